"""Megatron Qwen3 logits vs. transformers' Qwen3ForCausalLM with the same weights.

Run in-process (one rank) by the tests, or under torchrun for TP/PP layouts:
``torchrun --nproc_per_node 2 tests/models/logits_parity.py parallel.tp=2``; rank 0 prints the
maximum absolute logit difference as JSON.
"""

from __future__ import annotations

import json
import sys

import torch

from nemo_orch import config as config_lib
from nemo_orch.models import qwen3, weights
from nemo_orch.models.hf_mapping import SeededHFWeights, hf_config_dict


def hf_reference(model, hf_weights):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    fields = {k: v for k, v in hf_config_dict(model).items()
              if k not in ("architectures", "model_type", "torch_dtype")}
    reference = Qwen3ForCausalLM(Qwen3Config(**fields)).eval()
    reference.load_state_dict(dict(hf_weights), strict=False)  # tied lm_head follows embeddings
    reference.tie_weights()
    return reference


def megatron_logits(module, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocabulary logits on the last pipeline stage (None on other stages); pp=1 only."""
    from megatron.core import tensor_parallel

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        logits = module(tokens, positions, None)
    return tensor_parallel.gather_from_tensor_model_parallel_region(logits)


def max_logit_difference(config, seed: int = 11) -> float | None:
    hf_weights = SeededHFWeights(config.model, seed)
    module = qwen3.build_model(config.model, config.parallel, pre_process=True, post_process=True)
    weights.load_hf_weights(module, hf_weights, config.model)
    tokens = torch.randint(0, config.model.vocab_size, (2, 48),
                           generator=torch.Generator().manual_seed(seed))
    ours = megatron_logits(module.eval(), tokens)
    if torch.distributed.get_rank() != 0:
        return None
    with torch.no_grad():
        theirs = hf_reference(config.model, hf_weights)(tokens).logits
    return float((ours - theirs).abs().max())


def main(overrides: list[str]) -> None:
    from nemo_orch import distributed

    config = config_lib.load(overrides)
    with distributed.parallel_session(config.parallel, config.run.seed):
        difference = max_logit_difference(config)
        if difference is not None:
            print(json.dumps({"max_abs_diff": difference}))


if __name__ == "__main__":
    main(sys.argv[1:])
