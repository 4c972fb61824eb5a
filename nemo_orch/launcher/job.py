"""The training job's entry point (``python -m nemo_orch.launcher.job``, on every rank under
torchrun): wait until the services it was launched with are ready, then run the ``nemo-orch``
command with their endpoints as config overrides.

Expert servers are components of the training's SLURM heterogeneous job, and the Ray head
runs on its first training node, on fixed ports; their hosts come from SLURM itself
(``scontrol show hostnames`` of each component's node list, in the batch script) as
environment variables the addresses name (``${NEMO_ORCH_HOST_1}``), so nothing here asks the
scheduler for state. A server is ready when
``/health`` answers 200 (vLLM and trtllm-serve both serve it); the Ray cluster when all its
nodes joined (only the first rank, which runs the rollouts, waits for that); its address goes
to the command as ``RAY_ADDRESS``, which ``ray.init(address="auto")`` reads.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import httpx

from nemo_orch.train import preemption

POLL_INTERVAL_S = 5.0


class LaunchError(RuntimeError):
    """A service the job needs did not come up, or was named wrong."""


def expand(url: str) -> str:
    """``url`` with ``$VAR`` / ``${VAR}`` taken from the environment; all must be defined."""
    expanded = os.path.expandvars(url)
    if "$" in expanded:
        raise LaunchError(f"{url}: names an undefined environment variable")
    return expanded


def health_url(base_url: str) -> str:
    parts = urlsplit(base_url)
    return f"{parts.scheme}://{parts.netloc}/health"


def wait_until(ready: Callable[[], bool], what: str, deadline: float) -> None:
    announced = False
    while not ready():
        if time.monotonic() > deadline:
            raise LaunchError(f"{what} was not ready in time (launcher.startup_timeout_s)")
        if not announced and os.environ.get("RANK", "0") == "0":
            print(f"job: waiting for {what}", file=sys.stderr, flush=True)
            announced = True
        time.sleep(POLL_INTERVAL_S)


def is_healthy(base_url: str) -> bool:
    try:
        return httpx.get(health_url(base_url), timeout=10.0).status_code == 200
    except httpx.HTTPError:
        return False


def ray_nodes(address: str) -> int:
    """How many nodes of the Ray cluster at ``address`` are alive (0 while its head is not
    up)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=5.0).close()
    except OSError:
        return 0
    import ray  # the rollouts' extra; only a launch with a Ray cluster gets here

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return sum(node["Alive"] for node in ray.nodes())
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m nemo_orch.launcher.job", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--endpoint",
        action="append",
        default=[],
        metavar="KEY=URL",
        help="a server's base URL, waited for and passed as the override KEY=URL",
    )
    parser.add_argument(
        "--ray",
        default=None,
        metavar="HOST:PORT",
        help="the Ray cluster's head, waited for and passed as RAY_ADDRESS",
    )
    parser.add_argument(
        "--ray-nodes", type=int, default=1, help="the nodes the Ray cluster has once all joined"
    )
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for all of it")
    parser.add_argument(
        "command", nargs=argparse.REMAINDER, help="the nemo-orch command and its overrides"
    )
    args = parser.parse_args(argv)
    preemption.listen()
    deadline = time.monotonic() + args.timeout
    overrides = []
    try:
        for endpoint in args.endpoint:
            key, _, url = endpoint.partition("=")
            url = expand(url)
            wait_until(lambda url=url: is_healthy(url), f"{key} at {url}", deadline)
            overrides.append(f"++{key}={url}")  # ++: the key may be new (tools.endpoints)
        if args.ray is not None:
            address = expand(args.ray)
            if os.environ.get("RANK", "0") == "0":
                wait_until(
                    lambda: ray_nodes(address) >= args.ray_nodes,
                    f"the Ray cluster at {address} ({args.ray_nodes} nodes)",
                    deadline,
                )
            os.environ["RAY_ADDRESS"] = address
    except LaunchError as error:
        print(f"job: error: {error}", file=sys.stderr)
        return 1
    from nemo_orch import cli

    return cli.main([*args.command, *overrides])


if __name__ == "__main__":
    sys.exit(main())
