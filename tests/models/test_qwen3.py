"""The Megatron Qwen3 policy: builds from presets, matches transformers' Qwen3 logits."""

import pytest
import torch
from logits_parity import max_logit_difference

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError
from nemo_orch.models import qwen3


@pytest.mark.parametrize("tied", [False, True])
def test_logits_match_hf_qwen3(megatron_world, tied):
    config = config_lib.load([f"model.share_embeddings_and_output_weights={tied}"])
    assert max_logit_difference(config) < 1e-4


def test_parameter_count_matches_built_model(megatron_world):
    config = config_lib.load()
    module = qwen3.build_model(config.model, config.parallel, pre_process=True, post_process=True)
    assert sum(p.numel() for p in module.parameters()) == config.model.num_parameters()


def test_transformer_config_mirrors_qwen3(megatron_world):
    config = config_lib.load(["model=qwen3-8b", "model.transformer_impl=local"])
    tc = qwen3.transformer_config(config.model, config.parallel)
    assert (
        tc.num_layers,
        tc.hidden_size,
        tc.num_query_groups,
        tc.kv_channels,
        tc.ffn_hidden_size,
    ) == (36, 4096, 8, 128, 12288)
    assert tc.qk_layernorm and tc.gated_linear_unit and tc.normalization == "RMSNorm"
    assert not tc.add_bias_linear and tc.hidden_dropout == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU refusal")
@pytest.mark.parametrize(
    "override", ["model.transformer_impl=transformer_engine", "model.fp8=hybrid"]
)
def test_gpu_only_choices_fail_clearly_on_cpu(override):
    config = config_lib.load(["model.transformer_impl=transformer_engine", override])
    with pytest.raises(ConfigError, match="GPU"):
        qwen3.check_runtime(config.model)


@pytest.mark.parametrize("groups", [1, 2])
def test_fused_core_attention_equals_megatron_s_own(megatron_world, groups):
    """The CPU spec's SDPA core attention against Megatron's DotProductAttention on the same
    causal GQA inputs: outputs and gradients equal up to float rounding."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from nemo_orch.models.sdpa_attention import SDPAttention

    config = config_lib.load(["model.num_attention_heads=4", f"model.num_query_groups={groups}"])
    assert (
        qwen3.layer_spec(config.model).submodules.self_attention.submodules.core_attention
        is SDPAttention
    )
    tc = qwen3.transformer_config(config.model, config.parallel)
    generator = torch.Generator().manual_seed(0)
    heads, head_dim = tc.num_attention_heads, tc.kv_channels
    inputs = [
        torch.randn(24, 3, n, head_dim, generator=generator, requires_grad=True)
        for n in (heads, groups, groups)
    ]
    results = []
    for cls in (SDPAttention, DotProductAttention):
        attention = cls(
            tc, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )
        output = attention(*inputs, attention_mask=None)
        results.append((output, torch.autograd.grad(output.square().sum(), inputs)))
    (fused, fused_grads), (own, own_grads) = results
    assert fused.shape == own.shape == (24, 3, heads * head_dim)
    torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-5)
    for fused_grad, own_grad in zip(fused_grads, own_grads):
        torch.testing.assert_close(fused_grad, own_grad, rtol=1e-4, atol=1e-5)
