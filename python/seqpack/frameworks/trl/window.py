"""TRL's gradient accumulation window in prefix-reuse passes (issue 52): each prompt
forwarded and back-propagated once per optimizer step, however TRL cuts the
generation batch into ``per_device_train_batch_size`` micro-batches.

TRL shuffles a generation batch and cuts it into ``steps_per_generation``
micro-batches, one ``training_step`` each, so a GRPO group larger than a micro-batch
(or scattered by the shuffle) forwards its prompt once per micro-batch. When those
micro-batches make one optimizer step (``steps_per_generation`` equal to the
accumulation steps), every one of their losses depends on the parameters only
through the log-probs (and entropies) TRL asks for, so the window runs as::

    first micro-batch   the window's tree (all its rows) in passes without
                        gradients: every row's log-probs, each prompt once (A)
    micro-batch j       TRL's own loss and backward on leaf tensors holding rows j's
                        values from (A): its gradient g_j w.r.t. them, nothing else
    last micro-batch    after its backward, the window's passes with gradients, each
                        pass's backward that of sum(log-probs * g) (B): the
                        parameters' gradient is sum_j d loss_j / d theta, exactly

    cost: one forward of the window's physical tokens (A), one forward and backward
    of them (B) and one more forward of the shared prefixes (B keeps only their K/V
    until their backward: memory="kv"), against a forward and backward of every
    micro-batch's tree, whose prompts repeat once per micro-batch

Any TRL loss (``loss_type``, sequence-level importance sampling, the KL term, the
entropy bonus) is kept: only how its log-probs reach the parameters changes. Under
DDP the passes run on the module it wraps and the window's gradient is all-reduced
(averaged) once over its process group, every trainable parameter in one order on
every rank. Where the window does not pay, where any of its micro-batches goes to
TRL's own path, or where TRL's run is outside these conditions (another
accumulation, DeepSpeed or FSDP, dropout, reentrant gradient checkpointing), each
micro-batch runs as its own tree, as before.

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from .._completion_trees import completion_tree

__all__ = ["after_training_step", "window_logps"]

KEY = "_seqpack_window"
# A forward and backward costs about 3 forwards: the window's (A) + (B) cost 4/3 of
# its physical tokens' forward and backward, plus a third of its shared prefixes'.
WINDOW_COST = 4.0 / 3.0
PREFIX_COST = 1.0 / 3.0


class WindowRun:
    """One accumulation window of a trainer: the rows of its ``k`` micro-batches
    (``b`` rows each), their values from the no-gradient passes, and the gradients
    TRL's losses send them."""

    def __init__(self, start: int, k: int, b: int, ids: List[Any], found: Any, passes: Any, logps: Any,
                 entropies: Any, snapshot: List[Tuple[Any, ...]]) -> None:
        import torch

        self.start, self.k, self.b, self.ids, self.found, self.passes = start, k, b, ids, found, passes
        self.logps, self.entropies, self.snapshot = logps, entropies, snapshot
        self.grad_logps = torch.zeros_like(logps)
        self.grad_entropies = None if entropies is None else torch.zeros_like(entropies)
        self.served: List[int] = []

    def serve(self, j: int, compute_entropy: bool) -> Tuple[Any, Any, None]:
        """Micro-batch ``j``'s leaf log-probs (and entropies) whose gradient TRL's backward
        adds to the window's."""
        if j in self.served:
            raise RuntimeError(f"seqpack (TRL prefix reuse): micro-batch {j} of the accumulation window asked for its "
                               "log-probs twice; each runs one loss and one backward")
        if compute_entropy and self.entropies is None:
            raise RuntimeError("seqpack (TRL prefix reuse): a micro-batch asked for entropies the window's first "
                               "micro-batch did not")
        self.served.append(j)
        rows = slice(j * self.b, (j + 1) * self.b)
        lp = self.logps[rows].clone().requires_grad_(True)
        lp.register_hook(lambda g: self.grad_logps[rows].add_(g))
        ent = None
        if compute_entropy:
            ent = self.entropies[rows].clone().requires_grad_(True)
            ent.register_hook(lambda g: self.grad_entropies[rows].add_(g))
        return lp, ent, None

    def finish(self, trainer: Any, model: Any) -> None:
        """The window's passes with gradients (B), each pass's backward that of its
        log-probs (and entropies) weighted by the gradients TRL's losses sent."""
        import torch

        from ...training.prefix_reuse import _parameters, prefix_reuse

        if _parameters(_local(model)) != self.snapshot:
            raise RuntimeError("seqpack (TRL prefix reuse): the model's parameters changed inside the accumulation "
                               "window (an optimizer step or an in-place update before its last micro-batch): the "
                               "window's log-probs are stale")
        _, scored, source, target = self.found
        weights = _logical(self.grad_logps, source, target, scored.shape[0])
        # entropies only where TRL's loss reads them (an entropy bonus): else their gradient is 0
        entropy = self.grad_entropies is not None and bool(self.grad_entropies.any())
        weights_ent = _logical(self.grad_entropies, source, target, scored.shape[0]) if entropy else None

        def forward(m, ids, pos, layout):
            with trainer.accelerator.autocast():
                out = m(input_ids=ids[None], position_ids=pos[None], seqpack_tree=(layout, scored, entropy))
            return torch.stack([out["log_probs"], out["entropy"]]) if entropy else out["log_probs"][None]

        local = _local(model)  # the passes run on the module itself: no DDP collective per pass (buffers)
        # memory="kv": a shared prefix keeps only its K/V until its close (then one more forward), so no pass
        # holds more activations than a micro-batch
        for mb in prefix_reuse(self.passes, memory="kv", forward=forward):
            out = mb.forward(local)
            surrogate = (out[0] * weights.to(out.dtype)).sum()
            if entropy:
                surrogate = surrogate + (out[1] * weights_ent.to(out.dtype)).sum()
            surrogate.backward()
        if local is not model:
            _average_gradients(model, local)


def _logical(grad: Any, source: Any, target: Any, n: int) -> Any:
    """``[B, C]`` gradients at the logical tokens that predict them: ``w[source] =
    grad.view(-1)[target]``, 0 elsewhere (``[N]``)."""
    import torch

    src = torch.from_numpy(source).to(grad.device)
    dst = torch.from_numpy(target).to(grad.device)
    return grad.new_zeros(n).index_copy(0, src, grad.reshape(-1).index_select(0, dst))


def _local(model: Any) -> Any:
    """The module under its wrappers (``torch.compile``'s, DistributedDataParallel's):
    its forwards run no collective, so ranks may run different numbers of passes."""
    import torch

    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, torch.nn.Module):
            model = model._orig_mod
        else:
            return model


def _agreed(ok: bool) -> bool:
    """Whether every rank runs its window in passes: the data decide it (what pays,
    what a tree can take), and the ranks' forwards and gradient reductions must match,
    so one all-reduce (min) over the default group decides, before any collective of
    the window."""
    from ..._dist import active, all_reduce_int

    return bool(all_reduce_int(int(ok), "min")) if active() else ok


def _average_gradients(model: Any, local: Any) -> None:
    """The data-parallel reduction DDP would have made of the window's gradient (run on
    the module it wraps): every trainable parameter's gradient (0 where a rank has
    none, so that every rank reduces the same tensors in one order) all-reduced over
    DDP's process group in buckets and divided by its size."""
    import torch
    import torch.distributed as dist

    ddp = model
    while not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        ddp = getattr(ddp, "_orig_mod", None)
        if ddp is None:
            return
    group = ddp.process_group
    size = dist.get_world_size(group)
    params = [p for p in local.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets: dict = {}
    for p in params:
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
    for grads in buckets.values():
        for start in range(0, len(grads), 64):
            chunk = grads[start:start + 64]
            flat = torch.cat([g.reshape(-1) for g in chunk])
            dist.all_reduce(flat, group=group)
            flat.div_(size)
            at = 0
            for g in chunk:
                g.copy_(flat[at:at + g.numel()].view_as(g))
                at += g.numel()


def _window_rows(trainer: Any) -> Optional[List[Any]]:
    """The padded ``[b, P + C]`` rows of each micro-batch of the trainer's window (as
    TRL's ``_compute_loss`` concatenates them), or None outside TRL's buffer."""
    import torch

    buffered = getattr(trainer, "_buffered_inputs", None)
    if not isinstance(buffered, list) or not buffered:
        return None
    rows = []
    for inputs in buffered:
        if not isinstance(inputs, dict) or not all(k in inputs for k in ("prompt_ids", "completion_ids",
                                                                          "prompt_mask", "completion_mask")):
            return None
        rows.append((torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1),
                     torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)))
    return rows


def _applies(trainer: Any, model: Any) -> Optional[int]:
    """The window's micro-batch count where one optimizer step spans exactly TRL's
    buffered micro-batches and nothing else changes the parameters' gradient, else None."""
    args = getattr(trainer, "args", None)
    spg = getattr(args, "steps_per_generation", None)
    accelerator = getattr(trainer, "accelerator", None)
    if not isinstance(spg, int) or spg < 2 or accelerator is None:
        return None
    if getattr(trainer, "current_gradient_accumulation_steps", None) != spg or args.gradient_accumulation_steps != spg:
        return None
    kind = getattr(getattr(accelerator, "distributed_type", None), "name", "NO")
    if kind != "NO" and not kind.startswith("MULTI_"):
        return None  # DeepSpeed's engine scales and accumulates the backward itself; FSDP shards the gradients
    if getattr(args, "gradient_checkpointing", False) and \
            (getattr(args, "gradient_checkpointing_kwargs", None) or {}).get("use_reentrant", False):
        return None  # a reentrant checkpoint recomputes a layer under no_grad: (B) needs its K/V's graph
    import torch

    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in _local(model).modules()):
        return None  # the passes (B) would draw other masks than the values (A)
    config = getattr(_local(model), "config", None)
    if any(float(getattr(config, name, 0.0) or 0.0) > 0 for name in ("attention_dropout", "hidden_dropout")):
        return None
    return spg


def window_logps(trainer: Any, model: Any, input_ids: Any, attention_mask: Any, c: int, compute_entropy: bool,
                 usable: Any, micro_trees: Any, always: bool, in_passes: Any) -> Optional[Tuple[Any, Any, None]]:
    """TRL's ``(log-probs, entropies, None)`` of a training micro-batch served from its
    window (started at its first micro-batch on every rank, or on none), or None
    where the window does not apply or pay: the caller runs the micro-batch as its
    own tree (or on TRL's path). ``usable(inputs)``: a tree can take the buffered
    micro-batch ``inputs`` (TRL's dict), checked for every micro-batch of the window."""
    import torch

    from ...training.prefix_reuse import _parameters

    step = getattr(trainer, "_step", None)
    run: Optional[WindowRun] = trainer.__dict__.get(KEY)
    k = _applies(trainer, model)
    if not isinstance(step, int) or k is None:
        return None
    j = step % k
    if run is not None and run.start == step - j:
        if not torch.equal(input_ids, run.ids[j]):
            raise RuntimeError(f"seqpack (TRL prefix reuse): micro-batch {j} of the accumulation window is not the "
                               "rows TRL buffered for it")
        return run.serve(j, compute_entropy)
    trainer.__dict__.pop(KEY, None)
    if j != 0:
        return None  # a window starts at its first micro-batch
    plan = _plan(trainer, input_ids, c, k, micro_trees, always, usable)
    if not _agreed(plan is not None):
        return None
    ids, found, ids_all, passes = plan  # passes of a micro-batch's padded tokens at most
    b = int(input_ids.shape[0])
    local = _local(model)
    with torch.no_grad():
        logps, entropies, _ = in_passes(trainer, local, passes, found, (k * b, c), bool(compute_entropy),
                                        int(ids_all.numel()))
    run = WindowRun(step, k, b, ids, found, passes, logps, entropies, _parameters(_local(model)))
    trainer.__dict__[KEY] = run
    return run.serve(0, compute_entropy)


def _plan(trainer: Any, input_ids: Any, c: int, k: int, micro_trees: Any, always: bool,
          usable: Any) -> Optional[Tuple[Any, ...]]:
    """``(each micro-batch's rows, the window's completion tree, all rows)`` where the
    window is TRL's buffer of ``k`` micro-batches of one shape starting with
    ``input_ids``, a tree can take every one of them, and its tree pays (fewer tokens
    than the micro-batches' trees; with the shared prefixes' extra forward, 4/3 fewer
    unless ``always``), else None."""
    import torch

    from ...tensors.prefix_passes import split_prefix_tree

    rows = _window_rows(trainer)
    if rows is None or len(rows) != k or not torch.equal(rows[0][0], input_ids):
        return None
    if not all(usable(inputs) for inputs in trainer._buffered_inputs):
        return None
    if any(ids.shape != input_ids.shape for ids, _ in rows):
        return None
    ids_all = torch.cat([ids for ids, _ in rows])
    found = completion_tree(ids_all, torch.cat([mask for _, mask in rows]), c)
    if found is None:
        return None
    window_tokens = found[0].num_tokens
    micro_tokens = sum(micro_trees(ids, mask) for ids, mask in rows)
    passes = split_prefix_tree(found[0], int(input_ids.shape[0]) * int(input_ids.shape[1]))
    prefix_tokens = sum(p.own.shape[0] for p in passes.passes if p.role == "provider")
    cost = WINDOW_COST * window_tokens + PREFIX_COST * prefix_tokens
    if window_tokens >= micro_tokens or (not always and cost >= micro_tokens):
        return None
    return [ids for ids, _ in rows], found, ids_all, passes


def after_training_step(trainer: Any, model: Any) -> None:
    """After TRL's ``training_step`` (its ``_step`` already advanced): at the window's
    last micro-batch, check every micro-batch was served and run the passes (B)."""
    run: Optional[WindowRun] = trainer.__dict__.get(KEY)
    if run is None or trainer._step - run.start < run.k:
        return
    trainer.__dict__.pop(KEY, None)
    missing = sorted(set(range(run.k)) - set(run.served))
    if missing:
        raise RuntimeError(f"seqpack (TRL prefix reuse): micro-batches {missing} of the accumulation window never "
                           "asked for their log-probs: their gradient is not in the window's")
    run.finish(trainer, model)
