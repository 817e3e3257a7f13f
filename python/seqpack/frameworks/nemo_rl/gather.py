"""``BatchedDataDict.all_gather``: every rank's rows over a ``torch.distributed``
group, the ranks' gathers agreed on first. Imports torch when called::

    all_gather_rows({"x": torch.arange(rank + 1)})   # on 2 ranks: {"x": tensor([0, 0, 1])}
"""

from __future__ import annotations

import pickle
from typing import Any, Dict, List, Mapping

from .._batch import is_tensor

__all__ = ["all_gather_rows"]


def all_gather_rows(data: Mapping[str, Any], group: Any = None) -> Dict[str, Any]:
    """Every rank's rows of ``data``, concatenated in rank order (see
    :meth:`~seqpack.BatchedDataDict.all_gather`)."""
    import torch.distributed as dist

    import torch

    from ..._dist import checked_on_every_rank

    world = dist.get_world_size(group)
    items = list(data.items())
    payloads: Dict[Any, bytes] = {}

    def local() -> List[tuple]:  # what each key's gathers exchange
        kinds = []
        for key, v in items:
            if is_tensor(v):
                if v.dim() < 1:
                    raise ValueError(f"BatchedDataDict.all_gather: {key!r} is a 0-d tensor; every tensor value "
                                     "needs a row dimension to gather")
                kinds.append((str(key), "tensor", tuple(v.shape[1:]), str(v.dtype)))
            elif isinstance(v, list):  # pickled here: an unpicklable item fails inside the agreement
                payloads[key] = pickle.dumps(v, protocol=pickle.HIGHEST_PROTOCOL)
                kinds.append((str(key), "list", None, None))
            else:
                raise NotImplementedError(f"Attempted to gather_and_balance_globally for unsupported type "
                                          f"{type(v)} with key {key}. Please provide either a tensor or a list "
                                          "of picklable objects.")
        return kinds

    checked_on_every_rank(local, group, "BatchedDataDict.all_gather", world > 1, fingerprint=lambda kinds: {
        "the keys and their order": [k[0] for k in kinds],
        "which values are tensors and which lists": [k[1] for k in kinds],
        "each tensor's shape past its rows": [k[2] for k in kinds],
        "each tensor's dtype": [k[3] for k in kinds]})
    out: Dict[str, Any] = {}
    for key, v in items:
        if is_tensor(v):
            count = torch.tensor([v.shape[0]], dtype=torch.int64, device=v.device)
            counts = [torch.zeros_like(count) for _ in range(world)]
            dist.all_gather(counts, count, group=group)
            sizes = [int(c.item()) for c in counts]
            most = max(sizes)
            padded = v.new_zeros((most, *v.shape[1:]))
            padded[: v.shape[0]] = v
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded.contiguous(), group=group)
            out[key] = torch.cat([p[:n] for p, n in zip(parts, sizes)])
        elif isinstance(v, list):
            out[key] = [x for part in _gather_bytes(payloads[key], world, group) for x in pickle.loads(part)]
        else:
            raise NotImplementedError(f"Attempted to gather_and_balance_globally for unsupported type {type(v)} "
                                      f"with key {key}. Please provide either a tensor or a list of picklable "
                                      "objects.")
    return out


def _gather_bytes(payload: bytes, world: int, group: Any) -> List[bytes]:
    """Every rank's ``payload``, in rank order: its length, then the bytes padded to
    the longest, all-gathered (on the current CUDA device for NCCL, else the CPU)."""
    import torch
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(n.item()) for n in sizes]
    buffer = torch.zeros(max(lengths), dtype=torch.uint8)
    if payload:
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buffer = buffer.to(device)
    parts = [torch.empty_like(buffer) for _ in range(world)]
    dist.all_gather(parts, buffer, group=group)
    return [bytes(p[:n].cpu().numpy().tobytes()) for p, n in zip(parts, lengths)]
