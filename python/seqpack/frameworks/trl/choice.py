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
predicted ``MARGIN`` faster. A call with gradients is timed through its backward too
(from the gradient reaching its log-probs to the one leaving the input embeddings:
where the tree path's extra operations cost most); a path whose calls never ran a
backward is priced by its forwards, and both paths are then. Every ``REFRESH`` calls
the path not taken runs once, so a run whose batches change keeps both current. On an
accelerator a call returns before its kernels finish, so ``q_tree / q_trl`` is fixed
at :data:`ACCELERATOR_RATIO` (a tree with nothing shared ran 0.87x plain packing on
an H200: benchmarks/results/gpu.md).
"""

from __future__ import annotations

import collections
import statistics
import time
from typing import Any, Callable, Deque, Dict, Tuple

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
        self._forward: Dict[Tuple[bool, str], Deque[Tuple[float, float]]] = {}  # the same, forwards only
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
            trl: Callable[[], Any], tree: Callable[[], Any], embeddings: Any = None
            ) -> Tuple[str, Any, Callable[[Any], Any]]:
        """``("tree" | "trl", its result, mark)``: the path priced lower, run (and timed
        on the CPU). With gradients and ``embeddings`` (the model's input embedding
        module), the caller passes the log-probs it returns through ``mark`` so that
        the call's backward is timed too; ``mark`` is the identity otherwise."""
        if device_type != "cpu":
            path = "tree" if ACCELERATOR_RATIO * work_tree < work_trl else "trl"
            return path, (tree if path == "tree" else trl)(), _identity
        path = self._pick(grad, work_trl, work_tree)
        key = (grad, path)
        other = (grad, "trl" if path == "tree" else "tree")
        self._calls[key] += 1
        self._since[key], self._since[other] = 0, self._since[other] + 1
        work = work_tree if path == "tree" else work_trl
        measured = self._calls[key] > 1  # the first call warms the path up (kernels, the attention installed)
        timing = _Timing(self, key, work) if measured and grad and embeddings is not None else None
        hook = embeddings.register_forward_hook(timing.leaving) if timing is not None else None
        start = time.perf_counter()
        try:
            out = (tree if path == "tree" else trl)()
        finally:
            if hook is not None:
                hook.remove()
        seconds = time.perf_counter() - start
        if measured:
            self._forward.setdefault(key, collections.deque(maxlen=_WINDOW)).append((work, seconds))
        if timing is None:
            return path, out, _identity
        timing.forward = seconds
        return path, out, timing.reaching

    def _record(self, key: Tuple[bool, str], work: float, seconds: float) -> None:
        self._seen.setdefault(key, collections.deque(maxlen=_WINDOW)).append((work, seconds))

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
        """Seconds per FLOP of ``path``: the median over its recent calls, forward and
        backward where both paths have such calls, else forwards (CPU; nan before any)."""
        both = all(self._seen.get((grad, p)) for p in ("tree", "trl"))
        seen = (self._seen if both else self._forward).get((grad, path))
        if not seen:
            return float("nan")
        return statistics.median([s / max(w, 1e-300) for w, s in seen])

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, PathChoice):
            return NotImplemented
        return (self.cost == other.cost and self.head_flops_per_token == other.head_flops_per_token
                and self._calls == other._calls and self._since == other._since
                and all({k: list(v) for k, v in getattr(self, name).items()}
                        == {k: list(v) for k, v in getattr(other, name).items()} for name in ("_seen", "_forward")))

    __hash__ = None  # mutable: its measurements grow

    def __repr__(self) -> str:
        measured = {f"{'grad' if g else 'no_grad'}/{p}": f"{self.q(g, p):.3g}" for g, p in sorted(self._forward)}
        return f"PathChoice(q={measured})"


def _identity(x: Any) -> Any:
    return x


class _Timing:
    """One call's time through its backward: the forward's seconds, then the span from
    the gradient reaching the call's log-probs (``reaching``) to the one leaving its
    input embeddings (``leaving``, a forward hook), recorded on the choice once both
    were seen. Holds the choice weakly: a graph kept alive does not keep it."""

    def __init__(self, choice: "PathChoice", key: Tuple[bool, str], work: float) -> None:
        import weakref

        self.choice, self.key, self.work = weakref.ref(choice), key, work
        self.forward: float = 0.0
        self.start: float = -1.0

    def reaching(self, x: Any) -> Any:
        return _stamp(x, self._started)

    def leaving(self, module: Any, args: Any, output: Any) -> Any:
        return _stamp(output, self._ended)

    def _started(self) -> None:
        if self.start < 0:
            self.start = time.perf_counter()

    def _ended(self) -> None:
        choice = self.choice()
        if self.start >= 0 and choice is not None:
            choice._record(self.key, self.work, self.forward + time.perf_counter() - self.start)
            self.start = float("inf")  # once


_STAMP: Dict[str, Any] = {}


def _stamp(x: Any, on_backward: Callable[[], None]) -> Any:
    """``x`` through an identity whose backward calls ``on_backward`` first."""
    if "fn" not in _STAMP:
        import torch

        class Stamp(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t, callback):
                ctx.callback = callback
                return t.view_as(t)

            @staticmethod
            def backward(ctx, grad):
                ctx.callback()
                return grad, None

        _STAMP["fn"] = Stamp.apply
    if not getattr(x, "requires_grad", False):
        return x
    return _STAMP["fn"](x, on_backward)

