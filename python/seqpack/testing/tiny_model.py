"""A small decoder-only transformer in plain PyTorch that runs padded, packed and
context-parallel: the reference model of seqpack's end-to-end equivalence tests,
the training-step benchmark and the demo.

Llama-shaped: token embedding, pre-norm blocks (RMSNorm, GQA attention with RoPE
on ``position_ids``, SwiGLU MLP), final norm, untied LM head. The same weights
compute

- ``forward_padded(input_ids [B, S], attention_mask [B, S])`` -> logits ``[B, S, V]``:
  PyTorch SDPA with a causal + key-padding mask, what a trainer without packing runs;
- ``forward_packed(batch)`` -> logits ``[T, V]`` for a :class:`seqpack.PackedBatch`
  holding ``input_ids``: :func:`seqpack.varlen_attention` over the THD rows, or,
  for a batch built with ``cp_size > 1``, :func:`seqpack.cp_attention` over
  ``cp_group`` on this rank's zigzag rows;
- ``forward_tree(tree)`` -> logits ``[T, V]`` at the physical tokens of a
  :class:`seqpack.PrefixTreeBatch` (shared prefixes forwarded once): RoPE at
  ``tree.position_ids`` (each token's depth), :func:`seqpack.tree_attention`.

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

from ..training.attention import cp_attention, varlen_attention


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

    def forward_packed(self, batch: Any, cp_group: Any = None, backend: str = "auto") -> torch.Tensor:
        """Logits ``[rows, V]`` of a :class:`seqpack.PackedBatch` with ``input_ids``
        (this rank's zigzag rows when the batch was built with ``cp_size > 1``), or
        of a :class:`seqpack.HybridCpBatch` (:func:`seqpack.hybrid_cp_attention`)."""
        ids = batch["input_ids"]
        if hasattr(batch, "parts"):  # a hybrid-CP micro-batch: each part over its block's group
            from ..training.attention_hybrid_cp import hybrid_cp_attention

            def attend(q, k, v):
                return hybrid_cp_attention(q, k, v, batch, backend=backend)
        elif batch.cp_size > 1:
            def attend(q, k, v):
                return cp_attention(q, k, v, batch, cp_group, backend=backend)
        else:
            cu, longest = batch.cu_seqlens_padded, batch.max_seqlen_padded

            def attend(q, k, v):
                return varlen_attention(q, k, v, cu, cu, longest, longest, backend=backend)

        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, batch.position_ids, attend)
        return self.lm_head(self.norm(x))

    def forward_tree(self, tree: Any, backend: str = "auto") -> torch.Tensor:
        """Logits ``[T, V]`` at the physical tokens of a :class:`seqpack.PrefixTreeBatch`
        (``tree.num_tokens`` rows, pad tokens included); ``logits[tree.logical_index]``
        are the rows' logits, each as the row run alone would give them."""
        from ..tensors.layout_kinds import as_tree

        tree = as_tree(tree)
        return self.forward_layout(torch.tensor(tree.input_ids, device=self.embed.weight.device), tree, backend)

    def forward_layout(self, input_ids: torch.Tensor, layout: Any, backend: str = "auto") -> torch.Tensor:
        """Logits ``[T, V]`` of the physical tokens ``input_ids`` [T] of any layout
        (a :class:`seqpack.PrefixTreeBatch`, a :class:`seqpack.PackedLayout` of rows
        that share nothing), each attention layer :func:`seqpack.tree_attention`."""
        from ..tensors.layout_kinds import as_layout
        from ..training.attention_tree import tree_attention

        layout = as_layout(layout)
        positions = torch.tensor(layout.position_ids, device=input_ids.device)  # a copy: the arrays are read-only

        def attend(q, k, v):
            return tree_attention(q, k, v, layout, backend=backend)

        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, positions, attend)
        return self.lm_head(self.norm(x))


def padded_loss(model: TinyCausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                global_valid_toks: float, right_padded: bool = False) -> torch.Tensor:
    """SFT loss of a padded batch: ``-sum log p(next token) / global_valid_toks``
    over every real next-token position (PyTorch ``log_softmax`` + ``gather``)."""
    logits = model.forward_padded(input_ids, attention_mask, right_padded=right_padded)
    logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return -(logp * attention_mask[:, 1:]).sum() / global_valid_toks


def packed_loss(model: TinyCausalLM, batch: Any, global_valid_toks: float, cp_group: Any = None,
                backend: str = "auto") -> torch.Tensor:
    """The same loss on a :class:`seqpack.PackedBatch` with the fused log-probs
    (:func:`seqpack.packed_token_logprobs`). With CP each rank sums its own rows'
    log-probs (the full ids are all-gathered once for the targets), so the losses of
    the CP ranks add up to the micro-batch's loss: no division by the CP size. A
    :class:`seqpack.HybridCpBatch` (hybrid CP) sums each part's log-probs at this
    rank's positions, so the ranks' losses add up the same way."""
    from ..tensors.cp import gather_cp
    from ..tensors.hybrid_cp import HybridCpBatch
    from ..training.logprobs import packed_token_logprobs

    logits = model.forward_packed(batch, cp_group, backend=backend)
    if isinstance(batch, HybridCpBatch):  # each part's log-probs at this rank's positions
        from ..training.attention_hybrid_cp import hybrid_cp_token_logprobs

        # Started from the logits (an empty micro-batch, a dummy, still has a backward).
        return -sum((lp.logprobs.sum() for lp in hybrid_cp_token_logprobs(logits, batch)),
                    logits[:0].sum()) / global_valid_toks
    ids = batch["input_ids"]
    if batch.cp_size > 1:
        ids = gather_cp(ids, batch.cu_seqlens_padded, cp_group)
    logp = packed_token_logprobs(logits, ids, batch.cu_seqlens, batch.cu_seqlens_padded, cp_size=batch.cp_size,
                                 cp_rank=batch.cp_rank).logprobs
    return -logp.sum() / global_valid_toks


def tree_loss(model: TinyCausalLM, tree: Any, global_valid_toks: float, backend: str = "auto") -> torch.Tensor:
    """The same loss on a :class:`seqpack.PrefixTreeBatch`: every row's next-token
    log-probs from the tree's logits (:func:`seqpack.tree_token_logprobs`), summed
    over the logical tokens, so it equals the loss of the rows run alone."""
    from ..training.logprobs_tree import tree_token_logprobs

    logp = tree_token_logprobs(model.forward_tree(tree, backend=backend), tree).logprobs
    return -logp.sum() / global_valid_toks
