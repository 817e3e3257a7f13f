"""Integrations with training frameworks (imported on demand: each needs its framework).

- :mod:`seqpack.integrations.hf`: HF transformers (attention function, mask
  function and a packing collator).
"""
