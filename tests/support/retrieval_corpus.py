"""A small labelled corpus for retrieval tests: twelve topic documents, paraphrased questions
that each one answers, and fillers that share generic words with the questions."""

from __future__ import annotations

import json
import random
from pathlib import Path

TOPICS = {
    "photosynthesis": "Photosynthesis lets green plants convert sunlight into chemical energy "
    "stored in glucose, releasing oxygen as a by-product.",
    "volcano": "Volcanoes erupt when molten magma rises through the crust; lava flows and ash "
    "clouds follow the explosion.",
    "rome": "The Western Roman Empire collapsed in 476 when Odoacer deposed the emperor Romulus "
    "Augustulus.",
    "dna": "DNA is a double helix that carries genetic instructions; Watson and Crick described "
    "its structure in 1953.",
    "black-hole": "A black hole is a region of spacetime where gravity is so strong that "
    "nothing, not even light, can escape.",
    "jazz": "Jazz originated in New Orleans among African-American communities, blending blues "
    "and ragtime with improvisation.",
    "penicillin": "Alexander Fleming discovered penicillin in 1928, the first antibiotic able to "
    "kill bacteria.",
    "tides": "Ocean tides are caused by the gravitational pull of the Moon and the Sun acting on "
    "the seas.",
    "printing": "Johannes Gutenberg invented the movable-type printing press around 1440 in Mainz.",
    "glacier": "Glaciers are slowly moving masses of ice that carve valleys as they advance and "
    "retreat.",
    "vaccine": "Vaccination trains the immune system to recognise a pathogen by exposing it to a "
    "harmless antigen.",
    "everest": "Mount Everest, the highest mountain above sea level, was first climbed by "
    "Hillary and Norgay in 1953.",
}
# Paraphrased questions and the document that answers each.
LABELLED = [
    ("how do plants turn light into sugar", "photosynthesis"),
    ("volcanic eruptions of magma", "volcano"),
    ("who deposed the last western roman emperor", "rome"),
    ("genetic molecule with a helical shape", "dna"),
    ("gravitational collapse that traps light", "black-hole"),
    ("improvised music from new orleans", "jazz"),
    ("discovery of penicillin", "penicillin"),
    ("what makes the sea rise and fall with the moon", "tides"),
    ("Gutenberg movable type", "printing"),
    ("ice carving valleys", "glacier"),
    ("immunization against pathogens", "vaccine"),
    ("first ascent of the highest peak", "everest"),
]
# Distractors sharing generic words ("first", "light", "music", "sea") with the questions.
SUBJECTS = (
    "market bank loan football league bridge poem novel painting museum harbor festival "
    "tax coffee bread cheese election parliament railway orchestra recipe garden tennis "
    "castle village factory newspaper theatre"
).split()
GENERIC = "first light energy discovery music sea system new history people large".split()
VERBS = "opened grew changed closed expanded hosted attracted financed".split()


def make_corpus(path: Path, fillers: int = 300) -> Path:
    rng = random.Random(0)
    records = [{"id": doc_id, "text": text} for doc_id, text in TOPICS.items()]
    for i in range(fillers):
        a, b, c = rng.sample(SUBJECTS, 3)
        g1, g2 = rng.sample(GENERIC, 2)
        records.append(
            {
                "id": f"filler-{i:03d}",
                "title": f"{a.title()} news",
                "text": f"The {a} {rng.choice(VERBS)} the {g1} {b} in "
                f"{rng.randint(1800, 2020)}, and the {c} brought {g2} visitors.",
            }
        )
    rng.shuffle(records)
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path
