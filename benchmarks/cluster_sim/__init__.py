"""A discrete-event simulator of a pagedserve cluster: engine replicas, a router, an autoscaler.

Why a simulator: routing and scaling decisions only show their worth at fleet scale (many replicas,
thousands of requests, minutes of traffic), which this 2-core machine cannot serve for real. So each
replica is simulated, but never guessed at: its prefix cache is the engine's own BlockPool and
KVCacheManager driven by the engine's own Scheduler, and its step time is a model fitted to the real
engine on this machine (fit.py). Routers and autoscalers are the production pure cores
(serve_app/routing/prefix_policy.py, autoscale/policy.py) fed only what they would see in production:
periodic, stale replica reports and their own history. See reference/routing_autoscaling.md, section 9.

    python -m benchmarks.cluster_sim.fit [--refit]     # the step-time model (cached in step_cost.json)
    python benchmarks/simulate.py                      # every table
    python benchmarks/simulate_pd.py                   # disaggregated prefill/decode (pd.py)
"""
