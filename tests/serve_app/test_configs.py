"""The shipped configs are valid Serve configs whose args are valid AppArgs and whose import paths
resolve; they build the application without starting anything. A config the model cannot run fails
build_app at once, naming the field, wherever the model's config can be read where the app is built."""

from __future__ import annotations

import importlib
import json
import logging
import time
from pathlib import Path

import psutil
import pytest
import ray
import yaml
from ray.serve.schema import ServeDeploySchema

from engine.models.builtin import BUILTIN_MODELS
from serve_app.app import build_app
from serve_app.app_args import AppArgs

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_is_valid(path):
    config = yaml.safe_load(path.read_text())
    schema = (ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate")
              else ServeDeploySchema.parse_obj(config))
    for app in schema.applications:
        module, attr = app.import_path.split(":")
        builder = getattr(importlib.import_module(module), attr)
        args = AppArgs.model_validate(app.args)
        assert builder.__annotations__["args"] is AppArgs  # a class, not a string: Ray validates args with it
        names = {d.name for d in app.deployments}
        assert names <= {"LLMServer", "PrefillServer", "DecodeServer", "OpenAIIngress", "IngressRouter"}, names
        assert not (args.streams_directly(haproxy=True) and "OpenAIIngress" in names), (
            "direct_streaming apps have no ingress deployment")
        assert args.engine_config().model == args.model
        build_app(args)  # checks the engine config against a model it can read here (the built-ins)


def _args(name: str) -> tuple[dict, AppArgs]:
    config = yaml.safe_load((CONFIGS[0].parent / name).read_text())
    return config, AppArgs.model_validate(config["applications"][0]["args"])


def test_default_config_is_the_product():
    # What a newcomer starts: the built-in model on CPU with the prefix router and the KV/queue autoscaler
    # (1 to 2 replicas, one torch thread each so that two fit two cores).
    config, args = _args("default.yaml")
    assert args.model == "pagedserve-tiny" and args.router == "prefix"
    scaling = args.engine_autoscaling_config()
    assert (scaling["min_replicas"], scaling["max_replicas"]) == (1, 2)
    assert scaling["policy"]["policy_function"] == "autoscale.ray_policy:KVQueueAutoscalingPolicy"
    assert args.engine_config().num_threads == 1
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8000}


def test_fixed_pow2_config_is_for_comparison():
    _, args = _args("fixed-pow2.yaml")
    assert args.router == "pow2" and args.autoscaling_config is None and args.num_replicas == 2
    assert args.engine_config().num_threads == 1


def test_bad_args_name_the_field():
    with pytest.raises(ValueError, match="max_model_len"):
        AppArgs.model_validate({"engine": {"max_model_len": -1}})
    with pytest.raises(ValueError, match="router"):
        AppArgs.model_validate({"router": "random"})
    with pytest.raises(ValueError, match="num_replcas"):
        AppArgs.model_validate({"num_replcas": 2})


def test_direct_streaming_is_on_wherever_it_can_be():
    # `auto`: the engine replicas serve clients themselves unless something needs the ingress deployment.
    assert AppArgs().streams_directly(haproxy=True) and AppArgs(num_replicas=2).streams_directly(haproxy=True)
    assert AppArgs(router="pow2").streams_directly(haproxy=False)
    assert not AppArgs(num_replicas=2).streams_directly(haproxy=False)  # the prefix router asks HAProxy's IngressRouter
    assert AppArgs(num_replicas=1).streams_directly(haproxy=False)  # one replica: nothing to route
    for needs_ingress in ({"router": "round_robin"}, {"ingress_replicas": 2}, {"ingress_ray_actor_options": {}},
                          {"allow_runtime_lora_updating": True, "lora_root": "/tmp"},
                          {"engine": {"data_parallel_size": 2}}, {"direct_streaming": False}):
        assert not AppArgs(**needs_ingress).streams_directly(haproxy=True), needs_ingress
    assert not AppArgs.model_validate(_args("pd.yaml")[0]["applications"][0]["args"]).streams_directly(haproxy=True)
    assert AppArgs().engine_config().small_step_threads == "auto"  # and small steps leave a core to it


def test_direct_streaming_refuses_what_it_cannot_serve():
    assert AppArgs(router="pow2", direct_streaming=True).direct_streaming
    assert AppArgs(router="prefix", direct_streaming=True).direct_streaming
    with pytest.raises(ValueError, match="router: round_robin"):
        AppArgs(router="round_robin", direct_streaming=True)  # Serve refuses a custom router behind HAProxy
    with pytest.raises(ValueError, match="ingress_replicas"):
        AppArgs(router="pow2", direct_streaming=True, ingress_replicas=2)
    with pytest.raises(ValueError, match="allow_runtime_lora_updating"):
        AppArgs(router="pow2", direct_streaming=True, allow_runtime_lora_updating=True, lora_root="/tmp")


# --- API keys from the environment (a Kubernetes Secret mounted as env: k8s/rayservice-gpu.yaml) -------------


def test_api_keys_env_reads_comma_separated_keys():
    args = AppArgs.model_validate({"api_keys_env": "PAGEDSERVE_API_KEYS"})
    assert args.resolve_api_keys({"PAGEDSERVE_API_KEYS": " key-one,key-two ,, "}) == ["key-one", "key-two"]
    assert AppArgs.model_validate({"api_keys": ["k"]}).resolve_api_keys({}) == ["k"]
    assert AppArgs().resolve_api_keys({"PAGEDSERVE_API_KEYS": "ignored"}) == []  # no keys asked for: open


@pytest.mark.parametrize("environ", [{}, {"PAGEDSERVE_API_KEYS": ""}, {"PAGEDSERVE_API_KEYS": " , "}])
def test_api_keys_env_without_keys_fails_closed(environ):
    args = AppArgs.model_validate({"api_keys_env": "PAGEDSERVE_API_KEYS"})
    with pytest.raises(ValueError, match="api_keys_env: the environment variable PAGEDSERVE_API_KEYS is unset"):
        args.resolve_api_keys(environ)


def test_api_keys_env_is_validated():
    with pytest.raises(ValueError, match="api_keys, api_keys_env: set one of them"):
        AppArgs.model_validate({"api_keys": ["k"], "api_keys_env": "PAGEDSERVE_API_KEYS"})
    with pytest.raises(ValueError, match="api_keys_env"):
        AppArgs.model_validate({"api_keys_env": "$PAGEDSERVE_API_KEYS"})  # the name, not a reference


def test_http_app_takes_its_keys_from_the_environment(monkeypatch):
    """The ingress's HTTP app (no Ray): /v1 answers 401 without one of the keys in the variable, and an
    ingress whose variable is missing does not start."""
    from types import SimpleNamespace

    from fastapi.testclient import TestClient

    from serve_app.http_api import build_http_app
    from serve_app.protocol.openai import ModelCard

    serving = SimpleNamespace(model_cards=lambda: [ModelCard(id="m", max_model_len=16)])
    ingress = SimpleNamespace(args=AppArgs.model_validate({"api_keys_env": "PAGEDSERVE_API_KEYS"}), openai=serving)
    monkeypatch.setenv("PAGEDSERVE_API_KEYS", "key-one,key-two")
    client = TestClient(build_http_app(ingress))
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer key-three"}).status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer key-two"}).json()["data"][0]["id"] == "m"
    monkeypatch.delenv("PAGEDSERVE_API_KEYS")
    with pytest.raises(ValueError, match="PAGEDSERVE_API_KEYS is unset"):
        build_http_app(ingress)


def test_multi_rank_replica_gets_one_bundle_per_rank():
    config = yaml.safe_load((CONFIGS[0].parent / "gpu-llama3-70b-tp4.yaml").read_text())
    args = AppArgs.model_validate(config["applications"][0]["args"])
    engine = args.engine_config()
    assert engine.distributed_executor_backend == "ray" and engine.world_size == 4
    placement = args.placement(engine)
    assert placement["placement_group_bundles"] == [{"GPU": 1, "CPU": 5}] + [{"GPU": 1, "CPU": 1}] * 3
    assert placement["placement_group_strategy"] == "STRICT_PACK"
    assert placement["ray_actor_options"] == {"num_cpus": 4, "num_gpus": 1}  # the replica's engine process is rank 0
    cpu = AppArgs.model_validate({"engine": {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}})
    placement = cpu.placement(cpu.engine_config())
    assert (placement["placement_group_bundles"] == [{"CPU": 0.01}] * 4
            and placement["placement_group_strategy"] == "PACK")
    assert AppArgs.model_validate({}).placement(AppArgs.model_validate({}).engine_config()) == {
        "ray_actor_options": {"num_cpus": 0}}
    # A custom resource that keeps replicas on some nodes: the replica sits in bundle 0, which must offer it.
    spread = AppArgs.model_validate({"engine": {"tensor_parallel_size": 2},
                                     "ray_actor_options": {"num_cpus": 0, "resources": {"big_node": 1}}})
    assert spread.placement(spread.engine_config())["placement_group_bundles"] == [
        {"CPU": 0.01, "big_node": 1}, {"CPU": 0.01}]


def test_each_pool_of_disaggregation_may_have_its_own_actor_options():
    args = AppArgs.model_validate({"disaggregation": {"prefill": {"ray_actor_options": {"resources": {"p": 1}}}}})
    assert args.placement(args.engine_config("prefill"), "prefill") == {"ray_actor_options": {"resources": {"p": 1}}}
    assert args.placement(args.engine_config("decode"), "decode") == {"ray_actor_options": {"num_cpus": 0}}


def test_engine_quantization_passes_through_to_the_engine():
    config = yaml.safe_load("args: {model: pagedserve-tiny, engine: {quantization: int8}}")
    assert AppArgs.model_validate(config["args"]).engine_config().quantization == "int8"
    with pytest.raises(ValueError, match="quantization"):
        AppArgs.model_validate({"engine": {"quantization": "nf4"}}).engine_config()


def test_disaggregation_sizes_each_pool_and_gives_each_its_engine_and_signals():
    pd = {"disaggregation": {"prefill": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}},
                             "decode": {"num_replicas": 2, "engine": {"max_num_seqs": 8}}}}
    args = AppArgs.model_validate({"engine": {"max_num_seqs": 32}, **pd})
    prefill, decode = args.engine_config("prefill"), args.engine_config("decode")
    assert prefill.kv_transfer_config.kv_role == "kv_producer" and decode.kv_transfer_config.kv_role == "kv_consumer"
    assert (prefill.max_num_seqs, decode.max_num_seqs) == (32, 8)
    policy = args.engine_autoscaling_config("prefill")["policy"]["policy_kwargs"]
    assert policy["target_queued_prefill_tokens"] and policy["target_kv_cache_usage"] is None
    assert args.engine_autoscaling_config("decode") is None
    with pytest.raises(ValueError, match="num_replicas: with `disaggregation` set, size each pool"):
        AppArgs.model_validate({"num_replicas": 2, **pd})
    with pytest.raises(ValueError, match="router: disaggregation needs `prefix`"):
        AppArgs.model_validate({"router": "pow2", **pd})
    with pytest.raises(ValueError, match="min_replicas: a pool may not scale to 0"):
        AppArgs.model_validate({"disaggregation": {"decode": {"autoscaling_config": {"min_replicas": 0}}}})
    for field, value in (("quantization", "int8"), ("seed", 1), ("model", "pagedserve-tiny")):
        with pytest.raises(ValueError,
                           match=f"disaggregation.prefill.engine.{field}: both pools must run the same weights"):
            AppArgs.model_validate({"disaggregation": {"prefill": {"engine": {field: value}}}})


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


# A config the model cannot run, the field its error names, and the same config that it can run.
UNRUNNABLE = {
    "tp_heads": ({"model": "pagedserve-tiny", "engine": {"tensor_parallel_size": 3}},
                 "tensor_parallel_size: 3 does not divide num_attention_heads=4", {"tensor_parallel_size": 2}),
    "int4_group_split": ({"model": "pagedserve-tiny", "engine": {"quantization": "int4", "tensor_parallel_size": 2}},
                         (r"quantization: 'int4' groups model\.layers\.0\.self_attn\.o_proj's 64 inputs by 64, which "
                          r"does not divide the 32 each rank holds; use another tensor_parallel_size"),
                         {"quantization": "int8"}),
    "quant_mismatch": ({"engine": {"quantization": "awq"}},
                       "quantization: 'awq' was asked for, but the checkpoint is in 'gptq'", {"quantization": "gptq"}),
    "prefill_pool": ({"model": "pagedserve-tiny-moe",
                      "disaggregation": {"prefill": {"engine": {"tensor_parallel_size": 3}}}},
                     "tensor_parallel_size: 3 does not divide num_attention_heads=4", {}),
    "max_model_len": ({"model": "pagedserve-tiny", "engine": {"max_model_len": 100_000}},
                      "max_model_len: 100000 exceeds the model's limit of 4096", {"max_model_len": 4096}),
}


@pytest.fixture
def gptq_folder(tmp_path):
    """A GPTQ checkpoint folder holding its config.json alone: what build_app reads (never the weights)."""
    folder = tmp_path / "gptq"
    folder.mkdir()
    quant = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
    (folder / "config.json").write_text(json.dumps({**BUILTIN_MODELS["pagedserve-tiny"], "quantization_config": quant}))
    return folder


@pytest.mark.parametrize("case", UNRUNNABLE)
def test_build_app_refuses_what_the_model_cannot_run_before_starting_anything(case, gptq_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path / "cache"))  # a built-in model must not be written
    args, message, fix = UNRUNNABLE[case]
    args = {"model": str(gptq_folder), **args}
    children, ray_was_up = _children(), ray.is_initialized()  # other tests of the session may have started Ray
    start = time.monotonic()
    with pytest.raises(ValueError, match=message):
        build_app(AppArgs.model_validate(args))
    assert time.monotonic() - start < 5
    assert _children() == children and ray.is_initialized() == ray_was_up  # no worker process, no actor, no Ray
    fixed = {**args, "engine": {**args.get("engine", {}), **fix}}
    if case == "prefill_pool":
        fixed["disaggregation"] = {"prefill": {"engine": {"tensor_parallel_size": 2}}}
    build_app(AppArgs.model_validate(fixed))
    assert not (tmp_path / "cache").exists()


def test_build_app_leaves_a_hub_model_to_its_replicas(caplog):
    with caplog.at_level(logging.WARNING, logger="serve_app.app"):
        build_app(AppArgs.model_validate({"model": "org/unreadable-here", "engine": {"tensor_parallel_size": 3}}))
    assert "'org/unreadable-here' is no built-in model and no folder on this host" in caplog.text
    assert "checked against it by each replica as it starts" in caplog.text


def test_gpu_configs_and_manifests_say_they_have_not_run():
    root = CONFIGS[0].parents[1]
    gpu = sorted(root.glob("configs/gpu-*.yaml")) + sorted(root.glob("k8s/rayservice-gpu*.yaml"))
    assert len(gpu) == 5
    for path in gpu:
        header = "".join(line for line in path.read_text().splitlines(keepends=True)[:20] if line.startswith("#"))
        assert "UNVERIFIED" in header and "benchmarks/gpu_check.sh" in header, path.name


def test_a_data_parallel_deployment_has_one_replica_per_rank_and_does_not_autoscale():
    engine = {"data_parallel_size": 2, "enable_expert_parallel": True}
    args = AppArgs.model_validate({"model": "pagedserve-tiny-moe", "engine": engine})
    assert args.num_replicas == 2 and args.engine_config().data_parallel_size == 2
    with pytest.raises(ValueError, match="autoscaling_config: a data-parallel group"):
        AppArgs.model_validate({"model": "pagedserve-tiny-moe", "engine": engine,
                                "autoscaling_config": {"min_replicas": 1, "max_replicas": 4}})
    with pytest.raises(ValueError, match="num_replicas: 3, but the replicas of a data-parallel deployment"):
        AppArgs.model_validate({"model": "pagedserve-tiny-moe", "engine": engine, "num_replicas": 3})
