"""No prompt or completion text in any log of the app's processes by default, for requests that
succeed and for requests that fail. (API keys: tests/serve_app/test_errors.py::test_api_keys; traces
without text unless record_content: tests/serve_app/test_tracing_local.py.)"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import httpx


def _ray_logs() -> Path:
    import ray

    return Path(ray._private.worker.global_worker.node.get_logs_dir_path())


def _logs_containing(texts: list[str]) -> list[str]:
    hits = []
    for path in _ray_logs().rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            hits += [f"{path.name}: {t[:20]}" for t in texts if t.encode() in data]
    return hits


def test_prompts_and_completions_stay_out_of_logs(serve_app_url):
    canary = f"canary-{uuid.uuid4().hex}"
    prompt = f"{canary} tell me a secret"
    r = httpx.post(serve_app_url + "/v1/completions", json={"prompt": prompt, "max_tokens": 24, "ignore_eos": True},
                   timeout=60)
    completion = r.json()["choices"][0]["text"]
    assert len(completion) >= 20
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8, "stream": True}
    assert httpx.post(serve_app_url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
    bad = [  # failures too: the errors must not echo the text
        {"prompt": prompt, "temperature": -1},
        {"prompt": prompt * 400},  # too long
        {"prompt": prompt, "stop": [canary] * 40},
    ]
    for body in bad:
        assert httpx.post(serve_app_url + "/v1/completions", json=body, timeout=60).status_code == 400
    r = httpx.post(serve_app_url + "/v1/messages", json={"model": "pagedserve-tiny", "max_tokens": 4,
                                                         "messages": [{"role": "user", "content": prompt}]}, timeout=60)
    assert r.status_code == 200
    time.sleep(2)  # log lines reach their files
    assert _logs_containing(["LLMServer"])  # the scan reads the app's real logs
    assert _logs_containing([canary, completion]) == []
