"""Speculative decoding: draft tokens (n-gram prompt lookup or a draft model) verified in one target
forward, with rejection sampling that keeps the target's distribution."""
