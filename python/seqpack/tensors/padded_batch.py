"""A padded batch as the packs read it: what :func:`~seqpack.pack_sequences`,
:func:`~seqpack.pack_to_layout` and :func:`~seqpack.pack_sequences_static` accept and
check before a token moves.

::

    tensors        {"input_ids": [B, S], "labels": [B, S], "hidden": [B, S, H], ...}   one device
    position ids   [B, S], or [..., B, S] with leading dimensions (M-RoPE's [3, B, S])
    pad values     one per name (pad_values), else pad_value; exact for the dtype
    packed side    [T, ...] (dim 0), or [..., T] (dim -1) for packed position ids

Importing this module does not import torch; its functions do, when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, FrozenSet, Mapping, Tuple

import numpy as np

from .._lengths import as_int64, type_name

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["POSITION_KEYS", "as_named", "batch_dims", "check_batch_shape", "check_device", "host_mask",
           "leading_names", "named_tensors", "pad_fills", "position_names", "rows_first", "token_dim"]

# Names of the position tensors that may carry leading dimensions ([3, B, S] M-RoPE ids).
POSITION_KEYS = ("position_ids",)


def check_device(t: "torch.Tensor", name: str) -> None:
    """``t`` must be a CPU or CUDA tensor (a ``TypeError`` for anything but a tensor,
    a ``ValueError`` on the meta device). CPU and CUDA tensors move; on CUDA without
    seqpack's kernels (a build without nvcc, a driver its runtime cannot use) a
    PyTorch path runs, with one warning."""
    from ._device import check_tensor

    check_tensor(t, name)
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on {t.device}; seqpack moves CPU and CUDA tensors")


def host_mask(attention_mask: "torch.Tensor", batch: int, width: int) -> np.ndarray:
    """``attention_mask`` as a C-contiguous uint8 host array (non-zero: a real token)
    for the C++ planner, read in its own dtype: a bool or 8-bit mask is viewed, not
    converted (``mask != 0`` on a bool tensor promotes it to int64, 8 bytes a token);
    a wider one is compared with 0 on its device (one byte a token) before the copy."""
    import torch

    from ._device import check_tensor

    check_tensor(attention_mask, "attention_mask")
    if tuple(attention_mask.shape) != (batch, width):
        raise ValueError(f"attention_mask must be [B, S] = [{batch}, {width}], got {tuple(attention_mask.shape)}")
    mask = attention_mask.detach()
    if mask.dtype not in (torch.bool, torch.uint8, torch.int8):
        mask = mask != 0
    return mask.cpu().contiguous().view(torch.uint8).numpy()


def position_names(position_keys: Any) -> FrozenSet[str]:
    """``position_keys`` (one name, a collection of names, or None) as a frozenset."""
    if position_keys is None:
        return frozenset()
    if isinstance(position_keys, str):
        return frozenset((position_keys,))
    try:
        names = frozenset(position_keys)
    except TypeError:
        raise TypeError(f"position_keys must be a name or a collection of names, got {type_name(position_keys)}") \
            from None
    if not all(isinstance(n, str) for n in names):
        raise TypeError(f"position_keys must hold tensor names (str), got {sorted(map(repr, names))}")
    return names


def leading_names(named: Mapping[str, "torch.Tensor"], position_keys: Any) -> FrozenSet[str]:
    """The tensors read as ``[..., B, S]``: position tensors of three or more dimensions."""
    keys = position_names(position_keys)
    return frozenset(name for name, t in named.items() if name in keys and t.dim() >= 3)


def batch_dims(named: Mapping[str, "torch.Tensor"], leading: FrozenSet[str]) -> Tuple[int, int]:
    """``(B, S)`` of the batch: the first ``[B, S, ...]`` tensor's first two dimensions,
    else (position tensors only) the last two of the first ``[..., B, S]`` one."""
    for name, t in named.items():
        if name not in leading:
            if t.dim() < 2:
                raise ValueError(f"tensors[{name!r}] must be [B, S, ...], got shape {tuple(t.shape)}")
            return int(t.shape[0]), int(t.shape[1])
    first = next(iter(named.values()))
    return int(first.shape[-2]), int(first.shape[-1])


def check_batch_shape(name: str, t: "torch.Tensor", leading: FrozenSet[str], batch: int, width: int) -> None:
    """``t`` is ``[B, S, ...]``, or ``[..., B, S]`` when ``name`` is in ``leading``."""
    if name in leading:
        if tuple(t.shape[-2:]) != (batch, width):
            raise ValueError(
                f"tensors[{name!r}] has shape {tuple(t.shape)}; a position tensor of 3 or more dimensions must be "
                f"[..., B, S] = [..., {batch}, {width}] (M-RoPE's [3, B, S]; a [B, 3, S] one is .transpose(0, 1))")
    elif t.dim() < 2 or tuple(t.shape[:2]) != (batch, width):
        raise ValueError(
            f"tensors[{name!r}] has shape {tuple(t.shape)}; every tensor must start with [B, S] = [{batch}, {width}]"
        )


def rows_first(t: "torch.Tensor") -> "torch.Tensor":
    """``[..., B, S]`` as a ``[B, S, ...]`` view (the row move's input; contiguous, and
    so not copied by it, when the tensor was a ``[B, S, ...]`` one moved)."""
    return t.movedim((-2, -1), (0, 1))


def token_dim(x: "torch.Tensor", rows: int, dim: Any) -> int:
    """The dimension of ``x`` that holds the ``rows`` packed tokens: 0 (``[T, ...]``)
    or -1 (``[..., T]``, e.g. packed M-RoPE ids ``[3, T]``). ``dim=None``: 0 when
    ``x`` has ``rows`` rows, else -1 when its last dimension has ``rows`` entries."""
    if dim is None:
        if x.dim() >= 1 and x.shape[0] == rows:
            return 0
        if x.dim() >= 2 and x.shape[-1] == rows:
            return -1
        raise ValueError(f"x must have {rows} rows (the packed length), or {rows} entries in its last dimension "
                         f"([..., T] such as M-RoPE position ids), got shape {tuple(x.shape)}")
    dim = as_int64(dim, "dim")
    if x.dim() < 1 or dim not in (0, -1, x.dim() - 1):
        raise ValueError(f"dim must be None, 0 ([T, ...]) or -1 ([..., T]) for x of shape {tuple(x.shape)}, "
                         f"got {dim!r}")
    token = 0 if dim == 0 else -1
    if x.shape[token] != rows:
        raise ValueError(f"x must have {rows} rows (the packed length) in dimension {token}, got shape "
                         f"{tuple(x.shape)}")
    return token


def as_named(tensors) -> Dict[str, "torch.Tensor"]:
    """``tensors`` as a dict of names to tensors (one tensor is ``"input"``), each
    checked by :func:`seqpack.tensors._device.check_tensor`."""
    import torch

    from ._device import check_tensor

    if isinstance(tensors, torch.Tensor):
        named = {"input": tensors}
    elif isinstance(tensors, Mapping) or (callable(getattr(tensors, "keys", None)) and hasattr(tensors, "__getitem__")):
        named = {name: tensors[name] for name in tensors.keys()}  # a dict, BatchedDataDict, TensorDict
    else:
        raise TypeError(f"tensors must be a torch.Tensor or a mapping of names to torch.Tensor, got "
                        f"{type_name(tensors)}")
    if not named:
        raise ValueError("tensors must hold at least one tensor")
    for name, t in named.items():
        check_tensor(t, f"tensors[{name!r}]")
    return named


def named_tensors(tensors, position_keys: Any = POSITION_KEYS) -> tuple:
    """``(dict of tensors, B, S, leading)``: every tensor a CPU/CUDA ``[B, S, ...]`` on
    one device, but the position tensors (names in ``position_keys``) of three or more
    dimensions, which are ``[..., B, S]`` (``leading``: their names)."""
    named = as_named(tensors)
    leading = leading_names(named, position_keys)
    first_name, first = next(iter(named.items()))
    batch, width = batch_dims(named, leading)
    for name, t in named.items():
        check_batch_shape(name, t, leading, batch, width)
        check_device(t, f"tensors[{name!r}]")
        if t.device != first.device:
            raise ValueError(f"tensors[{name!r}] is on {t.device}, tensors[{first_name!r}] on {first.device}")
    return named, batch, width, leading


def pad_fills(named: Mapping[str, "torch.Tensor"], pad_values: Any, pad_value: Any) -> Dict[str, Any]:
    """Each tensor's pad, checked exact for its dtype (:func:`seqpack.tensors._ops.check_fill`):
    ``pad_values[name]`` where given (a name of no tensor is a ``ValueError``), else
    ``pad_value``."""
    from ._ops import check_fill

    pad_values = dict(pad_values or {})
    unknown = set(pad_values) - set(named)
    if unknown:
        raise ValueError(f"pad_values names tensors that were not given: {sorted(unknown)}")
    return {name: check_fill(pad_values[name], t.dtype, f"pad_values[{name!r}]") if name in pad_values
            else check_fill(pad_value, t.dtype, "pad_value") for name, t in named.items()}
