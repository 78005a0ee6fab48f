"""The Ray Serve adapter of the prefix router: a RequestRouter on the LLMServer deployment that hands
the request's block hashes (the PreparedRequest, the call's first argument) and the replicas' routing
stats to the pure core (prefix_policy.py), and returns its ranking as singleton ranks, so that Serve
falls through to the next choice when one replica is full."""

from __future__ import annotations

import time

import numpy as np
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from engine.core.prepared_request import PreparedRequest
from serve_app import tracing
from serve_app.disaggregation.transfer import KVFetchRequest
from serve_app.routing.prefix_policy import PrefixRouterConfig, PrefixRouterPolicy, ReplicaLoad

# choose_replica's keyword when the caller only picks and HAProxy forwards the request (IngressRouter):
# Serve will not report the request's end, so the policy ages it out instead (PrefixRouterPolicy.record_sent).
SENT_OUT_OF_BAND = "sent_out_of_band"


class PrefixRouter(RequestRouter):
    def initialize_state(self, **kwargs) -> None:
        """`request_router_kwargs` are PrefixRouterConfig fields."""
        self.policy = PrefixRouterPolicy(PrefixRouterConfig(**kwargs))
        self._summaries: dict[str, tuple[bytes, frozenset[int]]] = {}

    def _load(self, replica: RunningReplica, now: float) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        rid = replica.replica_id.unique_id
        raw = stats.get("cached_blocks")
        blocks = None
        if raw is not None:
            cached = self._summaries.get(rid)
            if cached is None or cached[0] is not raw:  # decode each report once
                cached = (raw, frozenset(np.frombuffer(raw, dtype=np.uint64).tolist()))
                self._summaries[rid] = cached
            blocks = cached[1]
        return ReplicaLoad(
            replica_id=rid,
            num_running=int(stats.get("num_running", 0)),
            num_waiting=int(stats.get("num_waiting", 0)),
            kv_cache_usage=float(stats.get("kv_cache_usage", 0.0)),
            cached_blocks=blocks,
            stats_age_s=now - stats["reported_at"] if "reported_at" in stats else float("inf"),
            adapters=frozenset(stats["lora_adapters"]) if "lora_adapters" in stats else None,
        )

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # never spin when every replica is full
        if not candidate_replicas:
            return []
        request = pending_request.args[0] if pending_request is not None and pending_request.args else None
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if isinstance(request, KVFetchRequest):  # pinned: only the replica holding the KV can answer
            return [[by_id[request.replica_id]]] if request.replica_id in by_id else []
        hashes = request.block_hashes if isinstance(request, PreparedRequest) else []
        adapter = _adapter(request)
        now = time.time()
        decision = self.policy.route(hashes, [self._load(r, now) for r in candidate_replicas], now, adapter)
        if isinstance(request, PreparedRequest):
            request.routed_matched_blocks = decision.matched_by_replica
        tracer = tracing.tracer()
        if tracer is not None and isinstance(request, PreparedRequest):
            tracer.start_span("route", context=tracing.extract(request.trace_context), attributes={
                "pagedserve.route.policy": "prefix", "pagedserve.route.replica": decision.ranked[0],
                "pagedserve.route.matched_blocks": decision.matched_blocks, "pagedserve.route.reason": decision.reason,
                "pagedserve.route.source": decision.source, "pagedserve.route.prompt_blocks": len(hashes),
                "pagedserve.route.lora": adapter or "",
            }).end()
        if pending_request is not None and pending_request.kwargs.get(SENT_OUT_OF_BAND) and decision.ranked:
            self.policy.record_sent(hashes, decision.ranked[0], now, adapter)  # a pick-only caller takes the first
        return [[by_id[rid]] for rid in decision.ranked]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        request = pending_request.args[0] if pending_request.args else None
        hashes = request.block_hashes if isinstance(request, PreparedRequest) else []
        self.policy.record(hashes, replica_id.unique_id, time.time(), _adapter(request))

    def on_request_completed(self, replica_id, internal_request_id: str) -> None:
        self.policy.complete(replica_id.unique_id)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.forget_replica(replica_id.unique_id)
        self._summaries.pop(replica_id.unique_id, None)


def _adapter(request) -> str | None:
    """The LoRA adapter a request names (the ingress also sets it as Serve's multiplexed_model_id)."""
    lora = request.lora_request if isinstance(request, PreparedRequest) else None
    return lora.lora_name if lora is not None else None
