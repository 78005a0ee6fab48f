"""Replica-count policy for engine replicas: a pure core (policy.py) and a thin Ray adapter (ray_policy.py)."""
