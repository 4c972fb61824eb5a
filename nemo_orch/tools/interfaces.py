"""The tool interfaces an orchestrator is offered, by their tools' names: ToolOrchestra's
composites (``search``, ``enhance_reasoning``, ``answer``, each taking a ``model`` alias: a
writer of that alias writes the query, the program or the answer, and ``answer`` ends the
episode), and the basic interface's expert tool (``call_expert``: hand the question to one
model). Simulated experts (the offline world) and served ones (``tools=experts``,
``tools=reference``) sit behind the same names."""

from __future__ import annotations

from collections.abc import Iterable

SEARCH, REASON, ANSWER = "search", "enhance_reasoning", "answer"
ORCHESTRA_TOOLS = (SEARCH, REASON, ANSWER)
EXPERT_TOOL = "call_expert"


def offers_orchestra(tool_names: Iterable[str]) -> bool:
    """Whether a tool set is ToolOrchestra's interface (it has the three composites)."""
    return set(ORCHESTRA_TOOLS) <= set(tool_names)
