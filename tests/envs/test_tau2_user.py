"""tau2 under its own protocol: an LLM user (here the SIMULATED one of
``tests/support/simulated_tau2_user.py``, over real HTTP on 127.0.0.1) talks with the agent turn by turn,
acts on its own phone in telecom, ends the conversation, and tau2's evaluator scores the
transcript; a failing or hanging user endpoint ends the episode with a counted ``user_error``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import threading
import time

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
pytest.importorskip("tau2")

from support.simulated_openai import SimulatedOpenAI  # noqa: E402
from support.simulated_tau2_user import MODEL, simulated_user_server  # noqa: E402

from nemo_orch import config as config_lib  # noqa: E402
from nemo_orch.clients.openai import EndpointRefusal  # noqa: E402
from nemo_orch.config import RolloutConfig  # noqa: E402
from nemo_orch.envs import build_environment  # noqa: E402
from nemo_orch.envs.interfaces import final_message  # noqa: E402
from nemo_orch.envs.tau2 import adapter  # noqa: E402
from nemo_orch.envs.tau2.environment import SCENARIO_PROTOCOL  # noqa: E402
from nemo_orch.rollout import journal  # noqa: E402
from nemo_orch.rollout.engines.scripted import ScriptedEngine  # noqa: E402
from nemo_orch.rollout.format import call_text  # noqa: E402
from nemo_orch.rollout.runner import run_rollouts  # noqa: E402
from nemo_orch.serve.http_server import RequestError, serve_json  # noqa: E402

pytestmark = pytest.mark.tau2

TELECOM_TASK = "[mobile_data_issue]airplane_mode_on|user_abroad_roaming_enabled_off[PERSONA:None]"
SETTINGS = RolloutConfig(
    max_context_tokens=1 << 15, max_turns=12, max_new_tokens=512, check_template=False
)


@pytest.fixture(scope="module")
def user_url(tiny_tokenizer):
    with simulated_user_server(tiny_tokenizer) as url:
        yield url


def _environment(domain, url, *overrides):
    user = [] if url is None else [f"env.user.base_url={url}", f"env.user.model={MODEL}"]
    return build_environment(
        config_lib.load(["env=tau2", f"env.domain={domain}", "env.split=train", *user, *overrides])
    )


def _task(environment, tau2_id):
    return next(
        task for task in environment.domain.tasks if task.metadata["tau2_task"]["id"] == tau2_id
    )


def _own_turns(prompt: str) -> int:
    """How many messages the agent has written (the greeting and the generation prompt are
    not its own)."""
    return prompt.count("<|im_start|>assistant") - 2


async def _episode(environment, task, agent, tokenizer):
    """One episode of the scripted ``agent`` with the environment's user, and tau2's score."""
    (trajectory,) = await run_rollouts(
        [task],
        1,
        ScriptedEngine(tokenizer, agent),
        environment.toolbox(),
        tokenizer,
        SETTINGS,
        users=environment.users(),
    )
    return trajectory, await environment.score(task, trajectory)


def _play(environment, task, agent, tokenizer):
    """:func:`_episode`, run to its end."""
    return asyncio.run(_episode(environment, task, agent, tokenizer))


def _retail_agent(task):
    """Asks who the user is, makes the task's gold calls, then closes with every fact."""
    criteria = adapter.tau2_task_of(task).evaluation_criteria
    calls = [(action.name, action.arguments) for action in criteria.actions]

    def agent(prompt):
        turn = _own_turns(prompt)
        if turn == 0:
            return "I can help with that. What is your name and zip code?"
        if turn <= len(calls):
            return call_text(calls[turn - 1])
        return f"<answer>{final_message(criteria.communicate_info or [])}</answer>"

    return agent, len(calls)


def test_a_telecom_user_acts_on_its_phone_when_the_agent_asks(user_url, tiny_tokenizer):
    """The fix needs the user's hands: the agent can only ask, the user's own tool calls
    change its phone, and tau2's assertions on the phone pass."""
    environment = _environment(
        "telecom", user_url, "env.user.input_usd_per_million=1", "env.user.output_usd_per_million=2"
    )
    task = _task(environment, TELECOM_TASK)

    def agent(prompt):
        if _own_turns(prompt) == 0:
            return (
                "Please turn airplane mode off with `toggle_airplane_mode {}` and data "
                "roaming on with `toggle_roaming {}`."
            )
        return f"<answer>{final_message([])}</answer>"

    trajectory, scored = _play(environment, task, agent, tiny_tokenizer)
    assert trajectory.termination == "user_stop" and scored.outcome.correct
    assert scored.details["tau2"]["breakdown"]["env_assertions"] == [
        {"assertion": "user.assert_mobile_data_status(expected_status=True)", "met": True},
        {
            "assertion": "user.assert_internet_speed(expected_speed=200, "
            "expected_desc='excellent')",
            "met": True,
        },
    ]
    # The scenario is not stated up front: the user opens with its reason for calling.
    first_prompt = [m["content"] for m in trajectory.messages[:3]]
    assert first_prompt[1] == "Hi! How can I help you today?"
    assert first_prompt[2].startswith("You mobile data is not working properly")
    assert "Known info" not in " ".join(first_prompt)
    # The user's reply after its two phone actions is the agent's next observation, with
    # loss mask 0.
    reply = trajectory.messages[4]
    assert reply["role"] == "user" and reply["content"].startswith("Done. My phone says:")
    reply_ids = tiny_tokenizer.encode(reply["content"], add_special_tokens=False)
    start = next(
        i
        for i in range(len(trajectory.token_ids))
        if trajectory.token_ids[i : i + len(reply_ids)] == reply_ids
    )
    assert set(trajectory.loss_mask[start : start + len(reply_ids)]) == {0}
    # The user's tokens are priced in its own ledger, apart from the episode's cost.
    user = trajectory.user
    assert user.messages == 3 and user.input_tokens > 0
    assert user.cost_usd == pytest.approx((user.input_tokens + 2 * user.output_tokens) / 1e6)
    assert trajectory.cost_usd == sum(turn.orchestrator_cost_usd for turn in trajectory.turns)

    # Without the user's phone actions, the same closing fails tau2's assertions.
    def closes_at_once(prompt):
        return f"<answer>{final_message([])}</answer>"

    _, scored = _play(environment, task, closes_at_once, tiny_tokenizer)
    assert not scored.outcome.correct


def test_a_retail_agent_asks_the_user_and_acts_on_the_answer(user_url, tiny_tokenizer):
    """The agent asks who the user is; the user answers from its scenario; the agent's gold
    calls and closing message pass tau2's database and communicate checks."""
    environment = _environment("retail", user_url)
    task = _task(environment, "0")
    agent, _ = _retail_agent(task)
    trajectory, scored = _play(environment, task, agent, tiny_tokenizer)
    assert trajectory.termination == "user_stop", trajectory.messages[-2:]
    assert scored.outcome.correct, scored.details
    answer = trajectory.messages[4]["content"]
    assert "Yusuf Rossi in zip code 19122" in answer and trajectory.messages[4]["role"] == "user"


def test_a_conversation_cut_midway_continues_from_its_journal(user_url, tiny_tokenizer, tmp_path):
    """The retail conversation cut (its run cancelled) while the agent writes its third turn,
    after the user has answered and a gold call has run, then run again with the same journal:
    the agent's and the user's completed turns come back from it, the rest is made once, the
    domain's database is restored by its calls running again, and the transcript and tau2's
    score are those of a conversation never cut."""
    environment = _environment("retail", user_url)
    task = _task(environment, "0")
    agent, _ = _retail_agent(task)

    def conversation(script):
        return _episode(environment, task, script, tiny_tokenizer)

    def journaled(name: str, script):
        with journal.journaling(tmp_path / name, 64, "retail") as kept:
            return asyncio.run(conversation(script)), kept.counts()

    (whole, scored), made = journaled("whole.db", agent)
    assert whole.termination == "user_stop" and scored.outcome.correct

    reached, release = threading.Event(), threading.Event()

    def cut_at_third_turn(prompt):
        if _own_turns(prompt) == 2:
            reached.set()
            release.wait(30)
        return agent(prompt)

    async def cut():
        running = asyncio.ensure_future(conversation(cut_at_third_turn))
        assert await asyncio.to_thread(reached.wait, 30)
        running.cancel()
        release.set()
        with contextlib.suppress(asyncio.CancelledError):
            await running

    with journal.journaling(tmp_path / "cut.db", 64, "retail") as kept:
        asyncio.run(cut())
    before = kept.counts()["recorded"]  # completed (the third turn was cut, not kept)
    assert before >= 4  # the agent's two turns, the user's opening and answer
    (again, rescored), resumed = journaled("cut.db", agent)
    assert resumed["replayed"] == before
    assert before + resumed["missed"] == made["missed"]
    assert again.messages == whole.messages and again.token_ids == whole.token_ids
    assert rescored.outcome == scored.outcome and rescored.outcome.correct


def test_tau2s_step_limit_ends_a_conversation(user_url, tiny_tokenizer):
    """Every agent message, user message and batch of tool results is one of tau2's steps."""
    environment = _environment("retail", user_url, "env.user.max_steps=4")
    task = _task(environment, "0")
    trajectory, scored = _play(
        environment, task, lambda prompt: "Could you say that again?", tiny_tokenizer
    )
    # The user's opening (1), then agent (2), user (3), agent (4): the limit.
    assert trajectory.termination == "max_steps" and len(trajectory.turns) == 2
    assert not scored.outcome.correct


def _failing_user(handler):
    return serve_json({("POST", "/v1/chat/completions"): handler}, url_path="/v1")


def test_a_failing_or_hanging_user_endpoint_is_a_counted_user_error(tiny_tokenizer):
    def broken(body):
        raise RequestError("the user model crashed", status=500)

    def hanging(body):
        time.sleep(3)
        return {}

    for handler in (broken, hanging):
        with _failing_user(handler) as server:
            environment = _environment(
                "retail", server.url, "env.user.timeout_s=0.5", "env.user.max_retries=1"
            )
            started = time.perf_counter()
            trajectory, scored = _play(
                environment, _task(environment, "0"), lambda prompt: "Hello?", tiny_tokenizer
            )
            assert time.perf_counter() - started < 10
        assert trajectory.termination == "user_error" and not trajectory.turns
        assert not scored.outcome.correct


def test_a_user_endpoint_that_refuses_its_dialect_stops_the_run(tiny_tokenizer):
    """gpt-5 as the user (the reference's) refuses tau2's temperature 0: asked in vllm's dialect
    the run stops naming it; in the reasoning dialect it is asked without one."""
    with SimulatedOpenAI("gpt-5", reasoning=True, key=None, reply=lambda body: "Hi.") as gpt5:
        environment = _environment("retail", gpt5.url, "env.user.max_retries=0")
        with pytest.raises(EndpointRefusal, match="^env.user: .*'temperature'"):
            _play(environment, _task(environment, "0"), lambda prompt: "Hello?", tiny_tokenizer)
        environment = _environment(
            "retail", gpt5.url, "env.user.dialect=openai-reasoning", "env.user.max_steps=3"
        )
        trajectory, _ = _play(
            environment, _task(environment, "0"), lambda prompt: "Hello?", tiny_tokenizer
        )
    assert trajectory.termination != "user_error"
    assert "temperature" not in gpt5.requests[-1]["body"]


def test_without_a_user_the_report_says_it_is_not_tau2_bench():
    environment = _environment("mock", None)
    assert environment.users() is None
    assert environment.notes["protocol"] == SCENARIO_PROTOCOL
    assert re.search("not comparable with tau2-bench", SCENARIO_PROTOCOL)


@pytest.mark.parametrize("concurrency", [1, 16])
def test_each_trial_is_an_episode_of_its_own(concurrency, user_url, tiny_tokenizer, tmp_path):
    """Three trials of a task that writes to its database, run at once or one by one: each on
    its own environment, so every trial passes alike (pass^k does not depend on concurrency)."""
    from nemo_orch.config import ORCHESTRATOR
    from nemo_orch.eval.harness import evaluate
    from nemo_orch.eval.systems import System

    config = config_lib.load(
        [
            "env=tau2",
            "env.domain=retail",
            "env.split=train",
            f"env.user.base_url={user_url}",
            f"env.user.model={MODEL}",
            "model.max_position_embeddings=32768",
            "rollout.check_template=false",
            "eval.num_trials=3",
            f"eval.concurrency={concurrency}",
        ]
    )
    environment = build_environment(config)
    task = _task(environment, "0")
    environment.domain.tasks = [task]
    agent, _ = _retail_agent(task)
    system = System(ORCHESTRATOR, ORCHESTRATOR, ScriptedEngine(tiny_tokenizer, agent))
    evaluation = evaluate(config, environment, [system], tmp_path, tiny_tokenizer)
    records = evaluation.records[ORCHESTRATOR]
    assert [
        (r["trial"], r["episode"]["termination"], r["outcome"]["correct"]) for r in records
    ] == [(trial, "user_stop", True) for trial in range(3)]
    assert len(environment.domain.environments) == 0  # every trial's environment released


def _closing_steps(calls: int) -> int:
    """tau2's steps up to the user's reply to the closing message: the user's opening, the
    agent's question and the user's answer, two per call, the closing and the reply."""
    return 3 + 2 * calls + 2


@pytest.mark.parametrize(
    "extra_steps, termination, correct",
    [
        (
            0,
            "max_steps",
            False,
        ),  # the user stops on the step that reaches the limit: the limit wins
        (1, "user_stop", True),
    ],
)
def test_a_limit_reached_on_the_users_stop_ends_the_episode_as_tau2s(
    extra_steps, termination, correct, user_url, tiny_tokenizer
):
    environment = _environment("retail", None)
    task = _task(environment, "0")
    agent, calls = _retail_agent(task)
    environment = _environment(
        "retail", user_url, f"env.user.max_steps={_closing_steps(calls) + extra_steps}"
    )
    trajectory, scored = _play(environment, _task(environment, "0"), agent, tiny_tokenizer)
    assert (trajectory.termination, scored.outcome.correct) == (termination, correct)


def test_the_agents_stop_token_and_text_beside_calls_reach_the_transcript(user_url, tiny_tokenizer):
    """As tau2's LLMAgent: a message with ``###STOP###`` goes to the user like any other, and
    text written beside a call is the message's content, which tau2's communicate check
    reads."""
    environment = _environment("retail", user_url)
    task = _task(environment, "24")  # no action; the user must be told two materials
    facts = adapter.tau2_task_of(task).evaluation_criteria.communicate_info
    assert facts == ["polyester", "cotton"]

    def beside_a_call(prompt):
        if _own_turns(prompt) == 0:
            return "The materials are polyester and cotton. " + call_text(
                ("calculate", {"expression": "1 + 1"})
            )
        return f"<answer>{final_message([])} ###STOP###</answer>"

    trajectory, scored = _play(environment, task, beside_a_call, tiny_tokenizer)
    assert trajectory.termination == "user_stop" and scored.outcome.correct, scored.details
    # The message with the stop token went to the user, who ended the conversation.
    assert trajectory.messages[-1]["content"].endswith("###STOP###</answer>")

    def silent_call(prompt):
        if _own_turns(prompt) == 0:
            return call_text(("calculate", {"expression": "1 + 1"}))
        return f"<answer>{final_message([])}</answer>"

    _, scored = _play(environment, task, silent_call, tiny_tokenizer)
    assert not scored.outcome.correct
    assert "not told to the user: 'polyester'" in scored.outcome.detail


def test_under_tau2s_protocol_the_agent_has_tau2s_system_prompt_and_no_turn_limit(
    user_url, tiny_tokenizer
):
    from tau2.agent.llm_agent import AGENT_INSTRUCTION, SYSTEM_PROMPT

    environment = _environment("retail", user_url, "env.user.max_steps=30")
    task = _task(environment, "0")
    policy = _environment("retail", None).domain.policy
    assert task.system == SYSTEM_PROMPT.format(
        agent_instruction=AGENT_INSTRUCTION, domain_policy=policy
    )
    settings = dataclasses.replace(SETTINGS, max_turns=2, max_new_tokens=4)

    async def run():
        (trajectory,) = await run_rollouts(
            [task],
            1,
            ScriptedEngine(tiny_tokenizer, agent),
            environment.toolbox(),
            tiny_tokenizer,
            settings,
            users=environment.users(),
        )
        return trajectory

    agent, calls = _retail_agent(task)
    trajectory = asyncio.run(run())
    # rollout.max_turns and max_new_tokens are not tau2's: the scripted agent's long calls
    # and all its turns ran.
    assert trajectory.termination == "user_stop" and len(trajectory.turns) == calls + 2


def test_user_errors_are_reported_per_trial_and_run_again_on_resume(
    user_url, tiny_tokenizer, tmp_path
):
    """A user endpoint down for the first run: its episodes end ``user_error``, which the report
    counts and names; the same evaluation resumed with the endpoint back runs them again."""
    import httpx

    from nemo_orch.config import ORCHESTRATOR
    from nemo_orch.eval.harness import evaluate
    from nemo_orch.eval.report import summarize
    from nemo_orch.eval.systems import System

    down = True

    def flaky(body):
        if down:
            raise RequestError("the user model is down", status=503)
        return httpx.post(f"{user_url}/chat/completions", json=body, timeout=30).json()

    with _failing_user(flaky) as server:
        config = config_lib.load(
            [
                "env=tau2",
                "env.domain=retail",
                "env.split=train",
                f"env.user.base_url={server.url}",
                f"env.user.model={MODEL}",
                "env.user.max_retries=0",
                "model.max_position_embeddings=32768",
                "rollout.check_template=false",
                "eval.num_trials=2",
            ]
        )
        environment = build_environment(config)
        environment.domain.tasks = [_task(environment, "0")]
        agent, _ = _retail_agent(environment.domain.tasks[0])
        system = System(ORCHESTRATOR, ORCHESTRATOR, ScriptedEngine(tiny_tokenizer, agent))
        failed = evaluate(config, environment, [system], tmp_path, tiny_tokenizer)
        summary = summarize(failed.results(ORCHESTRATOR))
        assert summary["user_errors"] == 2 and summary["correct"] == 0
        assert summary["user_error_episodes"] == ["tau2-retail-0@0", "tau2-retail-0@1"]
        down = False
        resumed = evaluate(config, environment, [system], tmp_path, tiny_tokenizer)
    summary = summarize(resumed.results(ORCHESTRATOR))
    assert (summary["user_errors"], summary["correct"]) == (0, 2)
