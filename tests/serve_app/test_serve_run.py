"""The README's run command (`make run`: `serve run configs/default.yaml` behind HAProxy) answers a chat
completion and exits cleanly on SIGTERM. It starts its own Ray, so it runs before the shared session
instance."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from serve_app.app import HAPROXY_INGRESS_ENV

ROOT = Path(__file__).resolve().parents[2]


def _ray_processes() -> int:
    out = subprocess.run(["pgrep", "-f", "raylet|gcs_server|haproxy"], capture_output=True, text=True).stdout
    return len(out.split())


@pytest.mark.own_ray
def test_serve_run_default_config():
    before = _ray_processes()
    serve_bin = Path(sys.executable).parent / "serve"
    env = {**os.environ, **HAPROXY_INGRESS_ENV, "RAY_ADDRESS": "local"}  # a fresh local Ray, never another's
    proc = subprocess.Popen([str(serve_bin), "run", "configs/default.yaml"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, proc.stdout.read().decode(errors="replace")[-3000:]
            try:
                if httpx.get("http://127.0.0.1:8000/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "serve run did not come up"
            time.sleep(0.5)
        r = httpx.post("http://127.0.0.1:8000/v1/chat/completions", timeout=60, json={
            "model": "pagedserve-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        proc.send_signal(signal.SIGTERM)
        # Ray's driver handles SIGTERM with sys.exit(15) after running its shutdown hooks.
        assert proc.wait(timeout=60) in (0, signal.SIGTERM)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    # Clean exit: nothing listens on the port any more, and no Ray process of its own is left.
    with pytest.raises(httpx.HTTPError):
        httpx.get("http://127.0.0.1:8000/health", timeout=2)
    deadline = time.monotonic() + 30
    while _ray_processes() > before:
        assert time.monotonic() < deadline, "Ray processes outlived serve run"
        time.sleep(0.5)
