"""Imported by each verl worker through ``actor_rollout_ref.model.external_lib``:
patches the worker's engine with prefix trees and prefix reuse,
``seqpack.frameworks.verl.engine.patch(shared_prefix=True, prefix_reuse=True)`` (a
tree larger than ``ppo_max_token_len_per_gpu`` runs as passes, each shared prefix
forwarded and back-propagated once a step; :mod:`seqpack.frameworks.verl.prefix_reuse`).

    actor_rollout_ref:
      model:
        external_lib: seqpack.frameworks.verl.prefix_reuse_engine
"""

from .engine import patch

patch(shared_prefix=True, prefix_reuse=True)
