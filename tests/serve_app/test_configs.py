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


def test_default_config_serves_the_builtin_model_on_cpu():
    config = yaml.safe_load((CONFIGS[0].parent / "default.yaml").read_text())
    args = AppArgs.model_validate(config["applications"][0]["args"])
    assert args.model == "pagedserve-tiny" and args.num_replicas == 2
    assert config["http_options"] == {"host": "127.0.0.1", "port": 8000}


def test_bad_args_name_the_field():
    with pytest.raises(ValueError, match="max_model_len"):
        AppArgs.model_validate({"engine": {"max_model_len": -1}})
    with pytest.raises(ValueError, match="router"):
        AppArgs.model_validate({"router": "random"})
    with pytest.raises(ValueError, match="num_replcas"):
        AppArgs.model_validate({"num_replcas": 2})
