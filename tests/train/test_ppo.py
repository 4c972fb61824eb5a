"""PPO (``grpo=ppo``): GAE by hand with observation tokens skipped, whitening and the return
statistics, the clipped value loss, the critic's start and checkpoints, a run and its resume
after a kill, and the settings PPO and GRPO refuse of each other."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from support.cli_helpers import (
    grpo_overrides,
    grpo_stage,
    read_metrics,
    run_cli,
    sum_task_overrides,
)

from nemo_orch import config as config_lib
from nemo_orch.faults import ENV as KILL_AT
from nemo_orch.models import checkpoint
from nemo_orch.train import ppo
from nemo_orch.train.grpo_samples import Sample, micro_batches
from nemo_orch.train.policy import Critic, Policy

PPO_CONFIG = config_lib.load(["grpo=ppo"]).grpo.ppo


def _by_hand(rewards, values, mask, gamma, lam):
    """GAE over the masked positions, written out as the textbook recursion over a list."""
    steps = [i for i, flag in enumerate(mask) if flag]
    advantages = [0.0] * len(rewards)
    following = 0.0
    for k in reversed(range(len(steps))):
        here = steps[k]
        next_value = values[steps[k + 1]] if k + 1 < len(steps) else 0.0
        delta = rewards[here] + gamma * next_value - values[here]
        following = delta + gamma * lam * following
        advantages[here] = following
    return advantages


def test_gae_skips_observation_tokens_by_hand():
    # Two turns of the policy (positions 1-2 and 5-6) around an observation (3-4).
    mask = [0, 1, 1, 0, 0, 1, 1, 0]
    values = [9.0, 0.5, 0.25, 7.0, -3.0, 0.75, 0.5, 4.0]
    rewards = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    gamma, lam = 0.9, 0.8
    advantages, returns = ppo.gae(
        torch.tensor([rewards]),
        torch.tensor([values]),
        torch.tensor([mask], dtype=torch.float),
        gamma,
        lam,
    )
    # Hand-computed: delta_6 = 1 - 0.5; delta_5 = 0.9 * 0.5 - 0.75; delta_2 = 0.9 * 0.75 - 0.25
    # (the observation's values 7 and -3 never enter); delta_1 = 0.9 * 0.25 - 0.5.
    a6 = 0.5
    a5 = (0.45 - 0.75) + 0.72 * a6
    a2 = (0.675 - 0.25) + 0.72 * a5
    a1 = (0.225 - 0.5) + 0.72 * a2
    expected = [0.0, a1, a2, 0.0, 0.0, a5, a6, 0.0]
    assert advantages[0].tolist() == pytest.approx(expected)
    assert expected == pytest.approx(_by_hand(rewards, values, mask, gamma, lam))
    assert returns[0].tolist() == pytest.approx(
        [(a + v) * m for a, v, m in zip(expected, values, mask)]
    )
    # Changing an observation token's value changes nothing.
    values[3] = -100.0
    again, _ = ppo.gae(
        torch.tensor([rewards]),
        torch.tensor([values]),
        torch.tensor([mask], dtype=torch.float),
        gamma,
        lam,
    )
    assert torch.equal(again, advantages)


def test_gae_batches_rows_of_different_lengths():
    generator = torch.Generator().manual_seed(0)
    rewards, values = torch.zeros(3, 12), torch.randn(3, 12, generator=generator)
    mask = (torch.rand(3, 12, generator=generator) > 0.4).float()
    mask[2] = 0  # a row of padding only
    for row in range(2):
        rewards[row, int(mask[row].nonzero().max())] = float(row) + 0.5
    advantages, _ = ppo.gae(rewards, values, mask, 1.0, 0.95)
    for row in range(3):
        assert advantages[row].tolist() == pytest.approx(
            _by_hand(rewards[row].tolist(), values[row].tolist(), mask[row].tolist(), 1.0, 0.95),
            abs=1e-6,
        )


def test_micro_batches_put_the_reward_on_the_last_policy_token():
    samples = [
        Sample([5, 6, 7, 8, 9], [0, 1, 1, 0, 0], [0.0] * 5, 0.0, [0, 1, 0, 0, 0], reward=0.75),
        Sample([5, 6, 7], [0, 0, 1], [0.0] * 3, 0.0, [0, 0, 1], reward=-1.0),
    ]
    (batch,) = micro_batches(samples, 2, 0)
    # Sorted by length, the short one first; labels are ids[1:], so the long one's policy
    # tokens are labels 0 and 1, the short one's label 1.
    assert batch["rewards"][0, :4].tolist() == [0.0, -1.0, 0.0, 0.0]
    assert batch["rewards"][1, :4].tolist() == [0.0, 0.75, 0.0, 0.0]


def test_whitening_and_return_statistics_match_numpy():
    generator = torch.Generator().manual_seed(1)
    tensors = [torch.randn(2, 5, generator=generator) * 3 + 1 for _ in range(2)]
    masks = [(torch.rand(2, 5, generator=generator) > 0.3).float() for _ in range(2)]
    picked = np.concatenate([t[m > 0].numpy() for t, m in zip(tensors, masks)])
    mean, variance, count = ppo.global_moments(tensors, masks)
    assert (mean, variance, count) == pytest.approx((picked.mean(), picked.var(), len(picked)))
    whitened = np.concatenate([w[m > 0].numpy() for w, m in zip(ppo.whiten(tensors, masks), masks)])
    assert whitened.mean() == pytest.approx(0, abs=1e-6)
    assert whitened.std() == pytest.approx(1, abs=1e-4)
    assert all(float(w[m == 0].abs().sum()) == 0 for w, m in zip(ppo.whiten(tensors, masks), masks))


def test_return_statistics_fold_batches_in_like_one_pass(megatron_world):
    config = config_lib.load(
        [
            "grpo=ppo",
            "model.num_layers=1",
            "model.hidden_size=32",
            "model.ffn_hidden_size=64",
            "model.kv_channels=8",
            "model.vocab_size=512",
            "tokenizer.vocab_size=512",
        ]
    )
    critic = Critic(ppo.critic_config(config), megatron_world)
    statistics = ppo.ReturnStatistics(critic, enabled=True)
    assert statistics.scale() == (0.0, 1.0)
    batches = [np.array([1.0, 2.0, 4.0]), np.array([-3.0, 0.5]), np.array([10.0])]
    for values in batches:
        statistics.update(values.mean(), values.var(), len(values))
    everything = np.concatenate(batches)
    assert statistics.scale() == pytest.approx((everything.mean(), everything.std()))
    assert ppo.ReturnStatistics(critic, enabled=False).scale() == (0.0, 1.0)


def test_value_loss_is_clipped_around_the_old_values_by_hand():
    loss_fn = ppo.value_loss(PPO_CONFIG)  # value_clip 0.2
    values = torch.tensor([[0.0, 1.0, 0.5, 9.0]])
    batch = {
        "loss_mask": torch.tensor([[1.0, 1.0, 1.0, 0.0]]),
        "returns": torch.tensor([[1.0, 0.0, 0.5, 0.0]]),
        "old_values": torch.tensor([[0.5, 0.0, 0.0, 0.0]]),
    }
    result = loss_fn(values, batch)
    # token 0: unclipped 0.5; clipped to 0.3 -> 0.5 * 0.49; max 0.5 (the unclipped)
    # token 1: unclipped 0.5; clipped to 0.2 -> 0.02; max 0.5
    # token 2: unclipped 0; clipped to 0.2 -> 0.5 * 0.09 = 0.045 (the clipped is larger)
    assert float(result.loss_sum) == pytest.approx(0.5 + 0.5 + 0.045)
    assert int(result.num_tokens) == 3
    assert float(result.metric_sums["critic/clip_frac"]) == 1.0
    unclipped = ppo.value_loss(config_lib.load(["grpo=ppo", "grpo.ppo.value_clip=null"]).grpo.ppo)(
        values, batch
    )
    assert float(unclipped.loss_sum) == pytest.approx(1.0)


def test_the_critic_starts_from_the_policy_trunk_with_a_zero_head(megatron_world, start_checkpoint):
    config = config_lib.load(["grpo=ppo", f"trainer.init_from={start_checkpoint}", *_tiny_model()])
    critic = ppo.start_critic(config, megatron_world, resumed_step=None)
    policy = Policy(config, megatron_world)
    checkpoint.load(checkpoint.open_checkpoint(start_checkpoint), policy.module)
    trunk = {
        name: tensor
        for name, tensor in policy.module.state_dict().items()
        if not name.startswith("output_layer") and not name.endswith("_extra_state")
    }
    own = critic.module.state_dict()
    assert trunk and all(torch.equal(own[name], tensor) for name, tensor in trunk.items())
    assert float(critic.head.weight.abs().sum()) == 0
    batches = micro_batches(
        [Sample([1, 2, 3, 4], [0, 1, 1, 1], [0.0] * 4, 0.0, [0, 1, 1, 1])], 1, 0
    )
    (values,) = critic.forward_values(batches)
    assert values.shape == batches[0]["tokens"].shape and float(values.abs().sum()) == 0


# ----------------------------------------------------------------------------- runs


def _tiny_model() -> list[str]:
    from support.cli_helpers import TINY_LONG_MODEL

    return ["model.vocab_size=1024", "tokenizer.vocab_size=1000", *TINY_LONG_MODEL]


def _tasks(tmp_path: Path) -> list[str]:
    return [*sum_task_overrides(tmp_path), "grpo=ppo"]


def _learned(metrics: dict) -> dict:
    """What two runs of the same samples and weights agree on: all but wall-clock figures."""
    return {
        key: value
        for key, value in metrics.items()
        if not key.startswith("time/") and "per_s" not in key and "seconds" not in key
    }


@pytest.fixture(scope="module")
def ppo_runs(start_checkpoint, tmp_path_factory) -> tuple[Path, Path]:
    """Three PPO steps killed in the third and resumed from step 2's checkpoint, and the same
    three steps straight: their stage directories."""
    out = tmp_path_factory.mktemp("ppo")
    args = grpo_overrides(
        start_checkpoint, out / "killed", *_tasks(out), "grpo.max_steps=3", "grpo.save_interval=2"
    )
    assert (
        run_cli("grpo", *args, env={KILL_AT: "step:3"}, expect=None).returncode == -signal.SIGKILL
    )
    assert (grpo_stage(out / "killed") / ppo.CRITIC_DIR / "step_2").is_dir()
    run_cli("grpo", *args)
    run_cli(
        "grpo",
        *grpo_overrides(
            start_checkpoint,
            out / "whole",
            *_tasks(out),
            "grpo.max_steps=3",
            "grpo.save_interval=2",
        ),
    )
    return grpo_stage(out / "killed"), grpo_stage(out / "whole")


def test_ppo_trains_policy_and_critic_and_resumes_both_after_a_kill(ppo_runs):
    resumed, whole = (read_metrics(stage) for stage in ppo_runs)
    assert [m["step"] for m in resumed] == [1, 2, 3]
    # Step 3 after the resume is step 3 of the straight run: the critic's weights, optimizer
    # and return statistics came back with the policy's.
    assert _learned(resumed[2]) == pytest.approx(_learned(whole[2]), rel=1e-5, abs=1e-7)
    assert {"critic/value_loss", "critic/grad_norm", "critic/return_mean", "policy_loss"} <= whole[
        0
    ].keys()
    assert any(m["critic/value_loss"] > 0 for m in whole)


@pytest.mark.parametrize(
    "overrides, key",
    [
        (("grpo=ppo", "grpo.dynamic_sampling=true"), "grpo.dynamic_sampling"),
        (("grpo=ppo", "grpo.async_grpo.enabled=true"), "grpo.async_grpo.enabled"),
        (("grpo=ppo", "grpo.sample_mode=turn"), "grpo.sample_mode"),
        (("grpo.algo=ppo",), "grpo.ppo"),
        (("grpo=ppo", "grpo.algo=grpo"), "grpo.ppo"),
    ],
)
def test_ppo_and_grpo_refuse_each_others_settings(overrides, key):
    with pytest.raises(config_lib.ConfigError, match=key.replace(".", r"\.")):
        config_lib.load(list(overrides))


def test_the_command_line_refuses_a_grpo_setting_under_ppo(start_checkpoint, tmp_path):
    result = run_cli(
        "grpo",
        *grpo_overrides(
            start_checkpoint, tmp_path, *_tasks(tmp_path), "grpo.dynamic_sampling=true"
        ),
        expect=2,
    )
    assert "grpo.dynamic_sampling" in result.stderr


def test_a_critic_checkpoint_of_another_architecture_is_refused(
    ppo_runs, megatron_world, start_checkpoint, tmp_path
):
    critic = tmp_path / "deeper"
    shutil.copytree(ppo_runs[1] / ppo.CRITIC_DIR / "step_2", critic)
    saved = OmegaConf.load(critic / checkpoint.CONFIG_FILE)
    saved.model.num_layers += 1  # as a critic of a deeper policy would have it
    OmegaConf.save(saved, critic / checkpoint.CONFIG_FILE)
    config = config_lib.load(
        [
            "grpo=ppo",
            f"trainer.init_from={start_checkpoint}",
            f"grpo.ppo.critic_init_from={critic}",
            *_tiny_model(),
        ]
    )
    with pytest.raises(config_lib.ConfigError, match=r"grpo\.ppo\.critic_init_from=.*num_layers"):
        ppo.start_critic(config, megatron_world, resumed_step=None)
