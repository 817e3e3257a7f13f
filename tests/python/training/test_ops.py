"""Conformance of the one-operation API (issue 50): ``seqpack.attention``,
``seqpack.token_logprobs`` (logits and the fused LM head) and
``SequencePackingLossWrapper`` equal the per-row reference in fp64, values and
gradients, through one call each, for every layout kind and cut:

- one process: rows back to back, a prefix tree, a tree whose rows share nothing;
- gloo ranks (2 and 4): zigzag rows, tree ranges, Ulysses slices of rows and of a
  tree, and hybrid-CP micro-batches (composites of whole and sharded parts).

The reference runs every row alone: causal SDPA, ``log_softmax`` + ``gather``, and
NeMo-RL's NLL on the padded rows.
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _gloo import started_pools, values_of

import seqpack
from seqpack.training.loss import NLLLoss

HEADS, KV_HEADS, DIM, VOCAB, HIDDEN = 4, 2, 8, 19, 6
CASE_TIMEOUT_S = 120


def _rows(kind, seed=0):
    rng = np.random.default_rng(seed)
    if kind == "tree":
        rows = []
        for prompt_len, answers in ((9, 3), (4, 2), (6, 1)):
            prompt = rng.integers(1, VOCAB, prompt_len).tolist()
            rows += [prompt + rng.integers(1, VOCAB, int(rng.integers(1, 6))).tolist() for _ in range(answers)]
        return rows
    lengths = [13, 7, 1, 9, 4] if kind == "rows" else [5, 8, 3, 6]
    rows = [rng.integers(1, VOCAB, n).tolist() for n in lengths]
    if kind == "flat_tree":  # distinct first tokens: nothing shared
        rows = [[1 + i] + r[1:] for i, r in enumerate(rows)]
    return rows


def _layout(kind, rows, multiple=4):
    if kind == "rows":
        return seqpack.PackedLayout.from_lengths([len(r) for r in rows], pad_multiple=multiple)
    return seqpack.pack_prefix_tree(rows, pad_to_multiple_of=multiple)


def _physical(layout, rows):
    """The physical ids [T] of ``rows`` in ``layout`` (0 at pad tokens)."""
    flat = torch.tensor([t for r in rows for t in r])
    return torch.as_tensor(layout.to_physical(flat.numpy(), fill=0))


def _inputs(layout, seed):
    g = torch.Generator().manual_seed(seed)
    t = layout.num_tokens
    q = torch.randn(t, HEADS, DIM, generator=g, dtype=torch.float64)
    k = torch.randn(t, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    v = torch.randn(t, KV_HEADS, DIM, generator=g, dtype=torch.float64)
    logits = torch.randn(t, VOCAB, generator=g, dtype=torch.float64)
    hidden = torch.randn(t, HIDDEN, generator=g, dtype=torch.float64)
    head = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    return q, k, v, logits, hidden, head


def _logical_index(layout):
    return torch.from_numpy(np.array(layout.logical_index, dtype=np.int64))


# ---- the per-row references ---------------------------------------------------------------
def reference_attention(q, k, v, layout):
    """Every row alone: causal SDPA over the physical rows it reads, as [N, H, D]."""
    index, cu = _logical_index(layout), np.asarray(layout.cu_seqlens)
    outs = []
    for r in range(layout.num_rows):
        rows = index[cu[r]:cu[r + 1]]
        qs, ks, vs = (x[rows].transpose(0, 1) for x in (q, k, v))
        ks, vs = (x.repeat_interleave(HEADS // KV_HEADS, 0) for x in (ks, vs))
        outs.append(F.scaled_dot_product_attention(qs[None], ks[None], vs[None], is_causal=True)[0].transpose(0, 1))
    return torch.cat(outs)


def reference_logprobs(logits, layout, rows):
    """Every row alone: log_softmax + gather of each token's next token, 0 at its last, [N]."""
    index, cu = _logical_index(layout), np.asarray(layout.cu_seqlens)
    outs = []
    for r, row in enumerate(rows):
        lp = torch.log_softmax(logits[index[cu[r]:cu[r + 1]]], -1)
        nxt = torch.tensor(row[1:] + [0])
        outs.append(lp.gather(-1, nxt[:, None])[:, 0] * (torch.arange(len(row)) < len(row) - 1))
    return torch.cat(outs)


def nemo_rl_data(rows):
    width = max(len(r) for r in rows) + 1
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.float64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1.0
    data = seqpack.BatchedDataDict(input_ids=ids, token_mask=mask, sample_mask=torch.ones(len(rows),
                                                                                           dtype=torch.float64))
    return data, mask[:, 1:].sum(), torch.tensor(float(len(rows)))


def reference_nll(logits, layout, rows, gvt):
    lp = reference_logprobs(logits, layout, rows)
    cu = np.asarray(layout.cu_seqlens)
    per_row = [lp[cu[r]:cu[r + 1] - 1].sum() for r in range(len(rows))]
    return -sum(per_row) / (gvt + 1e-8)  # NeMo-RL's masked_mean adds 1e-8 to the normaliser


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    out = fn(*xs)
    g = torch.Generator().manual_seed(7)
    weight = torch.randn(out.shape, generator=g, dtype=out.dtype)
    (out * weight).sum().backward()
    return out.detach(), [x.grad for x in xs]


# ---- one process ----------------------------------------------------------------------------
KINDS = ["rows", "tree", "flat_tree"]


@pytest.mark.parametrize("kind", KINDS)
def test_attention_equals_every_row_alone(kind):
    rows = _rows(kind)
    layout = _layout(kind, rows)
    q, k, v = _inputs(layout, 1)[:3]
    got, got_grads = _grads(lambda *x: layout.to_logical(seqpack.attention(*x, layout)), q, k, v)
    want, want_grads = _grads(lambda *x: reference_attention(*x, layout), q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _logical_logprobs(result, layout, kind):
    """Rows' results sit at their physical rows (THD); a tree's at its logical tokens."""
    return layout.to_logical(result) if kind == "rows" else result


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fused_head", [False, True])
def test_token_logprobs_equal_every_row_alone(kind, fused_head):
    rows = _rows(kind)
    layout = _layout(kind, rows)
    _, _, _, logits, hidden, head = _inputs(layout, 2)
    ids = _physical(layout, rows) if kind == "rows" else None
    if fused_head:
        got, (got_grad,) = _grads(lambda h: _logical_logprobs(
            seqpack.token_logprobs(h, layout, ids, weight=head).logprobs, layout, kind), hidden)
        want, (want_grad,) = _grads(lambda h: reference_logprobs(h @ head.T, layout, rows), hidden)
    else:
        got, (got_grad,) = _grads(lambda x: _logical_logprobs(seqpack.token_logprobs(x, layout, ids).logprobs,
                                                              layout, kind), logits)
        want, (want_grad,) = _grads(lambda x: reference_logprobs(x, layout, rows), logits)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", KINDS)
def test_the_loss_wrapper_equals_nemo_rls_loss_on_the_rows(kind):
    rows = _rows(kind)
    layout = _layout(kind, rows)
    logits = _inputs(layout, 3)[3]
    data, gvt, gvs = nemo_rl_data(rows)
    wrapper = seqpack.SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=layout)
    got, (got_grad,) = _grads(lambda x: wrapper(x, data, gvs, gvt)[0], logits)
    want, (want_grad,) = _grads(lambda x: reference_nll(x, layout, rows, gvt), logits)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-10, atol=1e-12)


def test_a_missing_entry_and_a_whole_layout_with_a_group_raise_by_name():
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    cut = seqpack.shard_layout(tree, 2, 0, scheme="ulysses")
    with pytest.raises(TypeError, match="token_logprobs has no implementation for a tree layout with a ulysses cut"):
        seqpack.token_logprobs(torch.zeros(cut.num_local_tokens, 5), cut)
    with pytest.raises(TypeError, match="layout must be a layout"):
        seqpack.attention(*_inputs(tree, 0)[:3], "not a layout")
    with pytest.raises(ValueError, match="kv_heads_per_chunk bounds a CP gather"):
        seqpack.attention(*_inputs(tree, 0)[:3], tree, kv_heads_per_chunk=1)
    with pytest.raises(ValueError, match="input_ids is given by a prefix tree itself"):
        seqpack.token_logprobs(torch.zeros(tree.num_tokens, 5), tree, torch.zeros(tree.num_tokens))
    with pytest.raises(ValueError, match="input_ids is required with rows"):
        seqpack.token_logprobs(torch.zeros(4, 5), seqpack.PackedLayout.from_lengths([4]))


def test_shard_layout_cuts_and_refuses_by_name():
    rows = seqpack.PackedLayout.from_lengths([3, 5], pad_multiple=4)
    assert seqpack.shard_layout(rows, 1, 0) is rows
    cut = seqpack.shard_layout(rows, 2, 1)
    assert (cut.cut.kind, cut.cp_size, cut.cp_rank, cut.num_local_tokens) == ("zigzag", 2, 1, 6)
    full = torch.arange(12)  # rows padded to 4 and 8: rank 1 holds chunks 1 and 2 of each
    assert cut.local_rows(full).tolist() == [1, 2, 6, 7, 8, 9]
    uly = seqpack.shard_layout(rows, 5, 4, scheme="ulysses")  # ceil(12 / 5) = 3 rows a rank, the tail padded
    assert uly.bounds.tolist() == [0, 3, 6, 9, 12, 15] and uly.local_rows(full).tolist() == [0, 0, 0]
    assert seqpack.shard_layout(rows, 5, 3, scheme="ulysses").local_rows(full).tolist() == [9, 10, 11]
    with pytest.raises(ValueError, match="padded lengths|multiple"):
        seqpack.shard_layout(seqpack.PackedLayout.from_lengths([3, 5]), 2, 0)
    with pytest.raises(ValueError, match="scheme='ranges' cuts a prefix tree"):
        seqpack.shard_layout(rows, 2, 0, scheme="ranges")
    tree = seqpack.pack_prefix_tree([[1, 2, 3], [1, 2, 4]])
    with pytest.raises(ValueError, match="scheme='zigzag' cuts rows"):
        seqpack.shard_layout(tree, 2, 0, scheme="zigzag")
    with pytest.raises(ValueError, match="already cut"):
        seqpack.shard_layout(cut, 2, 0)
    with pytest.raises(ValueError, match=r"cp_rank must be in \[0, cp_size=2\)"):
        seqpack.shard_layout(tree, np.int64(2), torch.tensor(2))
    assert seqpack.shard_layout(tree, np.int64(2), torch.tensor(1)).cut.rank == 1


# ---- gloo ranks -------------------------------------------------------------------------------
def _check_cut(rank, world, kind, scheme):
    """attention, token_logprobs (both forms) and the loss wrapper on this rank's cut
    equal this rank's share of the one-process result (gradients included)."""
    rows = _rows(kind, seed=world)
    layout = _layout(kind, rows, multiple=2 * world)
    cut = seqpack.shard_layout(layout, world, rank, scheme=scheme)
    q, k, v, logits, hidden, head = _inputs(layout, 4)
    group = dist.group.WORLD
    # attention: this rank's rows of the whole output. Every rank weighs the whole output
    # alike and takes its rows' share, so the ranks' losses sum to the whole loss and
    # each rank's gradients are its rows of the whole gradients (k's and v's through
    # the gathers' backward).
    whole = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = seqpack.attention(*whole, layout)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=out.dtype)
    (out * weight).sum().backward()
    local = [cut.local_rows(x).detach().clone().requires_grad_() for x in (q, k, v)]
    got = seqpack.attention(*local, cut, group=group)
    torch.testing.assert_close(got, cut.local_rows(out.detach()), rtol=1e-10, atol=1e-12)
    (got * cut.local_rows(weight)).sum().backward()
    for mine, full in zip(local, whole):
        torch.testing.assert_close(mine.grad, cut.local_rows(full.grad), rtol=1e-10, atol=1e-12)
    if scheme == "ulysses":
        return True
    # token log-probs: rows' at this rank's physical rows; a tree's at its logical
    # tokens, this rank's predictions only (the ranks sum to the whole).
    ids = _physical(layout, rows) if kind == "rows" else None
    for fused in (False, True):
        x, whole_x = (hidden, hidden) if fused else (logits, logits)
        kw = dict(weight=head) if fused else {}
        mine = seqpack.token_logprobs(cut.local_rows(x), cut, ids, **kw).logprobs
        full = seqpack.token_logprobs(whole_x, layout, ids, **kw).logprobs
        if kind == "rows":
            torch.testing.assert_close(mine, cut.local_rows(full), rtol=1e-10, atol=1e-12)
        else:
            summed = mine.clone()
            dist.all_reduce(summed)
            torch.testing.assert_close(summed, full, rtol=1e-10, atol=1e-12)
    # the loss wrapper: the whole layout and the CP group (NeMo-RL's convention)
    data, gvt, gvs = nemo_rl_data(rows)
    ref = reference_nll(logits, layout, rows, gvt)
    wrapper = seqpack.SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=layout, context_parallel_group=group)
    loss, _ = wrapper(cut.local_rows(logits), data, gvs, gvt)
    torch.testing.assert_close(loss, ref, rtol=1e-10, atol=1e-12)
    return True


def case_cut(rank, world, kind, scheme):
    return _check_cut(rank, world, kind, scheme)


def case_hybrid(rank, world, trees):
    """Hybrid CP (C = world, D = 1): a one-layer model through ``seqpack.attention``
    and ``seqpack.token_logprobs`` on each micro-batch (one call each), and the loss
    wrapper on the same micro-batches: both sum over the ranks to the padded step."""
    from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig, packed_loss

    torch.manual_seed(0)
    model = TinyCausalLM(TinyConfig(vocab_size=VOCAB, hidden_size=16, num_layers=1, num_heads=4,
                                    num_kv_heads=2)).double()
    rng = np.random.default_rng(1)
    if trees:
        prompts = [rng.integers(1, VOCAB, n).tolist() for n in (30, 5, 8)]
        rows = [p + rng.integers(1, VOCAB, int(rng.integers(1, 8))).tolist() for p in prompts for _ in range(2)]
    else:
        rows = [rng.integers(1, VOCAB, n).tolist() for n in (41, 23, 5, 3, 9, 2, 7)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    lengths = torch.tensor([len(r) for r in rows])
    mask = (torch.arange(ids.shape[1])[None] < lengths[:, None]).long()
    tokens = float((lengths - 1).sum())
    logits = model.forward_padded(ids, mask)
    lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
    (-(lp * mask[:, 1:]).sum() / tokens).backward()
    reference = {n: p.grad.clone() for n, p in model.named_parameters()}
    forest = seqpack.PrefixForest.from_rows(rows) if trees else None
    cost = seqpack.CostModel(per_micro_batch=20.0, per_token=1.0, per_token_squared=0.02, per_kv_token=0.5,
                             per_collective=5.0)
    plan = seqpack.plan_step(lengths, 1, 24, cost=cost, cp_size=world, hybrid_cp=True,
                             forest=forest)
    data, gvt, gvs = nemo_rl_data(rows)
    for through_wrapper in (False, True):
        model.zero_grad()
        for mb in seqpack.hybrid_cp_micro_batches({"input_ids": ids}, lengths, plan, forest=forest):
            if through_wrapper:
                # the composite layout itself (a TokenLayout) as the loss's layout
                wrapper = seqpack.SequencePackingLossWrapper(NLLLoss(), cu_seqlens_q=mb.layout)
                sub = {key: val[list(mb.rows)] for key, val in data.items()}
                loss, _ = wrapper(model.forward_packed(mb), sub, gvs, torch.tensor(tokens))
            else:
                loss = packed_loss(model, mb, tokens)
            loss.backward()
        for n, p in model.named_parameters():
            grad = p.grad.clone()
            dist.all_reduce(grad)
            torch.testing.assert_close(grad, reference[n], rtol=1e-9, atol=1e-12, msg=n)
    return True


@pytest.fixture(scope="module")
def pools():
    yield from started_pools((2, 4))


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind, scheme", [("rows", "zigzag"), ("tree", "ranges"), ("flat_tree", "ranges"),
                                          ("rows", "ulysses"), ("tree", "ulysses")])
def test_every_cut_on_gloo_ranks(pools, world, kind, scheme):
    assert values_of(pools[world], case_cut, kind, scheme, timeout_s=CASE_TIMEOUT_S) == [True] * world


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("trees", [False, True], ids=["rows", "trees"])
def test_hybrid_cp_composites_on_gloo_ranks(pools, world, trees):
    assert values_of(pools[world], case_hybrid, trees, timeout_s=CASE_TIMEOUT_S) == [True] * world
