"""The tiny transformer on a prefix tree (issue 28, item 5): on random forests
(duplicates, rows inside rows, empty rows, groups, padding) in fp64, the tree's
logits at every row's tokens equal the row run alone, its log-probs equal the plain
packed path's, and an NLL / ClippedPG loss through the loss classes on the logical
layout, with every parameter gradient, equals the rows-alone one."""

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import seqpack
from seqpack.testing.tiny_model import TinyCausalLM, TinyConfig, tree_loss
from seqpack.training.nemo_rl_loss import ClippedPGLoss, NLLLoss

CFG = TinyConfig(vocab_size=16, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2)
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a forward and two backwards per example: fewer
LOSS_SETTINGS = settings(SETTINGS, max_examples=6)

# A 3-token alphabet makes rows share prefixes, duplicate and end inside each other.
rows_st = st.lists(st.lists(st.integers(0, 2), max_size=6), min_size=1, max_size=6)


@st.composite
def forests(draw):
    rows = draw(rows_st)
    groups = draw(st.none() | st.lists(st.integers(0, 2), min_size=len(rows), max_size=len(rows)))
    tree = seqpack.pack_prefix_tree(rows, group_ids=groups, min_shared_tokens=draw(st.integers(0, 2)),
                                    pad_to_multiple_of=draw(st.integers(1, 4)))
    return rows, tree


def model(seed=0):
    torch.manual_seed(seed)
    m = TinyCausalLM(CFG).double()
    for p in m.parameters():  # larger than the 0.02 embedding init: logits that differ per token
        torch.nn.init.normal_(p, std=0.3)
    return m


def alone_logits(m, row):
    ids = torch.tensor(row)[None]
    return m.forward_padded(ids, torch.ones_like(ids))[0]


def row_index(tree, r):
    return torch.tensor(tree.logical_index[tree.cu_seqlens[r]:tree.cu_seqlens[r + 1]])


def padded_logprobs(logical, cu, width):
    """Logical next-token log-probs [N] as NeMo-RL's [B, S - 1] (row r's first
    len - 1 values; its last token predicts nothing)."""
    out = []
    for r in range(len(cu) - 1):
        lo, hi = int(cu[r]), int(cu[r + 1])
        part = logical[lo:max(hi - 1, lo)]
        out.append(torch.cat([part, part.new_zeros(width - 1 - part.shape[0])]))
    return torch.stack(out)


def loss_data(rows, seed):
    g = torch.Generator().manual_seed(seed)
    b, s = len(rows), max(2, max(len(r) for r in rows))
    ids = torch.zeros(b, s, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.float64)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, :len(r)] = 1
    mask = mask * (torch.rand(b, s, generator=g) > 0.2)  # some tokens masked out
    data = {"input_ids": ids, "token_mask": mask, "sample_mask": (torch.rand(b, generator=g) > 0.1).double()}
    data["advantages"] = torch.randn(b, s, generator=g, dtype=torch.float64)
    for key in ("generation_logprobs", "prev_logprobs", "reference_policy_logprobs"):  # log-probs: <= 0
        data[key] = -torch.rand(b, s, generator=g, dtype=torch.float64)
    return data, s


def grads(m):
    return {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in m.named_parameters()}


@SETTINGS
@given(forests())
def test_tree_logits_equal_rows_alone(case):
    rows, tree = case
    m = model()
    with torch.no_grad():
        logits = m.forward_tree(tree)
        assert logits.shape == (tree.num_tokens, CFG.vocab_size)
        for r, row in enumerate(rows):
            if row:
                torch.testing.assert_close(logits[row_index(tree, r)], alone_logits(m, row), rtol=1e-10,
                                           atol=1e-12)


@SETTINGS
@given(forests())
def test_tree_logprobs_equal_packed_path(case):
    """tree_token_logprobs on the tree's logits equals the plain packed path: the
    non-empty rows packed back to back (THD, varlen attention, pad_multiple 4)
    through token_logprobs; empty rows have no logical tokens in either."""
    rows, tree = case
    kept = [r for r in rows if r]
    if not kept:
        return
    m = model(1)
    width = max(map(len, kept))
    ids = torch.zeros(len(kept), width, dtype=torch.long)
    for i, r in enumerate(kept):
        ids[i, :len(r)] = torch.tensor(r)
    with torch.no_grad():
        out = seqpack.token_logprobs(m.forward_tree(tree), tree, return_entropy=True)
        batch = seqpack.pack_sequences({"input_ids": ids}, seq_lens=[len(r) for r in kept], pad_multiple=4)
        ref = seqpack.token_logprobs(m.forward_packed(batch), batch, batch["input_ids"], return_entropy=True)
    real = torch.cat([torch.arange(int(p), int(p) + len(r)) for p, r in zip(batch.cu_seqlens_padded, kept)])
    torch.testing.assert_close(out.logprobs, ref.logprobs[real], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.entropy, ref.entropy[real], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("loss_fn", [NLLLoss(), ClippedPGLoss()], ids=["nll", "clipped_pg"])
@LOSS_SETTINGS
@given(case=forests(), seed=st.integers(0, 3))
def test_tree_loss_and_gradients_equal_rows_alone(loss_fn, case, seed):
    rows, tree = case
    assume(any(rows))  # no tokens: no graph to differentiate
    data, width = loss_data(rows, seed)
    toks = float((data["token_mask"][:, 1:] * data["sample_mask"][:, None]).sum().clamp(min=1))
    seqs = float(data["sample_mask"].sum().clamp(min=1))

    m = model(2)
    logical = seqpack.token_logprobs(m.forward_tree(tree), tree).logprobs
    loss, _ = loss_fn(padded_logprobs(logical, tree.cu_seqlens, width), data, seqs, toks)
    loss.backward()
    tree_grads = grads(m)

    m.zero_grad()
    per_row = []
    for row in rows:
        if not row:
            continue
        logp = torch.log_softmax(alone_logits(m, row)[:-1], -1).gather(-1, torch.tensor(row[1:])[:, None])[:, 0]
        per_row.append(torch.cat([logp, logp.new_zeros(1)]))  # a row's last token: 0, as the packed path
    logical_alone = torch.cat(per_row) if per_row else torch.zeros(0, dtype=torch.float64)
    ref, _ = loss_fn(padded_logprobs(logical_alone, tree.cu_seqlens, width), data, seqs, toks)
    ref.backward()

    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=1e-10, atol=1e-12)
    for name, g in grads(m).items():
        torch.testing.assert_close(tree_grads[name], g, rtol=1e-9, atol=1e-12, msg=name)


def test_tree_loss_helper_equals_padded_loss():
    rows = [[1, 2, 3, 4], [1, 2, 3, 5, 6], [1, 2], [7, 8, 9]]
    m = model(3)
    tree = seqpack.pack_prefix_tree(rows, pad_to_multiple_of=8)
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
    tokens = float(sum(len(r) - 1 for r in rows))
    from seqpack.testing.tiny_model import padded_loss

    ref = padded_loss(m, ids, mask, tokens)
    ref.backward()
    ref_grads = grads(m)
    m.zero_grad()
    loss = tree_loss(m, tree, tokens)
    loss.backward()
    # padded_loss takes its log-softmax in fp32 (as trainers do): fp32 tolerances
    torch.testing.assert_close(loss.detach().float(), ref.detach(), rtol=1e-5, atol=1e-6)
    for name, g in grads(m).items():
        torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    assert tree.num_tokens - tree.num_pad_tokens == 9  # 14 logical tokens: the shared prefixes once


def test_forward_tree_rejects_other_batches():
    with pytest.raises(TypeError, match="tree must be a PrefixTreeBatch"):
        model().forward_tree([[1, 2]])
