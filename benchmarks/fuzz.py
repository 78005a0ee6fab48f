"""Fuzz every route of the live app from its own /openapi.json with schemathesis: valid (positive) and
invalid (negative) requests, plus the methods and paths the schema does not have.

    python benchmarks/fuzz.py [--cases 2000] [--concurrency 8] [--port 8201] [--max-model-len 512]

Starts Ray and the app (built-in pagedserve-tiny, two engine replicas), generates at least --cases
requests spread over the schema's operations and both generation modes, sends them concurrently, and
checks each answer: no 5xx (nor an in-band server error in a stream); every 4xx carries the documented
error object (OpenAI's `{"error": {message, type, param, code}}`, Anthropic's `{"type": "error", "error":
{type, message}}` on /v1/messages); JSON bodies conform to the schema; streams are well-formed. Then
no replica restarted, /health is 200 and the engines are idle with every KV block free. Prints a table
(route, cases, 2xx, 4xx, 5xx, bad bodies) and a curl reproduction of every failing case; exits 1 on any.

Before the end-state checks it also runs benchmarks/text_fuzz.py's whole sweep: its fixed hostile texts
and HOSTILE_DRAWS seeded random ones in every text field of every generating route (its own table).
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import requests

if __package__ in (None, ""):  # run as a script: make `benchmarks.*` importable
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hypothesis
import hypothesis.errors
import schemathesis
from hypothesis import HealthCheck, Phase
from schemathesis import Case, GenerationMode

from benchmarks import live_app, text_fuzz
from benchmarks.api_answers import error_body_problem, status_table, stream_problem

_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
_TIMEOUT_S = 300
HOSTILE_DRAWS = 20  # random texts (benchmarks/text_fuzz.py's drawn_texts) besides its fixed hostile ones


@dataclass(frozen=True)
class Outcome:
    route: str  # "POST /v1/completions"
    status: int
    problem: str | None  # why the answer is wrong; None when it is right
    reproduce: str


def generate(schema, cases: int, seed: int, on_case: Callable[[Case], None]) -> None:
    """At least `cases` cases, handed to `on_case` as they come: an equal quota per (operation, mode)
    pair that can vary its input; an operation without parameters yields its one case."""
    pairs = [(result.ok(), mode) for result in schema.get_all_operations()
             for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
    varying = sum(1 for op, _ in pairs if op.body or op.query or op.path_parameters or op.headers)
    quota = -(-cases // max(1, varying))
    for op, mode in pairs:

        @hypothesis.seed(seed)
        @hypothesis.settings(max_examples=quota, phases=[Phase.generate], database=None, deadline=None,
                             suppress_health_check=list(HealthCheck))
        @hypothesis.given(op.as_strategy(generation_mode=mode))
        def collect(case: Case) -> None:
            on_case(case)

        for attempt in range(3):
            try:
                collect()
            except hypothesis.errors.Unsatisfiable:
                pass  # nothing invalid to say to an operation without input
            except RuntimeError as e:
                # Hypothesis describes a strategy by iterating sys.modules unguarded (lambda_sources.py) while
                # the sender threads may import lazily: a race in the generator, not a finding. Draw again.
                if "changed size during iteration" not in str(e) or attempt == 2:
                    raise
                continue
            break


def steer(case: Case, model: str, rng: random.Random, max_tokens_cap: int | None) -> None:
    """Point most valid requests at the served model (a random name is a 404 before anything else is
    looked at), and optionally cap how much they may generate: token limits within the model's reach
    become at most `max_tokens_cap`; larger ones, which must fail, stay. Validation is under test here,
    not the length of the outputs."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and rng.random() < 0.8:
        body["model"] = model
    if max_tokens_cap is None or case.operation.path not in _GENERATING:
        return
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if type(value) is int and 0 < value <= 4096:
            body[key] = min(value, max_tokens_cap)
    if case.operation.path == "/v1/chat/completions" and body.get("max_tokens") is None:
        body["max_tokens"] = max_tokens_cap  # unset, a chat request may fill the whole context


def check(case: Case, response: schemathesis.Response) -> str | None:
    path = case.operation.path
    status = response.status_code
    if status >= 500:
        return f"{status}: {response.text[:300]}"
    content_type = next((v[0] for k, v in response.headers.items() if k.lower() == "content-type"), "")
    if content_type.startswith("text/event-stream"):
        return stream_problem(path, response.text, response.stream_cut_short)
    try:
        body = response.json()
    except ValueError:
        return None if status < 400 and path == "/health" else f"{status} body is not JSON: {response.text[:200]}"
    if status >= 400:
        problem = error_body_problem(path, status, body)
        if problem:
            return problem
    try:
        case.operation.validate_response(response, case=case)
    except Exception as e:  # noqa: BLE001 - schemathesis reports non-conformance as assorted errors
        return f"{status} body does not match the schema: {str(e)[:300]}"
    return None


class _Sessions(threading.local):
    def __init__(self) -> None:
        self.session = requests.Session()


def send(base_url: str, case: Case, sessions: _Sessions) -> Outcome:
    route = f"{case.method.upper()} {case.operation.path}"
    reproduce = case.as_curl_command(base_url=base_url)
    try:
        response = case.call(base_url=base_url, session=sessions.session, timeout=_TIMEOUT_S)
    except requests.RequestException as e:
        return Outcome(route, 0, f"no answer: {e}", reproduce)
    return Outcome(route, response.status_code, check(case, response), reproduce)


def probe_other_methods(base_url: str, schema) -> list[Outcome]:
    """Each path with each method it does not serve (405), and an unknown path (404): the errors of the
    routing layer, which the schema cannot describe, must carry the documented error object too."""
    served: dict[str, set[str]] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        served.setdefault(op.path, set()).add(op.method.upper())
    probes = [(m, p) for p, methods in served.items() for m in _METHODS if m not in methods]
    probes += [("GET", "/v1/unknown"), ("POST", "/v1/messages/unknown")]
    outcomes = []
    for method, path in probes:
        response = requests.request(method, base_url + path, json={}, timeout=_TIMEOUT_S)
        problem = (f"{response.status_code}: {response.text[:300]}" if response.status_code >= 500 else
                   _json_error_problem(path, response))
        outcomes.append(Outcome("methods or paths not served", response.status_code, problem,
                                f"curl -X {method} {base_url}{path} -H 'Content-Type: application/json' -d '{{}}'"))
    return outcomes


def _json_error_problem(path: str, response: requests.Response) -> str | None:
    if response.status_code < 400:
        return f"{response.status_code}: a route that is not served answered"
    try:
        body = response.json()
    except ValueError:
        return f"{response.status_code} body is not JSON: {response.text[:200]}"
    return error_body_problem(path, response.status_code, body)


def table(outcomes: Iterable[Outcome]) -> str:
    answers = sorted((o.route, o.status, o.problem is not None and o.status < 500) for o in outcomes)
    return status_table(answers, "route", "bad bodies", 44, 11)


@dataclass
class FuzzReport:
    outcomes: list[Outcome]
    restarts: list[str]
    health_status: int
    idle: bool
    text_outcomes: list[text_fuzz.TextOutcome]

    @property
    def failures(self) -> list[Outcome]:
        texts = [Outcome(f"{o.case.route} {o.case.field} <- {o.case.text_name}", o.status, o.problem, o.case.reproduce)
                 for o in self.text_outcomes]
        return [o for o in self.outcomes + texts if o.problem is not None]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.restarts and self.health_status == 200 and self.idle


def fuzz(base_url: str, cases: int, concurrency: int, seed: int = 0, max_tokens_cap: int | None = None,
         app: str = live_app.APP, hostile_texts: bool = False) -> FuzzReport:
    """The whole fuzz against a live app: every check above, then (`hostile_texts`) the whole sweep of
    benchmarks/text_fuzz.py, and the app's state afterwards."""
    before = live_app.replicas(app)
    schema = schemathesis.openapi.from_url(base_url + "/openapi.json")
    model = requests.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    rng = random.Random(seed)
    sessions = _Sessions()
    with ThreadPoolExecutor(concurrency) as pool:  # cases go out while the next ones are generated
        futures: list[Future[Outcome]] = []

        def submit(case: Case) -> None:
            if case.meta is not None and case.meta.generation.mode == GenerationMode.POSITIVE:
                steer(case, model, rng, max_tokens_cap)
            futures.append(pool.submit(send, base_url, case, sessions))

        generate(schema, cases, seed, submit)
        outcomes = [f.result() for f in futures]
    outcomes += probe_other_methods(base_url, schema)
    if hostile_texts:
        texts = {**text_fuzz.HOSTILE_TEXTS, **text_fuzz.drawn_texts(HOSTILE_DRAWS, seed)}
        text_outcomes = text_fuzz.run(base_url, text_fuzz.cases(model, texts), concurrency)
    else:
        text_outcomes = []
    deadline = time.monotonic() + 60
    while not (idle := all(load.idle for load in live_app.engine_loads(app))) and time.monotonic() < deadline:
        time.sleep(0.5)
    health = requests.get(base_url + "/health", timeout=30).status_code
    return FuzzReport(outcomes, live_app.restarts(before, live_app.replicas(app)), health, idle, text_outcomes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=2000, help="generated cases, at least")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--port", type=int, default=8201)
    parser.add_argument("--max-model-len", type=int, default=512, help="keeps valid requests' outputs short")
    parser.add_argument("--max-tokens-cap", type=int, default=None, help="cap valid requests' max_tokens")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base_url = live_app.start(args.port, {"max_model_len": args.max_model_len, "num_kv_blocks": 512, "num_threads": 1})
    try:
        start = time.perf_counter()
        report = fuzz(base_url, args.cases, args.concurrency, args.seed, args.max_tokens_cap, hostile_texts=True)
        elapsed = time.perf_counter() - start
    finally:
        live_app.stop()
    print(table(report.outcomes))
    print("\nHostile text in every text field (benchmarks/text_fuzz.py):\n" + text_fuzz.table(report.text_outcomes))
    print(f"\n{len(report.outcomes) + len(report.text_outcomes)} requests in {elapsed:.0f} s; "
          f"replica restarts: {report.restarts or 'none'}; "
          f"/health after: {report.health_status}; engines idle, KV free: {report.idle}")
    for o in report.failures:
        print(f"\nFAIL {o.route}: {o.problem}\n  {o.reproduce}")
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
