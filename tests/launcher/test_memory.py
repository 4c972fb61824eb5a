"""The memory estimator's formulas against numbers worked out by hand for a small Qwen3:
4 layers, hidden 64, 4 heads, 2 query groups of 16 channels, FFN 128, vocabulary 512, TP2."""

import dataclasses

import pytest

from nemo_orch import config as config_lib
from nemo_orch.config import (
    Config,
    GRPOConfig,
    LauncherConfig,
    ModelConfig,
    ParallelConfig,
    PPOConfig,
    RolloutConfig,
    TokenizerConfig,
    TrainerConfig,
)
from nemo_orch.launcher import memory
from nemo_orch.launcher.memory import GIB

MODEL = ModelConfig(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    kv_channels=16,
    ffn_hidden_size=128,
    vocab_size=512,
    params_dtype="bfloat16",
)
TP2_DP2 = ParallelConfig(tp=2, dp=2)
# Per layer, unsharded GEMMs: QKV 64 x (4 + 2*2) x 16 = 8192, output 4*16 x 64 = 4096,
# SwiGLU 3 x 64 x 128 = 24576: 36864, of which a TP2 rank holds 18432. Norms (replicated):
# 2 x 64 + q/k norms 2 x 16 = 160. Embedding and output layer: 512 x 64 / 2 = 16384 each, plus
# the final norm 64.
LAYER_SHARD = 18432 + 160
PARAMS_PER_GPU = 4 * LAYER_SHARD + 2 * 16384 + 64  # 107200


def test_parameter_share_by_hand():
    assert memory.layer_gemm_parameters(MODEL) == 36864
    share = memory.parameter_share(MODEL, TP2_DP2)
    assert share == memory.ParameterShare(total=PARAMS_PER_GPU, fp8_gemm=0)
    assert PARAMS_PER_GPU == 107200
    # PP2: 2 layers and one vocabulary table per stage (+ the final norm on the last)
    assert memory.parameter_share(MODEL, ParallelConfig(tp=2, pp=2)).total == (
        2 * LAYER_SHARD + 16384 + 64
    )
    # TP1 holds the whole model: the same count as ModelConfig.num_parameters()
    assert memory.parameter_share(MODEL, ParallelConfig()).total == MODEL.num_parameters()


def test_weights_gradients_and_optimizer_by_hand():
    estimate = memory.training_estimate(
        MODEL, TP2_DP2, seq_length=32, micro_batch_size=2, num_microbatches=1
    )
    assert estimate.weights == 107200 * 2  # bf16
    assert estimate.gradients == 107200 * 4  # fp32 grad buffers
    assert estimate.optimizer == 107200 * 12 // 2  # fp32 main + 2 Adam moments, over DP2
    fp32 = dataclasses.replace(MODEL, params_dtype="float32")
    no_sharding = ParallelConfig(tp=2, dp=2, use_distributed_optimizer=False)
    assert (
        memory.optimizer_bytes(fp32, no_sharding, memory.parameter_share(fp32, no_sharding))
        == 107200 * 8
    )  # the moments only, on every rank


# PPO's critic: the same layers and its own embedding (16384), the final norm (64) and a value
# head Linear(64, 1) replicated over TP (65) in place of the output layer.
CRITIC_PARAMS_PER_GPU = 4 * LAYER_SHARD + 16384 + 64 + 65  # 90881


def test_critic_parameter_share_by_hand():
    assert memory.parameter_share(MODEL, TP2_DP2, critic=True) == memory.ParameterShare(
        total=CRITIC_PARAMS_PER_GPU, fp8_gemm=0
    )
    assert CRITIC_PARAMS_PER_GPU == 90881
    # PP2: the first stage (embedding) outweighs the last (final norm + head)
    assert memory.parameter_share(MODEL, ParallelConfig(tp=2, pp=2), critic=True).total == (
        2 * LAYER_SHARD + 16384
    )
    # TP1: the policy's count, less the output layer, plus the head
    assert memory.parameter_share(MODEL, ParallelConfig(), critic=True).total == (
        MODEL.num_parameters() - 512 * 64 + 65
    )
    # Tied embeddings: the policy's output layer is its embedding; the critic's embedding is
    # its own all the same
    tied = dataclasses.replace(MODEL, share_embeddings_and_output_weights=True)
    assert memory.parameter_share(tied, TP2_DP2).total == 4 * LAYER_SHARD + 16384 + 64
    assert memory.parameter_share(tied, TP2_DP2, critic=True).total == CRITIC_PARAMS_PER_GPU


def test_critic_weights_gradients_and_optimizer_by_hand():
    critic = memory.training_estimate(
        MODEL, TP2_DP2, seq_length=32, micro_batch_size=2, num_microbatches=1, critic=True
    )
    assert critic.weights == 90881 * 2  # bf16, as the policy's
    assert critic.gradients == 90881 * 4  # fp32 grad buffers
    assert critic.optimizer == 90881 * 12 // 2  # its own Adam, distributed over DP2
    assert critic.runtime == 0  # the GPU's is counted once, with the policy
    fp8 = dataclasses.replace(
        MODEL,
        transformer_impl="transformer_engine",
        fp8="hybrid",
        fp8_recipe="tensorwise",
        first_last_layers_bf16=True,
    )
    assert memory.training_estimate(fp8, TP2_DP2, 32, 2, 1, critic=True).weights == (
        90881 * 2 + 2 * 18432
    )  # TE's FP8 copies of layers 2 and 3, as the policy's


def test_fp8_weights_by_hand():
    fp8 = dataclasses.replace(
        MODEL,
        transformer_impl="transformer_engine",
        fp8="hybrid",
        fp8_recipe="tensorwise",
        first_last_layers_bf16=True,
    )
    share = memory.parameter_share(fp8, TP2_DP2)
    assert share.fp8_gemm == 2 * 18432  # layers 2 and 3; the first and last stay BF16
    assert memory.weight_bytes(fp8, share) == 107200 * 2 + 36864  # + TE's FP8 copies
    fp8_param = dataclasses.replace(fp8, fp8_param=True)
    assert memory.weight_bytes(fp8_param, share) == (107200 - 36864) * 2 + 36864


# Activations of s=32 x b=2 = 64 tokens, TP2. Per token: the norms' and QKV/fc1 inputs 8h = 512
# (256 with sequence parallelism); over TP: the output GEMM's input 2q = 128, SwiGLU 4f + fc2
# 2f = 768: (128 + 768) / 2 = 448; core attention, fused or recomputed: the QKV output
# 2(q + 2kv) = 256 and Q, K after RoPE 2(q + kv) = 192: 448 / 2 = 224; unfused: Q and K, V
# expanded 6q = 384, the softmax 6as = 6 x 4 x 32 = 768 and the QKV output the QK norms keep,
# 256: 1408 / 2 = 704.
FUSED, UNFUSED = 64 * (512 + 448 + 224), 64 * (512 + 448 + 704)


@pytest.mark.parametrize(
    "impl,recompute,sp,per_layer",
    [
        ("transformer_engine", None, False, FUSED),
        ("transformer_engine", None, True, FUSED - 64 * 256),
        ("local", None, False, UNFUSED),
        ("local", "selective", False, FUSED),
        ("transformer_engine", "selective", True, FUSED - 64 * 256),
        ("local", "full", False, 64 * 2 * 64),  # the layer's input, 2h per token
        ("transformer_engine", "full", True, 64 * 2 * 64 / 2),
    ],
)
def test_layer_activations_by_hand(impl, recompute, sp, per_layer):
    model = dataclasses.replace(MODEL, recompute_granularity=recompute, transformer_impl=impl)
    parallel = ParallelConfig(tp=2, dp=2, sequence_parallel=sp)
    assert memory.layer_activation_bytes(model, parallel, 32, 2) == pytest.approx(per_layer)
    # Without QK norms, only the unfused attention lets the QKV output go
    without_qk_norms = dataclasses.replace(model, qk_layernorm=False)
    kept_qkv = 64 * 128 if impl == "local" and recompute is None else 0
    assert memory.layer_activation_bytes(without_qk_norms, parallel, 32, 2) == pytest.approx(
        per_layer - kept_qkv
    )


def test_activations_count_layers_in_flight_and_the_loss_peak():
    # The final norm's and output GEMM's inputs 4h = 256 per token, the logits 6v/t = 1536
    output = 64 * (256 + 6 * 512 / 2)
    model = dataclasses.replace(MODEL, transformer_impl="transformer_engine")
    assert memory.activation_bytes(model, TP2_DP2, 32, 2, num_microbatches=8) == (
        pytest.approx(4 * FUSED + output)
    )
    # PP2 with 1F1B: the first stage keeps 2 micro-batches of its 2 layers; with only one
    # micro-batch, one
    pp2 = ParallelConfig(tp=2, pp=2)
    assert memory.activation_bytes(model, pp2, 32, 2, 8) == pytest.approx(4 * FUSED + output)
    assert memory.activation_bytes(model, pp2, 32, 2, 1) == pytest.approx(2 * FUSED + output)
    # Full recompute: the layers' inputs, then the larger of the loss and one whole layer
    full = dataclasses.replace(model, recompute_granularity="full")
    assert memory.activation_bytes(full, TP2_DP2, 32, 2, 1) == pytest.approx(
        4 * 64 * 128 + max(output, FUSED)
    )
    # ... which, unfused at 4096 tokens (the softmax grows with the sequence), is the layer
    unfused = dataclasses.replace(MODEL, transformer_impl="local")
    whole_layer = memory.layer_activation_bytes(unfused, TP2_DP2, 4096, 1)
    assert whole_layer > 4096 * (256 + 1536)
    assert memory.activation_bytes(
        dataclasses.replace(unfused, recompute_granularity="full"), TP2_DP2, 4096, 1, 1
    ) == pytest.approx(4 * 4096 * 128 + whole_layer)


def test_critic_activations_have_the_value_head_in_place_of_the_logits():
    # The final norm's input 2h = 128 (64 with SP), the head's input gathered whole 2h = 128,
    # one value per token in bf16 and fp32: 6
    model = dataclasses.replace(MODEL, transformer_impl="transformer_engine")
    assert memory.activation_bytes(model, TP2_DP2, 32, 2, 8, critic=True) == pytest.approx(
        4 * FUSED + 64 * (128 + 128 + 6)
    )
    sp = ParallelConfig(tp=2, dp=2, sequence_parallel=True)
    assert memory.output_activation_bytes(model, sp, 64, critic=True) == 64 * (64 + 128 + 6)
    # Full recompute: the layers' inputs, then one whole layer, which outweighs the head
    full = dataclasses.replace(model, recompute_granularity="full")
    assert memory.activation_bytes(full, TP2_DP2, 32, 2, 1, critic=True) == pytest.approx(
        4 * 64 * 128 + FUSED
    )


def test_kv_cache_per_token_by_hand():
    # layers x 2 (K, V) x query groups / engine TP x channels x bytes
    assert memory.kv_bytes_per_token(MODEL, 2, "bfloat16") == 4 * 2 * 1 * 16 * 2
    assert memory.kv_bytes_per_token(MODEL, 1, "float32") == 4 * 2 * 2 * 16 * 4


def colocated(engine: str) -> Config:
    return Config(
        model=MODEL,
        parallel=TP2_DP2,
        tokenizer=TokenizerConfig(vocab_size=512),
        trainer=TrainerConfig(micro_batch_size=2, global_batch_size=8),
        rollout=RolloutConfig(engine=engine, engine_tp=2, gpu_memory_utilization=0.5),
    )


def test_trtllm_takes_its_share_of_the_memory_left_and_never_sleeps():
    config = colocated("trtllm")
    training = memory.training_estimate(MODEL, TP2_DP2, 32, 2, 1)
    gpu = 8 * GIB
    estimate = memory.with_colocated_engine(training, config, gpu)
    engine_weights = MODEL.num_parameters() * 2 // 2  # bf16 over engine TP2
    assert MODEL.num_parameters() == 213696 and estimate.engine_weights == engine_weights
    free = gpu - (214400 + 428800 + 643200) - 4 * GIB - engine_weights
    assert estimate.kv_cache == pytest.approx(0.5 * free)
    assert estimate.kv_tokens == int(0.5 * free // 256)  # 256 bytes a token (above)
    assert estimate.total == pytest.approx(
        training.resident + 4 * GIB + training.activations + engine_weights + 0.5 * free
    )


def test_vllm_takes_its_share_of_the_gpu_and_sleeps_while_training():
    config = colocated("vllm")
    training = memory.training_estimate(MODEL, TP2_DP2, 32, 2, 1)
    estimate = memory.with_colocated_engine(training, config, 8 * GIB)
    assert estimate.kv_cache == pytest.approx(0.5 * 8 * GIB - 213696)
    assert estimate.total == pytest.approx(training.resident + 4 * GIB + 0.5 * 8 * GIB)
    # not colocated, or the CPU engine: nothing of the engine on the training GPUs
    apart = dataclasses.replace(config, rollout=dataclasses.replace(config.rollout, colocate=False))
    assert memory.with_colocated_engine(training, apart, 8 * GIB) == training
    hf = dataclasses.replace(config, rollout=RolloutConfig())
    assert memory.with_colocated_engine(training, hf, 8 * GIB) == training


def test_ppo_counts_the_critic_beside_the_policy_and_the_engine():
    grpo = colocated("trtllm")
    ppo = dataclasses.replace(
        grpo, grpo=GRPOConfig(algo="ppo", ppo=PPOConfig(), dynamic_sampling=False)
    )
    gpu = 8 * GIB
    without, estimate = memory.grpo_estimate(grpo, gpu), memory.grpo_estimate(ppo, gpu)
    assert without.critic is None
    critic = estimate.critic
    assert critic.resident == 90881 * (2 + 4 + 6)
    assert estimate.resident == 107200 * (2 + 4 + 6) + critic.resident
    # TensorRT-LLM's KV cache takes half of what the critic leaves
    assert estimate.kv_cache == pytest.approx(without.kv_cache - 0.5 * critic.resident)
    # The policy and the critic train in turn: the larger activations count, the policy's
    assert 0 < critic.activations < estimate.activations == without.activations
    assert estimate.peak_activations == estimate.activations
    assert estimate.total == pytest.approx(
        estimate.resident
        + 4 * GIB
        + max(estimate.activations, estimate.refit)
        + estimate.engine_weights
        + estimate.kv_cache
    )


def test_the_refit_counts_a_bucket_received_and_assembled_or_the_largest_unit():
    """After the step, on the first rank: twice the bucket, or twice the largest unit moved
    whole (the 8B model's embeddings: 151,936 x 4,096 bf16), in place of the activations."""
    config = config_lib.load(["recipe=orchestrator-qwen3-8b-2n8g-tp4pp1-fp8"])
    embeddings = 151936 * 4096 * 2
    assert memory.refit_bytes(config) == 2 * embeddings  # above the 512 MiB bucket
    big = dataclasses.replace(
        config, rollout=dataclasses.replace(config.rollout, refit_bucket_mb=8192)
    )
    assert memory.refit_bytes(big) == 2 * 8192 * 2**20
    estimate = memory.grpo_estimate(big, 80 * GIB)
    assert estimate.refit == 16 * GIB > estimate.activations
    assert estimate.total == pytest.approx(
        estimate.resident + 4 * GIB + estimate.refit + estimate.engine_weights + estimate.kv_cache
    )


def test_a_packed_row_keeps_its_layers_once_beside_its_tree_mask():
    """A micro-batch of 2 x 32 tokens sharing a 24-token prompt packs into a row of 24 + 2 x 8
    = 40: the layers keep 40 tokens (1184 bytes each, fused, above), the tree mask 40 x 40
    booleans; the output layer still reads the 64 tokens of the samples."""
    model = dataclasses.replace(MODEL, transformer_impl="transformer_engine")
    output = 64 * (256 + 6 * 512 / 2)
    assert memory.activation_bytes(model, TP2_DP2, 32, 2, 8, packed_row=40) == pytest.approx(
        4 * 40 * 1184 + 40 * 40 + output
    )
    assert memory.tree_mask_bytes(ParallelConfig(tp=2, pp=2), 40, 8) == 2 * 1600  # 2 in flight
    # Full recompute: the layers' inputs on the row, then the larger of the loss and one
    # layer's whole activations on it
    full = dataclasses.replace(model, recompute_granularity="full")
    assert memory.activation_bytes(full, TP2_DP2, 32, 2, 8, packed_row=40) == pytest.approx(
        4 * 40 * 128 + 1600 + max(output, 40 * 1184)
    )


def grpo_config(**changes) -> Config:
    """Trajectories of 32 tokens (24 of prompt, 8 of reply) in groups of 4, over DP2."""
    settings = {"transformer_impl": "transformer_engine", "micro_batch_size": 2, **changes}
    return Config(
        model=dataclasses.replace(MODEL, transformer_impl=settings["transformer_impl"]),
        parallel=ParallelConfig(tp=2, dp=settings.get("dp", 2)),
        tokenizer=TokenizerConfig(vocab_size=512),
        trainer=TrainerConfig(micro_batch_size=2, global_batch_size=8),
        rollout=RolloutConfig(group_size=4, max_new_tokens=8, max_context_tokens=32),
        grpo=GRPOConfig(
            prompts_per_step=4,
            micro_batch_size=settings["micro_batch_size"],
            prefix_sharing=settings.get("prefix_sharing", "auto"),
        ),
        launcher=LauncherConfig(gpus_per_node=settings.get("gpus", 0)),
    )


def test_prefix_sharing_packs_a_groups_prompt_once_per_micro_batch():
    # Each of DP2's ranks holds 2 of a group's 4 samples (4 / (1 mini-batch x 2 ranks)).
    config = grpo_config()
    assert memory.group_samples_per_rank(config) == 2
    two = memory.prefix_sharing(config, 2)
    assert (two.prompt_tokens, two.reply_tokens, two.groups, two.row_tokens) == (24, 8, 1, 40)
    # 16 samples / (DP2 x 2) = 4 micro-batches a rank: as the unshared, the packed row of 40
    assert two.unshared_activations == memory.activation_bytes(config.model, TP2_DP2, 32, 2, 4)
    assert two.shared_activations == pytest.approx(
        two.unshared_activations - 4 * (64 - 40) * 1184 + 40 * 40
    )
    assert two.mask == 1600
    assert two.unavailable == "Transformer Engine's attention does not take the tree mask yet"
    # 4 samples hold 2 of each of 2 groups: 2 x 24 + 4 x 8 = 80 tokens in place of 4 x 32
    four = memory.prefix_sharing(config, 4)
    assert (four.groups, four.row_tokens) == (2, 80)


def test_which_micro_batch_sharing_is_counted_at_and_whether_it_applies():
    assert memory.sharing_micro_batch(grpo_config(micro_batch_size=4)) == 4
    # A micro-batch of 1 shares nothing: counted at a rank's 2 samples of a group instead
    assert memory.sharing_micro_batch(grpo_config(micro_batch_size=1)) == 2
    # DP4: a rank holds 1 sample of a group of 4, and nothing shares at any size
    assert memory.sharing_micro_batch(grpo_config(dp=4, micro_batch_size=1)) is None
    assert memory.sharing_unavailable(grpo_config(transformer_impl="local")) is None
    assert memory.sharing_unavailable(grpo_config(transformer_impl="local", gpus=8)) == (
        "the local spec's fused softmax on GPUs ignores the tree mask"
    )
    assert memory.sharing_unavailable(
        grpo_config(transformer_impl="local", prefix_sharing="off")
    ) == ("grpo.prefix_sharing=off")
