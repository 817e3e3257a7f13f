"""Attention over packed (THD) sequences: :func:`attention` takes any layout (see
:mod:`~seqpack.training.ops`); the implementations it dispatches to are here too:

- :func:`varlen_attention` (:mod:`~seqpack.training.attention_varlen`): the whole
  packed batch on one device, flash-attention's ``cu_seqlens`` convention, and its
  backends (:func:`attention_backends`);
- :func:`cp_attention` (:mod:`~seqpack.training.attention_cp`): zigzag context
  parallelism, K/V gathered over the CP group;
- :func:`ulysses_attention` (:mod:`~seqpack.training.attention_ulysses`): Ulysses
  sequence parallelism, two all-to-alls over the group;
- :func:`tree_attention` (:mod:`~seqpack.training.attention_tree`): a prefix tree
  (:class:`~seqpack.PrefixTreeBatch`), each token over its ancestors and itself, and
  its backends (:func:`tree_attention_backends`);
- :func:`tree_cp_attention` (:mod:`~seqpack.training.attention_tree_cp`): a prefix
  tree over CP ranks, contiguous ranges balanced by attention work.

::

    q, k, v rows [T, H, D]:   | a a a | b b | c c c c |      cu_seqlens = [0, 3, 5, 9]
                                sequences never see each other

    >>> from seqpack.training.attention import varlen_attention   # doctest: +SKIP
"""

from .attention_tree import tree_attention_backends
from .attention_tree_cp import tree_cp_attention
from .deprecated import cp_attention, tree_attention, ulysses_attention
from .attention_varlen import BACKENDS, MAX_SCORE_ELEMENTS, attention_backends
from .ops import attention, varlen_attention

__all__ = ["BACKENDS", "MAX_SCORE_ELEMENTS", "attention", "attention_backends", "cp_attention", "tree_attention",
           "tree_attention_backends", "tree_cp_attention", "ulysses_attention", "varlen_attention"]
