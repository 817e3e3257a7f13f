"""The column ids of the column log-probs (``[T, k]`` global token ids per row, -1:
none) and the log-softmax over a row's columns: shared by
:mod:`~seqpack.training.logprobs_columns`, its vocabulary-parallel forms and the
distillation loss.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # pragma: no cover
    import torch


def check_columns(columns: Any, rows: int, vocab: Optional[int], device) -> "torch.Tensor":
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


def subset_log_softmax(z: "torch.Tensor", columns: "torch.Tensor") -> "torch.Tensor":
    """Log-softmax of ``z`` ``[T, k]`` over each row's columns ``>= 0`` (0 at the
    others; a row without any is all 0, with no NaN in its forward or backward):
    the softmax restricted to a row's columns, renormalised."""
    import torch

    valid = columns >= 0
    empty = ~valid.any(-1, keepdim=True)
    z = torch.where(valid | empty, z, -torch.inf)
    return torch.where(valid, torch.log_softmax(z, dim=-1), 0.0)
