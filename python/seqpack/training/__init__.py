"""Training ops on packed sequences: what a trainer's step calls.

- :mod:`~seqpack.training.logprobs`: fused next-token log-probs (and entropy) on packed logits.
- :mod:`~seqpack.training.logprobs_tree`: the same on prefix-tree logits (``tree_token_logprobs``,
  ``tree_linear_token_logprobs`` with the LM head fused).
- :mod:`~seqpack.training.loss`: :class:`SequencePackingLossWrapper` (NeMo-RL's losses on packed logits).
- :mod:`~seqpack.training.nemo_rl_loss`: NeMo-RL's losses and their normalisation (re-exported by ``loss``).
- :mod:`~seqpack.training.attention`: varlen attention and its backends, CP and Ulysses attention,
  prefix-tree attention (``attention_varlen``, ``attention_cp``, ``attention_ulysses``, ``attention_tree``).

Importing this package does not import torch; the ops do, when called.
"""

from .attention import (attention_backends, cp_attention, tree_attention, tree_attention_backends, ulysses_attention,
                        varlen_attention)
from .logprobs import TokenLogprobs, packed_token_logprobs
from .logprobs_tree import tree_linear_token_logprobs, tree_token_logprobs
from .loss import ClippedPGLoss, NLLLoss, SequencePackingLossWrapper, prepare_loss_input

__all__ = [
    "ClippedPGLoss", "NLLLoss", "SequencePackingLossWrapper", "TokenLogprobs", "attention_backends",
    "cp_attention", "packed_token_logprobs", "prepare_loss_input", "tree_attention", "tree_attention_backends",
    "tree_linear_token_logprobs", "tree_token_logprobs", "ulysses_attention", "varlen_attention",
]
