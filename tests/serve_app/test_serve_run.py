"""The README's run command (`make run`: `python -m serve_app.run configs/default.yaml` behind HAProxy,
with the Makefile's SERVE_ENV) answers a chat completion, and Ctrl-C stops it after draining the streams in
flight, then as quickly as an idle app. The test starts its own Ray, so it runs before the shared session
instance. Ctrl-C is what a terminal sends: SIGINT to the whole foreground process group (Ray's own
processes block it and are stopped by serve_app/run.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import yaml

from serve_app.serve_env import SERVE_ENV
from tests.serve_app.conftest import HAPROXY_PORTS_ENV, HTTP_PORT

ROOT = Path(__file__).resolve().parents[2]
URL = f"http://127.0.0.1:{HTTP_PORT}"


def _ray_processes() -> int:
    out = subprocess.run(["pgrep", "-f", "raylet|gcs_server|haproxy"], capture_output=True, text=True).stdout
    return len(out.split())


@contextmanager
def _make_run(tmp_path: Path) -> Iterator[subprocess.Popen]:
    """configs/default.yaml served as `make run` serves it (its HTTP port is the suite's), up and healthy,
    in a process group of its own; killed if a test leaves it running."""
    config = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text())
    config["http_options"]["port"] = HTTP_PORT
    path = tmp_path / "default.yaml"
    path.write_text(yaml.safe_dump(config))
    env = {**os.environ, **SERVE_ENV, **HAPROXY_PORTS_ENV, "RAY_ADDRESS": "local"}  # a fresh local Ray, never another's
    log = tmp_path / "run.log"
    with open(log, "w") as out:  # a file, not a pipe: a full pipe would block the app's logging
        proc = subprocess.Popen([sys.executable, "-m", "serve_app.run", str(path)], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_foreground_signals)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                if httpx.get(URL + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the app did not come up"
            time.sleep(0.5)
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _foreground_signals() -> None:
    """SIGINT handled as in a terminal's foreground job. A suite started in the background (`make test &` from
    a script) ignores SIGINT, every child inherits that, and Python leaves an inherited SIG_IGN alone: the app
    would never see the Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _ctrl_c(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)


def _assert_clean_exit(before: int) -> None:
    """Nothing listens on the port any more, and no Ray process of its own is left."""
    with pytest.raises(httpx.HTTPError):
        httpx.get(URL + "/health", timeout=2)
    deadline = time.monotonic() + 30
    while _ray_processes() > before:
        assert time.monotonic() < deadline, "Ray processes outlived the app"
        time.sleep(0.5)


@pytest.mark.own_ray
def test_make_run_serves_drains_on_ctrl_c_and_stops_quickly(tmp_path):
    """One app (each start of a fresh Ray and app costs ~40 s on 2 cores): a chat completion is answered; Ctrl-C
    with a stream in flight lets that stream finish; then the app stops as quickly as an idle one does. The
    idle figure is the time from the stream's end to the exit, which covers the shutdown's serial part (Serve
    stopping the proxies and Ray) after the last request; a draining period that outlasted the stream would
    show here too, as the stream takes a few seconds."""
    before = _ray_processes()
    max_tokens = 800  # ~3 s of streaming on 2 cores: longer than any drain period would hide
    body = {"model": "pagedserve-tiny", "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    outcome: dict = {}
    first_tokens = threading.Event()

    def stream() -> None:
        try:
            with httpx.stream("POST", URL + "/v1/completions", json=body, timeout=120) as r:
                outcome["status"] = r.status_code
                if r.status_code != 200:
                    outcome["body"] = r.read().decode(errors="replace")  # the error names its cause
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        first_tokens.set()
                        if chunk.get("usage"):
                            outcome["tokens"] = chunk["usage"]["completion_tokens"]
                        for c in chunk["choices"]:
                            outcome["finish"] = c.get("finish_reason") or outcome.get("finish")
                    elif line == "data: [DONE]":
                        outcome["done"] = True
        except Exception as e:  # noqa: BLE001 - reported below
            outcome["error"] = repr(e)
        outcome["ended"] = time.monotonic()

    with _make_run(tmp_path) as proc:
        r = httpx.post(URL + "/v1/chat/completions", timeout=60, json={
            "model": "pagedserve-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
        client = threading.Thread(target=stream)
        client.start()
        assert first_tokens.wait(60), outcome
        _ctrl_c(proc)
        client.join(timeout=120)
        ended = outcome.pop("ended")
        assert outcome == {"status": 200, "tokens": max_tokens, "finish": "length", "done": True}
        assert proc.wait(timeout=60) in (0, 1, -signal.SIGINT)
        took = time.monotonic() - ended
    print(f"after the last stream ended, the app stopped in {took:.1f} s")  # pytest -s shows it
    assert took < 15, f"the app took {took:.1f} s to stop after its last stream"  # loose: a loaded CI machine must pass
    _assert_clean_exit(before)


def test_makefile_sets_what_serve_env_says():
    makefile = (ROOT / "Makefile").read_text()
    line = re.search(r"^SERVE_ENV := ((?:.*\\\n)*.*)$", makefile, re.M).group(1).replace("\\\n", " ")
    assert dict(item.split("=", 1) for item in line.split()) == SERVE_ENV
    assert "$(SERVE_ENV) $(BIN)/python -m serve_app.run configs/default.yaml" in makefile
