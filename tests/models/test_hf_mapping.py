"""HF <-> Megatron weight mapping for every TP/PP layout, and the TensorRT-LLM checkpoint."""

import pytest
import torch

from nemo_orch import config as config_lib
from nemo_orch.models import trtllm
from nemo_orch.models.hf_mapping import (
    Layout,
    SeededHFWeights,
    hf_to_megatron,
    megatron_to_hf,
    parse_size,
)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def model(request):
    return config_lib.load(
        [f"model.share_embeddings_and_output_weights={request.param}", "model.num_layers=4"]
    ).model


@pytest.fixture(scope="module")
def hf(model):
    return dict(SeededHFWeights(model, seed=3))


def _shard_all(hf, model, tp, pp, impl="local"):
    return [
        [hf_to_megatron(hf, model, Layout(tp, t, pp, p), impl) for t in range(tp)]
        for p in range(pp)
    ]


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2)])
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_hf_megatron_hf_is_exact(hf, model, tp, pp, impl):
    back = megatron_to_hf(_shard_all(hf, model, tp, pp, impl), model, impl)
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


def test_shard_sizes_parse_as_hf_writes_them():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("500MiB") == 500 * 2**20
    assert parse_size(" 1.5 kb ") == 1500 and parse_size("1000") == parse_size(1000) == 1000
    for bad in ("5 parsecs", "0", "-1GB", ""):
        with pytest.raises(config_lib.ConfigError, match="max shard size"):
            parse_size(bad)


def test_shards_have_megatron_shapes(hf, model):
    shard = _shard_all(hf, model, 2, 2)[1][1]
    d, groups, heads = model.kv_channels, model.num_query_groups, model.num_attention_heads
    local_rows = (heads + 2 * groups) * d // 2
    assert shard["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (
        local_rows,
        model.hidden_size,
    )
    assert shard["decoder.layers.1.mlp.linear_fc1.weight"].shape[0] == model.ffn_hidden_size
    assert "embedding.word_embeddings.weight" not in shard  # second pipeline stage
    assert shard["output_layer.weight"].shape[0] == model.vocab_size // 2
    assert all(t.is_contiguous() for t in shard.values())


def test_te_spec_fuses_norms_into_linears(hf, model):
    shard = hf_to_megatron(hf, model, Layout(), "transformer_engine")
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in shard
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in shard
    assert not any(
        k.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight")) for k in shard
    )


def test_qkv_fusion_groups_queries_with_their_kv_head(hf, model):
    fused = hf_to_megatron(hf, model, Layout())["decoder.layers.0.self_attention.linear_qkv.weight"]
    d = model.kv_channels
    per_group = model.num_attention_heads // model.num_query_groups
    block = (per_group + 2) * d
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    for group in range(model.num_query_groups):
        rows = fused[group * block : (group + 1) * block]
        assert torch.equal(
            rows[: per_group * d], q[group * per_group * d : (group + 1) * per_group * d]
        )
        assert torch.equal(rows[per_group * d : per_group * d + d], k[group * d : (group + 1) * d])


def test_seeded_weights_are_layout_independent_and_lazy(model):
    a, b = SeededHFWeights(model, 5), SeededHFWeights(model, 5)
    name = "model.layers.3.mlp.down_proj.weight"
    assert torch.equal(a[name], b[name])
    assert not torch.equal(a[name], SeededHFWeights(model, 6)[name])
    assert a[name].std() < a["model.layers.3.mlp.up_proj.weight"].std()  # scaled output init


@pytest.mark.parametrize("tp", [1, 2])
def test_trtllm_shards_reassemble_to_hf(tmp_path, hf, model, tp):
    trtllm.save_trtllm_checkpoint(tmp_path, hf, model, tp=tp, dtype="float32")
    config, shards = trtllm.load_trtllm_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"] + [
        f"rank{r}.safetensors" for r in range(tp)
    ]
    assert config["mapping"]["tp_size"] == tp and config["architecture"] == "Qwen3ForCausalLM"
    back = trtllm.trtllm_shards_to_hf(shards, model)
    assert back.keys() == hf.keys()
    for name in hf:
        assert torch.equal(back[name], hf[name]), name


def test_trtllm_names_swap_gate_and_fc(hf, model):
    shard = trtllm.hf_to_trtllm_shards(hf, model, tp=1)[0]
    layer = "transformer.layers.2.mlp."
    assert torch.equal(shard[layer + "fc.weight"], hf["model.layers.2.mlp.gate_proj.weight"])
    assert torch.equal(shard[layer + "gate.weight"], hf["model.layers.2.mlp.up_proj.weight"])
    assert torch.equal(
        shard["transformer.layers.2.attention.q_layernorm.weight"],
        hf["model.layers.2.self_attn.q_norm.weight"],
    )


def test_trtllm_rejects_indivisible_tp(hf, model):
    with pytest.raises(ValueError, match="not divisible"):
        trtllm.hf_to_trtllm_shards(hf, model, tp=3)


@pytest.fixture(scope="module")
def hf_distinct_norms(model, hf):
    """The seeded weights with every norm distinct (seeded norms are all ones, so a mapping that
    swapped two norms would go unnoticed)."""
    generator = torch.Generator().manual_seed(7)
    return {
        name: torch.rand(tensor.shape, generator=generator) + 0.5
        if name.endswith("norm.weight")
        else tensor
        for name, tensor in hf.items()
    }


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 2)])
def test_te_state_crosses_to_local_through_hf(hf_distinct_norms, model, tp, pp):
    """HF -> Megatron (TE) -> HF -> Megatron (local) equals HF -> Megatron (local), with TE's
    FP8 ``_extra_state`` entries ignored on the way."""
    te = _shard_all(hf_distinct_norms, model, tp, pp, "transformer_engine")
    fp8_metadata = torch.frombuffer(bytearray(b"te-fp8-metadata"), dtype=torch.uint8)
    for stage in te:
        for shard in stage:
            shard.update(
                {
                    name.replace(".weight", "._extra_state"): fp8_metadata
                    for name in list(shard)
                    if name.endswith("linear_qkv.weight")
                }
            )
    back = megatron_to_hf(te, model, "transformer_engine")
    local = _shard_all(back, model, tp, pp, "local")
    direct = _shard_all(hf_distinct_norms, model, tp, pp, "local")
    for crossed, expected in zip(sum(local, []), sum(direct, [])):
        assert crossed.keys() == expected.keys()
        assert not any(name.endswith("_extra_state") for name in crossed)
        assert all(torch.equal(crossed[name], expected[name]) for name in expected)
    # and back: local -> HF -> TE reproduces the TE weights
    again = _shard_all(megatron_to_hf(local, model, "local"), model, tp, pp, "transformer_engine")
    for crossed, original in zip(sum(again, []), sum(te, [])):
        assert all(torch.equal(crossed[name], original[name]) for name in crossed)


def test_te_fused_norms_are_the_local_norms(hf_distinct_norms, model):
    te = hf_to_megatron(hf_distinct_norms, model, Layout(), "transformer_engine")
    local = hf_to_megatron(hf_distinct_norms, model, Layout(), "local")
    for layer in range(model.num_layers):
        prefix = f"decoder.layers.{layer}."
        assert torch.equal(
            te[prefix + "self_attention.linear_qkv.layer_norm_weight"],
            local[prefix + "input_layernorm.weight"],
        )
        assert torch.equal(
            te[prefix + "mlp.linear_fc1.layer_norm_weight"],
            local[prefix + "pre_mlp_layernorm.weight"],
        )
        assert torch.equal(
            local[prefix + "input_layernorm.weight"],
            hf_distinct_norms[f"model.layers.{layer}.input_layernorm.weight"],
        )
        assert torch.equal(
            local[prefix + "pre_mlp_layernorm.weight"],
            hf_distinct_norms[f"model.layers.{layer}.post_attention_layernorm.weight"],
        )
    shared = te.keys() & local.keys()
    assert te.keys() - shared == {
        f"decoder.layers.{i}.{suffix}"
        for i in range(model.num_layers)
        for suffix in (
            "self_attention.linear_qkv.layer_norm_weight",
            "mlp.linear_fc1.layer_norm_weight",
        )
    }
