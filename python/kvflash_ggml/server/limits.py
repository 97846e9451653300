"""What a request may cost the server before it computes anything for it, bounded from the context (--n-ctx).

A prompt that fits has at most n_ctx tokens, and no token stands for more than `max_piece_bytes` bytes of text
(the longest piece of the vocabulary, special tokens' text included): the two tokenizer kinds the core loads
(byte-level BPE, SentencePiece) make every byte of the text part of some token. So a text of more than
max_piece_bytes * n_ctx bytes cannot fit, and is refused (413) before it is tokenized (tokenizing first, on the
event loop, let a 1 MB prompt of control tokens hold the server for 44 s: libllama's special-token partition is
quadratic in them). A chat of more messages than n_ctx cannot fit either (each message's turn takes at least one
token of the template's markup): they are counted before pydantic validates each. The raw body is capped before
it is parsed as JSON, at what the largest request that could fit takes (JSON may spell one byte of text in 6:
"\\u0001"). What is accepted is rendered and tokenized off the event loop (`off_loop`), so that /health and a
SIGTERM are answered meanwhile.

The byte bound assumes the template writes a user's, system's or tool's content whole (perhaps trimmed) and that
no token strips the whitespace beside it (libllama sets that only for a few vocabularies by model name: phi-3,
jina, modern-bert); where that fails, a request the context could hold is refused with 413, never cut.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..tokenizer import LoneSurrogateError, utf8

JSON_BYTES_PER_TEXT_BYTE = 6      # the longest JSON spelling of one byte of text: "\u0001"
JSON_BYTES_PER_MESSAGE = 256      # a message's JSON besides its content: role, name, a tool call id, ...
BODY_SLACK_BYTES = 1 << 20        # the other fields (sampling, stop strings, tools, ...)
DRAIN_BYTES = 64 << 20            # a refused body is read (and dropped) up to this, so the client sees the 413
OFF_LOOP_THREADS = 4              # prompts tokenized at once; more wait their turn without blocking the loop


class Refused(ValueError):
    """A request refused before any work: status 400 (not text) or 413 (cannot fit), the field it names."""

    def __init__(self, status: int, message: str, *, code: Optional[str] = None, param: Optional[str] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def text_bytes(text: str, where: str) -> int:
    """UTF-8 bytes of a request's text; a lone surrogate (a JSON escape \\ud800-\\udfff that is not half of a
    pair) is no Unicode text and no tokenizer takes it: 400 naming the field and the index (the tokenizer's
    own check and message)."""
    try:
        return len(utf8(text, where))
    except LoneSurrogateError as e:
        raise Refused(400, str(e), code="invalid_text", param=where) from None


@dataclass(frozen=True)
class RequestLimits:
    n_ctx: int
    max_piece_bytes: int   # the longest token's text (special tokens as written), in UTF-8 bytes

    @classmethod
    def of(cls, tokenizer, n_ctx: int) -> "RequestLimits":
        _, offsets = tokenizer.pieces(range(tokenizer.n_vocab), special=True)   # one call into the vocab
        return cls(n_ctx=n_ctx, max_piece_bytes=max(1, int(np.diff(offsets).max())))

    @property
    def max_text_bytes(self) -> int:
        """More bytes of text than this cannot fit in n_ctx tokens."""
        return self.max_piece_bytes * self.n_ctx

    @property
    def max_body_bytes(self) -> int:
        """The largest JSON body a request that fits can need."""
        return (JSON_BYTES_PER_TEXT_BYTE * self.max_text_bytes + JSON_BYTES_PER_MESSAGE * self.n_ctx
                + BODY_SLACK_BYTES)

    def _too_long(self, n_bytes: int, what: str, param: str) -> Refused:
        return Refused(413, f"{what} has {n_bytes} bytes of text: more than {self.n_ctx} tokens (the context) can "
                            f"hold, as no token of this vocabulary is longer than {self.max_piece_bytes} bytes",
                       code="context_length_exceeded", param=param)

    def check_text(self, text: str, what: str = "the prompt", param: str = "prompt") -> None:
        n = text_bytes(text, param)
        if n > self.max_text_bytes:
            raise self._too_long(n, what, param)

    def check_token_ids(self, tokens: Sequence[Any], param: str = "prompt") -> None:
        if len(tokens) > self.n_ctx:
            raise Refused(413, f"the prompt has {len(tokens)} tokens, more than the context of {self.n_ctx}",
                          code="context_length_exceeded", param=param)

    def check_message_count(self, n_messages: int) -> None:
        if n_messages > self.n_ctx:
            raise Refused(413, f"the chat has {n_messages} messages, more than the context of {self.n_ctx} "
                               f"tokens can hold (each message takes at least one token)",
                          code="context_length_exceeded", param="messages")

    def check_messages(self, messages: Sequence[Any]) -> None:
        """Chat messages (schemas.ChatMessage): their number, and the bytes of the content a template writes
        whole (an assistant's may be rewritten: some templates drop earlier turns' reasoning)."""
        self.check_message_count(len(messages))
        total = 0
        for i, m in enumerate(messages):
            for j, text in enumerate(m.texts()):
                where = f"messages.{i}.content" + (f".{j}.text" if isinstance(m.content, list) else "")
                n = text_bytes(text, where)
                if m.role != "assistant":
                    total += n - (len(text) - len(text.strip()))   # templates may trim; the stripped part is ASCII
        if total > self.max_text_bytes:
            raise self._too_long(total, "the chat's content", "messages")


async def off_loop(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on a daemon thread (at most OFF_LOOP_THREADS at once), awaited. Daemon threads, not
    asyncio.to_thread: the interpreter joins an executor's threads at exit, so a SIGTERM would wait for a
    long tokenization to end; a daemon thread is left behind. A caller that is cancelled (its client left,
    the server stops) stops waiting; the thread's result is then dropped."""
    loop = asyncio.get_running_loop()
    async with _gate(loop):
        future = loop.create_future()

        def settle(result: Any, error: Optional[BaseException]) -> None:
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(result)

        def work() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as e:   # noqa: BLE001 - handed to the awaiting request
                result, error = None, e
            try:
                loop.call_soon_threadsafe(settle, result, error)
            except RuntimeError:   # the loop closed meanwhile: nobody waits
                pass

        threading.Thread(target=work, name="kvflash-tokenize", daemon=True).start()
        return await future


_gates: dict = {}


def _gate(loop: asyncio.AbstractEventLoop) -> asyncio.Semaphore:
    """One semaphore per event loop (a semaphore belongs to the loop it first waits on)."""
    gate = _gates.get(loop)
    if gate is None:
        _gates.clear()   # a server runs one loop; a test that starts another drops the old one
        gate = _gates[loop] = asyncio.Semaphore(OFF_LOOP_THREADS)
    return gate


class BodyLimit:
    """ASGI middleware: a request body larger than max_bytes is answered 413 before anything parses it
    (by its Content-Length, or as it arrives when there is none). The body is read whole here and handed on,
    so the app sees it unchanged; what follows it (the client's disconnect) passes through."""

    def __init__(self, app, *, max_bytes: int, refuse: Callable[[int], Any]) -> None:
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse   # refuse(limit) -> an ASGI response

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, 0, more=declared <= DRAIN_BYTES)
            return
        parts, n, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return   # the client left before its body was whole: nobody to answer
            chunk = message.get("body", b"")
            n += len(chunk)
            if n > self.max_bytes:
                await self._refuse(scope, receive, send, n, more=message.get("more_body", False))
                return
            parts.append(chunk)
            more = message.get("more_body", False)
        body, replayed = b"".join(parts), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, n_read: int, *, more: bool) -> None:
        """Read the rest of the body (more: some is still to come; n_read: the bytes read so far) up to
        DRAIN_BYTES before answering: a client still sending when the connection closes sees a broken pipe,
        not the 413."""
        while more and n_read <= DRAIN_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            n_read += len(message.get("body", b""))
            more = message.get("more_body", False)
        await self.refuse(self.max_bytes)(scope, receive, send)


def _content_length(scope) -> Optional[int]:
    for name, value in scope.get("headers") or []:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
