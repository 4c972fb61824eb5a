"""The tokenizer and the chat format every stage (SFT, rollouts, RL) shares.

Conversations are rendered the Qwen3/Hermes way by :data:`CHAT_TEMPLATE`, so a locally trained
BPE tokenizer and a real Qwen3 one see the same text; the ``compact`` format differs only in how
the system turn lists the tools (signatures instead of JSON schemas), for small models trained
here. The template marks what the model must learn
(each assistant message's content, tool calls and closing ``<|im_end|>``) with
``{% generation %}``, which is what ``apply_chat_template(..., return_assistant_tokens_mask=True)``
turns into the loss mask.

Tokenizer directories the project writes (:func:`save_tokenizer`, :func:`copy_tokenizer`) load in
transformers 4.34 and later as well as in 5.x, as serving stacks pinned to 4.x read them.
"""

from __future__ import annotations

import json
import re
import shutil
import weakref
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
# Control tokens: skipped by ``decode(..., skip_special_tokens=True)``.
CONTROL_TOKENS = (PAD_TOKEN, "<|im_start|>", EOS_TOKEN)
# Markup the model writes and reads back; kept on decode (as in Qwen3) so tool calls can be parsed.
MARKUP_TOKENS = (
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)
SPECIAL_TOKENS = CONTROL_TOKENS + MARKUP_TOKENS

_TOKENIZER_CONFIG = "tokenizer_config.json"
# Where transformers >= 4.47 save the chat template, and then read it in preference to the
# ``chat_template`` key of the tokenizer config.
_CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The files of a fast tokenizer's directory that a copy carries (those that exist).
_TOKENIZER_FILES = ("tokenizer.json", "special_tokens_map.json")
# transformers 5 saves a tokenizer built on a ``tokenizers`` object under its class
# ``TokenizersBackend``, a name 4.x does not know. ``PreTrainedTokenizerFast`` is that class in
# 4.x and an alias of it in 5.x, and both load ``tokenizer.json`` as it is.
_V5_ONLY_TOKENIZER_CLASS, _PORTABLE_TOKENIZER_CLASS = "TokenizersBackend", "PreTrainedTokenizerFast"
# What Qwen3's forward takes. 4.x's PreTrainedTokenizerFast also returns token_type_ids by
# default, and ``model.generate(**tokenizer(text, return_tensors="pt"))`` then raises.
_MODEL_INPUT_NAMES = ["input_ids", "attention_mask"]

# Qwen2/Qwen3's pre-tokenization split (contractions, letter runs, single digits, punctuation,
# newlines, spaces), so a locally trained vocabulary segments text like the real one.
_PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPECIAL_TOKEN_RE = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))
_GENERATION_MARKER = re.compile(r"{%-?\s*generation\s*-?%}")
# A tag-like literal of a chat template's source (<|im_start|>, </tool_call>,
# <|start_header_id|>): no whitespace, quote, backslash or Jinja brace inside, so an expression
# such as ``a < b`` or ``'<' + x`` never reads as one.
_TEMPLATE_TAG = re.compile(r"""<[^<>\s'"\\{}]+>""")
# What :func:`escape_markup` puts after a control string's first character: invisible when read,
# and no tokenizer's added token or template tag contains it (checked).
ESCAPE_MARK = "\u200b"

# Qwen3's official template restricted to non-thinking conversations, with two changes: the
# final assistant turn gets no empty "<think>\n\n</think>\n\n" block (so every assistant turn,
# tool call or answer, starts right after the "<|im_start|>assistant\n" generation prompt), and
# an unknown role is an error instead of being dropped silently. How the system turn lists the
# tools is one of the listings below; the rest is shared.
_QWEN3_TOOLS_LISTING = r"""
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- '\n' + tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and "
        "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
        "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>" }}
"""
# One signature line per tool, ``name(arg, optional?, choice: a|b)``, a priced choice followed by
# its output price (``a $10``, USD per million tokens: what an expert call mostly costs), and no
# descriptions: for models trained from scratch, which learn what a tool does from its results,
# not from prose, and for which the JSON schemas would be most of every sequence.
_COMPACT_TOOLS_LISTING = r"""
    {{- 'Tools:' }}
    {%- for tool in tools %}
        {%- set function = tool.function or tool %}
        {%- set required = function.parameters.required or [] %}
        {{- '\n' + function.name + '(' }}
        {%- for name, schema in (function.parameters.properties or {}).items() %}
            {{- (', ' if not loop.first else '') + name + ('' if name in required else '?') }}
            {%- if schema.enum %}
                {{- ': ' }}
                {%- for choice in schema.enum %}
                    {{- ('|' if not loop.first else '') + choice | string }}
                    {%- if schema.prices and choice in schema.prices %}
                        {{- ' $' + '%g' | format(schema.prices[choice][1]) }}
                    {%- endif %}
                {%- endfor %}
            {%- endif %}
        {%- endfor %}
        {{- ')' }}
    {%- endfor %}
"""
_TEMPLATE_BODY = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
TOOLS_LISTING
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- generation %}
            {{- content }}
            {%- for tool_call in message.tool_calls or [] %}
                {%- if content or not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {%- set call = tool_call.function or tool_call %}
                {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
                {%- if call.arguments is string %}
                    {{- call.arguments }}
                {%- else %}
                    {{- call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
            {{- '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role != 'system' %}
        {{- raise_exception('unknown message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""
# Chat formats by name (``tokenizer.chat_format``): ``qwen3`` for real Qwen3 tokenizers, and the
# one a locally trained tokenizer is saved with.
CHAT_TEMPLATES = {
    "qwen3": _TEMPLATE_BODY.replace("TOOLS_LISTING", _QWEN3_TOOLS_LISTING.strip("\n")),
    "compact": _TEMPLATE_BODY.replace("TOOLS_LISTING", _COMPACT_TOOLS_LISTING.strip("\n")),
}
CHAT_TEMPLATE = CHAT_TEMPLATES["qwen3"]


class TokenizerError(ValueError):
    """A tokenizer directory that is missing, unreadable or lacks the chat format's tokens."""


def render_conversation(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = False,
    chat_format: str = "qwen3",
) -> str:
    """Render messages in a chat format of :data:`CHAT_TEMPLATES` without a tokenizer (e.g. to
    train one)."""
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=tools or None,
        chat_template=CHAT_TEMPLATES[chat_format],
        add_generation_prompt=add_generation_prompt,
    )
    return rendered[0]


def _split_special_tokens(texts: Iterable[str]) -> Iterator[str]:
    # The BPE trainer does not extract added tokens from its input, so the markup would otherwise
    # spend merges (and vocabulary) on pieces like "<|" and "<tool".
    for text in texts:
        yield from (piece for piece in _SPECIAL_TOKEN_RE.split(text) if piece)


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    min_frequency: int,
    out_dir: str | Path,
    chat_format: str = "qwen3",
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer on ``texts``, save it in HF format to ``out_dir`` with
    the chat template of ``chat_format``.

    Byte-level with Qwen's pre-tokenization, so any text encodes (no unknown token) and the same
    input always yields the same vocabulary. The special tokens take ids ``0..8``.
    """
    if vocab_size <= 256 + len(SPECIAL_TOKENS):
        raise TokenizerError(
            f"vocab_size={vocab_size} must exceed the 256 byte tokens plus "
            f"{len(SPECIAL_TOKENS)} special tokens"
        )
    backend = Tokenizer(models.BPE())
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    # Untrimmed offsets: the assistant mask is computed from character offsets.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_split_special_tokens(texts), trainer)
    # The trainer registers all its special tokens as control tokens; demote the markup ones.
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in MARKUP_TOKENS])

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATES[chat_format],
    )
    save_tokenizer(tokenizer, out_dir)
    return tokenizer


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, out_dir: str | Path) -> None:
    """``save_pretrained`` in the layout transformers 4.x and 5.x both load
    (:func:`_write_portable_config`)."""
    tokenizer.save_pretrained(str(out_dir))
    _write_portable_config(Path(out_dir), Path(out_dir))


def copy_tokenizer(source: str | Path, out: str | Path) -> None:
    """Copy the tokenizer of HF directory ``source`` into ``out``, in the layout transformers 4.x
    and 5.x both load, whichever version saved it (a checkpoint trained before this layout
    included)."""
    source, out = Path(source), Path(out)
    for name in _TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, out / name)
    _write_portable_config(source, out)


def _write_portable_config(source: Path, out: Path) -> None:
    """Write ``source``'s tokenizer config to ``out`` in a form transformers 4.34+ and 5.x read
    alike: a tokenizer class both know, the model's input names (5.x's default, not 4.x's), 5.x's
    list of extra special tokens as the ``additional_special_tokens`` both read (4.x takes
    ``extra_special_tokens`` for a mapping), and the chat template as the config's
    ``chat_template`` key (the only place before 4.47) and not also as a file."""
    config_path = source / _TOKENIZER_CONFIG
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    if config.get("tokenizer_class") == _V5_ONLY_TOKENIZER_CLASS:
        config["tokenizer_class"] = _PORTABLE_TOKENIZER_CLASS
    config["model_input_names"] = _MODEL_INPUT_NAMES
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    if (source / _CHAT_TEMPLATE_FILE).is_file():
        config["chat_template"] = (source / _CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    # Left beside the key, an earlier file (e.g. a previous export's) would be read instead.
    (out / _CHAT_TEMPLATE_FILE).unlink(missing_ok=True)
    (out / _TOKENIZER_CONFIG).write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """Load an HF tokenizer directory (ours or Qwen3's) set up for our chat format.

    A directory saved with a template that marks the assistant's tokens (``{% generation %}``:
    one of :data:`CHAT_TEMPLATES`, as this run or an earlier version of the project saved it)
    keeps it, so a checkpoint is always prompted as it was trained; any other (a base Qwen3 one)
    gets the ``qwen3`` format. ``eos=<|im_end|>`` and ``pad=<|endoftext|>`` are always set, so a
    base Qwen3 tokenizer (whose eos is ``<|endoftext|>``) and ours end turns and pad the same way.
    """
    path = Path(path)
    if not path.is_dir():
        raise TokenizerError(f"{path}: no such tokenizer directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as error:
        raise TokenizerError(f"{path}: cannot load the tokenizer: {error}") from error
    if not tokenizer.is_fast:
        raise TokenizerError(f"{path}: a fast (tokenizers) tokenizer is needed for assistant masks")
    for token in SPECIAL_TOKENS:
        if len(tokenizer.encode(token, add_special_tokens=False)) != 1:
            raise TokenizerError(f"{path}: {token!r} is not a single token in this vocabulary")
    if not _GENERATION_MARKER.search(tokenizer.chat_template or ""):
        tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.eos_token = EOS_TOKEN
    tokenizer.pad_token = PAD_TOKEN
    return tokenizer


@dataclass(frozen=True)
class SpecialTokenIds:
    """The ids generation stops, starts and pads with, in the roles Qwen3's ``config.json`` and
    ``generation_config.json`` give them."""

    end_of_turn: int  # <|im_end|>: the eos, where an assistant turn (and a generation) ends
    end_of_text: int  # <|endoftext|>: the pad and bos id, and a second stop


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> SpecialTokenIds:
    """The ids of ``tokenizer``'s vocabulary for :data:`EOS_TOKEN` and :data:`PAD_TOKEN`, the
    eos and pad :func:`load_tokenizer` sets on any tokenizer (a base Qwen3 one's own eos is
    ``<|endoftext|>``)."""
    return SpecialTokenIds(
        end_of_turn=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        end_of_text=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
    )


@dataclass(frozen=True)
class _Controls:
    """A tokenizer's control strings, the pattern :func:`escape_markup` breaks them with, and
    what they were derived from (``key``: recomputed when that changes)."""

    key: tuple[Any, ...]
    strings: tuple[str, ...]
    pattern: re.Pattern[str]


# Per tokenizer object, dropped with it (an id-keyed cache would outlive it and be reused).
_CONTROLS: weakref.WeakKeyDictionary[PreTrainedTokenizerBase, _Controls] = (
    weakref.WeakKeyDictionary()
)


def control_strings(tokenizer: PreTrainedTokenizerBase) -> tuple[str, ...]:
    """Every string that means something to ``tokenizer``'s chat format rather than being text,
    sorted: its special tokens, every added token (a project-trained tokenizer registers
    ``<|im_start|>`` as added but not special; Qwen3 adds ``<|vision_pad|>`` and the like), the
    project's :data:`SPECIAL_TOKENS` (``<think>`` included) and each tag-like literal its chat
    template writes (``<tools>``, or another template's ``<|start_header_id|>``).

    Whitespace-only and one-character added tokens (some code models add indentation runs) are
    text, not markup, and are left out: no character can be put inside one to break it."""
    return _controls(tokenizer).strings


def escape_markup(text: str, tokenizer: PreTrainedTokenizerBase) -> str:
    """``text`` (a tool output, a user reply, a document, a task's prompt) with every control
    string of ``tokenizer`` broken by an :data:`ESCAPE_MARK` after its first character, so it
    cannot open or close a turn or a tag once rendered; the text stays readable.

    One pass suffices: the mark goes into every occurrence, overlapping ones included (in
    ``<<|im_start|>``, after the second ``<``), and the result holds none. An occurrence in it
    without an inserted mark would be one of ``text``, which got a mark inside (every control
    string has two characters or more); one with a mark is impossible, as no control string
    contains the mark. Nor can one span a content and the template's literal beside it (a
    newline, ``<|im_end|>``) unless it holds a newline, or a ``<`` past its first character,
    as the chat formats' tags do not; ``check_template`` counts them every turn."""
    return _controls(tokenizer).pattern.sub(lambda match: match.group() + ESCAPE_MARK, text)


def _controls(tokenizer: PreTrainedTokenizerBase) -> _Controls:
    template = tokenizer.chat_template
    # A tokenizer may carry named templates (e.g. "default" and "tool_use"): all are read.
    sources = tuple(template.values()) if isinstance(template, dict) else (template or "",)
    key = (sources, len(tokenizer), tuple(tokenizer.all_special_tokens))
    cached = _CONTROLS.get(tokenizer)
    if cached is not None and cached.key == key:
        return cached
    candidates = {*tokenizer.all_special_tokens, *tokenizer.get_added_vocab(), *SPECIAL_TOKENS}
    for source in sources:
        candidates.update(_TEMPLATE_TAG.findall(source))
    strings = tuple(sorted(s for s in candidates if len(s) > 1 and not s.isspace()))
    marked = [s for s in strings if ESCAPE_MARK in s]
    if marked:
        raise TokenizerError(
            f"control strings {marked} contain the escape mark "
            f"{ESCAPE_MARK!r}: escaping could form new ones"
        )
    # One alternative per first character, the rest as a lookahead: the match consumes only
    # that character, so occurrences overlapping it are still found.
    rests: dict[str, set[str]] = defaultdict(set)
    for string in strings:
        rests[string[0]].add(string[1:])
    pattern = re.compile(
        "|".join(
            f"{re.escape(first)}(?={'|'.join(re.escape(rest) for rest in sorted(rests[first]))})"
            for first in sorted(rests)
        )
    )
    cached = _CONTROLS[tokenizer] = _Controls(key, strings, pattern)
    return cached
