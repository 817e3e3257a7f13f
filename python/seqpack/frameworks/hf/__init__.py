"""HF transformers: train a model on packed sequences through seqpack.

``register()`` adds an attention implementation named ``"seqpack"`` to
transformers' ``AttentionInterface`` - :func:`seqpack.varlen_attention`, so any
backend (flash-attn, PyTorch varlen, the exact CPU reference) - together with
the matching mask function in ``AttentionMaskInterface``: without one,
transformers skips mask creation for an unknown implementation and a padded
batch's ``attention_mask`` would silently never reach the attention.
:class:`PackingCollator` flattens a list of examples into one row as
transformers' ``DataCollatorWithFlattening`` does - its options (``separator_id``,
``return_flash_attn_kwargs``, ``return_seq_idx``, ``position_ids_start``,
``return_tensors`` ``"pt"`` / ``"np"``), defaults, keys, dtypes and values, empty
examples dropped - optionally padding each sequence to a multiple (2·CP·TP).
Examples of vision-language models with M-RoPE ids (Qwen2-VL, Qwen2.5-VL:
``position_ids [3, n]``) pack to the ``[4, 1, T]`` ids transformers reads as a
packed batch (a text row, then temporal / height / width), their vision inputs
concatenated; see ``docs/vlm.md``.

    >>> from seqpack.integrations import hf                      # doctest: +SKIP
    >>> hf.register()                                             # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="seqpack")  # doctest: +SKIP
    >>> batch = hf.PackingCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])  # doctest: +SKIP
    >>> model(**batch).loss                                       # doctest: +SKIP

Prefix trees (``docs/prefix_tree.md``, :mod:`seqpack.frameworks.hf_tree`, its names
here too): ``register_tree()`` adds ``"seqpack_tree"``, :func:`seqpack.attention`
when ``model(**tree_kwargs(tree))`` passes the tree down to every attention call and
the model's usual attention (SDPA) for every other call; an MoE model's router
statistics on a tree are the rows' (:mod:`seqpack.frameworks.hf_moe`, ``router_counts``);
a VLM's images are encoded once per tree (``tree_kwargs(tree, model=, pixel_values=,
...)``, rows keyed by ``image_keys``: :mod:`seqpack.frameworks.hf_vlm`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from ..._lengths import as_int64, as_positive_int, as_real
from ..hf_moe import router_counts  # noqa: F401
from ..hf_vlm import image_keys  # noqa: F401
from ..hf_tree import (TREE_KWARG, TREE_NAME, pass_forward, register_tree, restore_attention,  # noqa: F401
                      tree_attention_forward, tree_kwargs, tree_name, use_tree_attention)

NAME = "seqpack"
IGNORE_INDEX = -100


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      sliding_window: Optional[int] = None, softcap=None, is_causal: Optional[bool] = None,
                      backend: str = "auto", **kwargs):
    """transformers' attention-function contract: ``query`` ``[B, Hq, S, D]``,
    ``key``/``value`` ``[B, Hk, S_k, D]``; returns ``([B, S, Hq, D], None)``.

    Sequences come from, in this order: a 2-D padding ``attention_mask`` (rows
    unpadded), ``cu_seq_lens_q/k`` + ``max_length_q/k`` keyword arguments (the
    collator's), ``position_ids`` restarting inside a single row (packed; see
    :func:`sequence_starts` for 3-D M-RoPE ids), else each batch row is one
    sequence.

    Under ``torch.autocast`` it follows SDPA: transformers hands it float32 q/k
    (after the rotary embedding) and a bfloat16 v; all three are cast to the
    autocast dtype and the output comes back in it (:func:`seqpack.varlen_attention`)."""
    import torch

    from ...training.attention import varlen_attention

    if as_real(dropout, "dropout", minimum=0, maximum=1) and module.training:
        raise ValueError("seqpack attention has no attention dropout; set the model's attention_dropout to 0")
    if softcap is not None:
        raise ValueError("seqpack attention does not support logit softcapping")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    sliding_window = 0 if sliding_window is None else as_positive_int(sliding_window, "sliding_window", allow_zero=True)
    window = (sliding_window - 1, sliding_window - 1) if sliding_window else (-1, -1)
    batch, _, s_q, _ = query.shape
    s_k = key.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # [B, S, H, D]
    attend = dict(causal=bool(causal), softmax_scale=scaling, window_size=window, backend=backend)

    if attention_mask is not None and attention_mask.dim() == 2:
        mask = attention_mask[:, -s_k:].bool()
        if s_q != s_k:
            raise ValueError("a 2-D attention_mask needs as many queries as keys (no KV cache in seqpack attention)")
        rows = mask.reshape(-1).nonzero().squeeze(1)  # sorted: the offsets are a search, not mask.sum(1) (int64)
        cu = torch.searchsorted(rows, torch.arange(batch + 1, device=rows.device) * s_k).to(torch.int32).cpu()
        longest = int(cu.diff().max()) if batch else 0
        flat = [t.reshape(batch * s_q, *t.shape[2:]).index_select(0, rows) for t in (q, k, v)]
        out = varlen_attention(*flat, cu, cu, longest, longest, **attend)
        full = out.new_zeros(batch * s_q, *out.shape[1:]).index_copy(0, rows, out)
        return full.view(batch, s_q, *out.shape[1:]), None
    if attention_mask is not None:
        raise ValueError("seqpack attention takes a 2-D padding mask or none (4-D masks are not supported)")

    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is None or cu_k is None or max_q is None or max_k is None:
        position_ids = kwargs.get("position_ids")
        cu_q = cu_k = None
        if position_ids is not None and batch == 1 and s_q == s_k and s_q > 1 and position_ids.shape[-1] == s_q:
            starts = sequence_starts(position_ids).to(torch.int32).cpu()
            if starts.numel() > 1:
                cu_q = cu_k = torch.cat([starts, torch.tensor([s_q], dtype=torch.int32)])
                max_q = max_k = int(cu_q.diff().max())
        if cu_q is None:  # every row one sequence
            cu_q = torch.arange(batch + 1, dtype=torch.int32) * s_q
            cu_k = torch.arange(batch + 1, dtype=torch.int32) * s_k
            max_q, max_k = s_q, s_k
    flat = [t.reshape(-1, *t.shape[2:]) for t in (q, k, v)]
    out = varlen_attention(*flat, cu_q, cu_k, int(max_q), int(max_k), **attend)
    return out.view(batch, s_q, *out.shape[1:]), None


def sequence_starts(position_ids):
    """The tokens of one packed row where a sequence starts, from its position ids:
    where they are at their minimum (transformers' ``prepare_fa_kwargs_from_position_ids``).

    * ``[S]`` / ``[1, S]``: the ids themselves.
    * ``[4, 1, S]`` (Qwen2-VL / Qwen2.5-VL packed: text row, then temporal / height /
      width): the text row, as transformers does.
    * ``[k, 1, S]`` otherwise (M-RoPE ``[3, 1, S]`` without a text row): tokens where
      every row is at the minimum. A single row would not do: an image opening a
      sequence holds its temporal id for all its tokens. Videos whose temporal ids
      stay at the start position for several frames (a frame step under one
      position) still read as several starts there: give ``cu_seq_lens_q/k`` or the
      text row with such data.

    >>> import torch
    >>> t = torch.tensor([0, 0, 0, 0, 2, 0, 1])                  # a 2x2 image opens the first sequence
    >>> hw = torch.tensor([0, 0, 1, 1, 2, 0, 1]), torch.tensor([0, 1, 0, 1, 2, 0, 1])
    >>> sequence_starts(torch.stack([t, *hw])[:, None]).tolist()
    [0, 5]
    >>> sequence_starts(t[None]).tolist()                          # one row: every image token a start
    [0, 1, 2, 3, 5]
    """
    if position_ids.dim() == 3 and position_ids.shape[0] > 1:
        rows = position_ids.reshape(position_ids.shape[0], -1)
        if rows.shape[0] == 4:
            rows = rows[:1]
        return (rows == rows.min()).all(0).nonzero().squeeze(1)
    flat = position_ids.reshape(-1)
    return (flat == flat.min()).nonzero().squeeze(1)


def register(name: str = NAME, backend: str = "auto") -> str:
    """Registers seqpack's attention (and its mask function) with transformers under
    ``name``; use ``attn_implementation=name``. Returns ``name``."""
    import functools

    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    fn = attention_forward if backend == "auto" else functools.partial(attention_forward, backend=backend)
    AttentionInterface.register(name, fn)
    # Same mask contract as flash-attention: None when nothing is padded, else the
    # 2-D padding mask, which attention_forward unpads.
    AttentionMaskInterface.register(name, flash_attention_mask)
    return name


# Vision inputs of Qwen2-VL-style processors: one entry per image / video (patches
# of all images back to back), so a packed row's are the examples' concatenated.
VISION_KEYS = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
# Keys that mean nothing in one packed row, left out without a warning (transformers
# drops every key but input_ids and labels).
_PACKED_AWAY = frozenset({"input_ids", "labels", "position_ids", "attention_mask"})


def _host_ints(value: Any) -> np.ndarray:
    """A token list, NumPy array or torch tensor (any device) as flat int64."""
    if hasattr(value, "detach"):
        value = value.detach().cpu().numpy()
    return np.asarray(value, dtype=np.int64).reshape(-1)


def _example_mrope(f: Mapping[str, Any], i: int, n: int) -> Optional[np.ndarray]:
    """Example ``i``'s M-RoPE ids as ``[k, n]`` (``k > 1``; ``[k, 1, n]`` from a
    batched ``get_rope_index`` is squeezed), or None for none or 1-D ids."""
    if f.get("position_ids") is None:
        return None
    pos = f["position_ids"]
    pos = np.asarray(pos.detach().cpu() if hasattr(pos, "detach") else pos)
    if pos.ndim == 3 and pos.shape[1] == 1:
        pos = pos[:, 0]
    if pos.ndim <= 1 or (pos.ndim == 2 and pos.shape[0] == 1):
        return None  # text positions: the collator's own restart per sequence
    if pos.ndim != 2 or pos.shape[1] != n or pos.dtype.kind not in "iu":
        raise ValueError(f"features[{i}]['position_ids'] must be integer M-RoPE ids [k, n] (or [k, 1, n]) with "
                         f"n = {n} tokens, got {pos.dtype} {pos.shape}")
    return pos.astype(np.int64)


@dataclass
class PackingCollator:
    """Flattens examples into one packed row: a drop-in for transformers'
    ``DataCollatorWithFlattening`` (5.24) - its options, defaults, keys, dtypes and
    values - with per-sequence padding and M-RoPE / vision inputs on top.

    transformers' options, with its defaults:
        return_position_ids: ``position_ids [1, T]``, restarting at
            ``position_ids_start`` for every sequence.
        separator_id: the label of every sequence's first token (-100), so the
            shifted causal-LM loss never predicts a sequence's first token from the
            previous sequence. ``__call__(..., separator_id=)`` overrides it.
        return_flash_attn_kwargs: ``cu_seq_lens_q/k`` (int32) and ``max_length_q/k``
            (Python ints). ``None`` (the default) is transformers' ``False`` unless a
            seqpack-only layout is asked for (``pad_to_multiple_of > 1`` or
            ``mrope_text_row=False``), where it is ``True``.
        return_seq_idx: ``seq_idx [1, T]`` (int32), the index of each token's
            example (after empty examples are dropped).
        position_ids_start: the position of every sequence's first token (RoBERTa-
            like models number positions from ``padding_idx + 1``).
        return_tensors: ``"pt"`` (torch) or ``"np"`` (NumPy: no torch needed);
            ``__call__(..., return_tensors=)`` overrides it.

    seqpack's own:
        pad_to_multiple_of: pad each sequence to a multiple of this (e.g.
            ``seqpack.alignment(cp, tp)``); padding gets ``pad_token_id`` and label
            -100, continues the position ids and belongs to its sequence in
            ``cu_seq_lens`` and ``seq_idx``.
        mrope_text_row: with M-RoPE examples, put the text positions (restarting
            per sequence) in front of the three M-RoPE rows: ``position_ids [4, 1, T]``,
            what transformers' Qwen2-VL / Qwen2.5-VL take as packed. ``False`` gives
            ``[3, 1, T]``, which transformers never reads as packed: only a varlen
            attention given ``cu_seq_lens_q/k`` keeps the sequences apart then.
        vision_keys: fields concatenated along dimension 0 across the examples
            that have them (Qwen2-VL's ``pixel_values``, ``image_grid_thw``, ...).

    Each example is a mapping with ``input_ids`` (and optionally ``labels``). As in
    transformers, examples without tokens are dropped (no tokens: nothing to
    train on) and a batch of only such examples is a ``ValueError``; ``input_ids``
    and ``labels`` may be lists, NumPy arrays or tensors. Where transformers would
    fail or silently misread, seqpack raises: ``labels`` of another length than
    ``input_ids``, or ``labels`` in some examples and not in others (transformers
    reads the first example's choice for all). Keys other than these, M-RoPE
    ``position_ids``, ``attention_mask`` and ``vision_keys`` are left out, as
    transformers leaves them out, with a warning naming them.

    An example may carry M-RoPE ``position_ids [k, n]`` (or ``[k, 1, n]``; ``k = 3``
    for Qwen2-VL's temporal / height / width, as ``get_rope_index`` gives them): they
    are packed per sequence (examples without them get ``0 .. n-1`` in every row, the
    ids of text), the padding continuing from the sequence's largest id as text
    would; ``position_ids_start`` shifts the text row only. 1-D ``position_ids`` are
    ignored: the collator's own restart per sequence.

    >>> from seqpack.integrations.hf import PackingCollator
    >>> out = PackingCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": []}, {"input_ids": [4, 5]}])
    >>> sorted(out), out["position_ids"].tolist(), out["labels"].tolist()
    (['input_ids', 'labels', 'position_ids'], [[0, 1, 2, 0, 1]], [[-100, 2, 3, -100, 5]])
    >>> out = PackingCollator(return_flash_attn_kwargs=True, return_seq_idx=True, return_tensors="np")(
    ...     [{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    >>> out["cu_seq_lens_q"], out["seq_idx"], out["max_length_q"]
    (array([0, 3, 5], dtype=int32), array([[0, 0, 0, 1, 1]], dtype=int32), 3)
    >>> mrope = [[0, 1, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3]]          # [3, n]: one image token pair
    >>> out = PackingCollator(pad_to_multiple_of=2)([{"input_ids": [7, 8, 8, 9], "position_ids": mrope},
    ...                                              {"input_ids": [4]}])
    >>> out["position_ids"].shape, out["position_ids"][:, 0].tolist()
    (torch.Size([4, 1, 6]), [[0, 1, 2, 3, 0, 1], [0, 1, 1, 3, 0, 1], [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]])
    """

    pad_to_multiple_of: int = 1
    pad_token_id: int = 0
    return_position_ids: bool = True
    return_flash_attn_kwargs: Optional[bool] = None
    mrope_text_row: bool = True
    vision_keys: Sequence[str] = VISION_KEYS
    separator_id: int = IGNORE_INDEX
    return_seq_idx: bool = False
    position_ids_start: int = 0
    return_tensors: str = "pt"

    def flash_attn_kwargs(self) -> bool:
        """Whether ``cu_seq_lens_q/k`` and ``max_length_q/k`` are emitted (what
        ``return_flash_attn_kwargs=None`` resolves to)."""
        if self.return_flash_attn_kwargs is not None:
            return bool(self.return_flash_attn_kwargs)
        return as_positive_int(self.pad_to_multiple_of, "pad_to_multiple_of") > 1 or not self.mrope_text_row

    def __call__(self, features: Sequence[Mapping[str, Any]], return_tensors: Optional[str] = None,
                 separator_id: Optional[int] = None) -> Dict[str, Any]:
        multiple = as_positive_int(self.pad_to_multiple_of, "pad_to_multiple_of")
        fmt = self.return_tensors if return_tensors is None else return_tensors
        if not isinstance(fmt, str) or fmt not in ("pt", "np"):
            raise ValueError(f"return_tensors must be one of ('pt', 'np'), got {fmt!r}")
        sep = as_int64(self.separator_id if separator_id is None else separator_id, "separator_id")
        start = as_int64(self.position_ids_start, "position_ids_start")
        pad_id = as_int64(self.pad_token_id, "pad_token_id")
        flash = self.flash_attn_kwargs()

        kept: List[Mapping[str, Any]] = []
        where: List[int] = []  # the kept examples' indices in features
        ids: List[np.ndarray] = []
        for i, f in enumerate(features):
            if not isinstance(f, Mapping) or "input_ids" not in f:
                raise ValueError(f"features[{i}] has no 'input_ids' (each example must be a mapping with them)")
            x = _host_ints(f["input_ids"])
            if x.size:  # examples without tokens are dropped, as transformers drops them
                kept.append(f)
                where.append(i)
                ids.append(x)
        if not kept:
            raise ValueError("every example of the batch is empty (no input_ids): nothing to pack")
        with_labels = [f.get("labels") is not None for f in kept]
        if any(with_labels) and not all(with_labels):
            raise ValueError(f"the examples must all have labels or none: features[{where[with_labels.index(False)]}] "
                             f"has none, features[{where[with_labels.index(True)]}] has some (transformers would fail "
                             f"or use the first example's choice for all)")
        labels: List[np.ndarray] = []
        mrope: List[Optional[np.ndarray]] = []
        dropped = set()
        for i, f, x in zip(where, kept, ids):
            y = _host_ints(f["labels"]) if with_labels[0] else x
            if y.size != x.size:
                raise ValueError(f"features[{i}]: labels and input_ids differ in length ({y.size} vs {x.size})")
            labels.append(y)
            mrope.append(_example_mrope(f, i, x.size) if self.return_position_ids else None)
            dropped.update(key for key in f if key not in _PACKED_AWAY and key not in self.vision_keys)
        if dropped:
            warnings.warn(f"PackingCollator leaves out the examples' {sorted(map(str, dropped))} (one packed row "
                          "has only input_ids, labels, position_ids, the sequence boundaries and vision inputs; "
                          "transformers' DataCollatorWithFlattening leaves them out too)", stacklevel=2)

        lengths = np.array([x.size for x in ids], dtype=np.int64)
        padded = -(-lengths // multiple) * multiple
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(padded, out=offsets[1:])
        total = int(offsets[-1])
        within = np.arange(total, dtype=np.int64) - np.repeat(offsets[:-1], padded)  # token index in its sequence
        real = within < np.repeat(lengths, padded)
        input_ids = np.full(total, pad_id, dtype=np.int64)
        input_ids[real] = np.concatenate(ids)
        out_labels = np.full(total, IGNORE_INDEX, dtype=np.int64)
        out_labels[real] = np.concatenate(labels)
        out_labels[offsets[:-1]] = sep
        out: Dict[str, Any] = {"input_ids": input_ids[None], "labels": out_labels[None]}
        if self.return_position_ids:
            out["position_ids"] = self._position_ids(within + start, mrope, lengths, offsets, flash)
        if self.return_seq_idx:
            out["seq_idx"] = np.repeat(np.arange(lengths.size, dtype=np.int32), padded)[None]
        if flash:
            out["cu_seq_lens_q"] = offsets.astype(np.int32)
            out["cu_seq_lens_k"] = offsets.astype(np.int32)
            out["max_length_q"] = out["max_length_k"] = int(padded.max())
        if fmt == "pt":
            import torch

            out = {key: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for key, v in out.items()}
        for key in self.vision_keys:
            parts = [f[key] for f in kept if f.get(key) is not None]
            if parts:
                out[key] = _concat(parts, fmt)
        return out

    def _position_ids(self, text: np.ndarray, mrope: List[Optional[np.ndarray]], lengths: np.ndarray,
                      offsets: np.ndarray, flash: bool) -> np.ndarray:
        """``[1, T]`` text positions, or with M-RoPE examples the packed ``[k, T]``
        ids (each sequence's padding continuing from its largest id, as text after it
        would) as ``[4, 1, T]`` with the text row (``mrope_text_row`` and ``k = 3``)
        or ``[k, 1, T]``."""
        rows = {p.shape[0] for p in mrope if p is not None}
        if len(rows) > 1:
            raise ValueError(f"the examples' M-RoPE position_ids have different row counts: {sorted(rows)}")
        if not rows:
            return text[None]
        k = rows.pop()
        if k == 3 and not self.mrope_text_row and not flash:
            raise ValueError("3-row M-RoPE position_ids without a text row or cu_seq_lens_q/k: transformers "
                             "would read the packed row as one sequence (set mrope_text_row or "
                             "return_flash_attn_kwargs)")
        packed = np.empty((k, text.size), dtype=np.int64)
        for b, (n, p) in enumerate(zip(lengths.tolist(), mrope)):
            lo, hi = int(offsets[b]), int(offsets[b + 1])
            packed[:, lo:lo + n] = np.arange(n) if p is None else p
            top = n - 1 if p is None else int(p.max())
            packed[:, lo + n:hi] = np.arange(top + 1, top + 1 + hi - lo - n)
        if k == 3 and self.mrope_text_row:
            packed = np.concatenate([text[None], packed])
        return packed[:, None]


def _concat(parts: List[Any], fmt: str) -> Any:
    """The examples' values of one vision key, concatenated along dimension 0."""
    if fmt == "np":
        arrays = [np.asarray(p.detach().cpu() if hasattr(p, "detach") else p) for p in parts]
        return np.concatenate([a.reshape(1) if a.ndim == 0 else a for a in arrays])
    import torch

    tensors = [torch.as_tensor(p) for p in parts]
    return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in tensors])
