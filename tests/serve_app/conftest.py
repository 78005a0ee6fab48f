"""One Ray instance and one running app for the whole test session (starting Serve costs seconds).

`serve_app_url` is the base URL of the default app (2 engine replicas of the tiny model, exporting spans to
`span_receiver`). Tests that need a different configuration deploy their own app under another name and route
prefix with `deploy_app`, on the same Ray instance."""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

import pytest

APP = "pagedserve"
ENGINE = {"max_model_len": 1024, "num_kv_blocks": 512, "num_threads": 1}
SMALL_APP = "small"
SMALL_APP_KEYS = ("key-one", "key-two")
HTTP_PORT = int(os.environ.get("PAGEDSERVE_TEST_HTTP_PORT", "8000"))
BASE_URL = f"http://127.0.0.1:{HTTP_PORT}"
# HAProxy's stats and metrics ports are fixed (8404, 9101) unless set: two apps behind HAProxy on one machine
# (the suite and a developer's `make run`, two test sessions) would collide. Derive them from HTTP_PORT.
HAPROXY_PORTS_ENV = {"RAY_SERVE_HAPROXY_STATS_PORT": str(HTTP_PORT + 1404),
                     "RAY_SERVE_HAPROXY_METRICS_PORT": str(HTTP_PORT + 2101)}
# How HTTP reaches the app: "haproxy" as `make run` serves it (serve_app/serve_env.py), or
# "proxy", Ray's proxy actor, as a plain `serve run` does. `make test` runs the HTTP tests in both.
INGRESS = os.environ.get("PAGEDSERVE_TEST_INGRESS", "haproxy")
if INGRESS not in ("haproxy", "proxy"):
    raise ValueError(f"PAGEDSERVE_TEST_INGRESS={INGRESS!r}: use haproxy or proxy")


def pytest_collection_modifyitems(items):
    # Tests that start their own Ray (serve run in a subprocess) must run before the shared instance exists;
    # tests that kill or stop an app other tests share run after everything else.
    items.sort(key=lambda item: 0 if item.get_closest_marker("own_ray") else
               2 if item.get_closest_marker("runs_last") else 1)


def pytest_configure(config):
    config.addinivalue_line("markers", "own_ray: runs its own Ray, before the shared session instance starts")
    config.addinivalue_line("markers", "runs_last: kills or stops an app that other tests share; runs after them")


@pytest.fixture(scope="session")
def span_receiver():
    """Where the session app exports its spans (tests/serve_app/test_tracing_e2e.py reads them)."""
    from benchmarks.otlp_receiver import OTLPReceiver

    receiver = OTLPReceiver()
    yield receiver
    receiver.stop()


@pytest.fixture(scope="session")
def ray_session(span_receiver):  # the receiver first: it stops after Serve, whose replicas flush their spans to it
    import ray
    from ray import serve

    from serve_app.serve_env import SERVE_ENV

    if INGRESS == "haproxy":
        os.environ.update({**SERVE_ENV, **HAPROXY_PORTS_ENV})
    # A Ray of its own even where another session's cluster runs on this host (ray.init() would join the one
    # ray.cluster_utils last started); metrics reach Prometheus every 2 s instead of 10 (test_metrics.py waits)
    for attempt in (1, 2):
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     configure_logging=False, _system_config={"metrics_report_interval_ms": 2000})
            break
        except Exception as e:  # noqa: BLE001 - Ray raises a bare Exception
            # Once in a suite run (2026-12-07), after the tests that run their own Ray, this Ray's raylet never
            # reached its main and ray.init gave up after 30 s; the next start worked. Started again once, said.
            if attempt == 2 or "timed out during startup" not in str(e):
                raise
            warnings.warn(f"ray.init failed ({e}); starting Ray again", stacklevel=1)
    serve.start(http_options={"host": "127.0.0.1", "port": HTTP_PORT})
    yield
    serve.shutdown()
    ray.shutdown()


_deleting: set[str] = set()  # apps delete_app() is deleting


def delete_app(name: str) -> None:
    """Delete an app without waiting the ~3 s its replicas take to stop: they stop while the next module deploys
    its own app; a test that deploys none waits for them first (`_no_app_deleting`)."""
    from ray import serve

    serve.delete(name, _blocking=False)
    _deleting.add(name)


def _wait_deleted() -> None:
    if _deleting:
        from ray import serve

        wait_for(lambda: not _deleting & set(serve.status().applications), timeout=60)
        _deleting.clear()


@pytest.fixture(autouse=True)
def _no_app_deleting():
    """No test starts while an app is being deleted (after any app of its module is up): the stopping replicas
    would share the 2 cores, Ray's processes and /dev/shm with it."""
    _wait_deleted()


def run_apps(targets: list) -> None:
    """serve.run_many(targets), blocking until the apps run and the proxies serve them, but polling every 0.1 s
    where Serve polls every second (~0.5 s a deploy)."""
    from ray import serve
    from ray.serve.context import _get_global_client

    serve.run_many(targets, wait_for_applications_running=False)

    def running() -> bool:
        apps = serve.status().applications
        failed = [f"{t.name}: {apps[t.name].message}" for t in targets if apps[t.name].status == "DEPLOY_FAILED"]
        if failed:
            raise RuntimeError(f"deploying failed: {failed}")
        return all(apps[t.name].status == "RUNNING" for t in targets)

    wait_for(running, timeout=600)
    _get_global_client().wait_for_proxies_serving()


@pytest.fixture(scope="session")
def deploy_apps(ray_session):
    """deploy_apps({name: (route_prefix, AppArgs fields)}) -> {name: base URL}; each configuration is deployed
    once, those not up yet side by side (their replicas start together: ~30% less time than one after the other
    on 2 cores)."""
    from ray import serve

    from serve_app.app import build_app
    from serve_app.app_args import AppArgs

    deployed: dict[str, str] = {}

    def deploy(apps: dict[str, tuple[str, dict]]) -> dict[str, str]:
        if _deleting & set(apps):
            _wait_deleted()
        running = serve.status().applications
        targets = []
        for name, (route_prefix, args) in apps.items():
            if name not in deployed or name not in running:  # new, or deleted by a test
                # The suite's apps keep the ingress deployment unless a test asks for direct streaming (the
                # default where it can be: test_direct_streaming.py serves it)
                args = {"engine": ENGINE, "direct_streaming": False, **args}
                targets.append(serve.RunTarget(build_app(AppArgs(**args)), name=name, route_prefix=route_prefix))
                deployed[name] = BASE_URL + route_prefix.rstrip("/")
        if targets:
            run_apps(targets)
        return {name: deployed[name] for name in apps}

    return deploy


@pytest.fixture(scope="session")
def deploy_app(deploy_apps):
    """deploy_app(name, route_prefix, **AppArgs fields) -> base URL; each configuration is deployed once."""
    return lambda name, route_prefix, **args: deploy_apps({name: (route_prefix, args)})[name]


@pytest.fixture(scope="session")
def serve_app_url(deploy_app, span_receiver) -> str:
    # Tracing on (spans exported every 100 ms): test_tracing_e2e.py checks them here rather than on an app of its own
    return deploy_app(APP, "/", model="pagedserve-tiny", num_replicas=2, tracing={
        "exporter": "otlp", "protocol": "http/protobuf", "endpoint": span_receiver.endpoint, "export_interval_ms": 100})


@dataclass
class SmallApp:
    url: str
    receiver: object  # benchmarks.otlp_receiver.OTLPReceiver
    auth: dict[str, str]
    deployed_at: float  # time.monotonic()


@pytest.fixture(scope="session")
def small_app(deploy_app):
    """One one-replica app for the checks that need settings of their own (each app deployed costs 15-25 s
    on 2 cores), chosen so that they do not get in each other's way: two API keys; one running request and
    one queued (the overload check); every stream paced as on a saturated CPU (utilization threshold 0, 0.25 s
    rests); spans exported to `receiver` only once an hour, so that they are still queued when the app is
    stopped, which the test that stops it (marked `runs_last`) checks; the deepseek_r1 reasoning parser (its
    chats, messages and responses: tests/serve_app/test_reasoning_parsers.py; the other checks send completions,
    which it leaves alone) and room for an Anthropic thinking budget of 1024 tokens."""
    from benchmarks.otlp_receiver import OTLPReceiver

    receiver = OTLPReceiver()
    url = deploy_app(SMALL_APP, "/small", num_replicas=1, api_keys=list(SMALL_APP_KEYS), reasoning_parser="deepseek_r1",
                     engine={**ENGINE, "max_model_len": 1536, "max_num_seqs": 1, "max_waiting_requests": 1},
                     stream_coalesce_cpu_utilization=0.0, stream_coalesce_interval_s=0.25,
                     tracing={"exporter": "otlp", "protocol": "http/protobuf", "endpoint": receiver.endpoint,
                              "export_interval_ms": 3_600_000})
    yield SmallApp(url, receiver, {"Authorization": f"Bearer {SMALL_APP_KEYS[0]}"}, time.monotonic())
    from ray import serve

    if SMALL_APP in serve.status().applications:  # still up where its runs_last test did not run: its queued
        serve.delete(SMALL_APP)  # spans go to the receiver now, not to a stopped one for ~20 s at serve.shutdown()
    receiver.stop()


@pytest.fixture(scope="session")
def engine_handle(serve_app_url):
    from ray import serve

    return serve.get_deployment_handle("LLMServer", app_name=APP)


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(interval)


def engine_idle(engine) -> bool:
    """No replica of `engine` (a DeploymentHandle to the engine deployment) runs, queues or holds KV."""
    stats = engine.broadcast("stats").results()
    return all(s.num_running == 0 and s.num_waiting == 0 and s.kv_cache_usage == 0 for s in stats)


def disconnect_mid_stream(base_url: str, engine) -> None:
    """A client reads a few events of a 900-token stream and goes away: whatever stands in front of the
    engine cancels the request, the replica aborts it well before its 900 tokens, and its KV blocks go back
    to the pool."""
    import httpx

    wait_for(lambda: engine_idle(engine))
    before = sum(s.generation_tokens for s in engine.broadcast("stats").results())
    body = {"prompt": "keep going", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        received = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: {") for line in received)
    wait_for(lambda: engine_idle(engine), timeout=20)
    assert sum(s.generation_tokens for s in engine.broadcast("stats").results()) - before < 900
