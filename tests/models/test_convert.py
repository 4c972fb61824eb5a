"""``nemo-orch export`` / ``import``: HF and TensorRT-LLM checkpoints, and bad checkpoints."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file
from support.cli_helpers import read_metrics, run_cli, run_cli_here, small_sft_overrides

from nemo_orch.models import checkpoint, convert, qwen3, trtllm
from nemo_orch.models.tokenizer import EOS_TOKEN, PAD_TOKEN, load_tokenizer

# Tokenizer classes that AutoTokenizer resolves in transformers 4.x and 5.x alike, for a directory
# with a tokenizer.json: 4.x's generic fast class (in 5.x an alias of TokenizersBackend) and
# Qwen's (4.x takes Qwen2TokenizerFast, 5.x strips the "Fast"). 5.x's own TokenizersBackend is
# not one: 4.x raises "Tokenizer class TokenizersBackend does not exist".
TOKENIZER_CLASSES_OF_BOTH_MAJOR_VERSIONS = (
    "PreTrainedTokenizerFast",
    "Qwen2Tokenizer",
    "Qwen2TokenizerFast",
)


@pytest.fixture(scope="module")
def trained(tiny_tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs")
    run_cli("sft", *small_sft_overrides(tiny_tokenizer_dir, out, "trained"), "trainer.max_steps=2")
    return out / "trained" / "checkpoints"


@pytest.fixture(scope="module")
def hf_export(trained, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    run_cli("export", "--format", "hf", "--checkpoint", str(trained), "--out", str(out))
    return out


def test_hf_export_loads_in_transformers_with_megatron_logits(megatron_world, trained, hf_export):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    ckpt = checkpoint.open_checkpoint(trained)
    config = convert.checkpoint_config(ckpt)
    module = qwen3.build_model(config.model, config.parallel, pre_process=True, post_process=True)
    checkpoint.load(ckpt, module)
    tokens = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = module.eval()(tokens, torch.arange(40).expand_as(tokens), None)
        theirs = Qwen3ForCausalLM.from_pretrained(hf_export).eval()(tokens).logits
    assert (ours - theirs).abs().max() < 1e-4
    assert AutoTokenizer.from_pretrained(hf_export).convert_tokens_to_ids("<tool_call>") > 0


def test_hf_export_generate_stops_at_im_end(hf_export):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_export)
    model = AutoModelForCausalLM.from_pretrained(hf_export).eval()
    im_end = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    # An LM head that predicts <|im_end|> whatever the input: greedy decoding emits it first, and
    # goes on emitting it unless the generation config says it ends the generation.
    with torch.no_grad():
        model.lm_head.weight.zero_()
    model.lm_head.bias = torch.nn.Parameter(
        torch.nn.functional.one_hot(torch.tensor(im_end), model.config.vocab_size).float()
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}],
        add_generation_prompt=True,
        return_dict=True,
        return_tensors="pt",
    )
    output = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    assert output[0, prompt["input_ids"].shape[1] :].tolist() == [im_end]


def test_hf_export_names_the_tokenizers_special_tokens(hf_export, tiny_tokenizer_dir):
    from transformers import GenerationConfig

    tokenizer = load_tokenizer(tiny_tokenizer_dir)
    im_end, end_of_text = tokenizer.convert_tokens_to_ids([EOS_TOKEN, PAD_TOKEN])
    config = json.loads((hf_export / "config.json").read_text())
    # As Qwen3's config.json: no pad_token_id (transformers would freeze its embedding row).
    assert (config["bos_token_id"], config["eos_token_id"]) == (end_of_text, im_end)
    assert "pad_token_id" not in config
    generation = GenerationConfig.from_pretrained(hf_export)
    assert generation.eos_token_id == [im_end, end_of_text]
    assert (generation.bos_token_id, generation.pad_token_id) == (end_of_text, end_of_text)


def test_hf_export_tokenizer_config_loads_in_both_transformers_major_versions(
    hf_export, tiny_tokenizer_dir
):
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    config = json.loads((hf_export / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] in TOKENIZER_CLASSES_OF_BOTH_MAJOR_VERSIONS
    assert tokenizer_class_from_name(config["tokenizer_class"]) is not None
    # The template where every version reads it (a chat_template.jinja would take precedence
    # from 4.47 on, and transformers before that do not read it).
    assert not (hf_export / "chat_template.jinja").exists()
    exported = AutoTokenizer.from_pretrained(hf_export)
    assert exported.is_fast and exported.chat_template == config["chat_template"]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "search",
                "parameters": {
                    "type": "object",
                    "properties": {"q": {"type": "string"}},
                    "required": ["q"],
                },
            },
        }
    ]
    messages = [{"role": "user", "content": "Find <tool_call> docs"}]
    assert (
        exported.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, return_dict=True
        )["input_ids"]
        == load_tokenizer(tiny_tokenizer_dir).apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )


def test_hf_export_without_a_tokenizer_warns_and_names_no_token_ids(trained, tmp_path, caplog):
    bare = tmp_path / "step_2"
    shutil.copytree(trained / "step_2", bare, ignore=shutil.ignore_patterns("tokenizer"))
    out = tmp_path / "hf"
    convert.export(str(bare), "hf", str(out))  # the tokenizer.path the checkpoint was saved with
    assert (out / "generation_config.json").exists()
    # As a checkpoint imported from an HF directory without a tokenizer was saved.
    convert.export(
        str(bare), "hf", str(out), overrides=["tokenizer.path=null", "tokenizer.vocab_size=1000"]
    )
    assert "has no tokenizer and tokenizer.path is not set" in caplog.text
    assert "eos_token_id" not in json.loads((out / "config.json").read_text())
    assert not (out / "generation_config.json").exists()  # the first export's, removed


def test_hf_export_past_max_shard_size_is_sharded_as_hf_does(trained, hf_export, tmp_path):
    from transformers import Qwen3ForCausalLM

    out = tmp_path / "sharded"
    shutil.copytree(hf_export, out)  # a previous single-file export there must not survive
    run_cli(
        "export",
        "--format",
        "hf",
        "--checkpoint",
        str(trained),
        "--out",
        str(out),
        "--max-shard-size",
        "300KB",
    )
    files = sorted(out.glob("*.safetensors"))
    shards = {file.name: load_file(str(file)) for file in files}
    assert len(files) > 2 and all(
        f.name.endswith(f"-of-{len(files):05d}.safetensors") for f in files
    )
    # A tensor starts a new shard rather than push one past the limit; larger ones go alone.
    assert all(
        len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 300_000
        for part in shards.values()
    )
    whole = load_file(str(hf_export / "model.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {name: file for file, part in shards.items() for name in part}
    assert sorted(index["weight_map"]) == sorted(whole)  # every tensor in exactly one file
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in whole.values()
    )
    assert all(torch.equal(shards[index["weight_map"][name]][name], whole[name]) for name in whole)
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    tokens = torch.randint(0, 1000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        sharded = Qwen3ForCausalLM.from_pretrained(out).eval()(tokens).logits
        single = Qwen3ForCausalLM.from_pretrained(hf_export).eval()(tokens).logits
    assert torch.equal(sharded, single)


def test_hf_export_reads_the_checkpoint_a_layer_at_a_time(trained):
    ckpt = checkpoint.open_checkpoint(trained)
    model = convert.checkpoint_config(ckpt).model
    layers = [
        {name.split(".")[2] for name in group if name.startswith("model.layers.")}
        for group in convert.hf_weight_groups(ckpt, model)
    ]
    assert layers == [set()] + [{str(layer)} for layer in range(model.num_layers)]


def test_max_shard_size_is_checked(trained, tmp_path):
    for fmt, size, message in (
        ("hf", "5 parsecs", "'5 parsecs'"),
        ("trtllm", "1GB", "applies to --format hf only"),
    ):
        result = run_cli_here(
            "export",
            "--format",
            fmt,
            "--checkpoint",
            str(trained),
            "--out",
            str(tmp_path),
            "--max-shard-size",
            size,
            expect=2,
        )
        assert message in result.stderr
    assert not any(tmp_path.iterdir())


def test_trtllm_export_shards_reassemble_to_the_hf_export(trained, hf_export, tmp_path):
    run_cli(
        "export",
        "--format",
        "trtllm",
        "--tp",
        "2",
        "--checkpoint",
        str(trained),
        "--out",
        str(tmp_path),
    )
    config, shards = trtllm.load_trtllm_checkpoint(tmp_path)
    assert config["mapping"]["world_size"] == 2 and (tmp_path / "tokenizer.json").exists()
    model = convert.checkpoint_config(checkpoint.open_checkpoint(trained)).model
    reassembled = trtllm.trtllm_shards_to_hf(shards, model)
    expected = load_file(str(hf_export / "model.safetensors"))
    assert reassembled.keys() == expected.keys()
    assert all(torch.equal(reassembled[k], expected[k]) for k in expected)


def test_import_round_trips_and_both_init_paths_agree(hf_export, tiny_tokenizer_dir, tmp_path):
    imported = tmp_path / "imported"
    run_cli("import", "--format", "hf", "--hf-dir", str(hf_export), "--out", str(imported))
    # The checkpoint keeps the HF directory's tokenizer, not its weights too.
    kept = sorted(path.name for path in (imported / "step_0" / "tokenizer").iterdir())
    assert kept == ["tokenizer.json", "tokenizer_config.json"]
    run_cli(
        "export",
        "--format",
        "hf",
        "--checkpoint",
        str(imported / "step_0"),
        "--out",
        str(tmp_path / "again"),
    )
    before = load_file(str(hf_export / "model.safetensors"))
    after = load_file(str(tmp_path / "again" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in before)
    first_losses = []
    for name, source in (("from-hf", hf_export), ("from-import", imported / "step_0")):
        run_cli(
            "sft",
            *small_sft_overrides(tiny_tokenizer_dir, tmp_path, name),
            "trainer.max_steps=1",
            f"trainer.init_from={source}",
        )
        first_losses.append(read_metrics(tmp_path / name)[0]["loss"])
    assert first_losses[0] == first_losses[1]


def test_missing_checkpoint_is_named(tmp_path):
    result = run_cli(
        "export",
        "--format",
        "hf",
        "--checkpoint",
        str(tmp_path / "nope"),
        "--out",
        str(tmp_path / "out"),
        expect=2,
    )
    assert str(tmp_path / "nope") in result.stderr and "Traceback" not in result.stderr


def test_partial_checkpoints_are_never_picked(trained, tmp_path):
    partial = tmp_path / "checkpoints" / ".step_9.partial"
    shutil.copytree(trained / "step_2", partial)
    with pytest.raises(checkpoint.CheckpointError, match="no complete checkpoint"):
        checkpoint.open_checkpoint(tmp_path / "checkpoints")


def test_a_checkpoint_written_again_has_another_identity(trained, tmp_path):
    """The evaluation cache names weights by checkpoint.identity: a run trained again into
    the same step directory must not pass for the weights cached before."""
    copied = tmp_path / "checkpoints" / "step_2"
    shutil.copytree(trained / "step_2", copied)
    before = checkpoint.identity(tmp_path / "checkpoints")
    assert before == checkpoint.identity(copied) and str(copied.resolve()) in before
    manifest = copied / checkpoint.MANIFEST
    manifest.write_text(manifest.read_text())  # rewritten, as a save rewrites it last
    os.utime(manifest, ns=(manifest.stat().st_atime_ns, manifest.stat().st_mtime_ns + 1))
    assert checkpoint.identity(copied) != before


def test_corrupt_checkpoints_fail_naming_the_path(trained, tmp_path):
    broken = tmp_path / "step_2"
    shutil.copytree(trained / "step_2", broken)
    (broken / "nemo_orch.json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match="step_2"):
        checkpoint.open_checkpoint(broken)
    shutil.copy2(trained / "step_2" / "nemo_orch.json", broken / "nemo_orch.json")
    for shard in broken.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    result = run_cli(
        "export",
        "--format",
        "hf",
        "--checkpoint",
        str(broken),
        "--out",
        str(tmp_path / "out"),
        expect=2,
    )
    assert "cannot load checkpoint" in result.stderr and str(broken) in result.stderr
