"""Engine metrics on Ray's Prometheus endpoint (ray.util.metrics), named after vLLM's so that dashboards
and alerts carry over: `ray_pagedserve_num_requests_running` is vLLM's `vllm:num_requests_running`.
Labels: model_name and replica. Gauges and counters follow the engine's stats snapshot; latency
histograms are observed once per finished request. Mixture-of-experts models add
`pagedserve_moe_expert_tokens{expert}`: (token, expert) assignments per expert, summed over the MoE
layers, whose spread is the experts' load balance (e.g. max over mean of their rates)."""

from __future__ import annotations

import time
from collections import deque

from ray.util.metrics import Counter, Gauge, Histogram

from engine.outputs import PoolingRequestOutput, RequestOutput
from engine.stats import EngineStats

_PREFIX = "pagedserve_"
_TAGS = ("model_name", "replica")
_LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5]

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
    # Vision-language models: images per request = rate(mm_prompt_images) / rate(request_success); the
    # encoder cache's hit rate = rate(hits) / (rate(hits) + rate(images_encoded)).
    "mm_prompt_images": "mm_prompt_images",
    "mm_images_encoded": "mm_images_encoded",
    "mm_encoder_cache_hits": "mm_encoder_cache_hits",
    "mm_encoder_seconds": "mm_encoder_seconds",
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
        self.kv_bytes_per_token = gauge("kv_cache_bytes_per_token",
                                        "KV bytes a token of context takes on the driver rank: K and V per layer, or "
                                        "one latent per layer (no factor 2) under latent attention (DeepSeek).")
        self.counters = {
            name: Counter(_PREFIX + name, description=f"Engine counter {name}.", tag_keys=_TAGS) for name in _COUNTERS
        }
        self.success = Counter(_PREFIX + "request_success", description="Finished requests by finish reason.",
                               tag_keys=(*_TAGS, "finished_reason"))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Mean time between output tokens, per request.",
                             _ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.lora_requests = Counter(_PREFIX + "lora_requests", description="Requests per LoRA adapter.",
                                     tag_keys=(*_TAGS, "lora_name"))
        self._last: dict[str, int] = {name: 0 for name in _COUNTERS}
        self.expert_tokens = Counter(_PREFIX + "moe_expert_tokens", tag_keys=(*_TAGS, "expert"),
                                     description="Tokens routed to each expert, summed over the MoE layers.")
        self._last_expert_tokens: list[int] = []

    def update(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running, tags=self.tags)
        self.waiting.set(stats.num_waiting, tags=self.tags)
        self.kv_usage.set(stats.kv_cache_usage, tags=self.tags)
        self.kv_bytes_per_token.set(stats.kv_bytes_per_token, tags=self.tags)
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

    def count_lora_request(self, lora_name: str) -> None:
        self.lora_requests.inc(1, tags={**self.tags, "lora_name": lora_name})

    def observe(self, output: RequestOutput | PoolingRequestOutput) -> None:
        """Called for every delta a request streams: counts finished samples (an embedding counts as one), and
        records latencies when the request as a whole finishes."""
        if isinstance(output, PoolingRequestOutput):
            reasons = output.finish_reasons
        else:
            reasons = [c.finish_reason for c in output.outputs if c.finish_reason is not None]
        for reason in reasons:
            self.success.inc(1, tags={**self.tags, "finished_reason": reason})
        m = output.metrics
        if not output.finished or m is None:
            return
        for histogram, value in ((self.ttft, m.time_to_first_token), (self.itl, m.mean_inter_token_latency),
                                 (self.e2e, m.e2e_latency), (self.queue, m.queue_time)):
            if value is not None:
                histogram.observe(value, tags=self.tags)


class DisaggregationMetrics:
    """A decode replica's prefill/decode disaggregation: KV transfers (bytes, seconds), requests prefilled
    on the prefill pool, and those prefilled here (`reason`: short_prompt below min_uncached_prompt_tokens,
    fallback after a failed remote prefill, ineligible such as prompt logprobs)."""

    def __init__(self, model_name: str, replica: str) -> None:
        self.tags = {"model_name": model_name, "replica": replica}
        self.bytes = Counter(_PREFIX + "pd_kv_transfer_bytes", description="KV bytes fetched from prefill replicas.",
                             tag_keys=_TAGS)
        self.seconds = Histogram(_PREFIX + "pd_kv_transfer_seconds", description="Fetch to staged here, per request.",
                                 boundaries=_LATENCY_BUCKETS, tag_keys=_TAGS)
        self.remote = Counter(_PREFIX + "pd_remote_prefills", description="Requests prefilled on the prefill pool.",
                              tag_keys=_TAGS)
        self.local = Counter(_PREFIX + "pd_local_prefills", description="Requests prefilled on this decode replica.",
                             tag_keys=(*_TAGS, "reason"))
        # The same, readable in-process (LLMServer.pd_stats: tests and benchmarks/pd_live.py).
        self.totals: dict[str, float] = {"transfer_bytes": 0, "transfer_seconds": 0.0, "transfers": 0, "remote": 0}

    def transfer(self, num_bytes: int, seconds: float) -> None:
        self.bytes.inc(num_bytes, tags=self.tags)
        self.seconds.observe(seconds, tags=self.tags)
        self.totals["transfer_bytes"] += num_bytes
        self.totals["transfer_seconds"] += seconds
        self.totals["transfers"] += 1

    def remote_prefill(self) -> None:
        self.remote.inc(1, tags=self.tags)
        self.totals["remote"] += 1

    def local_prefill(self, reason: str) -> None:
        self.local.inc(1, tags={**self.tags, "reason": reason})
        self.totals[f"local_{reason}"] = self.totals.get(f"local_{reason}", 0) + 1


class RecentTTFT:
    """The replica's time to first token over the last `window_s`, as the p90 of its requests (the
    prefill pool's latency signal for the autoscaler; 0 when nothing started lately)."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()  # (when, ttft)

    def observe(self, output: RequestOutput) -> None:
        """One sample per request, when it finishes (a prefill replica's requests finish at their first token)."""
        m = output.metrics
        if output.finished and m is not None and m.time_to_first_token is not None:
            self._samples.append((time.monotonic(), m.time_to_first_token))
            # Pruned here too, not only when read: Serve reads p90 only where autoscaling is configured,
            # and a replica with a fixed count kept every request's sample for its whole life.
            self._prune()

    def _prune(self) -> None:
        horizon = time.monotonic() - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def __len__(self) -> int:
        return len(self._samples)

    def p90(self) -> float:
        self._prune()
        if not self._samples:
            return 0.0
        values = sorted(v for _, v in self._samples)
        return values[min(len(values) - 1, int(0.9 * len(values)))]
