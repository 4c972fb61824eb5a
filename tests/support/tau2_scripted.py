"""SCRIPTED tau2 parties for differential tests: one agent and one user on 127.0.0.1 that play
fixed scripts, the same for tau2's own runner (litellm's chat requests) and nemo-orch's episode
loop (the policy's ``/v1/completions`` over the chat template, the user's chat requests), and
record every request, by side, task and trial.

- The agent answers ``/v1/chat/completions`` (tau2's ``LLMAgent`` through litellm: OpenAI
  ``tool_calls`` with the text beside them as ``content``) and ``/v1/completions`` (nemo-orch's
  policy: the prompt rendered by the chat template, as token ids or text; the reply is the text
  with ``<tool_call>`` markup after any text beside the calls, as the template renders it). Its
  ``k``-th message of a conversation (the greeting not counted) is the script's ``agent[k]``
  (past the end: ``agent_then``). It knows the task from the tag the user's first message
  starts with.
- The user answers ``/v1/chat/completions`` for both sides (tau2's ``UserSimulator`` through
  litellm, nemo-orch's through its OpenAI client: tau2's prompt and flipped roles either way).
  It knows the task from its system prompt, which holds the task's user scenario; its answer to
  the agent's ``k``-th message to it (``0``: the greeting) is the script's ``user[k]`` (past the
  end: ``user_then``): first the reply's own tool calls where it has some (telecom's phone),
  then, once their results are in, its text.

The side is what follows the party in the model name (``scripted-agent-tau2``,
``scripted-user-nemo``: sides ``tau2`` and ``nemo``; a run of its own can name a side of its own);
the trial is the request's ``seed`` (tau2's runner gives each trial its seed, nemo-orch each
episode its own). A request no script matches is answered 400, so a run fails loudly.
"""

from __future__ import annotations

import json
import re
import threading
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nemo_orch.rollout.format import call_text
from support.local_http import Answer, JSONServer

AGENT, USER = "scripted-agent", "scripted-user"
# What a party says once its script is over (and no ``*_then`` goes on): visible in whatever
# compares the conversations, never a stop.
SCRIPT_OVER = "(the script is over)"
_TAG = re.compile(r"^\[([\w.-]+)\] ")
_PROMPT_TAG = re.compile(r"<\|im_start\|>user\n\[([\w.-]+)\] ")
_ASSISTANT_TURN = "<|im_start|>assistant\n"
_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)

Call = tuple[str, dict[str, Any]]


@dataclass(frozen=True)
class Say:
    """One message of a party: its text and its tool calls (the agent's: in the same message,
    the text beside them; the user's: made first, the text sent once their results are in)."""

    text: str | None = None
    calls: tuple[Call, ...] = ()


@dataclass(frozen=True)
class Script:
    """A task's conversation. ``tag`` starts the user's first message (``[tag] ...``);
    ``scenario`` is the task's ``str(user_scenario)``, which tau2 puts in the user's system
    prompt."""

    tag: str
    scenario: str
    agent: tuple[Say, ...]
    user: tuple[Say, ...]
    agent_then: Say | None = None
    user_then: Say | None = None


def model_name(party: str, side: str) -> str:
    """The model name ``party`` (:data:`AGENT` or :data:`USER`) is asked for by ``side``."""
    return f"{party}-{side}"


def _side(body: Mapping[str, Any], party: str) -> str:
    model = str(body.get("model", ""))
    if not model.startswith(f"{party}-") or model == f"{party}-":
        raise LookupError(f"model {model!r} is not {party}-<side>")
    return model[len(party) + 1 :]


def _chat_reply(model: str, text: str | None, calls: Sequence[Call], call_ids: str) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"{call_ids}_{index}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(arguments)},
            }
            for index, (name, arguments) in enumerate(calls)
        ]
    return {
        "id": "chatcmpl-scripted",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if calls else "stop"}
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }


def _completion_reply(model: str, text: str, token_ids: Sequence[int]) -> dict:
    """vLLM's answer with ``return_tokens_as_token_ids``: the text's tokens as ``token_id:N``,
    each with its logprob (0: the script is certain)."""
    logprobs = {
        "tokens": [f"token_id:{token}" for token in token_ids],
        "token_logprobs": [0.0] * len(token_ids),
    }
    return {
        "id": "cmpl-scripted",
        "object": "text_completion",
        "created": 0,
        "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": "stop"}],
        "usage": {
            "prompt_tokens": 1,
            "completion_tokens": len(token_ids),
            "total_tokens": 1 + len(token_ids),
        },
    }


def policy_text(say: Say) -> str:
    """An agent message as nemo-orch's policy writes it: the text, then each call's markup
    (as the chat template renders an assistant message with tool calls)."""
    parts = [say.text] if say.text else []
    parts += [call_text(call) for call in say.calls]
    return "\n".join(parts)


@dataclass
class Recorded:
    """What the parties were asked: ``user[(side, tag, seed)]`` the user's requests (chat
    bodies), ``agent[(side, tag)]`` the agent's (the conversation: chat messages on tau2's
    side, the rendered prompt on nemo-orch's)."""

    user: dict[tuple[str, str, Any], list[dict[str, Any]]] = field(
        default_factory=lambda: defaultdict(list)
    )
    agent: dict[tuple[str, str], list[Any]] = field(default_factory=lambda: defaultdict(list))

    def told_user(self, side: str, tag: str, seed: Any) -> list[str]:
        """The agent's messages the user received in one episode, in order (the greeting
        first): the agent's turns of the user's longest request, where tau2 flips them to
        ``user``."""
        requests = self.user.get((side, tag, seed), [])
        if not requests:
            return []
        longest = max(requests, key=lambda body: len(body["messages"]))
        return [
            message["content"] for message in longest["messages"][1:] if message["role"] == "user"
        ]

    def user_saw(self, side: str, tag: str, seed: Any) -> list[str]:
        """The results of the user's own tool calls, as the user read them in one episode."""
        requests = self.user.get((side, tag, seed), [])
        if not requests:
            return []
        longest = max(requests, key=lambda body: len(body["messages"]))
        return [message["content"] for message in longest["messages"] if message["role"] == "tool"]

    def agent_saw(self, side: str, tag: str) -> list[str]:
        """The results of the agent's tool calls, as the agent read them in its longest
        conversation of the task: tau2's tool messages, or the ``<tool_response>`` blocks of
        nemo-orch's rendered prompt."""
        conversations = self.agent.get((side, tag), [])
        if not conversations:
            return []
        longest = max(conversations, key=len)
        if isinstance(longest, str):
            return _TOOL_RESPONSE.findall(longest)
        return [message["content"] for message in longest if message["role"] == "tool"]


class ScriptedParties:
    """The scripted agent and user, each on its own :class:`JSONServer`; ``agent_url`` and
    ``user_url`` end in ``/v1``. ``tokenizer`` decodes nemo-orch's token-id prompts."""

    def __init__(self, scripts: Sequence[Script], tokenizer: Any) -> None:
        self.scripts = {script.tag: script for script in scripts}
        if len(self.scripts) != len(scripts):
            raise ValueError("two scripts share a tag")
        scenarios = [script.scenario for script in scripts]
        if len(set(scenarios)) != len(scenarios):
            raise ValueError(
                "two scripts share a user scenario: the user could not tell them apart"
            )
        self.tokenizer = tokenizer
        self.recorded = Recorded()
        # the servers answer from threads: one lock for the records, one for the tokenizer
        self._lock, self._tokenizer_lock = threading.Lock(), threading.Lock()
        self._agent = JSONServer(self._answer_agent, url_path="/v1")
        self._user = JSONServer(self._answer_user, url_path="/v1")
        self.agent_url, self.user_url = self._agent.url, self._user.url

    def close(self) -> None:
        self._agent.stop()
        self._user.stop()

    def __enter__(self) -> ScriptedParties:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _refuse(message: str) -> Answer:
        return (
            400,
            {"error": {"message": message, "type": "invalid_request_error", "code": "scripted"}},
            {},
        )

    # ------------------------------------------------------------------ the agent
    def _answer_agent(self, path: str, headers: Mapping[str, str], body: Any) -> Answer:
        try:
            side = _side(body, AGENT)
            if path == "/v1/chat/completions":
                messages = body["messages"]
                first = next((m["content"] for m in messages if m["role"] == "user"), "")
                tag, conversation = _TAG.match(first or "")[1], messages
                index = sum(m["role"] == "assistant" for m in messages) - 1
            elif path == "/v1/completions":
                prompt = body["prompt"]
                if isinstance(prompt, str):
                    conversation = prompt
                else:
                    with self._tokenizer_lock:
                        conversation = self.tokenizer.decode(prompt, skip_special_tokens=False)
                tag = _PROMPT_TAG.search(conversation)[1]
                # the greeting and the generation prompt are assistant turns too
                index = conversation.count(_ASSISTANT_TURN) - 2
            else:
                return self._refuse(f"no endpoint {path}")
            script = self.scripts[tag]
        except (LookupError, TypeError) as error:
            return self._refuse(f"the scripted agent cannot tell the task: {error!r}")
        say = (
            script.agent[index]
            if index < len(script.agent)
            else script.agent_then or Say(SCRIPT_OVER)
        )
        with self._lock:
            self.recorded.agent[(side, tag)].append(conversation)
        if path == "/v1/chat/completions":
            return 200, _chat_reply(body["model"], say.text, say.calls, f"agent_{index}"), {}
        text = policy_text(say)
        with self._tokenizer_lock:
            token_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return 200, _completion_reply(body["model"], text, token_ids), {}

    # ------------------------------------------------------------------ the user
    def _script_of(self, system: str) -> Script:
        found = [script for script in self.scripts.values() if script.scenario in system]
        if not found:
            raise LookupError("no script's scenario is in the user's system prompt")
        return max(found, key=lambda script: len(script.scenario))

    def _answer_user(self, path: str, headers: Mapping[str, str], body: Any) -> Answer:
        if path != "/v1/chat/completions":
            return self._refuse(f"no endpoint {path}")
        try:
            side = _side(body, USER)
            messages = body["messages"]
            if messages[0]["role"] != "system":
                raise LookupError("the user's first message is not its system prompt")
            script = self._script_of(messages[0]["content"])
        except (LookupError, TypeError, KeyError) as error:
            return self._refuse(f"the scripted user cannot tell the task: {error!r}")
        with self._lock:
            self.recorded.user[(side, script.tag, body.get("seed"))].append(body)
        # tau2 flips the roles: the agent's messages reach the user LLM as "user" turns
        index = sum(message["role"] == "user" for message in messages[1:]) - 1
        say = (
            script.user[index] if index < len(script.user) else script.user_then or Say(SCRIPT_OVER)
        )
        if messages[-1]["role"] == "user" and say.calls:  # the calls first
            return 200, _chat_reply(body["model"], None, say.calls, f"user_{index}"), {}
        text = say.text or ""
        if index == 0:
            text = f"[{script.tag}] {text}"
        return 200, _chat_reply(body["model"], text, (), f"user_{index}"), {}
