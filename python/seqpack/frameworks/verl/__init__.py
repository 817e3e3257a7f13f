"""verl's names, seqpack's implementations (``seqpack.verl``, ``seqpack.integrations.verl``):

- :mod:`~seqpack.frameworks.verl.seqlen_balancing`: ``verl.utils.seqlen_balancing``'s
  dynamic micro-batching with a strict cap (``rearrange_micro_batches``,
  ``prepare_dynamic_batch`` / ``restore_dynamic_batch``, the partition helpers) and
  the legacy actor forward on a prefix tree;
- :mod:`~seqpack.frameworks.verl.engine`: verl 0.9.1's engine workers
  (``prepare_micro_batches`` of the engine's nested TensorDicts, ``tree_forward_step``
  in the engine's layout, ``patch()`` of its FSDP engine);
- :mod:`~seqpack.frameworks.verl.tree_engine`: the module a worker's ``external_lib``
  names to patch itself.

Importing this package does not import verl or torch.
"""

from .engine import prepare_micro_batches, tree_forward_step
from .seqlen_balancing import (ceildiv, get_group_balanced_partitions, get_reverse_idx, get_seqlen_balanced_partitions,
                               prepare_dynamic_batch, rearrange_micro_batches, restore_dynamic_batch,
                               roundup_divisible, tree_forward_micro_batch)

__all__ = ["ceildiv", "get_group_balanced_partitions", "get_reverse_idx", "get_seqlen_balanced_partitions",
           "prepare_dynamic_batch", "prepare_micro_batches", "rearrange_micro_batches", "restore_dynamic_batch",
           "roundup_divisible", "tree_forward_micro_batch", "tree_forward_step"]
