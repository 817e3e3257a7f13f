"""Drop-ins for training frameworks, each in its own module (imported on demand;
adapters never import one another):

- :mod:`~seqpack.frameworks.nemo_rl`: NeMo-RL's ``BatchedDataDict`` (also
  ``seqpack.BatchedDataDict``), its sharding and iterators as functions over a shard
  record (:mod:`~seqpack.frameworks.batched_data_dict` is the old path).
- :mod:`~seqpack.frameworks.roll`: ROLL's dynamic batching and sequence packing
  (also ``seqpack.roll``).
- :mod:`~seqpack.frameworks.verl`: verl's seqlen-balancing helpers (also ``seqpack.verl``).
- :mod:`~seqpack.frameworks.hf`: HF transformers attention/mask functions and a packing
  collator (also ``seqpack.integrations.hf``).
- :mod:`~seqpack.frameworks.trl`: HF TRL's ``pack_dataset`` on Arrow buffers (also
  ``seqpack.integrations.trl``).
- :mod:`~seqpack.frameworks.automodel`: NeMo AutoModel's THD ``pack_dataset`` on Arrow buffers and
  ``packed_sequence_thd_collater`` (also ``seqpack.integrations.automodel``).
- :mod:`~seqpack.frameworks.config`: NeMo-RL, ROLL and verl YAML keys (also ``seqpack.config``).
"""

from .._lazy import submodules

__getattr__ = submodules(__name__, ("automodel", "batched_data_dict", "config", "hf", "nemo_rl", "roll", "trl",
                                                "verl"))
