"""HF transformers: train a model on packed sequences through seqpack.

``register()`` adds an attention implementation named ``"seqpack"`` to
transformers' ``AttentionInterface`` - :func:`seqpack.varlen_attention`, so any
backend (flash-attn, PyTorch varlen, the exact CPU reference) - together with
the matching mask function in ``AttentionMaskInterface``: without one,
transformers skips mask creation for an unknown implementation and a padded
batch's ``attention_mask`` would silently never reach the attention.
:class:`PackingCollator` flattens a list of examples into one row the way
transformers' ``DataCollatorWithFlattening`` does (``position_ids`` restarting
per sequence, ``cu_seq_lens_q/k``, ``max_length_q/k``, labels -100 at each
sequence start), optionally padding each sequence to a multiple (2·CP·TP).
Examples of vision-language models with M-RoPE ids (Qwen2-VL, Qwen2.5-VL:
``position_ids [3, n]``) pack to the ``[4, 1, T]`` ids transformers reads as a
packed batch (a text row, then temporal / height / width), their vision inputs
concatenated; see ``docs/vlm.md``.

    >>> from seqpack.integrations import hf                      # doctest: +SKIP
    >>> hf.register()                                             # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_config(cfg, attn_implementation="seqpack")  # doctest: +SKIP
    >>> batch = hf.PackingCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])  # doctest: +SKIP
    >>> model(**batch).loss                                       # doctest: +SKIP
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence

import numpy as np

from .._lengths import as_positive_int, as_real

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
    sequence."""
    import torch

    from ..training.attention import varlen_attention

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
    """Flattens examples into one packed row (a drop-in for transformers'
    ``DataCollatorWithFlattening`` with ``return_flash_attn_kwargs=True``).

    Args:
        pad_to_multiple_of: pad each sequence to a multiple of this (e.g.
            ``seqpack.alignment(cp, tp)``); padding gets ``pad_token_id`` and label
            -100 and continues the position ids.
        return_position_ids / return_flash_attn_kwargs: which fields to emit.
        mrope_text_row: with M-RoPE examples, put the text positions (restarting
            per sequence) in front of the three M-RoPE rows: ``position_ids [4, 1, T]``,
            what transformers' Qwen2-VL / Qwen2.5-VL take as packed. ``False`` gives
            ``[3, 1, T]``, which transformers never reads as packed: only a varlen
            attention given ``cu_seq_lens_q/k`` keeps the sequences apart then.
        vision_keys: fields concatenated along dimension 0 across the examples
            that have them (Qwen2-VL's ``pixel_values``, ``image_grid_thw``, ...).

    Each example is a mapping with ``input_ids`` (and optionally ``labels``).
    Labels are -100 at every sequence's first token, so the shifted causal-LM
    loss never predicts one sequence's first token from the previous sequence.

    An example may carry M-RoPE ``position_ids [k, n]`` (or ``[k, 1, n]``; ``k = 3``
    for Qwen2-VL's temporal / height / width, as ``get_rope_index`` gives them): they
    are packed per sequence with :func:`seqpack.pack_sequences` (examples without
    them get ``0 .. n-1`` in every row, the ids of text), the padding continuing
    from the sequence's largest id as text would. 1-D ``position_ids`` are ignored:
    the collator's own restart per sequence.

    >>> from seqpack.integrations.hf import PackingCollator
    >>> out = PackingCollator()([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    >>> out["position_ids"].tolist(), out["labels"].tolist(), out["cu_seq_lens_q"].tolist()
    ([[0, 1, 2, 0, 1]], [[-100, 2, 3, -100, 5]], [0, 3, 5])
    >>> mrope = [[0, 1, 1, 3], [0, 1, 2, 3], [0, 1, 2, 3]]          # [3, n]: one image token pair
    >>> out = PackingCollator(pad_to_multiple_of=2)([{"input_ids": [7, 8, 8, 9], "position_ids": mrope},
    ...                                              {"input_ids": [4]}])
    >>> out["position_ids"].shape, out["position_ids"][:, 0].tolist()
    (torch.Size([4, 1, 6]), [[0, 1, 2, 3, 0, 1], [0, 1, 1, 3, 0, 1], [0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]])
    """

    pad_to_multiple_of: int = 1
    pad_token_id: int = 0
    return_position_ids: bool = True
    return_flash_attn_kwargs: bool = True
    mrope_text_row: bool = True
    vision_keys: Sequence[str] = VISION_KEYS

    def __call__(self, features: Sequence[Mapping[str, Any]], return_tensors: str = "pt") -> Dict[str, Any]:
        import torch

        from ..tensors.thd import pack_sequences

        as_positive_int(self.pad_to_multiple_of, "pad_to_multiple_of")
        if return_tensors != "pt":
            raise ValueError(f"return_tensors must be 'pt', got {return_tensors!r}")
        if not features:
            raise ValueError("features must hold at least one example")
        ids: List[np.ndarray] = []
        labels: List[np.ndarray] = []
        mrope: List[Optional[np.ndarray]] = []
        for i, f in enumerate(features):
            if "input_ids" not in f:
                raise ValueError(f"features[{i}] has no 'input_ids'")
            x = np.asarray(f["input_ids"], dtype=np.int64).reshape(-1)
            if x.size == 0:
                raise ValueError(f"features[{i}]['input_ids'] is empty")
            y = np.asarray(f["labels"], dtype=np.int64).reshape(-1) if "labels" in f else x
            if y.shape != x.shape:
                raise ValueError(f"features[{i}]: labels and input_ids differ in length ({y.size} vs {x.size})")
            ids.append(x)
            labels.append(y)
            mrope.append(_example_mrope(f, i, x.size) if self.return_position_ids else None)
        lengths = np.array([a.size for a in ids], dtype=np.int64)
        # Right-padded rows, then the THD pack of the tensor engine (its plan gives
        # the offsets and positions, the same rules as every other packed batch).
        rows = np.zeros((len(ids), int(lengths.max())), dtype=np.int64)
        rows_labels = np.full_like(rows, IGNORE_INDEX)
        for b, (x, y) in enumerate(zip(ids, labels)):
            rows[b, :x.size] = x
            rows_labels[b, 1:y.size] = y[1:]  # the first label stays -100
        tensors = {"input_ids": torch.from_numpy(rows), "labels": torch.from_numpy(rows_labels)}
        k = {p.shape[0] for p in mrope if p is not None}
        if len(k) > 1:
            raise ValueError(f"the examples' M-RoPE position_ids have different row counts: {sorted(k)}")
        k = k.pop() if k else 0
        if k:
            if k == 3 and not self.mrope_text_row and not self.return_flash_attn_kwargs:
                raise ValueError("3-row M-RoPE position_ids without a text row or cu_seq_lens_q/k: transformers "
                                 "would read the packed row as one sequence (set mrope_text_row or "
                                 "return_flash_attn_kwargs)")
            rows_pos = np.zeros((k, *rows.shape), dtype=np.int64)
            for b, (x, p) in enumerate(zip(ids, mrope)):
                rows_pos[:, b, :x.size] = np.arange(x.size) if p is None else p
            tensors["position_ids"] = torch.from_numpy(rows_pos)
        batch = pack_sequences(tensors, seq_lens=lengths, pad_multiple=self.pad_to_multiple_of,
                               pad_values={"input_ids": self.pad_token_id, "labels": IGNORE_INDEX})
        out: Dict[str, Any] = {"input_ids": batch["input_ids"][None], "labels": batch["labels"][None]}
        kwargs = batch.hf_kwargs()
        if self.return_position_ids:
            out["position_ids"] = kwargs["position_ids"]
            if k:
                out["position_ids"] = self._mrope_rows(batch, rows_pos, lengths, k)
        if self.return_flash_attn_kwargs:
            for key in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"):
                out[key] = kwargs[key]
        for key in self.vision_keys:
            parts = [torch.as_tensor(f[key]) for f in features if f.get(key) is not None]
            if parts:
                out[key] = torch.cat([t.reshape(1) if t.dim() == 0 else t for t in parts])
        return out

    def _mrope_rows(self, batch, rows_pos: np.ndarray, lengths: np.ndarray, k: int):
        """The packed ``[k, T]`` M-RoPE ids, each sequence's padding continuing from
        its largest id (as text after it would), as ``[4, 1, T]`` with the text row
        (``mrope_text_row`` and ``k = 3``) or ``[k, 1, T]``."""
        import torch

        packed = batch["position_ids"].numpy().copy()
        offsets = batch.cu_seqlens_padded.tolist()
        for b, n in enumerate(lengths.tolist()):
            start, end = offsets[b] + n, offsets[b + 1]
            if end > start:
                top = int(rows_pos[:, b, :n].max())
                packed[:, start:end] = np.arange(top + 1, top + 1 + end - start)
        if k == 3 and self.mrope_text_row:
            return batch.hf_kwargs(torch.from_numpy(packed))["position_ids"]
        return torch.from_numpy(packed)[:, None]
