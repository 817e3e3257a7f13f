"""Vision-language models on a prefix tree: each distinct image encoded once (issue 53).

GRPO samples every prompt G times, and a VLM prompt holds its images: the padded
batch encodes each image G times. On a tree the prompt, its image placeholder tokens
included, is laid out once, and :func:`multimodal_kwargs` (what
``hf.tree_kwargs(tree, model=, pixel_values=, ...)`` runs) hands the model the images
of the tree's physical placeholder tokens, in tree order, each once, with the M-RoPE
positions ``[3, 1, T]`` every physical token has in its rows (the model's own
``get_rope_index`` run on the rows)::

    rows (padded batch)                    tree (physical order)
    r0  s <A A A A> q | a a                s <A A A A> q -+- a a
    r1  s <A A A A> q | b                                 +- b
    r2  s <B B B B> q | c c                s <B B B B> q --- c c
    pixel_values  A A B  (3 encodes)       pixel_values  A B  (2 encodes)

The placeholder tokens of two images have one id, so a tree built from the ids alone
would share ``r2``'s image with ``r0``'s. :func:`image_keys` gives each image's tokens
a key of their own (one key per distinct content), which the tree builders take
(``PrefixTreeBatch.from_padded(..., keys=)``); :func:`multimodal_kwargs` refuses a
tree whose rows share the tokens of different images.

The family rules are the model's: its ``config.image_token_id`` /
``video_token_id`` mark the placeholder tokens, ``vision_config.spatial_merge_size``
how many an item's ``grid_thw`` fills, ``get_rope_index`` the positions (Qwen2-VL,
Qwen2.5-VL, Qwen3-VL and the families built like them). An item (an image or a
video) fills one run of placeholder tokens, or several (Qwen3-VL's video frames,
each between timestamps).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

__all__ = ["image_keys", "vision_family"]

# token type (mm_token_type_ids) -> (name, pixels, grid)
_MEDIA = {1: ("image", "pixel_values", "image_grid_thw"), 2: ("video", "pixel_values_videos", "video_grid_thw")}
_VIDEO_VALUES = ("second_per_grid_ts",)  # one value per video (Qwen2.5-VL's seconds per temporal patch)
KNOWN = frozenset({"pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids",
                   "position_ids", *_VIDEO_VALUES})


def _unwrapped(model: Any) -> Any:
    """The model under DDP / FSDP1 (``.module``), PEFT (``get_base_model``) and
    ``torch.compile`` (``_orig_mod``)."""
    for _ in range(8):
        if hasattr(model, "get_rope_index"):
            return model
        inner = getattr(model, "_orig_mod", None)
        if inner is None and hasattr(model, "get_base_model"):
            inner = model.get_base_model()
        if inner is None:
            inner = getattr(model, "module", None)
        if inner is None or inner is model:
            return model
        model = inner
    return model


def vision_family(model: Any) -> Optional[Any]:
    """The module of ``model`` (a transformers VLM, under DDP / PEFT wrappers) that
    owns ``get_rope_index`` and the placeholder ids: the model itself or its
    ``.model``; None for a model without (a text model, another VLM design)."""
    model = _unwrapped(model)
    for owner in (model, getattr(model, "model", None)):
        config = getattr(owner, "config", None)
        if callable(getattr(owner, "get_rope_index", None)) and getattr(config, "image_token_id", None) is not None \
                and getattr(getattr(config, "vision_config", None), "spatial_merge_size", None):
            return owner
    return None


def _family(model: Any) -> Any:
    if model is None:
        raise ValueError("multimodal inputs on a tree need model= (the VLM: its placeholder ids, merge size and "
                         "get_rope_index give the tree's images and M-RoPE positions)")
    owner = vision_family(model)
    if owner is None:
        raise ValueError(f"{type(model).__name__} has no get_rope_index with image_token_id and a vision "
                         "spatial_merge_size (Qwen2-VL, Qwen2.5-VL, Qwen3-VL): its images cannot run on a tree")
    return owner


def _inputs(multimodal: Dict[str, Any]) -> Dict[str, Any]:
    unknown = sorted(k for k, v in multimodal.items() if v is not None and k not in KNOWN)
    if unknown:
        raise ValueError(f"multimodal inputs {unknown} are not taken on a tree (it takes {sorted(KNOWN)}): run "
                         "such a batch without a tree")
    return {k: v for k, v in multimodal.items() if v is not None}


def _host(x: Any) -> np.ndarray:
    return np.asarray(x.detach().cpu() if hasattr(x, "detach") else x)


def _token_types(owner: Any, ids: np.ndarray, cu: np.ndarray, inputs: Dict[str, Any], rows_mask: Any) -> np.ndarray:
    """[N] the type of each logical token (0 text, 1 image, 2 video): the caller's
    ``mm_token_type_ids`` [B, S] at its rows' tokens (``rows_mask``: where they are;
    None: each row's first tokens), else the model's placeholder ids."""
    config = owner.config
    derived = np.zeros(ids.shape[0], dtype=np.int64)
    for kind in _MEDIA:
        token = getattr(config, f"{_MEDIA[kind][0]}_token_id", None)
        if token is not None:
            derived[ids == int(token)] = kind
    given = inputs.get("mm_token_type_ids")
    if given is None:
        return derived
    types = _host(given).astype(np.int64)
    lengths = np.diff(cu)
    if types.ndim != 2 or types.shape[0] != lengths.shape[0]:
        raise ValueError(f"mm_token_type_ids must be [B, S] with one row per row of the tree ({lengths.shape[0]}), "
                         f"got {tuple(types.shape)}")
    if rows_mask is None:
        if types.shape[1] < (int(lengths.max()) if lengths.size else 0):
            raise ValueError(f"mm_token_type_ids has {types.shape[1]} columns, fewer than the longest row "
                             f"({int(lengths.max())} tokens)")
        real = np.arange(types.shape[1])[None, :] < lengths[:, None]
    else:
        real = _host(rows_mask).astype(bool)
        if real.shape != types.shape or not np.array_equal(real.sum(1), lengths):
            raise ValueError(f"attention_mask (where mm_token_type_ids' rows are) must be [B, S] like it, with each "
                             f"row's token count {lengths.tolist()}")
    flat = types[real]
    if not np.array_equal(flat != 0, derived != 0):
        at = int(np.flatnonzero((flat != 0) != (derived != 0))[0])
        raise ValueError(f"mm_token_type_ids disagrees with the model's placeholder ids at logical token {at} (type "
                         f"{int(flat[at])}, token id {int(ids[at])}): the model places image features by id")
    return flat


def _items(types: np.ndarray, cu: np.ndarray, grids: Dict[int, Optional[np.ndarray]], merge: int) -> List[Tuple]:
    """The rows' items in row order: ``(kind, k, row, logical token indices)``, the
    ``k``-th item of its kind (its grid ``grids[kind][k]``) filling ``prod(grid) /
    merge**2`` placeholder tokens: one run of them, or several runs in one row."""
    rows = np.searchsorted(cu, np.arange(types.shape[0]), side="right") - 1
    marked = np.flatnonzero(types)
    items: List[Tuple] = []
    if marked.size:
        cut = np.flatnonzero((np.diff(marked) != 1) | (np.diff(types[marked]) != 0) | (np.diff(rows[marked]) != 0))
        starts = np.concatenate([[0], cut + 1])
        ends = np.concatenate([cut + 1, [marked.size]])
        runs = [(int(types[marked[a]]), int(rows[marked[a]]), marked[a:b]) for a, b in zip(starts, ends)]
    else:
        runs = []
    taken = {kind: 0 for kind in _MEDIA}
    open_item: Optional[List[Any]] = None  # kind, k, row, need, [runs]
    for kind, row, run in runs:
        if open_item is not None and (open_item[0] != kind or open_item[2] != row):
            raise ValueError(f"row {open_item[2]}: a {_MEDIA[open_item[0]][0]} of grid_thw "
                             f"{grids[open_item[0]][open_item[1]].tolist()} needs {open_item[3]} more placeholder "
                             f"tokens than the row holds before its next item")
        if open_item is None:
            grid = grids.get(kind)
            k = taken[kind]
            if grid is None or k >= grid.shape[0]:
                raise ValueError(f"the rows hold more {_MEDIA[kind][0]}s than {_MEDIA[kind][2]} gives "
                                 f"({0 if grid is None else grid.shape[0]})")
            taken[kind] += 1
            open_item = [kind, k, row, int(np.prod(grid[k])) // (merge * merge), []]
        open_item[4].append(run)
        open_item[3] -= run.shape[0]
        if open_item[3] < 0:
            raise ValueError(f"row {row}: a run of {run.shape[0]} {_MEDIA[kind][0]} placeholder tokens is longer than "
                             f"its grid_thw {grids[kind][open_item[1]].tolist()} fills (prod / {merge}**2)")
        if open_item[3] == 0:
            items.append((kind, open_item[1], row, np.concatenate(open_item[4])))
            open_item = None
    if open_item is not None:
        raise ValueError(f"row {open_item[2]} ends {open_item[3]} placeholder tokens short of its last "
                         f"{_MEDIA[open_item[0]][0]}")
    for kind, (name, _, grid_key) in _MEDIA.items():
        given = 0 if grids.get(kind) is None else grids[kind].shape[0]
        if taken[kind] != given:
            raise ValueError(f"{grid_key} gives {given} {name}s; the rows' placeholder tokens hold {taken[kind]}")
    return items


def _grids(inputs: Dict[str, Any]) -> Dict[int, Optional[np.ndarray]]:
    out: Dict[int, Optional[np.ndarray]] = {}
    for kind, (name, pixels, grid_key) in _MEDIA.items():
        grid = inputs.get(grid_key)
        if (grid is None) != (inputs.get(pixels) is None):
            raise ValueError(f"{pixels} and {grid_key} go together: got one without the other")
        out[kind] = None if grid is None else _host(grid).astype(np.int64).reshape(-1, 3)
    return out


def _pixel_offsets(inputs: Dict[str, Any], kind: int, grid: np.ndarray) -> np.ndarray:
    """Each item's first row of its pixel tensor ([items + 1]): ``prod(grid_thw)``
    patch rows per item, as the processor concatenates them."""
    pixels = inputs[_MEDIA[kind][1]]
    offsets = np.concatenate([[0], np.cumsum(np.prod(grid, axis=1))]).astype(np.int64)
    if pixels.dim() != 2 or pixels.shape[0] != offsets[-1]:
        raise ValueError(f"{_MEDIA[kind][1]} must be [patches, dim] with prod(grid_thw) patches per item "
                         f"({int(offsets[-1])} in all), got {tuple(pixels.shape)}")
    return offsets


def _content_classes(items: List[Tuple], inputs: Dict[str, Any], grids: Dict[int, Optional[np.ndarray]]) -> np.ndarray:
    """[items] an id per distinct content: two items get one id exactly when they are
    of one kind with equal grid, pixels (bit for bit: NaN pixels compare too) and
    per-video values. Items are bucketed by an integer fingerprint of their bits
    (exact, deterministic on any device), each checked against its bucket's first
    item in one comparison for the whole batch (one host sync per kind); an item a
    fingerprint matched by chance gets its own id."""
    import torch

    classes = np.arange(len(items), dtype=np.int64)
    for kind, (_, pixels_key, _) in _MEDIA.items():
        grid = grids.get(kind)
        if grid is None:
            continue
        offsets = _pixel_offsets(inputs, kind, grid)
        pixels = inputs[pixels_key].detach()
        device = pixels.device
        bits = pixels.contiguous().view(torch.int16 if pixels.element_size() == 2 else torch.int32)
        bits = bits.view(pixels.shape[0], -1)
        counts = torch.from_numpy(np.prod(grid, axis=1)).to(device)
        item_of_row = torch.repeat_interleave(torch.arange(grid.shape[0], device=device), counts)
        local = torch.arange(pixels.shape[0], device=device) - torch.from_numpy(offsets[:-1]).to(device)[item_of_row]
        row_sums = bits.sum(1, dtype=torch.int64)
        prints = torch.zeros(grid.shape[0], 2, dtype=torch.int64, device=device)
        prints[:, 0].index_add_(0, item_of_row, row_sums)
        prints[:, 1].index_add_(0, item_of_row, row_sums * (local + 1))
        prints = prints.cpu().numpy()
        values = {name: _host(inputs[name]).reshape(-1) for name in _VIDEO_VALUES if kind == 2 and name in inputs}
        first: Dict[Tuple, int] = {}  # fingerprint -> the first item (its index in items) with it
        same: List[Tuple[int, int]] = []  # (item, its bucket's first item) to confirm
        for i, (item_kind, k, _, _) in enumerate(items):
            if item_kind != kind:
                continue
            key = (tuple(grid[k].tolist()), tuple(prints[k].tolist()), tuple(float(v[k]) for v in values.values()))
            rep = first.setdefault(key, i)
            if rep != i:
                same.append((i, rep))
        if not same:
            continue
        ks = [(items[i][1], items[rep][1]) for i, rep in same]
        rows_a = np.concatenate([np.arange(offsets[k], offsets[k + 1]) for k, _ in ks])
        rows_b = np.concatenate([np.arange(offsets[r], offsets[r + 1]) for _, r in ks])
        pair_of_row = np.repeat(np.arange(len(ks)), [offsets[k + 1] - offsets[k] for k, _ in ks])
        differ = (bits[torch.from_numpy(rows_a).to(device)] != bits[torch.from_numpy(rows_b).to(device)]).any(1)
        bad = torch.zeros(len(ks), dtype=torch.int64, device=device).index_add_(
            0, torch.from_numpy(pair_of_row).to(device), differ.to(torch.int64)).cpu().numpy()
        for (i, rep), wrong in zip(same, bad):
            if not wrong:
                classes[i] = classes[rep]
            # else: a fingerprint collision; the item keeps its own id (a repeat of it is compared below)
        for (i, rep), wrong in zip(same, bad):  # collisions: exact pairwise among the bucket's others
            if wrong:
                for j, other in same:
                    if j < i and classes[j] == j and other == rep and torch.equal(
                            bits[offsets[items[i][1]]:offsets[items[i][1] + 1]],
                            bits[offsets[items[j][1]]:offsets[items[j][1] + 1]]):
                        classes[i] = j
                        break
    return classes


def image_keys(model: Any, input_ids: Any, attention_mask: Any, **multimodal: Any) -> Any:
    """``[B, S]`` int64 keys of padded VLM rows for the tree builders
    (``PrefixTreeBatch.from_padded(input_ids, attention_mask, keys=...)``): the ids,
    with each image's or video's placeholder tokens given the key ``-(1 + c)`` of its
    content ``c`` (equal pixels, grid and per-video values: one key), so rows share an
    item's tokens exactly when they hold that item. ``multimodal``: the padded batch's
    ``pixel_values`` / ``image_grid_thw`` / ``pixel_values_videos`` /
    ``video_grid_thw`` / ``second_per_grid_ts`` / ``mm_token_type_ids``, as the
    processor gives them. A tensor on the device of ``input_ids``."""
    import torch

    ids, mask, found = padded_items(model, input_ids, attention_mask, multimodal)
    return torch.from_numpy(found.keys(ids, mask)).to(input_ids.device if hasattr(input_ids, "device") else "cpu")


class RowItems:
    """The images and videos of padded rows (:func:`padded_items`): ``items``, one
    ``(kind, k, row, logical token indices)`` per item in row order (``kind`` 1 an
    image, 2 a video; ``k`` its index among its kind), ``classes`` [items] one id per
    distinct content, ``grids`` {kind: [n, 3] grid_thw}, ``cu`` the rows' offsets
    into their logical tokens, ``owner`` the model's module with the family rules."""

    __slots__ = ("owner", "items", "classes", "grids", "cu")

    def __init__(self, owner: Any, items: List[Tuple], classes: np.ndarray, grids: Dict[int, Any],
                 cu: np.ndarray) -> None:
        self.owner, self.items, self.classes, self.grids, self.cu = owner, items, classes, grids, cu

    def keys(self, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
        """:func:`image_keys` of the padded rows these items are of (host int64)."""
        keyed = ids[mask]
        for (_, _, _, tokens), cls in zip(self.items, self.classes):
            keyed[tokens] = -1 - cls
        out = ids.copy()
        out[mask] = keyed
        return out

    def grid_of(self, i: int) -> np.ndarray:
        """Item ``i``'s grid_thw."""
        kind, k = self.items[i][0], self.items[i][1]
        return self.grids[kind][k]


def padded_items(model: Any, input_ids: Any, attention_mask: Any,
                 multimodal: Dict[str, Any]) -> Tuple[np.ndarray, np.ndarray, RowItems]:
    """The host ``[B, S]`` ids and mask of padded VLM rows, and their items."""
    owner = _family(model)
    inputs = _inputs(multimodal)
    inputs.pop("position_ids", None)  # where tokens sit, not what they are
    ids = _host(input_ids).astype(np.int64)
    mask = _host(attention_mask).astype(bool)
    if ids.ndim != 2 or mask.shape != ids.shape:
        raise ValueError(f"input_ids and attention_mask must be [B, S] of one shape, got {ids.shape} and {mask.shape}")
    cu = np.concatenate([[0], np.cumsum(mask.sum(1))]).astype(np.int64)
    grids = _grids(inputs)
    types = _token_types(owner, ids[mask], cu, inputs, mask)
    items = _items(types, cu, grids, int(owner.config.vision_config.spatial_merge_size))
    return ids, mask, RowItems(owner, items, _content_classes(items, inputs, grids), grids, cu)


def multimodal_kwargs(tree: Any, model: Any, device: Any = None, attention_mask: Any = None,
                      **multimodal: Any) -> Dict[str, Any]:
    """``tree.hf_kwargs(device)`` plus the multimodal inputs of its rows, each
    distinct item once in tree order (see the module docstring): ``pixel_values`` /
    ``image_grid_thw`` (and the video counterparts, ``second_per_grid_ts``),
    ``mm_token_type_ids`` ``[1, T]`` and ``position_ids`` ``[3, 1, T]``, the M-RoPE
    positions each physical token has in its rows (0 at pad tokens).

    ``multimodal`` are the rows' inputs as the padded batch holds them (items in row
    order; ``mm_token_type_ids`` ``[B, S]`` with the rows' tokens where
    ``attention_mask`` ``[B, S]`` is non-zero, or each row's first tokens without
    one). ``position_ids``, optional: the rows' M-RoPE positions already computed,
    ``[3, N]`` or verl's ``[4, N]`` (text positions first) at the rows' ``N`` logical
    tokens in order (verl's nested ``position_ids.values()``), used instead of the
    model's ``get_rope_index``. Raises ValueError, naming the row, where the
    placeholder tokens and the grids disagree, where rows share the tokens of
    different items (build the tree with :func:`image_keys`) or give a shared token
    different positions."""
    import torch

    owner = _family(model)
    inputs = _inputs(multimodal)
    kwargs = tree.hf_kwargs(device)
    logical = tree.logical_index
    cu = tree.cu_seqlens
    ids = tree.input_ids[logical]
    grids = _grids(inputs)
    types = _token_types(owner, ids, cu, inputs, attention_mask)
    physical_types = np.zeros(tree.num_tokens, dtype=np.int64)
    physical_types[logical] = types
    if not np.array_equal(physical_types[logical], types):
        at = int(np.flatnonzero(physical_types[logical] != types)[0])
        raise ValueError(f"mm_token_type_ids gives physical token {int(logical[at])} two types in two rows")
    items = _items(types, cu, grids, int(owner.config.vision_config.spatial_merge_size))
    classes = _content_classes(items, inputs, grids)
    # the tree's items: one per first physical token, which every row holding it must
    # hold as the same item laid on the same physical tokens
    placed: Dict[int, Tuple[int, np.ndarray, int]] = {}
    for i, (kind, k, row, tokens) in enumerate(items):
        physical = logical[tokens]
        first = int(physical[0])
        seen = placed.get(first)
        if seen is None:
            placed[first] = (i, physical, int(classes[i]))
        elif seen[2] != classes[i] or not np.array_equal(seen[1], physical):
            other = items[seen[0]][2]
            raise ValueError(f"rows {other} and {row} share the placeholder tokens of physical token {first} but hold "
                             f"different {_MEDIA[kind][0]}s there: build the tree with keys="
                             "seqpack.frameworks.hf_vlm.image_keys(model, input_ids, attention_mask, ...) so that "
                             "only rows holding one item share its tokens")
    order = [placed[first][0] for first in sorted(placed)]
    dev = kwargs["input_ids"].device
    for kind, (_, pixels_key, grid_key) in _MEDIA.items():
        grid = grids.get(kind)
        if grid is None:
            continue
        chosen = [items[i][1] for i in order if items[i][0] == kind]
        offsets = _pixel_offsets(inputs, kind, grid)
        rows = np.concatenate([np.arange(offsets[k], offsets[k + 1]) for k in chosen]) if chosen else \
            np.zeros(0, dtype=np.int64)
        pixels = inputs[pixels_key]
        kwargs[pixels_key] = pixels.index_select(0, torch.from_numpy(rows).to(pixels.device)).to(dev)
        picked = torch.from_numpy(np.asarray(chosen, dtype=np.int64))
        kwargs[grid_key] = torch.as_tensor(inputs[grid_key]).reshape(-1, 3).cpu()[picked].to(dev)
        for name in _VIDEO_VALUES:
            if kind == 2 and name in inputs:
                kwargs[name] = torch.as_tensor(inputs[name]).reshape(-1).cpu()[picked].to(dev)
    kwargs["mm_token_type_ids"] = torch.from_numpy(physical_types)[None].to(dev)
    given = inputs.get("position_ids")
    positions = _mrope_positions(owner, tree, ids, types, inputs, grids) if given is None else \
        _given_positions(tree, given)
    kwargs["position_ids"] = positions.to(dev)
    return kwargs


def _given_positions(tree: Any, given: Any) -> Any:
    """``[3, 1, T]`` from the rows' positions ``[3 | 4, N]`` per logical token (the
    M-RoPE rows: the last three), checked equal wherever rows share a token."""
    import torch

    rows = torch.as_tensor(given).detach().cpu().to(torch.long)
    n = tree.num_logical_tokens
    if rows.dim() != 2 or rows.shape[0] not in (3, 4) or rows.shape[1] != n:
        raise ValueError(f"position_ids must be the rows' M-RoPE positions [3, N] or [4, N] at their N = {n} "
                         f"logical tokens, got {tuple(rows.shape)}")
    rows = rows[-3:]
    real = tree.num_tokens - tree.num_pad_tokens
    first = torch.from_numpy(tree.first_logical[:real].copy())
    out = torch.zeros(3, 1, tree.num_tokens, dtype=torch.long)
    out[:, 0, :real] = rows[:, first]
    logical = torch.from_numpy(tree.logical_index.copy())
    clash = (out[:, 0, logical] != rows).any(0).nonzero()
    if clash.numel():
        at = int(clash[0, 0])
        raise ValueError(f"position_ids give logical token {at} other positions than the row that first holds its "
                         f"physical token {int(logical[at])}: rows that share a token must agree on its position")
    return out


def _mrope_positions(owner: Any, tree: Any, ids: np.ndarray, types: np.ndarray, inputs: Dict[str, Any],
                     grids: Dict[int, Optional[np.ndarray]]) -> Any:
    """``[3, 1, T]`` int64: the model's ``get_rope_index`` on the rows (right-padded,
    on the host), each physical token's value taken from its first row."""
    import torch

    cu = tree.cu_seqlens
    lengths = np.diff(cu)
    live = np.flatnonzero(lengths)  # an empty row has no position
    out = torch.zeros(3, 1, tree.num_tokens, dtype=torch.long)
    if not live.size:
        return out
    width = int(lengths.max())
    column = np.arange(ids.shape[0]) - np.repeat(cu[:-1], lengths)
    slot = np.repeat(np.searchsorted(live, np.arange(lengths.shape[0])), lengths)
    rows_ids = np.zeros((live.size, width), dtype=np.int64)
    rows_types = np.zeros((live.size, width), dtype=np.int64)
    rows_ids[slot, column] = ids
    rows_types[slot, column] = types
    mask = np.arange(width)[None, :] < lengths[live][:, None]
    extra = {name: torch.as_tensor(inputs[name]).cpu() for name in _VIDEO_VALUES if name in inputs}
    positions, _ = owner.get_rope_index(
        torch.from_numpy(rows_ids), mm_token_type_ids=torch.from_numpy(rows_types),
        image_grid_thw=None if grids.get(1) is None else torch.from_numpy(grids[1]),
        video_grid_thw=None if grids.get(2) is None else torch.from_numpy(grids[2]),
        attention_mask=torch.from_numpy(mask.astype(np.int64)), **extra)
    real = tree.num_tokens - tree.num_pad_tokens
    first = tree.first_logical[:real]
    out[:, 0, :real] = positions[:, torch.from_numpy(slot[first]), torch.from_numpy(column[first])].to(torch.long)
    return out
