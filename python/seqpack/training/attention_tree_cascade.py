"""Tree attention with each shared prefix read once (cascade attention, as in
Hydragen): the CPU path of :func:`~seqpack.training.attention_tree.tree_attention`'s
``sdpa`` backend (:func:`seqpack.attention` on a prefix tree).

A query of an attention segment sees its ancestors (the prefix, fully) and its own
segment (causally). The two parts are computed apart and merged by their
log-sum-exps:

    segment rows        prefix part                     own part
    children of p  ->   all children's rows at once      each child alone, causal
                        against p's path (no mask)       (same-length children batched)
    merge               out = e^(lse_p - lse) o_p + e^(lse_o - lse) o_o,  lse = log(e^lse_p + e^lse_o)

    GRPO: prompt (P tokens), G responses (R each)
      prefix part: one call, G*R queries x P keys     (the prompt's keys read once)
      own part:    one call, G sequences of R, causal; the prompt: one call of P, causal

Both parts run PyTorch's fused CPU attention kernel (the one ``scaled_dot_product_attention``
runs without a mask), which returns each row's log-sum-exp. The backward calls
that kernel's backward on each part with the merged output and log-sum-exp, which
is the exact gradient of the merged softmax (the identity ring attention uses), and
adds the parts' gradients. No ``[Lq, Lk]`` mask is built and no key row is
gathered once per child.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Tuple

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from ..tensors.tree_plans import TreeAttentionPlan

__all__ = ["cascade_attention", "cascade_available", "tree_cascade_attention"]


def cascade_available(q: "torch.Tensor", v: "torch.Tensor") -> bool:
    """Whether the cascade path runs: CPU tensors of a dtype PyTorch's fused CPU
    attention takes, one head size for q, k and v (that kernel's rule), and the
    kernel present."""
    import torch

    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)
            and q.shape[2] == v.shape[2] and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _heads_first(x: "torch.Tensor", count: int, length: int) -> "torch.Tensor":
    """``[count * length, H, D]`` rows as ``[count, H, length, D]``."""
    return x.view(count, length, x.shape[1], x.shape[2]).transpose(1, 2)


def _rows_first(x: "torch.Tensor") -> "torch.Tensor":
    """``[count, H, length, ...]`` back to ``[count * length, H, ...]``."""
    return x.transpose(1, 2).reshape(-1, *x.shape[1:2], *x.shape[3:])


def _forward(q, k, v, plan, index, scale):
    """The merged output ``[T, H, Dv]`` and log-sum-exp ``[T, H]`` (float32 or float64)."""
    import torch

    attend = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    own_rows, prefix_q, prefix_k, own_inverse, own_k = index
    t, h, dv = q.shape[0], q.shape[1], v.shape[2]
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    outs, lses = [], []
    sizes = [c * n for c, n in plan.own_groups]
    for (count, length), qg, kg, vg in zip(plan.own_groups, torch.split(q.index_select(0, own_rows), sizes),
                                           *(torch.split(x.index_select(0, own_k), sizes) for x in (k, v))):
        o, lse = attend(_heads_first(qg, count, length), _heads_first(kg, count, length),
                        _heads_first(vg, count, length), 0.0, length > 1, scale=scale)
        outs.append(_rows_first(o))
        lses.append(_rows_first(lse.unsqueeze(-1)).squeeze(-1))
    out = torch.cat(outs).index_select(0, own_inverse).to(lse_dtype)
    lse = torch.cat(lses).index_select(0, own_inverse).to(lse_dtype)
    if plan.prefix_groups:
        pre_o, pre_lse = [], []
        q_parts = torch.split(q.index_select(0, prefix_q), [n for n, _ in plan.prefix_groups])
        k_rows = [p for _, p in plan.prefix_groups]
        k_parts = torch.split(k.index_select(0, prefix_k), k_rows)
        v_parts = torch.split(v.index_select(0, prefix_k), k_rows)
        for (nq, p), qg, kg, vg in zip(plan.prefix_groups, q_parts, k_parts, v_parts):
            o, l2 = attend(_heads_first(qg, 1, nq), _heads_first(kg, 1, p), _heads_first(vg, 1, p), 0.0, False,
                           scale=scale)
            pre_o.append(_rows_first(o))
            pre_lse.append(_rows_first(l2.unsqueeze(-1)).squeeze(-1))
        o_p, l_p = torch.cat(pre_o).to(lse_dtype), torch.cat(pre_lse).to(lse_dtype)
        o_o, l_o = out.index_select(0, prefix_q), lse.index_select(0, prefix_q)
        merged = torch.logaddexp(l_o, l_p)
        mixed = o_o * (l_o - merged).exp().unsqueeze(-1) + o_p * (l_p - merged).exp().unsqueeze(-1)
        out = out.index_copy(0, prefix_q, mixed)
        lse = lse.index_copy(0, prefix_q, merged)
    return out.view(t, h, dv), lse


def _backward(grad, q, k, v, out, lse, plan, index, scale):
    import torch

    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    own_rows, prefix_q, prefix_k, _, own_k = index
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    sizes = [c * n for c, n in plan.own_groups]
    pieces = [torch.split(x.index_select(0, rows), sizes)
              for x, rows in ((grad, own_rows), (q, own_rows), (k, own_k), (v, own_k), (out, own_rows))]
    lse_parts = torch.split(lse.index_select(0, own_rows), sizes)
    grads = []
    for (count, length), g, qg, kg, vg, og, lg in zip(plan.own_groups, *pieces, lse_parts):
        dqg, dkg, dvg = backward(*(_heads_first(x, count, length) for x in (g, qg, kg, vg, og)),
                                 lg.view(count, length, -1).transpose(1, 2).contiguous(), 0.0, length > 1,
                                 scale=scale)
        grads.append([_rows_first(x) for x in (dqg, dkg, dvg)])
    for target, rows, part in zip((dq, dk, dv), (own_rows, own_k, own_k), zip(*grads)):
        target.index_copy_(0, rows, torch.cat(part).to(target.dtype))
    if plan.prefix_groups:
        nqs, ps = [n for n, _ in plan.prefix_groups], [p for _, p in plan.prefix_groups]
        g_parts, q_parts, o_parts = (torch.split(x.index_select(0, prefix_q), nqs) for x in (grad, q, out))
        l_parts = torch.split(lse.index_select(0, prefix_q), nqs)
        k_parts, v_parts = (torch.split(x.index_select(0, prefix_k), ps) for x in (k, v))
        dq_p, dk_p, dv_p = [], [], []
        for (nq, p), g, qg, og, lg, kg, vg in zip(plan.prefix_groups, g_parts, q_parts, o_parts, l_parts, k_parts,
                                                  v_parts):
            a, b, c = backward(_heads_first(g, 1, nq), _heads_first(qg, 1, nq), _heads_first(kg, 1, p),
                               _heads_first(vg, 1, p), _heads_first(og, 1, nq),
                               lg.view(1, nq, -1).transpose(1, 2).contiguous(), 0.0, False, scale=scale)
            dq_p.append(_rows_first(a))
            dk_p.append(_rows_first(b))
            dv_p.append(_rows_first(c))
        dq.index_add_(0, prefix_q, torch.cat(dq_p).to(dq.dtype))
        dk.index_add_(0, prefix_k, torch.cat(dk_p).to(dk.dtype))
        dv.index_add_(0, prefix_k, torch.cat(dv_p).to(dv.dtype))
    return dq, dk, dv


_FUNCTION = None


def _function():
    global _FUNCTION
    if _FUNCTION is None:
        import torch

        class CascadeTreeAttention(torch.autograd.Function):
            @staticmethod
            def forward(ctx, q, k, v, plan, index, scale):
                out, lse = _forward(q, k, v, plan, index, scale)
                out = out.to(q.dtype)
                ctx.save_for_backward(q, k, v, out, lse)
                ctx.plan, ctx.index, ctx.scale = plan, index, scale
                return out

            @staticmethod
            def backward(ctx, grad):
                q, k, v, out, lse = ctx.saved_tensors
                dq, dk, dv = _backward(grad.contiguous(), q, k, v, out, lse, ctx.plan, ctx.index, ctx.scale)
                return dq, dk, dv, None, None, None

        _FUNCTION = CascadeTreeAttention
    return _FUNCTION


def tree_cascade_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", plan: "TreeAttentionPlan",
                           scale: float) -> "torch.Tensor":
    """Attention of every physical token over its ancestors and itself, ``q``
    ``[T, Hq, D]``, ``k`` / ``v`` ``[T, Hk, D]`` (GQA: k and v are repeated to
    ``Hq`` heads, their gradients summed back), by the cascade of the module
    docstring; ``plan``: the tree's :class:`~seqpack.tensors.tree_plans.TreeAttentionPlan`
    (not ``plain``). Differentiable w.r.t. q, k and v."""
    index = plan.on_device(q.device, "own_rows", "prefix_q", "prefix_k", "own_inverse")  # copied once per device
    return cascade_attention(q, k, v, plan, (*index, index[0]), scale)


def cascade_attention(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", plan: Any, index: Tuple[Any, ...],
                      scale: float) -> "torch.Tensor":
    """The cascade on any plan of its form: ``plan.own_groups`` ``(count, L)`` and
    ``plan.prefix_groups`` ``(Nq, P)``; ``index`` ``(own_rows, prefix_q, prefix_k,
    own_inverse, own_k)`` device tensors, the own part's queries at ``own_rows`` of
    ``q`` and its keys at ``own_k`` of ``k`` / ``v`` (the same rows for a whole tree;
    a pass of a split tree holds earlier passes' keys before its own). GQA as
    :func:`tree_cascade_attention`."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    return _function().apply(q, k.contiguous(), v.contiguous(), plan, index, scale)
