"""The event loop: requests arrive, a router places them, replicas step, an autoscaler resizes the fleet.

Simulated time only: an event heap of arrivals, step ends, replica start-ups, stats ticks (every
stats_period_s: the routing stats routers see, the load-imbalance samples) and control-loop ticks (the
autoscaler). Requests a router cannot place yet (no routable replica, or all at max_ongoing_requests)
wait at the handle, in order. A chat turn arrives a think time after its predecessor's last token.

Scale-up starts replicas that take requests only after cold_start_s. Scale-down stops starting replicas
first, then the newest running ones; a stopped running replica drains (no new requests, stops when its
streams have finished; after graceful_shutdown_timeout_s, if set, the rest are cut) or, without drain,
cuts its streams at once. Replica-seconds run from a replica's start request (cold start included) to
its stop, or to the end of the run."""

from __future__ import annotations

import heapq
import itertools
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass

from .autoscalers import CONTROL_LOOP_PERIOD_S, Autoscaler, Fixed
from .fit import StepCostModel
from .replica import Done, ReplicaConfig, SimReplica
from .routers import ReplicaReport, Router, RouterView
from .workloads import SimRequest, Workload


@dataclass(frozen=True)
class SimConfig:
    replica: ReplicaConfig = ReplicaConfig()
    initial_replicas: int = 6
    stats_period_s: float = 1.0  # routing stats (request_routing_stats_period_s in serve_app/app.py)
    cold_start_s: float = 15.0
    drain: bool = True
    graceful_shutdown_timeout_s: float | None = None  # None: a draining replica waits for every stream
    max_ongoing_requests: int = 256  # serve_app/app_args.py default
    max_time_s: float = 3600.0  # safety net: requests still open then count as unfinished


@dataclass
class Trace:
    sim: SimRequest
    arrival: float
    replica: str | None = None
    routed_at: float | None = None
    first_token: float | None = None
    finished: float | None = None
    cached_tokens: int = -1
    preemptions: int = 0
    dropped: bool = False


@dataclass
class SimOutcome:
    traces: list[Trace]
    replicas: list[SimReplica]
    end_time: float
    abandoned: int  # chat turns that never came: an earlier turn of their session was cut
    imbalance_samples: list[float]
    replica_timeline: list[tuple[float, int, int]]  # (time, routable replicas, target) at stats ticks
    scale_ups: int
    scale_downs: int
    router_reasons: Counter
    wall_s: float


class Cluster:
    def __init__(self, workload: Workload, router: Router, autoscaler: Autoscaler | None, cost: StepCostModel,
                 config: SimConfig) -> None:
        self.workload, self.router, self.config, self.cost = workload, router, config, cost
        self.autoscaler = autoscaler or Fixed()
        self.replicas: list[SimReplica] = []
        self.by_id: dict[str, SimReplica] = {}
        self.target = 0
        self.reports: dict[str, ReplicaReport] = {}
        self._ongoing: dict[str, int] = {}
        self.queue: deque[Trace] = deque()
        self.traces: dict[str, Trace] = {}
        self.followers: dict[str, list[SimRequest]] = defaultdict(list)
        self._heap: list[tuple[float, int, str, object]] = []
        self._seq = itertools.count()
        self._open = 0  # requests that arrived or will arrive and are not finished or dropped
        self.abandoned = 0
        self.scale_ups = self.scale_downs = 0
        self.imbalance: list[float] = []
        self.timeline: list[tuple[float, int, int]] = []
        self._ids = itertools.count()

    # --- what routers and autoscalers may read ----------------------------------------------------------
    def running_replicas(self) -> list[SimReplica]:
        return [r for r in self.replicas if r.state == "running"]

    def ongoing(self, replica_id: str) -> int:
        return self._ongoing.get(replica_id, 0)

    @property
    def queued(self) -> int:
        return len(self.queue)

    # --- the loop ------------------------------------------------------------------------------------
    def run(self) -> SimOutcome:
        start_wall = time.perf_counter()
        for sim in self.workload.requests:
            if sim.follows is None:
                self._push(sim.arrival, "arrive", sim)
            else:
                self.followers[sim.follows].append(sim)
            self._open += 1
        self._scale_to(self.config.initial_replicas, 0.0, warm=True)
        self._push(0.0, "stats", None)
        if not isinstance(self.autoscaler, Fixed):
            self._push(0.0, "control", None)
        now = 0.0
        while self._heap and self._open > 0:
            now, _, kind, obj = heapq.heappop(self._heap)
            if now > self.config.max_time_s:
                break
            getattr(self, f"_on_{kind}")(obj, now)
        end = now
        for r in self.replicas:
            if r.stopped_at is None:
                r.stopped_at = end
        return SimOutcome(list(self.traces.values()), self.replicas, end, self.abandoned, self.imbalance,
                          self.timeline, self.scale_ups, self.scale_downs, self.router.reasons,
                          time.perf_counter() - start_wall)

    def _push(self, t: float, kind: str, obj: object) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), kind, obj))

    def _on_arrive(self, sim: SimRequest, now: float) -> None:
        trace = Trace(sim, now)
        self.traces[sim.request_id] = trace
        self.queue.append(trace)
        self._dispatch(now)

    def _dispatch(self, now: float) -> None:
        while self.queue:
            replicas = self.running_replicas()
            if not replicas:
                return
            trace = self.queue[0]
            view = RouterView(replicas, {r.replica_id: self.ongoing(r.replica_id) for r in replicas}, self.reports)
            ranked = self.router.rank(trace.sim, view, now)
            rid = next((rid for rid in ranked if self.ongoing(rid) < self.config.max_ongoing_requests), None)
            if rid is None:
                return  # every replica is full: wait for a stream to end
            self.queue.popleft()
            replica = self.by_id[rid]
            replica.add(trace.sim, now)
            self._ongoing[rid] = self.ongoing(rid) + 1
            trace.replica, trace.routed_at = rid, now
            self.router.on_routed(trace.sim, rid, now)
            if not replica.in_step:
                self._start_step(replica, now)

    def _start_step(self, replica: SimReplica, now: float) -> None:
        duration = replica.start_step()
        if duration is not None:
            self._push(now + duration, "step_end", replica)

    def _on_step_end(self, replica: SimReplica, now: float) -> None:
        if replica.state == "stopped" or not replica.in_step:
            return  # cut while this step ran
        result = replica.finish_step()
        for sim in result.first_tokens:
            self.traces[sim.request_id].first_token = now
        for done in result.finished:
            self._close(done, now, replica, dropped=False)
        if replica.state == "draining" and replica.num_in_flight == 0:
            self._stop(replica, now)
        else:
            self._start_step(replica, now)
        if result.finished and self.queue:
            self._dispatch(now)

    def _close(self, done: Done, now: float, replica: SimReplica, dropped: bool) -> None:
        trace = self.traces[done.sim.request_id]
        trace.cached_tokens, trace.preemptions, trace.dropped = done.cached_tokens, done.preemptions, dropped
        trace.finished = None if dropped else now
        self._ongoing[replica.replica_id] -= 1
        self.router.on_completed(replica.replica_id, now)
        self._open -= 1
        if dropped:
            self._abandon(done.sim.request_id)
            return
        for follower in self.followers.pop(done.sim.request_id, ()):
            self._push(now + follower.think_time, "arrive", follower)

    def _abandon(self, request_id: str) -> None:
        for follower in self.followers.pop(request_id, ()):
            self.abandoned += 1
            self._open -= 1
            self._abandon(follower.request_id)

    # --- replicas coming and going -------------------------------------------------------------------
    def _scale_to(self, target: int, now: float, warm: bool = False) -> None:
        live = [r for r in self.replicas if r.state in ("starting", "running")]
        if target > len(live):
            for _ in range(target - len(live)):
                rid = f"r{next(self._ids)}"
                ready = now if warm else now + self.config.cold_start_s
                replica = SimReplica(rid, self.config.replica, self.cost, now, ready)
                self.replicas.append(replica)
                self.by_id[rid] = replica
                self._ongoing[rid] = 0
                self._push(ready, "ready", replica)
        elif target < len(live):
            victims = sorted(live, key=lambda r: (r.state == "running", -r.started_at, -int(r.replica_id[1:])))
            for replica in victims[: len(live) - target]:
                if replica.state == "starting":
                    replica.state, replica.stopped_at = "stopped", now
                else:
                    self._drain(replica, now)
        self.target = target

    def _on_ready(self, replica: SimReplica, now: float) -> None:
        if replica.state != "starting":
            return  # stopped before it came up
        replica.state = "running"
        self.router.on_replicas_changed([replica.replica_id], [], now)
        self._dispatch(now)

    def _drain(self, replica: SimReplica, now: float) -> None:
        replica.state, replica.drain_started_at = "draining", now
        self.router.on_replicas_changed([], [replica.replica_id], now)
        self.reports.pop(replica.replica_id, None)
        if not self.config.drain:
            self._cut(replica, now)
        elif replica.num_in_flight == 0:
            self._stop(replica, now)
        elif self.config.graceful_shutdown_timeout_s is not None:
            self._push(now + self.config.graceful_shutdown_timeout_s, "drain_timeout", replica)

    def _on_drain_timeout(self, replica: SimReplica, now: float) -> None:
        if replica.state == "draining":
            self._cut(replica, now)

    def _cut(self, replica: SimReplica, now: float) -> None:
        for done in replica.cut():
            self._close(done, now, replica, dropped=True)
        self._stop(replica, now)

    def _stop(self, replica: SimReplica, now: float) -> None:
        replica.state, replica.stopped_at = "stopped", now
        self.autoscaler.on_replica_stopped(replica.replica_id)

    # --- periodic ------------------------------------------------------------------------------------
    def _on_stats(self, _: object, now: float) -> None:
        routable = self.running_replicas()
        summaries = self.router.wants_summaries
        for r in routable:
            self.reports[r.replica_id] = ReplicaReport(
                now, r.num_running, r.num_waiting, r.kv_cache_usage, r.cache_summary() if summaries else None)
        loads = [r.num_in_flight for r in routable]
        if loads and sum(loads) > 0:
            self.imbalance.append(max(loads) * len(loads) / sum(loads))
        self.timeline.append((now, len(routable), self.target))
        self._push(now + self.config.stats_period_s, "stats", None)

    def _on_control(self, _: object, now: float) -> None:
        target = self.autoscaler.tick(now, self)
        if target != self.target:
            if target > self.target:
                self.scale_ups += 1
            else:
                self.scale_downs += 1
            self._scale_to(target, now)
        self._push(now + CONTROL_LOOP_PERIOD_S, "control", None)


def simulate(workload: Workload, router: Router, cost: StepCostModel, config: SimConfig | None = None,
             autoscaler: Autoscaler | None = None) -> SimOutcome:
    return Cluster(workload, router, autoscaler, cost, config or SimConfig()).run()
