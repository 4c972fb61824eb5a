"""Prefix-shared micro-batches: the token tree by hand, and on a tiny policy the same
log-probabilities, gradients and critic values as the unshared micro-batches."""

import dataclasses

import pytest
import torch
from multiprocess.grpo_step import OVERRIDES, PAD, synthetic_samples

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError, PPOConfig
from nemo_orch.models.hf_mapping import SeededHFWeights
from nemo_orch.models.positioned_gpt import rotary_at
from nemo_orch.train import grpo, ppo
from nemo_orch.train.grpo_samples import micro_batches
from nemo_orch.train.policy import Critic, Policy, _stage_output
from nemo_orch.train.prefix_sharing import packed_inputs, token_tree


def test_a_token_tree_by_hand():
    # [5 6 7] and [5 6 8] share "5 6"; [5 6] is a prefix of both; [9] stands alone
    tree = token_tree([[5, 6, 8], [9], [5, 6, 7], [5, 6]])
    assert tree.tokens == [5, 6, 7, 8, 9]  # depth-first, in token order
    assert tree.depths == [0, 1, 2, 2, 0]
    assert tree.ends == [4, 4, 3, 4, 5]
    assert tree.nodes == [[0, 1, 3], [4], [0, 1, 2], [0, 1]]
    packed = packed_inputs(tree, width=4, length=7, pad_id=0)
    assert packed["tokens"].tolist() == [[5, 6, 7, 8, 9, 0, 0]]
    assert packed["position_ids"].tolist() == [[0, 1, 2, 2, 0, 0, 0]]
    visible = (~packed["attention_mask"][0, 0]).int().tolist()
    assert visible == [
        [1, 0, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0],  # 7 sees its prefix, not its sibling 8
        [1, 1, 0, 1, 0, 0, 0],
        [0, 0, 0, 0, 1, 0, 0],
        [0, 0, 0, 0, 0, 1, 0],  # padding sees itself alone
        [0, 0, 0, 0, 0, 0, 1],
    ]
    assert packed["unpack"].tolist() == [[0, 1, 3, 0], [4, 0, 0, 0], [0, 1, 2, 0], [0, 1, 0, 0]]
    with pytest.raises(ValueError, match="cannot hold"):
        packed_inputs(tree, width=4, length=4, pad_id=0)


def test_ordinary_positions_take_megatrons_own_rotary_embedding():
    rotary = torch.randn(6, 1, 1, 4)
    assert torch.equal(rotary_at(rotary, torch.arange(6).repeat(3, 1)), rotary)
    mixed = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 2, 0, 0]])
    taken = rotary_at(rotary, mixed)
    assert taken.shape == (6, 2, 1, 4) and torch.equal(taken[3, 1], rotary[2, 0])
    with pytest.raises(ValueError, match="past the sequence"):
        rotary_at(rotary, torch.tensor([[0, 6]]))


@pytest.fixture
def shared_batches(megatron_world):
    """The synthetic samples, each pair sharing its prompt, cut both ways."""
    config = config_lib.load(OVERRIDES)
    samples = synthetic_samples(config)
    plain = micro_batches(samples, 4, PAD)
    packed = micro_batches(samples, 4, PAD, share_prefixes=True)
    return config, samples, plain, packed


def by_sample(samples, batches, outputs):
    """Each sample's output row (cut to its length), found by its labels."""
    rows = {}
    for batch, output in zip(batches, outputs):
        for labels, row in zip(batch["labels"], output):
            rows[tuple(labels.tolist())] = row
    found = []
    for sample in samples:
        length = len(sample.token_ids) - 1
        key = next(k for k in rows if list(k[:length]) == sample.token_ids[1:])
        found.append(rows[key][:length])
    return found


def test_shared_prefixes_give_the_unshared_logprobs_and_gradients(shared_batches, megatron_world):
    config, samples, plain, packed = shared_batches
    computed = sum(batch["tokens"].numel() for batch in packed)
    assert computed < sum(len(s.token_ids) - 1 for s in samples)  # real sharing
    policy = Policy(config, megatron_world)
    policy.load_hf_weights(SeededHFWeights(config.model, config.run.seed))
    for want, got in zip(
        by_sample(samples, plain, policy.forward_logprobs(plain)),
        by_sample(samples, packed, policy.forward_logprobs(packed)),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    model = policy.module

    def gradients(batches):
        loss = sum(
            (_stage_output(model, batch, labels=True) * batch["loss_mask"]).sum()
            for batch in batches
        )
        return torch.autograd.grad(loss, list(model.parameters()))

    for got, want in zip(gradients(packed), gradients(plain), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_shared_prefixes_give_the_critics_values(shared_batches, megatron_world):
    config, samples, plain, packed = shared_batches
    ppo_config = config_lib.replace(
        config,
        grpo=dataclasses.replace(config.grpo, algo="ppo", dynamic_sampling=False, ppo=PPOConfig()),
    )
    critic = Critic(ppo.critic_config(ppo_config), megatron_world)
    critic.load_hf_weights(SeededHFWeights(config.model, config.run.seed))
    with torch.no_grad():
        critic.head.weight.copy_(torch.randn(critic.head.weight.shape))
    for want, got in zip(
        by_sample(samples, plain, critic.forward_values(plain)),
        by_sample(samples, packed, critic.forward_values(packed)),
        strict=True,
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_prefix_sharing_is_on_where_the_attention_takes_a_tree():
    config = config_lib.load([])
    assert config.grpo.prefix_sharing == "auto" and grpo.shares_prefixes(config)  # CPU, local
    off = config_lib.replace(config, grpo=dataclasses.replace(config.grpo, prefix_sharing="off"))
    assert not grpo.shares_prefixes(off)
    engine = config_lib.replace(
        config,
        grpo=dataclasses.replace(config.grpo, prefix_sharing="on"),
        model=dataclasses.replace(config.model, transformer_impl="transformer_engine"),
    )
    with pytest.raises(ConfigError, match="prefix_sharing=on needs an attention"):
        grpo.shares_prefixes(engine)
    auto = config_lib.replace(engine, grpo=config.grpo)
    assert not grpo.shares_prefixes(auto)
