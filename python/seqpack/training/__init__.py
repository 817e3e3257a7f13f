"""Training ops on packed sequences: what a trainer's step calls.

- :mod:`~seqpack.training.ops`: ``attention`` (``seqpack.attention``; this package's
  ``attention`` is the module of its implementations) and :func:`token_logprobs` on any layout (the
  implementation each layout kind and cut runs: :mod:`~seqpack.training.dispatch`), and
  :func:`varlen_attention`, flash-attn's raw form.
- :mod:`~seqpack.training.logprobs`: fused next-token log-probs (and entropy) on packed logits.
- :mod:`~seqpack.training.logprobs_tree`: the same on prefix-tree logits (``tree_token_logprobs``,
  ``tree_linear_token_logprobs`` with the LM head fused).
- :mod:`~seqpack.training.loss`: :class:`SequencePackingLossWrapper` (NeMo-RL's losses on packed logits).
- :mod:`~seqpack.training.nemo_rl_loss`: NeMo-RL's losses and their normalisation (re-exported by ``loss``).
- :mod:`~seqpack.training.attention`: varlen attention and its backends, CP and Ulysses attention,
  prefix-tree attention (``attention_varlen``, ``attention_cp``, ``attention_ulysses``, ``attention_tree``).

Importing this package does not import torch; the ops do, when called.
"""

from .attention import attention_backends
from .logprobs import TokenLogprobs
from .loss import ClippedPGLoss, NLLLoss, SequencePackingLossWrapper, prepare_loss_input
from .ops import token_logprobs, varlen_attention

__all__ = [
    "ClippedPGLoss", "NLLLoss", "SequencePackingLossWrapper", "TokenLogprobs", "attention_backends",
    "prepare_loss_input", "token_logprobs", "varlen_attention",
]
