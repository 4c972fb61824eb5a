"""``nemo-orch plan``: the layout checks, and the recipes planned on CPU, fitting on 80 GB."""

import pytest
from support.cli_helpers import run_cli

from nemo_orch import cli
from nemo_orch import config as config_lib
from nemo_orch.launcher import memory, plan
from nemo_orch.launcher.launch import torchrun_script

PPO_RECIPE = "orchestrator-qwen3-8b-2n8g-tp4pp1-fp8-ppo"
RECIPES = [
    "orchestrator-qwen3-8b-2n8g-tp4pp1-fp8",
    "orchestrator-qwen3-8b-1n8g-tp4pp1-fp8",
    PPO_RECIPE,
]


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipes_plan_and_fit_on_an_80gb_gpu(recipe, capsys):
    assert cli.main(["plan", f"recipe={recipe}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"plan: {recipe}: qwen3-8b (8.19B parameters")
    assert "TP4 x PP1 x DP" in lines[0] and "FP8 hybrid/tensorwise" in lines[0]
    assert any(line.split()[:2] == ["rollout", "KV"] for line in lines)
    assert lines[-1] == "  fits on a 79.6 GiB GPU (launcher.gpu_memory_gib)"
    estimate = plan.plan(config_lib.load([f"recipe={recipe}"]))
    assert 0 < estimate.sft.total < estimate.grpo.total < 79.6 * 2**30
    assert estimate.grpo.kv_tokens >= 32768


def test_a_layout_that_does_not_fit_exits_1(capsys):
    # selective recompute keeps 34sbh/t per layer of a 32k sequence: ~43 GiB of activations
    assert cli.main(["plan", f"recipe={RECIPES[0]}", "model.recompute_granularity=selective"]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("  does not fit on a 79.6 GiB GPU")


def test_layout_problems_name_the_keys():
    config = config_lib.load(
        [
            f"recipe={RECIPES[0]}",
            "parallel.dp=2",
            "rollout.engine_tp=3",
            "grpo.prompts_per_step=3",
            "grpo.mini_batches=5",
        ]
    )
    problems = plan.layout_problems(config)
    assert problems == [
        "parallel: tp x pp x dp = 8 ranks, but the launcher gives 2 nodes x 8 GPUs = 16",
        "GRPO: grpo.prompts_per_step x rollout.group_size = 24 samples do not split into "
        "grpo.mini_batches x parallel.dp x grpo.micro_batch_size = 10",
        "model.num_attention_heads (32) is not divisible by rollout.engine_tp (3)",
        "model.num_query_groups (8) is not divisible by rollout.engine_tp (3)",
        "rollout.engine_tp (3) does not divide launcher.gpus_per_node (8) the colocated "
        "engines share",
    ]
    assert all(
        not plan.layout_problems(config_lib.load([f"recipe={recipe}"])) for recipe in RECIPES
    )


def test_fp8_shards_and_experts_are_checked():
    sharded = config_lib.load([f"recipe={RECIPES[0]}", "model.ffn_hidden_size=12304"])
    assert plan.layout_problems(sharded) == [
        "model.fp8: ffn_hidden_size / parallel.tp = 3076 is not a multiple of 16"
    ]
    on_cpu = config_lib.load(["model=qwen3-8b", "model.fp8=hybrid", "model.fp8_recipe=tensorwise"])
    assert plan.layout_problems(on_cpu) == [
        "model.fp8 needs GPUs (Hopper or newer): launcher.gpus_per_node is 0"
    ]
    small_nodes = config_lib.load(
        [
            f"recipe={RECIPES[1]}",
            "launcher.gpus_per_node=2",
            "parallel.tp=2",
            "parallel.dp=1",
            "rollout.engine_tp=2",
        ]
    )
    assert plan.layout_problems(small_nodes) == [
        "launcher.experts[math].tp (4) exceeds launcher.gpus_per_node (2)"
    ]


def test_a_ray_cluster_must_be_the_rollouts_one():
    idle = config_lib.load([f"recipe={RECIPES[0]}", "launcher.ray={nodes: 1}"])
    assert plan.layout_problems(idle) == [
        "launcher.ray starts a Ray cluster that rollout.backend=local does not use "
        "(rollout.backend=ray)"
    ]
    elsewhere = config_lib.load(
        [
            f"recipe={RECIPES[0]}",
            "launcher.ray={nodes: 1}",
            "rollout.engine=hf",
            "rollout.backend=ray",
        ]
    )
    assert plan.layout_problems(elsewhere) == [
        "rollout.ray.address must be auto to join launcher.ray's cluster (the job gets its "
        "RAY_ADDRESS)"
    ]


def test_plan_errors_exit_2_with_every_problem():
    result = run_cli("plan", f"recipe={RECIPES[0]}", "parallel.dp=2", expect=2)
    assert result.stderr.startswith("nemo-orch plan: error: parallel: tp x pp x dp = 8 ranks")
    assert "Traceback" not in result.stderr


ASYNC_RECIPE = "orchestrator-qwen3-8b-1n8g-tp4pp1-fp8-async"


def test_the_async_recipe_gives_the_engine_gpus_of_its_own(capsys):
    assert cli.main(["plan", f"recipe={ASYNC_RECIPE}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "on 4 GPUs of its own" in lines[2]
    config = config_lib.load([f"recipe={ASYNC_RECIPE}"])
    assert config.grpo.async_grpo.enabled and not config.rollout.colocate
    estimate = plan.plan(config)
    # The training GPUs hold no engine; the engine's GPUs hold its shard and KV cache only.
    assert estimate.grpo.engine_weights == 0 and estimate.grpo.kv_cache == 0
    assert estimate.engine.resident == 0 and estimate.engine.activations == 0
    assert estimate.engine.engine_weights == config.model.num_parameters() * 2 // 4
    assert estimate.engine.kv_tokens >= 32768 and estimate.fits()
    row = next(line for line in lines if line.startswith("  engine GPU:"))
    assert float(row.split()[-1]) == pytest.approx(estimate.engine.total / 2**30, abs=0.01)
    # Training takes the node's other GPUs: a rank per GPU but the engine's.
    assert "--nproc-per-node=4 " in torchrun_script(config, ["grpo"])
    # Its layout is checked with the engine's GPUs counted, on one node.
    assert plan.layout_problems(config_lib.load([f"recipe={ASYNC_RECIPE}", "parallel.dp=2"])) == [
        "parallel: tp x pp x dp = 8 ranks + rollout.engine_tp = 4 "
        "engine GPUs, but the launcher gives 1 nodes x 8 GPUs = 8"
    ]
    assert plan.layout_problems(
        config_lib.load([f"recipe={ASYNC_RECIPE}", "launcher.nodes=2", "launcher.gpus_per_node=4"])
    )[-1].startswith(
        "rollout.colocate=false: the engine runs on the first node's last rollout.engine_tp "
        "GPUs beside the training ranks, so launcher.nodes must be 1 (got 2)"
    )


def _rows(lines: list[str]) -> dict[str, list[float]]:
    """The memory table's rows: label -> [sft, grpo or ppo] GiB."""
    start = next(i for i, line in enumerate(lines) if line.startswith("  per-GPU memory"))
    end = next(i for i, line in enumerate(lines) if line.startswith("  total"))
    return {
        " ".join(line.split()[:-2]): [float(value) for value in line.split()[-2:]]
        for line in lines[start + 1 : end + 1]
    }


def test_the_ppo_recipe_counts_the_critic_and_fits(capsys):
    assert cli.main(["plan", f"recipe={PPO_RECIPE}"]) == 0
    ppo_lines = capsys.readouterr().out.splitlines()
    assert cli.main(["plan", f"recipe={RECIPES[0]}"]) == 0
    grpo_lines = capsys.readouterr().out.splitlines()
    config = config_lib.load([f"recipe={PPO_RECIPE}"])
    assert config.grpo.algo == "ppo" and not config.grpo.dynamic_sampling
    assert config.grpo.ppo.critic_optim.lr == 1e-5 and config.grpo.optim.lr == 1e-6
    estimate = plan.plan(config).grpo
    ppo, grpo = _rows(ppo_lines), _rows(grpo_lines)
    assert ppo_lines[3].split()[-2:] == ["sft", "ppo"]
    critic = {label: values for label, values in ppo.items() if label.startswith("critic")}
    assert list(critic) == [
        "critic weights (+ FP8 GEMM copies)",
        "critic gradients (fp32 buffers)",
        "critic optimizer (Adam + fp32 main, /DP4)",
        "critic activations (layers + value head peak)",
    ]
    for label, name in zip(critic, ["weights", "gradients", "optimizer", "activations"]):
        assert critic[label] == [
            0.0,
            pytest.approx(getattr(estimate.critic, name) / 2**30, abs=0.01),
        ]
    # The critic is the policy less its output layer (a 151936 x 4096 / TP4 shard), plus the
    # head: 155,578,367 parameters fewer per GPU
    policy_share = memory.parameter_share(config.model, config.parallel)
    critic_share = memory.parameter_share(config.model, config.parallel, critic=True)
    assert policy_share.total - critic_share.total == 151936 * 4096 // 4 - 4097
    # The policy's rows are the GRPO recipe's; the engine's KV cache gives up what the critic
    # takes; the policy's activations, the larger, count
    for label in (
        "weights (+ FP8 GEMM copies)",
        "gradients (fp32 buffers)",
        "optimizer (Adam + fp32 main, /DP4)",
        "activations (layers in flight + loss peak)",
        "rollout engine weights",
    ):
        assert ppo[label] == grpo[label]
    assert ppo["rollout KV cache"][1] < grpo["rollout KV cache"][1]
    assert (
        "  activations: the policy's count (the policy and the critic train in turn, never at once)"
    ) in ppo_lines
    assert grpo["total"][1] < ppo["total"][1] < 79.6


def test_grpo_plans_have_no_critic(capsys):
    for recipe in RECIPES[:2] + [ASYNC_RECIPE]:
        assert cli.main(["plan", f"recipe={recipe}"]) == 0
        assert "critic" not in capsys.readouterr().out
        assert plan.plan(config_lib.load([f"recipe={recipe}"])).grpo.critic is None


def test_plans_say_what_prefix_sharing_would_save(capsys):
    """The 8B recipes: not applied (Transformer Engine), and micro-batch 1 shares nothing; at
    micro-batch 2 (DP4's ranks hold 2 of a group's 8 samples) a row of one 24,000-token prompt
    and two 8,768-token replies, with its tree mask of 41,536^2 booleans. The main job (CPU,
    the local spec): applied, a group's 16 samples on its one rank, 8 to a micro-batch."""
    assert cli.main(["plan", f"recipe={RECIPES[0]}"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3] == (
        "  prefix sharing: not applied (Transformer Engine's attention does not take the tree "
        "mask yet); micro-batch 1 shares nothing; the table counts none"
    )
    assert lines[-2].startswith(
        "  at micro-batch 2 (a rank's samples of a group, on average): a row of 41,536 tokens "
        "(1 group's prompt of up to 24,000 tokens, max_context_tokens - max_new_tokens, once, "
        "then 2 replies of 8,768) in place of 2 x 32,768; activations "
    )
    sharing = plan.plan(config_lib.load([f"recipe={RECIPES[0]}"])).sharing
    assert sharing.row_tokens == 24000 + 2 * 8768 and sharing.mask == 41536**2
    assert f"(its tree mask {41536**2 / 2**30:.2f})" in lines[-2]
    assert cli.main(["plan"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3] == "  prefix sharing: applied; the table counts none"
    main_job = "at micro-batch 8: a row of 1,696 tokens (1 group's prompt of up to 928 tokens"
    assert main_job in lines[-2]
