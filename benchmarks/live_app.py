"""A live app for the reliability benchmarks (fuzz.py, soak.py) and their CI versions: Ray started here
with the app deployed (the built-in tiny model), and what their invariants read from it: which Serve
replicas are alive (a restart shows as a new actor), the engine replicas' load and memory."""

from __future__ import annotations

from dataclasses import dataclass

APP = "pagedserve"


def start(port: int, engine: dict, num_replicas: int = 2) -> str:
    """Ray on this machine's CPUs and the app at http://127.0.0.1:`port`; returns the base URL."""
    import ray
    from ray import serve

    from serve_app.app import build_app
    from serve_app.app_args import AppArgs

    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(AppArgs(model="pagedserve-tiny", num_replicas=num_replicas, engine=engine)),
              name=APP, route_prefix="/")
    return f"http://127.0.0.1:{port}"


def stop() -> None:
    import ray
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@dataclass(frozen=True)
class Replica:
    actor_id: str
    deployment: str
    replica_id: str  # Serve's, as LLMServer.identity() reports it
    state: str  # ALIVE, DEAD, ...
    pid: int


def replicas(app: str = APP) -> list[Replica]:
    """Every Serve replica actor of `app` this Ray instance has known, dead ones included. Read from the
    GCS actor table, which needs no dashboard (the shared test session runs without one)."""
    from ray._private import state

    prefix = f"ServeReplica:{app}:"
    return [Replica(actor_id, info["ActorClassName"].removeprefix(prefix), info["Name"].rsplit("#", 1)[-1],
                    info["State"], info["Pid"])
            for actor_id, info in state.actors().items() if info["ActorClassName"].startswith(prefix)]


def restarts(before: list[Replica], after: list[Replica]) -> list[str]:
    """What changed between two snapshots: replicas that died and replicas that appeared."""
    alive_before = {r.actor_id for r in before if r.state == "ALIVE"}
    alive_after = {r.actor_id for r in after if r.state == "ALIVE"}
    return ([f"{r.deployment} {r.replica_id} died" for r in after if r.actor_id in alive_before - alive_after]
            + [f"{r.deployment} {r.replica_id} appeared" for r in after if r.actor_id in alive_after - alive_before])


@dataclass(frozen=True)
class EngineLoad:
    replica_id: str
    kv_cache_usage: float
    num_running: int
    num_waiting: int
    num_in_flight: int  # streams the replica's AsyncLLM still holds

    @property
    def idle(self) -> bool:
        return self.kv_cache_usage == 0 and self.num_running == self.num_waiting == self.num_in_flight == 0


def engine_loads(app: str = APP) -> list[EngineLoad]:
    """Each engine replica's load. A broadcast lists replicas in the router's order, which holds while
    the replica set does: identities read before and after the other calls confirm it."""
    from ray import serve

    handle = serve.get_deployment_handle("LLMServer", app_name=app)
    while True:
        ids = handle.broadcast("identity").results()
        stats = handle.broadcast("stats").results()
        in_flight = handle.broadcast("num_in_flight").results()
        if handle.broadcast("identity").results() == ids:
            return [EngineLoad(i, s.kv_cache_usage, s.num_running, s.num_waiting, f)
                    for i, s, f in zip(ids, stats, in_flight)]


def engine_rss(app: str = APP) -> dict[str, int]:
    """Resident memory of each live engine replica (replica id -> bytes): the replica process and its
    children (the engine-core process)."""
    import psutil  # Ray ships it (ray/thirdparty_files, on sys.path once ray is imported)

    rss = {}
    for r in replicas(app):
        if r.deployment == "LLMServer" and r.state == "ALIVE":
            process = psutil.Process(r.pid)
            rss[r.replica_id] = process.memory_info().rss + sum(
                c.memory_info().rss for c in process.children(recursive=True))
    return rss


@dataclass(frozen=True)
class ServeProcess:
    """A process of the app whose memory the soak follows: "ingress ab12cd34", "engine ab12cd34" (an engine
    replica's actor process), "core ab12cd34" (its engine-core child), "proxy" (Ray's HTTP proxy)."""

    name: str
    pid: int


def serve_processes(app: str = APP) -> list[ServeProcess]:
    """The live replica processes of `app` (ingress and engine replicas), each engine replica's children
    (the engine-core process; not multiprocessing's resource tracker), and Ray's HTTP proxy actor if one
    serves the app (HAProxy may instead)."""
    import psutil
    from ray._private import state

    processes = []
    for r in sorted(replicas(app), key=lambda r: (r.deployment, r.replica_id)):
        if r.state != "ALIVE":
            continue
        if r.deployment == "OpenAIIngress":
            processes.append(ServeProcess(f"ingress {r.replica_id}", r.pid))
            continue
        processes.append(ServeProcess(f"engine {r.replica_id}", r.pid))
        children = [c for c in psutil.Process(r.pid).children(recursive=True)
                    if not any("resource_tracker" in arg for arg in c.cmdline())]
        processes += [ServeProcess(f"core{'' if i == 0 else i} {r.replica_id}", c.pid) for i, c in enumerate(children)]
    processes += [ServeProcess("proxy", info["Pid"]) for info in state.actors().values()
                  if info["ActorClassName"] == "ProxyActor" and info["State"] == "ALIVE"]
    return processes


def process_rss(processes: list[ServeProcess]) -> dict[str, int]:
    """Resident memory (bytes) of each process still running."""
    import psutil

    rss = {}
    for p in processes:
        try:
            rss[p.name] = psutil.Process(p.pid).memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return rss
