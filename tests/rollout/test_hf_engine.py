"""The CPU rollout engine: batching, KV cache, sampling, logprobs, stops, refit from Megatron."""

import pytest
import torch

from nemo_orch.config import ModelConfig, ParallelConfig
from nemo_orch.models import qwen3, weights
from nemo_orch.models.hf_mapping import SeededHFWeights, save_hf_checkpoint
from nemo_orch.rollout.engines.base import Engine, EngineError, SamplingParams
from nemo_orch.rollout.engines.hf import HFEngine, sample_rows

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)


def tiny_model(vocab_size: int) -> ModelConfig:
    # A larger init std than the default gives peaked logits, so greedy picks have no near-ties.
    return ModelConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        kv_channels=16,
        ffn_hidden_size=128,
        vocab_size=vocab_size,
        max_position_embeddings=64,
        init_method_std=0.1,
    )


@pytest.fixture(scope="module")
def engine(tiny_tokenizer):
    return HFEngine(tiny_model(len(tiny_tokenizer)), seed=3, tokenizer=tiny_tokenizer)


@pytest.fixture(scope="module")
def prompts(engine):
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randint(9, engine.model_config.vocab_size, (n,), generator=generator).tolist()
        for n in (3, 11, 6)
    ]


def forward_logits(engine: HFEngine, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return engine.model(input_ids=torch.tensor([tokens])).logits[0].float()


def test_is_an_engine(engine):
    assert isinstance(engine, Engine)


def test_batched_greedy_equals_one_at_a_time(engine, prompts):
    batched = engine.generate(prompts, GREEDY)
    for prompt, generation in zip(prompts, batched):
        alone = engine.generate([prompt], GREEDY)[0]
        assert generation.token_ids == alone.token_ids
        assert generation.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
        assert generation.prompt_tokens == len(prompt)
        assert generation.finish_reason == "length" and len(generation.token_ids) == 12
        assert generation.text == engine.tokenizer.decode(
            generation.token_ids, skip_special_tokens=True
        )


def test_kv_cache_equals_recomputation(engine, prompts):
    generation = engine.generate([prompts[1]], GREEDY)[0]
    tokens, logprobs = list(prompts[1]), []
    for _ in range(GREEDY.max_new_tokens):
        last = torch.log_softmax(forward_logits(engine, tokens)[-1], -1)
        tokens.append(int(last.argmax()))
        logprobs.append(float(last.max()))
    assert generation.token_ids == tokens[len(prompts[1]) :]
    assert generation.logprobs == pytest.approx(logprobs, abs=1e-5)


def test_sampled_logprobs_match_a_forward_pass(engine, prompts):
    params = SamplingParams(max_new_tokens=10, temperature=0.7, top_p=0.9, top_k=50, seed=1)
    for prompt, generation in zip(prompts, engine.generate(prompts, params)):
        logits = forward_logits(engine, prompt + generation.token_ids)[len(prompt) - 1 : -1]
        expected = torch.log_softmax(logits / 0.7, -1).gather(
            -1, torch.tensor(generation.token_ids)[:, None]
        )[:, 0]
        assert generation.logprobs == pytest.approx(expected.tolist(), abs=1e-5)


def test_seeded_sampling_is_reproducible_and_row_independent(engine, prompts):
    params = SamplingParams(max_new_tokens=10, temperature=1.0, seed=7)
    first = engine.generate(prompts, params)
    assert [g.token_ids for g in engine.generate(prompts, params)] == [g.token_ids for g in first]
    assert engine.generate(prompts[:1], params)[0].token_ids == first[0].token_ids
    other = engine.generate(prompts, SamplingParams(max_new_tokens=10, temperature=1.0, seed=8))
    assert [g.token_ids for g in other] != [g.token_ids for g in first]
    # The samples of one prompt repeated in a batch (a GRPO group) differ from each other.
    group = engine.generate([prompts[0]] * 4, params)
    assert len({tuple(g.token_ids) for g in group}) > 1


def test_a_prompt_with_its_own_seed_samples_alike_in_any_batch(engine, prompts):
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    batched = engine.generate(prompts, params, seeds=[11, 12, 13])
    alone = [
        engine.generate([prompt], params, seeds=[seed])[0]
        for prompt, seed in zip(reversed(prompts), (13, 12, 11))
    ][::-1]
    assert [g.token_ids for g in alone] == [g.token_ids for g in batched]
    for ours, theirs in zip(alone, batched):
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    # Per-prompt seeds replace the call's seed.
    again = engine.generate(prompts, SamplingParams(max_new_tokens=10, seed=99), [11, 12, 13])
    assert [g.token_ids for g in again] == [g.token_ids for g in batched]
    with pytest.raises(EngineError, match="2 seeds for 3 prompts"):
        engine.generate(prompts, params, seeds=[1, 2])


def test_rows_sample_their_distribution_and_never_a_filtered_token():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    generators = [torch.Generator().manual_seed(seed) for seed in range(4000)]
    tokens = sample_rows(probs.expand(len(generators), -1), generators)
    shares = torch.bincount(tokens, minlength=5) / len(generators)
    assert shares.tolist() == pytest.approx(probs.tolist(), abs=0.025)  # ~3.4 sigma at p=0.6
    assert shares[1] == shares[4] == 0
    # A row's token depends on its own generator only.
    again = sample_rows(probs[None], [torch.Generator().manual_seed(17)])
    assert int(again[0]) == int(tokens[17])


def test_top_k_one_is_greedy(engine, prompts):
    greedy = engine.generate(prompts, GREEDY)
    top1 = engine.generate(prompts, SamplingParams(max_new_tokens=12, top_k=1, seed=5))
    for a, b in zip(greedy, top1):
        assert a.token_ids == b.token_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


def test_stop_token_is_kept_and_ends_the_row(engine, prompts):
    free = engine.generate(prompts, GREEDY)
    stop = free[0].token_ids[4]
    cut = free[0].token_ids.index(stop) + 1
    stopped = engine.generate(
        prompts, SamplingParams(max_new_tokens=12, temperature=0, stop_token_ids=(stop,))
    )
    assert stopped[0].token_ids == free[0].token_ids[:cut]
    assert stopped[0].finish_reason == "stop" and stopped[0].extra["stop"] == stop
    for a, b in zip(free[1:], stopped[1:]):  # rows that finished early left the others intact
        expected = (
            a.token_ids[: a.token_ids.index(stop) + 1] if stop in a.token_ids else a.token_ids
        )
        assert b.token_ids == expected


def test_stop_string_truncates_after_the_completing_token(engine, prompts):
    free = engine.generate([prompts[2]], GREEDY)[0]
    text = free.text
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    decode = engine.tokenizer.decode
    cut = next(
        i + 1
        for i in range(len(free.token_ids))
        if stop in decode(free.token_ids[: i + 1], skip_special_tokens=True)
    )
    stopped = engine.generate(
        [prompts[2]],
        SamplingParams(max_new_tokens=12, temperature=0, stop_strings=(stop, "\x00never")),
    )
    assert stopped[0].token_ids == free.token_ids[:cut]
    assert stopped[0].finish_reason == "stop" and stop in stopped[0].text
    assert stopped[0].extra["stop"] == stop


def test_stop_strings_need_a_tokenizer(tiny_tokenizer, prompts):
    bare = HFEngine(tiny_model(len(tiny_tokenizer)), seed=3)
    assert bare.generate(prompts, GREEDY)[0].text == ""
    with pytest.raises(EngineError, match="tokenizer"):
        bare.generate(prompts, SamplingParams(stop_strings=("x",)))


def test_context_length_is_respected(engine):
    limit = engine.model_config.max_position_embeddings
    with pytest.raises(EngineError, match="at most"):
        engine.generate([[10] * limit], GREEDY)
    near_end = engine.generate([[10] * (limit - 3)], GREEDY)[0]
    assert len(near_end.token_ids) == 3 and near_end.finish_reason == "length"
    with pytest.raises(EngineError, match="outside"):
        engine.generate([[engine.model_config.vocab_size]], GREEDY)


def test_update_weights_rejects_mismatches(engine):
    state = dict(SeededHFWeights(engine.model_config, seed=3))
    with pytest.raises(EngineError, match="missing.*model.norm.weight"):
        engine.update_weights({k: v for k, v in state.items() if k != "model.norm.weight"})
    with pytest.raises(EngineError, match="unexpected.*extra"):
        engine.update_weights({**state, "extra": torch.zeros(1)})
    with pytest.raises(EngineError, match="shape"):
        engine.update_weights({**state, "model.norm.weight": torch.ones(3)})


def test_a_refit_that_stops_half_way_blocks_generation_until_a_full_one(engine, prompts):
    before = [g.token_ids for g in engine.generate(prompts, GREEDY)]
    state = dict(SeededHFWeights(engine.model_config, seed=5))
    first, *rest = ({name: tensor} for name, tensor in state.items())
    with pytest.raises(EngineError, match="without 1 of the model's tensors"):
        engine.update_weights(iter([first, *rest[:-1]]))
    with pytest.raises(EngineError, match="half-way"):
        engine.generate(prompts, GREEDY)
    engine.update_weights(SeededHFWeights(engine.model_config, seed=3))  # the fixture's
    assert [g.token_ids for g in engine.generate(prompts, GREEDY)] == before


def test_loads_an_hf_export(tmp_path, tiny_tokenizer, engine, prompts):
    save_hf_checkpoint(tmp_path, SeededHFWeights(engine.model_config, seed=3), engine.model_config)
    tiny_tokenizer.save_pretrained(str(tmp_path))
    loaded = HFEngine.from_pretrained(tmp_path)
    assert loaded.tokenizer is not None
    assert [g.token_ids for g in loaded.generate(prompts, GREEDY)] == [
        g.token_ids for g in engine.generate(prompts, GREEDY)
    ]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_refit_from_megatron_policy_gives_its_logits(megatron_world, tied):
    model = ModelConfig(share_embeddings_and_output_weights=tied)
    module = qwen3.build_model(model, ParallelConfig(), pre_process=True, post_process=True)
    weights.load_hf_weights(module, SeededHFWeights(model, seed=11), model)
    with torch.no_grad():  # stand-in for training steps: the policy drifts from its init
        for parameter in module.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.01)
    engine = HFEngine(model, seed=0)
    # streamed a layer at a time, as GRPO refits its engine
    engine.update_weights(weights.hf_weight_buckets(module, model, bucket_bytes=1))
    tokens = torch.randint(0, model.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ours = module.eval()(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
        theirs = engine.model(input_ids=tokens).logits
    assert float((ours - theirs).abs().max()) < 1e-4


# ----------------------------------------------------------------------------- prefix caching

BLOCK = 4  # small blocks, so the tiny prompts here fill some


@pytest.fixture(scope="module")
def uncached(tiny_tokenizer):
    return HFEngine(
        tiny_model(len(tiny_tokenizer)), seed=3, tokenizer=tiny_tokenizer, prefix_caching=False
    )


@pytest.fixture
def cached(tiny_tokenizer):
    """A fresh cache (and counters) per test."""
    return HFEngine(
        tiny_model(len(tiny_tokenizer)), seed=3, tokenizer=tiny_tokenizer, prefix_block_tokens=BLOCK
    )


def assert_same(ours, theirs):
    assert [g.token_ids for g in ours] == [g.token_ids for g in theirs]
    for a, b in zip(ours, theirs):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
        assert (a.finish_reason, a.prompt_tokens) == (b.finish_reason, b.prompt_tokens)


def next_turns(prompts, generations, seed):
    """Each episode's next prompt: this one, its generation and a 4-token observation."""
    generator = torch.Generator().manual_seed(seed)
    return [
        prompt + generation.token_ids + torch.randint(9, 200, (4,), generator=generator).tolist()
        for prompt, generation in zip(prompts, generations)
    ]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=8, temperature=0),
        SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9),
    ],
    ids=["greedy", "seeded"],
)
def test_later_turns_read_their_history_from_the_cache_and_continue_alike(
    cached, uncached, prompts, params
):
    turns = [list(prompts), None, None]
    seeds = [21, 22, 23]
    for turn in range(3):
        ours = cached.generate(turns[turn], params, seeds)
        assert_same(ours, uncached.generate(turns[turn], params, seeds))
        if turn < 2:
            turns[turn + 1] = next_turns(turns[turn], ours, seed=turn)
    stats = cached.prefix_stats
    assert stats.hits >= 2 * len(prompts) - 1  # every later turn but a too-short one hits
    # A turn reads all of its history but the last sampled token and the unfilled block.
    second = turns[1]
    assert stats.reused_tokens >= sum(len(p) - 4 - 1 - BLOCK for p in second)
    assert stats.computed_tokens + stats.reused_tokens >= stats.prompt_tokens


def test_a_batch_of_hits_misses_and_duplicates_continues_alike(cached, uncached, prompts):
    cached.generate(prompts[1:2], GREEDY)  # prompts[1] is cached, the others are not
    first = cached.generate(prompts[1:2], GREEDY)[0]
    extended = prompts[1] + first.token_ids + [9, 10, 11]
    batch = [prompts[0], extended, prompts[2], prompts[2], prompts[1], extended]
    hits = cached.prefix_stats.hits
    assert_same(cached.generate(batch, GREEDY), uncached.generate(batch, GREEDY))
    assert cached.prefix_stats.hits - hits == 5  # all but prompts[0], shorter than a block
    params = SamplingParams(max_new_tokens=10, temperature=1.0)
    seeds = list(range(40, 40 + len(batch)))
    assert_same(cached.generate(batch, params, seeds), uncached.generate(batch, params, seeds))


def test_a_group_computes_its_shared_prompt_once(cached, uncached):
    prompt = torch.randint(9, 200, (30,), generator=torch.Generator().manual_seed(5)).tolist()
    group = [prompt] * 4
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    seeds = [1, 2, 3, 4]
    assert_same(cached.generate(group, params, seeds), uncached.generate(group, params, seeds))
    stats = cached.prefix_stats
    shared = (len(prompt) - 1) // BLOCK * BLOCK  # whole blocks before the last token
    assert stats.shared_prefixes == 1
    assert stats.computed_tokens == shared + len(group) * (len(prompt) - shared)
    assert (stats.hits, stats.reused_tokens) == (4, 4 * shared)
    assert stats.computed_tokens < len(group) * len(prompt) / 2


def test_a_refit_empties_the_cache_even_when_it_stops_half_way(cached, uncached, prompts):
    cached.generate(prompts, GREEDY)
    assert cached.prefix_cache.cached_tokens > 0
    new = dict(SeededHFWeights(cached.model_config, seed=5))
    cached.update_weights(new)
    assert cached.prefix_cache.cached_tokens == 0
    # No key of the old weights is reused: the new weights give the uncached engine's tokens.
    reference = HFEngine(cached.model_config, new, prefix_caching=False)
    assert_same(cached.generate(prompts, GREEDY), reference.generate(prompts, GREEDY))
    assert cached.prefix_cache.cached_tokens > 0
    first, *rest = ({name: tensor} for name, tensor in new.items())
    with pytest.raises(EngineError, match="without 1 of the model's tensors"):
        cached.update_weights(iter([first, *rest[:-1]]))
    assert cached.prefix_cache.cached_tokens == 0


def test_a_cache_bound_below_one_block_is_refused(tiny_tokenizer):
    with pytest.raises(EngineError, match="prefix_cache_mb=1 holds no block"):
        HFEngine(tiny_model(len(tiny_tokenizer)), prefix_cache_mb=1, prefix_block_tokens=4096)
