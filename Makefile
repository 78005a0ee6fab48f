# Two commands for a newcomer on a fresh machine:
#   make run    install everything, then start the main job (Ctrl-C stops it)
#   make test   install everything, then run the test suite
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Bytecode caches for our own modules and the tests' assertion rewrites: where the environment turns them off
# (PYTHONDONTWRITEBYTECODE), every process (a test worker, a Ray replica, an engine) compiles the project from
# source again: ~0.9 s of CPU for a replica's imports, ~10 s for each pytest collection.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install run test bench

# torch first and pinned: an unpinned torch pulls a multi-GB CUDA build; 2.13.0 is a CPU build on CPU hosts.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m ops.cpu
	touch $(STAMP)

install: $(STAMP)

# Ray Serve's settings for the app (serve_app/serve_env.py says why each): HAProxy in front of the
# ingress replicas instead of Ray's proxy actor, a 1 s deregistration window for a stopping ingress, one
# event loop per replica process, request bodies (up to 64 KiB) for the prefix router of direct streaming,
# and a quieter controller loop and metrics export.
SERVE_ENV := RAY_SERVE_ENABLE_DIRECT_INGRESS=1 RAY_SERVE_ENABLE_HA_PROXY=1 RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=1 \
	RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0 RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0 \
	RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY=1 RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE=65536 \
	RAY_SERVE_CONTROL_LOOP_INTERVAL_S=0.5 RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000

# serve_app/run.py is `serve run` with a Ctrl-C that drains the streams in flight before the proxies go.
run: install
	$(SERVE_ENV) $(BIN)/python -m serve_app.run configs/default.yaml

# The suite serves HTTP as `make run` does (HAProxy); then the proxy path of a plain `serve run` (Ray's
# proxy actor) is checked with a representative few: streaming, every error status and a disconnect, through
# the ingress and straight to an engine replica (direct_streaming). The API-key (401) and overload (429)
# checks, which need an app of their own, run in the main pass only: their answers come from our ingress and
# cross the proxy like the other error statuses checked here.
PROXY_TESTS := tests/serve_app/test_errors.py \
	--deselect tests/serve_app/test_errors.py::test_api_keys \
	--deselect tests/serve_app/test_errors.py::test_overload_is_429_with_retry_after \
	tests/serve_app/test_disconnect_and_handle.py::test_disconnect_mid_stream_aborts_and_frees_blocks \
	tests/serve_app/test_openai_api.py::test_http_arrives_the_way_the_session_was_started \
	tests/serve_app/test_openai_api.py::test_completion_stream_matches_non_stream \
	tests/serve_app/test_openai_api.py::test_chat tests/serve_app/test_openai_api.py::test_n_and_seed \
	tests/serve_app/test_direct_streaming.py::test_stream_matches_non_stream \
	tests/serve_app/test_direct_streaming.py::test_disconnect_mid_stream_aborts_and_frees_blocks

# The linter first (pyproject.toml [tool.ruff]). Then the tests without Ray on two workers (most use one core
# and left 46% of the machine idle: 28-34% less time), then the Ray tests (the `ray` marker, tests/conftest.py) in
# one process, sharing one Ray instance and nothing else running beside them. --durations: the slowest tests
# in CI's log, and the suite's whole time at the end, to keep it in view (its budget is 12 minutes on 2 cores).
test: install
	$(BIN)/ruff check .
	@start=$$(date +%s); \
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not ray" --durations=10 && \
	$(BIN)/python -m pytest -q -m ray --durations=20 && \
	PAGEDSERVE_TEST_INGRESS=proxy $(BIN)/python -m pytest -q $(PROXY_TESTS); \
	status=$$?; echo "make test: the suite took $$(( $$(date +%s) - start )) s"; exit $$status

bench: install
	$(BIN)/python benchmarks/throughput.py
