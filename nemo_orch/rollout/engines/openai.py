"""The :class:`Engine` seam over an OpenAI-compatible server's ``/v1/completions``
(:class:`~nemo_orch.clients.openai.OpenAIClient` does the HTTP).

:class:`OpenAIEngine` evaluates a served model through the token-level :class:`Engine` seam. With
``extensions=True`` (vLLM and our server) it sends token ids as the prompt and vLLM's sampling
extensions (``top_k``, ``stop_token_ids``, ``ignore_eos``, ``include_stop_str_in_output``,
``return_tokens_as_token_ids``), so the returned token ids and logprobs are exact. Against a plain
OpenAI server it sends text and re-encodes the returned text; logprobs are then kept only when
they line up one-to-one with the re-encoded tokens. A request that fails for good is an
:class:`EngineError`, handled like any other engine failure.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

from nemo_orch.clients.openai import OpenAIClient, OpenAIError, run_sync
from nemo_orch.rollout.engines.base import (
    EngineError,
    Generation,
    SamplingParams,
    WeightUpdate,
    prompt_seeds,
)

_TOKEN_ID_PREFIX = "token_id:"
# A token named by id (vLLM's return_tokens_as_token_ids). At most 9 digits: no vocabulary is
# larger, and a longer number would overflow the tokenizer's decode (a crash, not an error).
_TOKEN_ID = re.compile(re.escape(_TOKEN_ID_PREFIX) + "[0-9]{1,9}")


class OpenAIEngine:
    """The :class:`Engine` seam over a served model's ``/v1/completions`` (for evaluation).

    ``extensions``: the server accepts token-id prompts and vLLM's sampling extensions (see the
    module docstring). ``concurrency`` bounds the requests in flight.
    """

    def __init__(
        self,
        client: OpenAIClient,
        tokenizer: PreTrainedTokenizerBase,
        *,
        model: str | None = None,
        extensions: bool = True,
        concurrency: int = 8,
    ) -> None:
        self.client = client
        self.tokenizer = tokenizer
        self.model = model
        self.extensions = extensions
        self.concurrency = concurrency

    def generate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        return run_sync(self.agenerate(prompts, params, seeds))

    def update_weights(self, weights: WeightUpdate) -> None:
        raise EngineError(
            "a served model cannot be refit through the OpenAI API; reload the "
            "server with the new checkpoint instead"
        )

    async def agenerate(
        self, prompts: list[list[int]], params: SamplingParams, seeds: Sequence[int] | None = None
    ) -> list[Generation]:
        """One request per prompt, ``concurrency`` at a time; results in prompt order. Each
        request carries its prompt's seed (:func:`prompt_seeds`), so the samples of a repeated
        prompt differ; with neither ``seeds`` nor ``params.seed`` the server picks."""
        semaphore = asyncio.Semaphore(self.concurrency)
        unseeded = seeds is None and params.seed is None
        request_seeds = (
            [None] * len(prompts) if unseeded else prompt_seeds(params, len(prompts), seeds)
        )

        async def one(prompt: list[int], seed: int | None) -> Generation:
            async with semaphore:
                return await self._generate_one(prompt, params, seed)

        return list(await asyncio.gather(*(one(p, s) for p, s in zip(prompts, request_seeds))))

    def _request_fields(self, params: SamplingParams, seed: int | None) -> dict[str, Any]:
        fields: dict[str, Any] = {
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": 0,
        }
        if seed is not None:
            fields["seed"] = seed
        stop = list(params.stop_strings)
        if self.extensions:
            fields.update(
                stop_token_ids=list(params.stop_token_ids),
                ignore_eos=True,
                include_stop_str_in_output=True,
                return_tokens_as_token_ids=True,
            )
            if params.top_k:
                fields["top_k"] = params.top_k
        else:
            if params.top_k:
                raise EngineError("top_k needs a server with extensions (vLLM-compatible)")
            stop += [self.tokenizer.decode([t]) for t in params.stop_token_ids]
        if stop:
            fields["stop"] = stop
        return fields

    async def _generate_one(
        self, prompt: list[int], params: SamplingParams, seed: int | None
    ) -> Generation:
        sent: str | list[int] = prompt if self.extensions else self.tokenizer.decode(prompt)
        try:  # a malformed reply (MalformedReply) too
            completion = await self.client.completions(
                sent, model=self.model, **self._request_fields(params, seed)
            )
        except OpenAIError as error:
            raise EngineError(str(error)) from error
        tokens, values = completion.tokens, completion.token_logprobs
        if tokens and all(_TOKEN_ID.fullmatch(token) for token in tokens):
            token_ids = [int(token[len(_TOKEN_ID_PREFIX) :]) for token in tokens]
        else:
            token_ids = self.tokenizer.encode(completion.text, add_special_tokens=False)
        extra: dict[str, Any] = {}
        if len(values) != len(token_ids):
            extra["server_logprobs"], values = values, []
        return Generation(
            token_ids=token_ids,
            logprobs=values,
            finish_reason=completion.finish_reason or "length",
            text=self.tokenizer.decode(token_ids, skip_special_tokens=True)
            if self.extensions
            else completion.text,
            prompt_tokens=len(prompt)
            if completion.prompt_tokens is None
            else completion.prompt_tokens,
            extra=extra,
        )
