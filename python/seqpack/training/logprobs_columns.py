"""Log-probabilities of k given columns of every row, from one log-sum-exp per row
(issue 30, item 1): what top-k distillation needs of the student (its log-probs
at the teacher's top-k token ids, and its full-vocabulary entropy), on logits or
with the LM head fused in, never a ``[T, V]`` log-softmax::

    logits [T, V]     columns [T, k]        log-probs [T, k]
    row 0  ........   [17,  4, 903]    ->   [lp(17), lp(4), lp(903)]     one log-sum-exp for row 0
    row 1  ........   [ 2, -1,  -1]    ->   [lp(2),  0,     0     ]     -1: no column

It runs on the same kernels as :func:`seqpack.token_logprobs` on a tree (the columns
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
from ._columns import check_columns
from .logprobs import TokenLogprobs

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["column_logprobs", "linear_column_logprobs"]


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
            ids; see :mod:`seqpack.training.logprobs_columns_tp`.

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
        cols = check_columns(columns, logits.shape[0], None, logits.device)
        from .logprobs_columns_tp import vocab_parallel_column_logprobs

        return vocab_parallel_column_logprobs(logits, cols, vocab_parallel_group, vocab_start, temp, entropy, threads)
    cols = check_columns(columns, logits.shape[0], logits.shape[1], logits.device)
    primary, offsets, extras = _csr(cols)
    out = torch.ops.seqpack.multi_token_logprobs(logits, primary, offsets, extras, temp, entropy, threads)
    return _result(out, cols.shape[0], cols.shape[1], entropy)


def linear_column_logprobs(hidden: "torch.Tensor", weight: "torch.Tensor", columns: "torch.Tensor", *,
                           bias: Optional["torch.Tensor"] = None, temperature: Any = 1.0,
                           return_entropy: bool = False, chunk_tokens: Optional[int] = None,
                           num_threads: int = 0, vocab_parallel_group: Any = None,
                           vocab_start: Any = None) -> TokenLogprobs:
    """:func:`column_logprobs` of ``hidden @ weight.T + bias`` without the ``[T, V]``
    logits: the LM head fused in, a chunk of rows at a time (as
    :func:`seqpack.token_logprobs` with ``weight``); each extra column's logit is one dot
    product.

    Args:
        hidden: ``[T, H]`` final hidden states; weight: ``[V, H]`` the LM head (the
            whole vocabulary), same dtype and device; bias: ``[V]`` or None.
        columns, temperature, return_entropy, num_threads: as :func:`column_logprobs`.
        chunk_tokens: rows of logits per chunk (default: about 2^24 logits, 2^26 on CUDA).
        vocab_parallel_group / vocab_start: ``weight`` (and ``bias``) is this rank's
            vocabulary slice of the head, ``columns`` global ids; the hidden states'
            gradient is summed over the group (see
            :mod:`seqpack.training.logprobs_columns_tp`).
    """
    import torch

    from . import _logprob_ops as ops
    from . import _multi_target_ops  # noqa: F401  (registers the operators)
    from .logprobs import check_head

    from .._dist import active

    check_head(hidden, weight, bias)
    vocab = int(weight.shape[0])
    parallel = vocab_parallel_group is not None and active(vocab_parallel_group)
    cols = check_columns(columns, hidden.shape[0], None if parallel else vocab, hidden.device)
    temp, entropy = as_temperature(temperature), bool(return_entropy)
    chunk = ops.chunk_rows(0 if chunk_tokens is None else as_positive_int(chunk_tokens, "chunk_tokens"),
                           hidden.shape[0], vocab, hidden.is_cuda)
    threads = as_positive_int(num_threads, "num_threads", allow_zero=True)
    if parallel:
        from .logprobs_columns_tp import vocab_parallel_linear_column_logprobs

        return vocab_parallel_linear_column_logprobs(hidden, weight, cols, vocab_parallel_group, bias=bias,
                                                     vocab_start=vocab_start, temperature=temp, entropy=entropy,
                                                     chunk=chunk, num_threads=threads)
    primary, offsets, extras = _csr(cols)
    out = torch.ops.seqpack.linear_multi_token_logprobs(hidden, weight, bias, primary, offsets, extras, temp,
                                                        entropy, threads, chunk)
    return _result(out, cols.shape[0], cols.shape[1], entropy)
