"""``nemo-orch launch``: the SLURM scripts a dry run renders for the 2-node recipe, and a real
2-process training through NeMo-Run's local executor."""

import re

import pytest
from support.cli_helpers import read_metrics, run_cli, small_sft_overrides

from nemo_orch import cli
from nemo_orch import config as config_lib

pytest.importorskip("nemo_run", reason="the launch extra (nemo-run) is not installed")

RECIPE = "orchestrator-qwen3-8b-2n8g-tp4pp1-fp8"
JOB_DIR = "/lustre/fsw/my-account/nemo-orch"
# The recipe with its rollouts in Ray workers (the CPU engine: the Ray backend's), so that the
# dry run also renders the Ray cluster: its head beside the training, a worker node of its own.
WITH_RAY = [
    "rollout.engine=hf",
    "rollout.backend=ray",
    "rollout.ray.address=auto",
    "launcher.ray={nodes: 1}",
]


@pytest.fixture(scope="module")
def rendered() -> dict[str, str]:
    """The dry run's files by name (train_sbatch.sh, train/scripts/train-<i>.sh),
    with a secret set in the environment that must appear nowhere. (A subprocess: NeMo-Run's
    LocalTunnel runs shell commands that read stdin.)"""
    result = run_cli(
        "launch",
        "--executor",
        "slurm",
        "--dryrun",
        f"recipe={RECIPE}",
        *WITH_RAY,
        env={"HF_TOKEN": "hf_do-not-print-me"},
    )
    assert "hf_do-not-print-me" not in result.stdout + result.stderr
    sections = re.split(r"^# ---- (\S+).*$", result.stdout, flags=re.M)
    return dict(zip(sections[1::2], sections[2::2]))


def test_the_batch_script_asks_for_the_training_expert_and_ray_nodes(rendered):
    assert set(rendered) == {"train_sbatch.sh", *(f"train/scripts/train-{i}.sh" for i in range(5))}
    components = rendered["train_sbatch.sh"].split("#SBATCH hetjob\n")
    assert len(components) == 5  # training + 3 expert servers + Ray, one heterogeneous job
    training = components[0].splitlines()
    for line in (
        "#SBATCH --account=my-account",
        "#SBATCH --partition=batch",
        "#SBATCH --time=04:00:00",
        "#SBATCH --nodes=2",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --ntasks-per-node=1",
    ):
        assert line in training
    gpus = [re.search(r"--gpus-per-node=(\d+)", c).group(1) for c in components[:4]]
    assert gpus == ["8", "4", "2", "2"]  # the experts' TP
    assert "#SBATCH --gpus-per-node=0" in components[4]  # launcher.ray.gpus_per_node
    assert all("#SBATCH --nodes=1" in c for c in components[1:])


def test_components_run_in_the_container_with_mounts_env_and_secrets_by_name(rendered):
    script = rendered["train_sbatch.sh"]
    sruns = [line for line in script.splitlines() if line.startswith("srun --het-group=")]
    assert len(sruns) == 5
    image = f"{JOB_DIR}/containers/nemo-orch+0.1.0.sqsh"
    for index, srun in enumerate(sruns):
        assert srun.startswith(f"srun --het-group={index} ")
        assert f"--container-mounts {JOB_DIR}:{JOB_DIR}," in srun
        assert "--container-env HF_TOKEN,WANDB_API_KEY,OPENAI_API_KEY,TAVILY_API_KEY" in srun
        assert f"bash /nemo_run/scripts/train-{index}.sh" in srun
    assert [f"--container-image {image}" in srun for srun in sruns] == [
        True,
        False,
        True,
        False,
        True,
    ]
    assert "--container-image nvcr.io#nvidia/vllm:25.09-py3" in sruns[1]
    for line in (
        "export NCCL_DEBUG=WARN",
        f"export HF_HOME={JOB_DIR}/hf_cache",
        "het_group_host_1=$(scontrol show hostnames=$SLURM_JOB_NODELIST_HET_GROUP_1 | head -n1)",
        "export NEMO_ORCH_RDZV_HOST=$het_group_host_0",
        "export NEMO_ORCH_HOST_1=$het_group_host_1",
        "export NEMO_ORCH_HOST_3=$het_group_host_3",
    ):
        assert line in script.splitlines()
    assert "squeue" not in script


def test_the_training_runs_torchrun_and_the_experts_their_servers(rendered):
    torchrun = rendered["train/scripts/train-0.sh"].strip().splitlines()[-1]
    assert torchrun == (
        "torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d "
        "--rdzv-endpoint=${NEMO_ORCH_RDZV_HOST}:29500 --rdzv-id=$SLURM_JOB_ID "
        "-m nemo_orch.launcher.job --timeout 1800 "
        "--endpoint 'tools.endpoints.math=http://${NEMO_ORCH_HOST_1}:8001/v1' "
        "--endpoint 'tools.endpoints.coder=http://${NEMO_ORCH_HOST_2}:8002/v1' "
        "--endpoint 'tools.endpoints.generalist=http://${NEMO_ORCH_HOST_3}:8003/v1' "
        f"--ray '${{NEMO_ORCH_RDZV_HOST}}:6379' --ray-nodes 2 grpo recipe={RECIPE} "
        + " ".join(f"'{o}'" if " " in o else o for o in WITH_RAY)
    )
    assert (
        rendered["train/scripts/train-1.sh"]
        .strip()
        .endswith(
            "exec vllm serve Qwen/Qwen2.5-Math-72B-Instruct --served-model-name "
            "Qwen/Qwen2.5-Math-72B-Instruct --tensor-parallel-size 4 --host 0.0.0.0 --port 8001"
        )
    )
    assert (
        rendered["train/scripts/train-2.sh"]
        .strip()
        .endswith(
            "exec trtllm-serve Qwen/Qwen2.5-Coder-32B-Instruct --tp_size 2 --host 0.0.0.0 "
            "--port 8002"
        )
    )
    # SLURM's stop signal before the time limit ends no component (the ranks handle it)
    scripts = [rendered[f"train/scripts/train-{i}.sh"].strip().splitlines() for i in range(5)]
    assert all(lines[1] == "trap '' USR1" for lines in scripts)


def test_the_ray_head_runs_beside_the_training_and_its_workers_join_it(rendered):
    """The head on the first training node for the script's life; the worker component joins
    it; every process of the job authenticates with the token written at launch."""
    assert rendered["train/scripts/train-0.sh"].strip().splitlines()[2:6] == [
        'if [ "$SLURM_NODEID" = 0 ]; then',
        "  ray start --head --port=6379 --num-gpus=0 --include-dashboard=false --block "
        "--disable-usage-stats &",
        '  trap "kill $!" EXIT',
        "fi",
    ]
    assert rendered["train/scripts/train-4.sh"].strip().splitlines()[-1] == (
        "exec ray start --address=${NEMO_ORCH_RDZV_HOST}:6379 --block --disable-usage-stats"
    )
    script = rendered["train_sbatch.sh"]
    experiment_dir = re.search(r"--output=(\S+)/train/sbatch_", script).group(1)
    assert experiment_dir.startswith(f"{JOB_DIR}/experiments/{RECIPE}/{RECIPE}_")
    for line in (
        "export RAY_AUTH_MODE=token",
        f"export RAY_AUTH_TOKEN_PATH={experiment_dir}.ray_auth_token",
    ):
        assert line in script.splitlines()


def test_paths_relative_to_the_launch_reach_the_job_absolute(tmp_path):
    """The job starts in the experiment's code/ directory, not where it was launched: a relative
    path that exists there reaches it absolute (runs/latest resolved at submission), the rest
    as given."""
    (tmp_path / "runs" / "e2e" / "sft" / "checkpoints").mkdir(parents=True)
    (tmp_path / "runs" / "latest").symlink_to("e2e")
    result = run_cli(
        "launch",
        "--executor",
        "slurm",
        "--dryrun",
        "recipe=micro-cpu-slurm",
        f"launcher.slurm.job_dir={tmp_path / 'jobs'}",
        "trainer.init_from=runs/latest/sft/checkpoints",
        cwd=tmp_path,
    )
    (torchrun,) = [line for line in result.stdout.splitlines() if line.startswith("exec torchrun ")]
    assert (
        f" grpo recipe=micro-cpu-slurm launcher.slurm.job_dir={tmp_path / 'jobs'} "
        f"trainer.init_from={tmp_path.resolve() / 'runs/e2e/sft/checkpoints'}"
    ) in torchrun


def test_a_layout_that_does_not_match_the_allocation_is_not_launched(capsys):
    assert (
        cli.main(["launch", "--executor", "slurm", "--dryrun", f"recipe={RECIPE}", "parallel.dp=2"])
        == 2
    )
    assert "tp x pp x dp = 8 ranks, but the launcher gives 2 nodes x 8 GPUs = 16" in (
        capsys.readouterr().err
    )


def test_a_missing_secret_stops_a_real_launch(monkeypatch, capsys):
    for name in config_lib.load([f"recipe={RECIPE}"]).launcher.secret_env:
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["launch", "--executor", "slurm", f"recipe={RECIPE}"]) == 2
    assert (
        "launcher.secret_env: HF_TOKEN, WANDB_API_KEY, OPENAI_API_KEY, TAVILY_API_KEY not "
        "set" in capsys.readouterr().err
    )


def local_overrides(tokenizer_dir, output_dir) -> list[str]:
    """Two SFT steps of a 2-layer micro model at DP=2 (gloo on CPU)."""
    return [
        *small_sft_overrides(tokenizer_dir, output_dir, "launched"),
        "launcher.job=sft",
        "parallel.dp=2",
        "trainer.max_steps=2",
        "model.num_layers=2",
        "data.seq_length=512",
    ]


def test_local_dryrun_prints_the_torchrun_command(tiny_tokenizer_dir, tmp_path, capsys):
    overrides = local_overrides(tiny_tokenizer_dir, tmp_path)
    assert cli.main(["launch", "--executor", "local", "--dryrun", *overrides]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1]
    assert command.startswith("torchrun ") and "--nnodes 1 --nproc-per-node 2" in command
    # sft continues its run when requeued
    assert command.endswith(
        " -m nemo_orch.launcher.job --timeout 1800 sft "
        + " ".join(overrides)
        + " trainer.resume=true"
    )
    assert not (tmp_path / "launched").exists()


@pytest.mark.dist
@pytest.mark.slow
def test_local_launch_trains_on_two_processes(tiny_tokenizer_dir, tmp_path):
    run_cli("launch", "--executor", "local", *local_overrides(tiny_tokenizer_dir, tmp_path))
    metrics = read_metrics(tmp_path / "launched")
    assert [m["step"] for m in metrics] == [1, 2] and all(m["loss"] > 0 for m in metrics)
    assert (tmp_path / "launched" / "checkpoints" / "step_2").is_dir()
    # NeMo-Run keeps the experiment (torchrun's logs) beside the runs
    assert list((tmp_path / "nemo_run" / "experiments" / "launched").iterdir())
