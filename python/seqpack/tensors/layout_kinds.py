"""What seqpack accepts in place of a layout, and the one place that looks at kinds.

Consumers take a :class:`~seqpack.tensors.token_layout.TokenLayout` through one
argument; this module turns what users pass there into one and checks the few
arguments that must be a given kind (the tree plans read a tree's parents and
segments):

- :func:`as_layout`: a layout as it is, a :class:`~seqpack.PackedBatch` as its
  ``layout``, flash-attn style ``cu_seqlens`` (with Megatron's
  ``cu_seqlens_padded``) as a :class:`~seqpack.PackedLayout`;
- :func:`is_layout`: a layout (not offsets that could become one);
- :func:`as_tree`, :func:`as_packed_layout`: the argument, when of that kind, else a
  ``TypeError`` naming it;
- :func:`layout_kind`: what the dispatch table (:mod:`seqpack.training.dispatch`)
  keys an implementation by, with the layout's cut.

Outside the layout modules (this one, :mod:`~seqpack.tensors.token_layout`,
:mod:`~seqpack.tensors.cp_cut`, :mod:`~seqpack.tensors.sharded_layout`,
:mod:`~seqpack.tensors.parts_layout`) and the dispatch table
(:mod:`seqpack.training.dispatch`), no code branches on a layout's
kind (``tests/python/training/test_dispatch.py`` reads the source).

    >>> as_layout([0, 3, 5], cu_seqlens_padded=[0, 4, 6]).cu_seqlens_padded.tolist()
    [0, 4, 6]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._lengths import _is_torch_tensor, type_name
from .layout import PackedLayout, host_offsets
from .prefix_tree import PrefixTreeBatch
from .cp_cut import CpCut
from .token_layout import TokenLayout

__all__ = ["LAYOUT_KINDS", "as_layout", "as_packed_layout", "as_tree", "is_composite", "is_layout", "layout_cut", "layout_kind"]

# "rows": rows back to back; "tree": a prefix tree whose rows share tokens;
# "flat_tree": a tree whose rows share nothing (plain packing's kernels run it, its
# results stay in its logical order); "parts": a composite of layouts (hybrid CP, a PartsLayout);
# "tree_pass": one pass of a tree split under a cap, reading earlier passes' K/V (a TreePass).
LAYOUT_KINDS = ("rows", "tree", "flat_tree", "parts", "tree_pass")


def as_layout(value: Any, name: str = "layout", cu_seqlens_padded: Any = None) -> TokenLayout:
    """``value`` as a :class:`TokenLayout`: a layout as it is; a
    :class:`~seqpack.PackedBatch` (or anything with a ``layout``) as its layout; host
    offsets (flash-attn's ``cu_seqlens``, with Megatron's ``cu_seqlens_padded``) as
    :meth:`PackedLayout.from_offsets <seqpack.PackedLayout.from_offsets>`.
    """
    if isinstance(value, TokenLayout):
        if cu_seqlens_padded is not None:
            raise ValueError(f"give cu_seqlens_padded only with plain offsets, not with a {type(value).__name__} "
                             f"as {name}")
        return value
    held = getattr(value, "layout", None)
    if isinstance(held, TokenLayout):
        return as_layout(held, name, cu_seqlens_padded)
    if not _offsets_like(value):
        raise TypeError(f"{name} must be a layout (PrefixTreeBatch, PackedLayout, PackedBatch) or 1-D cu_seqlens "
                        f"offsets, got {type_name(value)}")
    cu = host_offsets(value, name)
    return PackedLayout.from_offsets(cu, None if cu_seqlens_padded is None else
                                     host_offsets(cu_seqlens_padded, "cu_seqlens_padded"))


def _offsets_like(value: Any) -> bool:
    """A 1-D array, tensor, list or tuple of numbers (not rows of tokens)."""
    if _is_torch_tensor(value) or isinstance(value, np.ndarray):
        return value.ndim == 1
    if not isinstance(value, (list, tuple)):
        return False
    return all(not hasattr(v, "__len__") for v in value)


def as_tree(value: Any, name: str = "tree") -> Any:
    """``value`` when it is a :class:`~seqpack.PrefixTreeBatch` (what the tree plans
    and tree kernels read: parents, subtree ends, segments), else a ``TypeError``."""
    if not isinstance(value, PrefixTreeBatch):
        raise TypeError(f"{name} must be a PrefixTreeBatch (seqpack.pack_prefix_tree), got {type_name(value)}")
    return value


def as_packed_layout(value: Any, name: str = "layout") -> Any:
    """``value`` when it is a :class:`~seqpack.PackedLayout`, else a ``TypeError``."""
    if not isinstance(value, PackedLayout):
        raise TypeError(f"{name} must be a PackedLayout, got {type_name(value)}")
    return value


def is_layout(value: Any) -> bool:
    """True for a :class:`TokenLayout` (not for offsets that could become one)."""
    return isinstance(value, TokenLayout)


def layout_kind(value: Any) -> str:
    """The kind of ``value``'s whole layout (one of :data:`LAYOUT_KINDS`): with its
    cut (``value.cut.kind``) the key of :mod:`seqpack.training.dispatch`'s table.

    >>> layout_kind([0, 3, 5]), layout_kind(PrefixTreeBatch.from_rows([[1, 2], [1, 3]]))
    ('rows', 'tree')
    """
    if _plain_offsets(value):  # rows' offsets, read where they are (device offsets stay there: no host sync)
        return "rows"
    layout = as_layout(value).whole
    if isinstance(layout, PrefixTreeBatch):  # kept by the tree: read once per layer otherwise
        return layout.host_plan("layout_kind", lambda t: "tree" if t.shares_tokens else "flat_tree")
    if isinstance(layout, PackedLayout):
        return "rows"
    composite = _composite_kind(layout)
    if composite is not None:  # a PartsLayout (tensors/parts_layout.py, which imports this module)
        return composite
    declared = getattr(type(layout), "declared_kind", None)
    if declared is not None:  # a TreePass (tensors/prefix_passes.py): a pass of a tree split under a cap
        return declared
    raise TypeError(f"no layout kind for {type_name(layout)}: a TokenLayout is a PackedLayout, a PrefixTreeBatch "
                    "or a cut of one (seqpack.shard_layout)")


def layout_cut(value: Any) -> Any:
    """The :class:`~seqpack.tensors.cp_cut.CpCut` of ``value`` (a composite's own)."""
    return CpCut.whole() if _plain_offsets(value) else as_layout(value).cut


def _plain_offsets(value: Any) -> bool:
    """Offsets (flash-attn's ``cu_seqlens``), not a layout nor a batch holding one."""
    return not isinstance(getattr(value, "layout", value), TokenLayout) and _offsets_like(value)


def is_composite(value: Any) -> bool:
    """True for a composite of layouts (a hybrid-CP micro-batch or its
    :class:`~seqpack.tensors.parts_layout.PartsLayout`)."""
    return _composite_kind(getattr(value, "layout", value)) is not None


def _composite_kind(layout: Any) -> Any:
    """A composite layout's kind (a PartsLayout: ``"parts"``), else None."""
    return getattr(type(layout), "composite_kind", None)
