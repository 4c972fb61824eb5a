from __future__ import annotations

import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest
from jinja2.exceptions import TemplateError
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from nemo_orch.config import CHAT_FORMATS
from nemo_orch.models.tokenizer import (
    CHAT_TEMPLATE,
    CHAT_TEMPLATES,
    CONTROL_TOKENS,
    MARKUP_TOKENS,
    SPECIAL_TOKENS,
    TokenizerError,
    copy_tokenizer,
    load_tokenizer,
    render_conversation,
    train_tokenizer,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3, and 4 + 5?"},
    {
        "role": "assistant",
        "content": "Adding both.",
        "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}},
            {"type": "function", "function": {"name": "add", "arguments": '{"a": 4, "b": 5}'}},
        ],
    },
    {"role": "tool", "content": "5"},
    {"role": "tool", "content": "9"},
    {"role": "assistant", "content": "<answer>5 and 9</answer>"},
]
TOOL_JSON = (
    '{"type": "function", "function": {"name": "add", "description": "Add two integers.", '
    '"parameters": {"type": "object", "properties": {"a": {"type": "integer"}, '
    '"b": {"type": "integer"}}, "required": ["a", "b"]}}}'
)
ASSISTANT_TURNS = [
    'Adding both.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 4, "b": 5}}\n</tool_call><|im_end|>',
    "<answer>5 and 9</answer><|im_end|>",
]
# Qwen3's rendering, without the empty think block it puts before the final answer.
EXPECTED = (
    "<|im_start|>system\nBe brief.\n\n# Tools\n\n"
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + TOOL_JSON
    + "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "<|im_start|>user\nWhat is 2 + 3, and 4 + 5?<|im_end|>\n"
    f"<|im_start|>assistant\n{ASSISTANT_TURNS[0]}\n"
    "<|im_start|>user\n<tool_response>\n5\n</tool_response>\n"
    "<tool_response>\n9\n</tool_response><|im_end|>\n"
    f"<|im_start|>assistant\n{ASSISTANT_TURNS[1]}\n"
)
_ASSISTANT_TURN_RE = re.compile(r"<\|im_start\|>assistant\n(.*?<\|im_end\|>)", re.DOTALL)


def _examples(conversations: list[dict[str, Any]]) -> list[tuple[list[dict], list[dict]]]:
    return [(MESSAGES, TOOLS)] + [(c["messages"], c["tools"]) for c in conversations[:40]]


def test_template_renders_tools_calls_and_grouped_responses() -> None:
    assert render_conversation(MESSAGES, TOOLS) == EXPECTED


def test_compact_format_lists_signatures_and_renders_the_rest_alike() -> None:
    tools = TOOLS + [
        {
            "name": "ask",
            "parameters": {
                "type": "object",
                "required": ["model"],
                "properties": {
                    "model": {"type": "string", "enum": ["small", "large"]},
                    "question": {"type": "string"},
                },
            },
        }
    ]
    compact = render_conversation(MESSAGES, tools, chat_format="compact")
    header = (
        "<|im_start|>system\nBe brief.\n\nTools:\nadd(a, b)\n"
        "ask(model: small|large, question?)<|im_end|>\n"
    )
    assert compact.startswith(header)
    # Everything after the system turn is the qwen3 rendering.
    user = "<|im_start|>user"
    assert compact[compact.index(user) :] == EXPECTED[EXPECTED.index(user) :]
    assert set(CHAT_TEMPLATES) == set(CHAT_FORMATS)


def test_template_without_tools_and_generation_prompt() -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}]
    assert render_conversation(messages, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_conversation(messages[1:]) == "<|im_start|>user\nHi<|im_end|>\n"


def test_template_rejects_unknown_role() -> None:
    with pytest.raises(TemplateError, match="unknown message role: critic"):
        render_conversation([{"role": "user", "content": "x"}, {"role": "critic", "content": "y"}])


def test_special_tokens_are_single_ids(tiny_tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [tiny_tokenizer.encode(token, add_special_tokens=False) for token in SPECIAL_TOKENS]
    assert all(len(i) == 1 for i in ids)
    assert len({i[0] for i in ids}) == len(SPECIAL_TOKENS)
    assert tiny_tokenizer.eos_token == "<|im_end|>"
    assert tiny_tokenizer.pad_token == "<|endoftext|>"
    # Markup survives decoding (tool calls are parsed from it); control tokens do not.
    text = "".join(SPECIAL_TOKENS)
    decoded = tiny_tokenizer.decode(tiny_tokenizer.encode(text), skip_special_tokens=True)
    assert decoded == "".join(MARKUP_TOKENS)
    assert all(token not in decoded for token in CONTROL_TOKENS)


def test_training_is_deterministic(
    offline_conversations: list[dict[str, Any]], tmp_path: Path
) -> None:
    texts = [render_conversation(c["messages"], c["tools"]) for c in offline_conversations]
    first = train_tokenizer(texts, vocab_size=600, min_frequency=2, out_dir=tmp_path / "a")
    second = train_tokenizer(texts, vocab_size=600, min_frequency=2, out_dir=tmp_path / "b")
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    assert len(first) == 600
    # The markup is split off before training, so no merge is spent on fragments of it.
    vocab = first.get_vocab()
    assert not [token for token in vocab if "<|" in token and token not in CONTROL_TOKENS]


def test_training_rejects_a_vocabulary_too_small(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="vocab_size=100"):
        train_tokenizer(["hello"], vocab_size=100, min_frequency=1, out_dir=tmp_path)


def test_assistant_mask_covers_exactly_the_assistant_turns(
    tiny_tokenizer: PreTrainedTokenizerBase, offline_conversations: list[dict[str, Any]]
) -> None:
    for messages, tools in _examples(offline_conversations):
        encoded = tiny_tokenizer.apply_chat_template(
            messages, tools=tools, return_dict=True, return_assistant_tokens_mask=True
        )
        runs = [
            tiny_tokenizer.decode([token for token, _ in run])
            for masked, run in itertools.groupby(
                zip(encoded["input_ids"], encoded["assistant_masks"]), key=lambda pair: pair[1]
            )
            if masked
        ]
        text = render_conversation(messages, tools)
        assert runs == _ASSISTANT_TURN_RE.findall(text)
    assert _ASSISTANT_TURN_RE.findall(EXPECTED) == ASSISTANT_TURNS


def test_per_segment_tokenization_equals_whole(
    tiny_tokenizer: PreTrainedTokenizerBase, offline_conversations: list[dict[str, Any]]
) -> None:
    """No token straddles a message or assistant-span boundary, so the mask is exact."""
    for messages, tools in _examples(offline_conversations):
        text = render_conversation(messages, tools)
        cuts = {0, len(text)} | {m.start() for m in re.finditer(re.escape("<|im_start|>"), text)}
        cuts |= {i for m in _ASSISTANT_TURN_RE.finditer(text) for i in m.span(1)}
        bounds = sorted(cuts)
        pieces = [text[start:end] for start, end in zip(bounds, bounds[1:])]
        per_piece = [t for p in pieces for t in tiny_tokenizer.encode(p, add_special_tokens=False)]
        assert per_piece == tiny_tokenizer.encode(text, add_special_tokens=False)


def test_save_and_load_roundtrip(
    offline_conversations: list[dict[str, Any]], tmp_path: Path
) -> None:
    texts = [render_conversation(c["messages"], c["tools"]) for c in offline_conversations[:50]]
    trained = train_tokenizer(texts, vocab_size=400, min_frequency=2, out_dir=tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = render_conversation(MESSAGES, TOOLS)
    assert loaded.encode(text) == trained.encode(text)
    assert loaded.chat_template == trained.chat_template == CHAT_TEMPLATE
    assert loaded.eos_token_id == trained.eos_token_id
    assert loaded.pad_token_id == trained.pad_token_id
    # A tokenizer saved with the compact format keeps it.
    train_tokenizer(
        texts, vocab_size=400, min_frequency=2, out_dir=tmp_path / "compact", chat_format="compact"
    )
    assert load_tokenizer(tmp_path / "compact").chat_template == CHAT_TEMPLATES["compact"]
    # One saved by an earlier version (another listing, the same markers) keeps its own: a
    # checkpoint is prompted as it was trained.
    earlier = CHAT_TEMPLATES["compact"].replace("'Tools:'", "'Tools (earlier):'")
    config = tmp_path / "compact" / "chat_template.jinja"
    config.write_text(earlier)
    assert load_tokenizer(tmp_path / "compact").chat_template == earlier


def test_copy_rewrites_a_transformers_5_layout_into_one_4x_loads(
    tiny_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """A tokenizer as transformers 5's save_pretrained left it in checkpoints trained before the
    portable layout (4.57 raises on it: an unknown class, a list where it reads a mapping), copied
    into the form transformers 4.34+ and 5.x read."""
    PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<think>"],
        chat_template=CHAT_TEMPLATE,
    ).save_pretrained(str(tmp_path / "v5"))
    saved = json.loads((tmp_path / "v5" / "tokenizer_config.json").read_text())
    assert saved["tokenizer_class"] == "TokenizersBackend" and saved["extra_special_tokens"]
    out = tmp_path / "out"
    out.mkdir()
    (out / "chat_template.jinja").write_text("{{ 'a stale template' }}")

    copy_tokenizer(tmp_path / "v5", out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    # 4.x's default adds token_type_ids, which Qwen3's forward (and so generate) rejects.
    assert config["model_input_names"] == ["input_ids", "attention_mask"]
    assert "extra_special_tokens" not in config
    assert config["additional_special_tokens"] == ["<think>"]
    assert config["chat_template"] == CHAT_TEMPLATE
    assert not (out / "chat_template.jinja").exists()
    copied, original = (AutoTokenizer.from_pretrained(str(d)) for d in (out, tmp_path / "v5"))
    assert copied.chat_template == original.chat_template
    assert copied.all_special_tokens == original.all_special_tokens
    text = render_conversation(MESSAGES, TOOLS)
    assert copied.encode(text) == original.encode(text)


def test_load_overrides_template_eos_and_pad(
    tiny_tokenizer: PreTrainedTokenizerBase, tmp_path: Path
) -> None:
    """Like a base Qwen3 directory: another template and eos=<|endoftext|>."""
    other = PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer.backend_tokenizer,
        eos_token="<|endoftext|>",
        chat_template="{{ messages[0].content }}",
    )
    other.save_pretrained(str(tmp_path))
    loaded = load_tokenizer(tmp_path)
    assert loaded.chat_template == CHAT_TEMPLATE
    assert (loaded.eos_token, loaded.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_load_missing_or_unreadable_directory(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=re.escape(str(tmp_path / "nope"))):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=re.escape(f"{tmp_path}: cannot load")):
        load_tokenizer(tmp_path)


def test_load_rejects_a_vocabulary_without_the_chat_tokens(tmp_path: Path) -> None:
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(["hello world"], trainers.BpeTrainer(show_progress=False))
    PreTrainedTokenizerFast(tokenizer_object=backend).save_pretrained(str(tmp_path))
    with pytest.raises(TokenizerError, match=re.escape("'<|endoftext|>' is not a single token")):
        load_tokenizer(tmp_path)
