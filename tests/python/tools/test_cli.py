"""seqpack.tools.cli: the README's main job (`seqpack demo`) and `seqpack plan`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from seqpack import cli

SMALL = ["--dp", "2", "--capacity", "4096", "--round", "16"]


def test_demo_prints_every_section(capsys):
    assert cli.main(["demo", "-n", "512", *SMALL]) == 0
    out = capsys.readouterr().out
    for title in ("Data-parallel balance", "Sequence packing per rank", "Dynamic batching",
                  "Load-balanced micro-batches", "One training step: plan_step vs the frameworks' pipelines",
                  "A GRPO batch as prefix trees", "Sharing kept vs the cap"):
        assert title in out
    for name in ("first_fit_decreasing", "best_fit_decreasing", "modified_first_fit_decreasing",
                 "concatenative", "first_fit_shuffle", "greedy_sequential", "karmarkar_karp", "optimal"):
        assert name in out


def test_demo_as_console_module():
    # The README runs `seqpack demo`; `python -m seqpack` is the same entry point.
    done = subprocess.run([sys.executable, "-m", "seqpack", "demo", "-n", "256", *SMALL],
                          capture_output=True, text=True, check=True)
    assert "Sequence packing per rank" in done.stdout


def test_plan_reads_text_and_npy(tmp_path, capsys):
    lengths = np.random.default_rng(3).integers(1, 4096, 200)
    txt = tmp_path / "lens.txt"
    txt.write_text("# response lengths\n" + "\n".join(map(str, lengths)) + "\n\n")
    npy = tmp_path / "lens.npy"
    np.save(npy, lengths.astype(np.int32))
    assert cli.main(["plan", "--lengths", str(txt), "--json", *SMALL]) == 0
    from_text = json.loads(capsys.readouterr().out)
    assert cli.main(["plan", "--lengths", str(npy), "--json", *SMALL]) == 0
    from_npy = json.loads(capsys.readouterr().out)

    def without_timings(tables):
        return [[row[:-1] for row in t["rows"]] for t in tables]

    assert without_timings(from_text) == without_timings(from_npy)
    packing = next(t for t in from_text if t["title"].startswith("Sequence packing"))
    assert "bins" in packing["columns"]


def test_plan_selected_algorithm(tmp_path, capsys):
    path = tmp_path / "lens.txt"
    path.write_text("100\n200\n3000\n")
    assert cli.main(["plan", "--lengths", str(path), "--algorithm", "best_fit_decreasing", "--dp", "1"]) == 0
    out = capsys.readouterr().out
    assert "best_fit_decreasing" in out and "modified_first_fit_decreasing" not in out


@pytest.mark.parametrize(
    "content, message",
    [("12\nabc\n", "lens.txt:2: not an integer length"), ("12\n9000\n", "capacity")],
)
def test_plan_bad_lengths_exit_2_with_message(tmp_path, capsys, content, message):
    path = tmp_path / "lens.txt"
    path.write_text(content)
    assert cli.main(["plan", "--lengths", str(path), "--dp", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("seqpack plan: error:") and message in err


def test_plan_missing_file(tmp_path, capsys):
    assert cli.main(["plan", "--lengths", str(tmp_path / "missing.txt")]) == 2
    assert "No such file" in capsys.readouterr().err


def test_plan_rejects_2d_npy(tmp_path, capsys):
    path = tmp_path / "lens.npy"
    np.save(path, np.ones((2, 2), dtype=np.int64))
    assert cli.main(["plan", "--lengths", str(path)]) == 2
    assert "1-D array of integer lengths" in capsys.readouterr().err


def test_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "plan.png"
    assert cli.main(["demo", "-n", "256", *SMALL, "--plot", str(out)]) == 0
    trees = tmp_path / "plan_trees.png"  # the demo's prefix-tree figure beside it
    printed = capsys.readouterr().out
    for png in (out, trees):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"figure saved to {png}" in printed


def test_bench_runs(capsys):
    assert cli.main(["bench", "--sizes", "64", "--capacity", "512"]) == 0
    assert "Planner speed" in capsys.readouterr().out


def test_demo_json_is_one_array_and_small_capacities_work(capsys):
    # The demo's two reports print as one JSON array; a cap below the synthetic
    # prompts' lengths still runs (prompts are clipped to half of it).
    assert cli.main(["demo", "-n", "256", "--dp", "2", "--capacity", "1024", "--round", "16", "--json"]) == 0
    titles = [t["title"] for t in json.loads(capsys.readouterr().out)]
    assert "A GRPO batch as prefix trees: plan_step plain vs with a PrefixForest" in titles
    assert titles[0] == "Data-parallel balance (tokens per rank)"


def test_demo_with_context_parallelism(capsys):
    """`seqpack demo --cp 4`: fixed vs hybrid CP on a long-context batch (issue 41):
    hybrid gathers the least K/V its lengths allow here, and is predicted no slower."""
    assert cli.main(["demo", "-n", "128", "--cp", "4", "--capacity", "4096", "--dp", "2"]) == 0
    out = capsys.readouterr().out
    assert "Context parallelism: fixed vs hybrid CP (plan_step, cp_size=4)" in out
    from seqpack.tools.report_cp import cp_report, long_context_lengths

    rows = cp_report(long_context_lengths(128, 4 * 4096), 4096, 2, 4).tables[0].rows
    fixed, hybrid = rows
    assert fixed[1] == "4:128" and hybrid[2] <= fixed[2] and hybrid[5] <= fixed[5] * (1 + 1e-9)
    assert cli.main(["demo", "-n", "64", "--cp", "3"]) == 2
    assert "cp_size must be a power of two" in capsys.readouterr().err


@pytest.mark.parametrize("text, line, rule", [
    ("5\n# a comment\n0\n3\n", 3, "a length must be >= 1"),
    ("5\n-2\n", 2, "a length must be >= 1"),
    ("5\n\n9000\n", 3, "length 9000 exceeds --capacity 4096"),
    ("5\n" + str(2**63) + "\n", 2, "does not fit in int64"),
])
def test_plan_names_a_bad_length_where_it_is(tmp_path, capsys, text, line, rule):
    # Issue 51, item 8: 0 and negative lengths were internal index errors (and 0
    # passed one planner, failed another): one rule, named at file:line.
    path = tmp_path / "lens.txt"
    path.write_text(text)
    assert cli.main(["plan", "--lengths", str(path), *SMALL]) == 2
    err = capsys.readouterr().err
    assert f"{path}:{line}: " in err and rule in err
    npy = tmp_path / "lens.npy"
    np.save(npy, np.array([5, 0, 3], dtype=np.int64))
    assert cli.main(["plan", "--lengths", str(npy), *SMALL]) == 2
    assert f"{npy}[1]: a length must be >= 1" in capsys.readouterr().err


def test_plot_draws_the_cp_comparison_and_no_invisible_legend_entry(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    out = tmp_path / "plan.png"
    assert cli.main(["demo", "-n", "128", "--cp", "4", "--capacity", "4096", "--dp", "2", "--plot", str(out)]) == 0
    cp = tmp_path / "plan_cp.png"
    assert cp.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"figure saved to {cp}" in capsys.readouterr().out
    from seqpack.tools.report import analyze

    rep = analyze(np.full(64, 100, dtype=np.int64), capacity=4096, dp_size=4)   # every balancer is exact
    fig = rep.plot()
    ax = fig.axes[1]
    for handle, label in zip(*ax.get_legend_handles_labels()):
        visible = handle.get_height() != 0 if hasattr(handle, "get_height") else \
            any(getattr(p, "get_height", lambda: 1)() != 0 for p in getattr(handle, "patches", [handle]))
        assert visible, f"legend entry {label!r} draws nothing"
