"""The span tree and its attributes, in one process: the real app in Ray Serve's local testing mode
(both deployments in this process), spans collected by an in-memory exporter."""

from __future__ import annotations

import contextlib
import gc
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from serve_app import tracing
from serve_app.errors import APIError
from serve_app.protocol.openai import ChatCompletionRequest, CompletionRequest


@contextlib.contextmanager
def _process_tracing_reset():
    """This process's tracing as if never set up, restored afterwards (setup_tracing installs once)."""
    saved = tracing._TRACER, tracing._CONFIG, tracing._PROVIDER
    tracing._TRACER = tracing._CONFIG = tracing._PROVIDER = None
    try:
        yield
    finally:
        tracing._TRACER, tracing._CONFIG, tracing._PROVIDER = saved


@pytest.fixture(scope="module")
def traced_app():
    with _process_tracing_reset():
        yield from _traced_app()


def _traced_app():
    from ray import serve

    from serve_app.app import build_app
    from serve_app.app_args import AppArgs

    exporter = InMemorySpanExporter()
    tracing.setup_tracing(tracing.TracingConfig(record_content=False), {"test": "1"}, exporter=exporter)
    engine = {"max_model_len": 512, "num_kv_blocks": 128, "multiprocess": False}
    app = build_app(AppArgs(num_replicas=1, engine=engine, tracing={"detailed": True}, direct_streaming=False))
    handle = serve.run(app, _local_testing_mode=True)
    # The caller's own tracer: a different provider, as in a real client process.
    caller = TracerProvider()
    caller.add_span_processor(SimpleSpanProcessor(exporter))
    yield handle.options(stream=True), exporter, caller.get_tracer("caller")
    handle.shutdown()
    # The local replicas' engines end with their finalizers: run them now, not inside some later
    # compile() that a collection happens to interrupt (CPython 3.11 then fails that compile).
    gc.unfreeze()
    gc.collect()


def _by_name(spans):
    return {s.name: s for s in spans if s.name != "engine_step"}


def test_handle_call_joins_the_callers_trace(traced_app):
    handle, exporter, caller = traced_app
    exporter.clear()
    with caller.start_as_current_span("client") as parent:
        carrier = {}
        tracing._PROPAGATOR.inject(carrier)
        request = ChatCompletionRequest(messages=[{"role": "user", "content": "Hello"}], max_tokens=6, temperature=0.5,
                                        top_p=0.9)
        [response] = list(handle.chat.remote(request, trace_context=carrier))
    spans = _by_name(exporter.get_finished_spans())
    trace_id = parent.get_span_context().trace_id
    chat, tokenize, llm = spans["chat"], spans["tokenize"], spans["llm_request"]
    assert {s.context.trace_id for s in (chat, tokenize, llm)} == {trace_id}
    assert chat.parent.span_id == parent.get_span_context().span_id and chat.kind is SpanKind.SERVER
    assert tokenize.parent.span_id == chat.context.span_id
    assert llm.parent.span_id == chat.context.span_id and llm.kind is SpanKind.SERVER
    a = llm.attributes
    assert a["gen_ai.request.model"] == "pagedserve-tiny" and a["gen_ai.request.max_tokens"] == 6
    assert a["gen_ai.request.temperature"] == 0.5 and a["gen_ai.request.top_p"] == 0.9 and a["gen_ai.request.n"] == 1
    assert a["gen_ai.response.id"] == response.id and a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.usage.input_tokens"] == response.usage.prompt_tokens
    assert a["gen_ai.usage.output_tokens"] == 6 and a["gen_ai.usage.cache_read_input_tokens"] == 0
    assert 0 < a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    assert a["gen_ai.latency.time_in_queue"] >= 0
    events = [e.name for e in llm.events]
    assert events == ["queued", "scheduled", "first_token", "finished"]
    times = [e.timestamp for e in llm.events]
    assert times == sorted(times) and llm.start_time <= times[0] + 5_000_000 and times[-1] <= llm.end_time
    assert "gen_ai.prompt" not in a and "gen_ai.completion" not in a  # no text unless record_content


def test_detailed_mode_adds_a_span_per_engine_step(traced_app):
    handle, exporter, _ = traced_app
    exporter.clear()
    prompt = "word " * 40  # with max_tokens 5: one prefill step, then four decode steps
    [response] = list(handle.completions.remote(CompletionRequest(prompt=prompt, max_tokens=5)))
    spans = exporter.get_finished_spans()
    [llm] = [s for s in spans if s.name == "llm_request"]
    steps = sorted((s for s in spans if s.name == "engine_step"), key=lambda s: s.start_time)
    assert len(steps) == 5 and all(s.parent.span_id == llm.context.span_id for s in steps)
    prefill, *decodes = steps
    assert prefill.attributes["pagedserve.step.num_tokens"] == response.usage.prompt_tokens
    assert all(s.attributes["pagedserve.step.num_tokens"] == 1 for s in decodes)
    assert all(s.attributes["pagedserve.step.batch_size"] >= 1 for s in steps)
    assert all(llm.start_time <= s.start_time < s.end_time <= llm.end_time for s in steps)
    busy = sum(s.end_time - s.start_time for s in steps) / 1e9
    assert abs(llm.attributes["gen_ai.latency.time_in_model_execute"] - busy) < 1e-3


def test_without_a_caller_context_a_new_trace_starts(traced_app):
    handle, exporter, _ = traced_app
    exporter.clear()
    list(handle.completions.remote(CompletionRequest(prompt="Hi", max_tokens=2)))
    spans = _by_name(exporter.get_finished_spans())
    assert spans["completions"].parent is None
    assert spans["llm_request"].context.trace_id == spans["completions"].context.trace_id


def test_failed_and_aborted_requests_end_their_spans(traced_app):
    handle, exporter, _ = traced_app
    exporter.clear()
    with pytest.raises(APIError, match="`nope` does not exist"):
        list(handle.completions.remote(CompletionRequest(prompt="Hi", max_tokens=2, model="nope")))
    failed = _by_name(exporter.get_finished_spans())["completions"]
    assert failed.status.status_code is StatusCode.ERROR and failed.events[0].name == "exception"
    exporter.clear()
    stream = handle.completions.remote(CompletionRequest(prompt="Hi", max_tokens=400, stream=True, ignore_eos=True))
    next(iter(stream))
    stream.cancel()
    import time

    deadline = time.monotonic() + 10
    while "llm_request" not in _by_name(exporter.get_finished_spans()):
        assert time.monotonic() < deadline, "the aborted request's span was never ended"
        time.sleep(0.05)
    llm = _by_name(exporter.get_finished_spans())["llm_request"]
    assert "aborted" in [e.name for e in llm.events]
    assert llm.attributes["gen_ai.usage.output_tokens"] < 400


def test_tracing_off_costs_nothing():
    with _process_tracing_reset():
        assert tracing.setup_tracing(tracing.TracingConfig(), {}) is None  # exporter none: nothing installed
        assert tracing.tracer() is None and tracing.inject() == {}
        with tracing.span("x") as s:
            assert s is None
        tracing.flush()


def test_default_otlp_protocol_is_grpc_and_reaches_a_collector(monkeypatch):
    for var in ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(var, raising=False)
    received = []

    class Collector(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):  # noqa: N802 - the gRPC service's name
            received.extend((s.name,
                             {a.key: a.value.string_value for a in rs.resource.attributes}.get("pagedserve.replica"))
                            for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Collector(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with _process_tracing_reset():
            config = tracing.TracingConfig(exporter="otlp", endpoint=f"http://127.0.0.1:{port}",
                                           export_interval_ms=60_000)
            assert tracing.setup_tracing(config, {"pagedserve.replica": "r1"}) is not None
            with tracing.span("tokenize"):
                pass
            assert received == []  # queued for a minute...
            tracing.flush()  # ...unless flushed
            assert received == [("tokenize", "r1")]
            tracing._PROVIDER.shutdown()
    finally:
        server.stop(None)


def test_config_falls_back_to_otel_environment(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    monkeypatch.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "llm")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "team=serving,env=prod")
    r = tracing.resolve(tracing.TracingConfig(sampling_ratio=0.5, resource_attributes={"env": "test"}))
    assert (r.exporter, r.protocol, r.endpoint, r.sampling_ratio, r.service_name) == (
        "otlp", "http/protobuf", "http://collector:4318/v1/traces", 0.5, "llm")
    assert r.resource_attributes == {"team": "serving", "env": "test"}
    with pytest.raises(ValueError):
        tracing.TracingConfig(exporter="jaeger")
