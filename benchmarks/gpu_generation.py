"""Rollout generation throughput on one GPU: tokens/s at batch 1, 32 and 256.

What it measures: greedy generation of ``--new-tokens`` tokens (end-of-sequence ignored, so every
request generates exactly that many) after a random ``--prompt-len``-token prompt, for each
``--batch-sizes`` entry, with the first engine of this list whose library imports (or
``--engine``):

* ``trtllm``: the project's rollout engine ``nemo_orch.rollout.engines.trtllm.TRTLLMEngine``
  (TensorRT-LLM's ``LLM`` API, PyTorch backend, on the model's HF directory);
* ``vllm``: the project's ``nemo_orch.rollout.engines.vllm.VLLMEngine`` (sleep mode off);
* ``hf``: transformers' ``generate`` on CUDA in bfloat16. The project's CPU rollout engine
  (``nemo_orch.rollout.engines.hf.HFEngine``) is float32 and CPU-only (it takes no device), so
  this row measures transformers itself (dynamic KV cache, no compilation).

The two GPU engines go through the same ``Engine.generate`` seam rollouts use, so their numbers
include the per-token logprobs GRPO needs.

With ``--engine auto`` an engine that imports but fails to start (printed, with its traceback)
hands over to the next one, so one run on a fresh machine always yields numbers; the JSON and the
output name the engines that failed to start.

The model is ``--model`` (default ``qwen3-0.6b``: its ``conf/model/`` preset) with the project's
seeded initial weights (:class:`nemo_orch.models.hf_mapping.SeededHFWeights`; nothing is
downloaded), written once as an HF directory under ``--workdir`` in bfloat16, with a small BPE
tokenizer trained on the bundled offline conversations (the engines want one; prompts are token
ids and outputs are counted in tokens, so its size does not matter).

How to read the table: "tokens/s" is generated tokens (summed over the batch) / wall seconds of
the ``generate`` call, prefill included; "s" is that wall time. Engine start-up (loading, CUDA
graph capture, compilation) is timed separately, once, and is not in tokens/s. One untimed warm-up
call precedes the timed ones.

Run on a CUDA machine: ``python benchmarks/gpu_generation.py [--engine auto --batch-sizes 1 32 256
--prompt-len 128 --new-tokens 128 --json results.json]``. Without a CUDA GPU it exits with code 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

EXIT_NO_GPU = 2
ENGINES = ("trtllm", "vllm", "hf")
_MODULES = {"trtllm": "tensorrt_llm", "vllm": "vllm"}


@dataclass
class Row:
    engine: str
    batch_size: int
    seconds: float | None = None
    generated_tokens: int | None = None
    tokens_per_s: float | None = None
    error: str | None = None


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Generation tokens/s of a Qwen3-shaped policy on one CUDA GPU at several "
        "batch sizes, with TensorRT-LLM, vLLM or (neither installed) transformers. Exits 2 "
        "without a CUDA GPU."
    )
    parser.add_argument(
        "--engine",
        default="auto",
        choices=("auto", *ENGINES),
        help="auto: the first of trtllm, vllm, hf that imports",
    )
    parser.add_argument("--model", default="qwen3-0.6b", help="a conf/model preset")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--workdir",
        default=".gpu-check/generation",
        help="where the model's HF directory is written (reused when present)",
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    if min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.new_tokens < 1:
        parser.error("batch sizes, --prompt-len and --new-tokens must be >= 1")
    return args


def candidate_engines(requested: str) -> list[str]:
    """The engines to try, in order: the requested one, or every installed one then ``hf``."""
    if requested != "auto":
        return [requested]
    return [
        name for name in ("trtllm", "vllm") if importlib.util.find_spec(_MODULES[name]) is not None
    ] + ["hf"]


def model_config(preset: str):
    from nemo_orch import config as config_lib

    return config_lib.load([f"model={preset}"]).model


def hf_directory(model, workdir: Path) -> Path:
    """The model's seeded weights as a bfloat16 HF directory, with a tokenizer (written on first
    use)."""
    from nemo_orch.envs.offline.generator import generate_conversations
    from nemo_orch.models.hf_mapping import SeededHFWeights, save_hf_checkpoint
    from nemo_orch.models.tokenizer import render_conversation, train_tokenizer

    directory = workdir / f"{model.preset}-seeded"
    if not (directory / "model.safetensors").exists():
        save_hf_checkpoint(directory, SeededHFWeights(model, seed=0), model, dtype=torch.bfloat16)
    if not (directory / "tokenizer.json").exists():
        texts = (
            render_conversation(c["messages"], c["tools"])
            for c in generate_conversations(200, seed=0)
        )
        train_tokenizer(texts, vocab_size=1000, min_frequency=2, out_dir=directory)
    return directory


def prompts(batch_size: int, length: int, vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(batch_size)
    return torch.randint(0, vocab_size, (batch_size, length), generator=generator).tolist()


class ProjectEngineRunner:
    """A project rollout engine (``Engine`` seam) with greedy sampling."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, batch: list[list[int]], new_tokens: int) -> int:
        from nemo_orch.rollout.engines.base import SamplingParams

        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
        return sum(len(generation.token_ids) for generation in self.engine.generate(batch, params))


def trtllm_runner(directory: Path, args: argparse.Namespace) -> ProjectEngineRunner:
    from nemo_orch.models.tokenizer import load_tokenizer
    from nemo_orch.rollout.engines.trtllm import TRTLLMEngine

    return ProjectEngineRunner(
        TRTLLMEngine(
            directory,
            load_tokenizer(directory),
            max_batch_size=max(args.batch_sizes),
            max_seq_len=args.prompt_len + args.new_tokens + 1,
        )
    )


def vllm_runner(directory: Path, args: argparse.Namespace) -> ProjectEngineRunner:
    from nemo_orch.models.tokenizer import load_tokenizer
    from nemo_orch.rollout.engines.vllm import VLLMEngine

    return ProjectEngineRunner(
        VLLMEngine(
            directory,
            load_tokenizer(directory),
            max_batch_size=max(args.batch_sizes),
            max_model_len=args.prompt_len + args.new_tokens + 1,
            sleep_mode=False,
        )
    )


class TransformersRunner:
    """transformers' own ``generate`` on CUDA (the project's HF engine is CPU-only)."""

    def __init__(self, directory: Path) -> None:
        from transformers import Qwen3ForCausalLM

        self.model = (
            Qwen3ForCausalLM.from_pretrained(str(directory))
            .to(device="cuda", dtype=torch.bfloat16)
            .eval()
        )

    @torch.no_grad()
    def generate(self, batch: list[list[int]], new_tokens: int) -> int:
        input_ids = torch.tensor(batch, device="cuda")
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        return int(output.shape[0] * (output.shape[1] - input_ids.shape[1]))


def start(engine: str, directory: Path, args: argparse.Namespace):
    if engine == "trtllm":
        return trtllm_runner(directory, args)
    if engine == "vllm":
        return vllm_runner(directory, args)
    return TransformersRunner(directory)


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_generation.py needs a CUDA GPU (none is visible); benchmarks/rollout.py "
            "measures the CPU rollout path",
            file=sys.stderr,
        )
        return EXIT_NO_GPU
    model = model_config(args.model)
    directory = hf_directory(model, Path(args.workdir))
    failed_to_start: dict[str, str] = {}
    for engine in candidate_engines(args.engine):
        try:
            started = time.perf_counter()
            runner = start(engine, directory, args)
            startup_s = time.perf_counter() - started
            runner.generate(prompts(1, args.prompt_len, model.vocab_size), 8)  # warm-up
            break
        except Exception as error:
            traceback.print_exc()
            failed_to_start[engine] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
            print(
                f"gpu_generation.py: engine {engine} failed to start: {failed_to_start[engine]}",
                file=sys.stderr,
            )
    else:
        return 1
    rows = []
    for batch_size in args.batch_sizes:
        row = Row(engine, batch_size)
        try:
            batch = prompts(batch_size, args.prompt_len, model.vocab_size)
            started = time.perf_counter()
            row.generated_tokens = runner.generate(batch, args.new_tokens)
            row.seconds = time.perf_counter() - started
            row.tokens_per_s = row.generated_tokens / row.seconds
        except Exception as error:  # e.g. out of memory at one batch size: keep the others
            traceback.print_exc()
            row.error = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
        rows.append(row)
    print(
        f"GPU: {torch.cuda.get_device_name()}; engine {engine} (start-up {startup_s:.1f} s); "
        f"model {args.model}, bf16, seeded weights; prompt {args.prompt_len} + "
        f"{args.new_tokens} new tokens, greedy, EOS ignored"
    )
    for name, reason in failed_to_start.items():
        print(f"engine {name} failed to start: {reason}")
    print()
    print("| engine | batch | s | generated tokens | tokens/s |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        if row.error:
            print(f"| {row.engine} | {row.batch_size} | failed: {row.error} | | |")
        else:
            print(
                f"| {row.engine} | {row.batch_size} | {row.seconds:.2f} | "
                f"{row.generated_tokens} | {row.tokens_per_s:,.0f} |"
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump(
                {
                    "benchmark": "gpu_generation",
                    "engine": engine,
                    "model": args.model,
                    "startup_s": startup_s,
                    "failed_to_start": failed_to_start,
                    "rows": [asdict(row) for row in rows],
                },
                out,
                indent=2,
            )
    return 1 if failed_to_start or any(row.error for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
