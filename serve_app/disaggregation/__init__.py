"""Disaggregated prefill/decode: the pure decision (policy.py); the prefill and decode deployments build on it."""
