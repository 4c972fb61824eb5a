"""The GRPO step against a peer: ``nemo-orch grpo`` and Hugging Face TRL's ``GRPOTrainer`` at equal
work on CPU, on one of two workloads (``--workload``).

``arithmetic``: the micro policy (``model=micro``, seeded weights exported to HF, its tokenizer
trained on the offline conversations), 4 prompts x 8 samples a step (each prompt the
chat-templated first turn of a "What is i + i?" task, no tools), at most 64 new tokens.

``orchestrator``: the main job's first turn (``nemo-orch train``'s GRPO stage): the micro
policy's seeded weights with the main job's tokenizer (trained as its setup trains it), 8
prompts x 16 samples a step (``grpo.prompts_per_step``, ``rollout.group_size``), each prompt
the first 8 tasks of the offline world's training split rendered as its episodes render them:
the system prompt, the offline tools' descriptions and prices, the question with its
preference (about 150 tokens, the same 8 each step); at most 32 new tokens, one turn. TRL
cannot run nemo-orch's tools, so neither side runs any: nemo-orch declares the main job's tools
(they are in the prompt) and stops after the first turn (``rollout.max_turns=1``); a valid call
would still run before it stops, but the seeded policy writes none (a few malformed ones a
step, answered with an error: ``calls/ok`` 0). nemo-orch keeps its defaults here, the
update's prefix sharing included (``grpo.prefix_sharing=auto``: on, on CPU).

The same on both sides, either workload: temperature 1, one AdamW step over micro-batches of 8,
a KL of 0.1 to the start policy, fp32, ``--threads`` intra-op threads each; both take the same
prompt token ids (the TRL worker checks its tokenization against nemo-orch's rendering). The
ratio's old policy is the sampling one, not a second forward of the trainer (TRL's default with
one iteration; nemo-orch's ``grpo.old_logprobs=engine``). nemo-orch's defaults that do more
than this are turned off for the comparison (``grpo.sample_mode=turn``, ``kl_guard=null``,
``dynamic_sampling=false``, ``reward.min_group_std=0``, ``advantage_tokens=all``, one turn). The
reward, 1 for the right answer in ``<answer>...</answer>``, is computed by each framework's own
path (nemo-orch's outcome scorer, a TRL reward function); it is a string match on either side.

How it runs: the two frameworks are two processes, started once (model load and warm-up are not
timed), each in its own virtual environment: nemo-orch in ``.venv``, TRL in one made from
``requirements-bench-trl.txt`` (``make bench-trl`` makes both and runs this). Their steps
alternate: a worker waits at each step's start until this parent lets it go, and the parent
lets the other go only after the first has finished its step, so only one of them runs at a
time and a load on the machine falls on both alike; which goes first alternates per round.

How to read the table: seconds per step are the median (min-max) over the timed steps (the first
is left out: warm-up); completions/s is the step's completions over that median. The split:
nemo-orch's ``time/rollout_s``, ``time/train_s`` (old-policy and reference forwards, loss,
backward, the optimizer step) and ``time/refit_s`` from its ``metrics.jsonl``; TRL's generation
(``_generate``), the rest of its batch preparation (reference forward, rewards, advantages) and
its update (the remainder of the step: forwards, backward, optimizer), timed around its methods.

Run: ``make bench-trl`` or ``python benchmarks/vs_trl.py --trl-python .venv-trl/bin/python
[--workload orchestrator --steps 8 --threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the TRL worker's environment has no nemo-orch
    from nemo_orch.config import Config
    from nemo_orch.data.tasks import Task

MICRO_BATCH, KL, LR, SEED = 8, 0.1, 1e-5, 0


@dataclass(frozen=True)
class Workload:
    """A step's shape: ``prompts`` x ``samples`` completions of at most ``max_new_tokens``."""

    prompts: int
    samples: int
    max_new_tokens: int

    @property
    def completions(self) -> int:
        return self.prompts * self.samples


WORKLOADS = {
    "arithmetic": Workload(prompts=4, samples=8, max_new_tokens=64),
    # The main job's grpo.prompts_per_step and rollout.group_size.
    "orchestrator": Workload(prompts=8, samples=16, max_new_tokens=32),
}


# ------------------------------------------------------------------------- the parent: set-up


def prepare(workdir: Path, workload: str) -> None:
    """The shared inputs in ``workdir``: ``policy/`` (HF weights and tokenizer), ``tasks.jsonl``
    (nemo-orch's tasks) and ``prompts.json`` (the same first turns as text and token ids, with
    answers)."""
    from nemo_orch import config as config_lib
    from nemo_orch.data.tasks import write_tasks
    from nemo_orch.models.hf_mapping import SeededHFWeights, save_hf_checkpoint
    from nemo_orch.models.tokenizer import save_tokenizer, special_token_ids

    config = config_lib.load(["model=micro", f"run.output_dir={workdir}", "run.name=main-job"])
    tokenizer, tasks, tools = (
        _orchestrator_tasks(config, WORKLOADS[workload].prompts)
        if workload == "orchestrator"
        else _arithmetic_tasks(config, workdir, WORKLOADS[workload].prompts)
    )
    policy = workdir / "policy"
    save_hf_checkpoint(
        policy,
        SeededHFWeights(config.model, SEED),
        config.model,
        special_tokens=special_token_ids(tokenizer),
    )
    save_tokenizer(tokenizer, policy)
    write_tasks(workdir / "tasks.jsonl", tasks)
    if tools:  # nemo-orch's episodes read these tasks with the tools of its own config
        from nemo_orch.envs import build_environment

        overrides = nemo_overrides(workdir, 1, 1, workload)
        if build_environment(config_lib.load(overrides)).toolbox().schemas() != tools:
            raise SystemExit("nemo-orch's tasks would offer other tools than the main job's")
    prompts = []
    for task in tasks:
        text = _first_turn(task, tokenizer, tools)
        ids = tokenizer.encode(text, add_special_tokens=False)  # as an episode encodes it
        prompts.append({"prompt": text, "prompt_ids": ids, "answer": task.answer})
    (workdir / "prompts.json").write_text(json.dumps(prompts))


def _arithmetic_tasks(config: Config, workdir: Path, count: int) -> tuple[Any, list[Task], list]:
    """A tokenizer trained on 300 offline conversations; "add i and i" tasks; no tools."""
    from nemo_orch.data.tasks import Task
    from nemo_orch.envs.offline.generator import generate_conversations
    from nemo_orch.models.tokenizer import render_conversation, train_tokenizer

    texts = (
        render_conversation(c["messages"], c["tools"]) for c in generate_conversations(300, seed=0)
    )
    tokenizer = train_tokenizer(
        texts,
        vocab_size=config.tokenizer.vocab_size,
        min_frequency=2,
        out_dir=workdir / "tokenizer",
    )
    tasks = [
        Task(
            id=f"t{i}",
            question=f"Add {i} and {i} and then give the result as one whole "
            "number, with no words around it, inside the answer tags.",
            answer=str(2 * i),
        )
        for i in range(1, count + 1)
    ]
    return tokenizer, tasks, []


def _orchestrator_tasks(config: Config, count: int) -> tuple[Any, list[Task], list[dict]]:
    """The main job's tokenizer (trained as its setup trains it), the first ``count`` tasks of
    the offline world's training split and the schemas of its tools, the main job's."""
    from nemo_orch.envs import build_environment
    from nemo_orch.train.sft import prepare_tokenizer

    offline = build_environment(config)
    return (
        prepare_tokenizer(config),
        offline.tasks("train", count, SEED),
        offline.toolbox().schemas(),
    )


def _first_turn(task: Task, tokenizer: Any, tools: list[dict]) -> str:
    """The task's first prompt as an episode renders it (nemo_orch.rollout.episode)."""
    from nemo_orch.rollout.opening import initial_messages

    return tokenizer.apply_chat_template(
        initial_messages(task, tokenizer),
        tools=tools or None,
        tokenize=False,
        add_generation_prompt=True,
    )


def nemo_overrides(workdir: Path, steps: int, threads: int, workload: str) -> list[str]:
    """``nemo-orch grpo``'s settings for the comparison: the workload's shape and tools (none
    for ``arithmetic``; the main job's otherwise), the rest alike for both (module docstring)."""
    shape = WORKLOADS[workload]
    return [
        f"trainer.init_from={workdir / 'policy'}",
        f"run.output_dir={workdir / 'runs'}",
        "model=micro",
        "env=tasks",
        f"env.path={workdir / 'tasks.jsonl'}",
        "env.val_fraction=0",  # every task in the training split
        "reward.combination=linear",
        "reward.linear_gamma=0",
        "reward.min_group_std=0",
        *(["tools.declarations=[]"] if workload == "arithmetic" else []),
        "rollout.engine=hf",
        "rollout.max_turns=1",
        f"rollout.group_size={shape.samples}",
        f"rollout.max_new_tokens={shape.max_new_tokens}",
        "rollout.temperature=1.0",
        f"grpo.max_steps={steps}",
        f"grpo.prompts_per_step={shape.prompts}",
        f"grpo.micro_batch_size={MICRO_BATCH}",
        f"grpo.kl_coef={KL}",
        f"grpo.optim.lr={LR}",
        f"grpo.optim.min_lr={LR}",
        "grpo.sample_mode=turn",
        "grpo.kl_guard=null",
        "grpo.dynamic_sampling=false",
        "grpo.advantage_tokens=all",
        "grpo.old_logprobs=engine",
        f"grpo.save_interval={steps + 1}",
        f"trainer.num_threads={threads}",
        f"run.seed={SEED}",
    ]


# ------------------------------------------------------------------------- the workers


class Turns:
    """The worker's side of the alternation, over two named pipes in the work directory:
    ``wait`` tells the parent the worker is at a step's start and blocks until it is let go;
    ``done`` hands over the results. In a job of several ranks only rank 0 takes turns (the
    others wait for it in their collectives)."""

    def __init__(self, workdir: Path, name: str) -> None:
        self.ready = open(workdir / f"{name}.ready", "w")
        self.go = open(workdir / f"{name}.go")

    def wait(self) -> None:
        self.ready.write("ready\n")
        self.ready.flush()
        self.go.readline()

    def done(self, results: dict) -> None:
        self.ready.write(json.dumps(results) + "\n")
        self.ready.flush()


def nemo_worker(workdir: Path, name: str, steps: int, threads: int, dp: int, workload: str) -> None:
    """One rank of ``nemo-orch grpo`` (``dp`` ranks of ``threads`` threads each)."""
    from nemo_orch import cli, faults

    rank_zero = os.environ.get("RANK", "0") == "0"
    turns = Turns(workdir, name) if rank_zero else None
    kill_point = faults.maybe_kill

    def at_step(point: str, step: int) -> None:  # called at each step's start, before its clock
        if point == "step" and turns is not None:
            turns.wait()
        kill_point(point, step)

    faults.maybe_kill = at_step
    overrides = [
        *nemo_overrides(workdir, steps, threads, workload),
        f"run.name={name}",
        f"parallel.dp={dp}",
        f"trainer.micro_batch_size={MICRO_BATCH}",
    ]
    if cli.main(["grpo", *overrides]) != 0:
        raise SystemExit("nemo-orch grpo failed")
    if turns is None:
        return
    (stage,) = (workdir / "runs" / name).glob("grpo-*")
    rows = [json.loads(line) for line in (stage / "metrics.jsonl").read_text().splitlines()]
    turns.done(
        {
            "steps": [
                {
                    "step": row["time/step_s"],
                    "rollout": row["time/rollout_s"],
                    "update": row["time/train_s"],
                    "refit": row["time/refit_s"],
                    "completions": row["samples"],
                }
                for row in rows
            ]
        }
    )


def trl_worker(workdir: Path, name: str, steps: int, threads: int, workload: str) -> None:
    """TRL's ``GRPOTrainer`` on the same prompts, whose token ids it must see as nemo-orch's."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback, set_seed

    torch.set_num_threads(threads)
    set_seed(SEED)
    turns = Turns(workdir, name)
    policy = workdir / "policy"
    shape = WORKLOADS[workload]
    prompts = json.loads((workdir / "prompts.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(policy)
    for prompt in prompts:  # GRPOTrainer tokenizes a text prompt so
        if tokenizer(text=prompt["prompt"])["input_ids"] != prompt["prompt_ids"]:
            raise SystemExit("TRL's prompt token ids differ from nemo-orch's")
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)

    def answered(completions: list[str], answer: list[str], **_: object) -> list[float]:
        return [
            float(f"<answer>{gold}</answer>" in text) for text, gold in zip(completions, answer)
        ]

    timed: dict[str, float] = {"generate": 0.0, "prepare": 0.0}
    records: list[dict] = []

    class Alternate(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            turns.wait()
            timed.update(generate=0.0, prepare=0.0, started=time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - timed["started"]
            records.append(
                {
                    "step": step,
                    "generate": timed["generate"],
                    "reward_reference": timed["prepare"] - timed["generate"],
                    "update": step - timed["prepare"],
                    "completions": shape.completions,
                }
            )

    args = trl.GRPOConfig(
        output_dir=str(workdir / name),
        per_device_train_batch_size=MICRO_BATCH,
        gradient_accumulation_steps=shape.completions // MICRO_BATCH,
        num_generations=shape.samples,
        max_completion_length=shape.max_new_tokens,
        temperature=1.0,
        beta=KL,
        learning_rate=LR,
        lr_scheduler_type="constant",
        warmup_steps=0,
        max_steps=steps,
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=SEED,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = trl.GRPOTrainer(
        model=model,
        reward_funcs=answered,
        args=args,
        train_dataset=Dataset.from_list(
            [{"prompt": prompt["prompt"], "answer": prompt["answer"]} for prompt in prompts]
        ),
        processing_class=tokenizer,
        callbacks=[Alternate()],
    )
    for method, key in (("_generate", "generate"), ("_generate_and_score_completions", "prepare")):
        # Bound now, per method: the defaults hold this iteration's method and key.
        def timer(*call_args, _inner=getattr(trainer, method), _key=key, **call_kwargs):  # noqa: B008
            started = time.perf_counter()
            result = _inner(*call_args, **call_kwargs)
            timed[_key] += time.perf_counter() - started
            return result

        setattr(trainer, method, timer)
    trainer.train()
    turns.done({"steps": records, "trl": trl.__version__})


# ------------------------------------------------------------------------- the parent: run


@dataclass(frozen=True)
class Contestant:
    """One side of the comparison: a framework in a layout of ``processes`` x ``threads``."""

    label: str
    framework: str  # nemo | trl
    processes: int
    threads: int


CONTESTANTS = {
    "nemo_dp2": Contestant("nemo-orch, DP=2 x 1 thread", "nemo", 2, 1),
    "nemo_1proc": Contestant("nemo-orch, 1 process x 2 threads", "nemo", 1, 2),
    "trl": Contestant("TRL, 1 process x 2 threads", "trl", 1, 2),
}


class Worker:
    """The parent's side of one contestant's process and its two named pipes."""

    def __init__(
        self,
        name: str,
        contestant: Contestant,
        workdir: Path,
        steps: int,
        trl_python: str,
        workload: str,
    ) -> None:
        self.name = name
        for end in ("go", "ready"):
            os.mkfifo(workdir / f"{name}.{end}")
        script = [
            __file__,
            *("--worker", name, "--workdir", str(workdir), "--steps", str(steps)),
            *("--workload", workload),
        ]
        if contestant.framework == "trl":
            command = [trl_python, *script]
        elif contestant.processes == 1:
            command = [sys.executable, *script]
        else:
            from nemo_orch.distributed import free_port

            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nproc_per_node={contestant.processes}",
                "--nnodes=1",
                "--master_addr=127.0.0.1",
                f"--master_port={free_port()}",
                *script,
            ]
        self.process = subprocess.Popen(
            command,
            env={
                **os.environ,
                "OMP_NUM_THREADS": str(contestant.threads),
                "TOKENIZERS_PARALLELISM": "false",
            },
        )
        self.ready = os.open(workdir / f"{name}.ready", os.O_RDONLY | os.O_NONBLOCK)
        self._pending = b""
        while True:  # the write end opens once the worker has opened its read end
            try:
                self.go = os.open(workdir / f"{name}.go", os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                self._check_alive()
                time.sleep(0.1)

    def _check_alive(self) -> None:
        if self.process.poll() is not None:
            raise SystemExit(
                f"the {self.name} worker exited ({self.process.returncode}); its output is above"
            )

    def line(self) -> str:
        """The worker's next line: ``ready`` at a step's start, or its results."""
        while b"\n" not in self._pending:
            readable, _, _ = select.select([self.ready], [], [], 1.0)
            if readable:
                self._pending += os.read(self.ready, 1 << 20)
            else:
                self._check_alive()
        line, self._pending = self._pending.split(b"\n", 1)
        return line.decode()

    def step(self) -> str:
        os.write(self.go, b"go\n")
        return self.line()


def summary(name: str, contestant: Contestant, results: dict) -> dict:
    timed = results["steps"][1:]  # the first step warms up
    split = [part for part in timed[0] if part not in ("step", "completions")]
    seconds = [row["step"] for row in timed]
    median = statistics.median(seconds)
    label = (
        contestant.label.replace("TRL", f"TRL {results['trl']}")
        if "trl" in results
        else (contestant.label)
    )
    return {
        "name": name,
        "label": label,
        "framework": contestant.framework,
        "median": median,
        "min": min(seconds),
        "max": max(seconds),
        "completions_per_s": statistics.median(row["completions"] for row in timed) / median,
        "split": {part: statistics.median(row[part] for row in timed) for part in split},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--trl-python",
        default=".venv-trl/bin/python",
        help="python of a virtual environment with requirements-bench-trl.txt",
    )
    parser.add_argument("--steps", type=int, default=8, help="steps each, the first untimed")
    parser.add_argument("--contestants", nargs="+", choices=CONTESTANTS, default=list(CONTESTANTS))
    parser.add_argument("--workload", choices=WORKLOADS, default="arithmetic")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--worker", choices=CONTESTANTS)
    args = parser.parse_args()
    if args.worker is not None:
        contestant = CONTESTANTS[args.worker]
        if contestant.framework == "trl":
            trl_worker(args.workdir, args.worker, args.steps, contestant.threads, args.workload)
        else:
            nemo_worker(
                args.workdir,
                args.worker,
                args.steps,
                contestant.threads,
                contestant.processes,
                args.workload,
            )
        return

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="vs_trl-"))
    workdir.mkdir(parents=True, exist_ok=True)
    prepare(workdir, args.workload)
    workers = [
        Worker(name, CONTESTANTS[name], workdir, args.steps, args.trl_python, args.workload)
        for name in args.contestants
    ]
    for worker in workers:  # each loaded and at its first step's start
        assert worker.line() == "ready"
    results = {}
    for round_ in range(args.steps):
        shift = round_ % len(workers)  # who goes first rotates
        for worker in workers[shift:] + workers[:shift]:
            line = worker.step()  # the next step's start, or the results after the last
            if line != "ready":
                results[worker.name] = json.loads(line)
    for worker in workers:
        if worker.process.wait() != 0:
            raise SystemExit(f"the {worker.name} worker failed")
    (workdir / "results.json").write_text(json.dumps(results, indent=1))
    rows = [summary(name, CONTESTANTS[name], results[name]) for name in args.contestants]
    print(json.dumps(rows))
    shape = WORKLOADS[args.workload]
    print(
        f"\n{args.workload}: {shape.prompts} prompts x {shape.samples} samples of at most "
        f"{shape.max_new_tokens} tokens; {args.steps - 1} timed steps each, alternated; "
        f"{os.cpu_count()} CPUs\n"
    )
    print("| | s/step median (min–max) | completions/s | split (median s) |")
    print("|---|---:|---:|---|")
    for row in rows:
        split = " · ".join(
            f"{part.replace('_', ' + ')} {seconds:.2f}" for part, seconds in row["split"].items()
        )
        print(
            f"| {row['label']} | {row['median']:.2f} ({row['min']:.2f}–{row['max']:.2f}) "
            f"| {row['completions_per_s']:.1f} | {split} |"
        )
    trl_rows = [row for row in rows if row["framework"] == "trl"]
    for row in rows:
        if row["framework"] == "nemo" and trl_rows:
            print(
                f"\n{row['label']} / {trl_rows[0]['label']}, completions/s: "
                f"{row['completions_per_s'] / trl_rows[0]['completions_per_s']:.2f}x"
            )


if __name__ == "__main__":
    main()
