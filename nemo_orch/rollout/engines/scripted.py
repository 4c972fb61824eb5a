"""A scripted policy: replies chosen by a function of the conversation so far.

Not a model. It exists to exercise and measure everything around generation (parsing, tools,
ledgers, concurrency, token bookkeeping) with a policy that calls tools on purpose, which a small
untrained model does not. ``seconds_per_call`` stands in for the engine's batched forward time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from nemo_orch.rollout.engines.base import EngineError, Generation, SamplingParams, WeightUpdate


class ScriptedEngine:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, reply: Callable[[str], str],
                 seconds_per_call: float = 0.0) -> None:
        self.tokenizer, self.reply, self.seconds_per_call = tokenizer, reply, seconds_per_call
        self.eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
        self.batch_sizes: list[int] = []

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 seeds: Sequence[int] | None = None) -> list[Generation]:
        self.batch_sizes.append(len(prompts))
        if self.seconds_per_call:
            time.sleep(self.seconds_per_call)
        generations = []
        for prompt in prompts:
            text = self.reply(self.tokenizer.decode(prompt, skip_special_tokens=False))
            ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.eos_id]
            finish = "stop"
            if len(ids) > params.max_new_tokens:
                ids, finish = ids[:params.max_new_tokens], "length"
            generations.append(Generation(ids, [0.0] * len(ids), finish, text,
                                          prompt_tokens=len(prompt)))
        return generations

    def update_weights(self, weights: WeightUpdate) -> None:
        raise EngineError("a scripted engine has no weights")
