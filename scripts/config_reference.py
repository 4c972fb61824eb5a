"""The configuration reference, generated from the config dataclasses: ``docs/configuration.md``.

``python scripts/config_reference.py`` walks the root :class:`nemo_orch.config.Config` and every
config dataclass nested in it and writes, per section (``run.*``, ``model.*``, ...), each key with
its type, its default and one line of meaning. ``--check`` writes nothing: it exits 1, naming the
keys, when the file is stale or a key has no meaning.

A key's meaning is stated once, in the code, and read from there:

1. the ``#`` comment directly above the field, or beside it, in the dataclass's source; else
2. the sentence of the class docstring that begins with the field's name as a literal (in double
   backticks, alone or starting one: ``name=false``), else the first sentence that mentions it so.

A field with neither is an error: add a comment above it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import json
import re
import sys
import tokenize
import types
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from omegaconf import MISSING

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "configuration.md"
REGENERATE = "python scripts/config_reference.py"
HEADER = f"""# Configuration reference

Every key of the configuration tree, by section: its type, its default and what it means. Set a
key on the command line (`nemo-orch train grpo.kl_coef=0.05`), in a group's YAML under
`nemo_orch/conf/`, or in a recipe; `nemo-orch <command> --print-config` prints the resolved
tree. A key is checked once, when the config is loaded (`nemo_orch/config/`): an unknown key or a
wrong type fails there, naming it.

This page is generated from the config dataclasses by `{REGENERATE}`. Each
meaning is the comment or docstring sentence that states it in `nemo_orch/config/`, which is
where to change it.
"""


@dataclass
class Key:
    path: str
    type: str
    default: str
    meaning: str


@dataclass
class Section:
    path: str
    summary: str
    keys: list[Key]


def describe(root: type, prefix: str = "") -> list[Section]:
    """The sections of a config dataclass and of every dataclass nested in it, depth first; a
    field that holds one dataclass is a section of its own, a list of them a key (the list) and
    a section (``key[].*``, one element's keys)."""
    sections: list[Section] = []
    _walk(root, _default_instance(root), prefix, _markdown(_first_sentence(root)), sections)
    return [section for section in sections if section.keys]


def _walk(cls: type, instance: Any, path: str, summary: str, sections: list[Section]) -> None:
    section = Section(path, summary, [])
    sections.append(section)
    hints = typing.get_type_hints(cls)
    meanings = field_meanings(cls)
    for item in dataclasses.fields(cls):
        key = f"{path}.{item.name}" if path else item.name
        value = _field_value(item, instance)
        nested = _dataclass_in(hints[item.name])
        # A dataclass that is there by default is a section alone; a list of them, or one that
        # is null by default, is also a key.
        holds_section = nested is not None and value is not None and not isinstance(value, list)
        if not holds_section:
            section.keys.append(
                Key(key, _type_name(item.type), _render_default(value), meanings.get(item.name, ""))
            )
        if nested is not None:
            # Its line: the comment on its field, else what its own class says first.
            summary = _markdown(_comment(cls, item.name) or _first_sentence(nested))
            _walk(
                nested,
                value if holds_section else _default_instance(nested),
                f"{key}[]" if isinstance(value, list) else key,
                summary,
                sections,
            )


def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field holds: itself, optional, or as a list's elements."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType, list):
        for argument in typing.get_args(hint):
            if dataclasses.is_dataclass(argument):
                return argument
    return None


def _default_instance(cls: type) -> Any:
    """An instance with the defaults, or None where a field is required."""
    try:
        return cls()
    except (TypeError, ValueError):  # no default, or omegaconf's MISSING failing a check
        return None


def _field_value(item: dataclasses.Field, instance: Any) -> Any:
    if instance is not None:
        return getattr(instance, item.name)
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


def _render_default(value: Any) -> str:
    if value is dataclasses.MISSING or value == MISSING:
        return "required"
    if value is None:
        return "`null`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def _type_name(annotation: Any) -> str:
    # Under `from __future__ import annotations` the type is the source's spelling: keep it.
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return f"`{text}`"


def field_meanings(cls: type) -> dict[str, str]:
    """Each field's meaning, for the fields that state one (see the module docstring)."""
    meanings = {}
    for item in dataclasses.fields(cls):
        owner = _declaring_class(cls, item.name)
        meaning = _comment(owner, item.name) or _sentence_about(
            item.name, _docstring_sentences(owner)
        )
        if meaning:
            meanings[item.name] = _markdown(meaning)
    return meanings


def _declaring_class(cls: type, name: str) -> type:
    """The class whose body declares the field (an inherited field's is a base class)."""
    return next(owner for owner in cls.__mro__ if name in inspect.get_annotations(owner))


@cache
def _parsed(cls: type) -> tuple[ast.ClassDef, dict[int, tuple[str, bool]]]:
    """The class's syntax tree and its comments by line: (text, whether alone on its line)."""
    lines, _ = inspect.getsourcelines(cls)
    indent = len(lines[0]) - len(lines[0].lstrip())
    source = "".join(line[indent:] if line.strip() else "\n" for line in lines)
    comments = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            alone = not token.line[: token.start[1]].strip()
            comments[token.start[0]] = (token.string.lstrip("#").strip(), alone)
    (class_node,) = ast.parse(source).body
    return class_node, comments


def _comment(cls: type, name: str) -> str:
    """The comment block directly above the field ``name`` of ``cls``, and the one beside it."""
    class_node, comments = _parsed(_declaring_class(cls, name))
    for node in class_node.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            above = []
            line = node.lineno - 1
            while line in comments and comments[line][1]:
                above.insert(0, comments[line][0])
                line -= 1
            beside = [
                text
                for number, (text, alone) in comments.items()
                if not alone and node.lineno <= number <= node.end_lineno
            ]
            return " ".join(above + beside)
    return ""


@cache
def _docstring_sentences(cls: type) -> tuple[str, ...]:
    """The sentences of the class's own docstring; paragraphs and list items end one."""
    docstring = ast.get_docstring(_parsed(cls)[0]) or ""
    sentences: list[str] = []
    for block in re.split(r"\n\s*\n|\n\s*[*-] ", docstring):
        text = " ".join(block.split())
        depth, start = 0, 0
        for index, char in enumerate(text):
            depth += char in "([{"
            depth -= char in ")]}"
            # A sentence ends at a period outside brackets, before a capital or a literal.
            following = text[index + 1 : index + 3]
            if (
                char == "."
                and depth <= 0
                and following[:1] == " "
                and (following[1:].isupper() or following[1:] == "`")
                and not text[: index + 1].endswith(("e.g.", "i.e."))
            ):
                sentences.append(text[start : index + 1])
                start = index + 2
        if text[start:].strip():
            sentences.append(text[start:])
    return tuple(sentences)


def _first_sentence(cls: type) -> str:
    sentences = _docstring_sentences(cls)
    return sentences[0] if sentences else ""


def _sentence_about(name: str, sentences: tuple[str, ...]) -> str:
    # ``name``, or a literal that starts with it: ``name=false``, ``name + i``.
    literal = re.compile(rf"``{re.escape(name)}(?![\w.])[^`]*``")
    mentions = [sentence for sentence in sentences if literal.search(sentence)]
    leading = [sentence for sentence in mentions if literal.match(sentence)]
    return (leading or mentions or [""])[0]


def _markdown(text: str) -> str:
    """reStructuredText roles and literals as Markdown, on one line."""
    text = re.sub(r":\w+:`~?([^`]+)`", lambda match: f"`{match[1].replace(' ', '')}`", text)
    return " ".join(text.replace("``", "`").split())


def _table_cell(text: str) -> str:
    """A pipe outside a code span would end the cell (inside one, Markdown keeps it)."""
    pieces = text.split("`")
    return "`".join(
        piece.replace("|", "\\|") if index % 2 == 0 else piece for index, piece in enumerate(pieces)
    )


def undocumented(sections: list[Section]) -> list[str]:
    """The keys without a line of meaning."""
    return [key.path for section in sections for key in section.keys if not key.meaning]


def render(sections: list[Section]) -> str:
    parts = [HEADER]
    for section in sections:
        parts.append(f"\n## `{section.path}.*`\n")
        if section.summary:
            parts.append(f"\n{section.summary}\n")
        parts.append("\n| key | type | default | meaning |\n|---|---|---|---|\n")
        first_with = {}
        for key in section.keys:
            # A sentence that explains several keys is written once, at the first of them.
            first = first_with.setdefault(key.meaning, key.path)
            meaning = _table_cell(key.meaning) if first == key.path else f"See `{first}`."
            parts.append(f"| `{key.path}` | {key.type} | {key.default} | {meaning} |\n")
    return "".join(parts)


def _rows_by_key(text: str) -> dict[str, str]:
    return {row[1]: row[0] for row in re.finditer(r"^\| `([^`]+)` \|.*$", text, re.MULTILINE)}


def problems(sections: list[Section], written: str) -> list[str]:
    """What is wrong with the reference as written: keys without a meaning, and the keys whose
    rows differ from the code's (added, removed or changed)."""
    found = [
        f"{path}: no line of meaning (add a comment above the field in nemo_orch/config/)"
        for path in undocumented(sections)
    ]
    expected = render(sections)
    if written != expected:
        new, old = _rows_by_key(expected), _rows_by_key(written)
        stale = sorted(key for key in new.keys() | old.keys() if new.get(key) != old.get(key))
        found.append(
            f"{REFERENCE} is stale ("
            + (", ".join(stale) if stale else "outside the key rows")
            + f"): run {REGENERATE}"
        )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing; exit 1 if the reference is stale or a key lacks a meaning",
    )
    arguments = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))  # run as a script, only scripts/ is on the path
    from nemo_orch.config import Config

    sections = describe(Config)
    if arguments.check:
        written = REFERENCE.read_text() if REFERENCE.exists() else ""
        found = problems(sections, written)
        for problem in found:
            print(problem, file=sys.stderr)
        return 1 if found else 0
    REFERENCE.write_text(render(sections))
    missing = undocumented(sections)
    for path in missing:
        print(f"{path}: no line of meaning", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
