"""The refit's buckets in one process: whole layers within the bound, each let go once the next
is asked for, and together exactly the policy's weights. (TP=2, PP=2 and DP=2 against the
pickled gather: tests/multiprocess.)"""

import weakref

import torch

from nemo_orch.config import ModelConfig, ParallelConfig
from nemo_orch.models import qwen3, weights
from nemo_orch.models.hf_mapping import SeededHFWeights

MODEL = ModelConfig(num_layers=4)


def policy(model: ModelConfig) -> torch.nn.Module:
    module = qwen3.build_model(model, ParallelConfig(), pre_process=True, post_process=True)
    weights.load_hf_weights(module, SeededHFWeights(model, seed=3), model)
    return module


def layer_bytes(model: ModelConfig) -> int:
    hf = SeededHFWeights(model, seed=0)
    return sum(hf[name].numel() * 4 for name in hf if name.startswith("model.layers.0."))


def test_buckets_hold_whole_layers_within_the_bound_and_are_not_kept(megatron_world):
    bound = 2 * layer_bytes(MODEL) + 1
    expected = SeededHFWeights(MODEL, seed=3)
    names, previous = [], []
    for bucket in weights.hf_weight_buckets(policy(MODEL), MODEL, bound):
        assert all(reference() is None for reference in previous)  # freed: one bucket alive
        layers = {name.split(".")[2] for name in bucket if name.startswith("model.layers.")}
        assert all(f"model.layers.{layer}.mlp.down_proj.weight" in bucket for layer in layers)
        if layers:
            assert sum(t.numel() * t.element_size() for t in bucket.values()) <= bound
        assert all(torch.equal(tensor, expected[name]) for name, tensor in bucket.items())
        names += bucket
        previous = [weakref.ref(tensor) for tensor in bucket.values()]
        del bucket
    assert sorted(names) == sorted(expected) and len(previous) < len(names)


def test_a_layer_larger_than_the_bound_is_a_bucket_of_its_own(megatron_world):
    buckets = list(weights.hf_weight_buckets(policy(MODEL), MODEL, bucket_bytes=1))
    assert len(buckets) == MODEL.num_layers + 2  # the embeddings, each layer, the head
    assert set(buckets[0]) == {"model.embed_tokens.weight"}
    assert [{name.split(".")[2] for name in bucket} for bucket in buckets[1:-1]] == [
        {str(layer)} for layer in range(MODEL.num_layers)
    ]
    assert set(buckets[-1]) == {"model.norm.weight", "lm_head.weight"}
