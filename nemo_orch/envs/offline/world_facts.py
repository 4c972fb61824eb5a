"""The made-up world the offline tasks look facts up in: entities, their facts and passages.

Countries, companies, books and mountains with invented names, each relation (a capital, a founder,
a founding year, an author, a height) fixed per entity: the world is drawn from fixed seeds, not
from any task stream, so the same entity always has the same facts. :func:`world_documents` is the
bundled retrieval corpus (``conf/tools/offline/world.jsonl``) and :func:`world_passage` what a
search with one of the world's own queries finds. The tasks that ask about it are drawn in
:mod:`.task_families`.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass

_SYLLABLES = tuple(
    "vre kos ta mer os ter ha ven bra lin dor ka vel mi ra zan tol qui fen gar ul sen bo rik thal"
    " mor pel yss ne dra cor vin lu sha tem wyn es gal tor im".split()
)
_COUNTRY_SUFFIXES = ("land", "ia", "mark", "stan", "or", "ene")
_COMPANY_SUFFIXES = ("Labs", "Industries", "Systems", "Works", "Robotics", "Foods")
_BOOK_NOUNS = ("Lantern", "Harbor", "Orchard", "Cipher", "Meadow", "Engine", "Tide", "Archive")
_BOOK_ADJECTIVES = ("Silent", "Last", "Crimson", "Hollow", "Northern", "Glass", "Quiet")


def made_up_name(rng: random.Random, syllables: int) -> str:
    """An invented word of ``syllables`` syllables, capitalized."""
    return "".join(rng.choice(_SYLLABLES) for _ in range(syllables)).capitalize()


def person_name(rng: random.Random) -> str:
    """An invented first and last name."""
    return f"{made_up_name(rng, rng.randint(1, 2))} {made_up_name(rng, rng.randint(2, 3))}"


def city_name(rng: random.Random) -> str:
    """An invented city name."""
    return made_up_name(rng, rng.randint(2, 3)) + rng.choice(
        ("", "", " City", "haven", "burg", "port")
    )


@dataclass(frozen=True)
class Relation:
    """A fact type: how to make its value, ask about it, search it and state it."""

    name: str
    kind: str
    value: Callable[[random.Random], str]
    questions: tuple[str, ...]
    queries: tuple[str, ...]
    passages: tuple[str, ...]


RELATIONS = {
    relation.name: relation
    for relation in (
        Relation(
            name="capital",
            kind="country",
            value=city_name,
            questions=(
                "What is the capital of {e}?",
                "Which city is the capital of {e}?",
                "Name the capital of {e}.",
            ),
            queries=("capital of {e}", "{e} capital city"),
            passages=(
                "The capital of {e} is {v}.",
                "{e} is a small nation whose capital is {v}.",
                "{v} has been the capital of {e} since its independence.",
            ),
        ),
        Relation(
            name="founder",
            kind="company",
            value=person_name,
            questions=("Who founded {e}?", "Who is the founder of {e}?", "Who started {e}?"),
            queries=("founder of {e}", "{e} founder"),
            passages=(
                "{e} was founded by {v}.",
                "{v} founded {e} and led it for a decade.",
                "The founder of {e} is {v}.",
            ),
        ),
        Relation(
            name="founded",
            kind="company",
            value=lambda rng: str(rng.randint(1820, 2015)),
            questions=(
                "In what year was {e} founded?",
                "When was {e} founded?",
                "What is the founding year of {e}?",
            ),
            queries=("{e} founding year", "when was {e} founded"),
            passages=(
                "{e} was founded in {v}.",
                "Founded in {v}, {e} is known for its products.",
                "{e} opened its doors in {v}.",
            ),
        ),
        Relation(
            name="author",
            kind="book",
            value=person_name,
            questions=("Who wrote {e}?", "Who is the author of {e}?", "Which writer wrote {e}?"),
            queries=("author of {e}", "{e} author"),
            passages=("{e} is a novel by {v}.", "{v} wrote {e}.", "The author of {e} is {v}."),
        ),
        Relation(
            name="height",
            kind="mountain",
            value=lambda rng: str(rng.randint(800, 8000)),
            questions=(
                "How high is {e} in meters?",
                "What is the height of {e} in meters?",
                "How tall is {e}, in meters?",
            ),
            queries=("height of {e}", "{e} elevation"),
            passages=(
                "{e} rises {v} meters above sea level.",
                "The height of {e} is {v} meters.",
                "{e} is {v} meters high.",
            ),
        ),
    )
}


def _entity(rng: random.Random, kind: str) -> str:
    if kind == "country":
        return made_up_name(rng, rng.randint(1, 2)) + rng.choice(_COUNTRY_SUFFIXES)
    if kind == "company":
        return f"{made_up_name(rng, rng.randint(2, 3))} {rng.choice(_COMPANY_SUFFIXES)}"
    if kind == "book":
        adjective, noun = rng.choice(_BOOK_ADJECTIVES), rng.choice(_BOOK_NOUNS)
        return f"The {adjective} {noun} of {made_up_name(rng, 2)}"
    return f"Mount {made_up_name(rng, rng.randint(2, 3))}"


# The world is finite, so the bundled corpus (conf/tools/offline/world.jsonl) holds every fact a
# task can ask about. (Larger worlds make BM25 confuse a company with a person of the same name
# and a company's founder with its founding year: at 400 entities 1% of lookups fail.)
WORLD_ENTITIES_PER_RELATION = 200


@functools.cache
def world_entities(relation: str) -> tuple[str, ...]:
    """The distinct entities of the world the relation named ``relation`` is about, in a fixed
    order."""
    kind = RELATIONS[relation].kind
    entities: dict[str, None] = {}  # distinct names, in a fixed order
    for index in itertools.count():
        if len(entities) == WORLD_ENTITIES_PER_RELATION:
            return tuple(entities)
        entities[_entity(random.Random(f"world|{relation}|{index}"), kind)] = None
    raise AssertionError("unreachable")


def fact_passage(relation: Relation, entity: str) -> tuple[str, str]:
    """The fact's value and the one passage stating it (fixed: the world does not change)."""
    world = random.Random(f"{relation.name}|{entity}")
    value = relation.value(world)
    return value, world.choice(relation.passages).format(e=entity, v=value)


@functools.cache
def _passages_by_query() -> dict[str, str]:
    return {
        query.format(e=entity): fact_passage(relation, entity)[1]
        for relation in RELATIONS.values()
        for entity in world_entities(relation.name)
        for query in relation.queries
    }


def world_passage(query: str) -> str:
    """The passage of the world a search with one of its own queries finds."""
    return _passages_by_query()[query]


def world_documents() -> list[dict[str, str]]:
    """Every passage of the world, as a retrieval corpus (``{"id", "text"}``): what the offline
    ``search`` tool serves (``conf/tools/offline/world.jsonl``)."""
    return [
        {"id": f"{name}-{index:03d}", "text": fact_passage(relation, entity)[1]}
        for name, relation in RELATIONS.items()
        for index, entity in enumerate(world_entities(name))
    ]
