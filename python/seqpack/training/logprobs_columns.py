"""Log-probabilities of k given columns of every row, from one log-sum-exp per row
(issue 30, item 1): what top-k distillation needs of the student (its log-probs
at the teacher's top-k token ids, and its full-vocabulary entropy), on logits or
with the LM head fused in, never a ``[T, V]`` log-softmax::

    logits [T, V]     columns [T, k]        log-probs [T, k]
    row 0  ........   [17,  4, 903]    ->   [lp(17), lp(4), lp(903)]     one log-sum-exp for row 0
    row 1  ........   [ 2, -1,  -1]    ->   [lp(2),  0,     0     ]     -1: no column

It runs on the same kernels as :func:`~seqpack.tree_token_logprobs` (the columns
are each row's extra targets in the ``seqpack::multi_token_logprobs`` operators);
the backward writes each row's gradient once, every column included. Rows are whatever the caller lays out (a
packed stream's next-token rows, say); a negative column gives log-prob 0 and no
gradient.

    >>> import torch, seqpack
    >>> from seqpack.training.logprobs_columns import column_logprobs
    >>> logits = torch.zeros(2, 4)                            # uniform over 4 tokens
    >>> out = column_logprobs(logits, torch.tensor([[0, 3], [2, -1]]), return_entropy=True)
    >>> [[round(x, 4) for x in row] for row in out.logprobs.tolist()], [round(x, 4) for x in out.entropy.tolist()]
    ([[-1.3863, -1.3863], [-1.3863, 0.0]], [1.3863, 1.3863])

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .._lengths import as_positive_int, as_temperature
from .logprobs import TokenLogprobs

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["column_logprobs", "linear_column_logprobs", "vocab_parallel_column_logprobs"]


def _columns(columns: Any, rows: int, vocab: Optional[int], device) -> "torch.Tensor":
    """``columns`` as int64 ``[rows, k]`` on ``device``, every entry < ``vocab`` (on
    the host a ``ValueError`` naming the first bad one; on a CUDA device an
    asynchronous device assertion: no host synchronisation; ``vocab=None``: global
    ids of a vocabulary-parallel slice, not checked here)."""
    import torch

    from ..tensors._device import check_tensor

    if not isinstance(columns, torch.Tensor):
        raise TypeError(f"columns must be an integer tensor [T, k], got {type(columns).__name__}")
    check_tensor(columns, "columns")
    if columns.dim() != 2 or columns.shape[0] != rows:
        raise ValueError(f"columns must be [T = {rows}, k] (one row of column ids per row), got "
                         f"{tuple(columns.shape)}")
    if columns.dtype.is_floating_point or columns.dtype.is_complex or columns.dtype == torch.bool:
        raise TypeError(f"columns must hold integer token ids, got {columns.dtype}")
    columns = columns.to(device=device, dtype=torch.int64)
    if vocab is None:
        return columns
    if columns.device.type == "cpu":
        if columns.numel() and int(columns.max()) >= vocab:
            r, c = (int(x) for x in (columns >= vocab).nonzero()[0])
            raise ValueError(f"columns[{r}, {c}] = {int(columns[r, c])} is not a column of the vocabulary "
                             f"(V = {vocab}); ids must be < {vocab}, or negative for none")
    elif columns.numel():
        torch._assert_async((columns < vocab).all(), "seqpack: a column id is >= the vocabulary size")
    return columns


def _csr(columns: "torch.Tensor"):
    """The operators' form: every column an extra target (CSR offsets with stride k),
    and column 0 as each row's primary target, whose output is dropped: the operators
    give a row's entropy only where it has a primary target, and the columns' entropy
    is the row's whatever its columns."""
    import torch

    rows, k = columns.shape
    primary = columns.new_zeros(rows)
    offsets = torch.arange(rows + 1, device=columns.device, dtype=torch.int64) * k
    return primary, offsets, columns.reshape(-1).contiguous()


def _result(out, rows: int, k: int, entropy: bool) -> TokenLogprobs:
    return TokenLogprobs(out[1].view(rows, k), out[2] if entropy else None)


def column_logprobs(logits: "torch.Tensor", columns: "torch.Tensor", *, temperature: Any = 1.0,
                    return_entropy: bool = False, num_threads: int = 0, vocab_parallel_group: Any = None,
                    vocab_start: Any = None) -> TokenLogprobs:
    """Log-probability of each of ``columns[t]`` under row ``t`` of ``logits``
    (``log_softmax(logits[t] / temperature)[columns[t]]``), and the row's entropy
    over the whole vocabulary; differentiable.

    Args:
        logits: ``[T, V]`` fp32 / bf16 / fp16 (fp64 for ``gradcheck``), the whole
            vocabulary.
        columns: ``[T, k]`` integer token ids (< V; negative: none, log-prob 0).
        temperature: positive and finite (a Python, NumPy or 0-d tensor number).
        return_entropy: also each row's entropy ``[T]``.
        num_threads: CPU threads of the kernels (0: seqpack's default).
        vocab_parallel_group / vocab_start: tensor parallelism: ``logits`` is this
            rank's vocabulary slice ``[vocab_start, vocab_start + V_local)`` (default
            start ``rank * V_local``, Megatron's layout) and ``columns`` hold global
            ids; see :func:`vocab_parallel_column_logprobs`.

    Returns:
        :class:`~seqpack.TokenLogprobs` ``(logprobs [T, k], entropy [T] or None)``,
        fp32 (fp64 for fp64 logits), on the logits' device.
    """
    import torch

    from .._dist import active
    from . import _multi_target_ops  # noqa: F401  (registers the operators)
    from .logprobs import check_logits

    check_logits(logits)
    temp, entropy = as_temperature(temperature), bool(return_entropy)
    threads = as_positive_int(num_threads, "num_threads", allow_zero=True)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if vocab_parallel_group is not None and active(vocab_parallel_group):
        cols = _columns(columns, logits.shape[0], None, logits.device)
        return vocab_parallel_column_logprobs(logits, cols, vocab_parallel_group, vocab_start, temp, entropy, threads)
    cols = _columns(columns, logits.shape[0], logits.shape[1], logits.device)
    primary, offsets, extras = _csr(cols)
    out = torch.ops.seqpack.multi_token_logprobs(logits, primary, offsets, extras, temp, entropy, threads)
    return _result(out, cols.shape[0], cols.shape[1], entropy)


def vocab_parallel_column_logprobs(logits: "torch.Tensor", columns: "torch.Tensor", group: Any,
                                   vocab_start: Any, temperature: float, entropy: bool,
                                   num_threads: int) -> TokenLogprobs:
    """:func:`column_logprobs` of a vocabulary-parallel ``logits`` slice: a column's
    logit minus its row's log-sum-exp over the whole vocabulary, from the two
    vocabulary-parallel primitives::

        z   = vocab_parallel_gather_columns(logits, [anchor | columns])   one all-reduce
        lp0 = vocab-parallel log-prob of the anchor                       the row statistics' two
        lse = z[anchor] - lp0,   log p(column) = z[column] - lse           all-reduces (max, sums)

    ``anchor`` is the row's first column (id 0 where it is negative): any id works,
    its log-prob carries the row's log-sum-exp and entropy. Both pieces are
    differentiable and their gradients are each rank's own slice (the gather's
    reaches a column's owner, the log-prob's every rank's softmax), so the
    backward needs no communication. A column outside the global vocabulary has
    no owner and a logit of 0 (NeMo-RL's gather). ``columns`` int64 ``[T, k]``;
    every rank calls it with the same shapes."""
    import torch
    import torch.distributed as dist

    from . import _logprob_ops as ops
    from .vocab_parallel import vocab_parallel_gather_columns

    width = int(logits.shape[1])
    start = dist.get_rank(group) * width if vocab_start is None else as_positive_int(vocab_start, "vocab_start",
                                                                                      allow_zero=True)
    anchor = columns[:, :1].clamp(min=0)
    z = vocab_parallel_gather_columns(logits, torch.cat([anchor, columns.clamp(min=0)], 1), group,
                                      vocab_start_index=start, agree=False) / temperature
    lp0, ent, _, _ = ops.VocabParallelTokenLogprobs.apply(logits, anchor[:, 0].contiguous(), start, temperature,
                                                          entropy, num_threads, group)
    log_sumexp = z[:, 0] - lp0.to(z.dtype)
    lp = torch.where(columns >= 0, z[:, 1:] - log_sumexp[:, None], 0.0)
    return TokenLogprobs(lp, ent if entropy else None)


def linear_column_logprobs(hidden: "torch.Tensor", weight: "torch.Tensor", columns: "torch.Tensor", *,
                           bias: Optional["torch.Tensor"] = None, temperature: Any = 1.0,
                           return_entropy: bool = False, chunk_tokens: Optional[int] = None,
                           num_threads: int = 0) -> TokenLogprobs:
    """:func:`column_logprobs` of ``hidden @ weight.T + bias`` without the ``[T, V]``
    logits: the LM head fused in, a chunk of rows at a time (as
    :func:`~seqpack.linear_token_logprobs`); each extra column's logit is one dot
    product.

    Args:
        hidden: ``[T, H]`` final hidden states; weight: ``[V, H]`` the LM head (the
            whole vocabulary), same dtype and device; bias: ``[V]`` or None.
        columns, temperature, return_entropy, num_threads: as :func:`column_logprobs`.
        chunk_tokens: rows of logits per chunk (default: about 2^24 logits).
    """
    import torch

    from . import _logprob_ops as ops
    from . import _multi_target_ops  # noqa: F401  (registers the operators)
    from .logprobs import _check_head

    _check_head(hidden, weight, bias)
    vocab = int(weight.shape[0])
    cols = _columns(columns, hidden.shape[0], vocab, hidden.device)
    temp, entropy = as_temperature(temperature), bool(return_entropy)
    chunk = ops.chunk_rows(0 if chunk_tokens is None else as_positive_int(chunk_tokens, "chunk_tokens"),
                           hidden.shape[0], vocab)
    threads = as_positive_int(num_threads, "num_threads", allow_zero=True)
    primary, offsets, extras = _csr(cols)
    out = torch.ops.seqpack.linear_multi_token_logprobs(hidden, weight, bias, primary, offsets, extras, temp,
                                                        entropy, threads, chunk)
    return _result(out, cols.shape[0], cols.shape[1], entropy)
