"""seqpack on CUDA the way a trainer drives it: side streams, no host synchronisation
on the hot paths, CUDA-graph capture and ``torch.compile(fullgraph=True)`` of the
static-shape step (pack_sequences_static -> LM head -> packed_token_logprobs ->
loss), against eager execution and a padded PyTorch computation.

Marked ``gpu``: skipped where PyTorch sees no CUDA device, failed where it sees one
but seqpack's CUDA kernels cannot run (conftest.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import seqpack
from seqpack.logprobs import packed_token_logprobs

pytestmark = pytest.mark.gpu

BATCH, WIDTH, HIDDEN, VOCAB = 4, 32, 64, 1027
MAX_TOKENS, MAX_SEQS, MULTIPLE, TEMPERATURE = 160, 6, 8, 0.8
NORM = 64.0  # the loss's token normaliser (a constant: nothing is read back)


def layout(lens, multiple):
    padded = [-(-int(n) // multiple) * multiple for n in lens]
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    cu_p = np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)
    return cu, cu_p


def make_head(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(HIDDEN, VOCAB, device="cuda")


def make_inputs(seed):
    """(hidden [B, S, H], ids [B, S], lengths [B]) on the device; the padded lengths
    always fit MAX_TOKENS (4 x 32 <= 160)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(BATCH, WIDTH, HIDDEN, generator=g)
    ids = torch.randint(0, VOCAB, (BATCH, WIDTH), generator=g)
    lens = torch.randint(0, WIDTH + 1, (BATCH,), generator=g)
    lens[seed % BATCH] = WIDTH
    lens[(seed + 1) % BATCH] = 1
    return h.cuda(), ids.cuda(), lens.cuda()


def static_loss(head, h, ids, lens):
    """The static-shape step: no host read anywhere (device lengths, device int32 offsets)."""
    packed = seqpack.pack_sequences_static({"h": h, "ids": ids}, lens, max_tokens=MAX_TOKENS, max_seqs=MAX_SEQS,
                                           pad_multiple=MULTIPLE)
    logits = head(packed["h"])
    out = packed_token_logprobs(logits, packed["ids"], packed.cu_seqlens, packed.cu_seqlens_padded,
                                return_entropy=True, temperature=TEMPERATURE)
    loss = -out.logprobs.sum() / NORM - 0.01 * out.entropy.sum()
    return loss, out.logprobs, out.entropy


def padded_loss(head, h, ids, lens):
    """The same loss on the padded batch with log_softmax + gather, in fp64."""
    logits = head(h).double()
    lsm = torch.log_softmax(logits / TEMPERATURE, -1)
    loss = logits.new_zeros(())
    for b, n in enumerate(lens.tolist()):
        if n < 2:
            continue
        lp = lsm[b, torch.arange(n - 1, device=lsm.device), ids[b, 1:n]]
        p = lsm[b, : n - 1].exp()
        loss = loss - lp.sum() / NORM - 0.01 * -(p * lsm[b, : n - 1]).sum()
    return loss


def test_side_stream_pack_logprobs_unpack():
    # Everything on a side stream whose inputs are written on that stream after a
    # long sleep: a kernel or metadata copy issued on any other stream would read the
    # inputs before they are written. The main stream waits for the side stream and
    # checks the results against the same calls made on the main stream.
    torch.manual_seed(0)
    lens, multiple, vocab = [48, 3, 0, 17, 31], 8, 300
    cu, cu_p = layout(lens, multiple)
    x_src = torch.randn(len(lens), 48, 16, device="cuda")
    ids_src = torch.randint(0, vocab, (len(lens), 48), device="cuda")
    w = torch.randn(16, vocab, device="cuda")

    def compute(x, ids):
        packed = seqpack.pack_sequences({"x": x, "ids": ids}, seq_lens=lens, pad_multiple=multiple)
        logits = (packed["x"] @ w).requires_grad_()
        out = packed_token_logprobs(logits, packed["ids"], cu, cu_p, return_entropy=True)
        (out.logprobs.sum() + out.entropy.sum()).backward()
        return (packed["x"], packed["ids"], packed.position_ids, out.logprobs.detach(), out.entropy.detach(),
                logits.grad, packed.unpack(packed["x"], fill=-1.0))

    expected = compute(x_src, ids_src)
    main = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    x = torch.zeros_like(x_src)
    ids = torch.zeros_like(ids_src)
    side.wait_stream(main)  # x, ids (zeros) and the sources are ready
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # tens of milliseconds of device time on the side stream
        x.copy_(x_src)
        ids.copy_(ids_src)
        got = compute(x, ids)
    main.wait_stream(side)
    for t in got:
        t.record_stream(main)  # allocated on the side stream, read on the main one
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[6], expected[6])
    torch.cuda.synchronize()


def test_no_host_sync_on_the_hot_paths():
    # pack_sequences with host lengths, unpack, position ids, packed_token_logprobs
    # forward + backward with host offsets, pack_sequences_static with device lengths
    # and its device offsets: no synchronising call (sync debug mode "error" raises on
    # one). A first run outside the mode warms up lazy initialisation.
    g = torch.Generator().manual_seed(1)
    lens, multiple, vocab = [9, 0, 30, 4], 4, 257
    cu, cu_p = layout(lens, multiple)
    x = torch.randn(4, 30, 8, generator=g).cuda()
    ids = torch.randint(0, vocab, (4, 30), generator=g).cuda()
    logits = torch.randn(int(cu_p[-1]), vocab, generator=g).cuda()
    dev_lens = torch.tensor(lens).cuda()
    uniform = torch.ones(64, vocab, device="cuda")

    def hot():
        packed = seqpack.pack_sequences({"x": x, "ids": ids}, seq_lens=lens, pad_multiple=multiple)
        back = packed.unpack(packed["x"])
        positions = packed.position_ids
        leaf = logits.clone().requires_grad_()
        out = packed_token_logprobs(leaf, packed["ids"], cu, cu_p, return_entropy=True)
        (out.logprobs.sum() - out.entropy.sum()).backward()
        static = seqpack.pack_sequences_static({"x": x, "ids": ids}, dev_lens, max_tokens=64, max_seqs=6,
                                               pad_multiple=multiple)
        dev = packed_token_logprobs(uniform, static["ids"], static.cu_seqlens, static.cu_seqlens_padded,
                                    return_entropy=True)
        return (packed["x"], back, positions, out.logprobs.detach(), out.entropy.detach(), leaf.grad, static["x"],
                static.cu_seqlens_padded, dev.logprobs, dev.entropy)

    warm = hot()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = hot()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    for a, b in zip(got, warm):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # Uniform logits: every row with a target has log-prob -log(V) and entropy log(V).
    lp, ent = got[8], got[9]
    rows = lp != 0
    assert int(rows.sum()) == sum(max(n - 1, 0) for n in lens)
    torch.testing.assert_close(lp[rows], torch.full_like(lp[rows], -np.log(vocab)))
    torch.testing.assert_close(ent[rows], torch.full_like(ent[rows], np.log(vocab)))


def test_cuda_graph_static_pack_head_logprobs_loss():
    # Capture the whole static step (pack -> head -> log-probs with entropy -> loss ->
    # gradients of the head) after a warm-up on a side stream; replay it on new values
    # copied into the static inputs and compare with eager execution (and eager with
    # the padded PyTorch loss).
    head = make_head()
    params = (head.weight, head.bias)

    def step(h, ids, lens):
        loss, lp, ent = static_loss(head, h, ids, lens)
        grads = torch.autograd.grad(loss, params)
        return (loss.detach(), lp.detach(), ent.detach(), *grads)

    static_h, static_ids, static_lens = make_inputs(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step(static_h, static_ids, static_lens)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_h, static_ids, static_lens)
    losses = []
    for seed in (1, 2, 3):
        h, ids, lens = make_inputs(seed)
        static_h.copy_(h)
        static_ids.copy_(ids)
        static_lens.copy_(lens)
        graph.replay()
        replayed = [t.clone() for t in static_out]
        losses.append(float(replayed[0]))
        eager = step(h, ids, lens)
        for a, b in zip(replayed, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(eager[0].double(), padded_loss(head, h, ids, lens).detach(), rtol=1e-5,
                                   atol=1e-5)
    assert len(set(losses)) == 3  # each replay read its own inputs


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_fullgraph_static_path(backend):
    # torch.compile(fullgraph=True) of the static step on CUDA: no graph break; loss,
    # log-probs, entropies and the head's gradients equal eager's.
    if backend == "inductor":
        from torch.utils._triton import has_triton

        if not has_triton():
            pytest.skip("inductor on CUDA needs triton")
    head = make_head()

    def run(fn, inputs):
        head.zero_grad(set_to_none=True)
        loss, lp, ent = fn(head, *inputs)
        loss.backward()
        return loss.detach(), lp.detach(), ent.detach(), head.weight.grad.clone(), head.bias.grad.clone()

    torch._dynamo.reset()
    compiled = torch.compile(static_loss, fullgraph=True, backend=backend)
    for seed in (0, 1):  # a second call with new values (and lengths) reuses the graph
        inputs = make_inputs(seed)
        eager = run(static_loss, inputs)
        got = run(compiled, inputs)
        for a, b in zip(got, eager):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(eager[0].double(), padded_loss(head, *inputs).detach(), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
