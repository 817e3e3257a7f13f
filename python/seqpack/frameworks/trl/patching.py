"""TRL's trainers with seqpack in place of TRL's own (``seqpack.integrations.trl.patch``):
SFT's ``pack_dataset`` replaced by :func:`~seqpack.frameworks.trl.packing.pack_dataset`
(same packs, one C++ call a batch), and with ``shared_prefix=True`` GRPO's and RLOO's
log-probs computed on prefix trees (:mod:`seqpack.frameworks.trl.tree`)::

    patch()                      SFT packing                  (trl.data_utils.pack_dataset ...)
    patch(shared_prefix=True)    GRPO / RLOO on prefix trees  (SFT packing left alone unless packing=True)
    unpatch() / with patched():  TRL's own again

Importing this module does not import TRL or torch.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .packing import datasets_module, pack_dataset

__all__ = ["patch", "patched", "patched_names", "report", "trl_pack_dataset", "unpatch"]

_TRL_ORIGINAL: Dict[str, Any] = {}  # "pack_dataset": TRL's own function, while patched
_TRL_STRATEGIES = ("bfd", "bfd_split", "wrapped")  # what TRL's trainers read as packed (SFTTrainer's padding-free)


def trl_pack_dataset(dataset: Any, seq_length: int, strategy: str = "bfd",
                     map_kwargs: Optional[Dict[str, Any]] = None) -> Any:
    """What :func:`patch` puts in TRL's place: TRL's ``pack_dataset`` signature,
    :func:`pack_dataset` for a ``datasets.Dataset`` / ``DatasetDict`` (the same
    packs), TRL's own function for what seqpack does not take (``IterableDataset``,
    ``IterableDatasetDict``: packed as a stream, batch by batch).

    Only TRL's strategies (``"bfd"``, ``"bfd_split"``, ``"wrapped"``): SFTTrainer
    turns padding-free on (position ids restarting per sequence) for the ``bfd``
    ones by name, so ``"bfd_global"`` packs would be trained as one sequence per
    row - refused here, as TRL refuses an unknown strategy."""
    if strategy not in _TRL_STRATEGIES:
        raise ValueError(f"Invalid packing strategy '{strategy}', must be one of {_TRL_STRATEGIES} (TRL's trainers "
                         f"read only these as packed; seqpack's global strategies need seqpack.integrations.trl."
                         f"pack_dataset and a trainer that is told the rows are packed)")
    datasets = datasets_module()
    if isinstance(dataset, (datasets.Dataset, datasets.DatasetDict)):
        return pack_dataset(dataset, seq_length, strategy, map_kwargs)
    return _trl_pack_dataset()(dataset, seq_length, strategy, map_kwargs)


def _trl_pack_dataset() -> Any:
    """TRL's own ``pack_dataset`` (patched or not)."""
    if "pack_dataset" in _TRL_ORIGINAL:
        return _TRL_ORIGINAL["pack_dataset"]
    import trl.data_utils

    return trl.data_utils.pack_dataset


def _trl_modules() -> List[Tuple[str, Any]]:
    import sys

    return [(name, module) for name, module in sys.modules.copy().items()  # copy(): atomic, imports may race
            if module is not None and (name == "trl" or name.startswith("trl."))]


def patch(shared_prefix: bool = False, *, packing: Optional[bool] = None, trees: str = "auto") -> List[str]:
    """Make TRL's trainers run with seqpack.

    ``packing`` (default: on without ``shared_prefix``, off with it): TRL's
    ``pack_dataset`` is replaced by :func:`trl_pack_dataset` in ``trl.data_utils``
    and in every loaded TRL module that bound it (``trl.trainer.sft_trainer``,
    imported here, ``trl.experimental.gold.gold_trainer`` when loaded,
    ``trl.pack_dataset`` once read); TRL modules imported later bind the replacement
    from ``trl.data_utils``.

    ``shared_prefix=True`` puts prefix trees under TRL's ``GRPOTrainer`` and
    ``RLOOTrainer``: their log-probs (policy, old policy, reference model) are
    computed with each shared prompt forwarded once (:mod:`seqpack.frameworks.trl.tree`;
    docs/trl.md); a GRPO run does not have its SFT packing swapped unless it asks
    (``packing=True``). A batch runs as a tree only where the tree pays for it
    (``trees="auto"``: its tokens and pairs saved priced against the tree path's own
    costs, :mod:`seqpack.frameworks.trl.choice`), else on TRL's path;
    ``trees="always"`` runs every batch a tree can take as a tree. :func:`report`
    says how many batches ran as trees, how many did not and why, and the tokens the
    trees saved. ``patch()`` without ``shared_prefix`` leaves an earlier
    ``shared_prefix`` patch on.

    Idempotent; :func:`unpatch` (or the :func:`patched` context manager) restores
    TRL's own. Returns the names that are seqpack's now (``module.pack_dataset``,
    ``module.Trainer.method``; the same list when called again); what this call
    replaced is logged once, at WARNING, so a run's log says the patch is on."""
    import importlib
    import logging

    if trees not in ("auto", "always"):  # checked before anything is replaced
        raise ValueError(f"trees must be 'auto' (a tree when it pays) or 'always', got {trees!r}")
    packing = (not shared_prefix) if packing is None else bool(packing)
    try:
        data_utils = importlib.import_module("trl.data_utils")
    except ImportError as exc:
        raise ImportError(f"seqpack.integrations.trl.patch() needs TRL (pip install trl): {exc}") from exc
    replaced = []
    if packing:
        importlib.import_module("trl.trainer.sft_trainer")
        original = _TRL_ORIGINAL.get("pack_dataset", data_utils.pack_dataset)
        if original is trl_pack_dataset:  # patched, then this module reloaded: nothing left to restore to
            raise RuntimeError("trl.data_utils.pack_dataset is seqpack's already, and TRL's own is not known here")
        for name, module in _trl_modules():
            if getattr(module, "__dict__", {}).get("pack_dataset") is original:
                module.pack_dataset = trl_pack_dataset
                replaced.append(f"{name}.pack_dataset")
        _TRL_ORIGINAL["pack_dataset"] = original
    if shared_prefix:
        from .tree import patch_trainers, patched_trainer_names

        before = set(patched_trainer_names())
        replaced += [name for name in patch_trainers(trees) if name not in before]
    if replaced:
        logging.getLogger(__name__).warning("seqpack.integrations.trl.patch(): TRL's %s replaced by seqpack's",
                                            ", ".join(sorted(replaced)))
    return patched_names()


def report() -> Dict[str, Any]:
    """What the ``shared_prefix`` patch did in this process: batches of log-probs run
    on prefix trees and on TRL's own path (by reason), and the tokens the trees
    forwarded against TRL's padded rows (``tokens_saved``). Zeros before any batch.

    >>> report()["tree_batches"]
    0
    """
    trees = _trees()
    return trees.counts() if trees is not None else dict(tree_batches=0, trl_batches=0, trl_reasons={},
                                                         padded_tokens=0, tree_tokens=0, tokens_saved=0)


def patched_names() -> List[str]:
    """The ``module.pack_dataset`` names of loaded TRL modules that are seqpack's now,
    and the ``module.Trainer.method`` names of the ``shared_prefix`` patch."""
    names = sorted(f"{name}.pack_dataset" for name, module in _trl_modules()
                   if getattr(module, "__dict__", {}).get("pack_dataset") is trl_pack_dataset)
    trees = _trees()
    return names + (trees.patched_trainer_names() if trees is not None else [])


def _trees() -> Any:
    """:mod:`seqpack.frameworks.trl.tree` when loaded (only a ``shared_prefix`` patch
    loads it: nothing of it to report or restore otherwise), else None."""
    import sys

    return sys.modules.get("seqpack.frameworks.trl.tree")


def unpatch() -> List[str]:
    """Restores TRL's own ``pack_dataset`` wherever :func:`patch` (or a TRL module
    imported since) put seqpack's, and TRL's trainer methods, models' forwards and
    attention implementations a ``shared_prefix`` patch changed; returns the names
    restored."""
    original = _TRL_ORIGINAL.pop("pack_dataset", None)
    restored = patched_names()
    if original is not None:
        for name, module in _trl_modules():
            if getattr(module, "__dict__", {}).get("pack_dataset") is trl_pack_dataset:
                module.pack_dataset = original
    trees = _trees()
    if trees is not None:
        trees.unpatch_trainers()
    return restored


@contextlib.contextmanager
def patched(shared_prefix: bool = False, *, packing: Optional[bool] = None,
            trees: str = "auto") -> Iterator[List[str]]:
    """``with patched():`` TRL's trainers pack with seqpack inside the block (TRL
    packs in the trainer's constructor), with prefix trees under GRPO and RLOO for
    ``shared_prefix=True``; on exit TRL's own is restored unless it was patched
    before the block. Yields :func:`patch`'s list."""
    was = bool(_TRL_ORIGINAL)
    trees_before = _trees() is not None and bool(_trees().patched_trainer_names())
    try:
        yield patch(shared_prefix=shared_prefix, packing=packing, trees=trees)
    finally:
        if not was:
            unpatch()
        elif shared_prefix and not trees_before:
            _trees().unpatch_trainers()
