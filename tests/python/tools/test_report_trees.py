"""The demo's reports: plan_step against the frameworks' pipelines, and a GRPO
batch as prefix trees (tables recomputed from their own inputs)."""

import numpy as np
import pytest

import seqpack
from seqpack.testing.pipelines import nemo_rl_pipeline, simulate
from seqpack.tools.report import synthetic_rl_lengths
from seqpack.tools.report_step import step_table
from seqpack.tools.report_trees import CAP_MULTIPLES, grpo_rows, tree_report


def test_step_table_compares_with_the_pipelines_it_names():
    lengths = synthetic_rl_lengths(300, seed=1)  # 300 % 8 = 4 rows left out
    table = step_table(lengths, capacity=8192, dp_size=8)
    names = [r[0] for r in table.rows]
    assert names == ["seqpack plan_step", "NeMo-RL (MFFD bins, round-robin)", "verl (balance_batch + dynamic bsz)"]
    ours = seqpack.plan_step(lengths[:296], 8, 8192)  # CostModel.default(), as the table
    assert table.rows[0][3] == ours.predicted_time
    nemo = simulate(nemo_rl_pipeline(lengths[:296], 8, 8192), lengths[:296], seqpack.CostModel.default(),
                    max_tokens=8192)
    assert table.rows[1][3] == nemo["time"] and table.rows[1][4] == pytest.approx(nemo["time"] / ours.predicted_time)
    assert all(r[4] >= 1.0 - 1e-3 for r in table.rows)  # plan_step is (near) the fastest


def test_tree_report_numbers_come_from_the_batch():
    rows, groups = grpo_rows(prompts=12, group=4, seed=3, max_len=4096)
    assert len(rows) == 48 and max(len(r) for r in rows) <= 4096
    rep = tree_report(rows, groups, capacity=4096, dp_size=2)
    first = {r[0]: r[1:] for r in rep.tables[0].rows}
    tree = seqpack.pack_prefix_tree(rows, group_ids=groups).metrics()
    assert first["tokens computed"][:2] == [tree.logical_tokens, tree.physical_tokens]
    assert first["attention pairs"][:2] == [tree.plain_attention_pairs, tree.tree_attention_pairs]
    assert first["micro-batches per rank"][1] <= first["micro-batches per rank"][0]
    assert len(rep.caps) == len(CAP_MULTIPLES) and rep.caps == sorted(rep.caps)
    assert all(0 < s <= 1 for s in rep.sharing_kept) and rep.sharing_kept[-1] == 1.0
    assert "prefix trees" in rep.format() and "<table>" in rep._repr_html_()


def test_tree_report_plots(tmp_path):
    pytest.importorskip("matplotlib")
    rep = tree_report(*grpo_rows(prompts=4, group=2, seed=0, max_len=4096), capacity=4096, dp_size=2)
    path = tmp_path / "trees.png"
    rep.plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
