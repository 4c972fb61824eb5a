"""``launcher.*``: where the training job runs (local or SLURM) and what runs beside it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from omegaconf import MISSING

from nemo_orch.config.base import _require

# The file ``containers/enroot.sh`` writes: enroot's name for the image ``nemo-orch:0.1.0``
# (``containers/Dockerfile``), under ``<launcher.slurm.job_dir>/containers/``.
CONTAINER_SQSH = "nemo-orch+0.1.0.sqsh"
# Variables named like this hold secrets: they go by name (``launcher.secret_env``), never by value.
SECRET_MARKERS = ("TOKEN", "KEY", "SECRET", "PASSWORD")
_SLURM_TIME = re.compile(r"^(\d+-)?\d{1,2}:\d{2}:\d{2}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENDPOINT_KEY = re.compile(r"^(tools\.endpoints\.[A-Za-z0-9_-]+|reward\.judge_base_url)$")


@dataclass
class SlurmConfig:
    """The sbatch flags of every job (``account``, ``partition``, ``time`` as [D-]HH:MM:SS,
    ``qos``) and ``job_dir``: a directory on the cluster's shared filesystem, at the same path on
    the login node and in the jobs, holding NeMo-Run's experiments (scripts, logs), the Ray
    cluster's directory and ``containers/`` (the squashfs image). Jobs run in the pyxis container
    ``container_image`` (null: ``<job_dir>/containers/`` + :data:`CONTAINER_SQSH`) with
    ``container_mounts`` (``SRC:DST``), unless ``launcher.container`` is ``none``.

    Time limits: ``stop_before_limit_s`` seconds before ``time`` runs out, SLURM sends the
    training's processes SIGUSR1 (``--signal``); the training stops after the step it is in,
    checkpoints and exits with :data:`nemo_orch.train.preemption.REQUEUE_EXIT_CODE`, and the
    job requeues itself (at most ``requeues`` times, failures included) and resumes from that
    checkpoint."""

    account: Optional[str] = None
    partition: Optional[str] = None
    time: str = "04:00:00"
    qos: Optional[str] = None
    job_dir: Optional[str] = None
    container_image: Optional[str] = None
    container_mounts: list[str] = field(default_factory=list)
    stop_before_limit_s: int = 300
    requeues: int = 3

    def __post_init__(self) -> None:
        _require(
            bool(_SLURM_TIME.match(self.time)),
            f"launcher.slurm.time must be [D-]HH:MM:SS, got {self.time!r}",
        )
        _require(self.stop_before_limit_s >= 1, "launcher.slurm.stop_before_limit_s must be >= 1")
        _require(self.requeues >= 0, "launcher.slurm.requeues must be >= 0")
        _require(
            self.job_dir is None or self.job_dir.startswith("/"),
            "launcher.slurm.job_dir must be an absolute path on the shared filesystem",
        )
        for mount in self.container_mounts:
            source, _, target = mount.partition(":")
            _require(
                source.startswith("/") and target.startswith("/"),
                f"launcher.slurm.container_mounts: {mount!r} is not SRC:DST (absolute)",
            )

    @property
    def image(self) -> str:
        """The container image, resolved (see the class docstring)."""
        return self.container_image or f"{self.job_dir}/containers/{CONTAINER_SQSH}"


@dataclass
class RayClusterConfig:
    """A Ray cluster for the rollout workers inside the training's SLURM job: its head on the
    training's first node (its GCS on ``port``; no GPUs of the training's), and a worker on each
    of ``nodes`` further nodes (``gpus_per_node`` each), a component of the heterogeneous job.
    The training's first rank waits until all of them joined; the training gets the head's
    address as ``RAY_ADDRESS``."""

    nodes: int = 0
    gpus_per_node: int = 0
    port: int = 6379

    def __post_init__(self) -> None:
        _require(
            self.nodes >= 0 and self.gpus_per_node >= 0,
            "launcher.ray.nodes and launcher.ray.gpus_per_node must be >= 0",
        )
        _require(
            1024 <= self.port <= 65535 and not 10001 <= self.port <= 19999,
            "launcher.ray.port must be in [1024, 65535] and outside 10001-19999 (the Ray "
            "client server's and workers' ports)",
        )


@dataclass
class ExpertServerConfig:
    """A model served OpenAI-compatibly by ``engine`` (``vllm``: ``vllm serve``; ``trtllm``:
    ``trtllm-serve``) on ``tp`` GPUs of a node of its own, a component of the training's SLURM
    heterogeneous job, listening on ``port``. ``model`` is an HF id or a path in the mounts,
    served as ``served_model_name`` (null: ``model``; the name the tool declaration asks for).
    The training command gets ``<endpoint>=http://<its node>:<port>/v1``: ``endpoint`` is
    ``tools.endpoints.<alias>`` (an expert tool's alias) or ``reward.judge_base_url`` (the judge;
    ``reward.judge_model`` is then set to the served name). ``extra_args`` go to the engine.
    ``container_image``: null runs it in the launcher's image (which has trtllm-serve, not vLLM:
    see ``containers/README.md``)."""

    # The server's name (lowercase letters, digits, dashes): its SLURM component.
    name: str = MISSING
    engine: str = "vllm"
    model: str = MISSING
    served_model_name: Optional[str] = None
    tp: int = 1
    port: int = 8000
    endpoint: str = MISSING
    extra_args: list[str] = field(default_factory=list)
    container_image: Optional[str] = None

    def __post_init__(self) -> None:
        where = f"launcher.experts[{self.name}]"
        _require(
            bool(re.match(r"^[a-z0-9][a-z0-9-]*$", self.name)),
            f"{where}: name must be lowercase letters, digits and dashes",
        )
        _require(
            self.engine in ("vllm", "trtllm"),
            f"{where}.engine must be vllm|trtllm, got {self.engine!r}",
        )
        _require(
            self.served_model_name is None or self.engine == "vllm",
            f"{where}.served_model_name is vLLM's (trtllm-serve names the model itself)",
        )
        _require(self.tp >= 1, f"{where}.tp must be >= 1")
        _require(1024 <= self.port <= 65535, f"{where}.port must be in [1024, 65535]")
        _require(
            bool(_ENDPOINT_KEY.match(self.endpoint)),
            f"{where}.endpoint must be tools.endpoints.<alias> or reward.judge_base_url, "
            f"got {self.endpoint!r}",
        )

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model


@dataclass
class LauncherConfig:
    """``nemo-orch launch``: where the training job runs and what runs beside it.

    The training job runs ``nemo-orch <job>`` (``train`` or ``sft``) with the launch's overrides
    under torchrun on ``nodes`` x ``gpus_per_node`` GPUs (0: CPU processes, one per rank of
    ``parallel``); ``executor`` ``local`` runs it on this machine, ``slurm`` submits it (with
    ``slurm.*``, the expert servers ``experts`` and the Ray cluster ``ray``, SLURM only).
    ``gpu_memory_gib`` is what ``nemo-orch plan`` checks the per-GPU estimate against (H100
    80GB: 81559 MiB usable). ``container``: ``pyxis`` runs SLURM jobs in the container image
    (``slurm.container_image``); ``none`` runs them in the environment of the interpreter that
    submits (a cluster without pyxis, or the local one of ``scripts/slurm_local.sh``): its
    ``bin/`` first on ``PATH``. ``env`` sets plain variables in the job; ``secret_env`` names
    variables (API keys, tokens) passed from the submitting environment into the container by
    name, never written into a script or a command line. Services get ``startup_timeout_s`` to
    become ready; torchrun's rendezvous listens on ``rdzv_port`` of the first training node.
    """

    executor: str = "local"
    # The command the job runs: `train`, `sft` or `grpo`.
    job: str = "train"
    nodes: int = 1
    gpus_per_node: int = 0
    gpu_memory_gib: float = 79.6
    container: str = "pyxis"
    env: dict[str, str] = field(default_factory=dict)
    secret_env: list[str] = field(default_factory=list)
    rdzv_port: int = 29500
    startup_timeout_s: float = 1800.0
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    ray: Optional[RayClusterConfig] = None
    experts: list[ExpertServerConfig] = field(default_factory=list)

    def __post_init__(self) -> None:
        _require(
            self.executor in ("local", "slurm"),
            f"launcher.executor must be local|slurm, got {self.executor!r}",
        )
        _require(
            self.job in ("train", "sft", "grpo"),
            f"launcher.job must be train|sft|grpo, got {self.job!r}",
        )
        _require(
            self.nodes >= 1 and self.gpus_per_node >= 0,
            "launcher.nodes must be >= 1 and launcher.gpus_per_node >= 0",
        )
        _require(self.gpu_memory_gib > 0, "launcher.gpu_memory_gib must be > 0")
        _require(
            self.container in ("pyxis", "none"),
            f"launcher.container must be pyxis|none, got {self.container!r}",
        )
        _require(1024 <= self.rdzv_port <= 65535, "launcher.rdzv_port must be in [1024, 65535]")
        _require(self.startup_timeout_s > 0, "launcher.startup_timeout_s must be > 0")
        for name in [*self.env, *self.secret_env]:
            _require(bool(_ENV_NAME.match(name)), f"launcher: {name!r} is not a variable name")
        leaked = [name for name in self.env if any(m in name.upper() for m in SECRET_MARKERS)]
        _require(
            not leaked,
            f"launcher.env: {', '.join(leaked)} look like secrets: name them in "
            "launcher.secret_env (passed from your environment) instead of giving values",
        )
        names = [expert.name for expert in self.experts]
        endpoints = [expert.endpoint for expert in self.experts]
        _require(
            len(set(names)) == len(names) and len(set(endpoints)) == len(endpoints),
            "launcher.experts: names and endpoints must be unique",
        )
        if self.executor == "local":
            _require(self.nodes == 1, "launcher.executor=local runs on one node (launcher.nodes=1)")
            _require(
                not self.experts and self.ray is None,
                "launcher.experts and launcher.ray run on SLURM only (launcher.executor=slurm)",
            )
        else:
            _require(
                self.slurm.job_dir is not None,
                "launcher.executor=slurm needs launcher.slurm.job_dir",
            )
