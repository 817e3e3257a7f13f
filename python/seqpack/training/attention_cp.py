"""Context-parallel attention on zigzag-sharded packed sequences.

Each CP rank holds two chunks of every (padded) sequence, chunk ``r`` and chunk
``2*cp - 1 - r``, so causal work is even across ranks. K and V are all-gathered
over the CP group; each local query chunk attends to its sequence's keys up to
the chunk's end (causal) through :func:`~seqpack.training.attention_varlen.varlen_attention`::

    one sequence, cp = 2, padded to a multiple of 2 * cp:  | c0 | c1 | c2 | c3 |
    rank 0 holds  c0 c3     queries c0 -> keys c0;           c3 -> keys c0..c3
    rank 1 holds  c1 c2     queries c1 -> keys c0 c1;        c2 -> keys c0..c2

dK and dV are reduce-scattered back by the gather's backward.

Example (one process; see docs/training.md for a CP group)::

    >>> out = cp_attention(q, k, v, packed_batch, cp_group)   # doctest: +SKIP
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Optional

import numpy as np

from .._lengths import as_positive_int
from ..tensors.layout import host_offsets
from ..tensors.layout_kinds import is_layout
from . import attention_inputs as inputs
from .attention_gathered import attend_gathered
from .varlen_backends import pick_backend

if TYPE_CHECKING:
    import torch

__all__ = ["cp_attention"]


def _cp_plan(cu_padded: np.ndarray, cp: int, rank: int, causal: bool) -> Dict[str, Any]:
    """Index plan of one CP rank: its two zigzag chunks per sequence as query
    segments, and for each the keys it may see (causal: the sequence up to the end
    of the chunk; else the whole sequence), as rows of the full THD."""
    lens = np.diff(cu_padded)
    if np.any(lens % (2 * cp)):
        raise ValueError(f"every padded length must be a multiple of 2 * cp_size = {2 * cp}, got {lens.tolist()[:8]}")
    chunk = lens // (2 * cp)
    q_lens = np.repeat(chunk, 2)
    first, second = (rank + 1) * chunk, (2 * cp - rank) * chunk
    k_lens = np.stack([first, second], 1).reshape(-1) if causal else np.repeat(lens, 2)
    starts = np.repeat(cu_padded[:-1], 2)
    k_index = np.repeat(starts - np.concatenate([[0], np.cumsum(k_lens)[:-1]]), k_lens) + np.arange(k_lens.sum())
    return dict(cu_q=np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32),
                cu_k=np.concatenate([[0], np.cumsum(k_lens)]).astype(np.int32),
                k_index=k_index.astype(np.int64), max_q=int(q_lens.max(initial=0)), max_k=int(k_lens.max(initial=0)))


def _cp_checks(q, k, v, packed_batch, size: int, me: int, causal: bool, softmax_scale, kv_heads_per_chunk,
               backend: str) -> Dict[str, Any]:
    """Every check of :func:`cp_attention` whose outcome can differ between ranks
    (the batch's offsets, CP size and rank, this rank's q/k/v, the arguments), run
    before its first collective and inside the agreement; returns what the call
    needs."""
    try:
        layout = getattr(packed_batch, "layout", None)  # a PackedBatch's host offsets; else one copy
        cu = layout.cu_seqlens_padded if layout is not None else packed_batch.cu_seqlens_padded
        cp, rank = int(packed_batch.cp_size), int(packed_batch.cp_rank)
    except AttributeError as exc:
        raise TypeError(f"packed_batch must be rows back to back with cu_seqlens_padded, cp_size and cp_rank (a "
                        f"PackedBatch or PackedLayout; a prefix tree's attention is causal: seqpack.attention on "
                        f"seqpack.shard_layout(tree, ...)): {exc}") from None
    if size != cp or me != rank:
        raise ValueError(f"group has size {size} and this rank is {me} in it; "
                         f"packed_batch was built for cp_size={cp}, cp_rank={rank}")
    cu_p = host_offsets(cu, "packed_batch.cu_seqlens_padded", copy_device=True)
    inputs.check_qkv(q, k, v, (-1, -1), causal)
    held = getattr(packed_batch, "layout", packed_batch)
    if is_layout(held) and held.cp_size == cp and held.cp_rank == rank:  # the layout keeps its rank's plan
        plan = held.host_plan(("zigzag_cp_attention", bool(causal)), lambda _: _cp_plan(cu_p, cp, rank, causal))
    else:
        plan = _cp_plan(cu_p, cp, rank, causal)
    local = int(cu_p[-1]) // cp
    if q.shape[0] != local or k.shape[0] != local:
        raise ValueError(f"q and k must hold this rank's {local} rows (cu_seqlens_padded[-1] / cp_size), "
                         f"got {q.shape[0]} and {k.shape[0]}")
    hk = k.shape[1]
    step = hk if kv_heads_per_chunk is None else as_positive_int(kv_heads_per_chunk, "kv_heads_per_chunk")
    scale = inputs.softmax_scale(softmax_scale, q)
    pick_backend(backend, q, (-1, 0 if causal else -1), causal)  # an unknown / unusable backend: before the gathers
    return dict(cu_p=cu_p, plan=plan, step=min(step, hk), scale=scale)


def _cp_fingerprint(checked: Dict[str, Any], q, k, v) -> Dict[str, Any]:
    """What every CP rank must share, as named facts: the offsets (the size and
    order of every gather), q's, k's and v's shapes and dtypes (the gathered
    tensors), whether each takes part in a backward (the gathers' reduce-scatters,
    the checkpointed re-gathers), the autocast state and the heads per gather (how
    many gathers)."""
    from .._dist import autocast_state, tensor_facts

    facts = tensor_facts(q, k, v)
    return {"cu_seqlens_padded": checked["cu_p"].astype(np.int64),
            "the shapes of q, k and v": facts["shape"], "the dtypes of q, k and v": facts["dtype"],
            "which of q, k and v require grad (with grad mode on)": facts["requires_grad"],
            "the autocast state": autocast_state(q.device.type), "kv_heads_per_chunk": checked["step"]}


def cp_attention(
    q: "torch.Tensor",
    k: "torch.Tensor",
    v: "torch.Tensor",
    packed_batch: Any,
    group: Any = None,
    *,
    causal: bool = True,
    softmax_scale: Optional[float] = None,
    kv_heads_per_chunk: Optional[int] = None,
    backend: str = "auto",
    agree: bool = True,
) -> "torch.Tensor":
    """Context-parallel attention on this rank's zigzag-local THD rows.

    Every CP rank holds rows ``[T / cp, H, D]`` of q, k and v in the layout of
    :func:`seqpack.pack_sequences` with ``cp_size`` (chunks ``r`` and
    ``2 cp - 1 - r`` of each sequence). K and V are all-gathered over ``group``
    (Llama-3 style all-gather CP), put back in sequence order, and each local query
    chunk attends to its sequence's keys up to its own last position (causal) with
    :func:`varlen_attention` - so the per-sequence causal offsets are exact. The
    backward sums dK/dV over the group and keeps this rank's rows (a
    reduce-scatter). ``kv_heads_per_chunk`` bounds memory: K/V are gathered for
    that many KV heads at a time and re-gathered in the backward
    (activation checkpointing) instead of being kept.

    Before the first gather every rank runs its checks (the group's size and its
    rank against the batch's ``cp_size``/``cp_rank``, the offsets and their
    ``2 cp`` multiple, q/k/v shapes, dtypes and this rank's row count, the
    arguments and backend), then one all-reduce over ``group`` tells every rank
    whether any failed: the failing rank raises its own error, the others a
    ``ValueError`` saying another rank failed, and none is left waiting in a
    gather. The same all-reduce compares a fingerprint of what must be the same
    everywhere (the offsets, q/k/v shapes and dtypes, which of them require grad
    with grad mode on, the autocast state, the heads per gather); a mismatch makes
    every rank raise, naming what differs. A process outside ``group`` (or without
    an initialised process group) raises at once: it cannot take part in any
    collective over ``group``. The backward's collectives need no check of their
    own: every rank that passed the forward agreed on which tensors need a
    gradient, so every rank runs the same ones.

    Args:
        q, k, v: local rows ``[T / cp, Hq, D]`` and ``[T / cp, Hk, D]``.
        packed_batch: the layout of these rows: a :class:`seqpack.PackedBatch` or
            :class:`~seqpack.PackedLayout` (its ``cu_seqlens_padded``, ``cp_size``
            and ``cp_rank`` are used), or any object with those three attributes;
            any other layout runs through :func:`seqpack.attention`.
        group: the CP process group (``torch.distributed``; default WORLD); its
            size and this rank's index must be the batch's ``cp_size``/``cp_rank``.
        agree: run the checks' all-reduce (default). It costs one small collective
            and, on NCCL, a host-device synchronisation per call (the CPU waits
            for the queued GPU work before reading the verdict). ``False`` skips
            it - say, for every layer after the first of a micro-batch, when the
            first layer agreed on the same ``packed_batch`` and the layers' q/k/v
            shapes cannot differ between ranks; a rank that then fails a check
            raises alone and the others wait in the gather.

    Returns:
        ``[T / cp, Hq, D]``, this rank's rows of the attention output.
    """
    import torch.distributed as dist

    from .._dist import checked_on_every_rank
    from ..tensors.cp import gather_cp

    q, k, v = inputs.follow_autocast(q, k, v)  # the gathers move the autocast dtype, as varlen_attention computes in it
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size < 1 or me < 0:
        raise ValueError(f"this process is not in the CP group (size {size}, rank {me}); it cannot take part in "
                         "cp_attention's collectives over it")
    checked = checked_on_every_rank(
        lambda: _cp_checks(q, k, v, packed_batch, size, me, causal, softmax_scale, kv_heads_per_chunk, backend),
        group, "cp_attention", agree and size > 1, fingerprint=lambda c: _cp_fingerprint(c, q, k, v))
    plan, step, scale = checked["plan"], checked["step"], checked["scale"]
    cu32 = checked["cu_p"].astype(np.int32)
    # Agreed above (the offsets, k's and v's shapes, dtypes and requires_grad).
    return attend_gathered(q, k, v, lambda t: gather_cp(t, cu32, group, agree=False), plan, causal=causal,
                           scale=scale, backend=backend, kv_heads_per_chunk=step)
