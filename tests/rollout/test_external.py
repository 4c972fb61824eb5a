"""The training endpoint (``rollout.agent=external``): an agent loop of the user's own, written
with the ``openai`` SDK (``examples/agent_loops/openai_loop.py``, run as it is), drives the
episodes; what is trained is what the policy sampled.

The policy is scripted (each episode follows one of two routers of its task, picked by its
turns' seeds), so both paths make the same decisions: the built-in loop and the external loop
must give the same tokens, masks, ledger, rewards and advantages. Then a policy whose tokens are
not what its text tokenizes to, a loop that rewrites its history, one that raises, one that
abandons its episode, and loops in a process of their own taking episodes over HTTP."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from nemo_orch import config as config_lib
from nemo_orch.config import ExternalAgentConfig
from nemo_orch.envs import build_environment
from nemo_orch.envs.offline.world import make_tasks
from nemo_orch.reward.advantages import group_advantages
from nemo_orch.reward.scoring import score_groups
from nemo_orch.rollout.agent_episode import EndpointStopped, next_episode
from nemo_orch.rollout.engines.base import Generation, SamplingParams
from nemo_orch.rollout.engines.scripted import RouterReplies, ScriptedEngine
from nemo_orch.rollout.external import ExternalAgents, load_harness
from nemo_orch.rollout.runner import run_rollouts
from nemo_orch.rollout.trajectory import Termination, Trajectory

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "agent_loops"
OPENAI_LOOP = f"{EXAMPLES / 'openai_loop.py'}:run_episode"
GROUP = 4


class TwoRouters(ScriptedEngine):
    """Each turn follows one of two routers of the task, by its seed's parity; with
    ``by_character``, its text's tokens are written one character at a time (ids its text does
    not tokenize back to)."""

    def __init__(
        self, tokenizer: Any, routers: Sequence[RouterReplies], by_character: bool = False
    ):
        super().__init__(tokenizer, lambda prompt: prompt)
        self.routers, self.by_character = routers, by_character

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        generations = []
        for prompt, seed in zip(prompts, seeds):
            text = self.routers[seed % 2](self.tokenizer.decode(prompt, skip_special_tokens=False))
            pieces = text if self.by_character else [text]
            ids = [
                t
                for piece in pieces
                for t in self.tokenizer.encode(piece, add_special_tokens=False)
            ]
            ids.append(self.eos_id)
            logprobs = [-0.5] * len(ids)
            generations.append(Generation(ids, logprobs, "stop", text, prompt_tokens=len(prompt)))
        return generations


@pytest.fixture(scope="module")
def world():
    config = config_lib.load(
        [
            "tools=offline_basic",
            "rollout.max_new_tokens=200",
            # The answer alone: the sandbox's seconds are the machine's, in either path.
            "reward.combination=linear",
            "reward.linear_gamma=0",
        ]
    )
    environment = build_environment(config)
    task = next(t for t in make_tasks(40, seed=3) if len(t.metadata["route"]) >= 1)
    return config, environment, task


def _routers(task) -> list[RouterReplies]:
    route = tuple(task.metadata["route"])
    return [RouterReplies(route, task.answer), RouterReplies(route[:0], task.answer)]


def _run(
    config, environment, task, engine, agents: ExternalAgents | None, on_start=None
) -> list[Trajectory]:
    """The task's group, by the built-in loop or ``agents`` (``on_start``: called with their
    endpoint's URL once it serves)."""

    async def run() -> list[Trajectory]:
        toolbox = environment.toolbox()
        await toolbox.start()
        if agents is not None:
            url = await agents.start()
            if on_start is not None:
                on_start(url)
        try:
            return await run_rollouts(
                [task],
                GROUP,
                engine,
                toolbox,
                engine.tokenizer,
                config.resolved_rollout(),
                seed=11,
                agent=agents,
            )
        finally:
            if agents is not None:
                await agents.close()
            await toolbox.close()

    return asyncio.run(run())


def _external(harness: str | None = OPENAI_LOOP, **options: Any) -> ExternalAgents:
    return ExternalAgents(ExternalAgentConfig(harness=harness, **options), "policy")


async def _score(environment, config, task, trajectories):
    """The group scored as GRPO scores it: by the environment, or the loop's own verdict."""

    async def outcome(task, trajectory):
        return (await environment.score(task, trajectory)).outcome

    return await score_groups([task], [trajectories], config.reward, outcome)


def _advantages(config, environment, task, trajectories) -> tuple[list[float], list[float]]:
    (scored,) = asyncio.run(_score(environment, config, task, trajectories))
    rewards = [breakdown.reward for breakdown in scored.breakdowns]
    return rewards, list(group_advantages(rewards, config.reward))


def test_an_openai_sdk_loop_trains_the_tokens_masks_and_advantages_of_the_built_in_loop(
    world, tiny_tokenizer
):
    config, environment, task = world
    engine = TwoRouters(tiny_tokenizer, _routers(task))
    built_in = _run(config, environment, task, engine, None)
    external = _run(config, environment, task, engine, _external())
    assert {t.termination for t in built_in} == {Termination.ANSWER}
    # The two routers each played: the group's rewards differ.
    assert len({len(t.turns) for t in built_in}) == 2
    for ours, theirs in zip(built_in, external):
        assert theirs.token_ids == ours.token_ids
        assert theirs.loss_mask == ours.loss_mask
        assert theirs.logprobs == ours.logprobs
        assert theirs.decision_mask == ours.decision_mask
        assert theirs.messages == ours.messages
        assert (theirs.termination, theirs.answer, theirs.branches) == (
            ours.termination,
            ours.answer,
            0,
        )
        assert theirs.cost_usd == pytest.approx(ours.cost_usd)
        assert theirs.calls() == ours.calls()
    rewards, advantages = _advantages(config, environment, task, built_in)
    assert len(set(rewards)) == 2 and any(advantages)
    assert _advantages(config, environment, task, external) == (rewards, advantages)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_trained_tokens_are_the_sampled_ones_not_the_loops_text_tokenized_again(
    world, tiny_tokenizer
):
    config, environment, task = world
    engine = TwoRouters(tiny_tokenizer, _routers(task), by_character=True)
    for trajectory in _run(config, environment, task, engine, _external()):
        assert trajectory.branches == 0 and trajectory.termination == Termination.ANSWER
        trained = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m]
        replies = [m["content"] for m in trajectory.messages if m["role"] == "assistant"]
        spelled = [
            t
            for text in replies
            for t in [*(i for c in text for i in _encode(tiny_tokenizer, c)), engine.eos_id]
        ]
        retokenized = [
            t for text in replies for t in [*_encode(tiny_tokenizer, text), engine.eos_id]
        ]
        # The loop sent the replies back as text (its tool calls as JSON objects), which
        # tokenizes otherwise; the policy sampled them character by character: that is trained.
        assert retokenized != spelled
        assert trained == spelled


def test_a_loop_that_rewrites_its_history_starts_a_counted_branch(world, tiny_tokenizer):
    config, environment, task = world
    engine = TwoRouters(tiny_tokenizer, [_routers(task)[0]] * 2)
    trajectories = _run(
        config, environment, task, engine, _external("support.agent_loops:rewriting_loop")
    )
    for trajectory in trajectories:
        assert trajectory.branches == 1 and trajectory.termination == Termination.ANSWER
        assert len(trajectory.turns) == 2 and trajectory.turns[0].calls[0].cost_usd > 0
        # Only the turn after the branch is trained; the first is context, as the loop wrote it.
        trained = tiny_tokenizer.decode(
            [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m]
        )
        assert trained.startswith("<answer>") and "<tool_call>" not in trained
        assert "I ran python_sandbox." in tiny_tokenizer.decode(trajectory.token_ids)
        assert trajectory.agent_correct is True  # the loop's own verdict (its stream, read)
    (scored,) = asyncio.run(_score(environment, config, task, trajectories))
    assert all(
        b.components["outcome_method:agent"] == 1.0 and b.components["outcome"] == 1.0
        for b in scored.breakdowns
    )


def test_a_loop_that_fails_or_abandons_its_episode_is_masked_as_an_infrastructure_failure(
    world, tiny_tokenizer
):
    config, environment, task = world
    engine = TwoRouters(tiny_tokenizer, _routers(task))
    raised = _run(config, environment, task, engine, _external("support.agent_loops:raising_loop"))
    # No loop takes the episodes from the queue.
    abandoned = _run(config, environment, task, engine, _external(None, episode_timeout_s=0.5))
    for trajectories, why in ((raised, "raised ConnectionError"), (abandoned, "abandoned")):
        for trajectory in trajectories:
            assert trajectory.termination == Termination.AGENT_ERROR
            assert why in trajectory.agent_error
            assert trajectory.infra_failure().reason == "agent_error"

    (scored,) = asyncio.run(_score(environment, config, task, raised))
    assert scored.trajectories == [] and len(scored.masked) == GROUP


def test_loops_in_processes_of_their_own_take_episodes_over_http(world, tiny_tokenizer):
    """The endpoint hands its episodes to whoever asks over HTTP (here two threads, each doing
    what a separate process would); the trajectories are the built-in loop's."""
    config, environment, task = world
    engine = TwoRouters(tiny_tokenizer, _routers(task))
    run_episode = load_harness(OPENAI_LOOP)
    agents = _external(None)
    done: list[str] = []

    def worker(url: str) -> None:
        while True:
            try:
                episode = next_episode(url, wait_s=1)
            except EndpointStopped:  # the rollouts have ended
                return
            if episode is not None:
                run_episode(episode)
                done.append(episode.id)

    workers: list[threading.Thread] = []

    def start_workers(url: str) -> None:
        workers.extend(threading.Thread(target=worker, args=(url,)) for _ in range(2))
        for thread in workers:
            thread.start()

    external = _run(config, environment, task, engine, agents, on_start=start_workers)
    for thread in workers:
        thread.join()
    built_in = _run(config, environment, task, engine, None)
    assert len(done) == GROUP
    assert [t.token_ids for t in external] == [t.token_ids for t in built_in]
    assert [t.loss_mask for t in external] == [t.loss_mask for t in built_in]
