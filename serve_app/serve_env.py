"""The environment Ray Serve's processes need for the app as `make run` serves it. Ray reads these once,
when a process imports it: set them before Ray starts (and, in a Python driver that builds the app, before
it imports Ray). Kept free of Ray imports for that reason."""

# Serve through HAProxy (Ray Serve 2.60's direct ingress) rather than Ray's Python proxy actor: HAProxy
# takes the HTTP port and hands each connection to an ingress replica's own HTTP server, where the proxy
# actor relays every request, its body (a call back from the ingress) and each streamed message through
# one more Python process. On 2 cores that took 7.6% of the app's CPU and added ~100 ms to TTFT p50
# under load (benchmarks/results/serving.md).
HAPROXY_INGRESS_ENV = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"}

# Everything `make run` sets for Ray Serve (the Makefile's SERVE_ENV must say the same; a test checks):
# - HAProxy in front (above).
# - A stopping ingress replica stays reachable for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S before it
#   stops, so that an external load balancer can deregister it; Ray's default, 30 s, is what made Ctrl-C on
#   an idle `make run` take ~30 s. Here the only balancer is Serve's own HAProxy, which the controller
#   updates within ~0.1 s and which retries a refused connection elsewhere, so 1 s is plenty. Streams in
#   flight are still drained, up to graceful_shutdown_timeout_s.
# - One event loop per replica process: by default Serve runs user code on a thread and event loop of its
#   own, and the handle's router on another, so every streamed message hopped threads (a wake-up through a
#   self-pipe and a GIL hand-off) once in the engine replica and twice in the ingress. Measured on 2 cores
#   under load (python -m benchmarks.peers --env ...): 20-22% less CPU per request in the ingress and in
#   the engine replica. Our code never blocks its loop (format compiles go to a worker thread).
# - With direct_streaming and the prefix router, HAProxy hands IngressRouter the request's body (the prompt is
#   what it routes on), up to 64 KiB (~15k prompt tokens; longer ones are routed by load): HAProxy's buffers
#   take that size then, and Ray's 8 MiB default would cost 16 MiB per connection.
# - Ray's own background work turned down (benchmarks/results/ray_background.md): Serve's controller runs its
#   control loop every 0.5 s instead of 0.1 (each pass reads and writes state in the GCS, so both idled at a
#   third of their CPU), and replicas export their cached request metrics every 1 s instead of 0.1 (Prometheus
#   scrapes every few seconds anyway). With the 56M app at 4 requests/s on 2 cores, Ray's processes and ours
#   outside the engine took 78 ms of CPU per request instead of 122, and 0.12 cores idle instead of 0.17. The
#   price: the controller notices a change (a deploy's step, a dead replica, a scaling decision) up to 0.4 s
#   later, against seconds for a replica to start.
SERVE_ENV = {**HAPROXY_INGRESS_ENV, "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1",
             "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
             "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
             "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": "65536",
             "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000"}
