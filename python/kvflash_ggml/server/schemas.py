"""Request bodies the server accepts, as pydantic models: FastAPI checks every known field's type and
range and answers 400 with the field's name; unknown fields are ignored (clients send many we do not use).
Sampling fields map onto SamplingParams (options.py), which checks them once more."""
from __future__ import annotations

from typing import Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..options import SamplingParams

MAX_TOP_LOGPROBS = 20   # as OpenAI's API


class StreamOptions(BaseModel):
    include_usage: bool = False


class Sampling(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share (top_k and min_p are llama.cpp's)."""
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None          # None: the one model this server serves
    max_tokens: Optional[int] = Field(None, ge=0)
    max_completion_tokens: Optional[int] = Field(None, ge=0)
    temperature: Optional[float] = Field(None, ge=0.0, le=2.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    seed: Optional[int] = None
    stop: Union[None, str, list[str]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    n: int = Field(1, ge=1, le=1, description="one choice per request")

    def sampling_params(self, default_max_tokens: Optional[int]) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        given = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                     seed=self.seed, stop=self.stop)
        return SamplingParams(max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
                              **{k: v for k, v in given.items() if v is not None})

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(Sampling):
    prompt: Union[str, list[int], list[str]]
    logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: Literal[False] = False


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None

    @model_validator(mode="after")
    def _has_content(self) -> "ChatMessage":
        # as OpenAI's API: only an assistant message that calls tools may go without content
        calls = any((self.model_extra or {}).get(k) for k in ("tool_calls", "function_call"))
        if self.content is None and (self.role != "assistant" or not calls):
            needs = "'content' or 'tool_calls'" if self.role == "assistant" else "'content'"
            raise ValueError(f"a {self.role} message needs {needs}")
        return self

    def texts(self) -> list[str]:
        """The content's text parts (one for a plain string)."""
        if isinstance(self.content, list):
            return [part.text for part in self.content]
        return [self.content or ""]

    def text(self) -> str:
        return "".join(self.texts())


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def n_logprobs(self) -> Optional[int]:
        return (self.top_logprobs or 0) if self.logprobs else None

    def message_dicts(self) -> list[dict]:
        # a "developer" message is OpenAI's newer name for a system message; templates know only the latter
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(BaseModel):
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(BaseModel):
    tokens: list[int]


class SlotFile(BaseModel):
    filename: str = Field(min_length=1)
