"""The shipped configs are valid Serve configs whose args are valid AppArgs and whose import paths
resolve; they build the application without starting anything."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app.app_args import AppArgs

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_config_is_valid(path):
    config = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(config)
    for app in schema.applications:
        module, attr = app.import_path.split(":")
        builder = getattr(importlib.import_module(module), attr)
        args = AppArgs.model_validate(app.args)
        assert builder.__annotations__["args"] is AppArgs  # a class, not a string: Ray validates args with it
        names = {d.name for d in app.deployments}
        assert names <= {"LLMServer", "OpenAIIngress"}, names
        assert args.engine_config().model == args.model


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
