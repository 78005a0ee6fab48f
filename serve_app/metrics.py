"""Engine metrics on Ray's Prometheus endpoint (ray.util.metrics), named after vLLM's so that dashboards
and alerts carry over: `ray_pagedserve_num_requests_running` is vLLM's `vllm:num_requests_running`.
Labels: model_name and replica. Gauges and counters follow the engine's stats snapshot; latency
histograms are observed once per finished request. Mixture-of-experts models add
`pagedserve_moe_expert_tokens{expert}`: (token, expert) assignments per expert, summed over the MoE
layers, whose spread is the experts' load balance (e.g. max over mean of their rates)."""

from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

from engine.outputs import RequestOutput
from engine.stats import EngineStats

_PREFIX = "pagedserve_"
_TAGS = ("model_name", "replica")
_LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]

# vLLM name -> the EngineStats counter it follows
_COUNTERS = {
    "num_preemptions": "num_preemptions",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    # Speculative decoding; acceptance rate = rate(accepted_tokens) / rate(draft_tokens), and the mean
    # tokens per verification = 1 + rate(accepted_tokens) / rate(drafts).
    "spec_decode_num_drafts": "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens": "spec_decode_num_accepted_tokens",
}


class EngineMetrics:
    def __init__(self, model_name: str, replica: str) -> None:
        self.tags = {"model_name": model_name, "replica": replica}

        def gauge(name: str, description: str) -> Gauge:
            return Gauge(_PREFIX + name, description=description, tag_keys=_TAGS)

        def histogram(name: str, description: str, buckets: list[float]) -> Histogram:
            return Histogram(_PREFIX + name, description=description, boundaries=buckets, tag_keys=_TAGS)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).")
        self.counters = {
            name: Counter(_PREFIX + name, description=f"Engine counter {name}.", tag_keys=_TAGS) for name in _COUNTERS
        }
        self.success = Counter(_PREFIX + "request_success", description="Finished requests by finish reason.",
                               tag_keys=(*_TAGS, "finished_reason"))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Mean time between output tokens, per request.", _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self._last: dict[str, int] = {name: 0 for name in _COUNTERS}
        self.expert_tokens = Counter(_PREFIX + "moe_expert_tokens", tag_keys=(*_TAGS, "expert"),
                                     description="Tokens routed to each expert, summed over the MoE layers.")
        self._last_expert_tokens: list[int] = []

    def update(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running, tags=self.tags)
        self.waiting.set(stats.num_waiting, tags=self.tags)
        self.kv_usage.set(stats.kv_cache_usage, tags=self.tags)
        for name, field in _COUNTERS.items():
            value = getattr(stats, field)
            if value > self._last[name]:
                self.counters[name].inc(value - self._last[name], tags=self.tags)
                self._last[name] = value
        last = self._last_expert_tokens
        last.extend([0] * (len(stats.expert_tokens) - len(last)))
        for expert, value in enumerate(stats.expert_tokens):
            if value > last[expert]:
                self.expert_tokens.inc(value - last[expert], tags={**self.tags, "expert": str(expert)})
                last[expert] = value

    def observe(self, output: RequestOutput) -> None:
        """Called for every delta a request streams: counts finished samples, and records latencies
        when the request as a whole finishes."""
        for completion in output.outputs:
            if completion.finish_reason is not None:
                self.success.inc(1, tags={**self.tags, "finished_reason": completion.finish_reason})
        m = output.metrics
        if not output.finished or m is None:
            return
        for histogram, value in ((self.ttft, m.time_to_first_token), (self.itl, m.mean_inter_token_latency),
                                 (self.e2e, m.e2e_latency), (self.queue, m.queue_time)):
            if value is not None:
                histogram.observe(value, tags=self.tags)
