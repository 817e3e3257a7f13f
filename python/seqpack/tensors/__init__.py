"""Packed tensors: the THD layout and what moves tokens into and out of it.

- :mod:`~seqpack.tensors.token_layout`: :class:`TokenLayout`, the one layout of rows and
  trees (a packed batch is the layout of rows that share nothing);
  :mod:`~seqpack.tensors.layout_kinds`: what is accepted in place of a layout.
- :mod:`~seqpack.tensors.layout`: :class:`PackedLayout` (cu_seqlens, alignment, CP) and
  the one alignment rule.
- :mod:`~seqpack.tensors.thd`: pack/unpack between padded ``[B, S, ...]`` and packed
  ``[T, ...]`` tensors; :mod:`~seqpack.tensors.thd_static` the static-shape pack; both
  read the padded batch by :mod:`~seqpack.tensors.padded_batch`'s rules and return
  :mod:`~seqpack.tensors.packed_tensors` (named THD tensors and their offsets).
- :mod:`~seqpack.tensors.tree_plans`: the host plans a prefix tree carries.
- :mod:`~seqpack.tensors.cp`: context-parallel sharding (the 2·CP zigzag chunks).
- :mod:`~seqpack.tensors.sharded_layout`: :func:`~seqpack.shard_layout`, any layout cut for
  one CP rank (zigzag rows, a tree's ranges, Ulysses slices): what the training ops take.
- :mod:`~seqpack.tensors.dataset`: packing a tokenized dataset offline for SFT.
- :mod:`~seqpack.tensors.prefix_tree`: prefix-tree packing (shared prefixes laid out once).
- :mod:`~seqpack.tensors.prefix_tree_cp`: a prefix tree's CP shards (contiguous, balanced
  by attention work).

Importing this package does not import torch; the tensor functions do, when called.
"""

from .cp import cp_partition_indices, cp_restore_order
from .dataset import PackedDataset, collate_packs, pack_dataset
from .layout import PackedLayout, alignment, round_up
from .prefix_tree import PrefixTreeBatch, PrefixTreeMetrics, pack_prefix_tree
from .prefix_tree_cp import gather_tree_cp, tree_cp_bounds, tree_cp_local_rows
from .thd import PackedBatch, PackedSeqParams, pack_sequences, pack_to_layout, unpack_sequences
from .thd_static import StaticPackedBatch, pack_sequences_static
from .token_layout import TokenLayout

__all__ = [
    "PackedBatch", "PackedDataset", "PackedLayout", "PackedSeqParams", "PrefixTreeBatch", "PrefixTreeMetrics",
    "StaticPackedBatch", "TokenLayout", "alignment", "collate_packs", "cp_partition_indices", "cp_restore_order", "pack_dataset",
    "gather_tree_cp", "pack_prefix_tree", "pack_sequences", "pack_sequences_static", "pack_to_layout", "round_up",
    "tree_cp_bounds", "tree_cp_local_rows", "unpack_sequences",
]
