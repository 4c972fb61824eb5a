"""The simulated expert's accuracy, usage and price follow its configuration."""

from __future__ import annotations

import asyncio

import pytest

from nemo_orch.data.tasks import Task
from nemo_orch.tools.base import ToolContext, ToolError, ToolSpec
from nemo_orch.tools.pricing import USD_PER_MILLION_TOKENS, model_pricing
from nemo_orch.tools.simulated_expert import SimulatedExpert

SPEC = ToolSpec(
    "call_expert",
    "Ask an expert.",
    {
        "type": "object",
        "required": ["model", "question"],
        "properties": {"model": {"type": "string"}, "question": {"type": "string"}},
    },
)
MODELS = {
    "strong": {
        "counterpart": "gpt-5",
        "accuracy": {"easy": 0.95, "hard": 0.8},
        "mean_output_tokens": 400,
    },
    "small": {
        "counterpart": "Qwen2.5-Math-7B-Instruct",
        "accuracy": {"easy": 0.9, "hard": 0.3},
        "mean_output_tokens": 100,
    },
}


def ask(expert, model, difficulty, episodes=400):
    task = Task("t", "What is 6 * 7?", answer="42", metadata={"difficulty": difficulty})

    async def all_calls():
        return await asyncio.gather(
            *(
                expert.call(
                    {"model": model, "question": task.question},
                    ToolContext(episode_id=f"t#{i}", task=task),
                )
                for i in range(episodes)
            )
        )

    return asyncio.run(all_calls())


@pytest.mark.parametrize(
    "model, difficulty, accuracy",
    [("strong", "easy", 0.95), ("strong", "hard", 0.8), ("small", "hard", 0.3)],
)
def test_accuracy_follows_tier_and_difficulty(model, difficulty, accuracy):
    results = ask(SimulatedExpert(SPEC, MODELS), model, difficulty)
    observed = sum(r.output == "Answer: 42" for r in results) / len(results)
    assert observed == pytest.approx(accuracy, abs=0.07)
    assert all(r.error is None and r.output.startswith("Answer: ") for r in results)


def test_usage_is_billed_at_the_counterparts_price():
    results = ask(SimulatedExpert(SPEC, MODELS), "strong", "easy", episodes=200)
    price = model_pricing("gpt-5")
    for result in results:
        assert result.cost_usd == pytest.approx(price.cost(result.usage, 0.0))
        assert result.latency_s == pytest.approx(result.usage.output_tokens / 60.0)
    mean_out = sum(r.usage.output_tokens for r in results) / len(results)
    assert 300 < mean_out < 600  # log-normal around 400
    assert USD_PER_MILLION_TOKENS["gpt-5"] == (1.25, 10.0)


def test_reproducible_and_clear_errors():
    expert = SimulatedExpert(SPEC, MODELS)
    assert [r.output for r in ask(expert, "small", "hard", 20)] == [
        r.output for r in ask(expert, "small", "hard", 20)
    ]
    unknown = asyncio.run(expert.call({"model": "huge", "question": "q"}, ToolContext()))
    assert "unknown model 'huge'" in unknown.error
    no_task = asyncio.run(expert.call({"model": "small", "question": "q"}, ToolContext()))
    assert "reference answer" in no_task.error
    with pytest.raises(ToolError, match="no price for model 'gpt-9'"):
        SimulatedExpert(SPEC, {"x": {"counterpart": "gpt-9", "accuracy": {"easy": 1.0}}})
    assert model_pricing("Qwen/Qwen3-32B") == model_pricing("Qwen3-32B")


def test_evidence_in_the_context_changes_the_difficulty_and_answers_end_the_episode():
    expert = SimulatedExpert(SPEC, MODELS, ends_episode=True)
    task = Task(
        "t",
        "Who wrote Ostrel?",
        answer="Vel Anor",
        metadata={"difficulty": "hard", "evidence": "Vel Anor", "evidence_difficulty": "easy"},
    )

    def accuracy(observations: tuple[str, ...]) -> float:
        async def calls():
            return await asyncio.gather(
                *(
                    expert.call(
                        {"model": "small"},
                        ToolContext(episode_id=f"t#{i}", task=task, observations=observations),
                    )
                    for i in range(400)
                )
            )

        results = asyncio.run(calls())
        assert all(r.answer == r.output.removeprefix("Answer: ") for r in results)
        return sum(r.answer == "Vel Anor" for r in results) / len(results)

    assert accuracy(()) == pytest.approx(0.3, abs=0.07)  # hard
    assert accuracy(("Ostrel is a novel by Someone Else.",)) == pytest.approx(0.3, abs=0.07)
    assert accuracy(("Ostrel is a novel by Vel Anor.",)) == pytest.approx(0.9, abs=0.07)  # easy


def test_a_context_budget_hides_old_evidence_and_bills_less():
    expert = SimulatedExpert(
        SPEC, {**MODELS, "short": dict(MODELS["small"], max_context_tokens=10)}
    )
    assert [expert.context_budget(a) for a in ("short", "small", "huge")] == [10, None, None]
    task = Task(
        "t",
        "Who wrote Ostrel?",
        answer="Vel Anor",
        metadata={"difficulty": "hard", "evidence": "Vel Anor", "evidence_difficulty": "easy"},
    )
    evidence, filler = "Ostrel is a novel by Vel Anor.", "Unrelated search result text. " * 4

    def run(model: str, observations: tuple[str, ...]):
        async def calls():
            return await asyncio.gather(
                *(
                    expert.call(
                        {"model": model},
                        ToolContext(episode_id=f"t#{i}", task=task, observations=observations),
                    )
                    for i in range(400)
                )
            )

        return asyncio.run(calls())

    def accuracy(results) -> float:
        return sum(r.output == "Answer: Vel Anor" for r in results) / len(results)

    full, short = run("small", (evidence, filler)), run("short", (evidence, filler))
    assert accuracy(full) == pytest.approx(0.9, abs=0.07)  # it read the evidence
    assert accuracy(short) == pytest.approx(0.3, abs=0.07)  # 10 tokens: only the filler's end
    question_tokens = 60 + len(task.question) // 4
    assert {r.usage.input_tokens for r in full} == {
        question_tokens + (len(evidence) + len(filler)) // 4
    }
    assert {r.usage.input_tokens for r in short} == {question_tokens + 10}
    # Evidence in the newest observation fits the same budget.
    assert accuracy(run("short", (filler, evidence))) == pytest.approx(0.9, abs=0.07)
    # A budget the whole context fits changes nothing: same replies and bills as no budget.
    roomy = SimulatedExpert(SPEC, {"small": dict(MODELS["small"], max_context_tokens=1000)})
    context = ToolContext(episode_id="t#0", task=task, observations=(evidence, filler))
    assert asyncio.run(roomy.call({"model": "small"}, context)) == full[0]


@pytest.mark.parametrize("budget", [0, -1, 1.5, "512"])
def test_invalid_context_budgets_are_tool_errors(budget):
    with pytest.raises(ToolError, match="max_context_tokens must be null or an integer >= 1"):
        SimulatedExpert(
            SPEC,
            {
                "x": {
                    "counterpart": "gpt-5",
                    "accuracy": {"easy": 1.0},
                    "max_context_tokens": budget,
                }
            },
        )
