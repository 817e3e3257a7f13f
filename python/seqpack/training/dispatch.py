"""The one table from (layout kind, cut) to the implementation that runs it.

:func:`seqpack.attention`, :func:`seqpack.token_logprobs` and the loss wrapper
take any layout; which private implementation runs is decided here and nowhere
else (a test reads the source for kind switches outside this module and the
layout modules)::

    layout kind (tensors.layout_kinds)   cut (tensors.cp_cut)   attention            token log-probs
    rows       rows back to back          whole                  varlen               packed rows
                                          zigzag                 zigzag CP (gather)   packed rows (local)
                                          ulysses                Ulysses all-to-all   -
    flat_tree  a tree sharing nothing     whole                  varlen on its rows   packed rows -> logical
                                          ranges                 tree CP              tree (local)
                                          ulysses                Ulysses all-to-all   -
    tree       rows sharing prefixes      whole                  tree                 tree
                                          ranges                 tree CP              tree (local)
                                          ulysses                Ulysses all-to-all   -
    parts      hybrid CP micro-batch      composite              each part's own      each part's, concatenated
    tree_pass  a pass of a tree split     whole                  own tokens over      the tokens its own
               under a cap (TreePass)                            their paths, earlier tokens predict
                                                                 passes' K/V read

A pair without an entry raises a ``TypeError`` naming it. Adding a layout or a
parallel mode is one row here and one private implementation module.

    >>> sorted(ATTENTION)[:2]
    [('flat_tree', 'ranges'), ('flat_tree', 'ulysses')]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Tuple

from ..tensors.layout_kinds import as_layout, is_composite, is_layout, layout_cut, layout_kind

if TYPE_CHECKING:  # pragma: no cover
    from .logprobs import TokenLogprobs

__all__ = ["ATTENTION", "LOSS_ROUTE", "TOKEN_LOGPROBS", "dispatch_key", "loss_route", "lookup", "parts_token_logprobs"]

Key = Tuple[str, str]


def dispatch_key(layout: Any) -> Key:
    """``(layout kind, cut kind)`` of ``layout``: the key of the tables below."""
    return layout_kind(layout), layout_cut(layout).kind


def lookup(table: Dict[Key, Callable], layout: Any, op: str, group: Any = None) -> Callable:
    """The implementation of ``op`` for ``layout``, or a ``TypeError`` naming the pair.

    With a process ``group`` a rank whose lookup fails joins the agreement the other
    ranks' implementations open before their first collective (the same all-reduce),
    so every rank raises instead of waiting for it."""
    try:
        key = dispatch_key(layout)
        impl = table.get(key)
        if impl is None:
            have = ", ".join(f"{k}/{c}" for k, c in sorted(table))
            raise TypeError(f"{op} has no implementation for a {key[0]} layout with a {key[1]} cut (it runs: "
                            f"{have})")
    except (TypeError, ValueError) as exc:
        _fail_together(exc, group, op)
        raise
    return impl


def _fail_together(exc: BaseException, group: Any, op: str) -> None:
    """Raise ``exc`` after telling the other ranks of ``group`` (if any) that this
    rank failed, in the agreement their implementations run first."""
    if group is None:
        return
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    from .._dist import checked_on_every_rank

    def failed() -> None:
        raise exc

    checked_on_every_rank(failed, group, op, fingerprint=lambda _: {})


# ---- attention ------------------------------------------------------------------------
def _whole(group: Any, options: Dict[str, Any], what: str) -> Dict[str, Any]:
    """A whole layout's kernel options (it takes no group and gathers nothing)."""
    if group is not None:
        import torch.distributed as dist

        if dist.get_world_size(group) != 1:
            exc = ValueError(f"group has {dist.get_world_size(group)} ranks but the layout ({what}) is whole: cut "
                             "it for this rank with seqpack.shard_layout (or pack it with cp_size)")
            _fail_together(exc, group, "attention")
            raise exc
    if options["kv_heads_per_chunk"] is not None:
        raise ValueError("kv_heads_per_chunk bounds a CP gather of K/V: the layout is whole (nothing is gathered)")
    return dict(softmax_scale=options["softmax_scale"], backend=options["backend"])


def _rows_attention(q, k, v, layout, group, options):
    """Rows back to back: varlen."""
    from .attention_tree import rows_backend
    from .attention_varlen import varlen_attention

    options = _whole(group, options, "rows")
    rows = as_layout(layout).whole
    if q.dim() < 1 or k.dim() < 1 or q.shape[0] != rows.num_tokens or k.shape[0] != rows.num_tokens:
        raise ValueError(f"q, k and v must have one row per physical token of the layout ({rows.num_tokens}), got "
                         f"q {tuple(q.shape)} and k/v {tuple(k.shape)}")
    return varlen_attention(q, k, v, rows.cu_seqlens_padded, rows.cu_seqlens_padded, rows.max_seqlen_padded,
                            rows.max_seqlen_padded, causal=True, softmax_scale=options["softmax_scale"],
                            backend=rows_backend(options["backend"]))


def _flat_tree_attention(q, k, v, layout, group, options):
    from .attention_tree import flat_tree_attention

    return flat_tree_attention(q, k, v, as_layout(layout).whole, **_whole(group, options, "a prefix tree"))


def _tree_attention(q, k, v, layout, group, options):
    from .attention_tree import tree_attention

    return tree_attention(q, k, v, as_layout(layout).whole, **_whole(group, options, "a prefix tree"))


def _zigzag_attention(q, k, v, layout, group, options):
    from .attention_cp import cp_attention

    return cp_attention(q, k, v, as_layout(layout).whole, group, causal=True, **options)


def _tree_cp_attention(q, k, v, layout, group, options):
    import torch.distributed as dist

    from .attention_tree_cp import tree_cp_attention

    cut = layout.cut
    if dist.get_world_size(group) != cut.size or dist.get_rank(group) != cut.rank:
        raise ValueError(f"group has size {dist.get_world_size(group)} and this process is rank "
                         f"{dist.get_rank(group)} in it; the layout is cut for {cut}")
    return tree_cp_attention(q, k, v, layout.whole, group, **options)


def _ulysses(options: Dict[str, Any]) -> Dict[str, Any]:
    if options.pop("kv_heads_per_chunk") is not None:
        raise ValueError("kv_heads_per_chunk bounds a CP gather of K/V: Ulysses exchanges heads, it gathers none")
    return options


def _ulysses_attention(q, k, v, layout, group, options):
    """Rows (or a tree sharing nothing: its rows) in Ulysses slices."""
    from .attention_ulysses import ulysses_attention

    return ulysses_attention(q, k, v, layout.whole, group, **_ulysses(options))


def _tree_ulysses_attention(q, k, v, layout, group, options):
    from .attention_ulysses import tree_ulysses_attention

    return tree_ulysses_attention(q, k, v, layout.whole, group, **_ulysses(options))


def _parts_attention(q, k, v, batch, group, options):
    """A hybrid-CP micro-batch (or its PartsLayout): each part through this table
    with its own cut (whole rows or tree, zigzag rows, tree ranges) over its block's
    group."""
    if group is not None:
        raise ValueError("a hybrid-CP micro-batch finds each part's group itself (batch.block_group(part)): give "
                         "no group")
    composite = as_layout(batch)
    _check_part_rows(composite, q, "q")
    outs = []
    for part in composite.parts:
        layout = part.cut_layout
        rows = slice(part.start, part.end)
        outs.append(lookup(ATTENTION, layout, "attention")(q[rows], k[rows], v[rows], layout,
                                                            composite.block_group(part), dict(options)))
    if composite.num_local_pad_rows:  # a static shape's pad rows: no part reads them, nothing attends
        outs.append(q.new_zeros((composite.num_local_pad_rows, q.shape[1], v.shape[2])))
    if not outs:
        return q.new_empty((0, q.shape[1], v.shape[2]))
    import torch

    return torch.cat(outs) if len(outs) > 1 else outs[0]


def _check_part_rows(composite: Any, x: Any, name: str) -> None:
    if x.dim() < 1 or x.shape[0] != composite.num_local_tokens:
        raise ValueError(f"{name} must hold this rank's {composite.num_local_tokens} rows of the hybrid-CP micro-batch "
                         f"(every part's), got shape {tuple(x.shape)}")


def _tree_pass_attention(q, k, v, layout, group, options):
    from .attention_tree_pass import tree_pass_attention

    return tree_pass_attention(q, k, v, as_layout(layout), **_whole(group, options, "a pass of a prefix tree"))


ATTENTION: Dict[Key, Callable] = {
    ("rows", "whole"): _rows_attention,
    ("rows", "zigzag"): _zigzag_attention,
    ("rows", "ulysses"): _ulysses_attention,
    ("flat_tree", "whole"): _flat_tree_attention,
    ("flat_tree", "ranges"): _tree_cp_attention,
    ("flat_tree", "ulysses"): _ulysses_attention,
    ("tree", "whole"): _tree_attention,
    ("tree", "ranges"): _tree_cp_attention,
    ("tree", "ulysses"): _tree_ulysses_attention,
    ("parts", "composite"): _parts_attention,
    ("tree_pass", "whole"): _tree_pass_attention,
}


# ---- token log-probs --------------------------------------------------------------------
def _rows_logprobs(logits, layout, input_ids, options) -> "TokenLogprobs":
    from .logprobs import linear_token_logprobs, packed_token_logprobs

    if input_ids is None:
        raise ValueError("input_ids is required with rows back to back (the full packed ids [T], the next-token "
                         "targets); a prefix tree carries its own")
    rows = layout if not is_layout(getattr(layout, "layout", layout)) else as_layout(layout).whole  # offsets as given
    head = options.pop("head")
    if options.pop("scored") is not None:
        raise ValueError("scored selects a prefix tree's logical tokens: with rows, mask the ids with -100 instead")
    if head is None:
        options.pop("chunk_tokens")
        return packed_token_logprobs(logits, input_ids, rows, **options)
    weight, bias = head
    return linear_token_logprobs(logits, weight, input_ids, rows, bias=bias, **options)


def _tree_args(layout, input_ids, options) -> Tuple[Any, Dict[str, Any]]:
    if input_ids is not None:
        raise ValueError("input_ids is given by a prefix tree itself (its token ids): give none")
    for name in ("vocab_parallel_group", "vocab_start"):
        if options.pop(name) not in (None, 0):
            raise ValueError(f"{name} is not supported with a prefix tree (its logits hold the whole vocabulary)")
    options.pop("agree")
    cut = as_layout(layout).cut
    return as_layout(layout).whole, dict(options, cp_size=cut.size, cp_rank=cut.rank)


def _tree_logprobs(logits, layout, input_ids, options) -> "TokenLogprobs":
    from .logprobs_tree import tree_linear_token_logprobs, tree_token_logprobs

    tree, options = _tree_args(layout, input_ids, options)
    head = options.pop("head")
    if head is None:
        options.pop("chunk_tokens")
        return tree_token_logprobs(logits, tree, **options)
    weight, bias = head
    return tree_linear_token_logprobs(logits, weight, tree, bias=bias, **options)


def _flat_tree_logprobs(logits, layout, input_ids, options) -> "TokenLogprobs":
    from .logprobs_tree import rows_token_logprobs

    if options["scored"] is not None:  # the tree's targets plan skips the unscored rows
        return _tree_logprobs(logits, layout, input_ids, options)
    tree, options = _tree_args(layout, input_ids, options)
    head = options.pop("head") or (None, None)
    for name in ("scored", "cp_size", "cp_rank"):
        options.pop(name)
    return rows_token_logprobs(logits, tree, weight=head[0], bias=head[1], **options)


def parts_token_logprobs(logits: Any, batch: Any, options: Dict[str, Any]) -> list:
    """Each part's :class:`TokenLogprobs` of a hybrid-CP micro-batch, in part order: a
    packed part's at its rows here (with its full ids), a tree part's at its logical
    tokens. Summed over every rank and part, each token counts once."""
    composite = as_layout(batch)
    _check_part_rows(composite, logits, "logits")
    outs = []
    for part in composite.parts:
        layout = part.cut_layout
        outs.append(lookup(TOKEN_LOGPROBS, layout, "token_logprobs")(logits[part.start:part.end], layout,
                                                                      part.input_ids, dict(options)))
    return outs


def _parts_logprobs(logits, batch, input_ids, options) -> "TokenLogprobs":
    """:func:`parts_token_logprobs` back to back."""
    import torch

    from .logprobs import TokenLogprobs

    if input_ids is not None:
        raise ValueError("a hybrid-CP micro-batch carries each part's ids: give no input_ids")
    outs = parts_token_logprobs(logits, batch, options)
    if not outs:
        empty = logits.new_zeros((0,), dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
        return TokenLogprobs(empty, empty if options["return_entropy"] else None)
    entropy = torch.cat([o.entropy for o in outs]) if options["return_entropy"] else None
    return TokenLogprobs(torch.cat([o.logprobs for o in outs]), entropy)


def _tree_pass_logprobs(logits, layout, input_ids, options) -> "TokenLogprobs":
    """A pass's own rows: the logical tokens they predict (and ``scored`` keeps), 0
    elsewhere, so that the passes' results sum to the whole tree's."""
    import numpy as np

    from ..tensors.tree_plans import scored_targets

    layout = as_layout(layout)
    if logits.dim() != 2 or logits.shape[0] != layout.num_local_tokens:
        raise ValueError(f"logits must hold the pass's {layout.num_local_tokens} rows (mb.forward(model)'s output), "
                         f"got shape {tuple(logits.shape)}")
    mine = layout.predicted_tokens()
    scored = options.pop("scored")
    if scored is not None:
        if hasattr(scored, "detach"):
            scored = scored.detach().cpu().numpy()
        scored = np.asarray(scored)
        if scored.shape != mine.shape or scored.dtype != np.bool_:
            raise ValueError(f"scored must be a [N] bool array, one per logical token (N = {mine.shape[0]}), got "
                             f"{scored.dtype} {scored.shape}")
        mine = mine & scored
    from ..tensors._device import host_to_device

    def local_rows(pass_layout, wanted=mine):  # the pass's rows that predict a wanted token, on the logits' device
        rows = scored_targets(pass_layout.tree, wanted)[0]
        return host_to_device([np.searchsorted(pass_layout.own, rows)], logits.device)[0]  # no host sync

    local = local_rows(layout) if scored is not None else layout.host_plan(
        ("predicting_rows", str(logits.device)), local_rows)
    return _tree_logprobs(logits.index_select(0, local), layout.tree, input_ids, dict(options, scored=mine))


TOKEN_LOGPROBS: Dict[Key, Callable] = {
    ("rows", "whole"): _rows_logprobs,
    ("rows", "zigzag"): _rows_logprobs,
    ("flat_tree", "whole"): _flat_tree_logprobs,
    ("flat_tree", "ranges"): _tree_logprobs,
    ("tree", "whole"): _tree_logprobs,
    ("tree", "ranges"): _tree_logprobs,
    ("parts", "composite"): _parts_logprobs,
    ("tree_pass", "whole"): _tree_pass_logprobs,
}


# ---- the loss wrapper -------------------------------------------------------------------
# How SequencePackingLossWrapper runs a layout: per row (NeMo-RL's loop, or fused),
# in one pass over a tree's physical tokens, or per part of a hybrid-CP micro-batch.
LOSS_ROUTE: Dict[str, str] = {"rows": "rows", "flat_tree": "tree", "tree": "tree", "parts": "parts",
                              "tree_pass": "tree"}


def loss_route(value: Any) -> str:
    """``"rows"``, ``"tree"`` or ``"parts"``: how the loss wrapper runs ``value`` (a
    layout, a hybrid-CP micro-batch, or offsets: rows)."""
    if not (is_layout(getattr(value, "layout", value)) or is_composite(value)):
        return "rows"
    return LOSS_ROUTE[layout_kind(value)]
