"""The module path of NeMo-RL's ``BatchedDataDict`` before :mod:`seqpack.frameworks.nemo_rl`
(its package): the same objects.

    >>> from seqpack.frameworks.batched_data_dict import BatchedDataDict
    >>> from seqpack.frameworks.nemo_rl import BatchedDataDict as Same
    >>> BatchedDataDict is Same
    True
"""

from .nemo_rl import (BatchedDataDict, BatchedDataDictError, DynamicBatchingArgs, SequencePackingArgs, SlicedDataDict,
                      TreeMicroBatch, bin_assignment_spread)

__all__ = ["BatchedDataDict", "BatchedDataDictError", "DynamicBatchingArgs", "SequencePackingArgs",
           "SlicedDataDict", "TreeMicroBatch", "bin_assignment_spread"]
