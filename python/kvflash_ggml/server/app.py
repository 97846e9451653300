"""The HTTP surface (FastAPI): OpenAI's /v1/models, /v1/completions, /v1/chat/completions, and llama-server's
/health, /tokenize, /detokenize, /slots and /metrics. Every error is OpenAI-shaped,
{"error": {"message", "type", "param", "code"}}, with its HTTP status; the server keeps serving."""
from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import GenerationRecord
from ..options import SamplingParams
from ..responses import Responses
from ..snapshot import SnapshotError
from ..tokens import token_ids
from .metrics import Metrics, log_request
from .scheduler import QueueFull, Request as Job, Scheduler, SlotBusy
from .schemas import ChatRequest, CompletionRequest, DetokenizeRequest, SlotFile, TokenizeRequest

RETRY_AFTER_SECONDS = 1
COMPLETION_MAX_TOKENS = 16      # OpenAI's default for /v1/completions; chat runs until EOS or a full context
ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
             "/slots")
CLIENT_GONE = object()
SLOT_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None, headers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


@dataclass
class ServerState:
    """What the app serves: the slots (their engines share the model, the tokenizer, the pool config and the
    chat template), the model's name in the API, the API key, and the folder of slot files."""
    scheduler: Scheduler
    model_name: str
    api_key: Optional[str] = None
    slot_save_path: Optional[Path] = None


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # shutting down: stop the slots (each stores its prefix in the prefix cache), then free them
        await asyncio.to_thread(state.scheduler.stop)
        for slot in state.scheduler.slots:
            slot.engine.close()

    app = FastAPI(title="kvflash serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.kvflash = state
    metrics = Metrics(state.scheduler)
    app.add_middleware(AuthAndCount, api_key=state.api_key, metrics=metrics)
    scheduler = state.scheduler
    engine = scheduler.slots[0].engine   # for what every slot shares: tokenizer, pool, prompt rendering
    tokenizer, n_ctx, pool_tokens = engine.tokenizer, engine.pool.n_ctx, engine.pool.resolved_pool_tokens()
    created = int(time.time())

    def on_finish(slot, job, record, error) -> None:   # the scheduler thread
        if record is not None:
            metrics.prompt_tokens.inc(len(job.tokens))
            metrics.reused_tokens.inc((record.stats or {}).get("prompt_tokens_reused", 0))
        if error is not None and job.cancelled:
            metrics.cancelled.inc()
    scheduler.on_finish = on_finish

    # -- errors and auth --------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        message = f"{where}: {first.get('msg', 'invalid request')}" if where else first.get("msg", "invalid request")
        return APIError(400, message, param=where or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code).response()

    # -- small endpoints ----------------------------------------------------------------------------
    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": created,
                                            "owned_by": "kvflash-ggml",
                                            "meta": {"n_ctx": n_ctx, "pool_tokens": pool_tokens,
                                                     "slots": len(scheduler.slots)}}]}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        tokens = tokenizer.encode(body.content, add_special=body.add_special, parse_special=body.parse_special)
        if not body.with_pieces:
            return {"tokens": tokens}
        return {"tokens": [{"id": t, "piece": tokenizer.piece(t).decode("utf-8", errors="replace")} for t in tokens]}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        try:
            return {"content": tokenizer.decode(token_ids(body.tokens, tokenizer.n_vocab))}
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from None

    # -- slots --------------------------------------------------------------------------------------
    @app.get("/slots")
    async def slots() -> list:
        return [{"id": s.id, "n_ctx": n_ctx, "pool_tokens": pool_tokens, "is_processing": s.busy,
                 "n_tokens": len(s.held_tokens), "n_requests": s.n_requests,
                 "kvflash": {k: s.stats.get(k) for k in ("device_kv_bytes", "host_kv_bytes", "page_ins", "page_outs",
                                                         "prompt_tokens_reused")}}
                for s in scheduler.slots]

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: int, action: str, body: Optional[SlotFile] = None) -> dict:
        if not 0 <= slot_id < len(scheduler.slots):
            raise APIError(404, f"no slot {slot_id} (slots: 0..{len(scheduler.slots) - 1})", code="slot_not_found")
        slot = scheduler.slots[slot_id]
        if action == "erase":
            return await _on_scheduler(lambda: _erase(slot))
        if action not in ("save", "restore"):
            raise APIError(400, f"unknown action {action!r} (save, restore, erase)", param="action")
        path = _slot_file(state, body)
        if action == "save":
            return await _on_scheduler(lambda: _save(slot, path))
        if not path.is_file():
            raise APIError(404, f"no saved slot file {path.name!r}", code="file_not_found")
        return await _on_scheduler(lambda: _restore(slot, path))

    async def _on_scheduler(fn) -> dict:
        try:
            return await asyncio.wrap_future(scheduler.call(fn))
        except SlotBusy as e:
            raise APIError(409, str(e), code="slot_busy") from None
        except (SnapshotError, ValueError) as e:
            raise APIError(400, f"cannot restore: {e}", code="invalid_snapshot") from None

    # -- generation ---------------------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_model(state, body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (got a list of several)", param="prompt")
            prompt = prompt[0]
        return await _generate(http, body, _prompt_tokens(prompt), chat=False, logprobs=body.logprobs,
                               params=_params(body, COMPLETION_MAX_TOKENS))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: Request):
        _check_model(state, body.model)
        return await _generate(http, body, _prompt_tokens(body.message_dicts(), param="messages"), chat=True,
                               logprobs=body.n_logprobs(), params=_params(body, None))

    def _prompt_tokens(prompt, param: str = "prompt") -> list[int]:
        """Text, token ids or chat messages as the engines take them (Engine.prompt_tokens reads no session)."""
        try:
            return engine.prompt_tokens(prompt)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    async def _generate(http: Request, body, tokens: list[int], *, chat: bool, logprobs: Optional[int],
                        params: SamplingParams):
        if not tokens:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(tokens) > n_ctx:
            raise APIError(413, f"the prompt has {len(tokens)} tokens, more than the context of {n_ctx}",
                           code="context_length_exceeded", param="prompt")
        job = Job(tokens, params, asyncio.get_running_loop(), logprobs=logprobs)
        try:
            scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, f"server busy: {e}; retry later", type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        shape = Responses(chat=chat, model=state.model_name, n_prompt=len(tokens), tokenizer=tokenizer)
        http.state.logs_itself = True   # the middleware leaves this request's log line to _log_generation
        streaming, outcome = False, "cancelled"   # what the log line says if we leave before the end
        try:
            chunks: list[dict] = []
            while not chunks or chunks[-1]["choices"][0]["finish_reason"] is None:
                item = await _next_or_disconnect(job, http)
                if item is CLIENT_GONE:
                    return PlainTextResponse("client closed the request", status_code=499)
                if isinstance(item, BaseException) or item is None:
                    outcome = "failed"   # before the first token: an HTTP error with its status
                    _raise_failed(item)
                if body.stream:   # the first token is out: stream from here (its generator cancels and logs)
                    streaming = True
                    return EventSourceResponse(_events(job, shape, item, include_usage=body.include_usage), ping=15)
                chunks.append(shape.chunk(item))
            outcome = "done"
            return shape.collect(chunks)
        finally:
            if not streaming:
                scheduler.cancel(job)   # no-op once finished
                _log_generation(job, shape, outcome)

    async def _events(job: Job, shape: Responses, first: GenerationRecord, *,
                      include_usage: bool) -> AsyncIterator[dict]:
        outcome = "cancelled"
        try:
            if shape.chat:
                yield {"data": _json(shape.role_chunk())}
            item: Union[GenerationRecord, BaseException, None] = first
            while True:
                if isinstance(item, BaseException) or item is None:
                    outcome = "failed"
                    message = str(item) if item is not None else "the generation was cancelled"
                    yield {"data": _json({"error": {"message": message, "type": "server_error", "param": None,
                                                    "code": None}})}
                    return
                chunk = shape.chunk(item)
                chunk.pop("usage", None)
                yield {"data": _json(chunk)}
                if item.finish_reason is not None:
                    break
                item = await job.out.get()
            if include_usage:
                yield {"data": _json(shape.usage_chunk())}
            yield {"data": "[DONE]"}
            outcome = "done"
        finally:
            scheduler.cancel(job)   # a client that left: the slot stops at its next step (no-op once finished)
            _log_generation(job, shape, outcome)

    def _log_generation(job: Job, shape: Responses, outcome: str) -> None:
        """One line per generation request, however it ended (done, cancelled: the client left, failed)."""
        metrics.generated_tokens.inc(shape.n_generated)
        if job.t_start is not None:
            metrics.queue_seconds.observe(job.t_start - job.t_submit)
        if job.t_first is not None and job.t_start is not None:
            metrics.first_token_seconds.observe(job.t_first - job.t_start)
        kv = (shape.usage or {}).get("kvflash") or {}
        log_request(id=shape.id, outcome=outcome, slot=job.slot_id, prompt_tokens=len(job.tokens),
                    reused_tokens=kv.get("prompt_tokens_reused"), completion_tokens=shape.n_generated,
                    queue_ms=_ms(job.t_submit, job.t_start), prompt_ms=_ms(job.t_start, job.t_first),
                    total_ms=_ms(job.t_submit, time.perf_counter()), page_ins=kv.get("page_ins"))

    return app


def _params(body, default_max_tokens: Optional[int]) -> SamplingParams:
    try:
        return body.sampling_params(default_max_tokens)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _check_model(state: ServerState, name: Optional[str]) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist (this server serves {state.model_name!r})",
                       code="model_not_found", param="model")


async def _next_or_disconnect(job: Job, http: Request):
    """The job's next item, or CLIENT_GONE if the client disconnects first (the caller cancels the job)."""
    get = asyncio.ensure_future(job.out.get())
    gone = asyncio.ensure_future(_disconnected(http))
    done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    gone.cancel()
    if get in done:
        return get.result()
    get.cancel()
    return CLIENT_GONE


async def _disconnected(http: Request) -> None:
    while (await http.receive())["type"] != "http.disconnect":
        pass


def _raise_failed(item: Optional[BaseException]) -> None:
    if item is None:
        raise APIError(503, "the generation was cancelled (the server is shutting down)", type="server_error")
    if isinstance(item, ValueError):
        raise APIError(400, str(item))
    raise APIError(500, f"generation failed: {item}", type="server_error")


def _slot_file(state: ServerState, body: Optional[SlotFile]) -> Path:
    if state.slot_save_path is None:
        raise APIError(400, "slot save/restore is off: start the server with --slot-save-path DIR",
                       code="slot_save_disabled")
    if body is None:
        raise APIError(400, "give the file as {\"filename\": NAME}", param="filename")
    name = body.filename
    if not SLOT_FILE.fullmatch(name) or ".." in name:
        raise APIError(400, f"invalid file name {name!r}: letters, digits, '.', '_' and '-' only, no path",
                       param="filename", code="invalid_filename")
    return state.slot_save_path / name


def _idle(slot) -> None:
    if slot.busy:
        raise SlotBusy(f"slot {slot.id} is processing a request")


def _save(slot, path: Path) -> dict:
    _idle(slot)
    t0 = time.perf_counter()
    slot.engine.save_state(path)
    return {"id_slot": slot.id, "filename": path.name, "n_saved": len(slot.held_tokens),
            "n_written": path.stat().st_size, "timings": {"save_ms": _ms(t0, time.perf_counter())}}


def _restore(slot, path: Path) -> dict:
    _idle(slot)
    t0 = time.perf_counter()
    slot.engine.load_state(path)
    slot.held_tokens = list(slot.engine.session.tokens)
    return {"id_slot": slot.id, "filename": path.name, "n_restored": len(slot.held_tokens),
            "n_read": path.stat().st_size, "timings": {"restore_ms": _ms(t0, time.perf_counter())}}


def _erase(slot) -> dict:
    _idle(slot)
    n = len(slot.held_tokens)
    slot.engine.session.reset()
    slot.held_tokens = []
    return {"id_slot": slot.id, "n_erased": n}


def _ms(t0: Optional[float], t1: Optional[float]) -> Optional[float]:
    return None if t0 is None or t1 is None else round((t1 - t0) * 1e3, 1)


def _json(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


class AuthAndCount:
    """ASGI middleware (pure ASGI, so that streamed responses still see the client's disconnect): the API key
    check (every path but /health), the request counter by endpoint and status, and the request's log line
    unless it is a generation that reached the scheduler (that one logs its own, with token figures)."""

    def __init__(self, app, *, api_key: Optional[str], metrics: Metrics) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, path, status = time.perf_counter(), scope["path"], [500]

        async def send_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        headers = dict(scope.get("headers") or [])
        if self.api_key and path != "/health" and \
                headers.get(b"authorization", b"") != f"Bearer {self.api_key}".encode():
            response = APIError(401, "invalid or missing API key (Authorization: Bearer <key>)",
                                type="authentication_error", code="invalid_api_key").response()
            await response(scope, receive, send_status)
        else:
            await self.app(scope, receive, send_status)
        endpoint = "/slots/{id}" if path.startswith("/slots/") else path if path in ENDPOINTS else "other"
        self.metrics.requests.labels(endpoint, str(status[0])).inc()
        if not scope.get("state", {}).get("logs_itself"):
            log_request(path=path, status=status[0], ms=_ms(t0, time.perf_counter()))
