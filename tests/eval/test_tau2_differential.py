"""Differential: tau2's own runner (``tau2.run.run_task``: its ``LLMAgent``, ``UserSimulator``,
orchestrator and evaluator) against ``nemo-orch eval --benchmark tau2`` (the harness, the
episode loop, the openai engine, nemo-orch's tau2 user), both talking to the same SCRIPTED agent
and user on 127.0.0.1 (:mod:`support.tau2_scripted`). Per task and trial, the agent's messages the user
received, the termination reason (nemo-orch's in tau2's names) and the reward must be equal;
and nemo-orch's agent must be asked with tau2's ``LLMAgent`` system prompt.

Cases (real tasks of tau2's data; the scripts play the gold actions where the reward is meant
to be 1):
- retail 70: the agent writes text beside its tool call, and that text carries the fact the
  task's communicate check needs (22.55);
- retail 108 and airline 19: the agent's last message tells the answer (retail: the refund,
  346.93, the communicate check's fact) and ends with ``###STOP###``; airline 19's agent makes
  two calls in one message;
- telecom: the user runs its own tools when asked (data saver and roaming, a speed test; airplane
  mode and the status bar, then a transfer the user answers with ``###TRANSFER###``);
- mock create_task_1: a user that stops, 3 trials at eval.concurrency 16 and 1; a user that never
  stops (MAX_STEPS after more agent turns than rollout.max_turns); a user whose ``###STOP###``
  lands on the step that reaches max_steps (tau2: MAX_STEPS, reward 0).
Telecom's and mock's cases run 3 trials, retail's and airline's one (tau2: ``run_task`` per
trial, with the seeds its ``run_tasks`` draws; nemo-orch: ``eval.num_trials``).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # litellm stays offline
pytest.importorskip("tau2")

from support.tau2_scripted import AGENT, USER, Say, Script, ScriptedParties, model_name  # noqa: E402

from nemo_orch.cli import main  # noqa: E402
from nemo_orch.envs.tau2.adapter import breakdown  # noqa: E402

pytestmark = pytest.mark.tau2

TAU2_SEED = 300  # tau2's run_tasks default: the trials' seeds are drawn from it
MAX_ERRORS = 10  # tau2's default, and env.user.max_errors'
KEY = "sk-scripted"
GREETING = "Hi! How can I help you today?"


@dataclass(frozen=True)
class ScriptedTask:
    """A task's script (see :class:`support.tau2_scripted.Script`) and what tau2's own runner makes of
    it: the termination reason and the reward the script is written to reach."""

    id: str
    tag: str
    agent: tuple[Say, ...]
    user: tuple[Say, ...]
    termination: str
    reward: float
    agent_then: Say | None = None
    user_then: Say | None = None


@dataclass(frozen=True)
class Case:
    """Tasks of one domain run together: one tau2 run per task and trial, one ``nemo-orch
    eval`` with ``eval.num_trials=trials``, both with ``max_steps``. ``limit``: nemo-orch's
    tasks are the domain's first ``limit`` (mock's tasks name no domain, so no task file); else
    a task file of them. Retail and airline run one trial: their databases are most of a
    trial's time in either runner (each builds the environment three times: the episode's and
    the evaluator's two replays)."""

    domain: str
    tasks: tuple[ScriptedTask, ...]
    max_steps: int = 30
    limit: int | None = None
    split: str = "test"
    trials: int = 3


def _call(name: str, **arguments: Any) -> tuple[str, dict[str, Any]]:
    return name, arguments


STOP, TRANSFER = "###STOP###", "###TRANSFER###"
MOCK_CREATE = _call("create_task", user_id="user_1", title="Important Meeting")

CASES = {
    "retail": Case(
        "retail",
        trials=1,
        tasks=(
            ScriptedTask(
                "70",
                "retail-70",
                termination="USER_STOP",
                reward=1.0,
                agent=(
                    Say(calls=(_call("get_order_details", order_id="#W3947049"),)),
                    Say(
                        "The medium, high-ventilation blue helmet is item 9013366374. Shall I exchange "
                        "your helmet for it, paying the difference with credit_card_7901829? (yes/no)"
                    ),
                    # the fact the communicate check needs is only in the text beside the call
                    Say(
                        "Exchanging now: the price difference you pay today is $22.55.",
                        calls=(
                            _call(
                                "exchange_delivered_order_items",
                                order_id="#W3947049",
                                item_ids=["3358616356"],
                                new_item_ids=["9013366374"],
                                payment_method_id="credit_card_7901829",
                            ),
                        ),
                    ),
                    Say(
                        "Your exchange is requested; you will receive an email with the return "
                        "instructions. Anything else?"
                    ),
                ),
                user=(
                    Say(
                        "I got a helmet in order #W3947049; it is too small, I want a medium one with "
                        "high ventilation, blue if possible."
                    ),
                    Say("Yes."),
                    Say(f"No, that is all. {STOP}"),
                ),
            ),
            ScriptedTask(
                "108",
                "retail-108",
                termination="USER_STOP",
                reward=1.0,
                agent=(
                    Say(calls=(_call("get_order_details", order_id="#W1679211"),)),
                    Say(
                        "I can return the three items other than the tablet (9612497925, 7127170374, "
                        "6268080249), refunded to paypal_3022415. Shall I? (yes/no)"
                    ),
                    Say(
                        calls=(
                            _call(
                                "return_delivered_order_items",
                                order_id="#W1679211",
                                item_ids=["9612497925", "7127170374", "6268080249"],
                                payment_method_id="paypal_3022415",
                            ),
                        )
                    ),
                    # the answer (the communicate check's fact), then the agent's stop
                    Say(
                        f"Your return is requested: you will get $346.93 back to your PayPal. {STOP}"
                    ),
                ),
                user=(
                    Say("I want to return everything but the tablet in my order #W1679211."),
                    Say("Yes, please."),
                    Say(f"Thank you. {STOP}"),
                ),
            ),
        ),
    ),
    "airline": Case(
        "airline",
        trials=1,
        tasks=(
            ScriptedTask(
                "19",
                "airline-19",
                termination="USER_STOP",
                reward=1.0,
                agent=(
                    Say(
                        calls=(
                            _call("get_user_details", user_id="olivia_gonzalez_2305"),
                            _call("get_reservation_details", reservation_id="Z7GOZK"),
                        )
                    ),
                    Say(
                        "Reservation Z7GOZK is basic economy and cannot be modified; with its travel "
                        "insurance you can cancel it for a full refund. Shall I cancel it? (yes/no)"
                    ),
                    Say(calls=(_call("cancel_reservation", reservation_id="Z7GOZK"),)),
                    Say(
                        f"Reservation Z7GOZK is cancelled; the refund goes to the original payment "
                        f"method. {STOP}"
                    ),
                ),
                user=(
                    Say(
                        "I am Olivia Gonzalez, user id olivia_gonzalez_2305. I want a later return "
                        "flight to Newark on my Texas trip."
                    ),
                    Say("Yes, cancel it."),
                    Say(STOP),
                ),
            ),
        ),
    ),
    "telecom": Case(
        "telecom",
        (
            ScriptedTask(
                "[mobile_data_issue]data_saver_mode_on|user_abroad_roaming_enabled_off"
                "[PERSONA:Easy]",
                "telecom-data",
                termination="USER_STOP",
                reward=1.0,
                agent=(
                    Say(calls=(_call("get_customer_by_phone", phone_number="555-123-2002"),)),
                    Say("Please turn off Data Saver mode and turn on roaming on your phone."),
                    Say("Now please run a speed test."),
                    Say("Your mobile data is working again. Anything else?"),
                ),
                user=(
                    Say(
                        "My mobile data is very slow. I am John Smith, 555-123-2002, abroad in "
                        "France."
                    ),
                    Say(
                        "I turned Data Saver off and roaming on.",
                        calls=(_call("toggle_data_saver_mode"), _call("toggle_roaming")),
                    ),
                    Say("The speed test is done: excellent.", calls=(_call("run_speed_test"),)),
                    Say(f"No, thank you. {STOP}"),
                ),
            ),
            ScriptedTask(
                "[service_issue]airplane_mode_on|lock_sim_card_pin[PERSONA:Easy]",
                "telecom-airplane",
                termination="USER_STOP",
                reward=1.0,
                agent=(
                    Say(calls=(_call("get_customer_by_phone", phone_number="555-123-2002"),)),
                    Say("Please turn off airplane mode and tell me what your status bar shows."),
                    Say(
                        calls=(
                            _call(
                                "transfer_to_human_agents",
                                summary="The SIM card is locked with a PIN.",
                            ),
                        )
                    ),
                    Say("YOU ARE BEING TRANSFERRED TO A HUMAN AGENT. PLEASE HOLD ON."),
                ),
                user=(
                    Say("My phone shows No Service. I am John Smith, 555-123-2002."),
                    Say(
                        "Airplane mode is off; the status bar still shows no service.",
                        calls=(_call("toggle_airplane_mode"), _call("check_status_bar")),
                    ),
                    Say(TRANSFER),
                ),
            ),
        ),
    ),
    "mock": Case(
        "mock",
        limit=1,
        tasks=(
            ScriptedTask(
                "create_task_1",
                "mock-create",
                termination="USER_STOP",
                reward=1.0,
                agent=(
                    Say(calls=(MOCK_CREATE,)),
                    Say("I created the task 'Important Meeting' for user_1."),
                ),
                user=(
                    Say("Please create a task called 'Important Meeting' for user_1."),
                    Say(f"Thanks. {STOP}"),
                ),
            ),
        ),
    ),
    # Calls the tool's schema rejects run through tau2's dispatch in both runners: each fails
    # with tau2's own error, stays in the transcript with the text beside it, and counts
    # toward max_errors. Messages keep their trailing whitespace.
    "telecom-schema-edges": Case(
        "telecom",
        trials=1,
        tasks=(
            ScriptedTask(
                "[service_issue]airplane_mode_on|lock_sim_card_pin[PERSONA:Easy]",
                "telecom-edges",
                termination="USER_STOP",
                reward=1.0,
                agent=(
                    Say(calls=(_call("get_customer_by_phone"),)),  # a missing required argument
                    Say(
                        calls=(
                            _call("get_customer_by_phone", phone_number="555-123-2002"),
                            # an integral float (tau2's tool fails on it) and an undeclared one
                            _call("get_bills_for_customer", customer_id="C1001", limit=2.0),
                            _call("get_details_by_id", id="C1001", verbose=True),
                        )
                    ),
                    Say(
                        "Please turn off airplane mode and tell me what your status bar shows.  \n"
                    ),
                    # the action check matches the transfer by name: the failed call meets it
                    Say(
                        "I am transferring you to a human agent now.",
                        calls=(_call("transfer_to_human_agents", reason="SIM card locked"),),
                    ),
                    Say("YOU ARE BEING TRANSFERRED TO A HUMAN AGENT. PLEASE HOLD ON.  "),
                ),
                user=(
                    Say("My phone shows No Service. I am John Smith, 555-123-2002.  "),
                    # the user's own call with an undeclared argument
                    Say(
                        "Airplane mode is off; the status bar still shows no service.",
                        calls=(
                            _call("toggle_airplane_mode"),
                            _call("check_status_bar", verbose=True),
                        ),
                    ),
                    Say(TRANSFER),
                ),
            ),
        ),
    ),
    # the communicate check's fact is only in the text beside a call tau2 fails
    "retail-beside-a-failed-call": Case(
        "retail",
        trials=1,
        tasks=(
            ScriptedTask(
                "70",
                "retail-70-beside",
                termination="USER_STOP",
                reward=1.0,
                agent=(
                    Say(calls=(_call("get_order_details", order_id="#W3947049"),)),
                    Say(
                        "The medium, high-ventilation blue helmet is item 9013366374. Shall I exchange "
                        "your helmet for it, paying the difference with credit_card_7901829? (yes/no)"
                    ),
                    Say(
                        "The price difference you pay today is $22.55.",
                        calls=(_call("exchange_delivered_order_items", order_id="#W3947049"),),
                    ),
                    Say(
                        calls=(
                            _call(
                                "exchange_delivered_order_items",
                                order_id="#W3947049",
                                item_ids=["3358616356"],
                                new_item_ids=["9013366374"],
                                payment_method_id="credit_card_7901829",
                            ),
                        )
                    ),
                    Say("Your exchange is requested; the new helmet ships soon."),
                ),
                user=(
                    Say(
                        "I got a helmet in order #W3947049; it is too small, I want a medium one with "
                        "high ventilation, blue if possible."
                    ),
                    Say("Yes."),
                    Say(f"No, that is all. {STOP}"),
                ),
            ),
        ),
    ),
    # an optional argument sent as null, which tau2's tool takes
    "mock-null-optional": Case(
        "mock",
        limit=1,
        trials=1,
        tasks=(
            ScriptedTask(
                "create_task_1",
                "mock-null",
                termination="USER_STOP",
                reward=1.0,
                agent=(
                    Say(calls=((MOCK_CREATE[0], {**MOCK_CREATE[1], "description": None}),)),
                    Say("I created the task 'Important Meeting' for user_1.\n\n"),
                ),
                user=(
                    Say("Please create a task called 'Important Meeting' for user_1."),
                    Say(f"Thanks. {STOP}"),
                ),
            ),
        ),
    ),
    # 1 + 2 x 12 steps: the user's 13th message reaches max_steps; 12 agent turns, more than
    # rollout.max_turns (10), which tau2's limits replace
    "mock-never-stops": Case(
        "mock",
        limit=1,
        max_steps=25,
        tasks=(
            ScriptedTask(
                "create_task_1",
                "mock-never-stops",
                termination="MAX_STEPS",
                reward=0.0,
                agent=(Say(calls=(MOCK_CREATE,)),),
                agent_then=Say("The task 'Important Meeting' is created. Anything else?"),
                user=(Say("Please create a task called 'Important Meeting' for user_1."),),
                user_then=Say("Hmm, let me think."),
            ),
        ),
    ),
    # the user's 9th message, its stop, is step 19 = max_steps: tau2 ends MAX_STEPS (reward 0)
    "mock-stops-at-max-steps": Case(
        "mock",
        limit=1,
        max_steps=19,
        tasks=(
            ScriptedTask(
                "create_task_1",
                "mock-stops-at-limit",
                termination="MAX_STEPS",
                reward=0.0,
                agent=(Say(calls=(MOCK_CREATE,)),),
                agent_then=Say("The task 'Important Meeting' is created. Anything else?"),
                user=(
                    Say("Please create a task called 'Important Meeting' for user_1."),
                    *[Say("One moment.")] * 7,
                    Say(f"No, that is all. {STOP}"),
                ),
            ),
        ),
    ),
}


def tau2_trial_seeds(trials: int) -> list[int]:
    """The trials' seeds as tau2's ``run_tasks`` draws them (``random.seed(seed)``)."""
    draw = random.Random(TAU2_SEED)
    seeds = [draw.randint(0, 1000000) for _ in range(trials)]
    assert len(set(seeds)) == trials
    return seeds


@dataclass(frozen=True)
class Outcome:
    """One trial of one task, as each side is compared: the agent's messages the user received
    (the greeting first), the results of the user's own calls as the user read them, the
    termination reason in tau2's names, the reward and its breakdown (every check of tau2's
    evaluator, as :func:`~nemo_orch.envs.tau2.adapter.breakdown` lists them)."""

    told_user: list[str]
    user_saw: list[str]
    termination: str
    reward: float
    breakdown: dict[str, Any]


@dataclass
class Run:
    """One side's run of a case: outcomes by (tau2 task id, trial), and the runner's own record
    (tau2's messages of each simulation; nemo-orch's episode records)."""

    outcomes: dict[tuple[str, int], Outcome]
    extra: dict[str, Any] = field(default_factory=dict)


class Differential:
    """Runs the cases lazily, each once: its scripted parties, tau2's runner, nemo-orch."""

    def __init__(self, tokenizer: Any, tokenizer_dir: Path, workdir: Path) -> None:
        from loguru import logger

        logger.disable("tau2")  # tau2 logs every step and tool response
        self.tokenizer, self.tokenizer_dir, self.workdir = tokenizer, tokenizer_dir, workdir
        self.parties: dict[str, ScriptedParties] = {}
        self.runs: dict[tuple[str, str], Run] = {}
        self._tasks: dict[tuple[str, str], list[Any]] = {}

    def close(self) -> None:
        for parties in self.parties.values():
            parties.close()

    def tau2_tasks(self, case: Case) -> list[Any]:
        """The case's tasks, as tau2's registry loads them."""
        key = (case.domain, case.split)
        if key not in self._tasks:
            from tau2.registry import registry

            splits = registry.get_task_splits_loader(case.domain)
            self._tasks[key] = registry.get_tasks_loader(case.domain)(
                case.split if splits is not None else None
            )
        by_id = {task.id: task for task in self._tasks[key]}
        return [by_id[task.id] for task in case.tasks]

    def parties_of(self, name: str) -> ScriptedParties:
        if name not in self.parties:
            case = CASES[name]
            scripts = [
                Script(
                    task.tag,
                    str(tau2_task.user_scenario),
                    task.agent,
                    task.user,
                    task.agent_then,
                    task.user_then,
                )
                for task, tau2_task in zip(case.tasks, self.tau2_tasks(case))
            ]
            self.parties[name] = ScriptedParties(scripts, self.tokenizer)
        return self.parties[name]

    def tau2_run(self, name: str) -> Run:
        """tau2's own runner: ``run_task`` per task and trial, scored by its evaluator (as
        ``run_task`` does), with the seeds ``run_tasks`` would give the trials."""
        if ("tau2", name) in self.runs:
            return self.runs[("tau2", name)]
        from tau2.data_model.simulation import TerminationReason
        from tau2.run import run_task

        case, parties = CASES[name], self.parties_of(name)
        outcomes, messages = {}, {}
        for trial, seed in enumerate(tau2_trial_seeds(case.trials)):
            for task, tau2_task in zip(case.tasks, self.tau2_tasks(case)):
                simulation = run_task(
                    case.domain,
                    tau2_task,
                    "llm_agent",
                    "user_simulator",
                    llm_agent=f"openai/{model_name(AGENT, 'tau2')}",
                    llm_args_agent={
                        "api_base": parties.agent_url,
                        "api_key": KEY,
                        "temperature": 0.0,
                    },
                    llm_user=f"openai/{model_name(USER, 'tau2')}",
                    llm_args_user={
                        "api_base": parties.user_url,
                        "api_key": KEY,
                        "temperature": 0.0,
                    },
                    max_steps=case.max_steps,
                    max_errors=MAX_ERRORS,
                    seed=seed,
                )
                reason = TerminationReason(simulation.termination_reason)
                outcomes[(task.id, trial)] = Outcome(
                    parties.recorded.told_user("tau2", task.tag, seed),
                    parties.recorded.user_saw("tau2", task.tag, seed),
                    reason.name,
                    simulation.reward_info.reward,
                    json.loads(json.dumps(breakdown(simulation.reward_info))),
                )
                messages[(task.id, trial)] = simulation.messages
        self.runs[("tau2", name)] = run = Run(outcomes, {"messages": messages})
        return run

    def nemo_run(self, name: str, concurrency: int = 16) -> Run:
        """``nemo-orch eval --benchmark tau2 --agent orchestrator`` in this process, the policy
        the scripted agent behind ``rollout.engine=openai``, the user the scripted one."""
        side = "nemo" if concurrency == 16 else f"nemo-c{concurrency}"
        if (side, name) in self.runs:
            return self.runs[(side, name)]
        case, parties = CASES[name], self.parties_of(name)
        out = self.workdir / f"{name}-{side}"
        out.mkdir(parents=True)
        if case.limit is not None:
            tasks = [f"env.split={case.split}", f"env.limit={case.limit}"]
        else:
            path = out / "tasks.json"
            path.write_text(
                json.dumps([task.model_dump(mode="json") for task in self.tau2_tasks(case)])
            )
            tasks = [f"env.path={path}"]
        code = main(
            [
                "eval",
                "--benchmark",
                "tau2",
                "--agent",
                "orchestrator",
                f"env.domain={case.domain}",
                *tasks,
                f"env.user.base_url={parties.user_url}",
                f"env.user.model={model_name(USER, side)}",
                f"env.user.max_steps={case.max_steps}",
                f"env.user.max_errors={MAX_ERRORS}",
                "rollout.engine=openai",
                f"rollout.base_url={parties.agent_url}",
                f"rollout.model_name={model_name(AGENT, side)}",
                f"tokenizer.path={self.tokenizer_dir}",
                # a served policy's context: room for telecom's policy and tools
                "model.max_position_embeddings=131072",
                f"eval.num_trials={case.trials}",
                f"eval.concurrency={concurrency}",
                f"eval.out_dir={out / 'report'}",
            ]
        )
        assert code == 0, f"nemo-orch eval exited {code}"
        lines = (out / "report" / "episodes" / "orchestrator.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines[1:]]
        from nemo_orch.envs.tau2.adapter import _TERMINATIONS

        tags = {f"tau2-{case.domain}-{task.id}": task for task in case.tasks}
        assert sorted((r["task_id"], r["trial"]) for r in records) == sorted(
            (task_id, trial) for task_id in tags for trial in range(case.trials)
        )
        outcomes = {}
        for record in records:
            task = tags[record["task_id"]]
            outcomes[(task.id, record["trial"])] = Outcome(
                parties.recorded.told_user(side, task.tag, record["seed"]),
                parties.recorded.user_saw(side, task.tag, record["seed"]),
                _TERMINATIONS.get(record["episode"]["termination"], "AGENT_ERROR"),
                record["details"]["tau2"]["reward"],
                record["details"]["tau2"]["breakdown"],
            )
        self.runs[(side, name)] = run = Run(outcomes, {"records": records})
        return run


@pytest.fixture(scope="module")
def differential(tiny_tokenizer, tiny_tokenizer_dir, tmp_path_factory):
    runs = Differential(tiny_tokenizer, tiny_tokenizer_dir, tmp_path_factory.mktemp("tau2-diff"))
    yield runs
    runs.close()


def _expected(case: Case) -> dict[tuple[str, int], tuple[str, float]]:
    return {
        (task.id, trial): (task.termination, task.reward)
        for task in case.tasks
        for trial in range(case.trials)
    }


@pytest.mark.parametrize("name", CASES)
def test_tau2s_runner_plays_the_scripts_as_written(differential, name):
    """The scripts do what each case says, in tau2's own runner (whatever nemo-orch does)."""
    case, run = CASES[name], differential.tau2_run(name)
    assert {key: (o.termination, o.reward) for key, o in run.outcomes.items()} == _expected(case)
    for (task_id, trial), outcome in run.outcomes.items():
        task = next(task for task in case.tasks if task.id == task_id)
        texts = [say.text for say in task.agent + (task.agent_then,) if say and not say.calls]
        # every agent message without calls reached the user, the greeting first
        assert outcome.told_user[0] == GREETING
        assert set(outcome.told_user[1:]) <= set(texts), outcome.told_user
        messages = run.extra["messages"][(task_id, trial)]
        if any(STOP in (say.text or "") for say in task.agent):
            # tau2's LLMAgent does not stop: its ###STOP### message goes to the user
            assert STOP in outcome.told_user[-1]
        if name == "mock-stops-at-max-steps":
            assert messages[-1].role == "user" and STOP in messages[-1].content
            assert len(messages) == case.max_steps + 1  # the greeting, then a message a step
        if name == "mock-never-stops":
            assert len(outcome.told_user) == 1 + 11  # the greeting, the 11 texts after the call


@pytest.mark.parametrize("name", CASES)
def test_nemo_orch_agrees_with_tau2s_runner(differential, name):
    """Per task and trial: what the user was told and read of its own calls, how the episode
    ended, the reward and its breakdown; per task, the results of the agent's calls as the
    agent read them."""
    theirs = differential.tau2_run(name).outcomes
    ours = differential.nemo_run(name).outcomes
    assert {key: ours[key] for key in sorted(ours)} == {key: theirs[key] for key in sorted(theirs)}
    recorded = differential.parties_of(name).recorded
    for task in CASES[name].tasks:
        assert recorded.agent_saw("nemo", task.tag) == recorded.agent_saw("tau2", task.tag)


@pytest.mark.parametrize("name", ["retail", "airline", "telecom", "mock"])
def test_the_agent_is_asked_with_tau2s_llm_agent_system_prompt(differential, name):
    from tau2.agent.llm_agent import AGENT_INSTRUCTION, SYSTEM_PROMPT
    from tau2.registry import registry

    case = CASES[name]
    differential.tau2_run(name)
    differential.nemo_run(name)
    policy = registry.get_env_constructor(case.domain)().get_policy()
    expected = SYSTEM_PROMPT.format(agent_instruction=AGENT_INSTRUCTION, domain_policy=policy)
    recorded = differential.parties_of(name).recorded.agent
    for task in case.tasks:
        assert recorded[("tau2", task.tag)][0][0] == {"role": "system", "content": expected}
        prompt = recorded[("nemo", task.tag)][0]
        assert prompt.startswith("<|im_start|>system\n")
        # the chat template lists the tools after the system prompt
        system = prompt.removeprefix("<|im_start|>system\n").split("\n\n# Tools\n")[0]
        assert system == expected


def test_trials_agree_at_concurrency_16_and_1(differential):
    """Three trials of one task at once (eval.concurrency 16) or one after the other: the same
    per-trial results, tau2's."""
    theirs = differential.tau2_run("mock").outcomes
    together = differential.nemo_run("mock", concurrency=16).outcomes
    alone = differential.nemo_run("mock", concurrency=1).outcomes
    assert alone == theirs
    assert together == alone
