"""The one layout of packed tokens: rows back to back, or a tree of shared prefixes.

A batch of rows becomes one stream of *physical* tokens ``[T, ...]`` that every
token-wise layer runs on. The rows themselves are the *logical* tokens ``[N]``. A
:class:`TokenLayout` says how the two relate, whatever the kind of packing::

    plain packing (PackedLayout): rows share nothing, each padded at its tail
    logical   a0 a1 a2 | b0 b1 b2 b3 b4 | c0
    physical  a0 a1 a2 p  b0 b1 b2 b3 b4 p p p  c0 p p p      T = 16, N = 9
    logical_index  [0 1 2, 4 5 6 7 8, 12]     position_ids 0 1 2 3 0 1 ... 7 0 1 2 3

    prefix tree (PrefixTreeBatch): rows share their common prefix, laid out once
    logical   5 6 7 | 5 6 8 9 | 5 6
    physical  5 6 7 8 9                                      T = 5,  N = 9
    logical_index  [0 1 2, 0 1 3 4, 0 1]      position_ids 0 1 2 2 3

A packed batch is the layout of rows that share nothing. Every layout owns:

- token counts: ``num_tokens`` (T, pad rows included), ``num_logical_tokens`` (N),
  ``num_rows`` (R) and ``num_pad_tokens``;
- the physical ``position_ids`` [T] (a token's position in every row through it);
- the logical order: ``cu_seqlens`` [R + 1] (the rows' logical offsets) and
  ``logical_index`` [N] (the physical row of each logical token); ``pad_index``
  (the physical rows no logical token reads);
- the context-parallel cut: :attr:`TokenLayout.cut` (a
  :class:`~seqpack.tensors.cp_cut.CpCut`: whole, or zigzag for rows laid out with
  ``cp_size > 1``; any other cut, a tree's contiguous ranges or Ulysses slices, from
  :func:`seqpack.shard_layout`) and :attr:`TokenLayout.whole`, the layout it cuts;
- the host plans derived from it (attention segments, log-prob targets, CP plans):
  :meth:`TokenLayout.host_plan` builds each once and keeps it on the object, it
  pickles with the layout (and is checked when rebuilt), and device copies are
  made once per device.

Consumers take a layout through one argument and never branch on its kind: which
implementation runs a (kind, cut) is one table, :mod:`seqpack.training.dispatch`
(a tree whose rows share nothing runs plain packing's kernels on
:meth:`TokenLayout.rows`, with no tree plan).

:func:`seqpack.tensors.layout_kinds.as_layout` turns what seqpack accepts in place
of a layout (a :class:`~seqpack.PackedBatch`, flash-attn style ``cu_seqlens``
offsets) into one; :mod:`~seqpack.tensors.layout_kinds` is the only module that
looks at what it was given.

    >>> from seqpack import PackedLayout, pack_prefix_tree
    >>> rows = PackedLayout.from_offsets([0, 3, 8])
    >>> rows.logical_index.tolist(), rows.rows() is rows
    ([0, 1, 2, 3, 4, 5, 6, 7], True)
    >>> tree = pack_prefix_tree([[5, 6, 7], [5, 6, 8, 9]])
    >>> tree.logical_index.tolist(), tree.rows() is None
    ([0, 1, 2, 0, 1, 3, 4], True)

Importing this module does not import torch.
"""

from __future__ import annotations

import abc
import hashlib
import warnings
from typing import Any, Callable, Dict, Optional, Tuple, TypeVar

import numpy as np

from .._lengths import _is_torch_tensor, type_name
from .cp_cut import CpCut

__all__ = ["TokenLayout"]

T = TypeVar("T")

_IDENTITY = "identity_digest"  # the host plan key of a layout's digest (TokenLayout._identity)


class TokenLayout(abc.ABC):
    """Where the logical tokens of a batch of rows sit in the physical stream the
    model runs on (see the module docstring). Implemented by
    :class:`~seqpack.PackedLayout` (rows that share nothing),
    :class:`~seqpack.PrefixTreeBatch` (rows that share prefixes), a cut of either
    (:class:`~seqpack.tensors.sharded_layout.ShardedLayout`) and a hybrid-CP
    micro-batch's composite of parts
    (:class:`~seqpack.tensors.parts_layout.PartsLayout`)."""

    __slots__ = ()

    # Attributes (fields or properties of each layout):
    cu_seqlens: np.ndarray  # [R + 1]: the rows' logical offsets (flash-attn's cu_seqlens)
    cp_size: int  # the context-parallel size the physical rows were laid out for
    cp_rank: int  # this rank's index in that split

    # ---- what every layout states ----------------------------------------------------
    @property
    @abc.abstractmethod
    def num_tokens(self) -> int:
        """Physical rows T of the full stream, pad rows included."""

    @property
    @abc.abstractmethod
    def num_logical_tokens(self) -> int:
        """Tokens of the rows, N (the sum of their lengths)."""

    @property
    @abc.abstractmethod
    def num_rows(self) -> int:
        """Rows R of the batch."""

    @property
    @abc.abstractmethod
    def logical_index(self) -> np.ndarray:
        """``[N]`` int64: the physical row of each logical token, rows in order."""

    @property
    @abc.abstractmethod
    def position_ids(self) -> np.ndarray:
        """``[T]`` int64: each physical token's position in the rows through it."""

    @abc.abstractmethod
    def rows(self) -> Optional[Any]:
        """The :class:`~seqpack.PackedLayout` of these physical tokens when no token
        is shared (plain packing's kernels run it as it is), else ``None``."""

    @abc.abstractmethod
    def select(self, *, rows: T, tree: T) -> T:
        """``rows`` for a layout of rows back to back (zigzag CP chunks), ``tree``
        for a prefix tree (contiguous CP ranges): the one choice between the
        implementations of an operation whose algorithm depends on the packing."""

    @abc.abstractmethod
    def _plan_store(self) -> Dict[Any, Any]:
        """The dict this layout keeps its host plans in."""

    # ---- derived, the same for every layout -------------------------------------------
    @property
    def cut(self) -> CpCut:
        """How the physical tokens are cut across context-parallel ranks
        (:class:`~seqpack.tensors.cp_cut.CpCut`): rows laid out for ``cp_size > 1``
        are cut in zigzag chunks; :func:`seqpack.shard_layout` gives any other cut."""
        return CpCut.of("zigzag", self.cp_size, self.cp_rank)

    @property
    def whole(self) -> "TokenLayout":
        """The layout this one's cut is of: itself, unless :func:`seqpack.shard_layout`
        made it."""
        return self

    @property
    def num_local_tokens(self) -> int:
        """The rows a model runs on for this layout: ``num_tokens`` for a whole layout
        (a cut or a pass of a split tree holds fewer)."""
        return self.num_tokens

    def predicted_tokens(self) -> Optional[np.ndarray]:
        """``[N]`` bool: the logical tokens whose next token this layout's rows
        predict, when that is not every one (a pass of a split tree: the rest are
        other passes'); None: all of them."""
        return None

    def for_layer(self, layer: Any) -> "TokenLayout":
        """This layout as the attention of layer ``layer`` (an int, or None) sees it:
        itself, unless the layout holds per-layer state (a pass of a split tree reads
        that layer's K/V of earlier passes; transformers' attention modules give their
        ``layer_idx``, so a layer recomputed by gradient checkpointing finds them)."""
        return self

    @property
    def seq_lens(self) -> np.ndarray:
        """``[R]`` logical length of each row."""
        return np.diff(np.asarray(self.cu_seqlens, dtype=np.int64))

    @property
    def num_pad_tokens(self) -> int:
        """Physical rows no logical token reads."""
        return int(self.pad_index.shape[0])

    @property
    def pad_index(self) -> np.ndarray:
        """``[P]`` int64, ascending: the physical rows no logical token reads."""
        return self.host_plan("pad_index", _pad_index)

    @property
    def shares_tokens(self) -> bool:
        """True when some physical token is read by more than one logical token."""
        return self.num_logical_tokens != self.num_tokens - self.num_pad_tokens

    def require_rows(self, op: str) -> Any:
        """:meth:`rows`, or a ``TypeError`` saying that ``op`` needs rows that share
        no token (this layout is a prefix tree whose rows share some)."""
        rows = self.rows()
        if rows is None:
            raise TypeError(f"this prefix tree's rows share tokens: {op} takes rows that share nothing; run the tree "
                            "with seqpack.attention / seqpack.token_logprobs")
        return rows

    def packed_seq_params(self, device: Any = "cpu") -> Any:
        """Megatron-Core's ``PackedSeqParams`` (THD) of the rows, when no token is
        shared (:meth:`rows`); a tree that shares tokens has none (Transformer
        Engine's THD attention masks rows, not trees: use
        :func:`seqpack.attention`)."""
        return self.require_rows("Megatron's THD PackedSeqParams (each token over its ancestors is no row mask)"
                                 ).packed_seq_params(device)

    # ---- host plans ------------------------------------------------------------------------
    def host_plan(self, key: Any, build: Callable[[Any], T]) -> T:
        """The host plan ``key`` of this layout, built by ``build(self)`` on first use
        and kept by the layout: every layer of a step, and every step that reuses the
        layout, reads the same plan. Plans pickle with the layout (those with a
        ``check_layout(layout)`` method are checked against it when rebuilt; others
        are left to be built again). ``key`` must be hashable and picklable.

        >>> from seqpack import pack_prefix_tree
        >>> tree = pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
        >>> tree.host_plan("sizes", lambda t: t.num_tokens)
        4
        """
        plans = self._plan_store()
        plan = plans.get(key)
        if plan is None:
            plan = build(self)  # two threads may both build it, harmlessly: one value wins
            plan = plans.setdefault(key, plan)
        return plan

    def planned(self) -> Tuple[Any, ...]:
        """The keys of the host plans this layout holds."""
        return tuple(k for k in self._plan_store() if k != _IDENTITY)

    def _defining_arrays(self) -> Tuple[Any, ...]:
        """What makes this layout the one it is (its plans depend on nothing else):
        the arrays and numbers its identity digest hashes. Layouts whose plans read
        more (a tree's token ids) add them."""
        return (self.num_tokens, self.cu_seqlens, self.logical_index, self.position_ids)

    def _identity(self) -> str:
        """A digest of :meth:`_defining_arrays` (BLAKE2b, kept as a host plan): a
        pickled plan carries its layout's, and is refused by any other layout."""
        def digest(layout: "TokenLayout") -> str:
            h = hashlib.blake2b(type(layout).__name__.encode(), digest_size=16)
            for part in layout._defining_arrays():
                arr = np.ascontiguousarray(np.asarray(part))
                h.update(str((arr.dtype.str, arr.shape)).encode())
                h.update(arr.tobytes())
            return h.hexdigest()
        return self.host_plan(_IDENTITY, digest)

    def _pickled_plans(self) -> Dict[Any, Any]:
        """The plans that travel in a pickle: those that can be checked when rebuilt,
        with the digest of the layout they were built for."""
        plans = {k: p for k, p in self._plan_store().items() if getattr(type(p), "check_layout", None) is not None}
        if plans:
            plans[_IDENTITY] = self._identity()
        return plans

    def _adopt_plans(self, plans: Any) -> None:
        """Plans from a pickle, each checked against this (already checked) layout:
        the digest of the layout they were built for must be this one's (a tree's
        plan on another tree of the same sizes reads the wrong tokens), and each
        plan's own ``check_layout`` (its indices within this layout) must pass."""
        if plans is None:
            return
        if not isinstance(plans, dict):
            raise TypeError(f"a pickled {type(self).__name__}'s plans must be a dict, got {type_name(plans)}")
        plans = dict(plans)
        built_for = plans.pop(_IDENTITY, None)
        for key, plan in plans.items():
            if getattr(type(plan), "check_layout", None) is None:
                raise TypeError(f"a pickled {type(self).__name__} holds a plan {key!r} of type {type_name(plan)} "
                                "that cannot be checked against it")
        if plans and built_for is None:  # an older seqpack's pickle: its plans are caches, built again here
            warnings.warn(f"a pickled {type(self).__name__}'s host plans carry no digest of the layout they were "
                          f"built for (an older seqpack's pickle): {sorted(map(str, plans))} are not adopted and "
                          "will be built again", UserWarning, stacklevel=3)
            return
        if plans and built_for != self._identity():
            raise ValueError(f"a pickled {type(self).__name__}'s host plans were built for another layout (its "
                             "digest differs from this one's): refused, they would read the wrong tokens")
        store = self._plan_store()
        for key, plan in plans.items():
            type(plan).check_layout(plan, self)
            store[key] = plan

    def _first_occurrence(self) -> Tuple[np.ndarray, np.ndarray]:
        """(physical rows read by a logical token, the logical token that reads each
        first), physical ascending."""
        physical, logical = np.unique(self.logical_index, return_index=True)
        return physical.astype(np.int64), logical.astype(np.int64)

    # ---- moving per-token values --------------------------------------------------------
    def to_logical(self, x: Any) -> Any:
        """Per-physical-token values ``x`` [T, ...] (array or tensor) in the logical
        layout [N, ...]: each logical token takes its physical token's value."""
        x = _rows_of(x)
        _check_rows(x, self.num_tokens, "num_tokens (T)")
        return x[_index_for(x, self.logical_index)]

    def to_physical(self, x: Any, fill: Any = 0) -> Any:
        """Per-logical-token values ``x`` [N, ...] (array or tensor) in the physical
        layout [T, ...]: each physical token takes the value of its *first* logical
        occurrence (rows in their given order); later occurrences are not read, so
        values that are a function of the prefix (ids, positions, hidden states of a
        causal model) round-trip exactly. Pad rows get ``fill``."""
        x = _rows_of(x)
        _check_rows(x, self.num_logical_tokens, "num_logical_tokens (N)")
        physical, logical = self.host_plan("first_occurrence", type(self)._first_occurrence)
        if _is_torch_tensor(x):
            out = x.new_full((self.num_tokens, *x.shape[1:]), fill)
            if physical.shape[0]:
                out = out.index_copy(0, _index_for(x, physical), x[_index_for(x, logical)])
            return out
        arr = np.asarray(x)
        out = np.full((self.num_tokens, *arr.shape[1:]), fill, dtype=arr.dtype)
        out[physical] = arr[logical]
        return out


def _pad_index(layout: TokenLayout) -> np.ndarray:
    read = np.zeros(layout.num_tokens, dtype=bool)
    read[layout.logical_index] = True
    return np.flatnonzero(~read).astype(np.int64)


def _rows_of(x: Any) -> Any:
    """A tensor as it is; anything else (a list, a tuple) as a NumPy array."""
    return x if _is_torch_tensor(x) or isinstance(x, np.ndarray) else np.asarray(x)


def _check_rows(x: Any, n: int, what: str) -> None:
    shape = tuple(getattr(x, "shape", ()))
    if len(shape) < 1 or shape[0] != n:
        raise ValueError(f"x must have {what} = {n} rows along dim 0, got shape {shape}")


def _index_for(x: Any, index: np.ndarray) -> Any:
    if _is_torch_tensor(x):
        import torch

        return torch.from_numpy(np.array(index, dtype=np.int64)).to(x.device)  # a copy: the plans are read-only
    return index
