"""Haystack text made here, deterministic by seed: no corpus is downloaded.

Each kind is an endless stream of *units* (a sentence or a line, each carrying its own trailing
separator) so a context is the first k units and a needle goes in between two units. Kinds:
  grass  the passkey papers' repeated essay ("The grass is green. The sky is blue. ...")
  prose  varied sentences built from word banks (a different sentence almost every time)
  code   Python-like lines: defs, assignments, loops, returns
"""
from __future__ import annotations

import random
from typing import Iterator

GRASS = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")

ADJECTIVES = (
    "quiet ancient bright careful distant early famous gentle hidden honest large little narrow "
    "northern old patient proud rapid rare silent simple small steady strange sudden tall thick "
    "warm wide wild young broken calm clever crowded empty golden heavy hollow humble lonely "
    "modern muddy noble plain polite rough rusty sharp shy slow smooth soft sour spare stiff "
    "sturdy swift tired tiny vast weary wooden"
).split()
NOUNS = (
    "river mountain village garden teacher farmer window bridge harbor library market forest "
    "engine letter island kitchen ladder meadow mirror orchard painter pencil pilot "
    "planet pocket puzzle rabbit road sailor school shadow shelf signal station stone storm "
    "street student summer table tower train tunnel valley wagon winter wizard basket blanket "
    "candle castle cellar chimney cloud compass desert doctor feather fountain hammer helmet "
    "lantern lighthouse merchant monastery notebook ocean palace parrot pebble quarry saddle "
    "scholar shepherd soldier spoon temple thunder traveler violin weaver"
).split()
VERBS = (
    "watched carried followed painted crossed measured repaired visited described remembered "
    "admired built cleaned counted delivered found guarded helped imagined lifted noticed "
    "opened ordered planted pulled pushed reached studied touched traded wrapped"
).split()
PLACES = (
    "near the old mill", "beyond the hills", "after the long rain", "before dawn", "in the valley",
    "along the coast", "under the bridge", "across the square", "during the festival",
    "behind the station", "at the edge of town", "in the quiet evening", "by the northern gate",
)
OPENERS = ("", "", "", "Later, ", "Every morning, ", "In those years, ", "Without a word, ",
           "As expected, ", "Once again, ", "By the end of the week, ")

KINDS = ("grass", "prose", "code")


def units(kind: str, seed: int) -> Iterator[str]:
    """An endless, deterministic stream of haystack units of the given kind."""
    if kind == "grass":
        return _grass()
    if kind == "prose":
        return _prose(random.Random(f"prose-{seed}"))
    if kind == "code":
        return _code(random.Random(f"code-{seed}"))
    raise ValueError(f"unknown filler kind {kind!r} (known: {', '.join(KINDS)})")


def take(kind: str, seed: int, n: int) -> list[str]:
    it = units(kind, seed)
    return [next(it) for _ in range(n)]


def _grass() -> Iterator[str]:
    while True:
        yield GRASS


def _prose(rng: random.Random) -> Iterator[str]:
    while True:
        a, b = rng.sample(NOUNS, 2)
        s = (f"{rng.choice(OPENERS)}the {rng.choice(ADJECTIVES)} {a} {rng.choice(VERBS)} the "
             f"{rng.choice(ADJECTIVES)} {b} {rng.choice(PLACES)}.")
        yield s[0].upper() + s[1:] + " "


def _code(rng: random.Random) -> Iterator[str]:
    names = [f"{rng.choice(ADJECTIVES)}_{rng.choice(NOUNS)}" for _ in range(64)]
    while True:
        f, x, y = rng.choice(names), rng.choice(names), rng.choice(names)
        yield rng.choice((
            f"def {f}({x}, {y}):\n",
            f"    {x} = {y} * {rng.randint(2, 97)} + {rng.randint(0, 999)}\n",
            f"    if {x} > {rng.randint(1, 500)}:\n        return {y}\n",
            f"    for i in range({rng.randint(2, 64)}):\n        {x}.append(i)\n",
            f"    return {x} - {y}\n",
            f"{x} = {f}({y}, {rng.randint(0, 99)})\n",
        ))


def words(rng: random.Random, n: int) -> list[str]:
    """n distinct single words (adjectives and nouns): keys for needles, items for word lists."""
    return rng.sample(sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS)), n)


def key_phrases(rng: random.Random, n: int) -> list[str]:
    """n distinct two-word keys like 'rusty-lantern' (RULER uses words as needle keys)."""
    out: list[str] = []
    while len(out) < n:
        k = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if k not in out:
            out.append(k)
    return out
