"""Task generators: passkey and RULER-style needles, variable tracking, common-words extraction.

Every generator takes (renderer, length, depth, filler kind, rng) and returns one Case whose prompt
has at most `length - max_new_tokens` tokens (so prompt + answer fit a context of `length`) and at
least that minus one haystack unit. Wording follows RULER (Hsieh et al. 2024) and the passkey test
(Mohtashami & Jaggi 2023), with an answer prefix so that answering is continuing a sentence.
"""
from __future__ import annotations

import random
import string
from typing import Callable, Optional, Sequence

from . import filler
from .cases import Case, Haystack, Renderer, fit_to_length

MAGIC_INSTRUCTION = ("Some special magic numbers are hidden within the following text. Make sure to memorize "
                     "it. I will quiz you about the numbers afterwards.")


def _needle_case(renderer: Renderer, length: int, kind: str, rng: random.Random, *, task: str,
                 needles: Sequence[tuple[float, str]], answers: list[str], question: str, answer_prefix: str,
                 instruction: str, max_new_tokens: int, depth: Optional[float]) -> Case:
    """A haystack of `kind` with needles at their depths, fitted to the length."""
    hay = Haystack(kind, rng.randrange(1 << 30), renderer.tokenizer)

    def build(k: int) -> Case:
        context, placed = hay.build(k, needles)
        return Case(task=task, context=context, question=question, answers=answers, answer_prefix=answer_prefix,
                    instruction=instruction, max_new_tokens=max_new_tokens,
                    meta={"depth": depth, "filler": kind, "needles": placed})

    return fit_to_length(build, renderer, length - max_new_tokens)


def _magic_number(rng: random.Random) -> str:
    return str(rng.randint(1_000_000, 9_999_999))


def _spread(rng: random.Random, n: int, fixed: Optional[float] = None) -> list[float]:
    """n depths in [0.05, 0.95], the first one `fixed` when given (the queried needle's depth)."""
    out = [round(rng.uniform(0.05, 0.95), 3) for _ in range(n)]
    if fixed is not None:
        out[0] = fixed
    return out


def passkey(renderer: Renderer, length: int, depth: float, kind: str, rng: random.Random) -> Case:
    key = str(rng.randint(10_000, 99_999))
    return _needle_case(
        renderer, length, kind, rng, task="passkey", depth=depth,
        needles=[(depth, f"The pass key is {key}. Remember it. {key} is the pass key.")], answers=[key],
        instruction=("There is an important piece of information hidden inside a lot of irrelevant text. "
                     "Find it and memorize it. I will quiz you about the important information there."),
        question="What is the pass key?", answer_prefix="The pass key is", max_new_tokens=12)


def niah_single(renderer: Renderer, length: int, depth: float, kind: str, rng: random.Random) -> Case:
    key, value = filler.key_phrases(rng, 1)[0], _magic_number(rng)
    return _needle_case(
        renderer, length, kind, rng, task="niah", depth=depth,
        needles=[(depth, f"One of the special magic numbers for {key} is: {value}.")], answers=[value],
        instruction=MAGIC_INSTRUCTION,
        question=f"What is the special magic number for {key} mentioned in the provided text?",
        answer_prefix=f"The special magic number for {key} mentioned in the provided text is", max_new_tokens=16)


def niah_multikey(renderer: Renderer, length: int, depth: float, kind: str, rng: random.Random,
                  n_keys: int = 4) -> Case:
    """One queried needle at `depth` among n_keys - 1 distractor needles with other keys."""
    keys = filler.key_phrases(rng, n_keys)
    values = [_magic_number(rng) for _ in keys]
    depths = _spread(rng, n_keys, depth)
    return _needle_case(
        renderer, length, kind, rng, task="multikey", depth=depth,
        needles=[(d, f"One of the special magic numbers for {k} is: {v}.") for d, k, v in zip(depths, keys, values)],
        answers=[values[0]], instruction=MAGIC_INSTRUCTION,
        question=f"What is the special magic number for {keys[0]} mentioned in the provided text?",
        answer_prefix=f"The special magic number for {keys[0]} mentioned in the provided text is", max_new_tokens=16)


def niah_multivalue(renderer: Renderer, length: int, depth: float, kind: str, rng: random.Random,
                    n_values: int = 4) -> Case:
    """One key with n_values values at different depths; all must be recalled."""
    key = filler.key_phrases(rng, 1)[0]
    values = [_magic_number(rng) for _ in range(n_values)]
    depths = sorted(_spread(rng, n_values, depth))
    return _needle_case(
        renderer, length, kind, rng, task="multivalue", depth=depth,
        needles=[(d, f"One of the special magic numbers for {key} is: {v}.") for d, v in zip(depths, values)],
        answers=values, instruction=MAGIC_INSTRUCTION,
        question=f"What are all the special magic numbers for {key} mentioned in the provided text?",
        answer_prefix=f"The special magic numbers for {key} mentioned in the provided text are", max_new_tokens=48)


def niah_multiquery(renderer: Renderer, length: int, depth: float, kind: str, rng: random.Random,
                    n_queries: int = 4) -> Case:
    """n_queries keys, one value each, all asked for at once."""
    keys = filler.key_phrases(rng, n_queries)
    values = [_magic_number(rng) for _ in keys]
    depths = _spread(rng, n_queries, depth)
    asked = ", ".join(keys[:-1]) + f" and {keys[-1]}"
    return _needle_case(
        renderer, length, kind, rng, task="multiquery", depth=depth,
        needles=[(d, f"One of the special magic numbers for {k} is: {v}.") for d, k, v in zip(depths, keys, values)],
        answers=values, instruction=MAGIC_INSTRUCTION,
        question=f"What are all the special magic numbers for {asked} mentioned in the provided text?",
        answer_prefix=f"The special magic numbers for {asked} mentioned in the provided text are", max_new_tokens=48)


def variable_tracking(renderer: Renderer, length: int, depth: float, kind: str, rng: random.Random,
                      n_hops: int = 4) -> Case:
    """A chain VAR A = value, VAR B = VAR A, ... spread in order from `depth` onwards; the answer is
    every variable name in the chain."""
    names: list[str] = []
    while len(names) < n_hops + 1:
        v = "".join(rng.choices(string.ascii_uppercase, k=5))
        if v not in names:
            names.append(v)
    value = str(rng.randint(10_000, 99_999))
    lines = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    step = (0.95 - depth) / max(1, n_hops)
    depths = [round(depth + i * step, 3) for i in range(n_hops + 1)]
    return _needle_case(
        renderer, length, kind, rng, task="vt", depth=depth, needles=list(zip(depths, lines)), answers=names,
        instruction="Memorize and track the chain(s) of variable assignment hidden in the following text.",
        question=f"Question: Find all variables that are assigned the value {value} in the text above.",
        answer_prefix=(f"Answer: According to the chain(s) of variable assignment in the text above, "
                       f"{n_hops + 1} variables are assigned the value {value}, they are:"), max_new_tokens=40)


def common_words(renderer: Renderer, length: int, depth: float, kind: str, rng: random.Random,
                 n_common: int = 10) -> Case:
    """A numbered word list where n_common words appear far more often than the rest (RULER's CWE).
    The common words' frequency scales with the length so that short lists still fit."""
    bank = filler.words(rng, len(set(filler.ADJECTIVES) | set(filler.NOUNS) | set(filler.VERBS)))
    common, rare = bank[:n_common], bank[n_common:]
    freq = max(4, min(30, length // 200))
    seed = rng.randrange(1 << 30)

    def build(k: int) -> Case:
        items = common * freq + [rare[i % len(rare)] for i in range(k)]
        random.Random(seed).shuffle(items)
        context = "\n".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        return Case(task="cwe", context=context, answers=list(common), max_new_tokens=64,
                    instruction=("Below is a numbered list of words. In these words, some appear more often "
                                 "than others. Memorize the ones that appear most often."),
                    question=f"Question: What are the {n_common} most common words in the above list?",
                    answer_prefix=f"Answer: The top {n_common} words that appear most often in the list are:",
                    meta={"depth": None, "filler": "words", "common_freq": freq, "rare_items": k})

    return fit_to_length(build, renderer, length - 64)


# Task name -> generator. NIAH_TASKS make up `bench niah`, RULER_TASKS `bench ruler`.
Generator = Callable[[Renderer, int, float, str, random.Random], Case]
TASKS: dict[str, Generator] = {
    "passkey": passkey, "niah": niah_single, "multikey": niah_multikey, "multivalue": niah_multivalue,
    "multiquery": niah_multiquery, "vt": variable_tracking, "cwe": common_words,
}
NIAH_TASKS = ("passkey", "niah")
RULER_TASKS = ("niah", "multikey", "multivalue", "multiquery", "vt", "cwe")
DEFAULT_DEPTHS = tuple(round(0.1 * i, 1) for i in range(1, 10))


def case_plan(n: int, depths: Optional[Sequence[float]], fillers: Sequence[str]) -> list[tuple[float, str]]:
    """(depth, filler) of each of n cases. Without explicit depths, depths are evenly spaced over
    [0.1, 0.9] so any n covers the range; explicit depths are crossed with the fillers, in turn."""
    if depths:
        combos = [(d, f) for d in depths for f in fillers]
        return [combos[i % len(combos)] for i in range(n)]
    if n == 1:
        return [(0.5, fillers[0])]
    return [(round(0.1 + 0.8 * i / (n - 1), 3), fillers[i % len(fillers)]) for i in range(n)]


def generate(task: str, renderer: Renderer, length: int, n: int, *, seed: int = 0,
             depths: Optional[Sequence[float]] = None, fillers: Sequence[str] = filler.KINDS) -> list[Case]:
    """n cases of one task at one length; the same arguments always give the same cases."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r} (known: {', '.join(TASKS)})")
    for f in fillers:
        if f not in filler.KINDS:
            raise ValueError(f"unknown filler kind {f!r} (known: {', '.join(filler.KINDS)})")
    if depths and not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"depths must lie in [0, 1], got {list(depths)}")
    cases = []
    for i, (depth, kind) in enumerate(case_plan(n, depths, fillers)):
        rng = random.Random(f"{task}/{length}/{seed}/{i}")
        case = TASKS[task](renderer, length, depth, kind, rng)
        case.meta.update({"seed": seed, "index": i, "length": length})
        cases.append(case)
    return cases
