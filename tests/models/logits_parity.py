"""Megatron Qwen3 vs. transformers' Qwen3ForCausalLM with the same weights, in any layout.

Run in-process (one rank) by the tests, or under torchrun for TP/PP layouts:
``torchrun --nproc_per_node 2 tests/models/logits_parity.py parallel.tp=2``; rank 0 prints JSON
with ``roundtrip_exact`` (HF -> sharded Megatron -> gathered HF is bit-exact) and, when pp=1,
``max_abs_diff`` (the largest logit difference).
"""

from __future__ import annotations

import json
import sys

import torch

from nemo_orch import config as config_lib
from nemo_orch.config import Config
from nemo_orch.models import qwen3, weights
from nemo_orch.models.hf_mapping import SeededHFWeights, build_hf_model


def hf_reference(model, hf_weights):
    reference = build_hf_model(model).eval()
    reference.load_state_dict(dict(hf_weights), strict=False)  # tied lm_head follows embeddings
    reference.tie_weights()
    return reference


def loaded_stage(config: Config, hf_weights) -> torch.nn.Module:
    """This rank's pipeline stage with the given HF weights loaded."""
    from megatron.core import parallel_state as ps

    module = qwen3.build_model(
        config.model,
        config.parallel,
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    weights.load_hf_weights(module, hf_weights, config.model)
    return module.eval()


def max_logit_difference(config: Config, seed: int = 11) -> float | None:
    """Largest |logit| difference on rank 0 (None elsewhere); needs pp=1."""
    from megatron.core import tensor_parallel

    hf_weights = SeededHFWeights(config.model, seed)
    module = loaded_stage(config, hf_weights)
    tokens = torch.randint(
        0, config.model.vocab_size, (2, 48), generator=torch.Generator().manual_seed(seed)
    )
    with torch.no_grad():
        ours = tensor_parallel.gather_from_tensor_model_parallel_region(
            module(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
        )
    if torch.distributed.get_rank() != 0:
        return None
    with torch.no_grad():
        theirs = hf_reference(config.model, hf_weights)(tokens).logits
    return float((ours - theirs).abs().max())


def roundtrip_is_exact(config: Config, seed: int = 11) -> bool | None:
    """HF -> this layout's shards -> gathered HF reproduces every tensor bit for bit (rank 0)."""
    hf_weights = SeededHFWeights(config.model, seed)
    gathered = weights.gather_hf_weights(
        loaded_stage(config, hf_weights), config.model, config.rollout.refit_bucket_mb
    )
    if gathered is None:
        return None
    return gathered.keys() == set(hf_weights) and all(
        torch.equal(gathered[name], hf_weights[name]) for name in hf_weights
    )


def main(overrides: list[str]) -> None:
    from nemo_orch import distributed

    config = config_lib.load(overrides)
    with distributed.parallel_session(config.parallel, config.run.seed):
        result = {"roundtrip_exact": roundtrip_is_exact(config)}
        if config.parallel.pp == 1:
            result["max_abs_diff"] = max_logit_difference(config)
        if torch.distributed.get_rank() == 0:
            print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
