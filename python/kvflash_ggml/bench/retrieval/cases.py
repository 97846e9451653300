"""A retrieval case, how it becomes a prompt, how a haystack is fitted to a token length, and the
JSONL loader for user cases.

A case is rendered as instruction + context + question, then the answer prefix (e.g. "The pass key
is"), either through the GGUF's chat template (the prefix opens the assistant turn) or as plain text.
The answer prefix matters for small models: it turns "answer the question" into "continue the
sentence", which is what a 135M model does reliably.
"""
from __future__ import annotations

import bisect
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from ...tokenizer import Tokenizer
from . import filler

FORMATS = ("chat", "plain")


@dataclass
class Case:
    task: str
    context: str
    question: str
    answers: list[str]            # score = fraction of these found in the output (all = 1.0)
    answer_prefix: str = ""
    instruction: str = ""
    max_new_tokens: int = 16
    meta: dict = field(default_factory=dict)   # depth, filler, seed, needles (char offsets in context)

    @property
    def tf_answer(self) -> str:
        """The continuation teacher forcing feeds: the answers in context order, comma separated."""
        return ", ".join(self.answers)

    @property
    def numeric(self) -> bool:
        """Every answer is a number (tells the renderer the answer's type, never its value)."""
        return all(a.isdigit() for a in self.answers)

    def to_json(self) -> dict:
        return {"task": self.task, "question": self.question, "answers": self.answers,
                "answer_prefix": self.answer_prefix, "max_new_tokens": self.max_new_tokens,
                "context_chars": len(self.context), "meta": self.meta}


class Renderer:
    """Turns cases into prompt text and tokens with one tokenizer and one format."""

    def __init__(self, tokenizer: Tokenizer, fmt: str = "chat") -> None:
        if fmt not in FORMATS:
            raise ValueError(f"unknown prompt format {fmt!r} (known: {', '.join(FORMATS)})")
        if fmt == "chat" and not tokenizer.has_chat_template:
            raise ValueError("this GGUF has no chat template: use the plain format")
        self.tokenizer = tokenizer
        self.fmt = fmt
        # Tokenizers that split " 7" into " " + "7" (SmolLM2, Llama 3 style digit splitting) would
        # make the model pick between " " and " a" after "The pass key is"; ending the prefix with
        # that lone space leaves only digits to choose from. Where " 7" is one token, adding the
        # space would put the model off its training distribution, so it is not added there.
        space = tokenizer.encode(" ", add_special=False)
        self.space_before_digits = tokenizer.encode(" 7", add_special=False) == space + tokenizer.encode(
            "7", add_special=False)
        self._chat_parts: Optional[tuple[str, str]] = None
        if fmt == "chat":
            # Rendering the Jinja template costs as much as tokenizing 8K tokens and length fitting
            # renders dozens of times: render once around a marker and splice the content in.
            marker = "\x00kvflash-content\x00"
            head = tokenizer.apply_chat_template([{"role": "user", "content": marker}])
            if head.count(marker) == 1:
                before, after = head.split(marker)
                self._chat_parts = (before, after)

    def user_text(self, case: Case) -> str:
        parts = [case.instruction, case.context, case.question]
        return "\n\n".join(p for p in parts if p)

    def prefix(self, case: Case) -> str:
        if case.answer_prefix and case.numeric and self.space_before_digits:
            return case.answer_prefix + " "
        return case.answer_prefix

    def text(self, case: Case) -> str:
        if self.fmt == "chat":
            user = self.user_text(case)
            if self._chat_parts and user == user.strip():   # templates may strip content: splice only then
                return self._chat_parts[0] + user + self._chat_parts[1] + self.prefix(case)
            head = self.tokenizer.apply_chat_template([{"role": "user", "content": user}])
            return head + self.prefix(case)
        return self.user_text(case) + "\n\n" + self.prefix(case)

    def encode(self, text: str) -> list[int]:
        if self.fmt == "chat":   # BOS, if any, is in the template; special tokens are the template's
            return self.tokenizer.encode(text, add_special=False, parse_special=True)
        return self.tokenizer.encode(text, add_special=True, parse_special=False)

    def tokens(self, case: Case) -> list[int]:
        return self.encode(self.text(case))

    def answer_tokens(self, case: Case, prompt: Optional[Sequence[int]] = None) -> list[int]:
        """Tokens of the answer as the model would write them after the prompt. Tokenized together
        with the prompt when that leaves the prompt's tokens unchanged (so the first answer token is
        the one BPE really produces at that boundary), else on their own."""
        text = self.text(case)
        prompt = list(prompt) if prompt is not None else self.encode(text)
        sep = "" if not case.answer_prefix or text[-1].isspace() else " "
        full = self.encode(text + sep + case.tf_answer)
        if full[:len(prompt)] == prompt and len(full) > len(prompt):
            return full[len(prompt):]
        return self.tokenizer.encode(sep + case.tf_answer, add_special=False)

    def context_token_span(self, case: Case) -> tuple[int, int]:
        """[t0, t1): where the context lies in the prompt tokens (boundaries are +-1 token)."""
        text = self.text(case)
        c0 = text.index(case.context)
        return len(self.encode(text[:c0])), len(self.encode(text[:c0 + len(case.context)]))

    def token_offset(self, case: Case, context_char: int) -> int:
        """Token index in the prompt of a character offset inside the context."""
        text = self.text(case)
        return len(self.encode(text[:text.index(case.context) + context_char]))


def fit_to_length(build: Callable[[int], Case], renderer: Renderer, target: int, *, k_min: int = 0) -> Case:
    """The case with the largest k (haystack units) whose prompt has at most `target` tokens.
    Token count grows with k by one unit (< 64 tokens) per step, so the result is within one
    chunk of target. Doubling then bisection: ~2 log2(k) tokenizations."""
    def n_tokens(k: int) -> int:
        return len(renderer.tokens(build(k)))

    if n_tokens(k_min) > target:
        raise ValueError(f"target of {target} tokens is shorter than the case without haystack "
                         f"({n_tokens(k_min)} tokens)")
    lo, hi = k_min, max(k_min + 1, 16)
    while n_tokens(hi) <= target:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if n_tokens(mid) <= target:
            lo = mid
        else:
            hi = mid
    return build(lo)


class Haystack:
    """The first k units of a filler kind with needles inserted at token-depth fractions."""

    def __init__(self, kind: str, seed: int, tokenizer: Tokenizer) -> None:
        self.kind = kind
        self.sep = "\n" if kind == "code" else " "
        self._stream = filler.units(kind, seed)
        self._units: list[str] = []
        self._prefix = [0]     # _prefix[i] = tokens of the first i units, each tokenized alone
        self._tokenizer = tokenizer

    def _grow(self, k: int) -> None:
        while len(self._units) < k:
            u = next(self._stream)
            self._units.append(u)
            self._prefix.append(self._prefix[-1] + len(self._tokenizer.encode(u, add_special=False)))

    def build(self, k: int, needles: Sequence[tuple[float, str]]) -> tuple[str, list[dict]]:
        """Context text and, per needle (in the order given), its depth, text and char offset.
        A needle at depth d goes at the first unit boundary with >= d of the haystack tokens before
        it; needles at the same boundary keep their given order (chains stay in order)."""
        self._grow(k)
        total = self._prefix[k]
        at = [bisect.bisect_left(self._prefix, d * total, 0, k + 1) for d, _ in needles]
        order = sorted(range(len(needles)), key=lambda j: (at[j], j))
        pieces, placed, pos, prev = [], {}, 0, 0
        for j in order:
            body = "".join(self._units[prev:at[j]])
            pieces.append(body)
            pos += len(body)
            placed[j] = pos
            text = needles[j][1] + self.sep
            pieces.append(text)
            pos += len(text)
            prev = at[j]
        pieces.append("".join(self._units[prev:k]))
        info = [{"depth": needles[j][0], "text": needles[j][1], "char": placed[j]} for j in range(len(needles))]
        return "".join(pieces).rstrip(), info


# -- user cases ----------------------------------------------------------------------------------

def load_jsonl(path: str | Path) -> list[Case]:
    """Cases from a JSONL file, one object per line: {"context", "question", "answer"} where answer
    is a string or a list of strings (all must be found); optional "answer_prefix", "instruction",
    "max_new_tokens", "id". Blank lines are skipped; any other problem names the line."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    cases = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            cases.append(_case_from_json(line, f"{path}:{n}"))
    if not cases:
        raise ValueError(f"{path}: no cases (expected one JSON object per line)")
    return cases


def _case_from_json(line: str, where: str) -> Case:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("context", "question", "answer") if k not in obj]
    if missing:
        raise ValueError(f"{where}: missing key(s) {', '.join(missing)} (need context, question, answer)")
    for k in ("context", "question", "answer_prefix", "instruction"):
        if k in obj and not isinstance(obj[k], str):
            raise ValueError(f"{where}: {k!r} must be a string, got {type(obj[k]).__name__}")
    answers = obj["answer"] if isinstance(obj["answer"], list) else [obj["answer"]]
    if not answers or not all(isinstance(a, str) and a.strip() for a in answers):
        raise ValueError(f"{where}: 'answer' must be a non-empty string or a list of non-empty strings")
    max_new = obj.get("max_new_tokens", 32)
    if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new <= 0:
        raise ValueError(f"{where}: 'max_new_tokens' must be a positive integer")
    return Case(task="jsonl", context=obj["context"], question=obj["question"], answers=answers,
                answer_prefix=obj.get("answer_prefix", ""), instruction=obj.get("instruction", ""),
                max_new_tokens=max_new, meta={"id": obj.get("id", where)})
