"""Matplotlib figures for plans (optional: ``pip install seqpack[plot]``).

The figures read the data of a report, described here by what they read
(:class:`ReportData`, :class:`SharingData`), so the reports import this module and
this module imports no report.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Optional, Protocol, Sequence

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

__all__ = ["plot_cp", "plot_report", "plot_sharing"]  # *Data: what they read, for type checkers


class ReportData(Protocol):
    """What :func:`plot_report` draws: a :class:`~seqpack.tools.report.Report`'s data."""

    lengths: "np.ndarray"
    capacity: int
    rank_loads: Dict[str, List[int]]
    bin_loads: Dict[str, List[int]]
    computed_tokens: Dict[str, int]


class SharingData(Protocol):
    """What :func:`plot_sharing` draws: a :class:`~seqpack.tools.report_trees.TreeReport`'s data."""

    caps: Sequence[int]
    sharing_kept: Sequence[float]
    micro_batches: Dict[str, List[int]]


class CpData(Protocol):
    """What :func:`plot_cp` draws: a :class:`~seqpack.tools.report_cp.CpReport`'s data."""

    rank_costs: Dict[str, List[float]]
    kv_tokens: Dict[str, int]
    least_kv_tokens: int


def _pyplot():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - exercised when matplotlib is absent
        raise ImportError("plotting needs matplotlib: pip install 'seqpack[plot]'") from e
    return plt


def plot_report(report: ReportData, path: Optional[str] = None):
    """Length histogram, tokens per DP rank (before / after balancing), per-bin fill
    of each packer, and the tokens computed with and without padding.

    Returns the matplotlib Figure; saves it to ``path`` when given.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.5))
    ax = axes[0]
    ax.hist(report.lengths, bins=60, color="#4c72b0")
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("sequences")
    ax.set_title(f"{len(report.lengths):,} sequences")

    ax = axes[1]
    width = 0.8 / max(1, len(report.rank_loads))
    for j, (name, loads) in enumerate(report.rank_loads.items()):
        mean = sum(loads) / len(loads)
        xs, ys = [r + j * width for r in range(len(loads))], [100 * (l / mean - 1) if mean else 0.0 for l in loads]
        if max(map(abs, ys), default=0.0) < 0.05:  # bars of height 0 draw nothing: mark the series on the axis
            ax.plot(xs, ys, linestyle="none", marker="_", markersize=12, markeredgewidth=2.5,
                    color=f"C{j}", label=f"{name} (every rank at the mean)")
        else:
            ax.bar(xs, ys, width=width, color=f"C{j}", label=name)
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xlabel("DP rank")
    ax.set_ylabel("tokens vs mean (%)")
    ax.set_title("per-rank load")
    ax.legend(fontsize=8)

    ax = axes[2]
    for name, loads in report.bin_loads.items():
        fill = sorted((l / report.capacity for l in loads), reverse=True)
        ax.plot(range(len(fill)), fill, label=f"{name} ({len(fill)})")
    ax.set_xlabel("bin (sorted by fill)")
    ax.set_ylabel("fill")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"bin fill, capacity {report.capacity:,}")
    ax.legend(fontsize=7)

    ax = axes[3]
    names = list(report.computed_tokens)
    tokens = [report.computed_tokens[k] for k in names]
    ax.barh(range(len(names)), tokens, color="#55a868")
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens computed")
    real = report.computed_tokens.get("sequence packing", 0)
    ax.set_title(f"padding removed (real tokens: {real:,})")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def plot_cp(report: CpData, path: Optional[str] = None):
    """A :class:`~seqpack.tools.report_cp.CpReport`: each plan's predicted work per
    rank (its micro-batches summed) and the K/V the ranks gather, beside the least
    any degrees allow.

    Returns the matplotlib Figure; saves it to ``path`` when given.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    ax = axes[0]
    width = 0.8 / max(1, len(report.rank_costs))
    for j, (name, costs) in enumerate(report.rank_costs.items()):
        ax.bar([r + j * width for r in range(len(costs))], costs, width=width, color=f"C{j}", label=name)
    ax.set_xlabel("rank (dp_rank x cp_size + cp_rank)")
    ax.set_ylabel("predicted work (s)")
    ax.set_title("work per rank")
    ax.legend(fontsize=8)
    ax = axes[1]
    names = list(report.kv_tokens)
    ax.bar(range(len(names)), [report.kv_tokens[n] for n in names], color=[f"C{j}" for j in range(len(names))])
    ax.axhline(report.least_kv_tokens, color="black", linewidth=1, linestyle="--",
               label=f"least any degrees allow ({report.least_kv_tokens:,})")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("K/V tokens gathered")
    ax.set_title("context-parallel traffic")
    ax.legend(fontsize=8)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def plot_sharing(report: SharingData, path: Optional[str] = None):
    """A :class:`~seqpack.tools.report_trees.TreeReport`'s sharing kept and
    micro-batches per rank (plain vs trees) against the cap.

    Returns the matplotlib Figure; saves it to ``path`` when given.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    ax = axes[0]
    ax.plot(report.caps, report.sharing_kept, marker="o", color="#4c72b0")
    ax.set_xscale("log")
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("cap (tokens per micro-batch)")
    ax.set_ylabel("sharing kept")
    ax.set_title("batch physical tokens / sum over micro-batches")
    ax = axes[1]
    for name, counts in report.micro_batches.items():
        ax.plot(report.caps, counts, marker="o", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("cap (tokens per micro-batch)")
    ax.set_ylabel("micro-batches per rank")
    ax.set_title("plan_step, plain vs prefix trees")
    ax.legend()
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig
