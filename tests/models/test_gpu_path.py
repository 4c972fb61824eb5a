"""The GPU path, checked on CPU where it can be and on a GPU where it must.

CPU: FP8 config validation and its pass-through to megatron-core's ``TransformerConfig``;
distributed checkpoints crossing between the Transformer Engine and local layer specs (FP8
``_extra_state`` metadata present on one side only); ``export --format trtllm-engine`` (its
refusal without TensorRT-LLM or CUDA, the ``trtllm-build`` command line, and the whole flow with a
stand-in ``trtllm-build``); the GPU check script and benchmarks. GPU (``-m gpu``, skipped without
CUDA / Transformer Engine / trtllm-build): the policy training on CUDA in bf16 with megatron-core
alone, a TE checkpoint loaded into the local spec (and back) with matching logits, FP8 training
forward passes, and a real engine build.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.cli_helpers import run_cli

from nemo_orch import config as config_lib
from nemo_orch.config import ConfigError
from nemo_orch.models import checkpoint, convert, qwen3, trtllm, weights
from nemo_orch.models.hf_mapping import SeededHFWeights, megatron_to_hf

REPO = Path(__file__).resolve().parents[2]
NO_GPU = {"CUDA_VISIBLE_DEVICES": ""}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


# --- FP8 configuration ----------------------------------------------------------------------

TE_FP8 = ["model=qwen3-0.6b", "model.fp8=hybrid"]


@pytest.mark.parametrize(
    "overrides,named",
    [
        (["model.fp8=hybrid"], "model.fp8 requires model.transformer_impl=transformer_engine"),
        (["model.fp8_param=true"], "model.fp8_param requires model.fp8"),
        (["model.first_last_layers_bf16=true"], "model.first_last_layers_bf16 requires model.fp8"),
        (["model.fp8_wgrad=false"], "model.fp8_wgrad=false requires model.fp8"),
        ([*TE_FP8, "model.fp8_recipe=nvfp4"], "model.fp8_recipe must be"),
        ([*TE_FP8, "model.fp8_amax_compute_algo=mean"], "model.fp8_amax_compute_algo must be"),
        ([*TE_FP8, "model.fp8_amax_history_len=0"], "model.fp8_amax_history_len must be >= 1"),
        ([*TE_FP8, "model.fp8_margin=-1"], "model.fp8_margin must be >= 0"),
        (
            [*TE_FP8, "model.fp8_param=true", "model.params_dtype=float32"],
            "model.fp8_param requires model.params_dtype=bfloat16",
        ),
        (
            [*TE_FP8, "model.first_last_layers_bf16=true"],
            "not supported with model.fp8_recipe=delayed",
        ),
        (
            [
                *TE_FP8,
                "model.fp8_recipe=tensorwise",
                "model.first_last_layers_bf16=true",
                "model.num_layers_at_end_in_bf16=29",
            ],
            "model.num_layers_at_end_in_bf16 must be in",
        ),
        ([*TE_FP8, "model.hidden_size=1000"], "model.hidden_size to be a multiple of 16"),
        (
            [*TE_FP8, "model.num_attention_heads=8", "model.kv_channels=99"],
            "num_attention_heads \\* kv_channels to be a multiple",
        ),
    ],
)
def test_fp8_mistakes_name_the_key(overrides, named):
    with pytest.raises(ConfigError, match=named):
        config_lib.load(overrides)


def test_every_fp8_option_reaches_megatron():
    config = config_lib.load(
        [
            *TE_FP8,
            "model.fp8_recipe=tensorwise",
            "model.fp8_param=true",
            "model.fp8_wgrad=false",
            "model.fp8_margin=1",
            "model.fp8_amax_history_len=16",
            "model.fp8_amax_compute_algo=most_recent",
            "model.first_last_layers_bf16=true",
            "model.num_layers_at_start_in_bf16=2",
            "model.num_layers_at_end_in_bf16=3",
        ]
    )
    tc = qwen3.transformer_config(config.model, config.parallel)
    assert (
        tc.fp8,
        tc.fp8_recipe,
        tc.fp8_param,
        tc.fp8_wgrad,
        tc.fp8_margin,
        tc.fp8_amax_history_len,
        tc.fp8_amax_compute_algo,
    ) == ("hybrid", "tensorwise", True, False, 1, 16, "most_recent")
    assert (
        tc.first_last_layers_bf16,
        tc.num_layers_at_start_in_bf16,
        tc.num_layers_at_end_in_bf16,
    ) == (True, 2, 3)


def test_fp8_off_leaves_megatron_defaults():
    config = config_lib.load(["model=qwen3-0.6b", "model.transformer_impl=local"])
    tc = qwen3.transformer_config(config.model, config.parallel)
    assert tc.fp8 is None and not tc.fp8_param and not tc.first_last_layers_bf16


@pytest.mark.parametrize(
    "overrides,named",
    [
        (
            ["model.fp8_param=true", "parallel.use_distributed_optimizer=false"],
            "use_distributed_optimizer=true",
        ),
        (
            [
                "model.fp8_recipe=tensorwise",
                "model.first_last_layers_bf16=true",
                "parallel.pp=4",
                "model.num_layers_at_start_in_bf16=8",
            ],
            "exceeds the 7 layers of a pipeline stage",
        ),
    ],
)
def test_fp8_layout_mistakes_fail_before_megatron(overrides, named):
    config = config_lib.load([*TE_FP8, *overrides])
    with pytest.raises(ConfigError, match=named):
        qwen3.transformer_config(config.model, config.parallel)


@pytest.mark.parametrize(
    "capability,recipe,named",
    [
        ((8, 0), "delayed", "FP8-capable GPU"),
        ((9, 0), "mxfp8", "needs a Blackwell GPU"),
        ((9, 0), "tensorwise", None),
        ((10, 0), "mxfp8", None),
    ],
)
def test_fp8_recipes_need_their_gpu(monkeypatch, capability, recipe, named):
    """The decision on an imaginary GPU machine with Transformer Engine (both faked)."""
    config = config_lib.load([*TE_FP8, f"model.fp8_recipe={recipe}"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: capability)
    monkeypatch.setattr(qwen3.importlib.util, "find_spec", lambda name: object())
    if named is None:
        qwen3.check_runtime(config.model)
    else:
        with pytest.raises(ConfigError, match=named):
            qwen3.check_runtime(config.model)


# --- distributed checkpoints across the TE and local specs ----------------------------------

# What Transformer Engine stores as a module's ``_extra_state``: its pickled FP8 metadata.
TE_EXTRA_STATE = torch.frombuffer(bytearray(b"te-fp8-metadata"), dtype=torch.uint8)


def _seeded_local_module(config, seed: int):
    module = qwen3.build_model(config.model, config.parallel, pre_process=True, post_process=True)
    weights.load_hf_weights(module, SeededHFWeights(config.model, seed), config.model)
    return module


def _save(module, directory: Path, edit) -> checkpoint.Checkpoint:
    """A model-only dist checkpoint of ``module``'s sharded state after ``edit``."""
    from megatron.core import dist_checkpointing

    state = module.sharded_state_dict(metadata={"distrib_optim_sharding_type": "dp_reshardable"})
    dist_checkpointing.save({"model": edit(state)}, str(directory))
    return checkpoint.Checkpoint(path=directory, step=0, manifest={"contents": ["model"]})


def _as_written_by_te(state: dict) -> dict:
    """The state as the TE spec writes it: FP8 metadata in every ``_extra_state``, plus that of
    modules the local spec lacks (TE's RMSNorm for q/k layernorm)."""
    out = {}
    for name, value in state.items():
        if name.endswith("_extra_state"):
            value = dataclasses.replace(value, data=TE_EXTRA_STATE.clone())
            if "linear_proj" in name:
                out[name.replace("linear_proj", "q_layernorm")] = dataclasses.replace(
                    value, key=value.key.replace("linear_proj", "q_layernorm")
                )
        out[name] = value
    return out


def test_local_spec_already_writes_te_names(megatron_world):
    config = config_lib.load()
    module = qwen3.build_model(config.model, config.parallel, pre_process=True, post_process=True)
    keys = {value.key for value in module.sharded_state_dict().values()}
    assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in keys
    assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in keys
    assert not any(
        key.endswith(("input_layernorm.weight", "pre_mlp_layernorm.weight")) for key in keys
    )


def test_te_written_checkpoint_loads_into_the_local_spec(megatron_world, tmp_path):
    config = config_lib.load()
    source = _seeded_local_module(config, seed=1)
    ckpt = _save(source, tmp_path, _as_written_by_te)
    target = _seeded_local_module(config, seed=2)
    checkpoint.load(ckpt, target)
    expected, loaded = weights.parameter_state(source), weights.parameter_state(target)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


def test_checkpoint_without_extra_state_loads(megatron_world, tmp_path):
    """A model asking for ``_extra_state`` the checkpoint lacks (a TE model loading a local-spec
    checkpoint) keeps its own."""
    config = config_lib.load()
    source = _seeded_local_module(config, seed=1)
    ckpt = _save(
        source,
        tmp_path,
        lambda state: {
            name: value for name, value in state.items() if not name.endswith("_extra_state")
        },
    )
    target = _seeded_local_module(config, seed=2)
    checkpoint.load(ckpt, target)
    expected, loaded = weights.parameter_state(source), weights.parameter_state(target)
    assert all(torch.equal(loaded[name], expected[name]) for name in expected)


def test_checkpoint_missing_weights_is_refused_by_name(megatron_world, tmp_path):
    config = config_lib.load()
    ckpt = _save(
        _seeded_local_module(config, seed=1),
        tmp_path,
        lambda state: {
            name: value for name, value in state.items() if "linear_fc2.weight" not in name
        },
    )
    with pytest.raises(checkpoint.CheckpointError, match="linear_fc2.weight"):
        checkpoint.load(ckpt, _seeded_local_module(config, seed=2))


# --- export --format trtllm-engine ----------------------------------------------------------


@pytest.fixture
def config_only_checkpoint(tmp_path) -> Path:
    """A checkpoint directory with its manifest and config but no weights: enough to show that
    the engine export refuses before reading any."""
    step = tmp_path / "checkpoints" / "step_3"
    step.mkdir(parents=True)
    (step / checkpoint.CONFIG_FILE).write_text(config_lib.to_yaml(config_lib.load()))
    (step / checkpoint.MANIFEST).write_text(json.dumps({"step": 3, "contents": ["model"]}))
    return step


def test_engine_export_without_trtllm_or_cuda_fails_first(config_only_checkpoint, tmp_path):
    out = tmp_path / "engine-out"
    empty_path = tmp_path / "bin"
    empty_path.mkdir()
    result = run_cli(
        "export",
        "--format",
        "trtllm-engine",
        "--checkpoint",
        str(config_only_checkpoint),
        "--out",
        str(out),
        env={**NO_GPU, "PATH": str(empty_path)},
        expect=2,
    )
    error = result.stderr.strip()
    assert len(error.splitlines()) == 1 and "Traceback" not in result.stderr
    assert "trtllm-build" in error and "TensorRT-LLM" in error and "CUDA GPU" in error
    assert not out.exists()


def test_engine_requirements_name_only_what_is_missing(monkeypatch):
    monkeypatch.setattr(trtllm.shutil, "which", lambda name: f"/opt/bin/{name}")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="CUDA GPU") as refused:
        trtllm.engine_build_requirements()
    assert "on PATH" not in str(refused.value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert trtllm.engine_build_requirements() == "/opt/bin/trtllm-build"


def test_engine_options_belong_to_the_engine_format(config_only_checkpoint, tmp_path):
    result = run_cli(
        "export",
        "--format",
        "hf",
        "--max-seq-len",
        "512",
        "--checkpoint",
        str(config_only_checkpoint),
        "--out",
        str(tmp_path / "hf"),
        expect=2,
    )
    assert "--format trtllm-engine only" in result.stderr
    assert not (tmp_path / "hf").exists()


def test_engine_export_checks_max_seq_len_before_writing(
    config_only_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setattr(trtllm, "engine_build_requirements", lambda: "/opt/bin/trtllm-build")
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings"):
        convert.export_engine(str(config_only_checkpoint), str(tmp_path / "out"), max_seq_len=10**6)
    assert not (tmp_path / "out").exists()


def test_trtllm_build_command_line():
    command = trtllm.trtllm_build_command(
        "ck", "eng", max_batch_size=32, max_seq_len=4096, executable="/opt/bin/trtllm-build"
    )
    assert command == [
        "/opt/bin/trtllm-build",
        "--checkpoint_dir",
        "ck",
        "--output_dir",
        "eng",
        "--gemm_plugin",
        "auto",
        "--max_batch_size",
        "32",
        "--max_seq_len",
        "4096",
    ]
    parallel = trtllm.trtllm_build_command(
        Path("ck"), Path("eng"), max_batch_size=1, max_seq_len=8, workers=2
    )
    assert parallel[0] == "trtllm-build" and parallel[-2:] == ["--workers", "2"]
    with pytest.raises(ConfigError, match="max_batch_size must be >= 1"):
        trtllm.trtllm_build_command("ck", "eng", max_batch_size=0, max_seq_len=8)


FAKE_TRTLLM_BUILD = '''#!{python}
"""Stands in for trtllm-build: checks the checkpoint it is given, writes an "engine"."""
import json, sys
from pathlib import Path

args = sys.argv[1:]
options = dict(zip(args[::2], args[1::2]))
checkpoint = Path(options["--checkpoint_dir"])
assert (checkpoint / "config.json").is_file() and (checkpoint / "rank0.safetensors").is_file()
engine = Path(options["--output_dir"])
engine.mkdir(parents=True)
(engine / "rank0.engine").write_bytes(b"not an engine")
(engine / "config.json").write_text(json.dumps({{"argv": args}}))
'''

# The CLI with engine_build_requirements answering the stand-in's path (CPU machines have no
# CUDA, so the real check would refuse before the flow under test).
CLI_WITH_FAKE_REQUIREMENTS = """
import sys

from nemo_orch import cli
from nemo_orch.models import trtllm

trtllm.engine_build_requirements = lambda: sys.argv[1]
if __name__ == "__main__":
    sys.exit(cli.main(sys.argv[2:]))
"""


@pytest.mark.slow
def test_engine_export_flow_with_a_stand_in_trtllm_build(random_policy_dir, tmp_path):
    run_cli(
        "import",
        "--format",
        "hf",
        "--hf-dir",
        str(random_policy_dir),
        "--out",
        str(tmp_path / "imported"),
    )
    fake = tmp_path / "trtllm-build"
    fake.write_text(FAKE_TRTLLM_BUILD.format(python=sys.executable))
    fake.chmod(0o755)
    driver = tmp_path / "cli_driver.py"
    driver.write_text(CLI_WITH_FAKE_REQUIREMENTS)

    out = tmp_path / "engine-export"
    result = subprocess.run(
        [
            sys.executable,
            str(driver),
            str(fake),
            "export",
            "--format",
            "trtllm-engine",
            "--checkpoint",
            str(tmp_path / "imported" / "step_0"),
            "--out",
            str(out),
            "--max-batch-size",
            "4",
            "--max-seq-len",
            "256",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "built its engine in" in result.stdout
    argv = json.loads((out / "engine" / "config.json").read_text())["argv"]
    assert argv == [
        "--checkpoint_dir",
        str(out / "checkpoint"),
        "--output_dir",
        str(out / "engine"),
        "--gemm_plugin",
        "auto",
        "--max_batch_size",
        "4",
        "--max_seq_len",
        "256",
    ]
    assert (
        json.loads((out / "checkpoint" / "config.json").read_text())["architecture"]
        == "Qwen3ForCausalLM"
    )
    assert (out / "engine" / "tokenizer.json").is_file()
    manifest = json.loads((out / convert.EXPORT_MANIFEST).read_text())
    assert manifest["format"] == "trtllm-engine" and manifest["build_seconds"] >= 0
    assert manifest["max_seq_len"] == 256 and manifest["command"][0] == str(fake)


# --- the GPU check script and benchmarks ----------------------------------------------------


def test_gpu_check_script_parses():
    subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_check.sh")], check=True)


@pytest.mark.parametrize("script", ["gpu_train_step.py", "gpu_generation.py"])
def test_gpu_benchmarks_need_cuda(script):
    path = str(REPO / "benchmarks" / script)
    env = {**os.environ, **NO_GPU}
    helped = subprocess.run(
        [sys.executable, path, "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert helped.returncode == 0 and "CUDA" in helped.stdout
    result = subprocess.run(
        [sys.executable, path], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 2 and "needs a CUDA GPU" in result.stderr
    assert "Traceback" not in result.stderr


def test_gpu_tests_skip_cleanly_without_cuda():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-m",
            "gpu",
            "-p",
            "no:cacheprovider",
            str(Path(__file__)),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, **NO_GPU},
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert "skipped" in result.stdout and "error" not in result.stdout.lower()


# --- on a GPU -------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
def test_the_policy_trains_on_cuda_in_bf16_with_the_local_spec(megatron_world):
    """The Megatron policy as SFT and GRPO build it (DDP, distributed optimizer), on CUDA with
    megatron-core alone: it memorizes one batch."""
    from nemo_orch.train.policy import Policy

    config = config_lib.load(
        [
            "model.transformer_impl=local",
            "model.params_dtype=bfloat16",
            "trainer.optim.lr=1e-3",
            "trainer.optim.warmup_steps=0",
            "trainer.max_steps=100",
        ]
    )
    policy = Policy(config, megatron_world)
    assert all(p.is_cuda and p.dtype == torch.bfloat16 for p in policy.module.parameters())
    sequence = torch.randint(
        0, config.model.vocab_size, (4, 65), generator=torch.Generator().manual_seed(0)
    )
    batch = {
        "tokens": sequence[:, :-1],
        "labels": sequence[:, 1:],
        "loss_mask": torch.ones(4, 64),
        "position_ids": torch.arange(64).repeat(4, 1),
    }
    batch = {key: value.cuda() for key, value in batch.items()}
    results = [policy.train_step([batch]) for _ in range(12)]
    assert all(math.isfinite(r.loss) and math.isfinite(r.grad_norm) for r in results)
    assert results[-1].loss < results[0].loss - 0.5, [round(r.loss, 3) for r in results]


def _te_config(*overrides: str):
    pytest.importorskip("transformer_engine")
    return config_lib.load(
        ["model.transformer_impl=transformer_engine", "model.params_dtype=bfloat16", *overrides]
    )


def _logits(module, seed: int = 0) -> torch.Tensor:
    tokens = torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(seed))
    tokens = tokens.cuda()
    positions = torch.arange(tokens.shape[1], device="cuda").expand_as(tokens)
    with torch.no_grad():
        return module.eval()(tokens, positions, None).float()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("direction", ["te-to-local", "local-to-te"])
def test_checkpoints_cross_between_te_and_local_specs(megatron_world, tmp_path, direction):
    te_config = _te_config()
    local_config = config_lib.load(["model.transformer_impl=local", "model.params_dtype=bfloat16"])
    source_config, target_config = (
        (te_config, local_config) if direction == "te-to-local" else (local_config, te_config)
    )
    source = qwen3.build_model(
        source_config.model, source_config.parallel, pre_process=True, post_process=True
    )
    weights.load_hf_weights(source, SeededHFWeights(source_config.model, 1), source_config.model)
    saved = checkpoint.save(source_config, 0, source, directory=tmp_path)
    target = qwen3.build_model(
        target_config.model, target_config.parallel, pre_process=True, post_process=True
    )
    checkpoint.load(checkpoint.open_checkpoint(saved), target)
    hf_source = megatron_to_hf([[weights.parameter_state(source)]], source_config.model)
    hf_target = megatron_to_hf([[weights.parameter_state(target)]], target_config.model)
    assert all(torch.equal(hf_source[name], hf_target[name]) for name in hf_source)
    expected, got = _logits(source), _logits(target)
    # Different kernels (fused TE norm+GEMM, flash attention) in bf16: agreement to bf16 noise.
    assert (expected - got).abs().max() <= 2e-2 * max(1.0, float(expected.abs().max()))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
    reason="needs an FP8-capable GPU",
)
@pytest.mark.parametrize(
    "recipe,fp8_param", [("delayed", False), ("tensorwise", False), ("tensorwise", True)]
)
def test_fp8_forward_and_backward_track_bf16(megatron_world, recipe, fp8_param):
    from megatron.core.fp8_utils import is_float8tensor

    modules = {}
    for name, overrides in (
        ("bf16", []),
        (
            "fp8",
            [
                "model.fp8=hybrid",
                f"model.fp8_recipe={recipe}",
                f"model.fp8_param={str(fp8_param).lower()}",
            ],
        ),
    ):
        config = _te_config(*overrides)
        module = qwen3.build_model(
            config.model, config.parallel, pre_process=True, post_process=True
        )
        weights.load_hf_weights(module, SeededHFWeights(config.model, 3), config.model)
        modules[name] = module
    assert any(is_float8tensor(p) for p in modules["fp8"].parameters()) == fp8_param
    bf16, fp8 = _logits(modules["bf16"]), _logits(modules["fp8"])
    assert torch.isfinite(fp8).all()
    cosine = torch.nn.functional.cosine_similarity(bf16.flatten(), fp8.flatten(), dim=0)
    assert cosine > 0.98, f"FP8 logits drifted from bf16 (cosine {cosine:.4f})"
    tokens = torch.randint(0, 1000, (2, 64), device="cuda")
    positions = torch.arange(64, device="cuda").expand_as(tokens)
    loss = modules["fp8"].train()(tokens, positions, None, labels=tokens).float().mean()
    loss.backward()
    assert all(p.grad is None or torch.isfinite(p.grad).all() for p in modules["fp8"].parameters())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.skipif(
    shutil.which("trtllm-build") is None, reason="needs TensorRT-LLM's trtllm-build on PATH"
)
def test_trtllm_engine_builds(random_policy_dir, tmp_path):
    run_cli(
        "import",
        "--format",
        "hf",
        "--hf-dir",
        str(random_policy_dir),
        "--out",
        str(tmp_path / "imported"),
    )
    result = run_cli(
        "export",
        "--format",
        "trtllm-engine",
        "--checkpoint",
        str(tmp_path / "imported" / "step_0"),
        "--out",
        str(tmp_path / "out"),
        "--max-batch-size",
        "4",
        "--max-seq-len",
        "256",
    )
    assert "built its engine" in result.stdout
    assert (tmp_path / "out" / "engine" / "rank0.engine").is_file()
    assert (tmp_path / "out" / "engine" / "config.json").is_file()
