"""HF TRL's ``pack_dataset`` on Arrow buffers (also ``seqpack.integrations.trl``).

:func:`pack_dataset` has the signature, strategies, output columns and packs of
``trl.data_utils.pack_dataset``: the same rows in the same packs in the same
order. TRL packs each ``datasets.map`` batch (1,000 rows unless ``map_kwargs``
says otherwise) with a Python loop per row; here every batch is packed in one C++
call (best fit decreasing with TRL's tie-breaks, the GIL released) and the packed
columns are built with Arrow kernels (``list_slice``, ``take``) and new list
offsets, never a Python loop per row.

>>> import pyarrow as pa
>>> from seqpack.integrations.trl import pack_dataset
>>> table = pa.table({"input_ids": [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10], [11]]})
>>> pack_dataset(table, seq_length=4).to_pydict()
{'input_ids': [[1, 2, 3, 4], [8, 9, 10, 11], [6, 7]], 'seq_lengths': [[4], [3, 1], [2]]}

Strategies: ``"bfd"`` (truncate sequences to ``seq_length``), ``"bfd_split"``
(split them into ``seq_length`` fragments, the last one shorter), ``"wrapped"``
(concatenate and cut every ``seq_length`` tokens), as TRL; and ``"bfd_global"``
/ ``"bfd_split_global"``, the same rules over the whole dataset at once instead of
batch by batch: fewer, fuller packs (not TRL's packs). Empty and null rows are
left out, as TRL leaves them out, on every Arrow layout (``list`` / ``large_list``,
chunked, sliced, null slots that span values); ``map_kwargs`` are read as
``Dataset.map`` reads them.

Needs ``pyarrow`` (and ``datasets`` for ``Dataset`` / ``DatasetDict`` inputs):
``pip install seqpack[hf]``.
"""

from .packing import STRATEGIES, pack_dataset
from .patching import patch, patched, patched_names, report, trl_pack_dataset, unpatch

__all__ = ["pack_dataset", "STRATEGIES", "patch", "unpatch", "patched", "patched_names", "report", "trl_pack_dataset"]
