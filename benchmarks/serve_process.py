"""The app as `make run` starts it, for benchmarks: `serve run <config>` in a process of its own (a fresh
local Ray: RAY_ADDRESS=local), HTTP through HAProxy (serve_app/serve_env.py), at a port of our choosing.
The client then runs in another process, as a real one would.

    with serve_run(load_config("configs/bench-56m.yaml"), port=8300) as app:
        ...  # app.url; app.cpu_seconds() by role"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]

# Which app process a command line belongs to (Ray names replica workers after their deployment).
_ROLES = {"haproxy": "haproxy", "OpenAIIngress": "ingress", "LLMServer": "replica"}


def role(process) -> str | None:
    """A process's role by its command line; the engine replica's descendants (its engine process, started
    through a fork server, and that server) are the engine core; None for Ray's own."""
    found = next((r for key, r in _ROLES.items() if key in " ".join(process.cmdline())), None)
    if found is None and any("LLMServer" in " ".join(a.cmdline()) for a in process.parents()):
        found = "engine core"
    return found


def load_config(path: str | Path) -> dict:
    return yaml.safe_load(Path(path).read_text())


def with_args(config: dict, **args) -> dict:
    """`config` with its first application's `args` updated (a shallow merge; `engine` merged too)."""
    config = {**config, "applications": [dict(a) for a in config["applications"]]}
    app = config["applications"][0]
    merged = {**app.get("args", {}), **args}
    if "engine" in args:
        merged["engine"] = {**app.get("args", {}).get("engine", {}), **args["engine"]}
    app["args"] = merged
    return config


@dataclass
class ServeApp:
    url: str
    process: subprocess.Popen
    # A server that is not ours (vLLM's): the role of the process started (None: not counted, as `serve run`'s
    # driver, which waits) and of everything it starts (None: by `role`).
    root_role: str | None = None
    child_role: str | None = None

    def cpu_seconds(self, role_of=None) -> dict[str, float]:
        """CPU time used so far by the app's processes, by role: haproxy, ingress, replica (the engine
        replica's actor), engine core (its step-loop process), other (Ray's own: raylet, GCS, controller);
        `role_of(process)`: another split of the processes `role` leaves out (None: "other")."""
        import psutil

        total: dict[str, float] = {}
        try:
            root = psutil.Process(self.process.pid)
            procs = [(p, self.child_role) for p in root.children(recursive=True)]
        except psutil.Error:
            return total
        if self.root_role:
            procs.append((root, self.root_role))
        for p, known_role in procs:
            try:
                kind = known_role or role(p) or (role_of(p) if role_of else None) or "other"
                t = p.cpu_times()
                total[kind] = total.get(kind, 0.0) + t.user + t.system
            except psutil.Error:
                pass
        return total

    def pids(self) -> dict[str, list[int]]:
        """Process ids by role (for profilers)."""
        import psutil

        out: dict[str, list[int]] = {}
        for p in psutil.Process(self.process.pid).children(recursive=True):
            try:
                kind = role(p)
                if kind is not None:
                    out.setdefault(kind, []).append(p.pid)
            except psutil.Error:
                pass
        return out


def serve_env(extra: dict[str, str] | None = None, base: dict[str, str] | None = None) -> dict[str, str]:
    from serve_app.serve_env import SERVE_ENV

    base = SERVE_ENV if base is None else base
    return {**os.environ, **base, "RAY_ADDRESS": "local", **(extra or {})}  # a fresh local Ray, never another's


@contextmanager
def serve_run(config: dict, port: int, ready_timeout_s: float = 300, log: Path | None = None,
              env: dict[str, str] | None = None, root: Path = ROOT,
              base_env: dict[str, str] | None = None) -> Iterator[ServeApp]:
    """`serve run` of `config` (with its HTTP port set to `port`), up and healthy; stopped with SIGTERM.
    `env`: more variables for every Ray process (Serve's flags, for experiments). `root`: the checkout
    whose code serves (another one's, to compare with a baseline), with `base_env` instead of SERVE_ENV."""
    with socket.socket() as probe:  # another app on this port would answer our health checks and requests
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            raise RuntimeError(f"port {port} is already in use; pick another (--port)")
    config = {**config, "http_options": {**config.get("http_options", {}), "host": "127.0.0.1", "port": port}}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", prefix="pagedserve-bench-", delete=False) as f:
        yaml.safe_dump(config, f)
    serve_bin = Path(sys.executable).parent / "serve"
    # HAProxy's stats and metrics ports are fixed unless set: never collide with another app on this machine.
    env = {"RAY_SERVE_HAPROXY_STATS_PORT": str(port + 1404), "RAY_SERVE_HAPROXY_METRICS_PORT": str(port + 2101),
           **(env or {})}
    try:
        with server_process([str(serve_bin), "run", f.name], f"http://127.0.0.1:{port}", "serve run", root,
                            serve_env(env, base_env), ready_timeout_s, log) as app:
            yield app
    finally:
        os.unlink(f.name)


@contextmanager
def server_process(cmd: list[str], url: str, what: str, cwd: Path | str, env: dict[str, str],
                   ready_timeout_s: float, log: Path | None = None, root_role: str | None = None,
                   child_role: str | None = None) -> Iterator[ServeApp]:
    """`cmd` as an HTTP server in a session of its own (its output to `log`), up once `url`/health answers;
    stopped, with whatever it started, on exit. `what` names it in errors; the roles: ServeApp's."""
    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, url, ready_timeout_s, what + (f" (see {log})" if log else ""))
        yield ServeApp(url, proc, root_role, child_role)
    finally:
        stop(proc)
        if log:
            out.close()


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    """Until `url`/health answers 200; raises when the server process `proc` (named `what`) exits first or
    `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}) before it was healthy")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not become healthy within {timeout_s:.0f} s")
        time.sleep(poll_s)


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of its own Ray is left (raylet, workers, haproxy)
    except ProcessLookupError:
        pass
    proc.wait()
