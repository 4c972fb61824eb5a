"""The judge templates (reward.judge_template): what each asks the judge, served on 127.0.0.1 by
the project's own OpenAI-compatible server, and how each reads the reply; unreadable replies are
counted judge failures, never cached; bad template files and config values fail clearly."""

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nemo_orch.config import ConfigError, RewardConfig
from nemo_orch.config.reward import JUDGE_TEMPLATES
from nemo_orch.data.tasks import Task
from nemo_orch.reward.judge import (
    PARSERS,
    judge_description,
    load_judge_template,
    read_judge_template,
)
from nemo_orch.reward.outcome import OutcomeScorer
from nemo_orch.rollout.engines.scripted import ScriptedEngine
from nemo_orch.serve.http_server import serve_json
from nemo_orch.serve.openai_server import OpenAIService

CAPITAL = Task(id="capital", question="What is the capital of France?", answer="Paris")
ANSWER = "The city of Lyon"  # neither an exact nor a numeric match: always judged

DEFAULT_PROMPT = (
    "Question:\nWhat is the capital of France?\n\nReference answer:\nParis\n\n"
    "Prediction:\nThe city of Lyon\n\nIs the prediction correct?"
)
REFERENCE_PROMPT = (
    "Question: What is the capital of France?\n\nStudent answer: The city of Lyon\n\n"
    "Reference answer: Paris\n\nAssume that the reference answer is correct. Output "
    "<correct>True</correct> if the student answer matches the reference answer. Output "
    "<correct>False</correct> if the student answer does not match the reference answer."
)
HLE_SCHEMA = {
    "type": "json_schema",
    "json_schema": {
        "name": "extracted_answer",
        "strict": True,
        "schema": {
            "type": "object",
            "properties": {
                "extracted_final_answer": {"type": "string"},
                "reasoning": {"type": "string"},
                "correct": {"type": "string", "enum": ["yes", "no"]},
                "confidence": {"type": "integer"},
                "strict": {"type": "boolean"},
            },
            "required": ["extracted_final_answer", "reasoning", "correct", "confidence", "strict"],
            "additionalProperties": False,
        },
    },
}


def hle(**fields):
    reply = {
        "extracted_final_answer": "Lyon",
        "reasoning": "Lyon is not Paris.",
        "correct": "no",
        "confidence": 90,
        "strict": True,
        **fields,
    }
    return json.dumps({key: value for key, value in reply.items() if value is not None})


class RecordingJudge:
    """The project's OpenAI-compatible service over a scripted engine that answers ``reply``;
    every chat request body is kept."""

    def __init__(self, tokenizer):
        self.reply = ""
        self.bodies: list[dict] = []
        self.service = OpenAIService(
            ScriptedEngine(tokenizer, lambda _: self.reply), tokenizer, "judge"
        )

    def chat(self, body: dict) -> dict:
        self.bodies.append(body)
        return self.service.chat(body)


@pytest.fixture(scope="module")
def served(tiny_tokenizer):
    judge = RecordingJudge(tiny_tokenizer)
    routes = {**judge.service.routes(), ("POST", "/v1/chat/completions"): judge.chat}
    with serve_json(routes, url_path="/v1", name="judge") as server:
        yield judge, server.url


def scorer(served, template, dialect="vllm"):
    _, url = served
    return OutcomeScorer(
        RewardConfig(
            judge_base_url=url,
            judge_model="judge",
            judge_template=template,
            judge_max_retries=0,
            judge_dialect=dialect,
        )
    )


def judged(served, template, reply, times=1, dialect="vllm"):
    """Score ANSWER ``times`` with one scorer, asking in ``dialect``, while the judge says
    ``reply``; the results and the request bodies the judge received."""
    judge, _ = served
    judge.reply, judge.bodies = reply, []
    chosen = scorer(served, template, dialect)
    results = [asyncio.run(chosen.score(CAPITAL, ANSWER)) for _ in range(times)]
    return results, judge.bodies


@pytest.mark.parametrize(
    "template, reply, correct",
    [
        ("default", "Correct", True),
        ("default", "Incorrect, that is another city.", False),
        ("reference", "<correct>True</correct>", True),
        (
            "reference",
            "<think>Maybe <correct>False</correct>?</think>\n<correct> true </correct>",
            True,
        ),
        ("reference", "They differ. <correct>FALSE</correct>", False),
        ("hle_official", hle(correct="yes", extracted_final_answer="Paris", confidence=80), True),
        ("hle_official", hle(), False),
        ("hle_official", hle(strict=None), False),  # strict is optional
    ],
)
def test_verdicts_are_read_and_cached(served, template, reply, correct):
    results, bodies = judged(served, template, reply, times=2)
    assert [(r.correct, r.method) for r in results] == [(correct, "judge")] * 2
    assert len(bodies) == 1  # the second score was the cached verdict


def test_hle_detail_names_the_extracted_answer_and_confidence(served):
    [result], _ = judged(served, "hle_official", hle(extracted_final_answer="Lyon", confidence=35))
    assert result.detail == "extracted_final_answer='Lyon', confidence=35"


@pytest.mark.parametrize(
    "template, reply",
    [
        ("default", "Hmm, hard to say."),
        ("reference", "The student answer matches."),
        ("reference", "<correct>True</correct> <correct>False</correct>"),
        ("reference", "<correct>True</correct> <correct>True</correct>"),
        ("reference", "<correct>maybe</correct>"),
        ("reference", "<correct>True, it matches</correct>"),
        ("reference", "<think>It is <correct>True</correct>"),  # unfinished thinking only
        ("hle_official", f"```json\n{hle()}\n```"),
        ("hle_official", hle(reasoning=None)),
        ("hle_official", hle(extra="field")),
        ("hle_official", hle(confidence=101)),
        ("hle_official", hle(confidence=-1)),
        ("hle_official", hle(confidence=True)),
        ("hle_official", hle(confidence=90.5)),
        ("hle_official", hle(correct="Yes!")),
        ("hle_official", hle(strict=False)),
        ("hle_official", hle(extracted_final_answer=7)),
        ("hle_official", "correct: yes"),
        ("hle_official", "[1, 2]"),
    ],
)
def test_unreadable_replies_are_judge_errors_never_cached(served, template, reply):
    results, bodies = judged(served, template, reply, times=2)
    assert [(r.correct, r.method) for r in results] == [(False, "judge_error")] * 2
    assert "no verdict" in results[0].detail
    assert len(bodies) == 2  # a failure is asked again


def test_default_request(served):
    _, [body] = judged(served, "default", "Correct")
    assert body["messages"] == [
        {"role": "system", "content": load_judge_template("default").system},
        {"role": "user", "content": DEFAULT_PROMPT},
    ]
    assert body["messages"][0]["content"].startswith("You grade answers to questions.")
    assert (body["temperature"], body["max_tokens"]) == (0.0, 256)
    assert "response_format" not in body


def test_reference_request(served):
    _, [body] = judged(served, "reference", "<correct>False</correct>")
    assert body["messages"] == [{"role": "user", "content": REFERENCE_PROMPT}]  # no system
    assert body["temperature"] == 1.0
    assert "max_tokens" not in body and "response_format" not in body


def test_hle_official_request(served):
    """As the official code asks o3-mini: OpenAI's reasoning dialect, 4096 completion tokens."""
    _, [body] = judged(served, "hle_official", hle(), dialect="openai-reasoning")
    [message] = body["messages"]
    assert message["role"] == "user"
    prompt = message["content"]
    assert prompt.startswith("Judge whether the following [response] to [question] is correct")
    assert (
        "[question]: What is the capital of France?\n\n[response]: The city of Lyon\n\n" in prompt
    )
    assert "\n\n[correct_answer]: Paris\n\nreasoning: Explain why" in prompt
    assert prompt.endswith(
        "between 0|\\%| and 100|\\%| from [response]. Put 100 if there is no "
        "confidence score available."
    )
    assert "{" not in prompt
    assert "temperature" not in body and "max_tokens" not in body
    assert body["max_completion_tokens"] == 4096
    assert body["response_format"] == HLE_SCHEMA


def test_every_named_template_ships_and_describes_itself(served):
    assert set(JUDGE_TEMPLATES) == {"default", "reference", "hle_official"}
    for name in JUDGE_TEMPLATES:
        template = load_judge_template(name)
        assert template.name == name and "\n" not in template.description
    _, url = served
    described = judge_description(
        RewardConfig(judge_base_url=url, judge_model="o3-mini", judge_template="hle_official")
    )
    assert described == (
        f"hle_official (the official HLE judge: structured output) by o3-mini at {url}"
    )
    assert judge_description(RewardConfig()) == (
        "none: exact and numeric matching only (reward.judge_base_url unset)"
    )
    assert judge_description(RewardConfig(endpoint="http://127.0.0.1:9")).startswith(
        "on the reward server at http://127.0.0.1:9"
    )


def test_config_names_the_template():
    with pytest.raises(
        ConfigError,
        match=r"reward\.judge_template must be "
        r"default\|reference\|hle_official, got 'gpt'",
    ):
        RewardConfig(judge_template="gpt")


GOOD = {
    "description": "a judge",
    "system": None,
    "prompt": "{question} {reference} {response}",
    "parser": "verdict",
    "temperature": 0.0,
    "max_tokens": 16,
    "response_format": None,
}


@pytest.mark.parametrize(
    "change, key, problem",
    [
        ({"prompt": "{question} {answer} {response}"}, "prompt", "it uses {answer}, {question}"),
        ({"prompt": "{question} {reference}"}, "prompt", "exactly {question}, {reference}"),
        ({"prompt": "{question} {reference} {response!r}"}, "prompt", "{response!r}"),
        ({"prompt": "{question} {reference} {response} {0}"}, "prompt", "uses {0}"),
        ({"prompt": "{question} {reference} {response} }"}, "prompt", "not a str.format template"),
        (
            {"parser": "regex"},
            "parser",
            "'regex' is not one of verdict, correct_tag, hle_structured",
        ),
        ({"parser": ["verdict"]}, "parser", "is not one of"),
        ({"judge": "gpt-5"}, "judge", "unknown key"),
        ({"max_tokens": 0}, "max_tokens", "integer >= 1"),
        ({"temperature": "hot"}, "temperature", "number >= 0"),
        ({"response_format": "json"}, "response_format", "mapping with a 'type'"),
        ({"description": "two\nlines"}, "description", "one non-empty line"),
    ],
)
def test_bad_template_files_name_the_file_and_key(tmp_path, change, key, problem):
    path = tmp_path / "bad.yaml"
    path.write_text(json.dumps({**GOOD, **change}))  # JSON is YAML
    with pytest.raises(ConfigError) as raised:
        read_judge_template(path)
    assert str(raised.value).startswith(f"judge template {path}: {key}: ")
    assert problem in str(raised.value)


def test_missing_key_and_missing_file(tmp_path):
    path = tmp_path / "short.yaml"
    path.write_text(json.dumps({key: value for key, value in GOOD.items() if key != "system"}))
    with pytest.raises(ConfigError, match=r"short\.yaml: system: missing \(write null"):
        read_judge_template(path)
    with pytest.raises(ConfigError, match=r"absent\.yaml: cannot read it"):
        read_judge_template(tmp_path / "absent.yaml")
    good = tmp_path / "good.yaml"
    good.write_text(json.dumps(GOOD))
    assert (read_judge_template(good).name, read_judge_template(good).parser) == ("good", "verdict")


@settings(max_examples=300)
@given(
    st.one_of(
        st.text(),
        st.sampled_from([hle(), "<correct>True</correct>", "Correct"]).flatmap(
            lambda base: st.integers(0, len(base)).map(lambda cut: base[:cut])
        ),
    )
)
def test_parsers_never_raise(text):
    for parser in PARSERS.values():
        verdict, detail = parser(text)
        assert verdict in (True, False, None) and isinstance(detail, str)
