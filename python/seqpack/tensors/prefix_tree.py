"""Prefix-tree packing: rows that share a prefix are laid out once (issue 28, step 1).

GRPO samples every prompt many times and multi-turn rollouts branch from shared
histories; packed as independent rows, every shared prefix is forwarded G times.
:func:`pack_prefix_tree` builds the token trie of the rows (in C++, linear in the
tokens, GIL released) and lays its nodes out depth-first: the *physical* tokens.
The rows themselves are the *logical* tokens::

    rows (logical)        trie                    DFS order (physical)
    r0 = 5 6 7            5 ── 6 ──┬── 7          index        0  1  2  3  4  5
    r1 = 5 6 8 9                   └── 8 ── 9     input_ids    5  6  7  8  9  5
    r2 = 5 6                                      position_ids 0  1  2  2  3  0
    r3 = 5   (group 1)    5                       parent      -1  0  1  1  3 -1
                                                  subtree_end  5  5  3  5  5  6

The contract (all int64 NumPy arrays):

- ``input_ids`` / ``position_ids`` [T]: a token's position id is its depth, the
  position it has in every row through it.
- ``parent`` [T] (-1 for a root) and ``subtree_end`` [T]: key ``j`` is visible to
  query ``i`` exactly when ``j <= i < subtree_end[j]`` (``j`` is an ancestor of ``i``
  or ``i`` itself); the whole attention mask is these two arrays, and it is every
  row's causal mask mapped through ``logical_index``.
- ``logical_index`` [N]: for the rows concatenated in their given order, the physical
  index of each logical token (``input_ids[logical_index]`` is the concatenated
  rows); ``cu_seqlens`` [R + 1]: the rows' logical offsets.
- segments, the compressed form kernels want: maximal chains in which every node
  but the last has exactly one child and no row ends at it (a node starts a segment
  when it is a root, its parent branches, or a row ends at its parent), so each row
  is a root-to-leaf path of whole segments. ``segment_offsets`` [S + 1] index the
  physical order; ``segment_parent`` [S] is -1 for a root segment. Above:
  segments ``[0, 2) [2, 3) [3, 5) [5, 6)`` with parents ``-1 0 0 -1``.

Sharing. Rows share tokens only within a group (``group_ids``), and two rows ``r``
and ``s`` share exactly their first ``lcp(r, s)`` tokens (their longest common
prefix) when ``lcp(r, s) >= min_shared_tokens``, and nothing otherwise. This is
well defined and independent of the order of the rows. With ``min_shared_tokens=3``,
``1 2 3 4`` and ``1 2 3 5`` share ``1 2 3``, while ``1 2 7`` shares nothing with them;
a row shorter than ``min_shared_tokens`` is never shared, not even with a duplicate.
Exact duplicates, rows ending inside other rows, single-token and empty rows are
legal (an empty row has no tokens, physical or logical).

Padding. ``pad_to_multiple_of`` rounds ``T`` up with pad tokens (``pad_token_id``,
position 0) placed after the tree; each is its own root that sees only itself, and
no logical token maps to one.

    >>> tree = pack_prefix_tree([[5, 6, 7], [5, 6, 8, 9], [5, 6], [5]], group_ids=[0, 0, 0, 1])
    >>> tree.input_ids.tolist(), tree.parent.tolist(), tree.subtree_end.tolist()
    ([5, 6, 7, 8, 9, 5], [-1, 0, 1, 1, 3, -1], [5, 5, 3, 5, 5, 6])
    >>> tree.logical_index.tolist()
    [0, 1, 2, 0, 1, 3, 4, 0, 1, 5]
    >>> tree.metrics().token_ratio
    1.6666666666666667

Importing this module does not import torch; tensors are accepted where arrays are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Tuple

import numpy as np

from .. import _core
from .._lengths import _is_torch_tensor, as_int64, as_positive_int
from ..planning._token_rows import group_array, packed_rows, padded_rows, rows_flat
from .token_layout import TokenLayout

__all__ = ["PrefixTreeBatch", "PrefixTreeMetrics", "pack_prefix_tree"]

# The keyword that carries the tree through a transformers model to its attention.
HF_TREE_KWARG = "prefix_tree"
# attention_mask() is for tests and small cases: [T, T] bools past this are refused.
MAX_DENSE_MASK_TOKENS = 8192

_ARRAYS = ("input_ids", "position_ids", "parent", "subtree_end", "logical_index", "cu_seqlens", "segment_offsets",
           "segment_parent", "first_logical")


def _int64_array(value: Any, name: str) -> np.ndarray:
    """A fresh 1-D int64 copy of an integer array (tensors read on the host)."""
    if _is_torch_tensor(value):
        value = value.detach().cpu().numpy()
    arr = np.asarray(value)
    if arr.size and (arr.dtype == object or arr.dtype.kind not in "iu"):
        raise TypeError(f"{name} must hold integers, got {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype == np.uint64 and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} must fit in int64")
    return arr.astype(np.int64, copy=True)


def _build(tokens: np.ndarray, cu: np.ndarray, group_ids: Any, min_shared_tokens: Any, pad_to_multiple_of: Any,
           pad_token_id: Any, keys: Any = None) -> "PrefixTreeBatch":
    min_shared = as_positive_int(min_shared_tokens, "min_shared_tokens", allow_zero=True)
    multiple = as_positive_int(pad_to_multiple_of, "pad_to_multiple_of")
    pad = as_int64(pad_token_id, "pad_token_id")
    if keys is not None and keys.shape != tokens.shape:
        raise ValueError(f"keys must hold one key per token ({tokens.shape[0]} tokens), got {keys.shape[0]}")
    by = tokens if keys is None else keys
    arrays = _core.build_prefix_tree(by, cu, group_array(group_ids, cu.shape[0] - 1), min_shared, multiple, pad)
    num_pad = int(arrays.pop("num_pad_tokens"))
    if keys is not None:  # the trie of the keys; its tokens are the rows' ids, which shared keys must agree on
        ids = arrays["input_ids"]
        real = ids.shape[0] - num_pad
        ids[:real] = tokens[arrays["first_logical"][:real]]
        clash = np.flatnonzero(ids[arrays["logical_index"]] != tokens)
        if clash.size:
            raise ValueError(f"keys share logical token {int(clash[0])} with a token of another id "
                             f"({int(tokens[clash[0]])} vs {int(ids[arrays['logical_index'][clash[0]]])}): tokens "
                             f"with equal keys must have equal ids")
    return PrefixTreeBatch._trusted(arrays, num_pad)


def pack_prefix_tree(rows: Any, *, group_ids: Any = None, min_shared_tokens: Any = 1, pad_to_multiple_of: Any = 1,
                     pad_token_id: Any = 0, keys: Any = None) -> "PrefixTreeBatch":
    """The prefix tree of ``rows`` (a list of 1-D token sequences: lists, NumPy
    arrays or tensors of integers), as the module docstring describes.

    ``group_ids``: one integer per row; rows of different groups never share a token
    (e.g. one group per prompt of a GRPO batch). ``min_shared_tokens`` (>= 0; 0 acts
    as 1): two rows share their common prefix only when it is at least this long.
    ``pad_to_multiple_of``: the physical length is rounded up to a multiple of it
    with ``pad_token_id`` tokens, each its own root. ``keys``: rows of the same
    lengths whose equal prefixes are shared instead of the tokens' (a token's key
    tells what it stands for: the placeholder tokens of two different images have
    one id and two keys, :func:`seqpack.frameworks.hf_vlm.image_keys`); tokens
    sharing a key must have one id.

    >>> pack_prefix_tree([[1, 2, 3], [1, 2, 4]]).input_ids.tolist()
    [1, 2, 3, 4]
    >>> pack_prefix_tree([[9, 9, 3], [9, 9, 4]], keys=[[-1, -1, 3], [-2, -2, 4]]).input_ids.tolist()
    [9, 9, 3, 9, 9, 4]
    """
    tokens, cu = rows_flat(rows)
    return _build(tokens, cu, group_ids, min_shared_tokens, pad_to_multiple_of, pad_token_id,
                  None if keys is None else _keys_flat(rows_flat(keys), cu, "keys"))


def _keys_flat(flat: Tuple[np.ndarray, np.ndarray], cu: np.ndarray, name: str) -> np.ndarray:
    keys, key_cu = flat
    if not np.array_equal(key_cu, cu):
        raise ValueError(f"{name} must have the rows' lengths {np.diff(cu).tolist()}, got {np.diff(key_cu).tolist()}")
    return keys


class PrefixTreeBatch(TokenLayout):
    """A batch of rows packed as a prefix tree (see the module docstring for the
    layout): the :class:`~seqpack.tensors.token_layout.TokenLayout` of rows that
    share prefixes. Built by :func:`pack_prefix_tree`, :meth:`from_padded` or
    :meth:`from_packed`; holds read-only int64 NumPy arrays, compares by value,
    pickles and deep-copies through them (with the host plans built so far)."""

    __slots__ = ("_arrays", "_num_pad_tokens", "_plans")

    def __init__(self, *, input_ids: Any, position_ids: Any, parent: Any, subtree_end: Any, logical_index: Any,
                 cu_seqlens: Any, segment_offsets: Any, segment_parent: Any, first_logical: Any,
                 num_pad_tokens: int = 0) -> None:
        given = dict(input_ids=input_ids, position_ids=position_ids, parent=parent, subtree_end=subtree_end,
                     logical_index=logical_index, cu_seqlens=cu_seqlens, segment_offsets=segment_offsets,
                     segment_parent=segment_parent, first_logical=first_logical)
        arrays = {}
        for name in _ARRAYS:
            arr = _int64_array(given[name], name)
            arr.flags.writeable = False
            arrays[name] = arr
        num_pad = as_positive_int(num_pad_tokens, "num_pad_tokens", allow_zero=True)
        # The whole contract (depth-first order, subtree ends, depths, rows as root
        # paths, first occurrences, segments), checked in C++ in linear time: a tree
        # given by hand or rebuilt from a pickle is one build_prefix_tree could make.
        _core.check_prefix_tree(arrays, num_pad)
        self._init(arrays, num_pad)

    def _init(self, arrays: Dict[str, np.ndarray], num_pad_tokens: int) -> None:
        self._arrays = arrays
        self._num_pad_tokens = num_pad_tokens
        self._plans: Dict[Any, Any] = {}

    @classmethod
    def _trusted(cls, arrays: Dict[str, np.ndarray], num_pad_tokens: int) -> "PrefixTreeBatch":
        """A tree the C++ builder has just made (fresh int64 arrays): no second check."""
        self = object.__new__(cls)
        for arr in arrays.values():
            arr.flags.writeable = False
        self._init({name: arrays[name] for name in _ARRAYS}, int(num_pad_tokens))
        return self

    # ---- constructors -------------------------------------------------------------
    @classmethod
    def from_rows(cls, rows: Any, **options: Any) -> "PrefixTreeBatch":
        """:func:`pack_prefix_tree` (the same keyword options)."""
        return pack_prefix_tree(rows, **options)

    @classmethod
    def from_padded(cls, input_ids: Any, attention_mask: Any, *, group_ids: Any = None, min_shared_tokens: Any = 1,
                    pad_to_multiple_of: Any = 1, pad_token_id: Any = 0, keys: Any = None) -> "PrefixTreeBatch":
        """The tree of padded rows ``input_ids`` [B, S] whose real tokens are where
        ``attention_mask`` [B, S] (bool or 0/1 integers) is non-zero, in column order:
        left padding, right padding (as verl and NeMo-RL hold rollouts) or holes.
        ``keys`` [B, S]: see :func:`pack_prefix_tree`."""
        tokens, cu = padded_rows(input_ids, attention_mask)
        return _build(tokens, cu, group_ids, min_shared_tokens, pad_to_multiple_of, pad_token_id,
                      None if keys is None else _keys_flat(padded_rows(keys, attention_mask), cu, "keys"))

    @classmethod
    def from_packed(cls, input_ids: Any, cu_seqlens: Any, *, group_ids: Any = None, min_shared_tokens: Any = 1,
                    pad_to_multiple_of: Any = 1, pad_token_id: Any = 0, keys: Any = None) -> "PrefixTreeBatch":
        """The tree of rows packed back to back: ``input_ids`` [N] (or [1, N]) and
        ``cu_seqlens`` [R + 1] (starting at 0, non-decreasing, ending at N).
        ``keys`` [N]: see :func:`pack_prefix_tree`."""
        tokens, cu = packed_rows(input_ids, cu_seqlens)
        return _build(tokens, cu, group_ids, min_shared_tokens, pad_to_multiple_of, pad_token_id,
                      None if keys is None else _keys_flat(packed_rows(keys, cu), cu, "keys"))

    # ---- the layout ---------------------------------------------------------------
    input_ids = property(lambda self: self._arrays["input_ids"], doc="Physical token ids [T].")
    position_ids = property(lambda self: self._arrays["position_ids"], doc="Depth of each physical token [T].")
    parent = property(lambda self: self._arrays["parent"], doc="Parent's physical index [T] (-1: a root).")
    subtree_end = property(lambda self: self._arrays["subtree_end"],
                           doc="[T]: j is visible to i exactly when j <= i < subtree_end[j].")
    logical_index = property(lambda self: self._arrays["logical_index"],
                             doc="Physical index of each logical token of the concatenated rows [N].")
    cu_seqlens = property(lambda self: self._arrays["cu_seqlens"], doc="The rows' logical offsets [R + 1].")
    segment_offsets = property(lambda self: self._arrays["segment_offsets"],
                               doc="Segments' offsets into the physical order [S + 1].")
    segment_parent = property(lambda self: self._arrays["segment_parent"],
                              doc="Each segment's parent segment [S] (-1: a root segment).")
    first_logical = property(lambda self: self._arrays["first_logical"],
                             doc="Logical index of each physical token's first occurrence [T] (-1: a pad token).")

    @property
    def num_tokens(self) -> int:
        """Physical tokens T, pad tokens included."""
        return int(self._arrays["input_ids"].shape[0])

    @property
    def num_pad_tokens(self) -> int:
        return self._num_pad_tokens

    @property
    def num_logical_tokens(self) -> int:
        return int(self._arrays["logical_index"].shape[0])

    @property
    def num_rows(self) -> int:
        return int(self._arrays["cu_seqlens"].shape[0] - 1)

    @property
    def num_segments(self) -> int:
        return int(self._arrays["segment_parent"].shape[0])

    cp_size = property(lambda self: 1, doc="1: a tree holds the whole stream (cut into ranges when sharded).")
    cp_rank = property(lambda self: 0, doc="0 (see cp_size).")

    def rows(self) -> Any:
        """The plain packing of these physical tokens when no token is shared: each
        row's tokens back to back (in the physical order), each pad token an empty
        sequence padded to one row; ``None`` when rows share tokens.

        >>> pack_prefix_tree([[1, 2], [3]], pad_to_multiple_of=4).rows().cu_seqlens_padded.tolist()
        [0, 2, 3, 4]
        """
        return None if self.shares_tokens else self.host_plan("rows", _plain_rows)

    def select(self, *, rows: Any, tree: Any) -> Any:
        return tree

    def _first_occurrence(self) -> Tuple[np.ndarray, np.ndarray]:
        real = self.num_tokens - self._num_pad_tokens  # the real tokens come first, each read
        return np.arange(real, dtype=np.int64), self.first_logical[:real]

    def _plan_store(self) -> Dict[Any, Any]:
        return self._plans

    def attention_mask(self, max_tokens: int = MAX_DENSE_MASK_TOKENS) -> np.ndarray:
        """Dense bool [T, T]: ``mask[i, j]`` (query i, key j) is ``j <= i < subtree_end[j]``.
        For tests and small cases: above ``max_tokens`` physical tokens it is refused."""
        t = self.num_tokens
        limit = as_positive_int(max_tokens, "max_tokens", allow_zero=True)
        if t > limit:
            raise ValueError(f"attention_mask() builds a dense [T, T] mask; T = {t} is above max_tokens = {limit} "
                             "(use parent / subtree_end or the segments instead)")
        i = np.arange(t, dtype=np.int64)
        return (i[None, :] <= i[:, None]) & (i[:, None] < self.subtree_end[None, :])

    # ---- metrics ------------------------------------------------------------------
    def metrics(self) -> "PrefixTreeMetrics":
        """Logical vs physical tokens and attention pairs (:class:`PrefixTreeMetrics`)."""
        real = self.num_tokens - self._num_pad_tokens
        plain = sum(n * (n + 1) // 2 for n in self.seq_lens.tolist())
        tree = int((self.position_ids[:real] + 1).sum(dtype=np.int64)) if real else 0
        return PrefixTreeMetrics(num_rows=self.num_rows, logical_tokens=self.num_logical_tokens, physical_tokens=real,
                                 pad_tokens=self._num_pad_tokens, num_segments=self.num_segments,
                                 plain_attention_pairs=plain, tree_attention_pairs=tree)

    def row_weights(self) -> np.ndarray:
        """``[T]`` int64: how many logical rows hold each physical token (a shared
        prompt token: its group's size; a pad token: 0). What the rows count a token
        as, where a statistic over tokens must be the rows' (an MoE router's
        load-balancing loss and per-expert counts).

        >>> pack_prefix_tree([[1, 2, 3], [1, 2, 4]], pad_to_multiple_of=5).row_weights().tolist()
        [2, 2, 1, 1, 0]
        """
        def build(t: "PrefixTreeBatch") -> np.ndarray:
            out = np.bincount(t.logical_index, minlength=t.num_tokens).astype(np.int64)
            out.flags.writeable = False
            return out
        return self.host_plan("row_weights", build)

    def hf_kwargs(self, device: Any = None) -> Dict[str, Any]:
        """What a transformers model registered with
        ``seqpack.frameworks.hf.register_tree()`` takes for this tree:
        ``model(**tree.hf_kwargs())`` (``input_ids`` and ``position_ids`` ``[1, T]``
        int64 tensors on ``device``, the tree for the attention, and
        ``attention_mask`` ``[1, T]`` int64, its :meth:`row_weights`: the attention
        ignores it, and the losses transformers computes from it count each token
        once per row that holds it, as the rows do: an MoE model's load-balancing
        ``aux_loss``); the same as :func:`seqpack.frameworks.hf.tree_kwargs`. Imports torch.

        >>> tree = pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
        >>> kwargs = tree.hf_kwargs()
        >>> kwargs["input_ids"].tolist(), kwargs["position_ids"].tolist(), kwargs["attention_mask"].tolist()
        ([[1, 2, 3, 4]], [[0, 1, 2, 2]], [[2, 2, 1, 1]])
        """
        import torch

        ids = torch.tensor(self.input_ids, dtype=torch.long, device=device)[None]  # copies: the arrays are read-only
        pos = torch.tensor(self.position_ids, dtype=torch.long, device=device)[None]
        weights = torch.tensor(self.row_weights(), dtype=torch.long, device=device)[None]  # exact under any cast
        return {"input_ids": ids, "position_ids": pos, "attention_mask": weights, HF_TREE_KWARG: self}

    # ---- value semantics -----------------------------------------------------------
    def __eq__(self, other: object) -> Any:
        if not isinstance(other, PrefixTreeBatch):
            return NotImplemented
        return self._num_pad_tokens == other._num_pad_tokens and all(
            np.array_equal(self._arrays[k], other._arrays[k]) for k in _ARRAYS)

    __hash__ = None  # type: ignore[assignment]

    def _defining_arrays(self) -> Tuple[Any, ...]:
        """Every array of the tree (its token ids included: the log-prob plans read
        them) and its pad count."""
        return (self._num_pad_tokens, *(self._arrays[k] for k in _ARRAYS))

    def __reduce__(self):
        # The host plans built so far travel with the tree (a collate function in a
        # DataLoader worker builds them; the training loop then builds none).
        return (_rebuild, ({k: np.array(v) for k, v in self._arrays.items()}, self._num_pad_tokens,
                           self._pickled_plans()))

    def __repr__(self) -> str:
        return (f"PrefixTreeBatch(num_rows={self.num_rows}, num_logical_tokens={self.num_logical_tokens}, "
                f"num_tokens={self.num_tokens}, num_segments={self.num_segments}, "
                f"num_pad_tokens={self._num_pad_tokens})")


@dataclass(frozen=True)
class PrefixTreeMetrics:
    """What sharing saves. ``physical_tokens`` excludes pad tokens;
    ``plain_attention_pairs`` is the sum of L(L+1)/2 over the rows (causal pairs of
    the rows packed independently); ``tree_attention_pairs`` the visible pairs among
    the real physical tokens (the sum of depth + 1)."""

    num_rows: int
    logical_tokens: int
    physical_tokens: int
    pad_tokens: int
    num_segments: int
    plain_attention_pairs: int
    tree_attention_pairs: int

    @property
    def token_ratio(self) -> float:
        """logical / physical tokens: how many times fewer tokens every token-wise
        layer sees (1.0 when nothing is shared or the batch is empty)."""
        return self.logical_tokens / self.physical_tokens if self.physical_tokens else 1.0

    @property
    def attention_ratio(self) -> float:
        """plain / tree attention pairs (1.0 for an empty batch)."""
        return self.plain_attention_pairs / self.tree_attention_pairs if self.tree_attention_pairs else 1.0


def _plain_rows(tree: PrefixTreeBatch) -> Any:
    """:meth:`PrefixTreeBatch.rows` of a tree that shares no token."""
    from .layout import PackedLayout

    real = tree.num_tokens - tree.num_pad_tokens
    starts = np.sort(tree.logical_index[tree.cu_seqlens[:-1][tree.seq_lens > 0]])  # each non-empty row's first token
    cu = np.concatenate([starts, [real]]).astype(np.int64)
    pads = np.arange(real + 1, tree.num_tokens + 1, dtype=np.int64)
    return PackedLayout.from_offsets(np.concatenate([cu, np.full(pads.shape[0], real)]), np.concatenate([cu, pads]))


def _rebuild(arrays: Dict[str, np.ndarray], num_pad_tokens: int, plans: Any = None) -> PrefixTreeBatch:
    """A pickled tree: its arrays checked as any tree given from outside, then each
    plan checked against it."""
    tree = PrefixTreeBatch(**arrays, num_pad_tokens=num_pad_tokens)
    tree._adopt_plans(plans)
    return tree
