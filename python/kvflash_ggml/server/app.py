"""The HTTP surface (FastAPI): OpenAI's /v1/models, /v1/completions, /v1/chat/completions, and llama-server's
/health, /tokenize, /detokenize, /slots and /metrics. Every error is OpenAI-shaped,
{"error": {"message", "type", "param", "code"}}, with its HTTP status; the server keeps serving."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Optional, Union

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from sse_starlette.sse import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..generation import GenerationRecord
from ..options import SamplingParams
from ..responses import Responses
from ..snapshot import SnapshotError
from ..tokens import token_ids
from .limits import BodyLimit, Refused, RequestLimits, off_loop, text_bytes
from .metrics import Metrics, log_request
from .scheduler import QueueFull, Request as Job, Scheduler, SlotBusy
from .schemas import ChatRequest, CompletionRequest, DetokenizeRequest, SlotFile, TokenizeRequest

RETRY_AFTER_SECONDS = 1
COMPLETION_MAX_TOKENS = 16      # OpenAI's default for /v1/completions; chat runs until EOS or a full context
ENDPOINTS = ("/health", "/metrics", "/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
             "/slots")
CLIENT_GONE = object()
SHUTTING_DOWN = object()
SLOT_FILE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
SHUTDOWN_GRACE_SECONDS = 2   # a stream's last event after SIGTERM; within uvicorn's graceful shutdown (serve: 10 s)
# sse-starlette >= 3.3 tells a stream that the server shuts down (before it, the stream is cut: pyproject asks 3.3)
COOPERATIVE_SHUTDOWN = "shutdown_event" in inspect.signature(EventSourceResponse.__init__).parameters
PRIVATE_FILE = 0o600         # slot files hold a conversation's tokens

log = logging.getLogger("kvflash_ggml.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 code: Optional[str] = None, param: Optional[str] = None, headers: Optional[dict] = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.code, self.param = status, message, type, code, param
        self.headers = headers

    def response(self) -> JSONResponse:
        # a message may quote the request's text: a lone surrogate in it must not fail the JSON's UTF-8
        message = self.message.encode("utf-8", "backslashreplace").decode("utf-8")
        body = {"error": {"message": message, "type": self.type, "param": self.param, "code": self.code}}
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
    shared = Shared.of(state)
    # the outermost middleware is the last added: the key and the count see every request, 413s included
    app.add_middleware(BodyLimit, max_bytes=shared.limits.max_body_bytes, refuse=_body_too_large)
    app.add_middleware(AuthAndCount, api_key=state.api_key, metrics=shared.metrics)
    _log_storage(state, shared.engine, shared.limits)
    metrics = shared.metrics

    def on_finish(slot, job, record, error) -> None:   # the scheduler thread
        if record is not None:
            metrics.prompt_tokens.inc(len(job.tokens))
            metrics.reused_tokens.inc((record.stats or {}).get("prompt_tokens_reused", 0))
        if error is not None and job.cancelled:
            metrics.cancelled.inc()
    state.scheduler.on_finish = on_finish
    _add_error_handlers(app)
    _add_small_endpoints(app, shared)
    _add_slot_endpoints(app, shared)
    _add_generation_endpoints(app, shared)
    return app


@dataclass
class Shared:
    """What every endpoint reads: the state, what every slot shares (tokenizer, pool, prompt rendering: slot 0's
    engine), the request limits and the metrics."""
    state: ServerState
    scheduler: Scheduler
    engine: object
    tokenizer: object
    n_ctx: int
    pool_tokens: int
    limits: RequestLimits
    metrics: Metrics
    created: int

    @classmethod
    def of(cls, state: ServerState) -> "Shared":
        engine = state.scheduler.slots[0].engine
        return cls(state=state, scheduler=state.scheduler, engine=engine, tokenizer=engine.tokenizer,
                   n_ctx=engine.pool.n_ctx, pool_tokens=engine.pool.resolved_pool_tokens(),
                   limits=RequestLimits.of(engine.tokenizer, engine.pool.n_ctx), metrics=Metrics(state.scheduler),
                   created=int(time.time()))


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(Refused)
    async def refused(_: Request, e: Refused) -> JSONResponse:
        return APIError(e.status, e.message, code=e.code, param=e.param).response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        why = first.get("msg", "invalid request").removeprefix("Value error, ")
        return APIError(400, f"{where}: {why}" if where else why, param=where or None).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return APIError(e.status_code, str(e.detail), code=code).response()


def _add_small_endpoints(app: FastAPI, s: Shared) -> None:
    state, scheduler, tokenizer, limits, metrics = s.state, s.scheduler, s.tokenizer, s.limits, s.metrics
    n_ctx, pool_tokens, created = s.n_ctx, s.pool_tokens, s.created

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
        # at most one context's text: the same bound as a prompt's (tokenizing is quadratic in special tokens)
        limits.check_text(body.content, "the content", "content")
        return await off_loop(_tokenized, tokenizer, body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        try:
            return {"content": await off_loop(lambda: tokenizer.decode(token_ids(body.tokens, tokenizer.n_vocab)))}
        except ValueError as e:
            raise APIError(400, str(e), param="tokens") from None


def _add_slot_endpoints(app: FastAPI, s: Shared) -> None:
    state, scheduler, n_ctx, pool_tokens = s.state, s.scheduler, s.n_ctx, s.pool_tokens

    @app.get("/slots")
    async def slots() -> list:
        return [{"id": s.id, "n_ctx": n_ctx, "pool_tokens": pool_tokens, "is_processing": s.busy,
                 "n_tokens": s.n_held, "n_requests": s.n_requests,
                 "kvflash": {k: s.stats.get(k) for k in ("device_kv_bytes", "host_kv_bytes", "page_ins", "page_outs",
                                                         "prompt_tokens_reused")}}
                for s in scheduler.slots]

    @app.post("/slots/{slot_id}")
    async def slot_action(slot_id: int, action: str, body: Optional[SlotFile] = None) -> dict:
        if not 0 <= slot_id < len(scheduler.slots):
            raise APIError(404, f"no slot {slot_id} (slots: 0..{len(scheduler.slots) - 1})", code="slot_not_found")
        slot = scheduler.slots[slot_id]
        if action == "erase":
            return await _on_scheduler(lambda: _erase(slot), f"cannot erase slot {slot_id}")
        if action not in ("save", "restore"):
            raise APIError(400, f"unknown action {action!r} (save, restore, erase)", param="action")
        path = _slot_file(state, body)
        if action == "save":
            return await _on_scheduler(lambda: _save(slot, path), f"cannot save slot {slot_id} to {path.name!r}",
                                       "slot_save_failed", "slot_save_failed")
        if not path.is_file():
            raise APIError(404, f"no saved slot file {path.name!r}", code="file_not_found")
        return await _on_scheduler(lambda: _restore(slot, path), f"cannot restore slot {slot_id} from {path.name!r}",
                                   "invalid_snapshot", "slot_restore_failed")

    async def _on_scheduler(fn, failed: str, invalid: Optional[str] = None, unwritable: Optional[str] = None) -> dict:
        """A slot command's result. Its failure is an OpenAI error naming the reason, never a bare 500: 400
        (code `invalid`) for what the request asked (a file that is no snapshot of this model, a destination
        that is no regular file), 500 (code `unwritable`) for what the system refused (a directory in the
        file's place, a full disk)."""
        try:
            return await asyncio.wrap_future(scheduler.call(fn))
        except SlotBusy as e:
            raise APIError(409, str(e), code="slot_busy") from None
        except (SnapshotError, ValueError) as e:
            raise APIError(400, f"{failed}: {e}", code=invalid) from None
        except OSError as e:
            raise APIError(500, f"{failed}: {e}", type="server_error", code=unwritable) from None


def _add_generation_endpoints(app: FastAPI, s: Shared) -> None:
    state, limits = s.state, s.limits
    g = _Generations(s)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: Request):
        _check_model(state, body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            if len(prompt) != 1:
                raise APIError(400, "one prompt per request (got a list of several)", param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            limits.check_text(prompt)
        else:
            limits.check_token_ids(prompt)
        params = _params(body, COMPLETION_MAX_TOKENS)
        return await g.generate(http, body, await g.prompt_tokens(prompt), chat=False, logprobs=body.logprobs,
                                params=params)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        # parsed here rather than by FastAPI, to count the messages before pydantic validates each one (300,000
        # messages take it seconds, on the event loop)
        data = await _json_body(http)
        if isinstance(data, dict) and isinstance(data.get("messages"), list):
            limits.check_message_count(len(data["messages"]))
        body = _validated(ChatRequest, data)
        _check_model(state, body.model)
        limits.check_messages(body.messages)
        params = _params(body, None)
        return await g.generate(http, body, await g.prompt_tokens(body.message_dicts(), param="messages"),
                                chat=True, logprobs=body.n_logprobs(), params=params)


class _Generations:
    """A generation request from its prompt to its response or stream, and its log line."""

    def __init__(self, s: Shared) -> None:
        self.s = s

    async def prompt_tokens(self, prompt, param: str = "prompt") -> list[int]:
        """Text, token ids or chat messages as the engines take them (Engine.prompt_tokens reads no session),
        off the event loop: rendering a chat and tokenizing take time that /health must not wait for."""
        try:
            return await off_loop(self.s.engine.prompt_tokens, prompt)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from None

    async def generate(self, http: Request, body, tokens: list[int], *, chat: bool, logprobs: Optional[int],
                       params: SamplingParams):
        if not tokens:
            raise APIError(400, "the prompt is empty", param="prompt")
        if len(tokens) > self.s.n_ctx:
            raise APIError(413, f"the prompt has {len(tokens)} tokens, more than the context of {self.s.n_ctx}",
                           code="context_length_exceeded", param="prompt")
        job = Job(tokens, params, asyncio.get_running_loop(), logprobs=logprobs)
        try:
            self.s.scheduler.submit(job)
        except QueueFull as e:
            raise APIError(503, f"server busy: {e}; retry later", type="server_error", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        shape = Responses(chat=chat, model=self.s.state.model_name, n_prompt=len(tokens),
                          tokenizer=self.s.tokenizer)
        http.state.logs_itself = True   # the middleware leaves this request's log line to log_generation
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
                    shutdown = anyio.Event()   # set by sse_starlette when uvicorn begins to shut down
                    told = dict(shutdown_event=shutdown, shutdown_grace_period=SHUTDOWN_GRACE_SECONDS) \
                        if COOPERATIVE_SHUTDOWN else {}
                    return EventSourceResponse(self.events(job, shape, item, include_usage=body.include_usage,
                                                       shutdown=shutdown), ping=15, **told)
                chunks.append(shape.chunk(item))
            outcome = "done"
            return shape.collect(chunks)
        finally:
            if not streaming:
                self.s.scheduler.cancel(job)   # no-op once finished
                self.log_generation(job, shape, outcome)

    async def events(self, job: Job, shape: Responses, first: GenerationRecord, *, include_usage: bool,
                      shutdown: anyio.Event) -> AsyncIterator[dict]:
        """The stream's events. A server that shuts down (SIGTERM) ends it with an error event, so the client
        reads a whole response that says why it stopped rather than a connection cut mid-stream."""
        outcome = "cancelled"
        try:
            if shape.chat:
                yield {"data": _json(shape.role_chunk())}
            item: Union[GenerationRecord, BaseException, None, object] = first
            while True:
                if item is SHUTTING_DOWN:
                    outcome = "shutdown"
                    yield {"data": _json(_error_event(f"the server is shutting down: the generation stopped after "
                                                      f"{shape.n_generated} tokens", "server_shutting_down"))}
                    return
                if isinstance(item, BaseException) or item is None:
                    outcome = "failed"
                    why = str(item) if item is not None else "the generation was cancelled"
                    yield {"data": _json(_error_event(why))}
                    return
                chunk = shape.chunk(item)
                chunk.pop("usage", None)
                yield {"data": _json(chunk)}
                if item.finish_reason is not None:
                    break
                item = await _next_or_shutdown(job, shutdown)
            if include_usage:
                yield {"data": _json(shape.usage_chunk())}
            yield {"data": "[DONE]"}
            outcome = "done"
        finally:
            self.s.scheduler.cancel(job)   # a client that left: its slot stops at its next step (no-op once done)
            self.log_generation(job, shape, outcome)

    def log_generation(self, job: Job, shape: Responses, outcome: str) -> None:
        """One line per generation request, however it ended (done, cancelled: the client left, failed)."""
        self.s.metrics.generated_tokens.inc(shape.n_generated)
        if job.t_start is not None:
            self.s.metrics.queue_seconds.observe(job.t_start - job.t_submit)
        if job.t_first is not None and job.t_start is not None:
            self.s.metrics.first_token_seconds.observe(job.t_first - job.t_start)
        kv = (shape.usage or {}).get("kvflash") or {}
        log_request(id=shape.id, outcome=outcome, slot=job.slot_id, prompt_tokens=len(job.tokens),
                    reused_tokens=kv.get("prompt_tokens_reused"), completion_tokens=shape.n_generated,
                    queue_ms=_ms(job.t_submit, job.t_start), prompt_ms=_ms(job.t_start, job.t_first),
                    total_ms=_ms(job.t_submit, time.perf_counter()), page_ins=kv.get("page_ins"))


async def _json_body(http: Request):
    try:
        return json.loads(await http.body())
    except ValueError as e:   # not JSON, or not UTF-8
        raise APIError(400, f"the body is not JSON: {e}") from None


def _validated(model, data):
    """data as `model`, or the RequestValidationError FastAPI raises for a body it parses itself."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise RequestValidationError([{**error, "loc": ("body", *error["loc"])} for error in e.errors()]) from None


def _tokenized(tokenizer, body: TokenizeRequest) -> dict:
    tokens = tokenizer.encode(body.content, add_special=body.add_special, parse_special=body.parse_special)
    if not body.with_pieces:
        return {"tokens": tokens}
    return {"tokens": [{"id": t, "piece": tokenizer.piece(t).decode("utf-8", errors="replace")} for t in tokens]}


def _params(body, default_max_tokens: Optional[int]) -> SamplingParams:
    for stop in [body.stop] if isinstance(body.stop, str) else body.stop or []:
        text_bytes(stop, "stop")
    try:
        return body.sampling_params(default_max_tokens)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _body_too_large(limit: int) -> JSONResponse:
    return APIError(413, f"the request body is larger than {limit} bytes, more than any request that fits the "
                         f"context can need", code="request_too_large").response()


def _log_storage(state: ServerState, engine, limits: RequestLimits) -> None:
    """Say at startup what the server keeps on disk (conversations: the prefix cache, slot files) and where,
    and how large a request may be."""
    cache = engine.prefix_cache
    if cache is None:
        log.info("prefix cache off")
    else:
        try:
            mode = f"folder mode {stat.S_IMODE(cache.dir.stat().st_mode):o}, "
        except OSError:
            mode = ""   # PrefixCache warned: the cache is then a no-op
        log.info("prefix cache on: %s keeps the prompts of conversations (their tokens) on disk, across restarts, "
                 "up to %.0f MiB (%sfiles 600; --prefix-cache off: none)", cache.dir, cache.max_bytes / (1 << 20),
                 mode)
    if state.slot_save_path is not None:
        log.info("slot files (POST /slots/ID?action=save): %s (files 0600)", state.slot_save_path)
    log.info("requests: at most %d bytes of body, %d bytes of prompt text (the longest token is %d bytes, the "
             "context %d tokens)", limits.max_body_bytes, limits.max_text_bytes, limits.max_piece_bytes, limits.n_ctx)


def _check_model(state: ServerState, name: Optional[str]) -> None:
    if name is not None and name != state.model_name:
        raise APIError(404, f"the model {name!r} does not exist (this server serves {state.model_name!r})",
                       code="model_not_found", param="model")


async def _next_or(job: Job, other, otherwise):
    """The job's next item, or `otherwise` if the awaitable `other` completes first."""
    get = asyncio.ensure_future(job.out.get())
    other = asyncio.ensure_future(other)
    done, _ = await asyncio.wait({get, other}, return_when=asyncio.FIRST_COMPLETED)
    other.cancel()
    if get in done:
        return get.result()
    get.cancel()
    return otherwise


async def _next_or_disconnect(job: Job, http: Request):
    """The job's next item, or CLIENT_GONE if the client disconnects first (the caller cancels the job)."""
    return await _next_or(job, _disconnected(http), CLIENT_GONE)


async def _next_or_shutdown(job: Job, shutdown: anyio.Event):
    """The job's next item, or SHUTTING_DOWN if the server begins to shut down first."""
    if shutdown.is_set():
        return SHUTTING_DOWN
    return await _next_or(job, shutdown.wait(), SHUTTING_DOWN)


def _error_event(message: str, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


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
    os.chmod(path, PRIVATE_FILE)   # its token section is the conversation
    return {"id_slot": slot.id, "filename": path.name, "n_saved": slot.engine.session.n_tokens,
            "n_written": path.stat().st_size, "timings": {"save_ms": _ms(t0, time.perf_counter())}}


def _restore(slot, path: Path) -> dict:
    _idle(slot)
    t0 = time.perf_counter()
    slot.engine.load_state(path)
    slot.n_held = slot.engine.session.n_tokens
    return {"id_slot": slot.id, "filename": path.name, "n_restored": slot.n_held,
            "n_read": path.stat().st_size, "timings": {"restore_ms": _ms(t0, time.perf_counter())}}


def _erase(slot) -> dict:
    _idle(slot)
    n = slot.engine.session.n_tokens
    slot.engine.session.reset()
    slot.n_held = 0
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
            await self._serve(scope, receive, send_status)
        endpoint = "/slots/{id}" if path.startswith("/slots/") else path if path in ENDPOINTS else "other"
        self.metrics.requests.labels(endpoint, str(status[0])).inc()
        if not scope.get("state", {}).get("logs_itself"):
            log_request(path=path, status=status[0], ms=_ms(t0, time.perf_counter()))

    async def _serve(self, scope, receive, send) -> None:
        """The app; an error nothing else caught is answered as an OpenAI-shaped 500 naming it, here rather
        than by Starlette's outermost handler, which answers plain text and then re-raises, so that uvicorn
        closes the client's keep-alive connection."""
        started = False

        async def send_started(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, send_started)
        except Exception as e:   # noqa: BLE001 - answered and logged
            if started:
                raise   # the response is under way: nothing to answer with
            log.exception("%s %s failed", scope.get("method"), scope["path"])
            await APIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").response()(
                scope, receive, send)
