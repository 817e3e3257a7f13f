"""A hybrid-CP micro-batch's composite layout (``PartsLayout``) is a TokenLayout:
its counts, offsets, logical order and positions are its parts' back to back, its
cut is composite, it pickles, and the one operations take it in place of the
micro-batch."""

import pickle

import numpy as np
import pytest
import torch

import seqpack
from seqpack.tensors.layout_kinds import as_layout, is_composite, layout_cut, layout_kind
from seqpack.tensors.parts_layout import PartsLayout


def micro_batches(trees, cap=20, rank=0):
    rng = np.random.default_rng(4)
    if trees:
        prompts = [rng.integers(1, 50, n).tolist() for n in (20, 4, 6)]
        rows = [p + rng.integers(1, 50, int(rng.integers(1, 6))).tolist() for p in prompts for _ in range(2)]
    else:
        rows = [rng.integers(1, 50, n).tolist() for n in (33, 17, 5, 3, 9, 2)]
    ids = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    lengths = [len(r) for r in rows]
    forest = seqpack.PrefixForest.from_rows(rows) if trees else None
    cost = seqpack.CostModel(per_micro_batch=20.0, per_token=1.0, per_token_squared=0.02, per_kv_token=0.5)
    plan = seqpack.plan_step(lengths, 1, cap, cost=cost, cp_size=2, hybrid_cp=True, forest=forest)
    out = []
    for k in range(plan.num_micro_batches[0]):
        out.append(seqpack.pack_hybrid_cp({"input_ids": ids}, lengths, plan, rank=rank, micro_batch=k, forest=forest))
    return rows, out


@pytest.mark.parametrize("trees", [False, True])
def test_the_composite_is_its_parts_back_to_back(trees):
    rows, mbs = micro_batches(trees)
    assert any(p.degree > 1 for mb in mbs for p in mb.parts)  # sharded parts are covered
    for mb in mbs:
        layout = mb.layout
        assert isinstance(layout, seqpack.TokenLayout) and as_layout(mb) is layout and mb.layout is layout
        assert layout_kind(mb) == layout_kind(layout) == "parts" and is_composite(layout) and is_composite(mb)
        assert layout_cut(layout).kind == "composite" and layout.cut == mb.cut
        wholes = [as_layout(p.layout) for p in layout.parts]
        assert layout.num_tokens == sum(w.num_tokens for w in wholes)
        assert layout.num_rows == len(mb.rows)
        assert layout.num_local_tokens == mb.num_tokens
        assert layout.seq_lens.tolist() == [len(rows[i]) for i in mb.rows]
        # the logical tokens, read through the parts' stream, are the rows' ids
        stream = np.concatenate([np.asarray(w.to_physical(np.concatenate([rows[i] for i in p.rows])))
                                 for w, p in zip(wholes, layout.parts)]) if wholes else np.zeros(0, np.int64)
        expected = [t for i in mb.rows for t in rows[i]]
        assert layout.to_logical(stream).tolist() == expected
        assert layout.position_ids.tolist() == [q for w in wholes for q in w.position_ids.tolist()]
        assert layout.rows() is None
        with pytest.raises(TypeError, match="composite of parts"):
            layout.packed_seq_params()
        back = pickle.loads(pickle.dumps(layout))
        assert back == layout and back.planned() == ()  # host plans are rebuilt where it lands


def test_the_ops_take_the_composite_layout():
    # Rows that fit the cap whole: every part whole, run without a process group.
    _, mbs = micro_batches(False, cap=64)
    assert all(p.degree == 1 for mb in mbs for p in mb.parts)
    for mb in mbs:
        torch.manual_seed(0)
        n = mb.num_tokens
        q, k, v = (torch.randn(n, 2, 4, dtype=torch.float64) for _ in range(3))
        torch.testing.assert_close(seqpack.attention(q, k, v, mb.layout), seqpack.attention(q, k, v, mb))
        logits = torch.randn(n, 50, dtype=torch.float64)
        torch.testing.assert_close(seqpack.token_logprobs(logits, mb.layout).logprobs,
                                   seqpack.token_logprobs(logits, mb).logprobs)
        with pytest.raises(ValueError, match=f"must hold this rank's {n} rows"):
            seqpack.attention(q[:-1], k[:-1], v[:-1], mb.layout)
    assert isinstance(mbs[0].layout, PartsLayout)


def test_static_shapes_reach_the_hybrid_micro_batches():
    # Issue 51, finding 9: the plan priced each rank's micro-batch at its bucket, the
    # tensors held fewer rows (20 and 18 where the plan said 24 and 24).
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 50, n).tolist() for n in (33, 17, 5, 3, 9, 2, 11, 7)]
    lengths = [len(r) for r in rows]
    ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
    cost = seqpack.CostModel(per_micro_batch=20.0, per_token=1.0, per_token_squared=0.02, per_kv_token=0.5)
    for cap, shapes in ((24, [12, 18, 24]), (64, True)):
        plan = seqpack.plan_step(lengths, 1, cap, cost=cost, cp_size=2, hybrid_cp=True, static_shapes=shapes)
        assert plan.padded_tokens is not None
        for r in range(2):
            for k in range(plan.num_micro_batches[0]):
                mb = seqpack.pack_hybrid_cp({"input_ids": ids}, lengths, plan, rank=r, micro_batch=k)
                size, real = plan.padded_tokens[0][r][k], plan.tokens[0][r][k]
                assert mb.num_tokens == mb.layout.num_local_tokens == size
                assert mb["input_ids"].shape[0] == mb.position_ids.shape[0] == size
                assert mb.layout.num_local_pad_rows == size - real
                if cap == 64:  # every part whole: run the ops without a process group
                    torch.manual_seed(0)
                    q, kk, v = (torch.randn(size, 2, 4, dtype=torch.float64) for _ in range(3))
                    out = seqpack.attention(q, kk, v, mb)
                    assert out.shape[0] == size and not out[real:].any()
                    bare = seqpack.pack_hybrid_cp({"input_ids": ids}, lengths, dataclasses_replace(plan), rank=r,
                                                  micro_batch=k)
                    torch.testing.assert_close(out[:real], seqpack.attention(q[:real], kk[:real], v[:real], bare))
                    logits = torch.randn(size, 50, dtype=torch.float64)
                    torch.testing.assert_close(seqpack.token_logprobs(logits, mb).logprobs,
                                               seqpack.token_logprobs(logits[:real], bare).logprobs)


def dataclasses_replace(plan):
    """The same plan without its static shapes (the bare micro-batches)."""
    import dataclasses

    return dataclasses.replace(plan, padded_tokens=None, shape_buckets=None)
