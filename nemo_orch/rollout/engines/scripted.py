"""A scripted policy: replies chosen by a function of the conversation so far.

Not a model. It exists to exercise and measure everything around generation (parsing, tools,
ledgers, concurrency, token bookkeeping) with a policy that calls tools on purpose, which a small
untrained model does not. ``seconds_per_call`` stands in for the engine's batched forward time.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_orch.config import RolloutConfig
from nemo_orch.rollout.engines.base import EngineError, Generation, SamplingParams, WeightUpdate
from nemo_orch.rollout.format import call_text
from nemo_orch.tools.composite import extract_final_answer

# A route: the calls a rule makes, in order (tool name, arguments).
Route = tuple[tuple[str, dict[str, Any]], ...]


class ScriptedEngine:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        reply: Callable[[str], str],
        seconds_per_call: float = 0.0,
    ) -> None:
        self.tokenizer, self.reply, self.seconds_per_call = tokenizer, reply, seconds_per_call
        self.eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.batch_sizes: list[int] = []

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        self.batch_sizes.append(len(prompts))
        if self.seconds_per_call:
            time.sleep(self.seconds_per_call)
        generations = []
        for prompt in prompts:
            text = self.reply(self.tokenizer.decode(prompt, skip_special_tokens=False))
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_id]
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[: params.max_new_tokens], "length"
            generations.append(
                Generation(ids, [0.0] * len(ids), finish, text, prompt_tokens=len(prompt))
            )
        return generations

    def update_weights(self, weights: WeightUpdate) -> None:
        raise EngineError("a scripted engine has no weights")


_RESPONSE_RE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


class RouterReplies:
    """A router's replies: a fixed route's calls, then the answer from the last observation
    (the sandbox's output, the passage's fact when ``answer`` is known and stated in it, else
    what the expert said). Played by a :class:`ScriptedEngine`, not a model: the fixed routers
    evaluations compare against, and the offline world's naive routers (whose episodes become
    SFT demonstrations)."""

    def __init__(self, route: Route, answer: str | None = None) -> None:
        self.route, self.answer = route, answer

    def __call__(self, prompt: str) -> str:
        observations = _RESPONSE_RE.findall(prompt.split("<|im_start|>user\n", 1)[-1])
        if len(observations) < len(self.route):
            return call_text(self.route[len(observations)])
        last = observations[-1].strip() if observations else ""
        # The fact inside a passage or output when it is there; else what the expert said.
        stated = self.answer is not None and re.search(
            rf"(?<![\w.]){re.escape(self.answer)}(?![\w])", last
        )
        copied = self.answer if stated else extract_final_answer(last)
        return f"<answer>{copied}</answer>"


def scripted_settings(settings: RolloutConfig) -> RolloutConfig:
    """A rule's replies are neither priced nor cut by the policy's per-turn token limit."""
    return dataclasses.replace(
        settings,
        input_usd_per_million=0.0,
        output_usd_per_million=0.0,
        max_new_tokens=settings.max_context_tokens,
    )
