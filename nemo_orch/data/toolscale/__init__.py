"""ToolScale: domain environments and multi-step user tasks with gold actions, generated offline
(:mod:`.generator`, seeded, no LLM) or synthesized by an LLM (:mod:`.synth`), and kept only when
they pass the validation filters (:mod:`.validate`)."""
