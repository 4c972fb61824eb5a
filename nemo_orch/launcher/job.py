"""The training job's entry point (``python -m nemo_orch.launcher.job``, on every rank under
torchrun): wait until the services it was launched with are ready, then run the ``nemo-orch``
command with their endpoints as config overrides.

Expert servers are components of the training's SLURM heterogeneous job, on fixed ports; their
hosts come from SLURM itself (``scontrol show hostnames`` of each component's node list, in the
batch script) as environment variables the endpoint URLs name (``${NEMO_ORCH_HOST_1}``), so
nothing here asks the scheduler for state. A server is ready when ``/health`` answers 200 (vLLM
and trtllm-serve both serve it). The Ray cluster is a job of its own: ready when NeMo-Run's
``ray.sub`` has written ``ray_cluster_info.json`` (once every node joined; it removes the file
when the cluster ends); its address goes to the command as ``RAY_ADDRESS``, which ``ray.init()``
reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
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


def ray_address(info_file: Path) -> str | None:
    """``head_ip:port`` from the Ray cluster's info file, or None while there is none."""
    try:
        info = json.loads(info_file.read_text())
    except (OSError, json.JSONDecodeError):  # not written yet, or being written
        return None
    return f"{info['head_ip']}:{info['port']}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nemo_orch.launcher.job",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--endpoint", action="append", default=[], metavar="KEY=URL",
                        help="a server's base URL, waited for and passed as the override KEY=URL")
    parser.add_argument("--ray-info", type=Path, default=None,
                        help="the Ray cluster's ray_cluster_info.json, waited for")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds for all of it")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="the nemo-orch command and its overrides")
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
        if args.ray_info is not None:
            wait_until(lambda: ray_address(args.ray_info) is not None,
                       f"the Ray cluster ({args.ray_info})", deadline)
            os.environ["RAY_ADDRESS"] = ray_address(args.ray_info)
    except LaunchError as error:
        print(f"job: error: {error}", file=sys.stderr)
        return 1
    from nemo_orch import cli

    return cli.main([*args.command, *overrides])


if __name__ == "__main__":
    sys.exit(main())
