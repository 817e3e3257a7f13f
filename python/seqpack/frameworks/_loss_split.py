"""Which framework losses sum over prefix-reuse passes (issue 52): a pass holds some
of a row's tokens, so a loss runs on passes only when each token's term is its own
and the normaliser is global (the configs refuse the rest when they are read, the
adapters when a pass runs).

    >>> "vanilla" in VERL_TOKEN_LEVEL_LOSSES, "seq-mean-token-mean" in VERL_SPLITTING_AGGREGATIONS
    (True, False)

Importing this module does not import torch.
"""

__all__ = ["ROLL_SPLITTING_AGGREGATIONS", "VERL_SPLITTING_AGGREGATIONS", "VERL_TOKEN_LEVEL_LOSSES"]

# verl's policy losses whose terms are per token (GSPO's and geo_mean's ratios are per
# sequence; clip_cov / kl_cov select tokens by batch statistics; the others not checked).
VERL_TOKEN_LEVEL_LOSSES = ("vanilla", "gpg", "cispo")
# verl's aggregations over the global batch_num_tokens / global_batch_size (seq-mean-token-mean
# divides by each row's own token count).
VERL_SPLITTING_AGGREGATIONS = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# ROLL's aggregations over the mini-batch's global batch_num_tokens / global_valid_samples
# (its agg_loss; seq-mean-token-sum-norm divides by the micro-batch's width, which every
# pass keeps): seq-mean-token-mean, its default, divides by each row's own token count.
ROLL_SPLITTING_AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
# ROLL's switches whose terms couple a row's tokens (a sequence-level ratio or mask), by
# the value that turns them on.
ROLL_ROW_COUPLING = (("importance_sampling", "seq"), ("ratio_type", "segment"), ("train_infer_ratio_seq_mask", True),
                     ("train_infer_diff_seq_mask", True), ("length_loss_weight", True))
