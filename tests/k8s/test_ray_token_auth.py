"""Ray's token authentication as the manifests and k8s/README.md use it, checked against the installed Ray:
the variables KubeRay sets and the README names are the ones Ray reads, and a head node started the way
KubeRay starts one (`ray start --head --block` with RAY_AUTH_MODE=token and RAY_AUTH_TOKEN) refuses the
job API, which runs anyone's code, without the token."""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

README = Path(__file__).resolve().parents[2] / "k8s" / "README.md"
BIN = Path(sys.executable).parent


def _env(home: Path, **auth: str) -> dict[str, str]:
    """This process's environment without Ray's auth and address variables, with a HOME of its own (Ray
    also reads ~/.ray/auth_token), plus `auth`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    return {**env, "HOME": str(home), **auth}


# Each case: the environment (and ~/.ray/auth_token), then what Ray makes of it: token mode, and the header
# its clients (ray job, serve deploy/status, the state API) send. Ray reads the variables when it starts.
_PROBE = """
import json, os, sys
from click.testing import CliRunner
from ray._raylet import AuthenticationMode, AuthenticationTokenLoader, Config, get_authentication_mode
from ray.scripts.scripts import cli

loader, seen = AuthenticationTokenLoader.instance(), {}


def use(env):
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        os.environ.pop(k, None)
    os.environ.update(env)
    Config.initialize("")
    loader.reset_cache()


for name, env in json.loads(sys.argv[1]).items():
    use(env)
    seen[name] = [get_authentication_mode() == AuthenticationMode.TOKEN, loader.get_token_for_http_header()]
use({"RAY_AUTH_MODE": "token"})
generated = CliRunner().invoke(cli, ["get-auth-token", "--generate"])
seen["generated"] = [generated.exit_code, generated.stdout.strip()]
print(json.dumps(seen))
"""


def test_ray_reads_the_variables_kuberay_sets_and_the_readme_names(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    cases = {
        "kuberay": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "from-env"},  # what KubeRay puts on every pod
        "path": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)},
        "no mode": {"RAY_AUTH_TOKEN": "from-env"},  # a client without RAY_AUTH_MODE=token sends nothing
    }
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], env=_env(tmp_path), cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["kuberay"] == [True, {"authorization": "Bearer from-env"}]
    assert seen["path"] == [True, {"authorization": "Bearer from-a-file"}]
    assert seen["no mode"] == [False, {}]
    # `ray get-auth-token --generate` (the README's local recipe) writes the token where Ray looks by default
    code, printed = seen["generated"]
    assert code == 0 and printed == (tmp_path / ".ray" / "auth_token").read_text().strip() and len(printed) >= 32

    documented = set(re.findall(r"\bRAY_AUTH_[A-Z_]+", README.read_text()))
    assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN"} <= documented <= set().union(*cases.values())


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_a_head_started_like_kuberay_refuses_the_job_api_without_the_token(tmp_path):
    token = secrets.token_hex(32)
    gcs, dashboard, agent, client, metrics = _free_ports(5)
    # Every port given (others may run Ray on this machine) and a short temp dir of our own: Unix socket
    # paths stay under 108 bytes, and no one's `ray.init("auto")` finds this cluster.
    temp_dir = tempfile.mkdtemp(prefix="rta", dir="/tmp")
    log = (tmp_path / "ray-start.log").open("w")
    head = subprocess.Popen(
        # --no-monitor: KubeRay's flag when its autoscaler runs in a sidecar
        [str(BIN / "ray"), "start", "--head", "--block", "--no-monitor", f"--port={gcs}", "--num-cpus=0",
         "--disable-usage-stats", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
         f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}",
         f"--metrics-export-port={metrics}", f"--temp-dir={temp_dir}"],
        env=_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token), stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{dashboard}"
    job = {"entrypoint": "echo pwned"}
    try:
        deadline = time.monotonic() + 90
        while True:  # /api/gcs_healthz is public: KubeRay's probes call it without a token
            assert head.poll() is None, (tmp_path / "ray-start.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/api/gcs_healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the head did not come up in 90 s"
            time.sleep(0.5)

        assert httpx.post(url + "/api/jobs/", json=job, timeout=10).status_code == 401
        wrong = {"Authorization": "Bearer " + secrets.token_hex(32)}
        assert httpx.post(url + "/api/jobs/", json=job, headers=wrong, timeout=10).status_code == 403
        assert httpx.get(url + "/api/serve/applications/", timeout=10).status_code == 401  # serve deploy's API
        mode = httpx.get(url + "/api/authentication_mode", timeout=10).json()
        assert mode == {"authentication_mode": "token"}
        # ...and the token opens it (a GET: nothing runs)
        right = {"Authorization": "Bearer " + token}
        assert httpx.get(url + "/api/jobs/", headers=right, timeout=10).status_code == 200
    finally:
        head.terminate()  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
