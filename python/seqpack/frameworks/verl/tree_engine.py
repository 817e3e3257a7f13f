"""Imported by each verl worker through ``actor_rollout_ref.model.external_lib``
(verl imports it when it builds the model's config, before the engines): patches
the worker's engine with prefix trees, ``seqpack.frameworks.verl.engine.patch(
shared_prefix=True)``.

    actor_rollout_ref:
      model:
        external_lib: seqpack.frameworks.verl.tree_engine
"""

from .engine import patch

patch(shared_prefix=True)
