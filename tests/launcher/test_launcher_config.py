"""Recipes (``recipe=NAME`` for every command) and the launcher's configuration checks."""

import dataclasses

import pytest

from nemo_orch import cli
from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError

TWO_NODES = "orchestrator-qwen3-8b-2n8g-tp4pp1-fp8"
ONE_NODE = "orchestrator-qwen3-8b-1n8g-tp4pp1-fp8"
ONE_NODE_ASYNC = "orchestrator-qwen3-8b-1n8g-tp4pp1-fp8-async"
TWO_NODES_PPO = "orchestrator-qwen3-8b-2n8g-tp4pp1-fp8-ppo"
MICRO_CPU_SLURM = "micro-cpu-slurm"
MAIN_LONG = "main-long"  # `make train-long`: docs/main_job.md


def test_recipes_are_the_files_of_conf_recipes():
    assert config_lib.recipes() == [
        MAIN_LONG,
        MICRO_CPU_SLURM,
        ONE_NODE,
        ONE_NODE_ASYNC,
        TWO_NODES,
        TWO_NODES_PPO,
    ]


def test_the_cpu_slurm_recipe_runs_grpo_on_two_ranks_without_a_container():
    config = config_lib.load([f"recipe={MICRO_CPU_SLURM}", "launcher.slurm.job_dir=/shared"])
    launcher = config.launcher
    assert (launcher.executor, launcher.job, launcher.container, launcher.gpus_per_node) == (
        "slurm",
        "grpo",
        "none",
        0,
    )
    assert (
        config.model.preset,
        config.parallel.world_size,
        config.rollout.engine,
        config.env.label,
    ) == ("micro", 2, "hf", "offline")
    assert not launcher.env and not launcher.secret_env  # nothing of a cluster's site settings


def test_a_recipe_composes_over_the_defaults():
    config = config_lib.load([f"recipe={TWO_NODES}"])
    model, parallel, grpo, rollout = config.model, config.parallel, config.grpo, config.rollout
    assert (model.preset, model.fp8, model.fp8_recipe, model.transformer_impl) == (
        "qwen3-8b",
        "hybrid",
        "tensorwise",
        "transformer_engine",
    )
    assert (parallel.tp, parallel.pp, parallel.dp, parallel.sequence_parallel) == (4, 1, 4, True)
    assert (
        grpo.prompts_per_step,
        rollout.group_size,
        grpo.optim.lr,
        grpo.clip_low,
        grpo.clip_high,
        grpo.kl_coef,
    ) == (16, 8, 1e-6, 0.2, 0.28, 1e-4)
    assert (rollout.engine, rollout.engine_tp, rollout.temperature, rollout.max_turns) == (
        "trtllm",
        4,
        1.0,
        30,
    )
    # a turn's prompt budget is the context less its reply: 24,000 + 8,768
    assert rollout.max_context_tokens - rollout.max_new_tokens == 24000
    assert (config.launcher.executor, config.launcher.nodes, config.launcher.gpus_per_node) == (
        "slurm",
        2,
        8,
    )
    assert [e.endpoint for e in config.launcher.experts] == [
        "tools.endpoints.math",
        "tools.endpoints.coder",
        "tools.endpoints.generalist",
    ]
    # the untouched groups keep their defaults
    assert config.reward.combination == "preference" and config.data.num_offline_conversations


def test_the_one_node_recipe_derives_from_the_two_node_one():
    one, two = (config_lib.load([f"recipe={name}"]) for name in (ONE_NODE, TWO_NODES))
    assert (one.parallel.dp, one.launcher.nodes, one.run.name) == (2, 1, ONE_NODE)
    assert (one.model, one.grpo, one.rollout) == (two.model, two.grpo, two.rollout)


def test_the_ppo_recipe_is_the_two_node_one_with_grpo_ppo():
    ppo, two = (config_lib.load([f"recipe={name}"]) for name in (TWO_NODES_PPO, TWO_NODES))
    grpo_ppo = config_lib.load([f"recipe={TWO_NODES}", "grpo=ppo"]).grpo
    assert ppo.run.name == TWO_NODES_PPO
    assert (ppo.model, ppo.parallel, ppo.rollout, ppo.launcher) == (
        two.model,
        two.parallel,
        two.rollout,
        two.launcher,
    )
    # grpo=ppo's settings (algo, dynamic sampling, GAE) over the recipe's batches, policy lr and
    # KL; the critic's lr is one for an 8B critic
    critic_optim = dataclasses.replace(grpo_ppo.ppo.critic_optim, lr=1e-5, min_lr=1e-5)
    assert ppo.grpo == dataclasses.replace(
        grpo_ppo, ppo=dataclasses.replace(grpo_ppo.ppo, critic_optim=critic_optim)
    )
    assert dataclasses.replace(ppo.grpo, algo="grpo", ppo=None, dynamic_sampling=True) == two.grpo


def test_command_line_overrides_win_over_the_recipe():
    config = config_lib.load(
        [
            f"recipe={TWO_NODES}",
            "grpo.optim.lr=2e-6",
            "rollout.engine=vllm",
            "+tools.endpoints.math=http://node7:8001/v1",
        ]
    )
    assert (config.grpo.optim.lr, config.rollout.engine) == (2e-6, "vllm")
    assert config.tools.endpoints == {"math": "http://node7:8001/v1"}
    # a group chosen on the command line is the base the recipe's own values go over
    assert config_lib.load([f"recipe={TWO_NODES}", "rollout=vllm"]).rollout.engine == "trtllm"


def test_an_unknown_recipe_lists_the_available_ones():
    with pytest.raises(
        ConfigError,
        match=f"unknown recipe 'nope'; available: {MAIN_LONG}, {MICRO_CPU_SLURM}, {ONE_NODE}, "
        f"{ONE_NODE_ASYNC}, {TWO_NODES}, {TWO_NODES_PPO}",
    ):
        config_lib.load(["recipe=nope"])


def test_every_command_takes_a_recipe(capsys):
    assert cli.main(["train", "--print-config", f"recipe={ONE_NODE}"]) == 0
    printed = capsys.readouterr().out
    assert "preset: qwen3-8b" in printed and "name: orchestrator-qwen3-8b-1n8g" in printed
    assert cli.main(["sft", "--print-config", "recipe=nope"]) == 2
    assert "unknown recipe 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "override,message",
    [
        ("launcher.slurm.time=4h", "launcher.slurm.time must be [D-]HH:MM:SS"),
        (
            "+launcher.env.HF_TOKEN=hf_abc",
            "HF_TOKEN look like secrets: name them in launcher.secret_env",
        ),
        ("launcher.secret_env=[not-a-name]", "'not-a-name' is not a variable name"),
        ("launcher.slurm.job_dir=null", "launcher.executor=slurm needs launcher.slurm.job_dir"),
        ("launcher.container=docker", "launcher.container must be pyxis|none"),
        ("launcher.slurm.stop_before_limit_s=0", "launcher.slurm.stop_before_limit_s must be >= 1"),
        ("launcher.slurm.requeues=-1", "launcher.slurm.requeues must be >= 0"),
        ("launcher.slurm.container_mounts=[data:/data]", "is not SRC:DST (absolute)"),
        ("launcher.experts.0.engine=sglang", "launcher.experts[math].engine must be vllm|trtllm"),
        (
            "launcher.experts.1.endpoint=tools.math",
            "must be tools.endpoints.<alias> or reward.judge_base_url",
        ),
        ("launcher.experts.1.name=math", "names and endpoints must be unique"),
        ("++launcher.experts.1.served_model_name=coder", "served_model_name is vLLM's"),
        ("launcher.executor=local", "launcher.executor=local runs on one node"),
        ("+tools.endpoints.math=node7:8001", "tools.endpoints.math must be an http(s) URL"),
    ],
)
def test_launcher_mistakes_are_named(override, message):
    with pytest.raises(
        ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")
    ):
        config_lib.load([f"recipe={TWO_NODES}", override])


def test_experts_and_ray_are_slurm_only_and_need_a_model():
    with pytest.raises(ConfigError, match="launcher.experts and launcher.ray run on SLURM only"):
        config_lib.load(["launcher.ray={nodes: 1}"])
    with pytest.raises(
        ConfigError, match=r"launcher.experts\[0\].model: .* missing mandatory value: model"
    ):
        config_lib.load(
            [f"recipe={TWO_NODES}", "launcher.experts=[{name: x, endpoint: tools.endpoints.x}]"]
        )


def test_the_container_image_defaults_to_the_job_dirs_squashfs():
    slurm = config_lib.load([f"recipe={TWO_NODES}"]).launcher.slurm
    assert slurm.image == f"{slurm.job_dir}/containers/{config_lib.CONTAINER_SQSH}"
    other = config_lib.load(
        [f"recipe={TWO_NODES}", "launcher.slurm.container_image='nvcr.io#nvidia/pytorch:25.09-py3'"]
    )
    assert other.launcher.slurm.image == "nvcr.io#nvidia/pytorch:25.09-py3"


def test_a_recipe_kept_outside_the_repository_loads_from_its_path(tmp_path):
    """``recipe=PATH.yaml``: a user's own recipe file, with the same ``@package _global_`` and
    ``override /group:`` defaults as the shipped ones, composes as they do."""
    shipped = config_lib.CONF_DIR / "recipes" / f"{TWO_NODES}.yaml"
    mine = tmp_path / "my-recipe.yaml"
    mine.write_text(shipped.read_text().replace("prompts_per_step: 16", "prompts_per_step: 12"))
    assert "prompts_per_step: 12" in mine.read_text()
    config = config_lib.load([f"recipe={mine}", "parallel.dp=2"])
    expected = config_lib.load([f"recipe={TWO_NODES}", "parallel.dp=2", "grpo.prompts_per_step=12"])
    assert config == expected
    with pytest.raises(ConfigError, match="recipe=.*nope.yaml: no such file"):
        config_lib.load([f"recipe={tmp_path / 'nope.yaml'}"])
    with pytest.raises(ConfigError, match="or a path to a .yaml file"):
        config_lib.load(["recipe=nope"])
