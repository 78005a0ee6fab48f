"""The KubeRay deployment under k8s/, checked without a cluster and without starting Ray.

- every RayService under k8s/ against the RayService CRD's openAPIV3Schema (KubeRay v1.7, a copy in
  k8s/crd/), validated the way the API server does it for `kubectl apply` (unknown fields rejected,
  int-or-string, int32/int64, list-map keys unique), plus the KubeRay operator's own admission rules
  that apply to it, plus the shape we rely on (GPU workers, head without CPUs, autoscaling, drain).
- every RayService is closed by default (issue 19; ShadowRay, CVE-2023-48022): Ray's token
  authentication on, nothing but the Serve port reachable from outside the cluster, the app's API keys
  from a Secret, containers non-root on a read-only root filesystem with emptyDirs where Ray writes.
- its serveConfigV2 with Ray's ServeDeploySchema, its args with AppArgs, and every import path in it.
- k8s/grafana-dashboard.json: every metric a panel queries exists (ours, from serve_app/metrics.py,
  or Ray Serve's ray_serve_*), and every engine metric has a panel.
- k8s/podmonitor.yaml selects the head and worker pods and scrapes the port they name."""

from __future__ import annotations

import copy
import functools
import importlib
import json
import re
from pathlib import Path

import pytest
import yaml
from jsonschema import Draft4Validator, FormatChecker, ValidationError, validators

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
RAYSERVICE = K8S / "rayservice-gpu.yaml"
PODMONITOR = K8S / "podmonitor.yaml"
DASHBOARD = K8S / "grafana-dashboard.json"
README = K8S / "README.md"
# The CRD as published with KubeRay v1.7. The shared copy next to the repository is not there on a clean
# clone (CI), so the repository carries its own copy; the shared one, where present, must be identical.
SHARED_CRD = Path(__file__).resolve().parents[2].parent / "shared" / "kuberay" / "ray.io_rayservices.yaml"
CRD = K8S / "crd" / "ray.io_rayservices.yaml"

IMAGE = "ghcr.io/pagedserve/pagedserve:0.1.0-ray2.60.0-cu128"
RAY_VERSION = "2.60.0"
# The router class `router: prefix` stands for, until serve_app.app_args.ROUTERS names it.

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the 1 MB CRD loads in ~0.1 s


def _load_yaml(path: Path):
    with path.open() as f:
        return yaml.load(f, Loader=_Loader)


# Every RayService manifest gets the schema and closed-by-default checks; the rest of this file checks
# the GPU one's shape.
RAYSERVICES = sorted(p for p in K8S.glob("*.yaml") if (_load_yaml(p) or {}).get("kind") == "RayService")


# --- the CRD schema as a validator (built once per module) ------------------------------------------------


def _structural(schema: dict) -> dict:
    """A CRD schema node as plain JSON Schema, with what the API server does implicitly made explicit:
    - unknown fields are errors (`kubectl apply` validates strictly by default; the server would
      otherwise prune them silently), unless the node preserves unknown fields;
    - `nullable: true` admits null.
    `x-kubernetes-int-or-string` needs nothing: the CRD spells it out as anyOf integer|string (the
    quantity `pattern` applies to strings only). The other x-kubernetes-* keywords are handled by the
    validator below; `format` by `_FORMATS`."""
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {name: _structural(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if isinstance(schema.get("additionalProperties"), dict):
        out["additionalProperties"] = _structural(schema["additionalProperties"])
    if isinstance(schema.get("items"), dict):
        out["items"] = _structural(schema["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        if key in schema:
            out[key] = [_structural(sub) for sub in schema[key]]
    if "not" in schema:
        out["not"] = _structural(schema["not"])
    if schema.get("nullable") and isinstance(schema.get("type"), str):
        out["type"] = [schema["type"], "null"]
    return out


def _list_type(validator, list_type, instance, schema):
    """x-kubernetes-list-type: `set` items are unique; `map` items are unique by their
    x-kubernetes-list-map-keys (a key left out takes its schema default, e.g. protocol TCP)."""
    if not validator.is_type(instance, "array"):
        return
    if list_type == "set":
        for i, item in enumerate(instance):
            if item in instance[:i]:
                yield ValidationError(f"duplicate item {item!r} in a list of type set")
    elif list_type == "map":
        keys = schema.get("x-kubernetes-list-map-keys", [])
        defaults = {k: schema.get("items", {}).get("properties", {}).get(k, {}).get("default") for k in keys}
        seen: dict[tuple, int] = {}
        for i, item in enumerate(instance):
            if not isinstance(item, dict):
                continue
            key = tuple(item.get(k, defaults[k]) for k in keys)
            if key in seen:
                yield ValidationError(f"items {seen[key]} and {i} have the same key {dict(zip(keys, key))}")
            seen.setdefault(key, i)


def _cel_rules(validator, rules, instance, schema):
    """x-kubernetes-validations are CEL expressions, not evaluated here (the CRD has three, on managedBy
    and on gcsFaultToleranceOptions.backend). Using such a field fails, so that whoever adds one checks
    its rules by hand and extends this test."""
    yield ValidationError(
        "field guarded by CEL rules this test does not evaluate: " + "; ".join(r["rule"] for r in rules)
    )


_FORMATS = FormatChecker(formats=())


@_FORMATS.checks("int32")
def _int32(value) -> bool:
    return not isinstance(value, int) or -(2**31) <= value < 2**31


@_FORMATS.checks("int64")
def _int64(value) -> bool:
    return not isinstance(value, int) or -(2**63) <= value < 2**63


# OpenAPI v3.0 schemas are a Draft 4 dialect.
_KubeValidator = validators.extend(
    Draft4Validator, {"x-kubernetes-list-type": _list_type, "x-kubernetes-validations": _cel_rules}
)


@functools.cache
def crd() -> dict:
    return _load_yaml(CRD)


@functools.cache
def rayservice_validator():
    (v1,) = [v for v in crd()["spec"]["versions"] if v["name"] == "v1"]
    assert v1["served"] and v1["storage"]
    return _KubeValidator(_structural(v1["schema"]["openAPIV3Schema"]), format_checker=_FORMATS)


def schema_errors(doc: dict) -> list[str]:
    errors = sorted(rayservice_validator().iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))
    return ["/".join(map(str, e.absolute_path)) + ": " + e.message for e in errors]


# --- the documents ----------------------------------------------------------------------------------------


@functools.cache
def _rayservice(path: Path = RAYSERVICE) -> dict:
    return _load_yaml(path)


@pytest.fixture
def rayservice() -> dict:
    return copy.deepcopy(_rayservice())


@pytest.fixture(params=RAYSERVICES, ids=[p.name for p in RAYSERVICES])
def any_rayservice(request) -> dict:
    return copy.deepcopy(_rayservice(request.param))


@pytest.fixture
def serve_config(rayservice) -> dict:
    return yaml.safe_load(rayservice["spec"]["serveConfigV2"])


@pytest.fixture
def app(serve_config) -> dict:
    (app,) = serve_config["applications"]
    return app


def deployment(app: dict, name: str) -> dict:
    (d,) = [d for d in app["deployments"] if d["name"] == name]
    return d


def cluster(rayservice: dict) -> dict:
    return rayservice["spec"]["rayClusterConfig"]


def head_container(rayservice: dict) -> dict:
    return cluster(rayservice)["headGroupSpec"]["template"]["spec"]["containers"][0]


def gpu_group(rayservice: dict) -> dict:
    (group,) = cluster(rayservice)["workerGroupSpecs"]
    return group


def worker_container(rayservice: dict) -> dict:
    return gpu_group(rayservice)["template"]["spec"]["containers"][0]


def cluster_group(rayservice: dict, group: str) -> dict:
    rc = cluster(rayservice)
    if group == "head":
        return rc["headGroupSpec"]
    return next(g for g in rc["workerGroupSpecs"] if g["groupName"] == group)


def ports(container: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container.get("ports", [])}


# --- the CRD copy -----------------------------------------------------------------------------------------


def test_crd_copy_is_the_rayservice_crd():
    doc = crd()
    assert doc["kind"] == "CustomResourceDefinition"
    assert doc["metadata"]["name"] == "rayservices.ray.io"
    assert {v["name"] for v in doc["spec"]["versions"]} >= {"v1"}
    assert 500_000 < CRD.stat().st_size < 2_000_000  # ~1 MB: the full schema, pod templates included


def test_crd_copy_matches_shared_copy():
    if not SHARED_CRD.exists():
        pytest.skip(f"{SHARED_CRD} is not there (a clean clone): nothing to compare with")
    assert CRD.read_bytes() == SHARED_CRD.read_bytes(), f"update {CRD} from {SHARED_CRD}"


# --- RayService: the CRD schema ---------------------------------------------------------------------------


def test_every_rayservice_is_checked():
    assert RAYSERVICE in RAYSERVICES


def test_rayservice_is_valid_for_the_crd(any_rayservice):
    assert any_rayservice["apiVersion"] == "ray.io/v1"
    assert any_rayservice["kind"] == "RayService"
    assert schema_errors(any_rayservice) == []


def _set(doc: dict, path: str, value) -> dict:
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return doc


_DELETE = object()
_WORKER = "spec.rayClusterConfig.workerGroupSpecs.0"
_WORKER_CONTAINER = _WORKER + ".template.spec.containers.0"


@pytest.mark.parametrize(
    "path, value, expected",
    [
        # a wrong type deep inside a container spec
        (_WORKER_CONTAINER + ".ports.0.containerPort", "eight thousand", "'eight thousand' is not of type 'integer'"),
        (_WORKER_CONTAINER + ".resources.limits.cpu", "lots", "does not match"),  # not a quantity
        (_WORKER_CONTAINER + ".ports.0.containerPort", 2**31, "is not a 'int32'"),
        (_WORKER_CONTAINER + ".lifecycle.preStop.exec.command", "sleep 120", "is not of type 'array'"),
        (_WORKER + ".minReplica", 1, "Additional properties are not allowed ('minReplica'"),  # a typo
        (_WORKER + ".groupName", _DELETE, "'groupName' is a required property"),
        ("spec.rayClusterConfig.autoscalerOptions.version", "v3", "is not one of ['v1', 'v2']"),
        ("spec.rayClusterConfig.enableInTreeAutoscaling", "true", "is not of type 'boolean'"),
        ("spec.serveConfigV2", {"applications": []}, "is not of type 'string'"),
        ("spec.managedBy", "someone", "CEL rules"),
        ("spec.rayClusterConfig.authOptions.mode", "Token", "is not one of ['disabled', 'token']"),
        ("spec.rayClusterConfig.authOptions.secret", "x", "Additional properties are not allowed ('secret'"),
        (_WORKER + ".template.spec.securityContext.runAsUser", "1000", "is not of type 'integer'"),
        (_WORKER_CONTAINER + ".securityContext.capabilities.drop", "ALL", "is not of type 'array'"),
        ("spec.serveService.spec.type", ["LoadBalancer"], "is not of type 'string'"),
    ],
)
def test_crd_validation_rejects_broken_manifests(rayservice, path, value, expected):
    errors = schema_errors(_set(rayservice, path, value))
    assert errors, f"setting {path} to {value!r} went unnoticed"
    assert any(expected in e for e in errors), errors


def test_crd_validation_rejects_duplicate_list_map_keys(rayservice):
    container = worker_container(rayservice)
    container["ports"].append({"containerPort": container["ports"][0]["containerPort"], "name": "again"})
    assert any("have the same key" in e for e in schema_errors(rayservice))  # same port, protocol TCP by default


# --- RayService: KubeRay's own admission rules (ray-operator utils/validation.go, v1.7) ---------------------


def test_rayservice_passes_kuberay_operator_validation(rayservice):
    name = rayservice["metadata"]["name"]
    assert len(name) <= 47, "RayService names are at most 47 characters (53 minus the cluster suffix)"
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name), "a DNS-1035 label"
    spec = rayservice["spec"]
    assert spec.get("upgradeStrategy", {}).get("type", "NewCluster") in {
        "NewCluster", "NewClusterWithIncrementalUpgrade", "None"}
    rc = cluster(rayservice)
    assert "name" not in rc["headGroupSpec"].get("headService", {}).get("metadata", {})
    groups = [("head", rc["headGroupSpec"])] + [(g["groupName"], g) for g in rc["workerGroupSpecs"]]
    for group_name, group in groups:
        assert group["template"]["spec"]["containers"], group_name
        params = group.get("rayStartParams", {})
        assert not ({"num-cpus", "num-gpus", "memory", "resources"} & set(params) and group.get("resources")), (
            f"{group_name}: resources set in both rayStartParams and resources"
        )
        assert "labels" not in params, group_name
        # autoscaler v2: the operator rejects any other restartPolicy
        assert group["template"]["spec"].get("restartPolicy", "Never") == "Never", group_name
        env = {e["name"] for e in group["template"]["spec"]["containers"][0].get("env", [])}
        assert "RAY_enable_autoscaler_v2" not in env, "set autoscalerOptions.version only"
    for group in rc["workerGroupSpecs"]:
        assert 0 <= group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]


# --- RayService: the cluster we rely on -------------------------------------------------------------------


def test_cluster_shape(rayservice):
    rc = cluster(rayservice)
    assert rc["rayVersion"] == RAY_VERSION
    assert rc["enableInTreeAutoscaling"] is True
    assert rc["autoscalerOptions"]["version"] == "v2"

    head = head_container(rayservice)
    assert rc["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # no replica is ever placed on the head
    assert ports(head) == {"gcs": 6379, "dashboard": 8265, "serve": 8000, "metrics": 8080}
    for kind in ("requests", "limits"):
        assert not any(r.endswith("gpu") for r in head["resources"].get(kind, {})), "the head has no GPU"
    assert "num-gpus" not in rc["headGroupSpec"]["rayStartParams"]

    group = gpu_group(rayservice)
    worker = worker_container(rayservice)
    assert (group["minReplicas"], group["maxReplicas"]) == (1, 4)
    limits = worker["resources"]["limits"]
    assert str(limits["nvidia.com/gpu"]) == "1"
    assert {"cpu", "memory"} <= set(limits)
    # Ray reads num-cpus / num-gpus / memory from the limits; requests must not ask for less.
    assert worker["resources"].get("requests", limits) == limits
    assert not {"num-cpus", "num-gpus", "memory"} & set(group["rayStartParams"])
    assert ports(worker)["metrics"] == 8080

    for container in (head, worker):
        assert container["image"] == IMAGE
        assert f"ray{RAY_VERSION}" in container["image"], "the image's Ray must be rayVersion"


def _cpus(quantity) -> float:
    q = str(quantity)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def test_replicas_fit_the_worker_pods(rayservice, app):
    """Every LLMServer replica lands on its own GPU pod; the ingress cannot land on the head; the
    replica bounds of our policy match the worker group's pod bounds."""
    args = app["args"]
    group = gpu_group(rayservice)
    limits = worker_container(rayservice)["resources"]["limits"]
    engine_actor = args["ray_actor_options"]
    ingress_actor = deployment(app, "OpenAIIngress")["ray_actor_options"]
    assert engine_actor["num_gpus"] == int(limits["nvidia.com/gpu"]) == 1
    assert engine_actor["num_cpus"] + ingress_actor["num_cpus"] <= _cpus(limits["cpu"])
    assert ingress_actor["num_cpus"] > 0, "with 0 CPUs the ingress could be placed on the head (num-cpus 0)"
    autoscaling = deployment(app, "LLMServer")["autoscaling_config"]
    assert (autoscaling["max_replicas"]
            <= group["maxReplicas"] * int(limits["nvidia.com/gpu"]) // engine_actor["num_gpus"])
    assert (autoscaling["min_replicas"], autoscaling["max_replicas"]) == (group["minReplicas"], group["maxReplicas"])


def test_worker_pods_drain_streams_before_they_stop(rayservice, app):
    spec = gpu_group(rayservice)["template"]["spec"]
    command = " ".join(worker_container(rayservice)["lifecycle"]["preStop"]["exec"]["command"])
    sleep = re.search(r"\bsleep (\d+)\b", command)
    assert sleep, command
    sleep_s = int(sleep.group(1))
    assert sleep_s >= app["args"]["graceful_shutdown_timeout_s"], "the preStop sleep covers Serve's graceful stop"
    assert spec["terminationGracePeriodSeconds"] > sleep_s, "room for `ray stop` after the sleep"


# --- RayService: closed by default ------------------------------------------------------------------------
# A Ray cluster whose dashboard or job API can be reached runs anyone's code (ShadowRay, CVE-2023-48022).

RAY_HOME = "/home/ray"  # the `ray` user's home in rayproject/ray images (uid 1000, group users 100)
RAY_UID = 1000
_RAY_AUTH_ENV = {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"}  # tests/k8s/test_ray_token_auth.py


def pod_templates(rayservice: dict) -> dict[str, dict]:
    rc = cluster(rayservice)
    return {"head": rc["headGroupSpec"]["template"]} | {g["groupName"]: g["template"] for g in rc["workerGroupSpecs"]}


def _containers(template: dict) -> list[dict]:
    return template["spec"]["containers"] + template["spec"].get("initContainers", [])


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:3])


def test_ray_token_authentication_is_on(any_rayservice):
    rc = cluster(any_rayservice)
    auth = rc.get("authOptions", {})
    assert auth.get("mode") == "token", "KubeRay turns token auth on for an explicit `mode: token` only"
    assert auth.get("secretName"), "a Secret we name: KubeRay's generated one is renamed on every cluster upgrade"
    assert not auth.get("enableK8sTokenAuth"), "KubeRay v1.7 rejects Kubernetes token auth for a RayService"
    assert _version(rc["rayVersion"]) >= (2, 52), "KubeRay rejects token auth before Ray 2.52"
    # KubeRay adds RAY_AUTH_MODE and RAY_AUTH_TOKEN only to containers that do not set them (pod.go,
    # SetContainerTokenAuthEnvVars), and appends autoscalerOptions.env after its own: one set here wins.
    envs = [(f"{group}/{c['name']}", c.get("env", [])) for group, t in pod_templates(any_rayservice).items()
            for c in _containers(t)] + [("autoscaler", rc.get("autoscalerOptions", {}).get("env", []))]
    for where, env in envs:
        assert not _RAY_AUTH_ENV & {e["name"] for e in env}, where


_EXTERNAL = {"LoadBalancer", "NodePort"}
# KubeRay's head Service ports when the head container names none (ray-operator common/service.go).
_KUBERAY_DEFAULT_PORTS = {"client": 10001, "gcs-server": 6379, "dashboard": 8265, "metrics": 8080, "serve": 8000}


def reachable_from_outside(rayservice: dict) -> set[tuple[str, int]]:
    """(what, port) a client outside the cluster can reach, with the Services KubeRay v1.7 builds
    (ray-operator common/service.go) and what pods publish on their node themselves."""
    rc = cluster(rayservice)
    head = rc["headGroupSpec"]
    head_ports = ports(head_container(rayservice)) or dict(_KUBERAY_DEFAULT_PORTS)
    head_ports.setdefault("metrics", 8080)
    # headGroupSpec.serviceType is the default type of both the head and the serve Service
    default_type = head.get("serviceType") or "ClusterIP"
    head_svc = head.get("headService", {}).get("spec", {})
    serve_svc = rayservice["spec"].get("serveService", {}).get("spec", {})
    found = set()
    if head_svc.get("type", default_type) in _EXTERNAL:
        head_ports |= {p.get("name", str(p["port"])): p["port"] for p in head_svc.get("ports", [])}
        found |= {(f"head-svc {name}", port) for name, port in head_ports.items()}
    if serve_svc.get("type", default_type) in _EXTERNAL:
        # only the head container's ports named serve or serve-*; a listed port of the same name replaces one
        listed = {p.get("name"): p["port"] for p in serve_svc.get("ports", [])}
        found |= {(f"serve-svc {name}", listed.get(name, port)) for name, port in head_ports.items()
                  if name == "serve" or name.startswith("serve-")}
    if head.get("enableIngress"):
        found.add(("head ingress dashboard", head_ports.get("dashboard", 8265)))
    for group, template in pod_templates(rayservice).items():
        if template["spec"].get("hostNetwork"):
            found.add((f"{group} hostNetwork: every port", 0))
        for c in _containers(template):
            found |= {(f"{group}/{c['name']} hostPort", p["hostPort"]) for p in c.get("ports", []) if p.get("hostPort")}
    return found


def test_only_the_serve_port_leaves_the_cluster(any_rayservice):
    serve_port = yaml.safe_load(any_rayservice["spec"]["serveConfigV2"])["http_options"]["port"]
    assert reachable_from_outside(any_rayservice) == {("serve-svc serve", serve_port)}
    # explicit, so that publishing Serve is never done by changing the type both Services default to
    assert cluster(any_rayservice)["headGroupSpec"]["serviceType"] == "ClusterIP"


@pytest.mark.parametrize(
    "path, value",
    [
        ("spec.rayClusterConfig.headGroupSpec.serviceType", "LoadBalancer"),  # the ShadowRay cluster
        ("spec.rayClusterConfig.headGroupSpec.headService", {"spec": {"type": "NodePort"}}),
        ("spec.rayClusterConfig.headGroupSpec.enableIngress", True),
        (_WORKER + ".template.spec.hostNetwork", True),
        (_WORKER_CONTAINER + ".ports.0.hostPort", 8000),
    ],
)
def test_exposure_check_catches_a_published_control_plane(rayservice, path, value):
    before = reachable_from_outside(rayservice)
    broken = _set(rayservice, path, value)
    assert schema_errors(broken) == [], "valid for the CRD: only this test stands in the way"
    assert reachable_from_outside(broken) - before


def test_api_keys_come_from_a_secret(any_rayservice):
    from serve_app.app_args import AppArgs

    for app in yaml.safe_load(any_rayservice["spec"]["serveConfigV2"])["applications"]:
        args = AppArgs.model_validate(app["args"])
        assert args.api_keys_env and not args.api_keys, "keys in serveConfigV2 would sit in the RayService"
        # the ingress replicas run on the workers (never on the head: test_replicas_fit_the_worker_pods)
        for group in cluster(any_rayservice)["workerGroupSpecs"]:
            env = group["template"]["spec"]["containers"][0].get("env", [])
            (var,) = [e for e in env if e["name"] == args.api_keys_env]
            assert "value" not in var and not var["valueFrom"]["secretKeyRef"].get("optional"), (
                "from a Secret, and required: without it the pod must not start")
            assert args.resolve_api_keys({var["name"]: "key-one,key-two"}) == ["key-one", "key-two"]


def _writable(container: dict, volumes: dict[str, dict], path: str) -> bool:
    for m in container.get("volumeMounts", []):
        if (path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")) and not m.get("readOnly"):
            return "emptyDir" in volumes[m["name"]]
    return False


def engine_write_paths(env: dict[str, str]) -> dict[str, str]:
    """Where the engine and its libraries write at run time on a worker, given its env."""
    return {
        "Hugging Face hub": env.get("HF_HOME", f"{RAY_HOME}/.cache/huggingface"),
        "built-in model (engine/models/builtin.py)": env.get("PAGEDSERVE_CACHE", f"{RAY_HOME}/.cache/pagedserve"),
        "torch C++ extensions": env.get("TORCH_EXTENSIONS_DIR", f"{RAY_HOME}/.cache/torch_extensions"),
        "FlashInfer JIT kernels": env.get("FLASHINFER_WORKSPACE_BASE", RAY_HOME) + "/.cache/flashinfer",
        "Triton": env.get("TRITON_CACHE_DIR", env.get("TRITON_HOME", RAY_HOME) + "/.triton/cache"),
        "CUDA JIT": env.get("CUDA_CACHE_PATH", f"{RAY_HOME}/.nv/ComputeCache"),
    }


_LOCKED_DOWN = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True}


def test_containers_run_as_non_root_on_a_read_only_root(any_rayservice):
    rc = cluster(any_rayservice)
    for group, template in pod_templates(any_rayservice).items():
        spec = template["spec"]
        pod = spec.get("securityContext", {})
        # pod-level: also covers the containers KubeRay adds (autoscaler, wait-gcs-ready)
        assert (pod.get("runAsNonRoot"), pod.get("runAsUser"), pod.get("seccompProfile")) == (
            True, RAY_UID, {"type": "RuntimeDefault"}), group
        assert not any(spec.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), group
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in _containers(template):
            sc = c.get("securityContext", {})
            assert {k: sc.get(k) for k in _LOCKED_DOWN} == _LOCKED_DOWN, f"{group}/{c['name']}"
            assert not sc.get("privileged") and sc.get("runAsUser", RAY_UID) != 0 and sc.get("runAsNonRoot", True)
            for m in c.get("volumeMounts", []):
                assert "emptyDir" in volumes[m["name"]], f"{group}/{c['name']}: {m['name']} is scratch space"
        ray = spec["containers"][0]
        session = cluster_group(any_rayservice, group).get("rayStartParams", {}).get("temp-dir", "/tmp/ray")
        for path in (session + "/session_latest/logs", "/tmp/tmpabc123"):  # Ray's session folder, tempfile
            assert _writable(ray, volumes, path), f"{group}: {path}"
        if group != "head":  # where the engine runs
            env = {e["name"]: e["value"] for e in ray.get("env", []) if "value" in e}
            for what, path in engine_write_paths(env).items():
                assert _writable(ray, volumes, path), f"{group}: {what} writes {path} on a read-only root"
    autoscaler = rc.get("autoscalerOptions", {})
    assert {k: autoscaler.get("securityContext", {}).get(k) for k in _LOCKED_DOWN} == _LOCKED_DOWN
    head_volumes = {v["name"]: v for v in rc["headGroupSpec"]["template"]["spec"].get("volumes", [])}
    assert _writable(autoscaler, head_volumes, "/tmp/tmpabc123"), "the autoscaler sidecar's /tmp"


def test_write_path_check_catches_a_missing_cache_volume(rayservice):
    worker = worker_container(rayservice)
    volumes = {v["name"]: v for v in gpu_group(rayservice)["template"]["spec"]["volumes"]}
    env = {e["name"]: e["value"] for e in worker["env"] if "value" in e}
    assert _writable(worker, volumes, engine_write_paths(env)["Hugging Face hub"])
    assert not _writable(worker, volumes, engine_write_paths({})["Triton"])  # ~/.triton without TRITON_HOME
    worker["volumeMounts"] = [m for m in worker["volumeMounts"] if m["mountPath"] != f"{RAY_HOME}/.cache"]
    assert not _writable(worker, volumes, engine_write_paths(env)["Hugging Face hub"])


# --- serveConfigV2 ----------------------------------------------------------------------------------------


def test_serve_config_is_a_valid_serve_deploy_schema(serve_config, rayservice):
    from ray.serve.config import AutoscalingConfig
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config)  # imports the policy and router classes too
    (app,) = schema.applications
    assert app.import_path == "serve_app.app:build_app"
    assert app.route_prefix == "/"
    assert schema.http_options.host == "0.0.0.0"
    assert (schema.http_options.port == ports(head_container(rayservice))["serve"]
            == ports(worker_container(rayservice))["serve"])
    if rayservice["spec"].get("excludeHeadPodFromServeSvc"):
        # the serve Service then points at worker pods only: they need proxies of their own
        assert serve_config["proxy_location"] == "EveryNode"
    for d in serve_config["applications"][0]["deployments"]:
        if "autoscaling_config" in d:
            AutoscalingConfig(**d["autoscaling_config"])
            assert "num_replicas" not in d


def test_serve_config_names_the_apps_deployments(app):
    from serve_app.ingress import OpenAIIngress
    from serve_app.llm_server import LLMServer

    assert {d["name"] for d in app["deployments"]} <= {LLMServer.name, OpenAIIngress.name}


def test_llm_server_autoscales_with_our_policy(app):
    autoscaling = deployment(app, "LLMServer")["autoscaling_config"]
    assert {k: autoscaling[k] for k in ("min_replicas", "max_replicas", "metrics_interval_s", "look_back_period_s",
                                        "upscale_delay_s", "downscale_delay_s")} == {
        "min_replicas": 1, "max_replicas": 4, "metrics_interval_s": 1, "look_back_period_s": 5,
        "upscale_delay_s": 0, "downscale_delay_s": 0,
    }
    policy = autoscaling["policy"]
    assert policy["policy_function"] == "autoscale.ray_policy:KVQueueAutoscalingPolicy"
    assert policy["policy_kwargs"]["target_kv_cache_usage"] == 0.75
    assert policy["policy_kwargs"]["target_waiting_per_replica"] == 2


def test_app_args_validate(app):
    from serve_app.app_args import AppArgs

    args = app["args"]
    assert args["router"] == "prefix"
    assert args["model"] == "meta-llama/Llama-3.1-8B-Instruct"
    assert {k: args["engine"][k] for k in ("device", "dtype", "attention_backend")} == {
        "device": "cuda", "dtype": "bfloat16", "attention_backend": "flashinfer"
    }
    validated = AppArgs.model_validate(args)
    assert validated.router == "prefix"
    assert validated.engine_config().model == args["model"]
    assert validated.graceful_shutdown_timeout_s == args["graceful_shutdown_timeout_s"]


def test_app_args_match_the_gpu_config(app):
    """The manifest serves what configs/gpu-llama3-8b.yaml serves; change both together."""
    (gpu_app,) = _load_yaml(ROOT / "configs" / "gpu-llama3-8b.yaml")["applications"]
    for key in ("model", "served_model_name", "ray_actor_options"):
        assert app["args"][key] == gpu_app["args"][key], key
    assert app["args"]["engine"] == gpu_app["args"]["engine"]


def test_tensor_parallel_replica_fits_one_gpu_pod():
    """The TP=4 manifest: a replica's placement group (4 bundles, STRICT_PACK) fits one worker pod beside
    an ingress replica, one replica per pod, and the app is configs/gpu-llama3-70b-tp4.yaml's."""
    from serve_app.app_args import AppArgs
    from serve_app.placement import placement_shortfall

    rayservice = _rayservice(K8S / "rayservice-gpu-tp4.yaml")
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    args = AppArgs.model_validate(app["args"])
    engine = args.engine_config()
    placement = args.placement(engine)
    assert engine.tensor_parallel_size == 4 and engine.distributed_executor_backend == "ray"
    limits = worker_container(rayservice)["resources"]["limits"]
    pod = {"GPU": float(limits["nvidia.com/gpu"]), "CPU": _cpus(limits["cpu"])}
    ingress_cpus = deployment(app, "OpenAIIngress")["ray_actor_options"]["num_cpus"]
    bundles = placement["placement_group_bundles"]
    assert placement["placement_group_strategy"] == "STRICT_PACK" and len(bundles) == 4
    assert sum(b["GPU"] for b in bundles) == pod["GPU"]  # one replica per pod
    assert placement_shortfall(bundles + [{"CPU": ingress_cpus}], "STRICT_PACK", [pod]) is None
    autoscaling = deployment(app, "LLMServer")["autoscaling_config"]
    assert autoscaling["max_replicas"] == gpu_group(rayservice)["maxReplicas"]
    (config_app,) = _load_yaml(ROOT / "configs" / "gpu-llama3-70b-tp4.yaml")["applications"]
    for key in ("model", "served_model_name", "ray_actor_options", "placement_group_config", "engine"):
        assert app["args"][key] == config_app["args"][key], key


# --- import paths -----------------------------------------------------------------------------------------


def _split(path: str) -> tuple[str, str]:
    """`pkg.mod:attr` or `pkg.mod.attr` (Ray accepts both)."""
    return tuple(path.split(":")) if ":" in path else tuple(path.rsplit(".", 1))  # type: ignore[return-value]


def test_builder_import_path_resolves(serve_config):
    from serve_app.app_args import AppArgs

    for app in serve_config["applications"]:
        module, attr = _split(app["import_path"])
        builder = getattr(importlib.import_module(module), attr)
        assert callable(builder)
        assert builder.__annotations__["args"] is AppArgs  # Ray validates `args` with it


def _policy_paths(serve_config) -> list[tuple[str, dict]]:
    found = []
    for app in serve_config["applications"]:
        if app.get("autoscaling_policy"):
            found.append((app["autoscaling_policy"]["policy_function"],
                          app["autoscaling_policy"].get("policy_kwargs", {})))
        for d in app.get("deployments", []):
            policy = (d.get("autoscaling_config") or {}).get("policy")
            if policy:
                found.append((policy["policy_function"], policy.get("policy_kwargs", {})))
    return found


def test_autoscaling_policies_resolve(serve_config):
    paths = _policy_paths(serve_config)
    assert paths == [("autoscale.ray_policy:KVQueueAutoscalingPolicy", paths[0][1])]
    for path, kwargs in paths:
        module, attr = _split(path)
        policy = getattr(importlib.import_module(module), attr)
        if isinstance(policy, type):
            policy = policy(**kwargs)  # Serve builds a class policy once with policy_kwargs: bad kwargs fail here
        assert callable(policy)


def _router_paths(serve_config) -> list[str]:
    from serve_app.app_args import ROUTERS

    found = []
    for app in serve_config["applications"]:
        router = app.get("args", {}).get("router")
        if router is not None:
            found.append(ROUTERS[router])
        for d in app.get("deployments", []):
            cls = (d.get("request_router_config") or {}).get("request_router_class")
            if cls:
                found.append(cls)
    return [p for p in found if p]


def test_request_routers_resolve(serve_config):
    from ray.serve.request_router import RequestRouter

    paths = _router_paths(serve_config)
    assert paths, "router: prefix names a router class"
    for path in paths:
        module, attr = _split(path)
        router = getattr(importlib.import_module(module), attr)
        assert isinstance(router, type) and issubclass(router, RequestRouter), router


# --- Grafana dashboard ------------------------------------------------------------------------------------


@functools.cache
def engine_metrics() -> dict[str, str]:
    """name (as Ray exports it, `ray_` + ours) -> kind, from serve_app/metrics.py itself (an engine replica's
    metrics, and a decode replica's disaggregation metrics)."""
    import serve_app.metrics as m

    found: dict[str, str] = {}

    def recorder(kind):
        class Recorder:
            def __init__(self, name, *args, **kwargs):
                found["ray_" + name] = kind

        return Recorder

    saved = {kind: getattr(m, kind) for kind in ("Gauge", "Counter", "Histogram")}
    try:
        for kind in saved:
            setattr(m, kind, recorder(kind))
        m.EngineMetrics("model", "replica")
        m.DisaggregationMetrics("model", "replica")
    finally:
        for kind, cls in saved.items():
            setattr(m, kind, cls)
    return found


def exported_series() -> set[str]:
    """What Prometheus sees: counters get `_total`, histograms `_bucket`, `_sum` and `_count`."""
    suffixes = {"Gauge": [""], "Counter": ["_total"], "Histogram": ["_bucket", "_sum", "_count"]}
    return {name + s for name, kind in engine_metrics().items() for s in suffixes[kind]}


_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (enough PromQL for dashboards: no `__name__` matchers)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # ranges
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)  # label lists
    names = set()
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][\w:]*", s):
        if s[m.end():].lstrip().startswith("(") or m.group(0).lower() in _PROMQL_WORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group(0))
    return names


def _all_panels(dashboard: dict) -> list[dict]:
    panels = []
    for p in dashboard.get("panels", []):
        panels.append(p)
        panels.extend(p.get("panels", []))  # collapsed rows nest their panels
    return panels


def dashboard_queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL selector or expression) for every panel target and every query variable."""
    queries = [(p["title"], t["expr"]) for p in _all_panels(dashboard) for t in p.get("targets", [])]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"\s*label_values\((.*?)(?:,\s*\w+)?\)\s*", q)
            queries.append((f"${var['name']}", m.group(1) if m else q))
    return queries


def unknown_metrics(dashboard: dict) -> list[str]:
    known = exported_series()
    return [f"{where}: {name}" for where, expr in dashboard_queries(dashboard)
            for name in sorted(promql_metric_names(expr))
            if name not in known and not name.startswith("ray_serve_")]


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_engine_metrics_are_read_from_the_code():
    kinds = {
        "Gauge": ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"],
        "Counter": ["prompt_tokens", "generation_tokens", "prefix_cache_queries", "prefix_cache_hits",
                    "num_preemptions", "request_success"],
        "Histogram": ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                      "request_queue_time_seconds"],
    }
    expected = {f"ray_pagedserve_{name}": kind for kind, names in kinds.items() for name in names}
    assert expected.items() <= engine_metrics().items()


def test_promql_metric_names():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x=~"$y", z="sum(b)"}[$__rate_interval])))'
    ) == {"a_bucket"}
    assert promql_metric_names("sum(rate(a_total[5m])) by (replica) / on() group_left sum(b) * 1e3") == {"a_total", "b"}
    assert promql_metric_names("max by (deployment) (ray_serve_x{a='b'}) offset 5m") == {"ray_serve_x"}


def test_dashboard_identity(dashboard):
    assert dashboard["uid"] == "pagedserve"
    assert dashboard["schemaVersion"] >= 36
    assert dashboard["title"]
    ids = [p["id"] for p in _all_panels(dashboard)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for p in _all_panels(dashboard):
        if p["type"] != "row":
            assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert set(p["gridPos"]) == {"h", "w", "x", "y"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24


def test_dashboard_queries_only_existing_metrics(dashboard):
    assert unknown_metrics(dashboard) == []


def test_dashboard_metric_check_catches_typos(dashboard):
    broken = copy.deepcopy(dashboard)
    panel = next(p for p in _all_panels(broken) if p["type"] != "row")
    panel["targets"][0]["expr"] = panel["targets"][0]["expr"].replace("ray_pagedserve_", "ray_pagedsrv_", 1)
    assert unknown_metrics(broken)


def test_dashboard_covers_every_engine_metric(dashboard):
    used = set().union(*(promql_metric_names(e) for _, e in dashboard_queries(dashboard)))
    for name, kind in engine_metrics().items():
        series = {"Gauge": name, "Counter": name + "_total", "Histogram": name + "_bucket"}[kind]
        assert series in used, f"no panel shows {name}"
    assert "ray_serve_deployment_replica_healthy" in used
    assert "ray_serve_autoscaling_target_replicas" in used
    quantiles = [e for _, e in dashboard_queries(dashboard) if "histogram_quantile" in e]
    assert len(quantiles) >= 6
    for expr in quantiles:
        assert "_bucket" in expr and re.search(r"\bby \((\w+, )*le(, \w+)*\)", expr), expr


def test_dashboard_filters_on_the_label_the_podmonitor_adds(dashboard):
    relabeled = {r["targetLabel"] for e in _load_yaml(PODMONITOR)["spec"]["podMetricsEndpoints"]
                 for r in e.get("relabelings", [])}
    assert "ray_io_cluster" in relabeled
    assert any("ray_io_cluster" in expr for _, expr in dashboard_queries(dashboard))


# --- PodMonitor -------------------------------------------------------------------------------------------


def kuberay_pod_labels(template: dict, node_type: str, group: str, cluster_name: str) -> dict[str, str]:
    """The labels KubeRay puts on a Ray pod (ray-operator common/pod.go labelPod): its own, plus the
    template's, which cannot override node type, group or cluster."""
    labels = {
        "ray.io/is-ray-node": "yes",
        "ray.io/cluster": cluster_name,
        "ray.io/node-type": node_type,
        "ray.io/group": group,
        "ray.io/identifier": f"{cluster_name}-{node_type}",
        "app.kubernetes.io/name": "kuberay",
        "app.kubernetes.io/created-by": "kuberay-operator",
    }
    for k, v in template.get("metadata", {}).get("labels", {}).items():
        if k not in ("ray.io/node-type", "ray.io/group", "ray.io/cluster"):
            labels[k] = v
    return labels


def selects(selector: dict, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        present, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": present and value in e.get("values", []),
            "NotIn": not present or value not in e.get("values", []),
            "Exists": present,
            "DoesNotExist": not present,
        }[e["operator"]]
        if not ok:
            return False
    return True


def test_podmonitor_scrapes_the_ray_pods(rayservice):
    monitor = _load_yaml(PODMONITOR)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    selector = monitor["spec"]["selector"]
    # ray.io/cluster is generated (`<rayservice>-raycluster-<random>`, new on every upgrade): never match it
    assert "ray.io/cluster" not in selector.get("matchLabels", {})
    assert all(e["key"] != "ray.io/cluster" for e in selector.get("matchExpressions", []))

    rc = cluster(rayservice)
    name = rayservice["metadata"]["name"] + "-raycluster-x7k2p"
    pods = {"head": (kuberay_pod_labels(rc["headGroupSpec"]["template"], "head", "headgroup", name),
                     rc["headGroupSpec"]["template"]["spec"]["containers"][0],
                     rc["headGroupSpec"].get("rayStartParams", {}))}
    for g in rc["workerGroupSpecs"]:
        pods[g["groupName"]] = (kuberay_pod_labels(g["template"], "worker", g["groupName"], name),
                                g["template"]["spec"]["containers"][0], g.get("rayStartParams", {}))
    for pod, (labels, container, params) in pods.items():
        assert selects(selector, labels), f"the PodMonitor misses the {pod} pods: {labels}"
        for endpoint in monitor["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in ports(container), f"{pod} pods name no port {endpoint['port']!r}"
            port = ports(container)[endpoint["port"]]
            # Ray exports on metrics-export-port, which KubeRay sets to 8080 unless given
            assert port == int(params.get("metrics-export-port", 8080)) == 8080
            assert endpoint.get("path", "/metrics") == "/metrics"

    # ...and not every Ray pod in the namespace: another RayCluster's pods are left alone
    other = kuberay_pod_labels({}, "worker", "gpu", "other-cluster")
    assert not selects(selector, other)


# --- README -----------------------------------------------------------------------------------------------


def test_readme_matches_the_manifests(rayservice):
    text = README.read_text()
    assert text.startswith("## Deploying on Kubernetes (KubeRay)")
    assert IMAGE in text and "rayproject/ray:2.60.0-py311-cu128" in text and '".[gpu]"' in text
    assert "kubectl apply -f k8s/rayservice-gpu.yaml" in text
    name = rayservice["metadata"]["name"]
    assert f"svc/{name}-serve-svc" in text and f"svc/{name}-head-svc" in text
    assert "/v1/chat/completions" in text

    # closed by default: the Secrets as the manifest names them, the dashboard through a port-forward with
    # the token, what was and was not tried, token authentication for a local `serve run`
    rc = cluster(rayservice)
    ray_secret = rc["authOptions"]["secretName"]
    assert f"kubectl create secret generic {ray_secret} --from-literal=auth_token=" in text  # KubeRay's key
    (app,) = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"]
    (keys,) = [e["valueFrom"]["secretKeyRef"] for e in worker_container(rayservice)["env"]
               if e["name"] == app["args"]["api_keys_env"]]
    assert f"kubectl create secret generic {keys['name']} --from-literal={keys['key']}=" in text
    assert f"kubectl port-forward svc/{name}-head-svc 8265:8265" in text
    assert f"secret {ray_secret} -o jsonpath='{{.data.auth_token}}'" in text
    assert "export RAY_AUTH_MODE=token" in text and "RAY_AUTH_TOKEN=" in text  # names: test_ray_token_auth.py
    assert "ray get-auth-token --generate" in text and "serve run configs/default.yaml" in text
    assert "No pod has been started from these manifests here" in text
