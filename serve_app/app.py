"""The application builder: `serve run serve_app.app:build_app model=...`, or `import_path:
serve_app.app:build_app` with `args:` in a config file (configs/default.yaml)."""

# No `from __future__ import annotations` here: Ray reads the builder's annotation at run time to
# validate `args` as AppArgs, and a string annotation would hand us the raw dict.

import logging

import ray
from ray.serve import Application
from ray.serve._private.constants import RAY_SERVE_ENABLE_HA_PROXY
from ray.serve.config import BackpressureConfig, RequestRouterConfig

from engine.config import EngineConfig
from engine.model_spec import check_config, local_model_config
from serve_app.app_args import ROUTERS, AppArgs
from serve_app.data_parallel import DataParallelRankAssigner
from serve_app.engine_ingress import EngineIngress
from serve_app.ingress import OpenAIIngress
from serve_app.llm_server import LLMServer, StreamPacing
from serve_app.placement import check_placement
from serve_app.routing.ingress_router import IngressRouter

logger = logging.getLogger(__name__)


def build_app(args: AppArgs) -> Application:
    direct = args.streams_directly(haproxy=RAY_SERVE_ENABLE_HA_PROXY)
    if args.disaggregation is None:
        engine = _engine_deployment(args, "LLMServer", None, args.router, args.router_kwargs, direct=direct)
    else:
        # Decode-as-orchestrator (Ray Serve LLM 2.60's P/D shape): the ingress talks to the decode pool, routed
        # by load and KV usage; each decode replica asks the prefill pool, routed by our prefix router.
        prefill = _engine_deployment(args, "PrefillServer", "prefill", args.router, args.router_kwargs)
        engine = _engine_deployment(args, "DecodeServer", "decode", "prefix", {"affinity": False},
                                    prefill=prefill, pd_settings=args.pd_settings())
    if direct:  # every engine replica is an ingress (EngineIngress)
        # With the prefix router, HAProxy asks IngressRouter which replica takes each request (one replica: none).
        if args.router == "prefix" and args.routes_replicas:
            if not RAY_SERVE_ENABLE_HA_PROXY:
                raise ValueError("router: prefix with direct_streaming needs HAProxy in front (serve_app/serve_env.py, "
                                 "as `make run` sets it); set router: pow2, or direct_streaming: false")
            return engine._with_ingress_request_router(IngressRouter.bind(engine, args.model_dump(exclude_unset=True)))
        return engine
    # The ingress holds the clients' streams: it drains as long as the engine replicas do.
    return OpenAIIngress.options(num_replicas=args.ingress_replicas, ray_actor_options=args.ingress_ray_actor_options,
                                 graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s).bind(
        engine, args.model_dump(exclude_unset=True))


def _engine_deployment(args: AppArgs, name: str, role: str | None, router: str, router_kwargs: dict,
                       direct: bool = False, **extra):
    """An engine deployment (`role`: a disaggregation pool, None: the only one); `direct`: its replicas serve
    clients themselves (EngineIngress)."""
    engine_config = args.engine_config(role)
    check_engine_model(engine_config, f"{role} pool" if role else "engine")
    router_config = RequestRouterConfig()
    # One replica serving clients itself: nothing to route, and Serve refuses a custom router on a deployment
    # HAProxy balances over (unless an ingress request router picks its replicas).
    if ROUTERS[router] is not None and (args.routes_replicas or not direct):
        kwargs = {"block_size": engine_config.block_size, **router_kwargs} if router == "prefix" else {}
        router_config = RequestRouterConfig(request_router_class=ROUTERS[router], request_router_kwargs=kwargs,
                                            request_routing_stats_period_s=1, request_routing_stats_timeout_s=5)
    autoscaling = args.engine_autoscaling_config(role)
    num_replicas = args.num_replicas if role is None else getattr(args.disaggregation, role).num_replicas
    placement = args.placement(engine_config, role)
    if "placement_group_bundles" in placement and args.placement_group_config.check_fits and ray.is_initialized():
        check_placement(placement["placement_group_bundles"], placement["placement_group_strategy"])
    worker_bundle = placement["placement_group_bundles"][-1] if "placement_group_bundles" in placement else None
    if direct:
        deployment, extra["args"] = EngineIngress, args.model_dump(exclude_unset=True)
        # Past max_queued_requests Serve answers direct HTTP requests itself: the status and Retry-After
        # OpenAIIngress gives when the engine replicas' queues are full (serve_app/errors.py).
        extra_options = {"backpressure_config": BackpressureConfig(status_code=503, retry_after_s=1)}
    else:
        deployment, extra_options = LLMServer, {}
    if engine_config.data_parallel_size > 1:  # the group's ranks ask it theirs (serve_app/data_parallel.py)
        extra["rank_assigner"] = DataParallelRankAssigner.options(name=f"{name}RankAssigner").bind(
            engine_config.data_parallel_size)
    return deployment.options(
        name=name,
        **({"autoscaling_config": autoscaling} if autoscaling else {"num_replicas": num_replicas}),
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.max_queued_requests,
        graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
        request_router_config=router_config,
        **placement,
        **extra_options,
    ).bind(engine_config.model_dump(mode="json"), args.name, args.tracing.model_dump(),
           StreamPacing(args.stream_coalesce_cpu_utilization, args.stream_coalesce_interval_s), worker_bundle, **extra)


def check_engine_model(engine_config: EngineConfig, what: str) -> None:
    """Refuse now, naming the field, a config the model cannot run (engine/model_spec.py check_config):
    a replica would find it only after starting its workers, and Serve would retry replica after replica.
    Only where the model's config can be read here without weights: a built-in model or a local folder."""
    model_config = local_model_config(engine_config.model)
    if model_config is None:
        logger.warning("model: %r is no built-in model and no folder on this host; the %s's config is checked "
                       "against it by each replica as it starts", engine_config.model, what)
        return
    check_config(engine_config, model_config)
