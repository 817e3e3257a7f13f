"""One training step over a prefix tree split into passes (issue 52):
:func:`prefix_reuse` runs :func:`seqpack.split_prefix_tree`'s passes in a loop of the
usual shape, a shared prefix forwarded once and its backward run once, whatever the
micro-batch cap::

    passes = seqpack.split_prefix_tree(tree, max_tokens=4096)
    for mb in seqpack.prefix_reuse(passes):                   # memory="activations" or "kv"
        logits = mb.forward(model)                             # [mb.num_local_tokens, V]
        lp = seqpack.token_logprobs(logits, mb.layout)         # [N]: what this micro-batch predicts
        loss_fn(lp).backward()

What the loop yields (``mb.kind``)::

    branch i   pass i's forward and backward. The providers it reads are forwarded
               first, once per step (inside this forward); their K/V stay in the step
               and the gradient of what pass i read of them accumulates there.
    close p    provider p's backward, after every pass that read it: its own tokens'
               logits (for the tokens they predict, e.g. a prompt's last token and
               each response's first) whose backward also feeds p's accumulated K/V
               gradient into p's forward, once.

    memory="activations"   p's forward keeps its graph from its forward to its close
    memory="kv"            p's forward keeps only its K/V (no graph); its close runs the
                           forward again (one more forward of p, its activations only
                           from then to its backward)

The order is enforced: a close whose readers have not all run their backward, a
micro-batch skipped or left without its backward, a second step on a model whose
last step left a prefix open, and a model whose parameters changed between passes
(an optimizer step, a dtype change) each raise, naming the pass. Gradients equal
the same tree in one micro-batch (fp64 tests: tests/python/training/test_prefix_reuse.py).

A model runs a pass as ``model(input_ids, layout, position_ids=...)`` (the reference
model's signature: :class:`seqpack.testing.tiny_model.TinyCausalLM`), each layer's
attention :func:`seqpack.attention` on ``layout``; ``forward=`` takes any other call.

Importing this module does not import torch.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional, Set, Tuple

from .._lengths import as_positive_int, type_name
from ..tensors.prefix_passes import PrefixPasses, TreePass

__all__ = ["MEMORY_MODES", "PassMicroBatch", "PrefixReuseStep", "prefix_reuse"]

MEMORY_MODES = ("activations", "kv")

# Each model's unfinished step (the providers it left open), kept until a step on
# that model finishes: a loop stopped before its closes leaves gradients incomplete.
_OPEN: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()


def _default_forward(model: Any, input_ids: Any, position_ids: Any, layout: Any, **kwargs: Any) -> Any:
    return model(input_ids, layout, position_ids=position_ids, **kwargs)


def prefix_reuse(passes: Any, *, memory: str = "activations", forward: Optional[Callable[..., Any]] = None,
                 pad_to_multiple_of: Any = 1) -> "PrefixReuseStep":
    """The micro-batches of one step over ``passes`` (a :class:`~seqpack.PrefixPasses`),
    to iterate once (see the module docstring).

    Args:
        passes: :func:`seqpack.split_prefix_tree`'s passes.
        memory: ``"activations"`` (a provider's graph kept from its forward to its
            close) or ``"kv"`` (only its K/V kept; the close runs its forward again).
        forward: ``forward(model, input_ids, position_ids, layout, **kwargs)`` giving
            the pass's output ``[num_local_tokens, ...]``; default
            ``model(input_ids, layout, position_ids=position_ids, **kwargs)``.
        pad_to_multiple_of: each pass's model input padded to a multiple of this
            many tokens (:meth:`TreePass.padded_to <seqpack.TreePass.padded_to>`:
            tensor parallelism with sequence parallelism); the results are the
            unpadded pass's. Split the tree under the cap rounded down to the
            multiple so that padded passes stay under it.
    """
    if not isinstance(passes, PrefixPasses):
        raise TypeError(f"passes must be seqpack.split_prefix_tree(...)'s PrefixPasses, got {type_name(passes)}")
    if memory not in MEMORY_MODES:
        raise ValueError(f"memory must be one of {MEMORY_MODES}, got {memory!r}")
    if forward is not None and not callable(forward):
        raise TypeError(f"forward must be callable, got {type_name(forward)}")
    multiple = as_positive_int(pad_to_multiple_of, "pad_to_multiple_of")
    return PrefixReuseStep(passes, memory, forward or _default_forward, multiple)


class PassMicroBatch:
    """One micro-batch of a :class:`PrefixReuseStep`: ``kind`` (``"branch"`` or
    ``"close"``), ``index`` (its pass), ``layout`` (the :class:`~seqpack.TreePass`
    bound to the running step: give it to :func:`seqpack.attention` and
    :func:`seqpack.token_logprobs`), ``input_ids`` / ``position_ids`` (host int64,
    ``[num_local_tokens]``)."""

    __slots__ = ("kind", "index", "layout", "_step")

    def __init__(self, kind: str, layout: TreePass, step: Optional["PrefixReuseStep"]) -> None:
        self.kind, self.index, self.layout, self._step = kind, layout.index, layout, step

    input_ids = property(lambda self: self.layout.input_ids)
    position_ids = property(lambda self: self.layout.local_position_ids)
    num_local_tokens = property(lambda self: self.layout.num_local_tokens)

    def forward(self, model: Any, **kwargs: Any) -> Any:
        """The pass's output (``[num_local_tokens, ...]``, the model's logits or hidden
        states): a branch's forward (its providers' first, once), or a close's
        provider outputs carrying its K/V gradient into its backward."""
        if self._step is None:
            raise RuntimeError(f"this {self.kind} micro-batch of pass {self.index} is a copy outside its running step "
                               "(pickled or deep-copied): run the micro-batches seqpack.prefix_reuse(passes) yields")
        return self._step._run(self, model, kwargs)

    def __eq__(self, other: object) -> Any:
        if not isinstance(other, PassMicroBatch):
            return NotImplemented
        return self.kind == other.kind and self.layout == other.layout

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        # Its step (the K/V it reads, the model) stays in this process: a copy is the
        # micro-batch's layout, unbound (its forward says it is not in a running step).
        return PassMicroBatch, (self.kind, self.layout.bound(None), None)

    def __repr__(self) -> str:
        return f"PassMicroBatch(kind={self.kind!r}, index={self.index}, num_local_tokens={self.num_local_tokens})"


class PrefixReuseStep:
    """The running step of :func:`prefix_reuse`: iterate it once. Holds the
    providers' K/V (and their graphs under ``memory="activations"``) until their
    closes."""

    def __init__(self, passes: PrefixPasses, memory: str, forward: Callable[..., Any], multiple: int = 1) -> None:
        self.passes, self.memory, self._call, self.multiple = passes, memory, forward, multiple
        self._bound = [p.padded_to(multiple).bound(self) for p in passes.passes]
        self._readers: Dict[int, List[int]] = {p.index: [] for p in passes.passes}
        for p in passes.passes:
            for q in p.providers:
                self._readers[q].append(p.index)
        self._started = False
        self._model: Any = None
        self._snapshot: List[Tuple[Any, ...]] = []
        self._grad: Optional[bool] = None
        self._layers: Optional[int] = None
        self._leaves: Dict[int, List[Tuple[Any, Any]]] = {}  # provider -> per layer (k, v), read by later passes
        self._graph_kv: Dict[int, List[Tuple[Any, Any]]] = {}  # provider -> per layer (k, v) in its forward's graph
        self._outputs: Dict[int, Any] = {}  # provider -> its forward's output (its own tokens')
        self._opened: Set[int] = set()
        self._ran: Set[int] = set()
        self._read_back: Dict[int, Set[int]] = {}  # reader -> layers whose K/V read got its gradient
        self._closed: Set[int] = set()
        self._close_back: Set[int] = set()
        self._active: Optional[Tuple[int, str]] = None
        self._cursor = 0

    # ---- the loop ------------------------------------------------------------------------
    def __iter__(self) -> Iterator[PassMicroBatch]:
        if self._started:
            raise RuntimeError("a prefix_reuse step runs once: call seqpack.prefix_reuse(passes) for the next step")
        self._started = True
        for kind, index in self.passes.order:
            mb = PassMicroBatch(kind, self._bound[index], self)
            yield mb
            self._check_done(mb)
        if self._model is not None:
            _pop_open(self._model)

    def _check_done(self, mb: PassMicroBatch) -> None:
        """After the loop's body: the micro-batch ran, and (with gradients) its backward."""
        i = mb.index
        if (mb.kind == "branch" and i not in self._ran) or (mb.kind == "close" and i not in self._closed):
            raise RuntimeError(f"prefix_reuse: {mb.kind} micro-batch of pass {i} was skipped (every micro-batch of "
                               f"the step must run mb.forward(model)): the passes after it read its K/V")
        if not self._grad:
            return
        if mb.kind == "branch" and self._bound[i].providers and not self._backward_ran(i):
            raise RuntimeError(f"prefix_reuse: branch pass {i} ran its forward but not its backward before the next "
                               "micro-batch: run loss.backward() on each micro-batch inside the loop (the prefix's "
                               "backward needs the gradient of the K/V it read)")
        if mb.kind == "close" and i not in self._close_back:
            raise RuntimeError(f"prefix_reuse: the close of provider pass {i} ran its forward but not its backward: "
                               "run loss.backward() on its output (its K/V gradient reaches its forward that way)")

    def _backward_ran(self, reader: int) -> bool:
        return self._layers is not None and len(self._read_back.get(reader, ())) == self._layers

    # ---- running a micro-batch ---------------------------------------------------------------
    def _run(self, mb: PassMicroBatch, model: Any, kwargs: Dict[str, Any]) -> Any:
        self._check_model(model, mb)
        i = mb.index
        if mb.kind == "branch":
            if i in self._ran:
                raise RuntimeError(f"prefix_reuse: branch pass {i} already ran in this step")
            for q in self._bound[i].providers:
                self._open(q, kwargs)
            out = self._forward(i, "run", kwargs)
            self._ran.add(i)
            return out
        if i in self._closed:
            raise RuntimeError(f"prefix_reuse: provider pass {i} is already closed (its backward runs once a step)")
        pending = [r for r in self._readers[i] if not (r in self._ran or r in self._closed)
                   or (self._grad and not self._backward_ran(r))]
        if pending:
            raise RuntimeError(f"prefix_reuse: provider pass {i} cannot close yet: passes {pending} read its K/V "
                               "and have not run their forward and backward (iterate the step in its order)")
        self._open(i, kwargs)  # a provider no branch read (none in a split tree) still runs once
        if not self._grad:
            out = self._outputs.pop(i)
        else:
            if self.memory == "kv":
                self._graph_kv[i] = []
                out = self._forward(i, "recompute", kwargs)
            else:
                out = self._outputs.pop(i)
            if not hasattr(out, "requires_grad"):
                raise TypeError(f"prefix_reuse: the close of provider pass {i} needs the forward's output as one "
                                f"tensor (its backward carries the K/V gradient), got {type_name(out)}")
            flat = [t for pair in self._graph_kv.pop(i) for t in pair]
            grads = [leaf.grad for pair in self._leaves[i] for leaf in pair]
            out = _functions()["inject"](self._closed_back_of(i), grads, out, *flat)
        self._closed.add(i)
        self._leaves.pop(i, None)
        if self._model is not None and self._closed >= {p.index for p in self._bound if p.role == "provider"}:
            _pop_open(self._model)
        return out

    def _closed_back_of(self, i: int) -> Callable[[], None]:
        ref = weakref.ref(self)

        def done() -> None:
            step = ref()
            if step is not None:
                step._close_back.add(i)
        return done

    def _open(self, p: int, kwargs: Dict[str, Any]) -> None:
        """Provider ``p``'s forward, once a step (its own providers' first)."""
        import torch

        if p in self._opened:
            return
        for q in self._bound[p].providers:
            self._open(q, kwargs)
        self._leaves[p], self._graph_kv[p] = [], []
        keep = bool(self._grad) and self.memory == "activations"
        with torch.set_grad_enabled(keep):
            out = self._forward(p, "open", kwargs)
        if keep or not self._grad:  # with gradients under "kv" the close runs the forward again: nothing kept
            self._outputs[p] = out if keep or not hasattr(out, "detach") else out.detach()
        self._opened.add(p)
        _remember_open(self._model, f"provider passes {sorted(self._opened - self._closed)}")

    def _forward(self, i: int, purpose: str, kwargs: Dict[str, Any]) -> Any:
        import torch

        from ..tensors._device import host_to_device

        layout = self._bound[i]
        device = torch.device(_device_of(self._model))
        ids, pos = host_to_device([layout.input_ids, layout.local_position_ids], device)  # one copy, no host sync
        self._active, self._cursor = (i, purpose), 0
        try:
            out = self._call(self._model, ids, pos, layout, **kwargs)
        finally:
            self._active, calls = None, self._cursor
        if self._layers is None:
            if calls == 0:
                raise RuntimeError("prefix_reuse: the model ran no attention on the pass's layout (each layer must "
                                   "call seqpack.attention(q, k, v, layout))")
            self._layers = calls
        elif calls != self._layers:
            raise RuntimeError(f"prefix_reuse: pass {i}'s forward ran {calls} attention layers, the step's first "
                               f"ran {self._layers}: one model, the same layers, for every pass of a step")
        return out

    def _check_model(self, model: Any, mb: PassMicroBatch) -> None:
        import torch

        grad = torch.is_grad_enabled()
        if self._model is None:
            previous = _pop_open(model)
            if previous is not None:  # said once: the next step runs
                raise RuntimeError(f"prefix_reuse: this model's previous step left {previous} open (the loop stopped "
                                   "before their closes, so their backward never ran and the gradients are "
                                   "incomplete): zero the gradients and run every micro-batch of a step before the "
                                   "next")
            self._model, self._grad = model, grad
            self._snapshot = _parameters(model)
            return
        if model is not self._model:
            raise RuntimeError(f"prefix_reuse: {mb.kind} pass {mb.index} was given another model than the step's "
                               "first micro-batch (the K/V it reads came from that model)")
        if grad != self._grad:
            raise RuntimeError(f"prefix_reuse: gradients were {'on' if self._grad else 'off'} for the step's first "
                               f"micro-batch and are {'on' if grad else 'off'} for pass {mb.index}: one mode a step")
        now = _parameters(model)
        if now != self._snapshot:
            changed = next(n for n, (a, b) in enumerate(zip(now, self._snapshot)) if a != b) if len(now) == len(
                self._snapshot) else None
            raise RuntimeError(f"prefix_reuse: the model's parameters changed since the step's first micro-batch "
                               f"(parameter {changed}: an optimizer step, an in-place update or a dtype/device change "
                               f"between passes) before {mb.kind} pass {mb.index}: the K/V of its prefix are stale")

    # ---- what the pass's attention reads (seqpack.attention on a TreePass) ------------------------
    def attention_context(self, layout: TreePass, k: Any, v: Any) -> Tuple[Any, Any]:
        """Called by each layer's attention of the pass being forwarded: records a
        provider's K/V, and returns the K/V of the providers this pass reads
        (concatenated in provider order; None when it reads none)."""
        import torch

        active = self._active
        in_backward = torch._C._current_graph_task_id() >= 0
        if layout.runtime is self and active is not None and active[0] == layout.index and not in_backward:
            layer = self._cursor if layout.layer is None else layout.layer
            self._cursor += 1
            i, purpose = active
        elif layout.runtime is self and layout.layer is not None and in_backward and (
                layout.index in self._ran or layout.index in self._opened):
            # a layer recomputed by gradient checkpointing during the backward: the same K/V, nothing recorded
            layer, (i, purpose) = layout.layer, (layout.index, "recomputed")
        else:
            during = (" during a backward (gradient checkpointing recomputes a layer there: the layout must know its "
                      "layer, layout.for_layer(i), as seqpack's transformers attention gives it)") if in_backward else ""
            raise RuntimeError(f"attention on pass {layout.index} of a prefix_reuse step outside its mb.forward"
                               f"{during}: a pass's layers run inside mb.forward(model), once, in order (a layout of "
                               "another step or tree, whose K/V this forward does not hold, is refused too)")
        if self._layers is not None and layer >= self._layers:
            raise RuntimeError(f"prefix_reuse: pass {layout.index} ran more attention layers than the step's first "
                               f"({self._layers})")
        if purpose in ("open", "recompute"):
            grad = bool(self._grad)
            # (k needing no gradient with gradients on is fine: frozen layers below; off, the layer runs under
            # no_grad inside a step that takes them)
            if grad and (purpose == "recompute" or self.memory == "activations") and not torch.is_grad_enabled():
                raise RuntimeError(f"prefix_reuse: provider pass {i}'s layer {layer} ran without gradients inside a "
                                   "step that takes them (reentrant gradient checkpointing runs a layer's forward "
                                   "under no_grad): its K/V gradient could not reach its weights; use "
                                   "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
                                   "False})")
            if purpose == "open":
                self._leaves[i].append((k.detach().requires_grad_(grad), v.detach().requires_grad_(grad)))
                if grad and self.memory == "activations":
                    self._graph_kv[i].append((k, v))
            else:
                self._graph_kv[i].append((k, v))
        if not layout.providers:
            return None, None
        ks = [self._leaves[p][layer][0] for p in layout.providers]
        vs = [self._leaves[p][layer][1] for p in layout.providers]
        kc, vc = (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks), torch.cat(vs))
        if torch.is_grad_enabled() and self._grad:
            kc, vc = _functions()["mark"](self._read_back_of(i, layer), kc, vc)
        return kc, vc

    def _read_back_of(self, reader: int, layer: int) -> Callable[[], None]:
        ref = weakref.ref(self)

        def done() -> None:
            step = ref()
            if step is not None:
                step._read_back.setdefault(reader, set()).add(layer)
        return done

    def __eq__(self, other: object) -> Any:
        if not isinstance(other, PrefixReuseStep):
            return NotImplemented
        return (self.passes == other.passes and self.memory == other.memory and self._call == other._call
                and self.multiple == other.multiple and not self._started and not other._started)

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self):
        if self._started:
            raise TypeError("a running prefix_reuse step holds its model's K/V and graphs: it is not copied or "
                            "pickled (pickle its PrefixPasses, and start a step where it is run)")
        return _step_of, (self.passes, self.memory, self._call, self.multiple)

    def __repr__(self) -> str:
        return (f"PrefixReuseStep(memory={self.memory!r}, passes={self.passes.num_passes}, "
                f"closed={len(self._closed)}/{self.passes.num_providers})")


def _remember_open(model: Any, what: str) -> None:
    try:
        _OPEN[model] = what
    except TypeError:  # a model that cannot be weakly referenced: not tracked
        pass


def _pop_open(model: Any) -> Optional[str]:
    try:
        return _OPEN.pop(model, None)
    except TypeError:
        return None


def _step_of(passes: PrefixPasses, memory: str, forward: Callable[..., Any], multiple: int = 1) -> PrefixReuseStep:
    return PrefixReuseStep(passes, memory, forward, multiple)


def _device_of(model: Any) -> Any:
    for p in getattr(model, "parameters", lambda: iter(()))():
        return p.device
    return "cpu"


def _parameters(model: Any) -> List[Tuple[Any, ...]]:
    """What says a model is the one a step's K/V came from: each parameter's storage,
    version counter, dtype and device."""
    return [(p.data_ptr(), p._version, p.dtype, p.device) for p in getattr(model, "parameters", lambda: ())()]


_FUNCTIONS: Dict[str, Any] = {}


def _functions() -> Dict[str, Any]:
    """The two autograd functions of a step (built on first use: no torch at import)."""
    if not _FUNCTIONS:
        import torch

        class Mark(torch.autograd.Function):
            """Identity on the K/V a pass reads; its backward says the read's gradient came."""

            @staticmethod
            def forward(ctx, callback, k, v):
                ctx.callback = callback
                return k.view_as(k), v.view_as(v)

            @staticmethod
            def backward(ctx, gk, gv):
                ctx.callback()
                return None, gk, gv

        class Inject(torch.autograd.Function):
            """Identity on a provider's output whose backward also gives its forward's
            K/V the gradient the later passes accumulated."""

            @staticmethod
            def forward(ctx, callback, grads, out, *kv):
                ctx.callback, ctx.grads = callback, grads
                return out.view_as(out)

            @staticmethod
            def backward(ctx, g_out):
                ctx.callback()
                grads, ctx.grads = ctx.grads, None
                return (None, None, g_out, *grads)

        _FUNCTIONS.update(mark=Mark.apply, inject=Inject.apply)
    return _FUNCTIONS
