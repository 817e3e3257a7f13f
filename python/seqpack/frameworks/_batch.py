"""Row operations on batches: mappings of tensors, NumPy arrays and lists whose
dimension 0 is the batch (NeMo-RL's BatchedDataDict values, ROLL DataProto-like
dicts, verl TensorDict-like dicts). Torch is imported only when a tensor shows up."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np


def is_tensor(v: Any) -> bool:
    import sys

    torch = sys.modules.get("torch")  # a tensor implies torch is imported
    return torch is not None and isinstance(v, torch.Tensor)


def is_packed(v: Any) -> bool:
    """NeMo-RL's multimodal ``PackedTensor`` (duck-typed: rows sliced by ``.slice``)."""
    return hasattr(v, "slice") and hasattr(v, "as_tensor") and hasattr(type(v), "concat")


def rows(v: Any) -> int:
    return int(v.shape[0]) if (is_tensor(v) or isinstance(v, np.ndarray)) else len(v)


def is_nested(v: Any) -> bool:
    """A jagged nested tensor (verl's engine TensorDicts: ``input_ids``, ``position_ids``)."""
    return is_tensor(v) and v.is_nested


def nested_rows(v: Any, indices: Sequence[int], first_token: bool = False) -> Any:
    """Rows ``indices`` of a jagged nested tensor, nested again along the same ragged
    dimension (``[B, j]``, or ``[B, 3, j]`` for M-RoPE positions); ``first_token``
    keeps only each row's first token."""
    import torch

    ragged = int(getattr(v, "_ragged_idx", 1))
    if ragged not in (1, 2):
        raise ValueError(f"a nested tensor ragged along dimension {ragged} (only 1 and 2 are supported)")
    parts = v.unbind()
    picked = [parts[i] for i in indices]
    if ragged == 2:  # [3, L] rows: nest [L, 3], then move the ragged dimension back
        picked = [p.transpose(0, 1) for p in picked]
    if first_token:
        picked = [p[:1] for p in picked]
    out = torch.nested.as_nested_tensor(picked, layout=torch.jagged)
    return out.transpose(1, 2) if ragged == 2 else out


def select(key: str, v: Any, indices: Sequence[int]) -> Any:
    """Rows ``indices`` of one value, copied (a tensor in one ``index_select``)."""
    if is_nested(v):
        return nested_rows(v, indices)
    if is_tensor(v):
        import torch

        index = torch.as_tensor(np.asarray(indices, dtype=np.int64).reshape(-1))
        return v.index_select(0, index.to(v.device))
    if isinstance(v, np.ndarray):
        return v[np.asarray(indices, dtype=np.int64)]
    if is_packed(v):
        return v.slice(list(indices))
    if hasattr(v, "batch_size") and hasattr(v, "shape"):  # tensordict's NonTensorData / NonTensorStack (verl)
        import torch

        return v[torch.as_tensor(np.asarray(indices, dtype=np.int64).reshape(-1))]
    if isinstance(v, list):
        return [v[i] for i in indices]
    raise TypeError(f"Unsupported type {type(v)} for index selection in BatchedDataDict (key {key!r})")


def select_all(batch: Mapping[str, Any], indices: Sequence[int]) -> Dict[str, Any]:
    return {k: select(k, v, indices) for k, v in batch.items()}


def check_mapping(batch: Any, name: str = "batch") -> None:
    """A batch is a mapping of row-aligned values (dict, BatchedDataDict, TensorDict:
    ``keys()`` and ``[key]``). Anything else is refused here: ``"key" in obj`` on an
    object with ``__getitem__`` but no ``__contains__`` (ROLL's / verl's
    ``DataProto``) iterates ``obj[0], obj[1], ...`` and never ends."""
    if isinstance(batch, Mapping) or (callable(getattr(batch, "keys", None)) and hasattr(batch, "__getitem__")):
        return
    hint = ""
    if hasattr(batch, "batch") and hasattr(batch, "non_tensor_batch"):
        hint = " (a DataProto: pass its tensors, e.g. dict(proto.batch), or the adapter's mapping)"
    raise TypeError(f"{name} must be a mapping of row-aligned tensors/arrays, got {type(batch).__name__}{hint}")


def batch_size(batch: Mapping[str, Any], name: str = "batch") -> int:
    check_mapping(batch, name)
    sizes = {k: rows(v) for k, v in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"{name} values must share dimension 0, got sizes {sizes}")
    return next(iter(sizes.values()))


def host_mask(batch: Mapping[str, Any], name: str = "batch") -> np.ndarray:
    """``batch['attention_mask']`` as a ``[B, S]`` host array in its own dtype (a CPU
    tensor is viewed, a device one copied as it is: no conversion)."""
    check_mapping(batch, name)
    if "attention_mask" not in batch:
        raise ValueError(f"{name} needs an 'attention_mask' [B, S] (1 on real tokens)")
    mask = batch["attention_mask"]
    if is_tensor(mask):
        from .._lengths import check_not_meta

        check_not_meta(mask, f"{name}['attention_mask']")
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"{name}['attention_mask'] must be [B, S], got shape {mask.shape}")
    return mask


def mask_lengths(batch: Mapping[str, Any], name: str = "batch") -> np.ndarray:
    """Real tokens per row: the rows of a nested ``input_ids`` (verl's engine
    TensorDicts, read from its offsets as verl does), else the non-zeros of each row
    of a ``[B, S]`` mask, counted in the mask's own dtype (``(mask != 0).sum(1)``
    copied the mask first)."""
    check_mapping(batch, name)
    ids = batch["input_ids"] if "input_ids" in batch else None
    if is_nested(ids):
        return ids.offsets().diff().detach().cpu().numpy().astype(np.int64)
    return np.count_nonzero(host_mask(batch, name), axis=1).astype(np.int64)


# Keys whose zeros mean "no loss on this token / row" in the frameworks seqpack
# adapts (verl: response_mask, loss_mask; NeMo-RL: token_mask, sample_mask).
LOSS_MASK_KEYS = ("loss_mask", "response_mask", "token_mask", "sample_mask")


def _zeros_like(v: Any) -> Any:
    if is_tensor(v) or isinstance(v, np.ndarray):
        return v * 0
    return [type(x)(0) if isinstance(x, (int, float, bool)) else x for x in v]


def dummy_row(batch: Mapping[str, Any], *, loss_mask_keys: Sequence[str] = LOSS_MASK_KEYS,
              length_key: Optional[str] = None, name: str = "batch") -> Dict[str, Any]:
    """A one-row batch that runs the model on a single real token and adds nothing
    to the loss: the micro-batch a rank with no work runs so that every rank's
    collectives (FSDP all-gathers, gradient reductions) still match.

    Row 0 of ``batch`` with every ``loss_mask_keys`` value zeroed, ``labels`` set to
    -100 (ignored by HF losses), the ``attention_mask`` (when present) keeping only
    its first real token, and ``length_key`` (e.g. NeMo-RL's ``input_lengths``) set
    to 1.

    >>> import numpy as np
    >>> row = dummy_row({"attention_mask": np.array([[0, 1, 1], [1, 1, 0]]), "loss_mask": np.ones((2, 3))})
    >>> row["attention_mask"].tolist(), row["loss_mask"].tolist()
    ([[0, 1, 0]], [[0.0, 0.0, 0.0]])
    """
    if batch_size(batch, name) == 0:
        raise ValueError(f"{name} has no rows: a dummy micro-batch copies one row's shapes and dtypes")
    row = select_all(batch, [0])
    for key in loss_mask_keys:
        if key in row:
            row[key] = _zeros_like(row[key])
    if "labels" in row and (is_tensor(row["labels"]) or isinstance(row["labels"], np.ndarray)):
        row["labels"] = row["labels"] * 0 - 100
    mask = row.get("attention_mask")
    if mask is not None and (is_tensor(mask) or isinstance(mask, np.ndarray)) and mask.ndim == 2:
        real = np.flatnonzero(np.asarray(mask[0].tolist()) != 0)
        first = int(real[0]) if real.size else 0
        kept = mask * 0
        kept[0, first] = 1
        row["attention_mask"] = kept
    if length_key is not None and length_key in row:
        v = row[length_key]
        row[length_key] = v * 0 + 1 if (is_tensor(v) or isinstance(v, np.ndarray)) else [1]
    for key, v in row.items():  # verl's engine rows (nested input_ids, position_ids): the first token only
        if is_nested(v):
            row[key] = nested_rows(v, [0], first_token=True)
    return row


def step_plan_parts(plan: Any, dp_rank: Any, mini_batch: Any, rows_here: int, cap: Optional[int],
                    cap_name: str) -> "list[list[int]]":
    """Rank ``dp_rank``'s micro-batches of ``mini_batch`` in a
    :class:`seqpack.StepPlan`, as positions into the rank's rows (``[]``: a dummy),
    after checking the batch is the one planned. Every rank checks only its own
    inputs and runs no collective: the plan already gives every rank the same count.
    """
    from ..planning.step import StepPlan

    if not isinstance(plan, StepPlan):
        raise TypeError(f"step_plan must be a seqpack.StepPlan, got {type(plan).__name__}")
    from .._lengths import as_int64

    dp_rank = as_int64(dp_rank, "dp_rank")  # NumPy and 0-d tensor integers too; None is refused
    m = plan._mini_batch(mini_batch)
    if plan.prefix_reuse is not None and plan.prefix_reuse[m] is not None:
        raise ValueError(f"step_plan runs mini-batch {m} in prefix-reuse passes, which micro-batches of rows cannot "
                         "hold: shard it with BatchedDataDict.shard_by_batch_size(step_plan=...), or plan it with "
                         "prefix_reuse=False")
    parts = plan.local_micro_batches(dp_rank, mini_batch)
    planned = sum(len(p) for p in parts)
    if planned != rows_here:
        raise ValueError(f"the batch has {rows_here} rows but step_plan gives rank {dp_rank} {planned} in "
                         f"mini-batch {mini_batch}: build it from step_plan.rank_rows({dp_rank}, {mini_batch})")
    if cap is not None and plan.max_tokens > cap:
        raise ValueError(f"step_plan was planned with max_tokens={plan.max_tokens}, above {cap_name}={cap}")
    return parts


# ---------------------------------------------------------------- DataProto (ROLL, verl)


def is_data_proto(obj: Any) -> bool:
    """ROLL's / verl's ``DataProto``, duck-typed: ``.batch`` (a TensorDict of tensors,
    or ``None``), ``.non_tensor_batch`` (NumPy object arrays by name) and
    ``.meta_info`` (a dict); not itself a mapping."""
    return (not isinstance(obj, Mapping) and hasattr(obj, "batch") and hasattr(obj, "non_tensor_batch")
            and hasattr(obj, "meta_info"))


def proto_columns(proto: Any) -> Dict[str, Any]:
    """A DataProto's row-aligned values by name (``batch``'s tensors, then
    ``non_tensor_batch``'s arrays): a plain dict of the same objects, no copy. Only
    ``keys()`` and ``[key]`` are used (a TensorDict iterates rows, not keys)."""
    out: Dict[str, Any] = {}
    tensors = proto.batch
    if tensors is not None:
        for key in list(tensors.keys()):
            out[key] = tensors[key]
    non_tensors = proto.non_tensor_batch
    if non_tensors is not None:
        for key in list(non_tensors.keys()):
            out[key] = non_tensors[key]
    return out


def proto_select(proto: Any, indices: Sequence[int], name: str = "batch") -> Any:
    """Rows ``indices`` of a DataProto, as a new object of its class: its own
    ``select_idxs`` (ROLL's and verl's), else ``type(proto)(batch=...,
    non_tensor_batch=..., meta_info=...)``. The result's ``meta_info`` may be the
    input's own dict (ROLL's ``select_idxs`` shares it): assign a new dict before
    writing to it."""
    rows = [int(i) for i in indices]
    if callable(getattr(proto, "select_idxs", None)):
        return proto.select_idxs(rows)
    tensors = proto.batch
    if tensors is None:
        batch = None
    elif hasattr(tensors, "batch_size") and not isinstance(tensors, dict):  # a TensorDict keeps its type
        import torch

        batch = tensors[torch.as_tensor(rows, dtype=torch.long)]
    else:
        batch = {k: select(k, tensors[k], rows) for k in list(tensors.keys())}
    non_tensors = {k: select(k, v, rows) for k, v in (proto.non_tensor_batch or {}).items()}
    try:
        return type(proto)(batch=batch, non_tensor_batch=non_tensors, meta_info=proto.meta_info)
    except TypeError as exc:
        raise TypeError(f"{name} looks like a DataProto (.batch, .non_tensor_batch, .meta_info) but has no "
                        f"select_idxs() and {type(proto).__name__}(batch=..., non_tensor_batch=..., meta_info=...) "
                        f"failed: {exc}") from None


def proto_slice(proto: Any, start: int, end: int, name: str = "batch") -> Any:
    """Rows ``[start, end)`` of a DataProto: its own ``slice`` (views, as ROLL's
    iterators take them), else :func:`proto_select`. ``meta_info`` as there."""
    if callable(getattr(proto, "slice", None)):
        return proto.slice(int(start), int(end))
    return proto_select(proto, range(int(start), int(end)), name)


def group_codes(values: Any) -> List[int]:
    """One integer per row for the prefix-tree ``group_ids`` from a column of group
    labels (verl's ``uid`` strings, tensors, any hashable values): each label's
    first-seen index."""
    if hasattr(values, "tolist"):
        values = values.tolist()
    first_seen: Dict[Any, int] = {}
    try:
        return [first_seen.setdefault(v, len(first_seen)) for v in values]
    except TypeError as exc:
        raise TypeError(f"group labels must be hashable (one per row): {exc}") from None


def image_groups(multi_modal_inputs: Any) -> List[int]:
    """One group per distinct content of the rows' multimodal inputs (verl's
    ``multi_modal_inputs``: one dict of tensors per row, or None): rows whose images
    differ never share a token in a plan, so it never counts two images' placeholder
    tokens (one id) as one. The tree the rows run on is keyed by image content and
    shares the text before different images too: never more tokens than planned."""
    import hashlib

    keys = []
    for inputs in multi_modal_inputs:
        inputs = getattr(inputs, "data", inputs) or {}
        digest = hashlib.blake2b(digest_size=16)
        for name in sorted(inputs):
            value = inputs[name]
            if value is None:
                continue
            if hasattr(value, "detach"):  # a tensor's bytes, any dtype (bf16 too)
                import torch

                value = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
            host = np.ascontiguousarray(value)
            digest.update(f"{name}{tuple(getattr(inputs[name], 'shape', host.shape))}{inputs[name].dtype}".encode())
            digest.update(host.tobytes())
        keys.append(digest.hexdigest())
    return group_codes(keys)


def coupled_trees(forest: Any, group: int, cap: int, group_name: str, cap_name: str) -> None:
    """Checks a forest whose rows a loss couples, ``group`` consecutive rows at a
    time (DPO's chosen and rejected, a reward model's candidates): planned with
    ``whole_trees=True`` each tree stays in one micro-batch, so each group's rows
    must be one tree (share their prompt) and every tree must fit ``cap``."""
    n = forest.num_rows
    if n % group:
        raise ValueError(f"the batch has {n} rows, not a multiple of {group_name}={group}")
    tree = forest.tree_ids.reshape(-1, group)
    split = np.flatnonzero((tree != tree[:, :1]).any(axis=1))
    if split.size:
        g = int(split[0])
        raise ValueError(f"shared_prefix with {group_name}={group}: rows {g * group}..{g * group + group - 1} share "
                         "no prefix (they are not one prefix tree: different first tokens or group ids), so no "
                         "micro-batch plan can keep them together as a tree")
    tokens = forest.subset_costs(forest.trees)[0]
    if tokens.size and int(tokens.max()) > cap:
        t = int(tokens.argmax())
        raise ValueError(f"shared_prefix with {group_name}={group}: the prefix tree of rows "
                         f"{forest.trees[t][:4].tolist()}{'...' if len(forest.trees[t]) > 4 else ''} holds "
                         f"{int(tokens[t])} physical tokens, more than {cap_name}={cap}: rows the loss couples "
                         "cannot be split over micro-batches")


def padded_forest(cols: Mapping[str, Any], group_key: Optional[str], *, missing_group_ok: bool):
    """``(forest, group ids or None)``: the :class:`~seqpack.PrefixForest` of a batch's
    padded rows (``input_ids`` where ``attention_mask`` is set; left padding, right
    padding or both), rows sharing only within one value of the ``group_key``
    column. A missing ``group_key`` column is allowed (no groups) only with
    ``missing_group_ok`` (verl's optional ``uid``)."""
    from ..planning.prefix_forest import PrefixForest

    if "input_ids" not in cols:
        raise ValueError("shared_prefix needs the batch's 'input_ids' (the trie is built from the tokens)")
    groups = None
    if group_key is not None and (group_key in cols or not missing_group_ok):
        if group_key not in cols:
            raise ValueError(f"group_key {group_key!r} is not a column of the batch")
        groups = group_codes(cols[group_key])
    if cols.get("multi_modal_inputs") is not None:  # a VLM's rows: share only with rows holding the same images
        images = image_groups(cols["multi_modal_inputs"])
        groups = images if groups is None else group_codes(list(zip(groups, images)))
    ids = cols["input_ids"]
    if is_nested(ids):  # verl's engine rows: real tokens only, offsets per row
        return PrefixForest.from_packed(ids.values(), ids.offsets(), group_ids=groups), groups
    return PrefixForest.from_padded(ids, cols["attention_mask"], group_ids=groups), groups
