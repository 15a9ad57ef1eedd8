"""The long-context ladder's prompts, generated from a seed so that the battery file stays a few lines: a ship's
log of about N words (every entry names the ship), a corpus-unique needle (a vault code) at a depth in it, and
two questions: the code (the needle) and the ship (the document). A reply that gets the code and not the ship is
the fast-prefill failure signature (seed §10): exact copying survived, reading the document did not."""

from __future__ import annotations

import random
from typing import Any

SHIPS = ("Albatross", "Meridian", "Corvina", "Halcyon", "Tamarisk", "Osprey", "Lodestar", "Wayfarer")
PORTS = (
    "Lisbon",
    "Valletta",
    "Bergen",
    "Genoa",
    "Tangier",
    "Cadiz",
    "Marseille",
    "Naples",
    "Tromso",
    "Brest",
)
WEATHER = (
    "a grey swell",
    "fog at dawn",
    "a steady westerly",
    "squalls from the north",
    "flat calm",
    "light rain",
)
CARGO = ("salt cod", "olive oil", "timber", "wool bales", "copper wire", "barrels of wine", "sacks of grain")
CREW = ("the cook", "the bosun", "the first mate", "the carpenter", "the navigator", "the youngest deckhand")
DEEDS = (
    "mended a torn sail",
    "counted the water casks twice",
    "sang while hauling the lines",
    "checked the charts against the stars",
    "scrubbed the deck before noon",
    "complained about the biscuits",
)
LETTERS = "BCDFGHJKLMNPQRSTVWXZ"


def _entry(rng: random.Random, ship: str, day: int) -> str:
    return (
        f"Day {_word_number(day)} aboard the {ship}. We met {rng.choice(WEATHER)} on the way to "
        f"{rng.choice(PORTS)} with {rng.choice(CARGO)} in the hold, and {rng.choice(CREW)} {rng.choice(DEEDS)}."
    )


def _word_number(n: int) -> str:
    # the log spells its days out, so that no digit of the document can be mistaken for a piece of the needle
    ones = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
    return "-".join(ones[int(d)] for d in str(n))


def build(spec: Any) -> tuple[str, dict[str, Any]]:
    """(prompt, needle check) for {"words": N, "depth": D, "seed": S}; ValueError on a bad spec."""
    if not isinstance(spec, dict) or set(spec) - {"words", "depth", "seed"}:
        raise ValueError('longctx must be an object of "words", "depth" and "seed"')
    words, depth, seed = spec.get("words"), spec.get("depth"), spec.get("seed", 0)
    if not isinstance(words, int) or isinstance(words, bool) or not 20 <= words <= 200_000:
        raise ValueError("longctx words must be an integer in [20, 200000]")
    if not isinstance(depth, (int, float)) or isinstance(depth, bool) or not 0 <= depth <= 1:
        raise ValueError("longctx depth must be a number in [0, 1]")
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError("longctx seed must be an integer")
    rng = random.Random(f"longctx:{seed}:{words}:{depth}")
    ship = rng.choice(SHIPS)
    entries: list[str] = []
    count = 0
    while count < words:
        entries.append(_entry(rng, ship, len(entries) + 1))
        count += len(entries[-1].split())
    code = f"{rng.randint(1000, 9999)}-{''.join(rng.choice(LETTERS) for _ in range(3))}"
    needle = f"The vault code is {code}."
    doc = " ".join(entries)
    if code in doc:  # cannot happen (the log holds no digits); the needle must be unique in its corpus
        raise AssertionError("the needle occurs in its haystack")
    entries.insert(round(depth * len(entries)), needle)
    prompt = (
        "Read this ship's log.\n\n"
        + "\n".join(entries)
        + "\n\nAnswer two questions on one line, as CODE; SHIP. "
        "What is the vault code? What is the name of the ship whose log this is?"
    )
    return prompt, {"kind": "needle", "needle": code, "document": ship}
