"""Two gloo processes in TP=2, PP=2 and DP=2 layouts reproduce one process: SFT's per-step losses
through the command line, GRPO steps' loss, grad norm and metrics, PPO's update (policy and
critic), each also with prefix-shared micro-batches, and the refit's weights."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from multiprocess.grpo_step import (
    OVERRIDES,
    rank_batches,
    synthetic_samples,
    training_results,
    with_prefix_sharing,
)
from support.cli_helpers import read_metrics, run_cli, small_sft_overrides

from nemo_orch import config as config_lib
from nemo_orch.distributed import free_port

pytestmark = [pytest.mark.dist, pytest.mark.slow]

LAYOUTS = ["parallel.tp=2", "parallel.pp=2", "parallel.dp=2"]
# A smaller model than small_sft_overrides' (the micro preset) with every conversation still fitting:
# each run is mostly start-up, the fewer steps' seconds the better.
SFT_OVERRIDES = [
    "trainer.max_steps=3",
    "model.num_layers=2",
    "model.hidden_size=128",
    "model.ffn_hidden_size=256",
    "model.kv_channels=32",
    "data.seq_length=512",
]


def sft_losses(tokenizer_dir: Path, output_dir: Path, name: str, *overrides: str) -> list[float]:
    run_cli(
        "sft", *small_sft_overrides(tokenizer_dir, output_dir, name), *SFT_OVERRIDES, *overrides
    )
    return [record["loss"] for record in read_metrics(output_dir / name)]


@pytest.fixture(scope="module")
def one_process_sft_losses(tiny_tokenizer_dir, tmp_path_factory) -> list[float]:
    return sft_losses(tiny_tokenizer_dir, tmp_path_factory.mktemp("runs"), "one")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sft_losses_match_one_process(one_process_sft_losses, tiny_tokenizer_dir, tmp_path, layout):
    losses = sft_losses(tiny_tokenizer_dir, tmp_path, "two", layout)
    assert len(losses) == 3
    assert losses == pytest.approx(one_process_sft_losses, abs=1e-4)


def test_grpo_steps_match_one_process(megatron_world):
    config = config_lib.load(OVERRIDES)
    # without PP, the micro-batches differ in length, as GRPO's do
    cut = rank_batches(synthetic_samples(config, step_credit=True), config, megatron_world)
    assert len({batch["tokens"].shape[1] for batch in cut}) > 1
    # GRPO's steps carry credit per call: advantages that change within a sequence
    assert any(
        len(set(row[mask > 0].tolist())) > 1
        for batch in cut
        for row, mask in zip(batch["advantages"], batch["loss_mask"])
    )
    expected = training_results(config, megatron_world)
    first = expected["steps"][0]
    # the batch exercises every branch of the loss, so agreement means something
    assert (
        min(first["clip_frac_low"], first["clip_frac_high"], first["clip_frac_dual"], first["kl"])
        > 0
    )
    # GRPO's update made two passes over every sample (in 2 mini-batches: 4 optimizer steps);
    # its token count includes the padding, which differs between layouts
    update = expected["update"]
    real_tokens = sum(len(sample.token_ids) - 1 for sample in synthetic_samples(config, 16))
    assert "skipped_update" not in update and update.pop("tokens") >= 2 * real_tokens
    # PPO's: the policy and the critic both stepped, the critic's loss and clip took part
    ppo_update = expected["ppo_update"]
    assert "skipped_update" not in ppo_update and ppo_update.pop("tokens") >= 2 * real_tokens
    assert (
        min(
            ppo_update["critic/value_loss"],
            ppo_update["critic/clip_frac"],
            ppo_update["critic/grad_norm"],
            ppo_update["grad_norm"],
        )
        > 0
    )
    # one launch for all layouts: starting two processes costs more than the steps
    launched = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node=2",
            "--nnodes=1",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            str(Path(__file__).with_name("grpo_step.py")),
            *LAYOUTS,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert launched.returncode == 0, launched.stderr[-5000:]
    results = json.loads(launched.stdout.strip().splitlines()[-1])
    # one process with its prefixes shared, then every layout without and with
    runs = {"grpo.prefix_sharing=on": training_results(with_prefix_sharing(config), megatron_world)}
    for layout in LAYOUTS:
        # the refit: a bucket for the embeddings, each layer and the head; exactly the weights
        # the pickled gather delivered, in the buckets and in an engine refitted from the stream
        assert results[layout]["refit"] == {"exact": True, "engine_exact": True, "buckets": 4}, (
            layout
        )
        runs[layout] = results[layout]
        runs[f"{layout} grpo.prefix_sharing=on"] = results[layout]["shared"]
    for run, got in runs.items():
        for step, want in zip(got["steps"], expected["steps"], strict=True):
            assert step.keys() == want.keys()
            assert step == pytest.approx(want, abs=1e-5), run
        for update in ("update", "ppo_update"):
            result = dict(got[update])
            assert result.pop("tokens") > 0 and result.pop("tokens_computed") > 0
            want = {k: v for k, v in expected[update].items() if k != "tokens_computed"}
            assert result.keys() == want.keys()
            assert result == pytest.approx(want, abs=1e-4), (run, update)
    # sharing computed fewer tokens than the samples hold
    shared = runs["grpo.prefix_sharing=on"]["update"]
    assert shared["tokens_computed"] < shared["tokens"]
