"""The GRPO loss: hand-computed values for every branch, and real steps on a tiny policy."""

import dataclasses

import pytest
import torch
from multiprocess.grpo_step import OVERRIDES, rank_batches, synthetic_samples

from nemo_orch import config as config_lib
from nemo_orch.config import GRPOConfig
from nemo_orch.models.hf_mapping import SeededHFWeights
from nemo_orch.train import grpo as grpo_recipe
from nemo_orch.train import policy as policy_module
from nemo_orch.train.grpo_loss import grpo_token_loss
from nemo_orch.train.policy import Policy, ReferenceModel

# One row per token: which branch of the loss it takes, worked out by hand with clip_low 0.2,
# clip_high 0.28 (ratios kept in [0.8, 1.28]) and dual_clip 3.
#   branch                  logp  old   A     ref  mask  ratio=e^(logp-old)  surrogate
#   unclipped               -1.0  -1.1   1.0  -1.0  1    e^0.1 = 1.105171    -1.105171
#   clipped high            -0.5  -1.0   2.0  -1.0  1    e^0.5 = 1.648721    -2 * 1.28  = -2.56
#   clipped low             -2.0  -1.5  -1.0  -1.5  1    e^-.5 = 0.606531     1 * 0.8   =  0.8
#   dual clip               -0.2  -1.6  -0.5  -0.2  1    e^1.4 = 4.055200     0.5 * 3   =  1.5
#   A < 0, ratio in (1.28,3) -1.0 -1.7  -1.0   0.0  1    e^0.7 = 2.013753     2.013753
#   masked                  -0.1  -3.0   5.0  -2.0  0    e^2.9 = 18.17       (ignored)
# k3 = e^(ref-logp) - (ref-logp) - 1: 0, e^-.5-.5 = .106531, e^.5-1.5 = .148721, 0, e-2 = .718282
# mse = (logp-ref)^2 / 2:              0, .125,                .125,              0, .5
LOGP = [[-1.0, -0.5, -2.0], [-0.2, -1.0, -0.1]]
OLD = [[-1.1, -1.0, -1.5], [-1.6, -1.7, -3.0]]
ADVANTAGES = [[1.0, 2.0, -1.0], [-0.5, -1.0, 5.0]]
REF = [[-1.0, -1.0, -1.5], [-0.2, 0.0, -2.0]]
MASK = [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
ENGINE_OFFSET = [[0.1, -0.2, 0.0], [0.0, 0.3, 9.0]]

SURROGATE_SUM = -1.105171 - 2.56 + 0.8 + 1.5 + 2.013753  # 0.648582
K3_SUM = 0.106531 + 0.148721 + 0.718282  # 0.973534
MSE_SUM = 0.125 + 0.125 + 0.5
RATIO_SUM = 1.105171 + 1.648721 + 0.606531 + 4.055200 + 2.013753


def hand_batch(requires_grad: bool = False) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    token_losses = (-torch.tensor(LOGP)).requires_grad_(requires_grad)
    batch = {
        "old_logprobs": torch.tensor(OLD),
        "advantages": torch.tensor(ADVANTAGES),
        "ref_logprobs": torch.tensor(REF),
        "loss_mask": torch.tensor(MASK),
        "engine_logprobs": torch.tensor(OLD) + torch.tensor(ENGINE_OFFSET),
    }
    return token_losses, batch


def grpo(**changes) -> GRPOConfig:
    return GRPOConfig(
        **{
            "clip_low": 0.2,
            "clip_high": 0.28,
            "dual_clip": 3.0,
            "kl_type": "k3",
            "kl_coef": 0.1,
            **changes,
        }
    )


@pytest.mark.parametrize("kl_type, kl_sum", [("k3", K3_SUM), ("mse", MSE_SUM)])
def test_loss_and_metrics_by_hand(kl_type, kl_sum):
    result = grpo_token_loss(grpo(kl_type=kl_type))(*hand_batch())
    assert int(result.num_tokens) == 5
    assert float(result.loss_sum) == pytest.approx(SURROGATE_SUM + 0.1 * kl_sum, abs=1e-5)
    sums = {key: float(value) for key, value in result.metric_sums.items()}
    assert sums == pytest.approx(
        {
            "policy_loss": SURROGATE_SUM,
            "kl": kl_sum,
            "kl_loss": 0.1 * kl_sum,
            "ratio_mean": RATIO_SUM,
            "clip_frac_high": 1.0,
            "clip_frac_low": 1.0,
            "clip_frac_dual": 1.0,
            "engine_logprob_abs_diff": 0.1 + 0.2 + 0.3,
        },
        abs=1e-5,
    )
    # the masked token's ratio (18.17) does not count
    assert float(result.metric_maxima["ratio_max"]) == pytest.approx(4.055200, abs=1e-5)


def test_the_kl_term_covers_only_the_policys_own_draws():
    """A token exploration forced (``kl_mask`` 0) keeps its surrogate but adds no KL: here the
    k3 of the third token (0.148721), one the policy made less likely than the reference."""
    token_losses, batch = hand_batch(requires_grad=True)
    batch["kl_mask"] = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    result = grpo_token_loss(grpo())(token_losses, batch)
    assert float(result.metric_sums["kl"]) == pytest.approx(K3_SUM - 0.148721, abs=1e-5)
    assert float(result.metric_sums["policy_loss"]) == pytest.approx(SURROGATE_SUM, abs=1e-5)
    result.loss_sum.backward()
    assert float(token_losses.grad[0, 2]) == 0.0  # clipped low, and no KL gradient


def test_without_dual_clip_the_negative_advantage_loss_follows_the_ratio():
    result = grpo_token_loss(grpo(dual_clip=0.0, kl_coef=0.0))(*hand_batch())
    assert float(result.metric_sums["policy_loss"]) == pytest.approx(
        SURROGATE_SUM - 1.5 + 0.5 * 4.055200, abs=1e-5
    )
    assert float(result.metric_sums["clip_frac_dual"]) == 0.0


def test_only_unclipped_tokens_carry_gradient():
    token_losses, batch = hand_batch(requires_grad=True)
    grpo_token_loss(grpo(kl_coef=0.0))(token_losses, batch).loss_sum.backward()
    # d(-r A)/d(-logp) = r A on unclipped tokens; clipped, dual-clipped and masked ones get none
    torch.testing.assert_close(
        token_losses.grad,
        torch.tensor([[1.105171, 0.0, 0.0], [0.0, -2.013753, 0.0]]),
        atol=1e-5,
        rtol=0,
    )


def test_without_a_kl_term_the_reference_is_optional():
    token_losses, batch = hand_batch()
    del batch["ref_logprobs"], batch["engine_logprobs"]
    result = grpo_token_loss(grpo(kl_coef=0.0))(token_losses, batch)
    assert float(result.loss_sum) == pytest.approx(SURROGATE_SUM, abs=1e-5)
    assert {"kl", "kl_loss", "engine_logprob_abs_diff"}.isdisjoint(result.metric_sums)


@pytest.fixture
def tiny_policy(megatron_world):
    config = config_lib.load(OVERRIDES)
    policy = Policy(config, megatron_world)
    policy.load_hf_weights(SeededHFWeights(config.model, config.run.seed))
    return config, policy, megatron_world


def on_policy_batches(config, policy, context, advantage_per_sequence: torch.Tensor):
    """Micro-batches whose old and reference log-probabilities are the policy's own (ratio 1),
    sequence ``i`` with advantage ``advantage_per_sequence[i]`` (in the micro-batches' order:
    see :func:`sequence_advantages`)."""
    samples = [
        dataclasses.replace(sample, advantage=float(advantage))
        for sample, advantage in zip(synthetic_samples(config), advantage_per_sequence, strict=True)
    ]
    batches = rank_batches(samples, config, context)
    for micro_batch, logprobs in zip(batches, policy.forward_logprobs(batches)):
        del micro_batch["engine_logprobs"]  # the samples' are placeholders
        micro_batch.update(old_logprobs=logprobs, ref_logprobs=logprobs)
    return batches


def sequence_advantages(batches) -> torch.Tensor:
    """Per sequence, in the micro-batches' order."""
    return torch.cat([batch["advantages"].sum(1) / batch["loss_mask"].sum(1) for batch in batches])


def sequence_mean_logprobs(policy, batches) -> torch.Tensor:
    """Per sequence, over the micro-batches (which differ in length)."""
    return torch.cat(
        [
            (logprobs * batch["loss_mask"]).sum(1) / batch["loss_mask"].sum(1)
            for logprobs, batch in zip(policy.forward_logprobs(batches), batches)
        ]
    )


def test_a_step_raises_the_logprobs_of_positive_advantages(tiny_policy):
    config, policy, context = tiny_policy
    batches = on_policy_batches(config, policy, context, torch.tensor([1.0, -1.0] * 4))
    advantages = sequence_advantages(batches)
    before = sequence_mean_logprobs(policy, batches)
    result = policy.train_step(batches, grpo_token_loss(config.grpo))
    change = sequence_mean_logprobs(policy, batches) - before
    assert (change[advantages > 0] > 0).all() and (change[advantages < 0] < 0).all()
    assert result.metrics["ratio_mean"] == pytest.approx(1.0) and result.metrics["kl"] == 0.0
    assert result.metrics["ratio_max"] == pytest.approx(1.0)


def test_zero_advantages_on_policy_without_kl_is_zero_loss(tiny_policy):
    config, policy, context = tiny_policy
    batches = on_policy_batches(config, policy, context, torch.zeros(8))
    for batch in batches:
        del batch["ref_logprobs"]
    result = policy.train_step(
        batches, grpo_token_loss(dataclasses.replace(config.grpo, kl_coef=0.0))
    )
    assert result.loss == 0.0 and result.grad_norm == 0.0 and result.num_tokens > 0
    assert result.metrics == pytest.approx(
        {
            "policy_loss": 0.0,
            "ratio_mean": 1.0,
            "ratio_max": 1.0,
            "clip_frac_low": 0.0,
            "clip_frac_high": 0.0,
            "clip_frac_dual": 0.0,
        }
    )


def test_reference_is_a_frozen_copy_of_the_policy(tiny_policy):
    config, policy, context = tiny_policy
    reference = ReferenceModel(config, context)
    reference.module.load_state_dict(policy.module.state_dict())  # same layout
    batches = on_policy_batches(config, policy, context, torch.ones(8))
    start = reference.forward_logprobs(batches)
    torch.testing.assert_close(start, policy.forward_logprobs(batches), atol=0, rtol=0)
    policy.train_step(batches, grpo_token_loss(config.grpo))
    torch.testing.assert_close(reference.forward_logprobs(batches), start, atol=0, rtol=0)
    assert not any(p.requires_grad for p in reference.module.parameters())


def test_an_optimizer_that_never_stepped_is_saved_and_resumed(tiny_policy, tmp_path):
    """GRPO can reach a save before any update (every group of its first steps filtered): the
    checkpoint is written, and a run resumed from it trains as one that never saved."""
    from nemo_orch.models import checkpoint

    config, policy, context = tiny_policy
    saved = checkpoint.save(
        config, 1, policy.module, policy.optimizer, policy.scheduler, directory=tmp_path
    )
    checkpoint.load(
        checkpoint.open_checkpoint(saved), policy.module, policy.optimizer, policy.scheduler
    )
    batches = on_policy_batches(config, policy, context, torch.ones(8))
    assert torch.isfinite(torch.tensor(policy.train_step(batches).loss))


def test_an_update_with_too_few_samples_is_skipped(tiny_policy):
    config, policy, context = tiny_policy
    (sample,) = synthetic_samples(config, count=1)
    before = [parameter.detach().clone() for parameter in policy.module.parameters()]
    loss = grpo_token_loss(config.grpo)
    learner = grpo_recipe.Learner(policy, ReferenceModel(config, context), loss, 0, 0)
    assert grpo_recipe._update(learner, [sample], config, 1) == {"skipped_update": 1.0}
    assert all(torch.equal(old, new) for old, new in zip(before, policy.module.parameters()))


def test_the_kl_guard_skips_an_update_whose_kl_passes_it_and_rolls_back_the_last(tiny_policy):
    # The reference is a differently seeded model: far from the policy, as after a collapse.
    config, policy, context = tiny_policy
    reference = ReferenceModel(config, context)
    reference.load_hf_weights(SeededHFWeights(config.model, config.run.seed + 1))
    samples = synthetic_samples(config)

    def update(kl_guard: float, rollback=None) -> dict[str, float]:
        guarded = config_lib.replace(
            config, grpo=dataclasses.replace(config.grpo, kl_guard=kl_guard)
        )
        learner = grpo_recipe.Learner(policy, reference, grpo_token_loss(guarded.grpo), 0, 0)
        return grpo_recipe._update(learner, samples, guarded, 1, rollback=rollback)

    before = [parameter.detach().clone() for parameter in policy.module.parameters()]
    skipped = update(kl_guard=0.01)
    assert skipped["kl_guard/skipped"] == 1.0 and skipped["kl_guard/kl"] > 0.01
    assert all(torch.equal(old, new) for old, new in zip(before, policy.module.parameters()))
    trained = update(kl_guard=1e6)
    assert "kl_guard/skipped" not in trained and trained["kl_guard/kl"] == skipped["kl_guard/kl"]
    assert not all(torch.equal(old, new) for old, new in zip(before, policy.module.parameters()))
    # The next step's samples come from the updated policy; past the guard, the update that
    # produced it is rolled back.
    rolled = update(kl_guard=0.01, rollback=before)
    assert rolled["kl_guard/rolled_back"] == 1.0 and rolled["kl_guard/skipped"] == 1.0
    assert all(torch.equal(old, new) for old, new in zip(before, policy.module.parameters()))
    after = update(kl_guard=1e6)
    assert after["kl_guard/kl"] == pytest.approx(skipped["kl_guard/kl"])


def test_truncated_importance_sampling_by_hand():
    """Weights min(exp(old - engine), cap) with the engine's logprobs old + ENGINE_OFFSET:
    e^-0.1, e^0.2 -> cap 1.1, 1, 1, e^-0.3 (the masked token's e^-9 does not count)."""
    result = grpo_token_loss(grpo(kl_coef=0.0, importance_sampling_cap=1.1))(*hand_batch())
    # -e^0.1 e^-0.1 - 2.56 * 1.1 + 0.8 + 1.5 + e^0.7 e^-0.3
    expected = -1.0 - 2.816 + 0.8 + 1.5 + 1.491825
    assert float(result.loss_sum) == pytest.approx(expected, abs=1e-5)
    sums = {key: float(value) for key, value in result.metric_sums.items()}
    assert sums["is_weight_mean"] == pytest.approx(0.904837 + 1.1 + 1 + 1 + 0.740818, abs=1e-5)
    assert sums["is_truncated_frac"] == 1.0
    # Only the weight scales the gradient: it is not differentiated.
    token_losses, batch = hand_batch(requires_grad=True)
    grpo_token_loss(grpo(kl_coef=0.0, importance_sampling_cap=1.1))(
        token_losses, batch
    ).loss_sum.backward()
    torch.testing.assert_close(
        token_losses.grad, torch.tensor([[1.0, 0.0, 0.0], [0.0, -1.491825, 0.0]]), atol=1e-5, rtol=0
    )
    with pytest.raises(config_lib.ConfigError, match="importance_sampling_cap"):
        grpo(importance_sampling_cap=0.5)


def test_with_the_engine_as_the_old_policy_the_ratio_is_to_the_engine():
    """``grpo.old_logprobs=engine`` (what ``_update`` hands the loss as the old ones): ratios
    e^(logp - engine) = 1, e^0.7, e^-0.5, e^1.4, e^0.4; the mismatch is measured against this
    pass's logprobs."""
    token_losses, batch = hand_batch()
    batch["old_logprobs"] = batch["engine_logprobs"]
    result = grpo_token_loss(grpo(kl_coef=0.0, old_logprobs="engine"))(token_losses, batch)
    # -1 * 1, clipped high -2 * 1.28, clipped low 1 * 0.8, dual clip 0.5 * 3, 1 * e^0.4
    assert float(result.loss_sum) == pytest.approx(-1.0 - 2.56 + 0.8 + 1.5 + 1.491825, abs=1e-5)
    sums = {key: float(value) for key, value in result.metric_sums.items()}
    assert sums["engine_logprob_abs_diff"] == pytest.approx(0.0 + 0.7 + 0.5 + 1.4 + 0.4, abs=1e-5)


def test_logprobs_and_gradients_come_from_the_loss_positions_alone(tiny_policy):
    """The output layer runs on the positions the loss mask sets: there, the same log-probabilities
    and gradients as the full forward's; elsewhere (the prompt), zeros."""
    config, policy, context = tiny_policy
    batches = rank_batches(synthetic_samples(config), config, context)
    model = policy.module
    for batch, logprobs in zip(batches, policy.forward_logprobs(batches)):
        mask = batch["loss_mask"] > 0
        assert 0 < mask.sum() < mask.numel()  # a prompt to leave out
        with torch.no_grad():
            full = -model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        torch.testing.assert_close(logprobs[mask], full[mask], rtol=0, atol=1e-6)
        assert not logprobs[~mask].any()
    batch = batches[0]
    gradients = []
    for losses in (
        lambda: policy_module._stage_output(model, batch, labels=True),
        lambda: model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"]),
    ):
        gradients.append(
            torch.autograd.grad((losses() * batch["loss_mask"]).sum(), list(model.parameters()))
        )
    for masked, full in zip(*gradients, strict=True):
        torch.testing.assert_close(masked, full, rtol=1e-5, atol=1e-6)
