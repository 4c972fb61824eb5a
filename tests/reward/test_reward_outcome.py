"""Answer matching, the judge protocol against the project's own server, and database outcomes."""

import asyncio
import re
import socket

import pytest

from nemo_orch.clients.openai import OpenAIClient
from nemo_orch.config import RewardConfig
from nemo_orch.data.domain_tasks import gold_calls, to_task_row
from nemo_orch.data.tasks import Task
from nemo_orch.envs.toolscale.domain_records import generate_domain
from nemo_orch.envs.toolscale.generator import generate_tasks
from nemo_orch.reward.judge import parse_verdict
from nemo_orch.reward.outcome import (
    OutcomeScorer,
    exact_match,
    normalize_answer,
    numeric_match,
    parse_number,
)
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.openai_server import start_server

CAPITAL = Task(id="capital", question="What is the capital of France?", answer="Paris")


@pytest.mark.parametrize(
    "text, normalized",
    [
        ("Answer: The Eiffel Tower.", "eiffel tower"),
        ("  An   apple,  a day! ", "apple day"),
        ("U.S.", "us"),
        ("-3.5", "-3.5"),
        ("1,234", "1234"),
        ("3/4 cup", "3/4 cup"),
    ],
)
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


def test_exact_match_keeps_numbers_apart():
    assert exact_match("answer: the PARIS", "Paris")
    assert not exact_match("3.5", "35") and not exact_match("-3", "3")
    assert not exact_match("...", "")


@pytest.mark.parametrize(
    "prediction, reference, matches",
    [
        ("The total is 1,234.", "1234", True),
        ("42.0", "42", True),
        ("-3.5", "-3.5", True),
        ("3.5", "-3.5", False),
        ("0.75", "3/4", True),
        ("3/4", "0.75", True),
        ("first 7, then 12", "12", True),
        ("first 12, then 7", "12", False),
        ("5-3", "3", True),
        ("$12", "$12.00", True),
        ("1e-3", "0.001", True),
        ("2", "World War 2", False),  # the reference is not a number
        ("12", "1,2", False),  # nor is a list
        ("no number", "12", False),
    ],
)
def test_numeric_match(prediction, reference, matches):
    assert numeric_match(prediction, reference, rel_tol=1e-6, abs_tol=1e-9) is matches


def test_numeric_tolerances():
    assert numeric_match("3.1416", "3.14159", rel_tol=1e-4, abs_tol=0)
    assert not numeric_match("3.1416", "3.14159", rel_tol=1e-6, abs_tol=0)
    assert numeric_match("0.0000001", "0", rel_tol=0, abs_tol=1e-6)
    assert parse_number("1/0") is None and parse_number("nan") is None


@pytest.mark.parametrize(
    "reply, verdict",
    [
        ("Correct", True),
        ("incorrect.", False),
        ("Yes, it matches.", True),
        ("No.", False),
        ("The prediction is not correct.", False),
        ("It is wrong", False),
        ("<think>Is it correct? No wait.</think>\nYes", True),
        ("I cannot tell.", None),
    ],
)
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply) is verdict


def score(scorer, task, answer, calls=()):
    return asyncio.run(scorer.score(task, answer, calls))


def test_protocol_without_judge():
    scorer = OutcomeScorer(RewardConfig(max_answer_words=5))
    number = Task(id="n", question="2 + 2?", answer="4")
    assert (score(scorer, CAPITAL, None).method, score(scorer, CAPITAL, " . ").method) == (
        "empty",
        "empty",
    )
    long = score(scorer, CAPITAL, "Paris is the capital city of France")
    assert (long.correct, long.method) == (False, "too_long")
    assert (
        score(scorer, CAPITAL, "Answer: paris.").correct,
        score(scorer, CAPITAL, "Answer: paris.").method,
    ) == (True, "exact")
    assert score(scorer, number, "It is 4.0").method == "numeric"
    assert score(scorer, CAPITAL, "The city of Paris").method == "no_match"
    assert not score(scorer, Task(id="x", question="?"), "Paris").correct


def judge_reply(calls):
    """A judge that accepts any prediction mentioning Paris, and counts its calls."""

    def reply(prompt: str) -> str:
        calls.append(prompt)
        prediction = re.search(r"Prediction:\n(.*?)\n", prompt, re.DOTALL)[1]
        return "Correct" if "paris" in prediction.lower() else "Incorrect, that is another city."

    return reply


@pytest.fixture(scope="module")
def judge(tiny_tokenizer):
    calls: list[str] = []
    with start_server(
        ScriptedEngine(tiny_tokenizer, judge_reply(calls)), tiny_tokenizer, "judge"
    ) as server:
        yield server, calls


def test_judge_decides_and_caches(judge):
    server, calls = judge
    calls.clear()
    scorer = OutcomeScorer(RewardConfig(judge_base_url=server.url, judge_model="judge"))
    right = score(scorer, CAPITAL, "The city of Paris")
    wrong = score(scorer, CAPITAL, "Lyon")
    assert (right.correct, right.method) == (True, "judge")
    assert (wrong.correct, wrong.method) == (False, "judge")
    assert "capital of France" in calls[0] and "Reference answer:\nParis" in calls[0]
    assert score(scorer, CAPITAL, "the city of PARIS!") == right  # same normalized answer
    assert score(scorer, CAPITAL, "Paris").method == "exact"  # never reaches the judge
    assert len(calls) == 2


def test_concurrent_identical_answers_share_one_judge_call(judge):
    server, calls = judge
    calls.clear()
    scorer = OutcomeScorer(RewardConfig(judge_base_url=server.url, judge_model="judge"))

    async def group():
        return await asyncio.gather(*(scorer.score(CAPITAL, "Lyon") for _ in range(4)))

    assert all(r.method == "judge" and not r.correct for r in asyncio.run(group()))
    assert len(calls) == 1


def test_unreadable_verdict_is_a_judge_error(tiny_tokenizer):
    with start_server(
        ScriptedEngine(tiny_tokenizer, lambda _: "Hmm, hard to say."), tiny_tokenizer, "judge"
    ) as server:
        scorer = OutcomeScorer(RewardConfig(judge_base_url=server.url, judge_model="judge"))
        result = score(scorer, CAPITAL, "Lyon")
    assert (result.correct, result.method) == (False, "judge_error")
    assert "no verdict" in result.detail


def test_judge_down_is_a_judge_error_not_an_exception():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    client = OpenAIClient(url, "judge", timeout_s=2, max_retries=0)
    scorer = OutcomeScorer(RewardConfig(judge_base_url=url, judge_model="judge"), client=client)
    result = score(scorer, CAPITAL, "The city of Paris")
    assert (result.correct, result.method) == (False, "judge_error")
    assert "ConnectError" in result.detail or "connect" in result.detail.lower()


def test_a_judge_that_spends_its_cap_thinking_is_a_judge_error_masked_out_of_its_group():
    """A reasoning judge whose cap went to thinking (``finish_reason: length``, no content, as
    OpenAI answers it): a judge failure saying so, never a verdict; GRPO masks its episode."""
    from reward_fixtures import trajectory
    from support.local_http import JSONServer

    from nemo_orch.reward import by_answer, score_groups

    def answer(path, headers, body):
        return (
            200,
            {
                "model": "o3-mini",
                "choices": [{"index": 0, "finish_reason": "length", "message": {"content": ""}}],
                "usage": {
                    "prompt_tokens": 80,
                    "completion_tokens": 256,
                    "completion_tokens_details": {"reasoning_tokens": 256},
                },
            },
            {},
        )

    with JSONServer(answer, url_path="/v1") as judge:
        config = RewardConfig(judge_base_url=judge.url, judge_model="o3-mini")
        scorer = OutcomeScorer(config)
        result = score(scorer, CAPITAL, "The city of Lyon")
        judged, exact = trajectory("The city of Lyon"), trajectory("Paris")
        (group,) = asyncio.run(
            score_groups([CAPITAL], [[judged, exact]], config, by_answer(scorer))
        )
    assert (result.correct, result.method) == (False, "judge_error")
    assert result.detail == (
        "the judge hit its output cap (256 output tokens, 256 of them "
        "reasoning; max_tokens=256) before writing any answer (truncated)"
    )
    assert group.trajectories == [exact] and len(group.breakdowns) == 1
    ((masked, failure),) = group.masked
    assert masked is judged and (failure.reason, failure.endpoint) == ("judge_error", "the judge")


def test_domain_task_outcome_replays_the_episode_calls():
    shop = generate_domain("shop", seed=0)
    drawn = next(t for t in generate_tasks(shop, seed=0) if t.facts and len(t.gold_actions) > 2)
    row = to_task_row(shop, drawn)
    scorer = OutcomeScorer(RewardConfig(), domains={"shop": shop})
    told = "Done. " + " and ".join(drawn.facts)
    right = score(scorer, row, told, gold_calls(drawn))
    assert (right.correct, right.method) == (True, "database")
    silent = score(scorer, row, "Done.", gold_calls(drawn))
    assert not silent.correct and "not communicated" in silent.detail
    idle = score(scorer, row, told, [])
    assert not idle.correct and "database differs" in idle.detail
    with pytest.raises(ValueError, match="domain 'shop' is not loaded"):
        score(OutcomeScorer(RewardConfig()), row, told, [])
