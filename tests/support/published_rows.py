"""tau2 ``Task`` rows as the published ToolScale parquet stores them (every nested object a
struct, one ``arguments`` struct merging every tool's arguments), for tests that write such
files."""

from __future__ import annotations

import pyarrow as pa


def published_schema(arguments: pa.StructType) -> pa.Schema:
    """The published layout's columns, its actions' ``arguments`` struct given."""
    action = pa.struct(
        [
            ("arguments", arguments),
            ("name", pa.string()),
            ("action_id", pa.string()),
            ("info", pa.string()),
            ("requestor", pa.string()),
        ]
    )
    instructions = pa.struct(
        [
            (key, pa.string())
            for key in (
                "task_instructions",
                "reason_for_call",
                "known_info",
                "unknown_info",
                "domain",
            )
        ]
    )
    return pa.schema(
        [
            ("id", pa.string()),
            (
                "description",
                pa.struct(
                    [
                        ("purpose", pa.string()),
                        ("relevant_policies", pa.null()),
                        ("notes", pa.null()),
                    ]
                ),
            ),
            ("user_scenario", pa.struct([("persona", pa.null()), ("instructions", instructions)])),
            ("initial_state", pa.null()),
            (
                "evaluation_criteria",
                pa.struct(
                    [
                        ("actions", pa.list_(action)),
                        ("communicate_info", pa.list_(pa.string())),
                        ("nl_assertions", pa.list_(pa.string())),
                        ("env_assertions", pa.null()),
                        ("reward_basis", pa.list_(pa.string())),
                    ]
                ),
            ),
        ]
    )
