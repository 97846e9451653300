"""OpenAI-shaped completion and chat objects built from GenerationRecords: the one place that knows the
wire shape, for the Python API (Model.create_completion / create_chat_completion) and the server."""
from __future__ import annotations

import time
import uuid
from typing import Iterable, Optional

from .generation import GenerationRecord
from .sampling import TokenLogprobs
from .tokenizer import Tokenizer


class Responses:
    """The chunks and the whole object of one response. chat: chat.completion(.chunk), else text_completion."""

    def __init__(self, *, chat: bool, model: str, n_prompt: int, tokenizer: Tokenizer) -> None:
        self.chat = chat
        self.model = model
        self.n_prompt = n_prompt
        self.tokenizer = tokenizer
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.n_generated = 0
        self.usage: Optional[dict] = None
        self._offset = 0   # text offset of the next token (completions' logprobs)

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def chunk(self, rec: GenerationRecord) -> dict:
        """One streamed chunk; the closing record's carries usage (with the kvflash block)."""
        self.n_generated += rec.token is not None
        if self.chat:
            choice = {"index": 0, "delta": {"content": rec.text} if rec.text else {},
                      "finish_reason": rec.finish_reason}
        else:
            choice = {"index": 0, "text": rec.text, "finish_reason": rec.finish_reason}
        choice["logprobs"] = self._logprobs(rec)
        if self.chat and choice["logprobs"] is None:
            del choice["logprobs"]
        self._offset += len(rec.text)
        chunk = self._envelope("chat.completion.chunk" if self.chat else "text_completion", [choice])
        if rec.finish_reason is not None:
            self.usage = {"prompt_tokens": self.n_prompt, "completion_tokens": self.n_generated,
                          "total_tokens": self.n_prompt + self.n_generated, "kvflash": rec.stats}
            chunk["usage"] = self.usage
        return chunk

    def role_chunk(self) -> dict:
        """A chat stream's first chunk, as OpenAI sends it."""
        return self._envelope("chat.completion.chunk",
                              [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])

    def usage_chunk(self) -> dict:
        """stream_options.include_usage: the last chunk, no choices."""
        return {**self._envelope("chat.completion.chunk" if self.chat else "text_completion", []), "usage": self.usage}

    def collect(self, chunks: Iterable[dict]) -> dict:
        """The whole (non-streamed) object from the chunks."""
        texts, logprobs, last = [], [], None
        for last in chunks:
            choice = last["choices"][0]
            texts.append(choice["delta"].get("content", "") if self.chat else choice["text"])
            if choice.get("logprobs"):
                logprobs.append(choice["logprobs"])
        text = "".join(texts)
        finish = last["choices"][0]["finish_reason"]
        merged = _merge_logprobs(logprobs, self.chat) if logprobs else None
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            if merged is not None:
                choice["logprobs"] = merged
            return {**self._envelope("chat.completion", [choice]), "usage": last["usage"]}
        choice = {"index": 0, "text": text, "logprobs": merged, "finish_reason": finish}
        return {**self._envelope("text_completion", [choice]), "usage": last["usage"]}

    def _logprobs(self, rec: GenerationRecord) -> Optional[dict]:
        lp: Optional[TokenLogprobs] = rec.logprobs
        if lp is None or rec.token is None:
            return None
        text = self._text(rec.token)
        if self.chat:
            top = [{"token": self._text(t), "logprob": v, "bytes": list(self.tokenizer.piece(t))} for t, v in lp.top]
            return {"content": [{"token": text, "logprob": lp.logprob, "bytes": list(self.tokenizer.piece(rec.token)),
                                 "top_logprobs": top}]}
        return {"tokens": [text], "token_logprobs": [lp.logprob], "top_logprobs": [{self._text(t): v for t, v in lp.top}],
                "text_offset": [self._offset]}

    def _text(self, token: int) -> str:
        return self.tokenizer.piece(token).decode("utf-8", errors="replace")


def _merge_logprobs(parts: list[dict], chat: bool) -> dict:
    if chat:
        return {"content": [entry for p in parts for entry in p["content"]]}
    return {key: [v for p in parts for v in p[key]] for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
