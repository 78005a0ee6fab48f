"""Node autoscaling end to end: the app's engine replicas grow and shrink a Ray cluster by whole nodes.

    python benchmarks/scale_out.py [--burst-s 20] [--hold-s 5] [--concurrency 8] [--max-replicas 2] [--kill-running-ray]

WARNING: this stops every Ray process on this machine. The cluster is Ray's own autoscaling test harness
(`ray.cluster_utils.AutoscalingCluster` with the fake multi-node provider), whose start runs
`ray stop --force`: any other Ray instance here (a `make run`, a test session, another benchmark) is
killed. Run it alone: it refuses to start while Ray processes are running unless --kill-running-ray says
that is intended. (At the end it stops only its own cluster's processes, not with `ray stop --force`, so
that a Ray instance started meanwhile survives; it would still share the cores and skew the timeline.)

The cluster: a head node (the Serve controller, Ray's HTTP proxy actor and the ingress, pinned there by a
`head_node` resource) and up to --max-replicas worker nodes of one type, {CPU: 1, llm_replica: 1} with a
small object store, 0 of them at the start. Worker nodes are started and stopped by Ray's autoscaler
(autoscaler v1, its monitor on the head) as real raylets, all on this machine: they share its cores, so only
the orderings and the timeline's shape mean something, not the absolute figures.

The app: the built-in model pagedserve-tiny, engine replicas asking for {num_cpus: 0, llm_replica: 1}, so that
a node holds exactly one replica, scaled by our policy (autoscale.ray_policy:KVQueueAutoscalingPolicy) from
min_replicas (1) to --max-replicas, on waiting requests per replica (target 1; each engine runs at most 2
requests at once, so a burst queues). What a burst does:

1. the policy raises the deployment's target (requests wait on the first replica);
2. Serve creates the replica actor, which stays pending: no node offers `llm_replica`;
3. Ray's autoscaler sees the pending demand and adds a worker node;
4. the replica starts there, reports RUNNING, and the router sends it requests.

When the burst stops, --tail-streams long streams are still running: the policy lowers the target once one
replica fewer would hold the load (after its downscale_delay_s), Serve stops a replica, which drains its
streams first (graceful_shutdown_timeout_s), and once its node is idle for the autoscaler's idle timeout,
the autoscaler removes the node. Every stream, burst or tail, must end with finish_reason "length" and all
its tokens, without an error event.

Timeline: the cluster and the deployment are polled every --poll-s (the controller's deployment details:
target replicas, each replica's state and node; ray.nodes(); the engine replicas' stats through a broadcast),
and each event is the first poll that saw it, in seconds from the burst's start. Also replica-seconds (engine
replicas holding a node: RUNNING or STOPPING) and node-seconds (alive worker nodes) over the run, against a
cluster sized for the peak all along. Printed as markdown and saved to benchmarks/results/scale_out.md."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):  # run as a script: make `serve_app`, `autoscale` importable
    sys.path.insert(0, str(ROOT))

APP = "pagedserve"
REPLICA_RESOURCE = "llm_replica"
HEAD_RESOURCE = "head_node"
WORKER_TYPE = "ray.worker.llm"
MIB = 1024**2
RESULTS = ROOT / "benchmarks" / "results" / "scale_out.md"
# At most 2 requests running per engine, so a burst queues (what the policy scales on); room for the tail's
# long streams, whose KV stays a small share of the blocks (KV usage is a signal too).
ENGINE = {"max_model_len": 4096, "num_kv_blocks": 2048, "num_threads": 1, "max_num_seqs": 2}

# Ray's fake_multi_node/example.yaml, which AutoscalingCluster._generate_config reads but Ray 2.60's wheel lacks.
BASE_CONFIG = {
    "cluster_name": "fake_multinode",
    "max_workers": 8,
    "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                 "disable_launch_config_check": True},
    "auth": {},
    "available_node_types": {},
    "head_node_type": "ray.head.default",
    "upscaling_speed": 1.0,
    "idle_timeout_minutes": 0.1,
    "docker": {},
    "initialization_commands": [],
    "setup_commands": [],
    "head_setup_commands": [],
    "worker_setup_commands": [],
    "head_start_ray_commands": [],
    "worker_start_ray_commands": [],
    "file_mounts": {},
    "cluster_synced_files": [],
    "file_mounts_sync_continuously": False,
    "rsync_exclude": [],
    "rsync_filter": [],
}


def make_cluster(max_workers: int, idle_timeout_min: float):
    """An AutoscalingCluster (Ray's test harness, fake multi-node provider) with its base config inlined."""
    from ray.cluster_utils import AutoscalingCluster

    class FakeMultiNodeCluster(AutoscalingCluster):
        def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
            config = json.loads(json.dumps(BASE_CONFIG))
            config["available_node_types"] = {
                **worker_node_types,
                "ray.head.default": {"resources": head_resources, "node_config": {}, "max_workers": 0}}
            config.update(config_kwargs)
            return config

        def start(self, _system_config=None, override_env=None):
            """AutoscalingCluster.start with the dashboard off (it would take a core's worth of start-up here)
            and the head's custom resources passed as JSON Ray can read."""
            subprocess.check_call(["ray", "stop", "--force"])
            fd, path = tempfile.mkstemp(prefix="scale_out_", suffix=".json")
            with os.fdopen(fd, "w") as f:
                json.dump(self._config, f)
            head = dict(self._head_resources)
            cmd = ["ray", "start", "--head", f"--autoscaling-config={path}", f"--num-cpus={head.pop('CPU', 1)}",
                   f"--object-store-memory={head.pop('object_store_memory', 80 * MIB)}",
                   f"--resources={json.dumps(head)}", "--include-dashboard=false", "--disable-usage-stats"]
            env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1", **(override_env or {})}
            subprocess.check_call(cmd, env=env)

        def shutdown(self, session_name: str | None = None):
            """Stop this cluster's processes only (AutoscalingCluster.shutdown runs `ray stop --force`, which
            would also take down any Ray instance started here since): every process whose command line names
            this cluster's session (GCS, raylets, including the worker nodes' that the autoscaler started, the
            monitor, dashboard, log monitors), their children (workers, replicas' engine processes), and the
            head's Ray client server. Without a session name, `ray stop --force`."""
            if session_name is None:
                return super().shutdown()
            stop_session(session_name)

    workers = {WORKER_TYPE: {"resources": {"CPU": 1, REPLICA_RESOURCE: 1, "object_store_memory": 80 * MIB},
                             "node_config": {}, "min_workers": 0, "max_workers": max_workers}}
    return FakeMultiNodeCluster(head_resources={"CPU": 1, HEAD_RESOURCE: 1, "object_store_memory": 80 * MIB},
                                worker_node_types=workers, max_workers=max_workers,
                                idle_timeout_minutes=idle_timeout_min)


def stop_session(session_name: str) -> None:
    import psutil
    from ray.autoscaler._private.fake_multi_node.node_provider import FAKE_HEAD_NODE_ID

    procs: dict[int, psutil.Process] = {}
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = p.info["cmdline"] or []
        # The head's Ray client server names no session, but the fake provider's head node id.
        if any(session_name in arg for arg in cmdline) or (
                "ray.util.client.server" in cmdline and f"--node-id={FAKE_HEAD_NODE_ID}" in cmdline):
            procs[p.pid] = p
            try:
                procs.update({c.pid: c for c in p.children(recursive=True)})
            except psutil.NoSuchProcess:
                pass
    procs.pop(os.getpid(), None)
    for p in procs.values():
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(list(procs.values()), timeout=10)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def running_ray_processes() -> list[str]:
    import psutil

    names = {"raylet", "gcs_server"}
    return [f"{p.info['name']} (pid {p.info['pid']})" for p in psutil.process_iter(["name", "pid"])
            if p.info["name"] in names]


def app_args(max_replicas: int, min_replicas: int, downscale_delay_s: float):
    from serve_app.app_args import AppArgs

    return AppArgs(
        model="pagedserve-tiny",
        engine=ENGINE,
        ray_actor_options={"num_cpus": 0, "resources": {REPLICA_RESOURCE: 1}},  # one replica per worker node
        ingress_ray_actor_options={"num_cpus": 0, "resources": {HEAD_RESOURCE: 0.01}},  # the ingress stays
        autoscaling_config={
            "min_replicas": min_replicas, "max_replicas": max_replicas, "look_back_period_s": 2,
            "policy": {"policy_function": "autoscale.ray_policy:KVQueueAutoscalingPolicy",
                       "policy_kwargs": {"target_waiting_per_replica": 1, "downscale_delay_s": downscale_delay_s}},
        },
        graceful_shutdown_timeout_s=60,
    )


# --- load -------------------------------------------------------------------------------------------------------


@dataclass
class Stream:
    kind: str  # "burst" | "tail"
    max_tokens: int
    start: float
    end: float = 0.0
    status: int = 0
    tokens: int | None = None
    finish: str | None = None
    error: str | None = None

    @property
    def whole(self) -> bool:
        return self.status == 200 and self.error is None and self.finish == "length" and self.tokens == self.max_tokens


def stream(url: str, kind: str, max_tokens: int, out: list[Stream], lock: threading.Lock) -> None:
    body = {"model": "pagedserve-tiny", "prompt": "grow the cluster", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    s = Stream(kind, max_tokens, time.time())
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
            s.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    s.error = json.dumps(chunk["error"])[:200]
                if chunk.get("usage"):
                    s.tokens = chunk["usage"]["completion_tokens"]
                for c in chunk.get("choices", []):
                    s.finish = c.get("finish_reason") or s.finish
    except Exception as e:  # noqa: BLE001 - reported in the results
        s.error = repr(e)[:200]
    s.end = time.time()
    with lock:
        out.append(s)


def burst(url: str, concurrency: int, stop: threading.Event, max_tokens: int, out: list[Stream],
          lock: threading.Lock) -> None:
    """A closed loop of `concurrency` clients, each sending streams back to back until `stop` is set."""

    def client() -> None:
        while not stop.is_set():
            stream(url, "burst", max_tokens, out, lock)

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


# --- observation ------------------------------------------------------------------------------------------------


@dataclass
class Sample:
    t: float
    target: int
    replicas: dict[str, tuple[str, str | None]]  # replica id -> (state, node id)
    nodes: set[str]  # alive worker nodes (those offering llm_replica)
    served: list[int] | None  # generation tokens of each running replica (a broadcast), None if it failed
    # replica id -> (generation tokens, requests running + waiting), when the broadcasts' order held
    by_replica: dict[str, tuple[int, int]] = field(default_factory=dict)


class Poller(threading.Thread):
    def __init__(self, period_s: float) -> None:
        super().__init__(daemon=True)
        self.period_s = period_s
        self.samples: list[Sample] = []
        self.stopping = threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self.samples.append(sample())
            except Exception as e:  # noqa: BLE001 - keep observing; listed in the results
                self.errors.append(repr(e)[:200])
            self.stopping.wait(self.period_s)

    def stop(self) -> None:
        self.stopping.set()
        self.join()


def sample() -> Sample:
    import ray
    from ray import serve
    from ray.serve.context import _get_global_client

    now = time.time()
    details = _get_global_client().get_serve_details()
    deployment = details["applications"][APP]["deployments"]["LLMServer"]
    replicas = {r["replica_id"]: (str(getattr(r["state"], "value", r["state"])), r.get("node_id"))
                for r in deployment["replicas"]}
    nodes = {n["NodeID"] for n in ray.nodes() if n.get("Alive") and n["Resources"].get(REPLICA_RESOURCE)}
    served, by_replica = None, {}
    try:
        handle = serve.get_deployment_handle("LLMServer", app_name=APP)
        ids = handle.broadcast("identity").results(timeout_s=5)
        stats = handle.broadcast("stats").results(timeout_s=5)
        served = [s.generation_tokens for s in stats]
        if handle.broadcast("identity").results(timeout_s=5) == ids and len(ids) == len(stats):
            # the same order before and after (a broadcast lists replicas in the router's order): the pairs hold
            by_replica = {i: (s.generation_tokens, s.num_running + s.num_waiting) for i, s in zip(ids, stats)}
    except Exception:  # noqa: BLE001 - a replica stopping mid-broadcast; the next poll tries again
        pass
    return Sample(now, deployment["target_num_replicas"], replicas, nodes, served, by_replica)


def new_replica_served(s: Sample, base_replicas: set[str]) -> bool:
    """A replica that was not there at the start has made tokens: by its id where the broadcasts' answers could be
    paired with ids; else, as every replica's generation tokens start at 0, once more replicas than at the start
    have all made some."""
    if any(made > 0 and rid not in base_replicas for rid, (made, _) in s.by_replica.items()):
        return True
    return s.served is not None and len(s.served) > len(base_replicas) and min(s.served) > 0


@dataclass
class Event:
    name: str
    t: float | None  # seconds from the burst's start; None: not seen
    detail: str = ""


def short(node_id: str | None) -> str:
    return "-" if node_id is None else node_id[-5:] if node_id.startswith("fffff") else node_id[:8]


def timeline(samples: list[Sample], t0: float, stop_sending: float, burst_end: float, tail_end: float) -> list[Event]:
    before = [s for s in samples if s.t <= t0] or samples[:1]
    base = before[-1]
    after = [s for s in samples if s.t > t0]
    base_replicas, base_nodes = set(base.replicas), set(base.nodes)

    def first(pred, among=after):
        return next((s for s in among if pred(s)), None)

    def at(s: Sample | None) -> float | None:
        return None if s is None else s.t - t0

    events = [Event("burst start", 0.0, f"target {base.target}, replicas {len(base_replicas)}, worker nodes "
                                        f"{len(base_nodes)}")]
    up = first(lambda s: s.target > base.target)
    events.append(Event("autoscaler raises the replica target", at(up),
                        f"target {base.target} -> {up.target}" if up else ""))
    pending = first(lambda s: any(r not in base_replicas for r in s.replicas))
    new_id = next((r for r in pending.replicas if r not in base_replicas), None) if pending else None
    events.append(Event("new replica created, pending (no node offers it resources)", at(pending),
                        f"replica {new_id} {pending.replicas[new_id][0]}" if pending else ""))
    node_up = first(lambda s: s.nodes - base_nodes)
    events.append(Event("node up (Ray autoscaler added a worker node)", at(node_up),
                        f"node {', '.join(short(n) for n in sorted(node_up.nodes - base_nodes))}" if node_up else ""))
    ready = first(lambda s: any(r not in base_replicas and st == "RUNNING" for r, (st, _) in s.replicas.items()))
    ready_id = next((r for r, (st, _) in ready.replicas.items() if r not in base_replicas and st == "RUNNING"),
                    None) if ready else None
    events.append(Event("new replica RUNNING", at(ready),
                        f"replica {ready_id} on node {short(ready.replicas[ready_id][1])}" if ready else ""))
    served = first(lambda s: new_replica_served(s, base_replicas))
    events.append(Event("first request served by the new replica", at(served),
                        f"tokens per replica {sorted(served.served)}" if served else ""))
    events.append(Event("burst stops sending; tail streams sent", stop_sending - t0, ""))
    events.append(Event("burst end (last burst stream done)", burst_end - t0, ""))
    # The first scale-down after the scale-up (later ones, if the target moved again, are in "every change").
    peak_target = max((s.target for s in after), default=base.target)
    down = first(lambda s: s.t >= (up.t if up else t0) and s.target < peak_target)
    events.append(Event("autoscaler lowers the replica target", at(down),
                        f"target {peak_target} -> {down.target}" if down else ""))
    later = [s for s in after if down and s.t >= down.t]
    stopping = first(lambda s: any(st == "STOPPING" for st, _ in s.replicas.values()), later)
    stop_id = next((r for r, (st, _) in stopping.replicas.items() if st == "STOPPING"), None) if stopping else None
    if stop_id is not None:
        # Its streams as last seen before it stopped taking requests.
        seen = [s.by_replica[stop_id][1] for s in after if s.t <= stopping.t and stop_id in s.by_replica]
        in_flight = f", {seen[-1]} streams in flight when last seen running" if seen else ""
        events.append(Event("replica STOPPING (draining its streams)", at(stopping),
                            f"replica {stop_id} on node {short(stopping.replicas[stop_id][1])}{in_flight}"))
    events.append(Event("last tail stream done", tail_end - t0 if tail_end else None, ""))
    # The replica that left: the one seen STOPPING, else the first of those present at the decision to vanish.
    stopped, gone_id = None, stop_id
    for prev, s in zip(later, later[1:]):
        vanished = [r for r in prev.replicas if r not in s.replicas]
        if (stop_id is None and vanished) or (stop_id is not None and stop_id in vanished):
            stopped, gone_id = s, stop_id or vanished[0]
            break
    if stop_id is None and stopped is not None:
        events.append(Event("replica STOPPING (draining its streams)", None, f"replica {gone_id}: no poll saw it "
                                                                             "STOPPING"))
    events.append(Event("replica stopped (gone from the deployment)", at(stopped),
                        f"replica {gone_id}" if stopped else ""))
    removed = gone_nodes = None
    for prev, s in zip(later, later[1:]):
        if prev.nodes - s.nodes:
            removed, gone_nodes = s, sorted(prev.nodes - s.nodes)
            break
    events.append(Event("node removed (Ray autoscaler, idle timeout)", at(removed),
                        f"node {', '.join(short(n) for n in gone_nodes)}" if removed else ""))
    return sorted(events, key=lambda e: float("inf") if e.t is None else e.t)


def usage(samples: list[Sample], t0: float, t1: float) -> tuple[float, float, int, int]:
    """(replica-seconds, node-seconds, peak replicas, peak nodes) over [t0, t1], step-wise between polls."""
    inside = [s for s in samples if t0 <= s.t <= t1]
    replica_s = node_s = 0.0
    for a, b in zip(inside, inside[1:]):
        held = sum(st in ("RUNNING", "STOPPING") for st, _ in a.replicas.values())
        replica_s += held * (b.t - a.t)
        node_s += len(a.nodes) * (b.t - a.t)
    peak_replicas = max((sum(st in ("RUNNING", "STOPPING") for st, _ in s.replicas.values()) for s in inside),
                        default=0)
    return replica_s, node_s, peak_replicas, max((len(s.nodes) for s in inside), default=0)


def wait_until(predicate, timeout_s: float, period_s: float = 0.5) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(period_s)
    return False


# --- the run ----------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> str:
    import ray
    from ray import serve

    from serve_app.app import build_app

    cluster = make_cluster(args.max_replicas, args.idle_timeout_min)
    print("starting the fake multi-node cluster (ray stop --force first) ...", flush=True)
    cluster.start()
    session_name = None
    try:
        ray.init(address="auto", log_to_driver=False, configure_logging=False)
        session_name = ray._private.worker.global_worker.node.session_name
        serve.start(http_options={"location": "HeadOnly", "host": "127.0.0.1", "port": args.port})
        url = f"http://127.0.0.1:{args.port}"
        deploy_start = time.time()
        serve.run(build_app(app_args(args.max_replicas, args.min_replicas, args.downscale_delay_s)), name=APP,
                  route_prefix="/")
        deploy_s = time.time() - deploy_start
        print(f"app deployed in {deploy_s:.1f} s (its first replica waited for a node of its own)", flush=True)
        streams: list[Stream] = []
        lock = threading.Lock()
        # A first request outside the measurement: an engine's first steps are slow, and its stats (what the
        # policy reads) only move once the engine process answers.
        warm: list[Stream] = []
        stream(url, "warm-up", 16, warm, lock)
        if not warm[0].whole:
            raise RuntimeError(f"the warm-up request failed: {warm[0]}")
        poller = Poller(args.poll_s)
        poller.start()
        wait_until(lambda: len(poller.samples) >= 2, 30)
        base_replicas = set(poller.samples[-1].replicas)
        t0 = time.time()
        print(f"burst: {args.concurrency} clients of {args.burst_tokens}-token streams, for at least "
              f"{args.burst_s:.0f} s and until a new replica served for {args.hold_s:.0f} s "
              f"(at most {args.max_burst_s:.0f} s)", flush=True)
        stop = threading.Event()
        loader = threading.Thread(target=burst, args=(url, args.concurrency, stop, args.burst_tokens, streams, lock))
        loader.start()
        time.sleep(args.burst_s)
        grown = wait_until(lambda: any(new_replica_served(s, base_replicas) for s in poller.samples[-4:]),
                           max(0.0, t0 + args.max_burst_s - args.hold_s - time.time()))
        if grown:
            time.sleep(args.hold_s)
        # The tail: long streams sent as the burst stops sending, still running while the app scales back down.
        tails = [threading.Thread(target=stream, args=(url, "tail", args.tail_tokens, streams, lock))
                 for _ in range(args.tail_streams)]
        for t in tails:
            t.start()
        stop.set()
        stop_sending = time.time()
        loader.join()
        burst_end = max((s.end for s in streams if s.kind == "burst"), default=time.time())
        print(f"burst done at {burst_end - t0:.1f} s (a new replica served: {grown}); waiting for the scale-down",
              flush=True)
        for t in tails:
            t.join()
        tail_end = max((s.end for s in streams if s.kind == "tail"), default=0.0)

        def settled() -> bool:
            s = poller.samples[-1]
            return (s.target == args.min_replicas and len(s.replicas) == args.min_replicas
                    and len(s.nodes) == args.min_replicas)

        wait_until(settled, args.settle_timeout_s)
        time.sleep(2 * args.poll_s)
        poller.stop()
        t_end = time.time()
        return report(args, poller, streams, t0, stop_sending, burst_end, tail_end, t_end, deploy_s)
    finally:
        try:
            serve.shutdown()
            ray.shutdown()
        except Exception as e:  # noqa: BLE001 - the cluster is stopped below either way
            print(f"serve/ray shutdown: {e!r}", flush=True)
        print(f"stopping the cluster ({session_name or 'ray stop --force'}) ...", flush=True)
        cluster.shutdown(session_name)


def report(args, poller: Poller, streams: list[Stream], t0: float, stop_sending: float, burst_end: float,
           tail_end: float, t_end: float, deploy_s: float) -> str:
    samples = poller.samples
    events = timeline(samples, t0, stop_sending, burst_end, tail_end)
    replica_s, node_s, peak_replicas, peak_nodes = usage(samples, t0, t_end)
    span = t_end - t0
    lines = ["| event | s from burst start | detail |", "|---|---:|---|"]
    lines += [f"| {e.name} | {'not seen' if e.t is None else f'{e.t:.1f}'} | {e.detail} |" for e in events]
    # Where each replica ran, and its tokens as last seen (a broadcast whose order held).
    placed: dict[str, tuple[str | None, float, float, str]] = {}
    tokens: dict[str, int] = {}
    for s in samples:
        for rid, (state, node) in s.replicas.items():
            node0, first, _, _ = placed.get(rid, (node, s.t, s.t, state))
            placed[rid] = (node or node0, first, s.t, state)
        tokens.update({rid: made for rid, (made, _) in s.by_replica.items()})
    mapping = ["| replica | node | first seen (s) | last seen (s) | last state | tokens made (last seen) |",
               "|---|---|---:|---:|---|---:|"]
    mapping += [f"| {rid} | {short(node)} | {first - t0:.1f} | {last - t0:.1f} | {state} | {tokens.get(rid, '-')} |"
                for rid, (node, first, last, state) in sorted(placed.items(), key=lambda kv: kv[1][1])]
    changes, target = [], samples[0].target if samples else 0
    for s in samples:
        if s.target != target:
            changes.append(f"{target} -> {s.target} at {s.t - t0:.1f} s")
            target = s.target
    bursts = [s for s in streams if s.kind == "burst"]
    tails_ = [s for s in streams if s.kind == "tail"]
    cut = [s for s in streams if not s.whole]
    ok = "yes" if not cut else f"NO: {len(cut)} cut or failed"
    out = [
        "# benchmarks/scale_out.py",
        "",
        f"Command: `{' '.join(['python', 'benchmarks/scale_out.py', *sys.argv[1:]])}`, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(t0))}.",
        f"Host: {os.cpu_count()} CPUs. The cluster is Ray's autoscaling test harness (AutoscalingCluster, fake "
        "multi-node provider): the head and every worker node are processes on this one machine and share its "
        "cores, so only the orderings and the timeline's shape mean something, not the absolute figures.",
        "",
        f"Cluster: head {{CPU: 1, {HEAD_RESOURCE}: 1}} (controller, HTTP proxy actor, ingress); worker nodes "
        f"{{CPU: 1, {REPLICA_RESOURCE}: 1}}, 80 MiB object stores, min 0 / max {args.max_replicas}, idle timeout "
        f"{args.idle_timeout_min * 60:.0f} s. App: pagedserve-tiny, engine replicas asking {{num_cpus: 0, "
        f"{REPLICA_RESOURCE}: 1}} (one per node), {args.min_replicas} to {args.max_replicas} replicas, "
        f"KVQueueAutoscalingPolicy (target_waiting_per_replica 1, downscale_delay_s {args.downscale_delay_s:g}), "
        f"engine {json.dumps(ENGINE)}. Deploying took {deploy_s:.1f} s (its first replica waited for a node too).",
        f"Load: after one warm-up request, {args.concurrency} closed-loop clients sending {args.burst_tokens}-token "
        f"streams (ignore_eos) for at least {args.burst_s:g} s and until a new replica had served for "
        f"{args.hold_s:g} s, then {args.tail_streams} {args.tail_tokens}-token tail streams running through the "
        f"scale-down. Polled every {args.poll_s:g} s: an event's time is the first poll that saw it.",
        "",
        *lines,
        "",
        *mapping,
        "",
        f"Over the run ({span:.0f} s from the burst's start to the end of the scale-down): "
        f"{replica_s:.0f} replica-seconds and {node_s:.0f} worker-node-seconds, against "
        f"{peak_replicas * span:.0f} and {peak_nodes * span:.0f} had the peak ({peak_replicas} replicas, "
        f"{peak_nodes} nodes) been held throughout.",
        f"Every change of the replica target: {'; '.join(changes) or 'none'}.",
        f"Streams: {len(bursts)} burst + {len(tails_)} tail; every one finished with finish_reason \"length\", its "
        f"full token count and no error event: {ok}.",
    ]
    for s in cut[:10]:
        out.append(f"- {s.kind} stream: status {s.status}, tokens {s.tokens}/{s.max_tokens}, finish {s.finish}, "
                   f"error {s.error}")
    if poller.errors:
        out.append(f"Polls that failed: {len(poller.errors)} (first: {poller.errors[0]})")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--burst-s", type=float, default=20.0, help="least seconds the burst's clients keep sending")
    ap.add_argument("--hold-s", type=float, default=5.0,
                    help="...and then until a new replica has served for this long")
    ap.add_argument("--max-burst-s", type=float, default=240.0, help="most seconds of burst, replica or not")
    ap.add_argument("--concurrency", type=int, default=8, help="closed-loop clients in the burst")
    ap.add_argument("--burst-tokens", type=int, default=200, help="output tokens of each burst stream")
    ap.add_argument("--tail-streams", type=int, default=2, help="long streams sent as the burst stops")
    ap.add_argument("--tail-tokens", type=int, default=4000, help="output tokens of each tail stream")
    ap.add_argument("--min-replicas", type=int, default=1)
    ap.add_argument("--max-replicas", type=int, default=2, help="also the worker nodes' max_workers")
    ap.add_argument("--downscale-delay-s", type=float, default=25.0, help="the policy's downscale_delay_s")
    ap.add_argument("--idle-timeout-min", type=float, default=0.1, help="the autoscaler's idle_timeout_minutes")
    ap.add_argument("--settle-timeout-s", type=float, default=150.0, help="longest wait for the scale-down")
    ap.add_argument("--poll-s", type=float, default=0.5)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--kill-running-ray", action="store_true",
                    help="start even though Ray processes are running here: `ray stop --force` kills them")
    args = ap.parse_args()
    running = running_ray_processes()
    if running and not args.kill_running_ray:
        sys.exit(f"Ray is running on this machine ({', '.join(running[:4])}); this benchmark's `ray stop --force` "
                 "would kill it. Stop it first, or pass --kill-running-ray.")
    # Every Ray process the cluster starts (head, worker nodes started by the autoscaler's monitor, replica
    # workers) inherits this environment: the repository on the import path, the `ray` CLI of this Python.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    text = run(args)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"saved to {args.out}")


if __name__ == "__main__":
    main()
