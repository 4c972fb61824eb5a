"""Checking tool-call arguments against a tool's JSON-schema ``parameters``.

One checker for training data and live calls, so a demonstration and a rollout agree on what a
valid call is. It covers the subset tool schemas use (types, required, undeclared, enums) and
names the offending field, since its messages become the policy's error observations.
"""

from __future__ import annotations

from typing import Any

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


def argument_errors(parameters: dict[str, Any], arguments: dict[str, Any]) -> list[str]:
    """What is wrong with tool-call ``arguments`` under a JSON-schema ``parameters`` object.

    Checks the subset tool schemas use: required and undeclared arguments, basic types, enums,
    numeric bounds.
    """
    properties = parameters.get("properties", {})
    required = parameters.get("required", [])
    errors = [f"missing argument {name!r}" for name in required if name not in arguments]
    for name, value in arguments.items():
        schema = properties.get(name)
        if schema is None:
            errors.append(f"undeclared argument {name!r}")
            continue
        expected = _JSON_TYPES.get(schema.get("type", ""))
        # bool is an int subclass in Python, but not a JSON integer or number.
        if expected is not None and (
            not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected)
        ):
            errors.append(f"argument {name!r} should be of type {schema['type']}, got {value!r}")
        elif "enum" in schema and value not in schema["enum"]:
            errors.append(f"argument {name!r} must be one of {schema['enum']}, got {value!r}")
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if "minimum" in schema and value < schema["minimum"]:
                errors.append(f"argument {name!r} must be >= {schema['minimum']}, got {value!r}")
            if "maximum" in schema and value > schema["maximum"]:
                errors.append(f"argument {name!r} must be <= {schema['maximum']}, got {value!r}")
    return errors
