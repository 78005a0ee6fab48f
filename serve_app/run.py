"""`python -m serve_app.run CONFIG`: what `make run` runs. `serve run CONFIG` with a graceful Ctrl-C.

`serve run` answers Ctrl-C with serve.shutdown(), whose first act is to kill the HTTP proxies (HAProxy,
or Ray's proxy actor): every stream in flight is cut, whatever graceful_shutdown_timeout_s says. Here
Ctrl-C first deletes the applications, which Serve does gracefully: the replicas stop taking requests and
finish their streams (up to graceful_shutdown_timeout_s) while the proxies still carry them; an idle app
is gone in about a second. Then Serve shuts down, and Ray with this process. A second Ctrl-C skips the
drain. The rest is `serve run`'s: a local Ray started here (or RAY_ADDRESS's), the config's
proxy_location, http_options and grpc_options, its applications deployed as `serve deploy` would."""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import ray
import yaml
from ray import serve
from ray.serve._private.api import serve_start
from ray.serve._private.application_state import StatusOverview
from ray.serve._private.client import ServeControllerClient
from ray.serve._private.constants import SERVE_NAMESPACE
from ray.serve.config import gRPCOptions
from ray.serve.generated.serve_pb2 import StatusOverview as StatusOverviewProto
from ray.serve.schema import ApplicationStatus, ServeDeploySchema

logger = logging.getLogger(__name__)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path, help="a Serve config file (configs/default.yaml)")
    args = parser.parse_args(argv)
    config = ServeDeploySchema.model_validate(yaml.safe_load(args.config.read_text()))

    ray.init(namespace=SERVE_NAMESPACE)
    # Serve's own CLI starts Serve and deploys a config through these (ray/serve/scripts.py, `serve run`).
    client = serve_start(http_options=config.http_options.model_dump(), proxy_location=config.proxy_location,
                         grpc_options=gRPCOptions(**config.grpc_options.model_dump()),
                         controller_options=config.controller_options)
    client.deploy_apps(config, _blocking=False)
    names = [app.name for app in config.applications]
    print(f"Deployed {', '.join(names)} from {args.config}; Ctrl-C stops it (streams in flight finish first).",
          flush=True)
    try:
        while True:
            time.sleep(10)
    except KeyboardInterrupt:
        pass
    print("Stopping: draining the requests in flight (Ctrl-C again to stop at once).", flush=True)
    try:
        client.delete_apps(names, blocking=False)
        wait_deleted(client, names)
    except KeyboardInterrupt:
        pass
    serve.shutdown()


def wait_deleted(client: ServeControllerClient, names: list[str], poll_s: float = 0.1) -> None:
    """Until Serve has deleted the applications, asked as Serve's own blocking delete asks, which polls
    once a second: up to a second of an idle app's Ctrl-C. A drain that hangs is bounded by each
    deployment's graceful_shutdown_timeout_s, after which Serve stops the replicas itself."""
    while True:
        statuses = ray.get(client._controller.get_serve_statuses.remote(names))
        if all(StatusOverview.from_proto(StatusOverviewProto.FromString(s)).app_status.status
               == ApplicationStatus.NOT_STARTED for s in statuses):
            return
        time.sleep(poll_s)


if __name__ == "__main__":
    main()
