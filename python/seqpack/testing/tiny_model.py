"""A small decoder-only transformer in plain PyTorch that runs padded, packed and
context-parallel: the reference model of seqpack's end-to-end equivalence tests,
the training-step benchmark and the demo.

Llama-shaped: token embedding, pre-norm blocks (RMSNorm, GQA attention with RoPE
on ``position_ids``, SwiGLU MLP), final norm, untied LM head. The same weights
compute

- ``forward_padded(input_ids [B, S], attention_mask [B, S])`` -> logits ``[B, S, V]``:
  PyTorch SDPA with a causal + key-padding mask, what a trainer without packing runs;
- ``forward(input_ids, layout)`` -> logits ``[rows, V]`` of any layout (rows, a
  prefix tree with its shared prefixes forwarded once, a CP cut of either, a
  hybrid-CP micro-batch): RoPE at the layout's position ids and
  :func:`seqpack.attention` in every layer; :func:`loss` is the one packed loss
  (:func:`seqpack.token_logprobs`). ``forward_packed(batch)``, ``forward_tree(tree)``
  and ``packed_loss`` / ``tree_loss`` are the same for a batch's own tensors.

>>> import torch, seqpack
>>> from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig
>>> model = TinyCausalLM(TinyConfig(vocab_size=50, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1))
>>> batch = seqpack.pack_sequences({"input_ids": torch.randint(0, 50, (2, 5))}, seq_lens=[5, 3])
>>> model.forward_packed(batch).shape
torch.Size([8, 50])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from ..tensors.layout_kinds import as_layout
from ..training.ops import attention, token_logprobs


@dataclass
class TinyConfig:
    vocab_size: int = 1024
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: Optional[int] = None  # default: 8/3 x hidden, rounded to 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``x [..., H, D]`` at integer positions ``[...]`` (halves rotated)."""
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d)
    angles = (position_ids.to(torch.float64)[..., None] * inv).to(x.dtype)[..., None, :]  # [..., 1, D/2]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        inter = cfg.intermediate_size or (8 * d // 3 + 15) // 16 * 16
        self.cfg = cfg
        self.attn_norm = RMSNorm(d, cfg.norm_eps)
        self.q = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o = nn.Linear(cfg.num_heads * hd, d, bias=False)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        self.gate = nn.Linear(d, inter, bias=False)
        self.up = nn.Linear(d, inter, bias=False)
        self.down = nn.Linear(inter, d, bias=False)

    def qkv(self, x, position_ids):
        c = self.cfg
        shape = x.shape[:-1]
        q = self.q(x).view(*shape, c.num_heads, c.head_dim)
        k = self.k(x).view(*shape, c.num_kv_heads, c.head_dim)
        v = self.v(x).view(*shape, c.num_kv_heads, c.head_dim)
        return rope(q, position_ids, c.rope_theta), rope(k, position_ids, c.rope_theta), v

    def forward(self, x, position_ids, attend):
        q, k, v = self.qkv(self.attn_norm(x), position_ids)
        x = x + self.o(attend(q, k, v).flatten(-2))
        h = self.mlp_norm(x)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class TinyCausalLM(nn.Module):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        if cfg.hidden_size % cfg.num_heads or cfg.num_heads % cfg.num_kv_heads:
            raise ValueError("hidden_size must be a multiple of num_heads, and num_heads of num_kv_heads")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward_padded(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                       right_padded: bool = False) -> torch.Tensor:
        """Logits ``[B, S, V]`` of padded rows (``attention_mask`` 1 at real tokens).

        ``right_padded=True`` promises every row's padding is at its end: plain
        causal SDPA then gives the real rows exactly (no real query sees a padding
        key) without materialising a ``[B, S, S]`` mask - the fast padded baseline."""
        b, s = input_ids.shape
        mask = None
        if not right_padded:
            valid = attention_mask.bool()
            causal = torch.ones(s, s, dtype=torch.bool, device=input_ids.device).tril()
            mask = ((causal[None] & valid[:, None, :]) | ~valid[:, :, None])[:, None]  # padded queries: anything
        positions = torch.arange(s, device=input_ids.device).expand(b, s)
        group = self.cfg.num_heads // self.cfg.num_kv_heads

        def attend(q, k, v):  # [B, S, H, D]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            if group > 1:
                k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
            return out.transpose(1, 2)

        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, positions, attend)
        return self.lm_head(self.norm(x))

    def forward(self, input_ids: torch.Tensor, layout: Any, *, position_ids: Any = None, group: Any = None,
                backend: str = "auto") -> torch.Tensor:
        """Logits ``[rows, V]`` of this rank's physical tokens ``input_ids [rows]`` of any
        layout (rows, a prefix tree, a cut of either, a hybrid-CP micro-batch): RoPE at
        ``position_ids`` (default the layout's, for a whole layout) and
        :func:`seqpack.attention` in every layer (``group``: a cut layout's CP group)."""
        if position_ids is None:
            position_ids = torch.tensor(as_layout(layout).position_ids, device=input_ids.device)  # a copy

        def attend(q, k, v):
            return attention(q, k, v, layout, group=group, backend=backend)

        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids, attend)
        return self.lm_head(self.norm(x))

    def forward_packed(self, batch: Any, cp_group: Any = None, backend: str = "auto") -> torch.Tensor:
        """:meth:`forward` of a :class:`seqpack.PackedBatch` or hybrid-CP micro-batch
        holding ``input_ids`` (this rank's rows) and ``position_ids``."""
        return self.forward(batch["input_ids"], batch, position_ids=batch.position_ids, group=cp_group,
                            backend=backend)

    def forward_tree(self, tree: Any, backend: str = "auto") -> torch.Tensor:
        """:meth:`forward` of a :class:`seqpack.PrefixTreeBatch`'s own ids (``[T, V]``,
        pad tokens included; ``logits[tree.logical_index]`` are the rows')."""
        from ..tensors.layout_kinds import as_tree

        tree = as_tree(tree)
        return self.forward(torch.tensor(tree.input_ids, device=self.embed.weight.device), tree, backend=backend)

    def forward_layout(self, input_ids: torch.Tensor, layout: Any, backend: str = "auto") -> torch.Tensor:
        """:meth:`forward` of the physical tokens ``input_ids [T]`` of a whole layout."""
        return self.forward(input_ids, layout, backend=backend)


def padded_loss(model: TinyCausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                global_valid_toks: float, right_padded: bool = False) -> torch.Tensor:
    """SFT loss of a padded batch: ``-sum log p(next token) / global_valid_toks``
    over every real next-token position (PyTorch ``log_softmax`` + ``gather``)."""
    logits = model.forward_padded(input_ids, attention_mask, right_padded=right_padded)
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return -(logp * attention_mask[:, 1:]).sum() / global_valid_toks


def loss(model: TinyCausalLM, input_ids: torch.Tensor, layout: Any, global_valid_toks: float, *,
         targets: Any = None, position_ids: Any = None, group: Any = None, backend: str = "auto") -> torch.Tensor:
    """The same loss on any layout: ``-sum log p(next token) / global_valid_toks`` from
    :meth:`TinyCausalLM.forward`'s logits through :func:`seqpack.token_logprobs`
    (``targets``: rows' full packed ids; a tree and a hybrid micro-batch carry theirs).
    Each rank sums the log-probs it computes, so the losses of a cut layout's ranks
    add up to the batch's loss: no division by the CP size."""
    logits = model.forward(input_ids, layout, position_ids=position_ids, group=group, backend=backend)
    # Started from the logits (an empty micro-batch, a dummy, still has a backward).
    return -(token_logprobs(logits, layout, targets).logprobs.sum() + logits[:0].sum()) / global_valid_toks


def packed_loss(model: TinyCausalLM, batch: Any, global_valid_toks: float, cp_group: Any = None,
                backend: str = "auto") -> torch.Tensor:
    """:func:`loss` of a :class:`seqpack.PackedBatch` (CP: the full ids all-gathered
    once for the targets) or a hybrid-CP micro-batch."""
    return loss(model, batch["input_ids"], batch, global_valid_toks, targets=batch.next_token_targets(group=cp_group),
                position_ids=batch.position_ids, group=cp_group, backend=backend)


def tree_loss(model: TinyCausalLM, tree: Any, global_valid_toks: float, backend: str = "auto") -> torch.Tensor:
    """:func:`loss` of a :class:`seqpack.PrefixTreeBatch` (its own ids): it equals the
    loss of the rows run alone."""
    return loss(model, torch.tensor(tree.input_ids, device=model.embed.weight.device), tree, global_valid_toks,
                backend=backend)
