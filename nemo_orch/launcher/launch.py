"""``nemo-orch launch``: the training job and what runs beside it, as a NeMo-Run experiment.

- The training job runs ``python -m nemo_orch.launcher.job`` (which waits for its services, then
  runs ``nemo-orch <launcher.job>`` with the launch's overrides) on every rank under torchrun.
  Locally: NeMo-Run's ``LocalExecutor`` with its torchrun launcher, one process per rank of
  ``parallel``. On SLURM: one task per node in the pyxis container, torchrun with a c10d
  rendezvous on the first training node (``--rdzv-id`` the SLURM job id).
- Expert servers (``launcher.experts``: ``vllm serve`` or ``trtllm-serve``) are further
  components of the same SLURM heterogeneous job, one node each: SLURM starts them together
  with the training, and NeMo-Run's batch script stops all components when one ends. Their
  hosts are the components' first nodes, which that script resolves itself (``scontrol show
  hostnames $SLURM_JOB_NODELIST_HET_GROUP_<i>``) into ``$het_group_host_<i>``; the training
  component gets them exported as ``NEMO_ORCH_HOST_<i>`` and, the ports being fixed, waits for
  ``http://$NEMO_ORCH_HOST_<i>:<port>/v1`` and hands it over as ``<expert.endpoint>=URL``. No
  scheduler state is queried and no file is shared; a server that fails kills the job.
- The Ray cluster (``launcher.ray``) lives in the same job: the training's script starts its
  head on the first training node (``ray start --head``, the GCS on ``launcher.ray.port``) before
  torchrun, and workers on ``launcher.ray.nodes`` further nodes, one more component, join it;
  the training's first rank waits until all joined, and the training gets ``RAY_ADDRESS``.
  (NeMo-Run's own Ray-on-SLURM job starts Ray in pyxis containers only, and as a job of its
  own would be scheduled, time-limited and requeued apart from the training.)
- Every component ignores SIGUSR1, which SLURM sends to all of the job's processes before its
  time limit; the training's ranks take it as the request to stop after their step
  (:mod:`nemo_orch.train.preemption`), then the job requeues itself.

Secrets go by name only: ``sbatch`` exports the submitting environment and pyxis passes the
variables named in ``launcher.secret_env`` into the containers (``--container-env``).
NeMo-Run (the ``launch`` extra) is imported when a launch is asked for.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nemo_orch.config import Config, ConfigError, ExpertServerConfig
from nemo_orch.launcher import jobs, plan
from nemo_orch.train import preemption

TRAIN_TASK = "train"
HOST_VARIABLE = "NEMO_ORCH_HOST_{}"
RDZV_HOST = "NEMO_ORCH_RDZV_HOST"


def _nemo_run() -> Any:
    try:
        import nemo_run
    except ImportError as error:
        raise ConfigError(
            f"nemo-orch launch needs NeMo-Run: pip install 'nemo-orch[launch]' ({error})"
        ) from None
    return nemo_run


def expert_command(expert: ExpertServerConfig) -> list[str]:
    """The server's command line: OpenAI-compatible, on all interfaces of its node."""
    if expert.engine == "vllm":
        command = [
            "vllm",
            "serve",
            expert.model,
            "--served-model-name",
            expert.model_name,
            "--tensor-parallel-size",
            str(expert.tp),
        ]
    else:
        command = ["trtllm-serve", expert.model, "--tp_size", str(expert.tp)]
    return [*command, "--host", "0.0.0.0", "--port", str(expert.port), *expert.extra_args]


def remote_experiment_dir(config: Config, experiment_id: str) -> str:
    """The experiment's directory on the cluster (NeMo-Run's LocalTunnel layout under
    ``launcher.slurm.job_dir``)."""
    return f"{config.launcher.slurm.job_dir}/experiments/{config.run.name}/{experiment_id}"


def absolute_paths(overrides: list[str], here: Path) -> list[str]:
    """``overrides`` as the job must see them: it starts in the experiment's ``code/``
    directory, not ``here``, so a value naming a file or directory that exists relative to
    ``here`` (``trainer.init_from=runs/latest/sft/checkpoints``) becomes its absolute path, a
    link (``runs/latest``) resolved as it is now, when the job is submitted."""

    def absolute(override: str) -> str:
        key, equals, value = override.partition("=")
        if equals and value and not os.path.isabs(value) and (here / value).exists():
            return f"{key}={(here / value).resolve()}"
        return override

    return [absolute(override) for override in overrides]


def job_arguments(config: Config, overrides: list[str]) -> list[str]:
    """What ``nemo_orch.launcher.job`` gets: each expert's endpoint (its host: heterogeneous
    component ``i``, from 1), the Ray cluster's head (on the first training node) and its nodes
    once all joined, then the command and overrides."""
    launcher = config.launcher
    arguments = ["--timeout", f"{launcher.startup_timeout_s:g}"]
    for index, expert in enumerate(launcher.experts, start=1):
        url = f"http://${{{HOST_VARIABLE.format(index)}}}:{expert.port}/v1"
        arguments += ["--endpoint", f"{expert.endpoint}={url}"]
        if expert.endpoint == "reward.judge_base_url":
            overrides = [*overrides, f"reward.judge_model={expert.model_name}"]
    if launcher.job == "sft":  # a requeued job runs the same command: it continues its run
        overrides = [*overrides, "trainer.resume=true"]
    if launcher.ray is not None:
        arguments += [
            "--ray",
            f"${{{RDZV_HOST}}}:{launcher.ray.port}",
            "--ray-nodes",
            str(1 + launcher.ray.nodes),
        ]
    return [*arguments, launcher.job, *overrides]


# The signal's name as sbatch and bash write it (USR1).
_STOP_SIGNAL = preemption.STOP_SIGNAL.name.removeprefix("SIG")
# Every component's script starts with this: SLURM's signal before the time limit goes to all
# of the job's processes and is no reason for torchrun's agent or a server to end (the ranks
# block it and stop after their step).
_IGNORE_STOP_SIGNAL = f"trap '' {_STOP_SIGNAL}\n"


def _ray_start(*options: str) -> str:
    """``ray start`` in the foreground (it ends with the job), without the usage report."""
    return " ".join(["ray start", *options, "--block", "--disable-usage-stats"])


def ray_worker_script(config: Config) -> str:
    """The script of the Ray component's nodes: a worker joining the head (``ray start``
    waits for the head's GCS)."""
    address = f"--address=${{{RDZV_HOST}}}:{config.launcher.ray.port}"
    return _IGNORE_STOP_SIGNAL + "exec " + _ray_start(address)


def torchrun_script(config: Config, job_args: list[str]) -> str:
    """The training component's script, run on each of its nodes: torchrun with a c10d
    rendezvous on the first training node (``$NEMO_ORCH_RDZV_HOST``, from the batch script), a
    rank per GPU (but those of a rollout engine with GPUs of its own). torchrun's agent ignores
    the stop signal SLURM sends before the time limit; the ranks block it, stop after their
    step, checkpoint, and exit for a requeue (:mod:`nemo_orch.train.preemption`). With
    ``launcher.ray``, the first node also runs the Ray head, stopped when the script ends."""
    launcher = config.launcher
    torchrun = [
        "torchrun",
        f"--nnodes={launcher.nodes}",
        f"--nproc-per-node={config.parallel.world_size // launcher.nodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=${{{RDZV_HOST}}}:{launcher.rdzv_port}",
        "--rdzv-id=$SLURM_JOB_ID",
        "-m",
        "nemo_orch.launcher.job",
    ]
    command = " ".join(torchrun) + " " + shlex.join(job_args)
    if launcher.ray is None:
        return _IGNORE_STOP_SIGNAL + "exec " + command
    head = _ray_start(
        "--head", f"--port={launcher.ray.port}", "--num-gpus=0", "--include-dashboard=false"
    )
    return (
        _IGNORE_STOP_SIGNAL
        + f'if [ "$SLURM_NODEID" = 0 ]; then\n  {head} &\n'
        + '  trap "kill $!" EXIT\nfi\n'
        + command
    )


def _slurm_executor(
    config: Config,
    *,
    nodes: int,
    gpus_per_node: int,
    image: str,
    job_name_prefix: str,
    env: dict[str, str],
) -> Any:
    """One task per node (torchrun starts the ranks), in the pyxis container unless
    ``launcher.container`` is ``none``; stopped ``stop_before_limit_s`` before its time limit
    and requeued (NeMo-Run's retries: the batch script requeues a job that exits non-zero)."""
    run = _nemo_run()
    launcher, slurm = config.launcher, config.launcher.slurm
    container = {}
    if launcher.container == "pyxis":
        container = {
            "container_image": image,
            "container_mounts": list(slurm.container_mounts),
            "container_env": list(launcher.secret_env) or None,
            "srun_args": ["--no-container-mount-home"],
        }
    else:  # this interpreter's environment, as for the local executor
        env = {"PATH": f"{Path(sys.executable).parent}:$PATH", **env}
    return run.SlurmExecutor(
        account=slurm.account,
        partition=slurm.partition,
        time=slurm.time,
        qos=slurm.qos,
        job_name_prefix=job_name_prefix,
        nodes=nodes,
        ntasks_per_node=1,
        gpus_per_node=gpus_per_node or None,
        **container,
        signal=f"{_STOP_SIGNAL}@{slurm.stop_before_limit_s}",
        retries=slurm.requeues,
        env_vars={**launcher.env, **env},
        tunnel=run.LocalTunnel(job_dir=f"{slurm.job_dir}/experiments"),
        packager=run.Packager(),
    )


def _add_local(config: Config, overrides: list[str], experiment: Any) -> None:
    """One process per rank of ``parallel`` on this machine (NeMo-Run's torchrun launcher)."""
    run = _nemo_run()
    # torchrun and python from this interpreter's environment (a venv need not be on PATH)
    env = {"PATH": str(Path(sys.executable).parent), **config.launcher.env}
    executor = run.LocalExecutor(
        ntasks_per_node=config.parallel.world_size, launcher="torchrun", env_vars=env
    )
    task = run.Script(
        path="nemo_orch.launcher.job",
        entrypoint="python",
        m=True,
        args=job_arguments(config, overrides),
    )
    experiment.add(task, executor=executor, name=TRAIN_TASK)


def ray_token_file(experiment_dir: Path) -> Path:
    """The Ray cluster's authentication token (0600): only the job's processes, which all read
    it, can use the cluster. Beside the experiment's directory, which NeMo-Run creates when it
    submits (and refuses to find existing), so the token is there before the job starts."""
    return experiment_dir.with_name(f"{experiment_dir.name}.ray_auth_token")


def _write_secret(path: Path, secret: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(secret)


def _add_slurm(config: Config, overrides: list[str], experiment: Any, experiment_dir: Path) -> None:
    """Adds the training job (heterogeneous with the expert servers and the Ray workers, when
    there are) to ``experiment``."""
    run = _nemo_run()
    from nemo_run.core.execution.base import ExecutorMacros

    launcher = config.launcher
    # The other components: (script, nodes, GPUs per node, image).
    others = [
        (
            _IGNORE_STOP_SIGNAL + "exec " + shlex.join(expert_command(expert)),
            1,
            expert.tp,
            expert.container_image or launcher.slurm.image,
        )
        for expert in launcher.experts
    ]
    if launcher.ray is not None and launcher.ray.nodes:
        others.append(
            (
                ray_worker_script(config),
                launcher.ray.nodes,
                launcher.ray.gpus_per_node,
                launcher.slurm.image,
            )
        )
    # Batch-script variables (NeMo-Run's macros): the first training node (also the Ray head's)
    # and the others' first nodes. NeMo-Run substitutes them as string.Template: "$$" keeps a
    # "$" for the batch script.
    env = {
        RDZV_HOST: ExecutorMacros.group_host(0)
        if others
        else "$$" + ExecutorMacros.HEAD_NODE_IP_VAR
    }
    env |= {
        HOST_VARIABLE.format(index): ExecutorMacros.group_host(index)
        for index in range(1, len(others) + 1)
    }
    if launcher.ray is not None:
        env |= {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(ray_token_file(experiment_dir)),
        }
    prefix = f"{config.run.name}-"
    executors = [
        _slurm_executor(
            config,
            nodes=launcher.nodes,
            gpus_per_node=launcher.gpus_per_node,
            image=launcher.slurm.image,
            job_name_prefix=prefix,
            env=env,
        )
    ]
    tasks = [run.Script(inline=torchrun_script(config, job_arguments(config, overrides)))]
    for script, nodes, gpus, image in others:
        tasks.append(run.Script(inline=script))
        executors.append(
            _slurm_executor(
                config,
                nodes=nodes,
                gpus_per_node=gpus,
                image=image,
                job_name_prefix=prefix,
                env=env,
            )
        )
    if others:
        for executor in executors:
            executor.heterogeneous = True
            # NeMo-Run writes every component's value of each flag the first component has,
            # None as "None"; sbatch reads 0 GPUs as none.
            executor.gpus_per_node = executor.gpus_per_node or 0
        experiment.add(tasks, executor=executors, name=TRAIN_TASK)
    else:
        experiment.add(tasks[0], executor=executors[0], name=TRAIN_TASK)


def _print_dryrun(experiment: Any, exp_dir: Path, local: bool) -> None:
    """What would run, as text. Local: the command of each process (torchrun's agent; from
    the job's dry-run request, NeMo-Run has no public accessor). SLURM: the training job's
    batch script and the scripts its components run."""
    experiment.dryrun(log=False, delete_exp_dir=False)
    if local:
        for params in experiment.jobs[0]._dryrun_info.request.role_params.values():
            print(shlex.join(params[0].args))
        return
    scripts = [*sorted(exp_dir.glob("*_sbatch.sh")), *sorted(exp_dir.glob("*/scripts/*.sh"))]
    for script in scripts:
        print(f"# ---- {script.relative_to(exp_dir)}\n{script.read_text().rstrip()}\n")


def launch(config: Config, overrides: list[str], dryrun: bool) -> int:
    """Submit (or, with ``dryrun``, print) the launch. Local: waits, and returns 0 if the
    training succeeded; SLURM: returns 0 once submitted."""
    problems = plan.layout_problems(config)
    if problems:
        raise ConfigError("; ".join(problems) + " (see `nemo-orch plan`)")
    run = _nemo_run()
    from torchx.specs import AppState

    launcher = config.launcher
    local = launcher.executor == "local"
    missing = [name for name in launcher.secret_env if name not in os.environ]
    if missing and not dryrun:
        raise ConfigError(
            f"launcher.secret_env: {', '.join(missing)} not set in this "
            "environment (the job takes them from it)"
        )
    overrides = absolute_paths(overrides, Path.cwd())
    experiment_id = f"{config.run.name}_{time.time_ns()}"  # NeMo-Run's form: title_id
    experiment_dir = Path(remote_experiment_dir(config, experiment_id))
    with contextlib.ExitStack() as stack:
        if dryrun:  # NeMo-Run writes the scripts before it submits: into a scratch directory
            base_dir = stack.enter_context(tempfile.TemporaryDirectory(prefix="nemo-orch-"))
        elif local:
            base_dir = str(Path(config.run.output_dir) / "nemo_run")
        else:  # on the login node, the same directory the jobs see (LocalTunnel)
            base_dir = launcher.slurm.job_dir
        experiment = stack.enter_context(
            run.Experiment(
                config.run.name,
                id=experiment_id,
                base_dir=base_dir,
                log_level="WARN",
                clean_mode=dryrun,
            )
        )
        if local:
            _add_local(config, overrides, experiment)
        else:
            _add_slurm(config, overrides, experiment, experiment_dir)
        if dryrun:
            exp_dir = Path(base_dir) / "experiments" / config.run.name / experiment_id
            _print_dryrun(experiment, exp_dir, local)
            return 0
        if not local and launcher.ray is not None:
            _write_secret(ray_token_file(experiment_dir), secrets.token_hex(32))
        experiment.run(detach=not local, tail_logs=local)
    # leaving the experiment waited for a local run
    if local:
        return 0 if experiment.jobs[0].state == AppState.SUCCEEDED else 1
    # NeMo-Run's handle of a SLURM job ends with its id
    job = jobs.SubmittedJob(experiment.jobs[0].handle.rsplit("/", 1)[-1], experiment_dir)
    job.save()
    print(
        f"launch: submitted SLURM job {job.job_id}; files and logs in {job.experiment_dir} "
        f"(`nemo-orch launch --status|--logs` with the same overrides shows them)"
    )
    return 0
