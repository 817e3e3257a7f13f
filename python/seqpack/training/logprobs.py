"""Per-token log-probabilities on packed (THD) logits, fused: one pass over the
logits forward, one backward, no ``[T, V]`` intermediate.

::

    packed tokens   a0 a1 a2 p | b0 b1 p p        (p = padding)
    logprob[t]      lp(a1|a0) lp(a2|a1) 0 0 | lp(b1|b0) 0 0 0

Targets roll within each sequence (``input_ids[t + 1]``), never across a
boundary; each sequence's last real token and every padding row get 0 (and no
gradient). With context parallelism the logits are a rank's zigzag-local rows
and ``input_ids`` the full packed ids (their next tokens may sit on another
rank). With a vocabulary-parallel (TP) head, pass the group and each rank's
slice start: the per-row max and sums are combined with two all-reduces.

    >>> import torch, seqpack
    >>> logits = torch.zeros(6, 4)                        # uniform over 4 tokens
    >>> ids = torch.tensor([1, 2, 3, 0, 1, 0])
    >>> layout = seqpack.PackedLayout.from_offsets([0, 3, 5], [0, 4, 6])   # cu_seqlens, cu_seqlens_padded
    >>> out = seqpack.token_logprobs(logits, layout, ids)
    >>> out.logprobs.tolist(), out.entropy
    ([-1.3862943649291992, -1.3862943649291992, 0.0, 0.0, -1.3862943649291992, 0.0], None)

Masked vocabulary entries (``-inf`` logits) have probability 0 and get a zero
gradient; a NaN logit makes its row's results NaN (as ``log_softmax`` does); a
row whose logits are all ``-inf`` is NaN too. A target id outside the vocabulary
``[vocab_start, vocab_start + V)`` - above it or, with ``vocab_start > 0``, below it
- raises a ``ValueError`` when the ids are on the host and there is no
vocabulary-parallel group (the whole vocabulary is local), and gives NaN on a device
(no host read: the row is masked as not held, both bounds alike). With a group, ids
outside this rank's slice are the other ranks' (combined by the all-reduces); an
id no rank holds gives NaN. Negative ids mean "no target" everywhere.

With a vocabulary-parallel group, every rank checks its arguments and then one
all-reduce over the group tells every rank whether any failed, and compares what
the all-reduces need to be the same everywhere (rows, dtypes, which inputs require
grad, ...): a rank with other inputs makes every rank raise instead of waiting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, NamedTuple, Optional, Tuple

import numpy as np

from .._lengths import as_positive_int, as_temperature
from .._equality import values_equal
from ..tensors.cp import cp_row_positions
from ..tensors.layout import PackedLayout, check_offsets, reads_on_host
from ..tensors.layout_kinds import is_layout

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TokenLogprobs", "linear_token_logprobs", "next_token_sources", "next_token_targets",
           "packed_token_logprobs"]


class TokenLogprobs(NamedTuple):
    """The result of :func:`packed_token_logprobs`.

    Attributes:
        logprobs: ``[rows]`` log-probability of each row's next token (fp32; fp64
            for fp64 logits); 0 at padding and at each sequence's last real token.
        entropy: ``[rows]`` entropy of each row's distribution (0 where there is no
            target), or ``None`` when ``return_entropy=False``.
    """

    logprobs: "torch.Tensor"
    entropy: Optional["torch.Tensor"]

    def __eq__(self, other: object) -> bool:  # tensors element by element, not a tuple's truth values
        if not isinstance(other, TokenLogprobs):
            return NotImplemented
        return values_equal(self.logprobs, other.logprobs) and values_equal(self.entropy, other.entropy)

    def __ne__(self, other: object) -> bool:  # tuple's own __ne__ would compare the tensors' truth values
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # holds tensors


def _torch():
    import torch

    return torch


def _layout(cu_seqlens: Any, cu_seqlens_padded: Any, cp: int) -> PackedLayout:
    return PackedLayout.from_offsets(cu_seqlens, cu_seqlens_padded, cp_size=cp)


def next_token_targets(input_ids: "torch.Tensor", cu_seqlens: "torch.Tensor", cu_seqlens_padded: "torch.Tensor",
                       rows: int, cp_size: int = 1, cp_rank: int = 0) -> "torch.Tensor":
    """For every (local) packed row, the id of the token it predicts, or -1 (padding,
    a sequence's last real token, rows past the last sequence). PyTorch ops only,
    on the offsets' device: no host read, traceable by ``torch.compile`` and
    capturable in a CUDA graph. Offsets are trusted (validate them on the host
    first); every index is clamped, so bad offsets give wrong ids, never an
    out-of-bounds read.

    >>> import torch
    >>> ids = torch.tensor([10, 11, 12, 0, 20, 21])
    >>> next_token_targets(ids, torch.tensor([0, 3, 5]), torch.tensor([0, 4, 6]), rows=6).tolist()
    [11, 12, -1, -1, 21, -1]
    """
    torch = _torch()
    from ..tensors._device import check_tensor, to_device

    device = check_tensor(input_ids, "input_ids").device
    cu = to_device(check_tensor(cu_seqlens, "cu_seqlens"), device).to(torch.int64)
    cu_p = to_device(check_tensor(cu_seqlens_padded, "cu_seqlens_padded"), device).to(torch.int64)
    if cu_p.shape[0] <= 1 or input_ids.shape[0] == 0:
        return torch.full((rows,), -1, dtype=torch.int64, device=device)
    seq, pos = cp_row_positions(cu_p, rows, cp_size, cp_rank)
    valid = (pos >= 0) & (pos + 1 < cu[seq + 1] - cu[seq])
    src = (cu_p[seq] + pos + 1).clamp(0, input_ids.shape[0] - 1)
    return torch.where(valid, input_ids[src].to(torch.int64), -1)


def next_token_sources(cu_seqlens: Any, cu_seqlens_padded: Any = None, cp_size: int = 1,
                       cp_rank: int = 0) -> np.ndarray:
    """For every (local) packed row, the packed position of the token it predicts,
    or -1 (padding, a sequence's last real token). From host offsets; the same rule
    as :func:`next_token_targets` (which it runs on the positions themselves).

    >>> next_token_sources([0, 3, 5], [0, 4, 6]).tolist()
    [1, 2, -1, -1, 5, -1]
    """
    torch = _torch()
    cp = as_positive_int(cp_size, "cp_size")
    layout = _layout(cu_seqlens, cu_seqlens_padded, cp)
    total = layout.num_tokens
    cu, padded = layout._offsets_on("cpu")
    cp_rank = as_positive_int(cp_rank, "cp_rank", allow_zero=True)
    return next_token_targets(torch.arange(total), cu, padded, total // cp, cp, cp_rank).numpy()


def _offsets_on(device, cu_seqlens: Any, cu_seqlens_padded: Any, cp: int, rows: int, ids_len: int):
    """(cu_seqlens, cu_seqlens_padded) as tensors on ``device``: host offsets are
    validated against the shapes and copied with one pinned non-blocking copy;
    device offsets are used as they are (not read back)."""
    if is_layout(cu_seqlens):
        return _sized(cu_seqlens, rows, ids_len)._offsets_on(device)  # read only by the kernels
    if cu_seqlens_padded is None:
        cu_seqlens_padded = cu_seqlens
    if reads_on_host(cu_seqlens) and reads_on_host(cu_seqlens_padded):  # validated once, by the layout
        return _sized(_layout(cu_seqlens, cu_seqlens_padded, cp), rows, ids_len)._offsets_on(device)
    cu, padded = check_offsets(cu_seqlens, "cu_seqlens"), check_offsets(cu_seqlens_padded, "cu_seqlens_padded")
    if isinstance(cu, np.ndarray) or isinstance(padded, np.ndarray):
        raise TypeError("cu_seqlens and cu_seqlens_padded must both be device tensors or both host offsets")
    return cu, padded


def _rows_layout(cu_seqlens: Any) -> Any:
    """Offsets as they are; a layout (a PackedBatch's included) as the plain packing of
    its rows. A tree whose rows share tokens is refused: a shared token predicts one
    token per child, one row of logits cannot hold them."""
    layout = getattr(cu_seqlens, "layout", cu_seqlens)
    if not is_layout(layout):
        return cu_seqlens
    return layout.require_rows("packed log-probs (a shared token has one target per child)")


def _sized(layout: PackedLayout, rows: int, ids_len: int) -> PackedLayout:
    """``layout`` after checking it against the logits' rows and the ids' length."""
    if rows != layout.local_tokens:
        cp = layout.cp_size
        raise ValueError(f"logits has {rows} rows; the packed layout has {layout.local_tokens} "
                         f"(cu_seqlens_padded[-1] = {layout.num_tokens}{f', cp_size = {cp}' if cp > 1 else ''})")
    if ids_len != layout.num_tokens:
        raise ValueError(f"input_ids must hold the full packed ids [{layout.num_tokens}], got {ids_len}")
    return layout


def _check_target_ids(input_ids: "torch.Tensor", vocab_start: int, vocab: int) -> None:
    """Ids a host can read without a device sync, with the whole vocabulary
    ``[vocab_start, vocab_start + vocab)`` local: every id must index it, or be
    negative ("no target"). Device ids (and ids under ``torch.compile``) are not
    read: an id outside the vocabulary gives its row NaN there."""
    torch = _torch()
    if input_ids.device.type != "cpu" or torch.compiler.is_compiling() or input_ids.numel() == 0:
        return
    end = vocab_start + vocab
    if vocab_start == 0 and int(input_ids.max()) < end:  # the common case: one pass, no temporaries
        return
    bad = (input_ids >= end) | ((input_ids >= 0) & (input_ids < vocab_start))
    if bool(bad.any()):
        pos = int(torch.argmax(bad.to(torch.uint8)))
        value = int(input_ids[pos])
        if vocab_start == 0:
            raise ValueError(f"input_ids holds id {value} (first out-of-range id at packed position {pos}); the "
                             f"vocabulary has {vocab} entries (logits.shape[1]); ids must be < {vocab}, or negative "
                             "for no target")
        raise ValueError(f"input_ids holds id {value} (first out-of-range id at packed position {pos}); with "
                         f"vocab_start = {vocab_start} and no vocab_parallel_group the vocabulary is ids "
                         f"[{vocab_start}, {end}) ({vocab} entries); ids must be in [vocab_start, vocab_start + V) "
                         f"= [{vocab_start}, {end}), or negative for no target")


def _agreed(plan: Callable[[], Tuple[Callable[[], Any], Dict[str, Any]]], group: Any, agree: Any,
            what: str) -> Callable[[], Any]:
    """``plan()`` (every check of a log-prob call; gives the call and what its
    collectives need to be the same on every rank), inside one agreement over the
    vocabulary-parallel ``group`` when there is one; returns the call."""
    from .._dist import checked_on_every_rank, groups_of

    groups = [] if group is None else groups_of(group)
    run, _ = checked_on_every_rank(plan, groups, what, bool(agree) and bool(groups), fingerprint=lambda p: p[1])
    return run


def packed_token_logprobs(
    logits: "torch.Tensor",
    input_ids: "torch.Tensor",
    cu_seqlens: Any,
    cu_seqlens_padded: Any = None,
    *,
    cp_size: int = 1,
    cp_rank: int = 0,
    return_entropy: bool = False,
    temperature: float = 1.0,
    vocab_parallel_group=None,
    vocab_start: int = 0,
    num_threads: int = 0,
    agree: bool = True,
) -> TokenLogprobs:
    """Log-probability of each packed token's next token, fused and differentiable.

    Args:
        logits: ``[T, V]`` (fp32, bf16, fp16; fp64 for ``gradcheck``) for the packed
            rows; with CP this rank's ``T / cp_size`` zigzag-local rows; with a
            vocabulary-parallel head the local vocabulary slice ``[T, V / TP]``.
        input_ids: the full packed ids ``[T]`` (also under CP). An id < 0 (e.g.
            -100) as a target means "no target": log-prob 0, entropy 0, no gradient.
        cu_seqlens: real cumulative lengths ``[B + 1]``; cu_seqlens_padded: padded
            cumulative lengths (the THD offsets), default ``cu_seqlens``. Any form of
            :func:`seqpack.tensors.layout.check_offsets` (lists, int32/int64 arrays
            and tensors: the rule of the whole API). Host offsets are validated;
            device tensors are used without a host read (static shapes, CUDA graphs:
            see :func:`seqpack.pack_sequences_static`). Or a
            :class:`~seqpack.PackedLayout` (e.g. ``packed_batch.layout``), which also
            gives ``cu_seqlens_padded``, ``cp_size`` and ``cp_rank``.
        cp_size / cp_rank: context parallelism of ``logits``.
        return_entropy: also compute the per-token entropy.
        temperature: logits are divided by it first (positive, finite).
        vocab_parallel_group / vocab_start: tensor-parallel vocabulary: the group
            over which the slices are combined and this rank's first vocabulary id.
            Without a group the logits hold the whole vocabulary, ids
            ``[vocab_start, vocab_start + V)``: host ids outside it raise.
        num_threads: CPU threads (0: all the process may use).
        agree: with ``vocab_parallel_group``, run every check inside one
            all-reduce over the group first (default): a rank whose arguments fail
            makes every rank raise, and so do ranks that disagree on the logits'
            rows, dtype or ``requires_grad``, the ids' shape, the offsets or the
            autocast state. ``False`` skips that collective (the caller agreed).

    Returns:
        :class:`TokenLogprobs` ``(logprobs, entropy)``; ``entropy`` is ``None``
        unless asked for. The backward writes ``d/d logits`` directly (softmax
        minus one-hot, scaled), in the logits' dtype; it is never ``[T, V]`` extra.
    """
    run = _agreed(lambda: packed_plan(logits, input_ids, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank,
                                       return_entropy, temperature, vocab_parallel_group, vocab_start, num_threads),
                  vocab_parallel_group, agree, "packed_token_logprobs")
    return run()


def packed_plan(logits, input_ids, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, return_entropy, temperature,
                 vocab_parallel_group, vocab_start, num_threads) -> Tuple[Callable[[], TokenLogprobs], Dict[str, Any]]:
    """Every check of :func:`packed_token_logprobs`; returns the call, and what its
    all-reduces (with a vocabulary-parallel group) need every rank to share."""
    torch = _torch()
    from . import _logprob_ops as ops

    check_logits(logits)
    vocab_start, num_threads = _int_args(vocab_start, num_threads)
    targets, layout = _targets(logits.shape[0], logits.device, logits.shape[1], input_ids, cu_seqlens,
                               cu_seqlens_padded, cp_size, cp_rank, temperature, vocab_parallel_group, vocab_start)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    args = (logits, targets, vocab_start, as_temperature(temperature), bool(return_entropy), num_threads)

    def run() -> TokenLogprobs:
        if vocab_parallel_group is None:
            lp, ent, _, _ = torch.ops.seqpack.token_logprobs(*args)
        else:
            lp, ent, _, _ = ops.VocabParallelTokenLogprobs.apply(*args, vocab_parallel_group)
        return TokenLogprobs(lp, ent if return_entropy else None)

    from .._dist import autocast_state, grad_on

    # The vocabulary slices may differ in width (vocab_start says where each starts).
    return run, {"the rows of logits": int(logits.shape[0]), "the dtype of logits": str(logits.dtype),
                 "whether logits requires grad (with grad mode on)": grad_on(logits),
                 "the shape of input_ids": tuple(input_ids.shape), "the packed layout": layout,
                 "the autocast state": autocast_state(logits.device.type)}


def _int_args(vocab_start: Any, num_threads: Any):
    """``(vocab_start, num_threads)`` as ints >= 0 (0 threads: automatic)."""
    return (as_positive_int(vocab_start, "vocab_start", allow_zero=True),
            as_positive_int(num_threads, "num_threads", allow_zero=True))


def _targets(rows: int, device, vocab: int, input_ids: Any, cu_seqlens: Any, cu_seqlens_padded: Any, cp_size: Any,
             cp_rank: Any, temperature: Any, vocab_parallel_group, vocab_start: int):
    """The shared argument rules of the log-prob functions (``vocab_start`` checked
    by :func:`_int_args`); returns each local row's target id (-1: none) on
    ``device``, and what the ranks of a vocabulary-parallel group must share about
    the layout (the CP size and the host offsets; device offsets by their shapes)."""
    torch = _torch()
    from ..tensors._device import check_tensor

    if check_tensor(input_ids, "input_ids").dim() != 1:
        raise ValueError(f"input_ids must be the 1-D packed token ids [T], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    as_temperature(temperature)  # a normal float32: what the kernels receive is always valid
    cu_seqlens = _rows_layout(cu_seqlens)
    if is_layout(cu_seqlens):  # the layout carries the offsets and the CP split
        if cu_seqlens_padded is not None:
            raise ValueError("give cu_seqlens_padded only with plain offsets, not with a PackedLayout")
        cp_size, cp_rank = cu_seqlens.cp_size, cu_seqlens.cp_rank
    cp = as_positive_int(cp_size, "cp_size")
    cp_rank = as_positive_int(cp_rank, "cp_rank", allow_zero=True)
    if cp_rank >= cp:
        raise ValueError(f"cp_rank must be in [0, cp_size = {cp}), got {cp_rank}")
    cu, cu_p = _offsets_on(device, cu_seqlens, cu_seqlens_padded, cp, rows, input_ids.shape[0])
    if vocab_parallel_group is None:
        _check_target_ids(input_ids, vocab_start, vocab)
    from ..tensors._device import to_device

    layout = None
    if vocab_parallel_group is not None:  # facts for the agreement: host offsets by value, device ones by shape
        if is_layout(cu_seqlens):
            layout = (cp, cu_seqlens.cu_seqlens.astype(np.int64), cu_seqlens.cu_seqlens_padded.astype(np.int64))
        else:
            given = (cu_seqlens, cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded)
            layout = (cp,) + tuple(np.asarray(check_offsets(c), dtype=np.int64) if reads_on_host(c) else
                                   tuple(c.shape) for c in given)
    return next_token_targets(to_device(input_ids, device), cu, cu_p, rows, cp, cp_rank), layout


def linear_token_logprobs(
    hidden: "torch.Tensor",
    weight: "torch.Tensor",
    input_ids: "torch.Tensor",
    cu_seqlens: Any,
    cu_seqlens_padded: Any = None,
    *,
    bias: Optional["torch.Tensor"] = None,
    cp_size: int = 1,
    cp_rank: int = 0,
    return_entropy: bool = False,
    temperature: float = 1.0,
    vocab_parallel_group=None,
    vocab_start: int = 0,
    chunk_tokens: Optional[int] = None,
    reduce_hidden_grad: bool = True,
    num_threads: int = 0,
    agree: bool = True,
) -> TokenLogprobs:
    """:func:`packed_token_logprobs` of ``hidden @ weight.T + bias`` without ever
    holding the ``[T, V]`` logits: the LM head and the log-probs fused, a chunk of
    ``chunk_tokens`` rows at a time, forward and backward.

    The forward computes each chunk's logits (PyTorch's matmul: BLAS, cuBLAS), reduces
    them to four numbers per row with seqpack's kernels and drops them; the backward
    recomputes each chunk's logits, writes their gradient with seqpack's kernels and
    turns it into ``grad_hidden`` (``grad @ weight``) and ``grad_weight`` /
    ``grad_bias`` (accumulated over chunks in fp32 for bf16 / fp16). At most one
    chunk of logits and one of their gradient exist at a time.

    Args:
        hidden: ``[T, H]`` final hidden states of the packed tokens (CP-local rows
            under context parallelism), float32 / bfloat16 / float16 / float64.
        weight: ``[V, H]`` the LM head (this rank's vocabulary slice under
            tensor parallelism), same dtype and device; bias: ``[V]`` or None.
        input_ids, cu_seqlens, cu_seqlens_padded, cp_size, cp_rank, return_entropy,
            temperature, vocab_parallel_group, vocab_start, num_threads, agree: as
            :func:`packed_token_logprobs` (the agreement also compares hidden's
            shape, the dtypes and ``requires_grad`` of hidden, weight and bias,
            and ``reduce_hidden_grad``: the backward's all-reduce).
        chunk_tokens: rows of logits per chunk (default: about 2^24 logits, e.g. 110
            rows at V = 152k; 2^26 on CUDA); 1 to T.
        reduce_hidden_grad: with ``vocab_parallel_group``, all-reduce ``grad_hidden``
            over the group (every slice of the head contributes to every row). Turn it
            off when ``hidden`` already went through Megatron's
            ``copy_to_tensor_model_parallel_region``, whose backward does it.

    >>> import torch, seqpack
    >>> hidden, head = torch.zeros(6, 8), torch.zeros(4, 8)      # uniform over 4 tokens
    >>> ids = torch.tensor([1, 2, 3, 0, 1, 0])
    >>> layout = seqpack.PackedLayout.from_offsets([0, 3, 5], [0, 4, 6])
    >>> seqpack.token_logprobs(hidden, layout, ids, weight=head).logprobs.tolist()
    [-1.3862943649291992, -1.3862943649291992, 0.0, 0.0, -1.3862943649291992, 0.0]
    """
    run = _agreed(lambda: linear_plan(hidden, weight, input_ids, cu_seqlens, cu_seqlens_padded, bias, cp_size,
                                       cp_rank, return_entropy, temperature, vocab_parallel_group, vocab_start,
                                       chunk_tokens, reduce_hidden_grad, num_threads),
                  vocab_parallel_group, agree, "linear_token_logprobs")
    return run()


def linear_plan(hidden, weight, input_ids, cu_seqlens, cu_seqlens_padded, bias, cp_size, cp_rank, return_entropy,
                 temperature, vocab_parallel_group, vocab_start, chunk_tokens, reduce_hidden_grad,
                 num_threads) -> Tuple[Callable[[], TokenLogprobs], Dict[str, Any]]:
    """Every check of :func:`linear_token_logprobs`; returns the call, and what its
    all-reduces (with a vocabulary-parallel group) need every rank to share."""
    from . import _logprob_ops as ops

    check_head(hidden, weight, bias)
    chunk = 0 if chunk_tokens is None else as_positive_int(chunk_tokens, "chunk_tokens")
    vocab_start, num_threads = _int_args(vocab_start, num_threads)
    targets, layout = _targets(hidden.shape[0], hidden.device, weight.shape[0], input_ids, cu_seqlens,
                               cu_seqlens_padded, cp_size, cp_rank, temperature, vocab_parallel_group, vocab_start)
    chunk = ops.chunk_rows(chunk, hidden.shape[0], weight.shape[0], hidden.is_cuda)
    args = (hidden, weight, bias, targets, vocab_start, as_temperature(temperature), bool(return_entropy), num_threads,
            chunk)

    def run() -> TokenLogprobs:
        torch = _torch()
        if vocab_parallel_group is None:
            lp, ent, _, _ = torch.ops.seqpack.linear_token_logprobs(*args)
        else:
            lp, ent, _, _ = ops.VocabParallelLinearTokenLogprobs.apply(*args, vocab_parallel_group,
                                                                       bool(reduce_hidden_grad))
        return TokenLogprobs(lp, ent if return_entropy else None)

    from .._dist import autocast_state, tensor_facts

    facts = tensor_facts(hidden, weight, bias)
    # The head's vocabulary slices may differ in width (vocab_start says where each starts).
    return run, {"the shape of hidden": facts["shape"][0], "the dtypes of hidden, weight and bias": facts["dtype"],
                 "which of hidden, weight and bias require grad (with grad mode on)": facts["requires_grad"],
                 "reduce_hidden_grad": bool(reduce_hidden_grad), "the shape of input_ids": tuple(input_ids.shape),
                 "the packed layout": layout, "the autocast state": autocast_state(hidden.device.type)}


def check_logits(logits: "torch.Tensor") -> None:
    """The rules of the log-prob functions' logits: a ``[T, V > 0]`` tensor of fp32,
    bf16, fp16 or fp64."""
    torch = _torch()
    from ..tensors._device import check_tensor

    if check_tensor(logits, "logits").dim() != 2:
        raise ValueError(f"logits must be a [T, V] tensor, got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"logits must be float32, bfloat16, float16 or float64, got {logits.dtype}")
    if logits.shape[1] == 0:
        raise ValueError("logits must have at least one vocabulary column (V > 0)")


def check_head(hidden: "torch.Tensor", weight: "torch.Tensor", bias: Optional["torch.Tensor"]) -> None:
    """The rules of the fused LM head's inputs: hidden ``[T, H]`` float, weight
    ``[V > 0, H]`` and bias ``[V]`` (or None) of hidden's dtype and device."""
    torch = _torch()
    from ..tensors._device import check_tensor

    if check_tensor(hidden, "hidden").dim() != 2:
        raise ValueError(f"hidden must be a [T, H] tensor, got {tuple(hidden.shape)}")
    if hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        raise TypeError(f"hidden must be float32, bfloat16, float16 or float64, got {hidden.dtype}")
    if check_tensor(weight, "weight").dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"weight must be the [V, H = {hidden.shape[1]}] LM head, got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor(bias, "bias")
    if weight.shape[0] == 0:
        raise ValueError("weight must have at least one vocabulary row (V > 0)")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != hidden.dtype or t.device != hidden.device):
            raise TypeError(f"{name} must be {hidden.dtype} on {hidden.device} like hidden, got {t.dtype} on "
                            f"{t.device}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [V = {weight.shape[0]}], got {tuple(bias.shape)}")
