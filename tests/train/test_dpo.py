"""DPO: the loss against a hand computation, what it counts, pairs from the offline world's
rollouts, and ``nemo-orch dpo`` end to end: learning its pairs, exact resume after a kill, and
the errors a user meets."""

from __future__ import annotations

import itertools
import json
import math
import re
import signal
from pathlib import Path

import pytest
import torch
from support.cli_helpers import read_metrics, run_cli, run_cli_here

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError, DPOConfig
from nemo_orch.data.pairs import DataError, Pair, PairTokens, SideTokens, read_pairs, write_pairs
from nemo_orch.data.tasks import Task
from nemo_orch.faults import ENV as KILL_AT
from nemo_orch.reward.combine import RewardBreakdown
from nemo_orch.rollout.trajectory import Trajectory
from nemo_orch.train import dpo
from nemo_orch.train.dpo_loss import dpo_token_loss
from nemo_orch.train.grpo_groups import Group

# ----------------------------------------------------------------------------- the loss

# Two pairs, [chosen, rejected, chosen, rejected] rows of three labels; the last label of the
# first row is an observation (mask 0) whose loss must not count.
TOKEN_LOSSES = torch.tensor([[0.5, 1.0, 9.0], [0.2, 2.0, 3.0], [1.0, 1.0, 1.0], [0.1, 0.1, 0.4]])
LOSS_MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
REF_SUMS = torch.tensor([-2.0, -4.0, -1.5, -0.7])


def _batch() -> dict[str, torch.Tensor]:
    return {"loss_mask": LOSS_MASK, "ref_logprob_sums": REF_SUMS}


# log pi - log ref of each side, pair by pair, written out: chosen [0.5, -0.5], rejected
# [-1.2, 0.2], so the margins h are [1.7, -0.7].
CHOSEN_LOGRATIOS = [-(0.5 + 1.0) - -2.0, -(1.0 + 1.0) - -1.5]
REJECTED_LOGRATIOS = [-(0.2 + 2.0 + 3.0) - -4.0, -(0.1 + 0.4) - -0.7]
MARGINS = [c - r for c, r in zip(CHOSEN_LOGRATIOS, REJECTED_LOGRATIOS)]


def _log_sigmoid(x: float) -> float:
    return -math.log(1 + math.exp(-x))


@pytest.mark.parametrize(
    "loss_type, beta, smoothing", [("sigmoid", 0.1, 0.0), ("sigmoid", 2.0, 0.2), ("ipo", 0.5, 0.0)]
)
def test_the_losses_match_a_hand_computation(loss_type, beta, smoothing):
    config = DPOConfig(loss_type=loss_type, beta=beta, label_smoothing=smoothing)
    result = dpo_token_loss(config)(TOKEN_LOSSES, _batch())
    if loss_type == "ipo":
        expected = [(h - 1 / (2 * beta)) ** 2 for h in MARGINS]
    else:
        expected = [
            -(1 - smoothing) * _log_sigmoid(beta * h) - smoothing * _log_sigmoid(-beta * h)
            for h in MARGINS
        ]
    assert result.loss_sum.item() == pytest.approx(sum(expected), rel=1e-6)
    assert result.num_tokens.item() == 2  # the mean is over pairs
    sums = {key: value.item() for key, value in result.metric_sums.items()}
    assert sums["rewards/chosen"] == pytest.approx(beta * sum(CHOSEN_LOGRATIOS), abs=1e-6)
    assert sums["rewards/rejected"] == pytest.approx(beta * sum(REJECTED_LOGRATIOS))
    assert sums["rewards/margins"] == pytest.approx(beta * sum(MARGINS))
    assert sums["rewards/accuracies"] == 1.0  # the first pair only
    assert sums["logps/chosen"] == pytest.approx(-1.5 - 2.0)
    assert sums["logps/rejected"] == pytest.approx(-5.2 - 0.5)


def test_only_the_policys_tokens_count():
    loss = dpo_token_loss(DPOConfig())
    token_losses = TOKEN_LOSSES.clone().requires_grad_()
    result = loss(token_losses, _batch())
    result.loss_sum.backward()
    assert torch.equal(token_losses.grad == 0, LOSS_MASK == 0)  # no gradient through context
    observation = TOKEN_LOSSES.clone()
    observation[0, 2] = 100.0  # an observation token the policy never wrote
    assert loss(observation, _batch()).loss_sum.item() == result.loss_sum.item()
    policy = TOKEN_LOSSES.clone()
    policy[0, 1] = 100.0
    assert loss(policy, _batch()).loss_sum.item() > result.loss_sum.item()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"loss_type": "kto"}, "dpo.loss_type must be sigmoid|ipo"),
        ({"beta": 0}, "dpo.beta must be > 0"),
        ({"min_margin": 0}, "dpo.min_margin must be > 0"),
        ({"label_smoothing": 0.5}, "dpo.label_smoothing must be in [0, 0.5)"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "applies to loss_type=sigmoid only"),
        ({"global_batch_size": 6}, "multiple of dpo.micro_batch_size"),
        ({"pairs_path": "no/such/pairs.jsonl"}, "dpo.pairs_path: no such file"),
    ],
)
def test_the_dpo_section_is_checked(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        DPOConfig(**fields)


def test_the_batch_splits_over_data_parallel_ranks_when_the_config_loads():
    with pytest.raises(ConfigError, match=r"micro_batch_size x parallel.dp"):
        config_lib.load(["parallel.dp=2", "trainer.micro_batch_size=8", "dpo.global_batch_size=4"])


# ----------------------------------------------------------------------------- sequences


def _masked_text(tokenizer, ids: list[int], mask: list[int]) -> str:
    return tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)


def test_template_pairs_learn_the_sides_assistant_tokens_only(tiny_tokenizer, tmp_path):
    """A prompt with an earlier assistant turn (context: no loss) and a side that calls a tool
    (its result: no loss)."""
    search = {"type": "function", "function": {"name": "search", "arguments": {"query": "x"}}}
    pair = Pair(
        "p",
        [
            {"role": "user", "content": "1 + 1?"},
            {"role": "assistant", "content": "<answer>2</answer>"},
            {"role": "user", "content": "And 6 x 7?"},
        ],
        [
            {"role": "assistant", "content": "", "tool_calls": [search]},
            {"role": "tool", "content": "forty-two"},
            {"role": "assistant", "content": "<answer>42</answer>"},
        ],
        [{"role": "assistant", "content": "<answer>41</answer>"}],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "search",
                    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}},
                },
            }
        ],
    )
    (chosen, chosen_mask), (rejected, rejected_mask) = dpo.pair_sequences(
        tiny_tokenizer, pair, "here"
    )
    assert _masked_text(tiny_tokenizer, chosen, chosen_mask) == (
        '<tool_call>\n{"name": "search", "arguments": {"query": "x"}}\n</tool_call><|im_end|>'
        "<answer>42</answer><|im_end|>"
    )
    assert _masked_text(tiny_tokenizer, rejected, rejected_mask) == "<answer>41</answer><|im_end|>"
    prompt = len(
        tiny_tokenizer.apply_chat_template(
            pair.prompt, tools=pair.tools, tokenize=True, return_dict=True
        )["input_ids"]
    )
    assert chosen[:prompt] == rejected[:prompt] and not any(chosen_mask[:prompt])


def test_token_pairs_keep_their_tokens_if_their_prompt_is_this_tokenizers(tiny_tokenizer):
    prompt = [{"role": "user", "content": "6 x 7?"}]
    prompt_ids = list(
        tiny_tokenizer.apply_chat_template(
            prompt, tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )
    chosen, rejected = SideTokens([5, 6, 7], [1, 0, 1]), SideTokens([8], [1])
    pair = Pair(
        "p",
        prompt,
        [{"role": "assistant", "content": "a"}],
        [{"role": "assistant", "content": "b"}],
        tokens=PairTokens(prompt_ids, chosen, rejected),
    )
    assert dpo.pair_sequences(tiny_tokenizer, pair, "here") == [
        (prompt_ids + [5, 6, 7], [0] * len(prompt_ids) + [1, 0, 1]),
        (prompt_ids + [8], [0] * len(prompt_ids) + [1]),
    ]
    foreign = Pair(**{**pair.__dict__, "tokens": PairTokens(prompt_ids[1:], chosen, rejected)})
    with pytest.raises(DataError, match="here: tokens.prompt does not decode to the prompt"):
        dpo.pair_sequences(tiny_tokenizer, foreign, "here")


# ----------------------------------------------------------------------------- pairs from rollouts


def _episode(
    tokenizer, sample: int, answer: str, termination: str = "answer", question: str = "6 x 7?"
) -> Trajectory:
    """An episode that answers at once, its tokens the template's rendering."""
    messages = [{"role": "user", "content": question}]
    prompt = list(
        tokenizer.apply_chat_template(
            messages, tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )
    reply = tokenizer.encode(f"<answer>{answer}</answer>", add_special_tokens=False) + [
        tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    ]
    return Trajectory(
        task_id="t",
        sample=sample,
        messages=messages + [{"role": "assistant", "content": f"<answer>{answer}</answer>"}],
        tools=[],
        token_ids=prompt + reply,
        loss_mask=[0] * len(prompt) + [1] * len(reply),
        decision_mask=[0] * (len(prompt) + len(reply)),
        logprobs=[0.0] * (len(prompt) + len(reply)),
        prompt_length=len(prompt),
        turns=[],
        termination=termination,
        answer=answer,
        wall_seconds=0.0,
    )


def _group(episodes: list[tuple[Trajectory, float]]) -> Group:
    return Group(
        Task("t", "6 x 7?"),
        [episode for episode, _ in episodes],
        [RewardBreakdown(reward, {}) for _, reward in episodes],
    )


def test_a_group_pairs_its_best_episode_with_its_worst_a_margin_below(tiny_tokenizer):
    def episode(sample, answer, **kwargs):
        return _episode(tiny_tokenizer, sample, answer, **kwargs)

    group = _group(
        [
            (episode(0, "41"), 0.2),
            (episode(1, "42"), 0.9),
            (episode(2, "42"), 0.9),
            (episode(3, "40"), 0.1),
            (episode(4, "x", termination="user_error"), -1.0),
            (episode(5, "y", question="6 x 8?"), -1.0),
        ]
    )
    pair = dpo.group_pair(group, min_margin=0.8, tokenizer=tiny_tokenizer)
    # The first of the best; the worst that is neither another prompt's nor a failed user's.
    assert (pair.chosen_reward, pair.rejected_reward) == (0.9, 0.1)
    assert pair.chosen[0]["content"] == "<answer>42</answer>"
    assert pair.rejected[0]["content"] == "<answer>40</answer>"
    assert pair.prompt == [{"role": "user", "content": "6 x 7?"}]
    best = group.trajectories[1]
    assert pair.tokens.prompt + pair.tokens.chosen.ids == best.token_ids
    assert dpo.group_pair(group, min_margin=0.8 + 1e-6, tokenizer=tiny_tokenizer) is None
    # The same text scored twice differently is no preference between two texts.
    twice = _group([(episode(0, "42"), 1.0), (episode(1, "42"), 0.0)])
    assert dpo.group_pair(twice, min_margin=0.5, tokenizer=tiny_tokenizer) is None


@pytest.fixture(scope="module")
def offline_pairs(tiny_tokenizer, tmp_path_factory) -> list[Pair]:
    """Pairs from rollouts of the offline world with its real tools and reward: the policy is
    scripted (an untrained model answers nothing right, so no group would differ) and takes
    turns, episode by episode, between handing the task to the math expert (often right) and
    running code before a wrong answer."""
    from nemo_orch.envs import build_mixture
    from nemo_orch.rollout.engines.scripted import ScriptedEngine
    from nemo_orch.rollout.format import call_text
    from nemo_orch.train.grpo_rollouts import Rollouts

    config = config_lib.load(
        [
            "tools=offline_basic",
            "rollout.group_size=4",
            "dpo.tasks=16",
            "dpo.min_margin=0.5",
            "rollout.max_turns=3",
            "rollout.max_new_tokens=64",
            f"run.output_dir={tmp_path_factory.mktemp('rollouts')}",
        ]
    )
    config.run.dir.mkdir(parents=True)
    turns = itertools.count()

    def reply(prompt: str) -> str:
        if "<tool_response>" in prompt:
            return "<answer>0</answer>"
        if next(turns) % 2 == 0:
            return call_text(("call_expert", {"model": "math-large"}))
        return call_text(("python_sandbox", {"code": "print(6 * 7)"}))

    mixture = build_mixture(config)
    with Rollouts(
        dpo.rollout_config(config),
        ScriptedEngine(tiny_tokenizer, reply),
        tiny_tokenizer,
        mixture,
        [env.toolbox() for env in mixture.environments],
    ) as rollouts:
        pairs, tasks = dpo.rollout_pairs(rollouts, config.dpo.min_margin, tiny_tokenizer)
    assert tasks == 16
    return pairs


def test_pairs_from_offline_rollouts_keep_the_episodes_tokens(
    offline_pairs, tiny_tokenizer, tmp_path
):
    assert len(offline_pairs) >= 2
    for pair in offline_pairs:
        assert pair.chosen_reward - pair.rejected_reward >= 0.5
        assert pair.tokens.chosen != pair.tokens.rejected
        # The kept tokens are the messages: the prompt's rendering, then each side's turns,
        # the loss on what the policy wrote (its messages and their closing eos) only.
        assert tiny_tokenizer.decode(pair.tokens.prompt, skip_special_tokens=False) == (
            tiny_tokenizer.apply_chat_template(
                pair.prompt, tools=pair.tools, tokenize=False, add_generation_prompt=True
            )
        )
        for side in ("chosen", "rejected"):
            tokens, messages = getattr(pair.tokens, side), getattr(pair, side)
            assert _masked_text(tiny_tokenizer, tokens.ids, tokens.loss_mask) == "".join(
                m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"
            )
    observed = [pair for pair in offline_pairs if any(m["role"] == "tool" for m in pair.rejected)]
    assert observed, "some rejected episode ran code and read its output"
    for pair in observed:
        text = tiny_tokenizer.decode(pair.tokens.rejected.ids, skip_special_tokens=False)
        assert "<tool_response>\n42\n" in text  # in the tokens, outside the loss
    path = tmp_path / "pairs.jsonl"
    write_pairs(path, offline_pairs)
    assert read_pairs(path) == offline_pairs


# ----------------------------------------------------------------------------- nemo-orch dpo


def _run_args(policy: Path, pairs: Path, out: Path, *extra: str, steps: int = 6) -> list[str]:
    return [
        "dpo",
        f"trainer.init_from={policy}",
        f"dpo.pairs_path={pairs}",
        f"run.output_dir={out}",
        "run.name=run",
        f"dpo.max_steps={steps}",
        "dpo.save_interval=3",
        "dpo.optim.lr=5e-4",
        "dpo.optim.min_lr=5e-4",
        "dpo.global_batch_size=4",
        "dpo.micro_batch_size=2",
        "trainer.num_threads=1",
        *extra,
    ]


@pytest.fixture(scope="module")
def pair_file(offline_pairs, offline_conversations, tmp_path_factory) -> Path:
    """The rollouts' pairs (token ids) and pairs of demonstrations (messages only: rendered
    with the template): the demonstration chosen, a guess rejected."""
    guessed = [
        Pair(
            f"demo{i}",
            c["messages"][:2],
            c["messages"][2:],
            [{"role": "assistant", "content": "<answer>7</answer>"}],
            c["tools"],
        )
        for i, c in enumerate(offline_conversations[:4])
    ]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    write_pairs(path, offline_pairs + guessed)
    return path


@pytest.fixture(scope="module")
def straight_run(random_policy_dir, pair_file, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("straight")
    result = run_cli(*_run_args(random_policy_dir, pair_file, out))
    return out / "run" / "dpo", result.stdout


def test_dpo_learns_its_pairs(straight_run, pair_file):
    run_dir, stdout = straight_run
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["pairs"] == 4 for m in metrics)
    # The policy starts as its reference: every margin is 0.
    assert metrics[0]["loss"] == pytest.approx(math.log(2))
    assert metrics[0]["rewards/margins"] == 0 and metrics[0]["rewards/accuracies"] == 0
    assert metrics[-1]["loss"] < metrics[0]["loss"] - 0.1
    assert metrics[-1]["rewards/accuracies"] >= 0.75
    assert metrics[-1]["rewards/margins"] > metrics[1]["rewards/margins"] > 0
    assert all(
        {"rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "grad_norm", "lr"}
        <= m.keys()
        for m in metrics
    )
    for step in (3, 6):
        assert (run_dir / "checkpoints" / f"step_{step}" / "nemo_orch.json").exists()
    assert f"on {len(read_pairs(pair_file))} pairs of {pair_file}" in stdout
    assert "dpo: steps 1-6" in stdout and "reward accuracy 0.000 -> " in stdout


def test_resume_after_kill_reproduces_the_straight_run(
    straight_run, random_policy_dir, pair_file, tmp_path
):
    args = _run_args(random_policy_dir, pair_file, tmp_path)
    killed = run_cli(*args, env={KILL_AT: "step:5"}, expect=None)
    assert killed.returncode == -signal.SIGKILL
    checkpoints = tmp_path / "run" / "dpo" / "checkpoints"
    assert (checkpoints / "step_3").exists() and not (checkpoints / "step_6").exists()
    run_cli(*args)

    def comparable(run_dir: Path) -> list[dict]:
        return [{k: v for k, v in m.items() if k != "tokens_per_s"} for m in read_metrics(run_dir)]

    assert comparable(tmp_path / "run" / "dpo") == comparable(straight_run[0])


@pytest.mark.dist
@pytest.mark.slow
def test_a_pipeline_trains_as_one_process(straight_run, random_policy_dir, pair_file, tmp_path):
    """Two gloo processes as pipeline stages: the reference's sums and the loss on the last
    one only, micro-batches of one length. (Data parallelism splits the pairs with the
    step's own indices; its gradients are Policy.train_step's, checked by the GRPO and SFT
    parity tests, so one launch, the slower one, is spent here.)"""
    run_cli(*_run_args(random_policy_dir, pair_file, tmp_path, "parallel.pp=2", steps=2))
    keys = (
        "loss",
        "rewards/margins",
        "rewards/accuracies",
        "logps/chosen",
        "logps/rejected",
        "grad_norm",
        "pairs",
    )
    for parallel, single in zip(
        read_metrics(tmp_path / "run" / "dpo"), read_metrics(straight_run[0])[:2], strict=True
    ):
        assert {key: parallel[key] for key in keys} == pytest.approx(
            {key: single[key] for key in keys}, rel=1e-4, abs=1e-6
        )


def test_a_bad_pair_file_exits_2_naming_its_line(random_policy_dir, tmp_path):
    path = tmp_path / "pairs.jsonl"
    path.write_text(
        json.dumps(
            {
                "id": "p",
                "prompt": [{"role": "user", "content": "q"}],
                "chosen": [{"role": "assistant", "content": "a"}],
            }
        )
        + "\n"
    )
    error = run_cli_here(*_run_args(random_policy_dir, path, tmp_path), expect=2)
    assert f"{path}:1: missing 'rejected'" in error.stderr and "Traceback" not in error.stderr


def test_dpo_needs_a_starting_point():
    error = run_cli_here("dpo", expect=2)
    assert "nemo-orch dpo needs trainer.init_from" in error.stderr


def test_rollouts_without_a_margin_make_no_pairs_and_exit_2(random_policy_dir, tmp_path):
    """An untrained policy answers nothing right: every episode of the offline world scores 0,
    so no task gives a pair, and the run says what to change (nothing is written to resume)."""
    error = run_cli(
        "dpo",
        f"trainer.init_from={random_policy_dir}",
        f"run.output_dir={tmp_path}",
        "run.name=run",
        "tools=offline_basic",
        "dpo.tasks=2",
        "rollout.group_size=2",
        "rollout.max_turns=1",
        "rollout.max_new_tokens=8",
        "trainer.num_threads=1",
        expect=2,
    )
    assert (
        "none of the 2 env=offline tasks' 2 episodes had rewards dpo.min_margin=0.1 apart"
        in error.stderr
    )
    assert not (tmp_path / "run" / "dpo" / "pairs.jsonl").exists()
