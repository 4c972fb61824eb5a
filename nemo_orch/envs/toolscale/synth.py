"""ToolScale synthesis: an LLM designs domains and user tasks through any OpenAI-compatible
endpoint, and only what validates is kept.

The steps follow the reference pipeline, each one LLM call whose prompt is a file in
``prompts/``: domain (name, description, policy) -> table names -> schema -> data model (the
``tables`` of a :class:`~nemo_orch.data.domain.DomainSpec`) -> database records -> tools
(declared database operations, not code) -> user purposes -> tasks (the ToolScale/tau2 ``Task``
schema) -> "evolve harder" rewrites. A reply is parsed as JSON (a ```json fence is tolerated) and
checked; one that fails is sent back with the error, up to ``max_retries`` times, after which
the run fails naming the step.

What the reference does not do:

* every drafted task and every rewrite must pass the validation filters (:mod:`.validate`); a
  dropped task is counted under its filter with the reason, and a rewrite replaces its task
  only when it passes, so evolving never loses a task;
* records must fit the data model and their references resolve, constants a tool writes must
  fit their fields, and a domain needs read and write tools;
* a budget (``max_llm_calls``; ``max_usd`` at the configured prices, from the token counts the
  server reports) stops the run cleanly: domains that reached their task stage are written with
  the tasks finished so far;
* every step's reply is cached on disk, keyed by a hash of its request, so a killed or stopped
  run resumes without asking again (a cached reply is checked again: a stale one is re-asked).

Outputs under ``out_dir``: ``<domain>/domain.json`` (:meth:`Domain.save`, for
``tools.domains``), ``<domain>/tasks.jsonl``, ``summary.json`` and the cache,
``cache/<step>/<key>.json``.

This module is the pipeline; how a step is asked, retried, cached and budgeted is
:mod:`.synth_steps`, and what each step's reply must be is :mod:`.synth_checks`.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from nemo_orch.clients.openai import OpenAIClient, run_sync
from nemo_orch.config import ConfigError, SynthConfig
from nemo_orch.data.domain import Domain, DomainSpec
from nemo_orch.data.domain_tasks import DomainTask, task_from_record, write_domain_tasks
from nemo_orch.envs.toolscale.synth_checks import (
    check_about,
    check_data_model,
    check_evolved,
    check_purposes,
    check_records,
    check_schema,
    check_tables,
    check_tasks,
    check_tools,
)
from nemo_orch.envs.toolscale.synth_steps import BudgetExhausted, Steps, gather_within_budget
from nemo_orch.envs.toolscale.validate import Rejection, ValidationSummary, rejection, validated


async def _design(steps: Steps, config: SynthConfig, index: int, taken: list[str]) -> Domain:
    where = f"domain {index + 1} of {config.num_domains}"
    about = await steps.run(
        "domain",
        where,
        lambda value: check_about(value, taken),
        index=index + 1,
        count=config.num_domains,
        taken=taken,
    )
    where = f"domain {about['name']}"
    tables = await steps.run("tables", where, check_tables, domain=about)
    schema = await steps.run(
        "schema", where, lambda value: check_schema(value, tables), domain=about, tables=tables
    )
    model = await steps.run(
        "data_model",
        where,
        lambda value: check_data_model(value, about, schema),
        domain=about,
        schema=schema,
    )
    database = await steps.run(
        "records",
        where,
        lambda value: check_records(value, about, model),
        domain=about,
        data_model=model,
        count=config.records_per_table,
    )
    spec = DomainSpec.from_json(
        await steps.run(
            "tools",
            where,
            lambda value: check_tools(value, about, model),
            domain=about,
            data_model=model,
        ),
        where,
    )
    return Domain(spec, spec.check_database(database, where))


async def _draft_tasks(
    steps: Steps,
    config: SynthConfig,
    domain: Domain,
    purposes: list[str],
    summary: ValidationSummary,
) -> list[DomainTask]:
    """The tasks drafted for each purpose that pass the validation filters."""
    spec = domain.spec.to_json()

    def for_purpose(index: int, purpose: str) -> Awaitable[list[dict[str, Any]]]:
        prefix = f"{domain.name}-{index}"
        return steps.run(
            "tasks",
            f"domain {domain.name}, purpose {index + 1}",
            lambda value: check_tasks(value, domain, prefix, config.tasks_per_purpose),
            domain=spec,
            database=domain.database,
            purpose=purpose,
            count=config.tasks_per_purpose,
            name=domain.name,
        )

    drafted = await gather_within_budget(
        [for_purpose(index, purpose) for index, purpose in enumerate(purposes)]
    )
    tasks = [
        task_from_record(record, f"domain {domain.name}")
        for records in drafted
        for record in records
    ]
    return list(validated(domain, tasks, config.max_actions, summary))


async def _evolve(
    steps: Steps,
    config: SynthConfig,
    domain: Domain,
    tasks: list[DomainTask],
    summary: ValidationSummary,
) -> list[DomainTask]:
    """Each task after up to ``evolve_rounds`` harder rewrites, each kept only when it passes
    the filters (the first rejected one ends the task's evolution)."""
    spec = domain.spec.to_json()

    async def harder(task: DomainTask) -> tuple[DomainTask, list[Rejection | None]]:
        verdicts: list[Rejection | None] = []
        for _ in range(config.evolve_rounds):
            try:
                record = await steps.run(
                    "evolve",
                    f"domain {domain.name}, task {task.id}",
                    lambda value, current=task: check_evolved(value, domain, current),
                    domain=spec,
                    database=domain.database,
                    task=task.to_json(),
                    actions=len(task.gold_actions),
                )
            except BudgetExhausted:
                break
            candidate = task_from_record(record, f"task {task.id}")
            verdicts.append(rejection(domain, candidate, config.max_actions))
            if verdicts[-1] is not None:
                break
            task = candidate
        return task, verdicts

    evolved = await gather_within_budget([harder(task) for task in tasks])
    for _, verdicts in evolved:  # recorded in task order, whatever order the replies came in
        for verdict in verdicts:
            summary.seen += 1
            if verdict is None:
                summary.kept += 1
            else:
                summary.rejections.append(verdict)
    return [task for task, _ in evolved]


def _save(directory: Path, domain: Domain, tasks: list[DomainTask]) -> dict[str, Any]:
    directory.mkdir(parents=True, exist_ok=True)
    domain.save(directory / "domain.json")
    write_domain_tasks(directory / "tasks.jsonl", tasks)
    return {
        "name": domain.name,
        "domain_file": str(directory / "domain.json"),
        "tasks_file": str(directory / "tasks.jsonl"),
        "tasks": len(tasks),
        "tools": len(domain.spec.tools),
        "records": sum(len(records) for records in domain.database.values()),
    }


async def _synthesize(config: SynthConfig, out: Path) -> dict[str, Any]:
    client = OpenAIClient(
        config.base_url,
        config.model,
        dialect=config.dialect,
        name="synth",
        api_key_env=config.api_key_env,
        timeout_s=config.timeout_s,
    )
    steps = Steps(config, client, out / "cache")
    drafted, evolved = ValidationSummary(), ValidationSummary()
    written: list[dict[str, Any]] = []
    async with client:
        for index in range(config.num_domains):
            try:
                domain = await _design(steps, config, index, [d["name"] for d in written])
                purposes = await steps.run(
                    "purposes",
                    f"domain {domain.name}",
                    lambda value: check_purposes(value, config.num_purposes),
                    domain=domain.spec.to_json(),
                    count=config.num_purposes,
                )
            except BudgetExhausted:
                break
            tasks = await _draft_tasks(steps, config, domain, purposes, drafted)
            tasks = await _evolve(steps, config, domain, tasks, evolved)
            written.append(_save(out / domain.name, domain, tasks))
            if steps.stopped:
                break
    summary = {
        "out_dir": str(out),
        "stopped": steps.stopped,
        "domains": written,
        "tasks": drafted.to_json(),
        "evolved": evolved.to_json(),
        "llm": steps.usage.to_json(),
    }
    (out / "summary.json").write_text(json.dumps(summary, ensure_ascii=False, indent=1))
    return summary


def run(config: SynthConfig) -> dict[str, Any]:
    """Run the pipeline into ``config.out_dir`` (resuming from its cache); returns the summary,
    also written to ``summary.json``. :class:`SynthError` when a step never validates."""
    if not (config.base_url and config.model):
        raise ConfigError(
            "synth.base_url and synth.model must name an OpenAI-compatible endpoint and its model"
        )
    out = Path(config.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return run_sync(_synthesize(config, out))


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """The summary as the command prints it."""
    tasks, evolved, llm = summary["tasks"], summary["evolved"], summary["llm"]
    lines = [f"synth: {len(summary['domains'])} domain(s) -> {summary['out_dir']}"]
    lines += [
        f"  {d['name']}: {d['tools']} tools, {d['records']} records, {d['tasks']} tasks "
        f"-> {d['tasks_file']}"
        for d in summary["domains"]
    ]
    dropped = ", ".join(f"{name} {count}" for name, count in tasks["dropped"].items())
    lines.append(f"  tasks: {tasks['seen']} drafted, {tasks['kept']} kept; dropped: {dropped}")
    lines.append(
        f"  evolve: {evolved['seen']} harder rewrites, {evolved['kept']} kept (a "
        "dropped rewrite leaves its task as it was)"
    )
    lines.append(
        f"  LLM: {llm['calls']} requests (retries: {llm['retries']}), steps from the "
        f"cache: {llm['cached']}; {llm['input_tokens']} input + "
        f"{llm['output_tokens']} output tokens, ${llm['usd']:.4f}"
    )
    if summary["stopped"]:
        lines.append(
            f"  stopped early: {summary['stopped']}; run again with a larger budget "
            "to continue from the cache"
        )
    lines.append(f"  drops and reasons: {Path(summary['out_dir']) / 'summary.json'}")
    return lines
