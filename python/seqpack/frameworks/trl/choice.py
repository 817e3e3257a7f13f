"""Whether a batch's log-probs pay for a prefix tree: the TRL patch's choice, batch by
batch (:mod:`seqpack.frameworks.trl.tree`).

A tree forwards fewer tokens and attention pairs than TRL's padded rows, but its
path has costs TRL's does not: the tree built on the host, and more operations per
layer (the tree attention's gathers). On a small model, or a batch that shares
little, those win. Each batch is priced both ways by its work, the FLOPs of
:meth:`CostModel.from_model <seqpack.CostModel.from_model>` for the model's shape,
and by each path's seconds per FLOP, ``q``::

    TRL's path   rows x S padded tokens, rows x S(S+1)/2 pairs, its head's positions
    the tree     its physical tokens, its visible pairs, the scored positions
    tree  <=>  q_tree * work_tree < q_trl * work_trl

On the CPU ``q`` is measured in the run (a call is synchronous there): the paths take
turns, a call each to warm up and ``EXPLORE`` calls each measured, and from then on
the median ``q`` of each path's recent calls prices a batch; the tree must be
predicted ``MARGIN`` faster (what is timed is the forward; the backward, where the
tree path's extra operations run again, is not). Every ``REFRESH`` calls the path
not taken runs once, so a run whose batches change keeps both current. On an
accelerator a call returns before its kernels finish, so ``q_tree / q_trl`` is fixed
at :data:`ACCELERATOR_RATIO` (a tree with nothing shared ran 0.87x plain packing on
an H200: benchmarks/results/gpu.md).
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Deque, Dict, Tuple

import numpy as np

from ...planning.cost import CostModel

__all__ = ["ACCELERATOR_RATIO", "EXPLORE", "MARGIN", "PathChoice", "REFRESH"]

ACCELERATOR_RATIO = 1.15  # q_tree / q_trl off the CPU (measured: 0.87x when nothing is shared)
EXPLORE = 3  # measured calls of each path before the choice (CPU), after one warm-up call each
MARGIN = 0.1  # the tree must be predicted this much faster than TRL's path (CPU)
REFRESH = 50  # calls between two runs of the path not taken (CPU)
_WINDOW = 8  # recent calls a path's q is measured over


class PathChoice:
    """One trainer's choice between TRL's path and the tree (kept on the trainer).

    ``work(...)`` prices a batch both ways; ``run(...)`` picks a path, runs it and,
    on the CPU, times it. Pickles and deep-copies (its measurements come along).

    >>> choice = PathChoice(CostModel.from_model(64, 2, 4, 2, 128), head_flops_per_token=6 * 64 * 64)
    >>> trl, tree = choice.work(rows=16, columns=82, head_positions=16 * 82, tree_tokens=700, tree_pairs=30000,
    ...                         scored=600)
    >>> tree < trl
    True
    """

    def __init__(self, cost: CostModel, head_flops_per_token: float) -> None:
        self.cost = cost
        self.head_flops_per_token = float(head_flops_per_token)
        self._calls: Dict[Tuple[bool, str], int] = collections.Counter()  # (grad, path) -> calls
        self._seen: Dict[Tuple[bool, str], Deque[Tuple[float, float]]] = {}  # (grad, path) -> (work, seconds)
        self._since: Dict[Tuple[bool, str], int] = collections.Counter()  # calls since the path last ran

    @classmethod
    def of_model(cls, model: Any) -> "PathChoice":
        """From a transformers model's text config (a dense Llama-shaped estimate: an
        MoE's active experts are not counted apart)."""
        cfg = model.config.get_text_config()
        heads = int(cfg.num_attention_heads)
        hidden = int(cfg.hidden_size)
        cost = CostModel.from_model(hidden, int(cfg.num_hidden_layers), heads,
                                    int(getattr(cfg, "num_key_value_heads", None) or heads),
                                    int(getattr(cfg, "intermediate_size", None) or 4 * hidden),
                                    head_dim=getattr(cfg, "head_dim", None) or None)
        return cls(cost, 6.0 * hidden * int(cfg.vocab_size))

    def work(self, *, rows: int, columns: int, head_positions: int, tree_tokens: int, tree_pairs: int,
             scored: int) -> Tuple[float, float]:
        """FLOPs (forward + backward) of TRL's padded ``rows x columns`` and of the tree."""
        c = self.cost
        trl = (c.per_token * rows * columns + c.per_token_squared * rows * columns * (columns + 1)
               + self.head_flops_per_token * head_positions)
        # the cost model counts s^2 / 2 pairs per causal row: a tree's visible pairs
        # (each token with its ancestors and itself) are twice that.
        tree = c.per_token * tree_tokens + c.per_token_squared * 2 * tree_pairs + self.head_flops_per_token * scored
        return trl, tree

    def run(self, device_type: str, grad: bool, work_trl: float, work_tree: float,
            trl: Callable[[], Any], tree: Callable[[], Any]) -> Tuple[str, Any]:
        """``("tree" | "trl", its result)``: the path priced lower, run (and timed on
        the CPU)."""
        if device_type != "cpu":
            path = "tree" if ACCELERATOR_RATIO * work_tree < work_trl else "trl"
            return path, (tree if path == "tree" else trl)()
        path = self._pick(grad, work_trl, work_tree)
        key = (grad, path)
        other = (grad, "trl" if path == "tree" else "tree")
        self._calls[key] += 1
        self._since[key], self._since[other] = 0, self._since[other] + 1
        start = time.perf_counter()
        out = (tree if path == "tree" else trl)()
        seconds = time.perf_counter() - start
        if self._calls[key] > 1:  # the first call warms the path up (kernels, the attention installed)
            self._seen.setdefault(key, collections.deque(maxlen=_WINDOW)).append(
                (work_tree if path == "tree" else work_trl, seconds))
        return path, out

    def _pick(self, grad: bool, work_trl: float, work_tree: float) -> str:
        calls = {path: self._calls[(grad, path)] for path in ("tree", "trl")}
        if min(calls.values()) <= EXPLORE:  # turns: tree, TRL, tree, ... (a warm-up each, then measured)
            return "tree" if calls["tree"] <= calls["trl"] else "trl"
        for path in ("tree", "trl"):
            if self._since[(grad, path)] >= REFRESH:
                return path
        tree_pays = self.q(grad, "tree") * work_tree < (1 - MARGIN) * self.q(grad, "trl") * work_trl
        return "tree" if tree_pays else "trl"

    def q(self, grad: bool, path: str) -> float:
        """Seconds per FLOP of ``path``: the median over its recent calls (CPU; nan
        before any)."""
        seen = self._seen.get((grad, path))
        if not seen:
            return float("nan")
        return float(np.median([s / max(w, 1e-300) for w, s in seen]))

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, PathChoice):
            return NotImplemented
        return (self.cost == other.cost and self.head_flops_per_token == other.head_flops_per_token
                and self._calls == other._calls and self._since == other._since
                and {k: list(v) for k, v in self._seen.items()} == {k: list(v) for k, v in other._seen.items()})

    __hash__ = None  # mutable: its measurements grow

    def __repr__(self) -> str:
        measured = {f"{'grad' if g else 'no_grad'}/{p}": f"{self.q(g, p):.3g}" for g, p in sorted(self._seen)}
        return f"PathChoice(q={measured})"
