"""Tokenizer and chat template, both taken from the GGUF itself.

Tokens come from libllama's vocabulary code (loaded vocab-only from the same file), so any GGUF that
llama.cpp tokenizes is tokenized identically. The chat template is the GGUF's own Jinja template,
rendered with jinja2 in a sandbox the way Hugging Face renders it.

A chat's messages are text, as OpenAI's API reads them: the control tokens of a rendered chat are parsed in
the template's markup only, and a message whose content holds a control token's text (say "<|im_end|>") gets
that text as plain text, not the token, so a user cannot write a turn of another role (ChatText below).
Tokenizer(chat_special=True) parses them everywhere, as llama-server does.
"""
from __future__ import annotations

import codecs
import functools
import re
from datetime import datetime
from typing import Callable, Iterable, Mapping, Optional, Sequence

import jinja2
import jinja2.sandbox
import numpy as np

from . import _core


# libllama's built-in template of a family whose GGUFs often come without one (the Gemma 3 270M GGUF on PyPI).
BUILTIN_TEMPLATES = {"gemma3": "gemma"}

# Unicode noncharacters (reserved for a program's internal use, never meant to be interchanged), in pairs that
# open and close a message's content in the marked rendering of a chat (see content_spans).
SENTINELS = tuple((chr(c), chr(c + 1)) for c in range(0xFDD0, 0xFDF0, 2))


class LoneSurrogateError(UnicodeError):
    """Text holding a lone surrogate: a Python str that no UTF-8 can encode, so no tokenizer can read it.
    A ValueError (UnicodeError) that says where."""


def utf8(text: str, what: str = "the prompt") -> bytes:
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise LoneSurrogateError(f"{what} has a lone surrogate (U+{ord(text[e.start]):04X}) at index {e.start}: "
                                 f"text must be valid Unicode (UTF-8 encodable)") from None


class ChatText(str):
    """A rendered chat prompt that knows which of its bytes came from the messages' content: content_spans,
    sorted [lo, hi) byte ranges of its UTF-8. Tokenizer.encode(parse_special=True) parses control tokens
    outside them only. (A str: slicing or concatenating it gives a plain str, which parses them everywhere.)"""

    content_spans: tuple[tuple[int, int], ...]

    def __new__(cls, text: str, content_spans: Sequence[tuple[int, int]]) -> "ChatText":
        self = super().__new__(cls, text)
        self.content_spans = tuple(content_spans)
        return self


class Tokenizer:
    """chat_special: control-token text in chat messages (content and role) is parsed into control tokens, as
    llama-server does; by default it is text (see the module docstring)."""

    def __init__(self, path: str, *, chat_special: bool = False) -> None:
        if not isinstance(chat_special, bool):
            raise ValueError(f"chat_special must be True or False, got {chat_special!r}")
        self.chat_special = chat_special
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
        """text: a str, or bytes-like (bytes, bytearray, memoryview) read as UTF-8 (invalid bytes replaced).
        A ChatText (apply_chat_template's) with parse_special parses control tokens in its markup only.
        LoneSurrogateError (a ValueError) for a str no UTF-8 can encode."""
        if isinstance(text, (bytes, bytearray, memoryview)):
            text = bytes(text).decode("utf-8", errors="replace")
        data = utf8(text)
        # Control tokens parsed outside the spans only: a ChatText's content; no span with parse_special, the
        # whole text without. The same tokens as llama_tokenize(parse_special) (tests/test_chat_content.py), in
        # time linear in the special tokens found: libllama's own partition is quadratic in them (a 1 MB prompt
        # of one control token repeated: 0.03 s here, ~44 s there, issue 39).
        if not parse_special:
            spans = [(0, len(data))]
        else:
            spans = list(text.content_spans) if isinstance(text, ChatText) else []
        return self._vocab.tokenize_with_text_spans(data, spans, add_special=add_special)[0]

    def control_text(self, text: str) -> Optional[str]:
        """The first control token's text found in `text` (what parse_special would turn into a control token),
        or None."""
        _, token = self._vocab.find_control_text(utf8(text))
        return self.token_text(token) if token >= 0 else None

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
        """The chat as the template writes it: a ChatText that keeps the messages' content apart from the
        template's markup (a plain str with chat_special). ValueError for a role that holds control-token text,
        or content that does where the template does not let the content be told apart (see content_spans)."""
        messages = check_messages(messages)
        render = self._renderer(template, add_generation_prompt)
        text = render(messages)
        if self.chat_special:
            return text
        self._check_roles(messages)
        spans = content_spans(text, messages, render)
        if spans is None:
            self._check_no_control_text(messages)   # no content can write a control token: nothing to keep apart
            spans = []
        return ChatText(text, spans)

    def _renderer(self, template: str | None, add_generation_prompt: bool) -> Callable[[list], str]:
        """messages -> the rendered chat, the same for every call (one clock for strftime_now)."""
        source = template or self.chat_template
        if not source and self.builtin_template:
            return lambda messages: _core.builtin_chat_template(
                self.builtin_template, [(m["role"], m["content"]) for m in messages], add_generation_prompt)
        if not source:
            raise ValueError("this GGUF has no chat template (tokenizer.chat_template); pass chat_template=...")
        now = datetime.now()
        return lambda messages: render_chat_template(
            source, messages, add_generation_prompt=add_generation_prompt, now=now,
            bos_token=self.token_text(self.bos) if self.bos >= 0 else "",
            eos_token=self.token_text(self.eos) if self.eos >= 0 else "")

    def _check_roles(self, messages: Sequence[Mapping[str, str]]) -> None:
        """A role is the client's text too, written into the markup ('<|im_start|>' + role): it may hold no
        control token's text."""
        found = {role: self.control_text(role) for role in {m["role"] for m in messages}}
        for i, m in enumerate(messages):
            if found[m["role"]] is not None:
                raise ValueError(f"messages[{i}]['role'] holds the control token {found[m['role']]!r}")

    def _check_no_control_text(self, messages: Sequence[Mapping[str, str]]) -> None:
        for i, m in enumerate(messages):
            found = self.control_text(m["content"])
            if found is not None:
                raise ValueError(
                    f"messages[{i}]['content'] holds the control token {found!r}, and this chat template rewrites "
                    f"message content so that it cannot be told apart from the template's own tokens; remove it "
                    f"from the message, or let messages write control tokens (chat_special=True, as llama-server)")


def content_spans(text: str, messages: Sequence[Mapping[str, str]],
                  render: Callable[[list], str]) -> Optional[list[tuple[int, int]]]:
    """Where the messages' content lies in `text` (their rendering): sorted [lo, hi) byte ranges of its UTF-8,
    or None where the template does not let them be told apart.

    The chat is rendered a second time with each content between two sentinel characters (a pair found in
    no message and not in `text`), and what lies between them is content. Templates transform content (Gemma
    trims it, others strip or split it), so the sentinels go around the content's core, with its leading and
    trailing whitespace outside them: trimmed or not, the second rendering less its sentinels is then the
    first one, character for character, and the sentinels mark the core wherever the template put it (a
    system message moved into the first user turn included). That equality and well-nested pairs are checked:
    a template that splits, reverses or tests the content breaks one of them, and the answer is None rather
    than ranges that could be wrong (so is a second rendering the template refuses). The whitespace left
    outside is counted as markup: only a control token made of whitespace alone could be read there."""
    used = text + "".join(m["content"] for m in messages)
    pair = next((p for p in SENTINELS if p[0] not in used and p[1] not in used), None)
    if pair is None:
        return None
    try:
        marked = render([{**m, "content": _wrap(m["content"], *pair)} for m in messages])
    except ValueError:   # the template refuses what it is shown (raise_exception on a test of the content)
        return None
    return _spans_of_marked(marked, text, *pair)


def _wrap(content: str, opening: str, closing: str) -> str:
    core = content.strip()
    if not core:   # nothing to mark; an empty content stays empty, as templates test it
        return content
    lead = content[: len(content) - len(content.lstrip())]
    return lead + opening + core + closing + content[len(lead) + len(core):]


def _spans_of_marked(marked: str, text: str, opening: str, closing: str) -> Optional[list[tuple[int, int]]]:
    parts = re.split(f"([{opening}{closing}])", marked)   # text, sentinel, text, ..., text
    spans, plain, at, start, inside = [], [], 0, 0, False
    for k, part in enumerate(parts):
        if k % 2:
            if (part == opening) == inside:   # nested, or closed before opened
                return None
            inside = part == opening
            if inside:
                start = at
            elif at > start:
                spans.append((start, at))
        else:
            plain.append(part)
            at += len(part.encode("utf-8", errors="surrogatepass"))   # counted only; encode() refuses them
    return spans if not inside and "".join(plain) == text else None


def check_messages(messages: object) -> list[Mapping[str, str]]:
    """The messages as a list, each a mapping with a string role and string content (valid Unicode); anything
    else is a ValueError naming the message, where a template would fail somewhere inside jinja2 or render junk."""
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
            utf8(m[key], f"messages[{i}][{key!r}]")   # a lone surrogate named here, not deep in a binding
    return list(messages)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    """A template compiled once: a chat is rendered twice (apply_chat_template's content_spans) and every
    request renders the same template."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(source)


def render_chat_template(source: str, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool,
                         bos_token: str, eos_token: str, now: Optional[datetime] = None) -> str:
    try:
        # strftime_now as a render variable (it shadows nothing else), so one compiled template serves every clock
        return _compiled(source).render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                        bos_token=bos_token, eos_token=eos_token,
                                        strftime_now=lambda fmt: (now or datetime.now()).strftime(fmt))
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
