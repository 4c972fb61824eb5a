"""The task families of the offline world, each task drawn with the tool steps that solve it.

* arithmetic: ``python_sandbox`` runs ``print(<expression>)``; the response is what Python prints;
* lookup: ``search`` for a fact about a made-up entity (:mod:`.world_facts`); the response is a
  short passage stating it;
* lookup then arithmetic: ``search``, then ``python_sandbox`` on the number found;
* hard math (number theory with answers computed here): ``call_expert`` with ``math-small`` or
  ``math-large``; word puzzles: ``call_expert`` with ``generalist``.

The same family mix feeds the demonstration conversations (:mod:`.generator`) and the rollout
tasks (:func:`draw_task`, :class:`OfflineTask`); :func:`copy_span` draws the kinds of text a
route copies, for the copy exercises.
"""

from __future__ import annotations

import bisect
import math
import operator
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from nemo_orch.envs.offline.world_facts import (
    RELATIONS,
    Relation,
    city_name,
    fact_passage,
    made_up_name,
    person_name,
    world_entities,
)

# Preference instructions by kind; the demonstrated choice of tool and expert follows the kind.
# The preferences a conversation states (their phrasings: PREFERENCE_PHRASES).
CONVERSATION_PREFERENCES = ("cost", "accuracy", "no_search", "neutral")


@dataclass
class ToolStep:
    """One tool call and the tool's response."""

    tool: str
    arguments: dict[str, Any]
    observation: str


@dataclass
class SolvedTask:
    """A question, the tool steps that answer it and the preference kinds it may be paired with.

    Expert tasks have no steps: their one ``call_expert`` step is made once the preference is
    drawn (:mod:`.generator`).
    """

    question: str
    steps: list[ToolStep]
    answer: str
    preferences: tuple[str, ...] = CONVERSATION_PREFERENCES
    # For expert tasks, whose model follows the preference: (easy model, hard model, is hard).
    expert_choice: tuple[str, str, bool] | None = None
    # For lookups: the fact the task hinges on, stated by the search step's passage, and how
    # hard the task is for an expert handed that passage.
    evidence: str | None = None
    evidence_difficulty: str = "easy"
    # A Python program printing the answer (what a coder behind `enhance_reasoning` writes), and
    # the fact it needs to have been read first (lookup then compute).
    program: str | None = None
    needs: str | None = None
    # A plausible search for the wrong entity (what a query writer gets wrong).
    decoy: str = ""
    # The program written without the fact it needs (a guessed one) and what it prints.
    blind: tuple[str, str] | None = None


# ----------------------------------------------------------------------------- arithmetic

_OPERATORS: dict[str, Callable[[int, int], int]] = {
    "+": operator.add,
    "-": operator.sub,
    "*": operator.mul,
    "//": operator.floordiv,
    "%": operator.mod,
    "**": operator.pow,
}
_WORDED = {
    "+": ("What is {a} plus {b}?", "What is the sum of {a} and {b}?", "Add {a} and {b}."),
    "-": ("What is {a} minus {b}?", "Subtract {b} from {a}.", "What is {a} take away {b}?"),
    "*": ("What is the product of {a} and {b}?", "What is {a} times {b}?", "Multiply {a} by {b}."),
    "//": (
        "What is {a} divided by {b}, rounded down?",
        "How many whole times does {b} go into {a}?",
    ),
    "%": ("What is the remainder when {a} is divided by {b}?", "What is {a} modulo {b}?"),
    "**": ("What is {a} to the power of {b}?", "What is {a} raised to the power {b}?"),
}
_SYMBOLIC = (
    "What is {e}?",
    "Compute {e}.",
    "Calculate {e} exactly.",
    "What does {e} evaluate to?",
    "I need the exact value of {e}.",
    "Evaluate the expression {e}.",
    "Quick calculation: {e} = ?",
    "Please work out {e}.",
    "{e}",
)


class _Expr(NamedTuple):
    source: str
    value: int
    is_number: bool

    def operand(self) -> str:
        return self.source if self.is_number else f"({self.source})"


def _number(rng: random.Random, low: int, high: int) -> _Expr:
    value = rng.randint(low, high)
    return _Expr(str(value), value, True)


def _expression(rng: random.Random, depth: int) -> _Expr:
    """A random integer expression in Python syntax, with its value."""
    if depth == 0 or rng.random() < 0.25:
        return _number(rng, 2, rng.choice((20, 100, 1000, 100000)))
    op = rng.choice(tuple(_OPERATORS))
    if op == "**":  # small powers only: a readable, bounded value
        left, right = _number(rng, 2, 40), _number(rng, 2, 4)
    elif op in ("//", "%"):
        left, right = _expression(rng, depth - 1), _number(rng, 2, 97)
    else:
        left, right = _expression(rng, depth - 1), _expression(rng, depth - 1)
    source = f"{left.operand()} {op} {right.operand()}"
    return _Expr(source, _OPERATORS[op](left.value, right.value), False)


def _arithmetic(rng: random.Random) -> SolvedTask:
    if rng.random() < 0.35:
        op = rng.choice(tuple(_OPERATORS))
        a = rng.randint(2, 40) if op == "**" else rng.randint(2, 5000)
        b = rng.randint(2, 4) if op == "**" else rng.randint(2, 500)
        source, value = f"{a} {op} {b}", _OPERATORS[op](a, b)
        question = rng.choice(_WORDED[op]).format(a=a, b=b)
    else:
        source, value, bare = _expression(rng, depth=rng.randint(1, 3))
        # Short enough answers to copy; an operation, not a number that answers itself.
        while abs(value) > 10**15 or bare:
            source, value, bare = _expression(rng, depth=rng.randint(1, 3))
        shown = source.replace("*", "×") if "**" not in source and rng.random() < 0.2 else source
        question = rng.choice(_SYMBOLIC).format(e=shown)
    step = ToolStep("python_sandbox", {"code": f"print({source})"}, str(value))
    return SolvedTask(question, [step], str(value), program=f"result = {source}\nprint(result)")


# ----------------------------------------------------------------------------- lookup


def _fact(rng: random.Random, relation: Relation) -> tuple[str, str, ToolStep, str]:
    """An entity of the world, its fact, the search step that finds it and the same search for
    another entity (drawn from the entity, not from the task stream)."""
    entity = rng.choice(world_entities(relation.name))
    value, passage = fact_passage(relation, entity)
    template = rng.choice(relation.queries)
    decoy = random.Random(f"decoy|{relation.name}|{entity}").choice(
        [other for other in world_entities(relation.name) if other != entity]
    )
    return (
        entity,
        value,
        ToolStep("search", {"query": template.format(e=entity)}, passage),
        template.format(e=decoy),
    )


# Looking facts up is what search is for, so these tasks never forbid it.
_LOOKUP_PREFERENCES = ("cost", "accuracy", "neutral")


def _lookup(rng: random.Random) -> SolvedTask:
    relation = rng.choice(tuple(RELATIONS.values()))
    entity, value, step, decoy = _fact(rng, relation)
    question = rng.choice(relation.questions).format(e=entity)
    # Reading the fact off the passage is a language task.
    return SolvedTask(
        question,
        [step],
        value,
        preferences=_LOOKUP_PREFERENCES,
        evidence=value,
        evidence_difficulty="language",
        decoy=decoy,
    )


def _lookup_then_compute(rng: random.Random) -> SolvedTask:
    if rng.random() < 0.5:
        entity, year, search, decoy = _fact(rng, RELATIONS["founded"])
        now = rng.randint(2020, 2030)
        question = rng.choice(
            ("How many years before {now} was {e} founded?", "How old will {e} be in {now}?")
        ).format(e=entity, now=now)
        code, value, fact = f"print({now} - {year})", now - int(year), year
        program = "year = {}\nresult = " + f"{now} - year\nprint(result)"
        guess = _guess(entity, int(year))
        blind = program.format(guess), str(now - guess)
        program = program.format(year)
    else:
        entity, meters, search, decoy = _fact(rng, RELATIONS["height"])
        question = rng.choice(
            (
                "How high is {e} in feet, rounded to the nearest foot?",
                "What is the height of {e} in feet (1 m = 3.28084 ft), rounded?",
            )
        ).format(e=entity)
        code, value = f"print(round({meters} * 3.28084))", round(int(meters) * 3.28084)
        fact = meters
        program = "meters = {}\nresult = round(meters * 3.28084)\nprint(result)"
        guess = _guess(entity, int(meters))
        blind = program.format(guess), str(round(guess * 3.28084))
        program = program.format(meters)
    compute = ToolStep("python_sandbox", {"code": code}, str(value))
    return SolvedTask(
        question,
        [search, compute],
        str(value),
        preferences=_LOOKUP_PREFERENCES,
        evidence=fact,
        program=program,
        needs=fact,
        decoy=decoy,
        blind=blind,
    )


def _guess(entity: str, fact: int) -> int:
    """A wrong value of a numeric fact, drawn from the entity (not from the task stream)."""
    shift = random.Random(f"guess|{entity}").randint(1, max(2, fact // 10))
    return fact + random.Random(f"sign|{entity}").choice((-1, 1)) * shift


# ----------------------------------------------------------------------------- experts


def _primes_below(limit: int) -> list[int]:
    sieve = bytearray([1]) * limit
    sieve[:2] = b"\x00\x00"
    for p in range(2, math.isqrt(limit - 1) + 1):
        if sieve[p]:
            sieve[p * p :: p] = bytes(len(range(p * p, limit, p)))
    return [n for n in range(limit) if sieve[n]]


_PRIMES = _primes_below(120_000)


def _totient(n: int) -> int:
    result, rest = n, n
    for p in _PRIMES:
        if p * p > rest:
            break
        if rest % p == 0:
            result -= result // p
            while rest % p == 0:
                rest //= p
    return result - result // rest if rest > 1 else result


def _fibonacci_mod(n: int, m: int) -> int:
    """F(n) mod m by fast doubling: F(2k) = F(k)(2F(k+1) - F(k)), F(2k+1) = F(k)^2 + F(k+1)^2."""
    a, b = 0, 1  # F(k), F(k+1) for k = the bits of n read so far
    for bit in bin(n)[2:]:
        a, b = a * (2 * b - a) % m, (a * a + b * b) % m
        if bit == "1":
            a, b = b, (a + b) % m
    return a


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


_SIEVE = (
    "sieve = bytearray([1]) * 120000\nfor p in range(2, 347):\n"
    "    sieve[p * p::p] = bytes(len(sieve[p * p::p]))\n"
    "primes = [n for n in range(2, 120000) if sieve[n]]\n"
)
_PROGRAMS = (
    _SIEVE + "result = primes[{n} - 1]",
    _SIEVE + "result = sum(1 for p in primes if p < {n})",
    "result = pow({a}, {b}, {m})",
    "n = rest = result = {n}\np = 2\nwhile p * p <= rest:\n    if rest % p == 0:\n"
    "        result -= result // p\n        while rest % p == 0:\n            rest //= p\n"
    "    p += 1\nif rest > 1:\n    result -= result // rest",
    "n, result, power = {n}, 0, 5\nwhile power <= n:\n    result += n // power\n    power *= 5",
    "result = sum(int(digit) for digit in str(2 ** {k}))",
    "a, b = 0, 1\nfor _ in range({n}):\n    a, b = b, (a + b) % {m}\nresult = a",
)


def _math_problem(rng: random.Random) -> tuple[str, int, bool, str]:
    """A number-theory question, its answer, whether it is hard (for the expert choice) and a
    program that prints the answer."""
    kind = rng.randrange(7)
    if kind == 0:
        n = rng.randint(50, 10_000)
        found = f"What is the {_ordinal(n)} prime number?", _PRIMES[n - 1], n > 2000, {"n": n}
    elif kind == 1:
        n = rng.randint(1_000, 120_000)
        count = bisect.bisect_left(_PRIMES, n)
        found = f"How many prime numbers are there below {n}?", count, n > 30_000, {"n": n}
    elif kind == 2:
        a, b, m = rng.randint(2, 999), rng.randint(100, 10**6), rng.randint(7, 10**5)
        found = f"What is {a}^{b} mod {m}?", pow(a, b, m), b > 10**4, {"a": a, "b": b, "m": m}
    elif kind == 3:
        n = rng.randint(100, 10**7)
        found = f"What is Euler's totient of {n}?", _totient(n), n > 10**5, {"n": n}
    elif kind == 4:
        n = rng.randint(100, 10**6)
        zeros = sum(n // 5**k for k in range(1, 10))
        found = f"How many trailing zeros does {n}! have?", zeros, n > 10**4, {"n": n}
    elif kind == 5:
        k = rng.randint(50, 2000)
        found = (
            f"What is the sum of the digits of 2^{k}?",
            sum(map(int, str(2**k))),
            k > 500,
            {"k": k},
        )
    else:
        n, m = rng.randint(100, 100_000), rng.randint(10, 10**6)
        found = (
            f"What is the {_ordinal(n)} Fibonacci number modulo {m}, with F(1) = F(2) = 1?",
            _fibonacci_mod(n, m),
            n > 10_000,
            {"n": n, "m": m},
        )
    question, answer, hard, values = found
    return question, answer, hard, _PROGRAMS[kind].format(**values) + "\nprint(result)"


def _math_expert(rng: random.Random) -> SolvedTask:
    question, answer, hard, program = _math_problem(rng)
    return SolvedTask(
        question, [], str(answer), expert_choice=("math-small", "math-large", hard), program=program
    )


_WORDS = tuple(
    "orchestra lantern harbor meadow cipher archive balloon mississippi banana committee parallel"
    " tomato whisper galaxy ledger puzzle".split()
)


def _word_puzzle(rng: random.Random) -> SolvedTask:
    word = (
        rng.choice(_WORDS) if rng.random() < 0.5 else made_up_name(rng, rng.randint(2, 4)).lower()
    )
    kind = rng.randrange(4)
    if kind == 0:
        question, answer = f"Spell the word '{word}' backwards.", word[::-1]
        computed = f"{word!r}[::-1]"
    elif kind == 1:
        question, answer = f"How many letters are in the word '{word}'?", str(len(word))
        computed = f"len({word!r})"
    elif kind == 2:
        letter = rng.choice(word)
        question = f"How many times does the letter '{letter}' appear in '{word}'?"
        answer, computed = str(word.count(letter)), f"{word!r}.count({letter!r})"
    else:
        words = rng.sample(_WORDS, rng.randint(3, 5))
        question = f"Sort these words alphabetically: {', '.join(words)}."
        answer, computed = ", ".join(sorted(words)), f"', '.join(sorted({words!r}))"
    return SolvedTask(
        question,
        [],
        answer,
        expert_choice=("generalist", "generalist", False),
        program=f"result = {computed}\nprint(result)",
    )


# ----------------------------------------------------------------------------- assembly

_FAMILIES: tuple[tuple[Callable[[random.Random], SolvedTask], float], ...] = (
    (_arithmetic, 0.3),
    (_lookup, 0.28),
    (_lookup_then_compute, 0.12),
    (_math_expert, 0.22),
    (_word_puzzle, 0.08),
)
FAMILY_NAMES = {
    _arithmetic: "arithmetic",
    _lookup: "lookup",
    _lookup_then_compute: "lookup_compute",
    _math_expert: "math",
    _word_puzzle: "word",
}


def draw_solved_task(
    rng: random.Random,
) -> tuple[Callable[[random.Random], SolvedTask], SolvedTask]:
    """A family by its weight, and a task of it."""
    families, weights = zip(*_FAMILIES)
    make_task = rng.choices(families, weights)[0]
    return make_task, make_task(rng)


@dataclass(frozen=True)
class OfflineTask:
    """A task of the offline world for rollouts: its family, the exact-tool route that solves it
    (empty when only an expert can), how hard it is for an expert (``easy``, ``hard``, or
    ``unknown``: facts of the made-up world no model knows) and the preference kinds it may get.
    Lookups also name their ``evidence`` (the fact), the ``evidence_route`` that retrieves it
    and the ``evidence_difficulty`` of the task for an expert handed that passage. ``program``
    prints the answer (None for lookups: no program knows the made-up world), once it has read
    the fact it ``needs``; ``query`` is what finds the fact and ``decoy`` a plausible search
    for the wrong entity (both the question for tasks that look nothing up)."""

    family: str
    question: str
    answer: str
    route: tuple[tuple[str, dict[str, Any]], ...]
    difficulty: str
    preferences: tuple[str, ...]
    evidence: str | None = None
    evidence_route: tuple[tuple[str, dict[str, Any]], ...] = ()
    evidence_difficulty: str = "easy"
    program: str | None = None
    needs: str | None = None
    blind: tuple[str, str] | None = None
    query: str = ""
    decoy: str = ""


def draw_task(rng: random.Random) -> OfflineTask:
    """One task from the same family mix as the demonstrations."""
    make_task, task = draw_solved_task(rng)
    family = FAMILY_NAMES[make_task]
    if family == "word":
        difficulty = "language"
    elif task.expert_choice is not None:
        difficulty = "hard" if task.expert_choice[2] else "easy"
    else:
        difficulty = "unknown" if family.startswith("lookup") else "easy"
    # The route searches for the question itself (the offline search's default query): BM25
    # finds the fact from it.
    route = tuple(
        ("search", {}) if step.tool == "search" else (step.tool, step.arguments)
        for step in task.steps
    )
    evidence_route = tuple(step for step in route if step[0] == "search")
    query, decoy = _queries(task)
    return OfflineTask(
        family,
        task.question,
        task.answer,
        route,
        difficulty,
        task.preferences,
        task.evidence,
        evidence_route,
        task.evidence_difficulty,
        task.program,
        task.needs,
        task.blind,
        query,
        decoy,
    )


def _queries(task: SolvedTask) -> tuple[str, str]:
    """The query that finds the task's fact and :attr:`SolvedTask.decoy`; the question twice for
    a task that looks nothing up."""
    search = next((step for step in task.steps if step.tool == "search"), None)
    if search is None:
        return task.question, task.question
    return search.arguments["query"], task.decoy


def copy_span(rng: random.Random) -> str:
    """Text of the kinds routes copy: names, numbers, expressions, questions, word lists."""
    kind = rng.randrange(6)
    if kind == 0:
        relation = rng.choice(tuple(RELATIONS.values()))
        entity = rng.choice(world_entities(relation.name))
        return rng.choice((entity, fact_passage(relation, entity)[0]))
    if kind == 1:
        return person_name(rng) if rng.random() < 0.5 else city_name(rng)
    if kind == 2:
        return str(rng.randint(-(10 ** rng.randint(1, 4)), 10 ** rng.randint(1, 10)))
    if kind == 3:
        return _expression(rng, depth=rng.randint(1, 3)).source
    if kind == 4:
        return draw_solved_task(rng)[1].question
    return ", ".join(rng.sample(_WORDS, rng.randint(2, 5)))
