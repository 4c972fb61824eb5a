"""Checking tool-call arguments against a tool's JSON-schema ``parameters``.

One checker for training data and live calls, so a demonstration and a rollout agree on what a
valid call is. It is JSON Schema's own validator (``jsonschema``, the dialect the schema's
``$schema`` names, else 2020-12), so ``integer`` accepts ``50.0``, ``$ref``/``$defs``, ``anyOf``
and nested objects are checked as written, with two readings of what tool schemas mean:

- the arguments object is closed unless its schema says otherwise (``additionalProperties``):
  an undeclared argument is refused, as OpenAI's strict function calling refuses it;
- an argument whose ``default`` is ``null`` accepts ``null`` (how pydantic, and so tau2, writes
  an optional argument: ``{"type": "string", "default": null}``).

Its messages name the offending argument, since they become the policy's error observations.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jsonschema
from jsonschema.exceptions import ValidationError, best_match


class ToolSchemaError(ValueError):
    """A tool's ``parameters`` are not a valid JSON schema."""


def _nullable_defaults(schema: Any) -> Any:
    """``schema`` with every subschema whose ``default`` is null also accepting null."""
    if isinstance(schema, list):
        return [_nullable_defaults(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    rewritten = {key: _nullable_defaults(value) for key, value in schema.items()}
    if "default" in schema and schema["default"] is None:
        return {"anyOf": [rewritten, {"type": "null"}]}
    return rewritten


@functools.lru_cache(maxsize=1024)
def _validator(canonical: str) -> jsonschema.protocols.Validator:
    schema = _nullable_defaults(json.loads(canonical))
    schema.setdefault("additionalProperties", False)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as error:
        raise ToolSchemaError(f"not a valid JSON schema: {error.message}") from None
    return cls(schema)


def check_parameters(parameters: dict[str, Any]) -> None:
    """Raise :class:`ToolSchemaError` unless ``parameters`` is a valid JSON schema."""
    _validator(json.dumps(parameters, sort_keys=True))


def _where(error: ValidationError) -> str:
    """The argument an error is about, as a path: ``passengers[0].dob``."""
    where = ""
    for step in error.absolute_path:
        where += f"[{step}]" if isinstance(step, int) else f".{step}" if where else str(step)
    return where


_BOUNDS = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}


def _describe(error: ValidationError) -> list[str]:
    if error.validator in ("anyOf", "oneOf") and error.context:
        # e.g. an optional argument (its type or null): what the closest alternative says
        return _describe(best_match(error.context))
    if not error.absolute_path and error.validator == "required":
        present = error.instance if isinstance(error.instance, dict) else {}
        return [
            f"missing argument {name!r}" for name in error.validator_value if name not in present
        ]
    if not error.absolute_path and error.validator == "additionalProperties":
        declared = error.schema.get("properties", {})
        return [f"undeclared argument {name!r}" for name in error.instance if name not in declared]
    where = _where(error) or "arguments"
    if error.validator == "type":
        expected = error.validator_value
        listed = " or ".join(expected) if isinstance(expected, list) else expected
        return [f"argument {where!r} should be of type {listed}, got {error.instance!r}"]
    if error.validator == "enum":
        return [
            f"argument {where!r} must be one of {error.validator_value}, got {error.instance!r}"
        ]
    bound = _BOUNDS.get(str(error.validator))
    if bound is not None:
        return [
            f"argument {where!r} must be {bound} {error.validator_value}, got {error.instance!r}"
        ]
    return [f"argument {where!r}: {error.message}"]


def argument_errors(parameters: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """What is wrong with tool-call ``arguments`` under a JSON-schema ``parameters`` object
    (empty: nothing): the missing arguments first, then one problem per argument in the call's
    order (its type before its values, the shallowest first)."""
    validator = _validator(json.dumps(parameters, sort_keys=True))
    order = {name: index for index, name in enumerate(arguments)}
    found: dict[int, tuple[tuple[int, int, str], str]] = {}
    missing: dict[str, None] = {}  # jsonschema reports each missing name; ours lists them all
    for error in validator.iter_errors(arguments):
        if not error.absolute_path and error.validator == "required":
            missing.update(dict.fromkeys(_describe(error)))
        elif not error.absolute_path and error.validator == "additionalProperties":
            for name in error.instance:
                if name not in error.schema.get("properties", {}):
                    found[order[name]] = ((0, 0, ""), f"undeclared argument {name!r}")
        else:
            position = (
                order.get(error.absolute_path[0], len(order)) if error.absolute_path else len(order)
            )
            rank = (len(error.absolute_path), error.validator != "type", _where(error))
            message = _describe(error)[0]
            if position not in found or rank < found[position][0]:
                found[position] = (rank, message)
    return [*missing] + [message for _, (_, message) in sorted(found.items())]


def integral(parameters: dict[str, Any], arguments: dict[str, Any]) -> dict[str, Any]:
    """``arguments`` with each integral number of an ``integer`` argument an ``int``: JSON
    has one number type (``50.0`` is ``50``, which :func:`argument_errors` accepts), Python
    code that indexes or counts with it has two."""
    properties = parameters.get("properties", {})
    return {
        name: int(value)
        if (
            isinstance(value, float)
            and value.is_integer()
            and properties.get(name, {}).get("type") == "integer"
        )
        else value
        for name, value in arguments.items()
    }
