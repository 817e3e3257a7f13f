"""TRL's adapter (also ``seqpack.integrations.trl``): :func:`pack_dataset`, TRL's
``pack_dataset`` on Arrow buffers (:mod:`~seqpack.frameworks.trl.packing`: the same
packs, one C++ call a batch), and :func:`patch`, TRL's trainers with seqpack's packing
and, for GRPO and RLOO, prefix trees (:mod:`~seqpack.frameworks.trl.patching`,
:mod:`~seqpack.frameworks.trl.tree`).

>>> import pyarrow as pa
>>> from seqpack.integrations.trl import pack_dataset
>>> pack_dataset(pa.table({"input_ids": [[1, 2, 3], [4, 5]]}), seq_length=4).to_pydict()["input_ids"]
[[1, 2, 3], [4, 5]]
"""

from .packing import STRATEGIES, pack_dataset
from .patching import patch, patched, patched_names, report, trl_pack_dataset, unpatch

__all__ = ["pack_dataset", "STRATEGIES", "patch", "unpatch", "patched", "patched_names", "report", "trl_pack_dataset"]
