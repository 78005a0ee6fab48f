"""What a well-formed answer of the app looks like to a client: the documented error objects (OpenAI's,
and Anthropic's on /v1/messages) and server-sent event streams that end properly and carry no server
error. Shared by the fuzzers (benchmarks/fuzz.py, benchmarks/text_fuzz.py)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable


def error_body_problem(path: str, status: int, body: object) -> str | None:
    """Why a 4xx body is not the documented error object, or None."""
    if path.startswith("/v1/messages"):
        ok = (isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error"
              and isinstance(body["error"], dict) and set(body["error"]) == {"type", "message"}
              and isinstance(body["error"]["type"], str) and isinstance(body["error"]["message"], str)
              and body["error"]["message"])
    else:
        error = body.get("error") if isinstance(body, dict) else None
        ok = (isinstance(error, dict) and set(body) == {"error"} and set(error) == {"message", "type", "param", "code"}
              and isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
              and all(error[k] is None or isinstance(error[k], str) for k in ("param", "code")))
    return None if ok else f"{status} without the documented error object: {str(body)[:200]}"


def stream_problem(path: str, text: str, cut_short: bool) -> str | None:
    """Why a server-sent event stream is malformed or carries a server error, or None. A stream the
    client cut short (schemathesis reads 20 events at most) has no end to check."""
    data = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not data:
        return "empty stream"
    anthropic = path.startswith("/v1/messages")
    if not anthropic and not cut_short and data[-1] != "[DONE]":
        return "stream does not end with [DONE]"
    for item in data if anthropic or cut_short else data[:-1]:
        try:
            event = json.loads(item)
        except json.JSONDecodeError:
            return f"stream event is not JSON: {item[:200]}"
        error = event.get("error") if isinstance(event, dict) else None
        if isinstance(error, dict) and error.get("type") in ("server_error", "api_error"):
            return f"server error in the stream: {error.get('message')}"
    if anthropic and not cut_short and json.loads(data[-1]).get("type") != "message_stop":
        return "stream does not end with message_stop"
    return None


def status_table(answers: Iterable[tuple[str, int, bool]], key: str, bad: str, key_width: int,
                 column_width: int) -> str:
    """(row name, HTTP status or 0 for none, whether the answer was wrong) -> a table of cases, 2xx, 4xx,
    5xx and `bad` per row in the order rows first appear, then the total."""
    rows: dict[str, Counter] = {}
    for name, status, wrong in answers:
        row = rows.setdefault(name, Counter())
        row["cases"] += 1
        row[f"{status // 100}xx" if status else "no answer"] += 1
        row[bad] += wrong
    columns = ["cases", "2xx", "4xx", "5xx", bad]
    total = sum(rows.values(), Counter())
    lines = [f"{key:<{key_width}}" + "".join(f"{c:>{column_width}}" for c in columns)]
    for name, row in list(rows.items()) + [("total", total)]:
        lines.append(f"{name:<{key_width}}" + "".join(f"{row[c]:>{column_width}}" for c in columns))
    return "\n".join(lines)
