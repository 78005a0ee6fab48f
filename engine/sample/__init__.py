"""Sampling: the batched sampler over requests with different parameters, and the sampling of one step's
logit rows (draft verification and logprobs included)."""
