"""Context parallelism over a prefix tree (issue 29, item 3): ``seqpack.attention``
on a tree's cut for one rank, ``seqpack.shard_layout(tree, cp, rank)`` (contiguous
ranges balanced by work, K/V all-gathered) or ``shard_layout(..., scheme="ulysses")``;
the implementations' agreement (``training.attention_tree_cp.tree_cp_attention``).

One process: each rank's varlen plan, run on the full K/V, gives its rows of
``seqpack.attention`` on the tree (hypothesis, every CP size). On 2 and 3 gloo ranks (one
RankPool per world size for the module): every rank's rows of the output and of
the q/k/v gradients equal the single-process tree attention in fp64 (GQA, pad
tokens, one KV head per gather, ranks without tokens), the same for Ulysses, a
one-layer model's training step on CP ranks (attention and the tree log-probs
of each rank's rows) gives the one-process loss and weight gradients, so
does SequencePackingLossWrapper given the tree and the CP group, and one rank's bad
input makes every rank raise (never a hang).
"""

import numpy as np
import pytest
import torch
import torch.distributed as dist
from _gloo import started_pools, values_of
from hypothesis import given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.tensors.prefix_tree_cp import tree_cp_bounds
from seqpack.tensors.tree_plans import tree_cp_plan
from seqpack.training.attention_cp import cp_attention
from seqpack.training.attention_tree_cp import tree_cp_attention
from seqpack.training.attention_ulysses import ulysses_attention

CASE_TIMEOUT_S = 60
WORLDS = (2, 3)
OTHERS = "another rank's input failed"


def _grpo_tree(seed=0, prompts=2, group=3, pad=4):
    rng = np.random.default_rng(seed)
    rows, groups = [], []
    for p in range(prompts):
        prompt = rng.integers(0, 50, int(rng.integers(3, 9))).tolist()
        for _ in range(group):
            rows.append(prompt + rng.integers(50, 99, int(rng.integers(1, 7))).tolist())
            groups.append(p)
    # an agentic row that branches off the first response of prompt 0
    rows.append(rows[0] + rng.integers(0, 99, 4).tolist())
    groups.append(0)
    return seqpack.pack_prefix_tree(rows, group_ids=groups, pad_to_multiple_of=pad)


def _qkv(t, hq=4, hk=2, d=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(t, h, d, generator=g, dtype=torch.float64) for h in (hq, hk, hk)]


# ------------------------------------------------------------------ one process
@st.composite
def trees(draw):
    rows, groups = [], []
    for g in range(draw(st.integers(1, 3))):
        prompt = draw(st.lists(st.integers(0, 3), min_size=0, max_size=8))
        for _ in range(draw(st.integers(1, 4))):
            rows.append(prompt + draw(st.lists(st.integers(0, 3), min_size=0 if prompt else 1, max_size=6)))
            groups.append(g)
    return seqpack.pack_prefix_tree(rows, group_ids=groups, pad_to_multiple_of=draw(st.sampled_from([1, 3])))


@settings(max_examples=40, deadline=None)
@given(trees(), st.integers(1, 5))
def test_every_rank_plan_gives_its_rows_of_tree_attention(tree, cp):
    q, k, v = _qkv(tree.num_tokens)
    full = seqpack.attention(q, k, v, tree, backend="reference")
    bounds = tree_cp_bounds(tree, cp)  # the plan's own bounds (cp = 1 included)
    parts = []
    for rank in range(cp):
        plan = tree_cp_plan(tree, bounds, rank)
        s, e = int(bounds[rank]), int(bounds[rank + 1])
        assert plan["cu_q"][-1] == e - s
        index = torch.from_numpy(plan["k_index"])
        parts.append(seqpack.varlen_attention(q[s:e], k[index], v[index], plan["cu_q"], plan["cu_k"], plan["max_q"],
                                              plan["max_k"], causal=True))
    torch.testing.assert_close(torch.cat(parts), full, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------ gloo ranks
def case_tree_cp(rank, world, seed):
    """attention on this rank's cut: its rows and gradients equal the whole tree's
    (fp64): all heads at once and one KV head per gather; GQA; pads; a second call
    with agree=False."""
    tree = _grpo_tree(seed)
    cut = seqpack.shard_layout(tree, world, rank)
    full = _qkv(tree.num_tokens, seed=seed)
    w = torch.randn(tree.num_tokens, 4, 8, generator=torch.Generator().manual_seed(seed + 7), dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in full]
    ref = seqpack.attention(*leaves, tree, backend="reference")
    (ref * w).sum().backward()
    local_w = cut.local_rows(w)
    for heads, agree in ((None, True), (1, True), (None, False)):
        local = [cut.local_rows(t).clone().requires_grad_() for t in full]
        out = seqpack.attention(*local, cut, group=dist.group.WORLD, kv_heads_per_chunk=heads, agree=agree)
        torch.testing.assert_close(out, cut.local_rows(ref.detach()), rtol=1e-10, atol=1e-12)
        (out * local_w).sum().backward()
        for mine, leaf in zip(local, leaves):
            torch.testing.assert_close(mine.grad, cut.local_rows(leaf.grad), rtol=1e-10, atol=1e-12)
    return True


def case_tree_cp_tiny(rank, world):
    """Fewer tokens than ranks: the ranks without tokens still join the gathers."""
    tree = seqpack.pack_prefix_tree([[3, 4]])
    cut = seqpack.shard_layout(tree, world, rank)
    full = _qkv(tree.num_tokens, hq=2, hk=1)
    leaves = [t.clone().requires_grad_() for t in full]
    ref = seqpack.attention(*leaves, tree, backend="reference")
    ref.sum().backward()
    local = [cut.local_rows(t).clone().requires_grad_() for t in full]
    out = seqpack.attention(*local, cut, group=dist.group.WORLD)
    torch.testing.assert_close(out, cut.local_rows(ref.detach()), rtol=1e-10, atol=1e-12)
    out.sum().backward()
    for mine, leaf in zip(local, leaves):
        torch.testing.assert_close(mine.grad, cut.local_rows(leaf.grad), rtol=1e-10, atol=1e-12)
    return True


def case_gather_tree_cp(rank, world):
    """gather_tree_cp rebuilds the layout; its backward sums over the ranks."""
    from seqpack.tensors import gather_tree_cp

    tree = _grpo_tree(3)
    full = torch.arange(tree.num_tokens * 3, dtype=torch.float64).view(-1, 3)
    local = seqpack.shard_layout(tree, world, rank).local_rows(full).clone().requires_grad_()
    gathered = gather_tree_cp(local, tree, dist.group.WORLD)
    assert torch.equal(gathered, full)
    (gathered * (rank + 1)).sum().backward()  # every rank's loss: the sum over ranks is world (world + 1) / 2
    assert torch.equal(local.grad, torch.full_like(local, world * (world + 1) / 2))
    return True


def case_ulysses_tree(rank, world):
    """attention on the tree's Ulysses cut equals the whole tree's (rows and
    gradients); a window (the implementation's argument) is refused for a tree."""
    from seqpack.tensors._ulysses import local_rows

    tree = _grpo_tree(5)
    t = tree.num_tokens
    n = local_rows(t, world)
    hq = 2 * world
    full = _qkv(t, hq=hq, hk=world, seed=5)
    leaves = [x.clone().requires_grad_() for x in full]
    ref = seqpack.attention(*leaves, tree, backend="reference")
    w = torch.randn(t, hq, 8, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    (ref * w).sum().backward()

    def mine(x):
        padded = torch.cat([x, x.new_zeros(n * world - t, *x.shape[1:])])
        return padded[rank * n: (rank + 1) * n]

    local = [mine(x).clone().requires_grad_() for x in full]
    out = seqpack.attention(*local, seqpack.shard_layout(tree, world, rank, scheme="ulysses"), group=dist.group.WORLD)
    torch.testing.assert_close(out, mine(ref.detach()), rtol=1e-10, atol=1e-12)
    (out * mine(w)).sum().backward()
    for got, leaf in zip(local, leaves):
        torch.testing.assert_close(got.grad, mine(leaf.grad), rtol=1e-10, atol=1e-12)
    try:
        ulysses_attention(*local, tree, window_size=(4, 0))
    except TypeError as exc:  # a window is rows' attention; a tree's is causal over its ancestors
        assert "rows share tokens" in str(exc)
    else:
        raise AssertionError("a window must be refused with a tree")
    return True


def case_failing_rank(rank, world):
    """One rank's q has the wrong rows, or its tree differs: every rank raises
    (that rank its own error, or all the same fingerprint error), then the normal
    path still runs."""
    tree = _grpo_tree(1)
    other = _grpo_tree(2)
    full = _qkv(tree.num_tokens)
    cut = seqpack.shard_layout(tree, world, rank)
    q, k, v = (cut.local_rows(t) for t in full)
    last = world - 1
    cases = [(last, (torch.cat([q, q[:1]]), k, v), tree, "must hold this rank's"),
             (0, (q, k[..., :3], v), tree, "same head dim"),
             (0, (q, k, v), "not a tree", "tree must be a PrefixTreeBatch")]
    for bad, inputs, its_tree, error in cases:
        args = inputs + (its_tree,) if rank == bad else (q, k, v, tree)
        try:
            tree_cp_attention(*args)
        except (ValueError, TypeError) as exc:
            expected = error if rank == bad else OTHERS
            assert expected in str(exc), (bad, error, str(exc))
        else:
            raise AssertionError(f"every rank must raise (rank {bad}: {error})")
    # Another tree on the last rank: its own checks pass, the fingerprint does not.
    mine_tree = other if rank == last else tree
    mine = [seqpack.shard_layout(mine_tree, world, rank).local_rows(t) for t in _qkv(mine_tree.num_tokens)]
    try:
        tree_cp_attention(*mine, mine_tree)
    except ValueError as exc:
        assert "disagree on the tree's segments" in str(exc), str(exc)
    else:
        raise AssertionError("ranks with different trees must raise")
    try:  # a tree's attention is causal: non-causal (zigzag) CP refuses it on every rank
        cp_attention(q, k, v, tree, causal=False)
    except (TypeError, ValueError) as exc:
        assert "a prefix tree's attention is causal" in str(exc), str(exc)
    else:
        raise AssertionError("cp_attention(causal=False) must refuse a tree")
    ref = cut.local_rows(seqpack.attention(*full, tree, backend="reference"))
    torch.testing.assert_close(tree_cp_attention(q, k, v, tree), ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(seqpack.attention(q, k, v, cut, group=dist.group.WORLD), ref, rtol=1e-10, atol=1e-12)
    # The deprecated seqpack.cp_attention still takes a whole tree (it runs its contiguous cut).
    with pytest.warns(DeprecationWarning, match=r"seqpack\.cp_attention is deprecated"):
        old_cp_attention = seqpack.cp_attention
    torch.testing.assert_close(old_cp_attention(q, k, v, tree), ref, rtol=1e-10, atol=1e-12)
    return True


def _tiny_model_loss(params, ids, positions, layout, attend):
    """One layer: embedding + position embedding, q/k/v, attention over the tree, the
    output projection, the LM head; loss = -sum of the logical tokens' log-probs."""
    emb, pos, wqkv, wo, head = params
    x = emb[ids] + pos[positions]
    q, k, v = (x @ wqkv).view(x.shape[0], 3, 4, 4).unbind(1)
    x = x + attend(q, k, v).reshape(x.shape[0], -1) @ wo
    return -seqpack.token_logprobs(x, layout, weight=head).logprobs.sum()


def case_train_step(rank, world):
    """A training step on CP ranks (their rows of the tree's cut, attention and
    log-probs on it, the losses and weight gradients summed over the group) equals the
    one-process step on the whole tree (fp64)."""
    tree = _grpo_tree(6)
    g = torch.Generator().manual_seed(6)
    params = [torch.randn(*shape, generator=g, dtype=torch.float64) * 0.3
              for shape in ((100, 16), (40, 16), (16, 48), (16, 16), (100, 16))]
    ids, positions = torch.from_numpy(tree.input_ids % 100), torch.from_numpy(tree.position_ids)
    whole = [p.clone().requires_grad_() for p in params]
    ref = _tiny_model_loss(whole, ids, positions, tree, lambda q, k, v: seqpack.attention(q, k, v, tree))
    ref.backward()
    mine = [p.clone().requires_grad_() for p in params]
    cut = seqpack.shard_layout(tree, world, rank)
    loss = _tiny_model_loss(mine, cut.local_rows(ids), cut.local_rows(positions), cut,
                            lambda q, k, v: seqpack.attention(q, k, v, cut, group=dist.group.WORLD))
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    torch.testing.assert_close(total, ref.detach(), rtol=1e-12, atol=1e-12)
    for p, r in zip(mine, whole):
        dist.all_reduce(p.grad)
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-10, atol=1e-12)
    return True


def case_loss_wrapper(rank, world):
    """SequencePackingLossWrapper on a tree with a CP group: each rank's rows of the
    logits; the loss (the same on every rank) / cp backwards into exactly its rows of
    the one-process gradient."""
    from test_loss_tree import LOSSES, VOCAB, tree_batch

    from seqpack.loss import SequencePackingLossWrapper

    tree, data, gvt, gvs = tree_batch(seed=1, pad=4)
    physical = torch.randn(tree.num_tokens, VOCAB, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for loss_fn in LOSSES:
        whole = physical.clone().requires_grad_()
        ref, _ = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tree)(whole, data, gvs, gvt)
        ref.backward()
        local = seqpack.shard_layout(tree, world, rank).local_rows(physical).clone().requires_grad_()
        wrapper = SequencePackingLossWrapper(loss_fn, cu_seqlens_q=tree, context_parallel_group=dist.group.WORLD)
        loss, _ = wrapper(local, data, gvs, gvt)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-12, atol=1e-12)
        (loss / world).backward()
        torch.testing.assert_close(local.grad, seqpack.shard_layout(tree, world, rank).local_rows(whole.grad),
                                   rtol=1e-10, atol=1e-12)
    try:  # the last rank gives the whole tree's logits: every rank raises, none waits in the all-reduce
        wrapper(physical if rank == world - 1 else local.detach(), data, gvs, gvt)
    except ValueError as exc:
        assert ("this CP rank's" if rank == world - 1 else OTHERS) in str(exc), str(exc)
    else:
        raise AssertionError("every rank must raise")
    return True


@pytest.fixture(scope="module")
def pools():
    yield from started_pools(WORLDS)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case, args", [(case_tree_cp, (0,)), (case_tree_cp, (4,)), (case_tree_cp_tiny, ()),
                                        (case_gather_tree_cp, ()), (case_ulysses_tree, ()),
                                        (case_failing_rank, ()), (case_train_step, ()), (case_loss_wrapper, ())],
                         ids=["cp-seed0", "cp-seed4", "tiny", "gather", "ulysses", "failing-rank", "train-step",
                              "loss-wrapper"])
def test_on_gloo_ranks(pools, world, case, args):
    assert values_of(pools[world], case, *args, timeout_s=CASE_TIMEOUT_S) == [True] * world  # a hang raises
