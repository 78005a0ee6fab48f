"""A minimal OTLP/HTTP trace receiver (POST /v1/traces, protobuf bodies) on a local port: the end-to-end
tracing test decodes what the app exports with it. The tracing benchmark runs it as its own process
(`python -m benchmarks.otlp_receiver`), counting spans only, so that receiving costs the load
generator no GIL time; a GET answers the number of spans received."""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    kind: int
    attributes: dict
    resource: dict
    events: list[str] = field(default_factory=list)
    status_code: int = 0


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    return getattr(v, kind) if kind else None


class OTLPReceiver:
    def __init__(self, keep: bool = True) -> None:
        self.spans: list[ReceivedSpan] = []
        self.num_spans = 0
        self._keep = keep
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver._receive(body)
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def do_GET(self) -> None:  # noqa: N802
                body = str(receiver.num_spans).encode()
                self.send_response(200)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}/v1/traces"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def _receive(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        if not self._keep:
            with self._lock:
                self.num_spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        name=s.name, kind=s.kind, attributes={a.key: _value(a.value) for a in s.attributes},
                        resource=resource, events=[e.name for e in s.events], status_code=s.status.code,
                    ))
        with self._lock:
            self.num_spans += len(spans)
            self.spans.extend(spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def stop(self) -> None:
        self._server.shutdown()


if __name__ == "__main__":
    receiver = OTLPReceiver(keep=False)
    print(receiver.endpoint, flush=True)
    sys.stdin.read()  # until the parent closes our stdin (or exits)
