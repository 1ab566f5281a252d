"""The HTTP face of the engine: OpenAI's API on FastAPI (``attnlab serve``, docs/serving.md).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (``"stream": true``: server-sent
events, one ``data: {json}`` line per chunk and a last ``data: [DONE]``), ``GET /v1/models``,
``GET /health``. Sampling: ``temperature`` (OpenAI's default 1; 0 is greedy), ``top_p``,
``max_tokens`` (or ``max_completion_tokens``), ``stop`` (a string or a list), ``seed``; ``n`` must be 1.
The ``model`` field is not checked: one model is served, whatever a client calls it.

Safety. An API key, when set, is required on every route (``Authorization: Bearer KEY``, else
401); bodies over ``max_body_bytes`` get 413 before they are parsed; ``max_tokens`` over the limit
or a prompt that fills the context 400; a full queue 429; a request still unfinished after
``timeout`` seconds 504. Every error is OpenAI's JSON, ``{"error": {"message", "type", "param",
"code"}}``, never a traceback; a fault inside the engine fails the requests it was decoding (500)
and the server goes on.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass

from starlette.requests import Request as HTTPRequest

from .engine import Delta, Engine, Failed, Finished, QueueFull, Request

__all__ = ["ServeSettings", "create_app"]

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          413: "invalid_request_error", 429: "rate_limit_error", 504: "timeout_error"}


@dataclass
class ServeSettings:
    """The server's limits (docs/serving.md): see the module docstring."""
    model_name: str = "attnlab"
    api_key: str | None = None
    max_tokens: int = 1024                # the most a request may ask for
    default_max_tokens: int = 256         # what a request that names none gets
    max_body_bytes: int = 1 << 20
    timeout: float = 600.0                # seconds from arrival to the last token


def error_body(status: int, message: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": status}}


class _Guard:
    """ASGI middleware ahead of the routes: the API key on every route (401), then the body's size
    (413), read whole before anything parses it."""

    def __init__(self, app, settings: ServeSettings):
        self.app, self.settings = app, settings

    async def _refuse(self, send, status: int, message: str) -> None:
        body = json.dumps(error_body(status, message)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        key = self.settings.api_key
        if key is not None:
            given = headers.get(b"authorization", b"").decode("latin-1")
            token = given[7:] if given.lower().startswith("bearer ") else ""
            if not hmac.compare_digest(token.encode(), key.encode()):
                return await self._refuse(send, 401, "invalid or missing API key (Authorization: Bearer KEY)")
        limit = self.settings.max_body_bytes
        too_big = f"the request body exceeds {limit} bytes"
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, 413, too_big)
        chunks, size = [], 0
        while True:                               # read it all now (bounded), replay it to the route
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await self._refuse(send, 413, too_big)
            if not message.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()               # after the body: the disconnect, when it comes

        return await self.app(scope, replay, send)


def _check(data, settings: ServeSettings, chat: bool) -> dict:
    """The request's fields, validated; ValueError with (message, param)."""
    if not isinstance(data, dict):
        raise ValueError("the body must be a JSON object", None)
    if chat:
        msgs = data.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in msgs):
            raise ValueError("messages must be a non-empty list of {role, content} with string content", "messages")
    else:
        prompt = data.get("prompt", "")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("prompt must be a string (one prompt per request)", "prompt")
        data["prompt"] = prompt
    n = data.get("max_completion_tokens", data.get("max_tokens"))
    n = settings.default_max_tokens if n is None else n
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= settings.max_tokens:
        raise ValueError(f"max_tokens must be an integer in [1, {settings.max_tokens}]", "max_tokens")
    t = data.get("temperature", 1.0)
    t = 1.0 if t is None else t
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 2:
        raise ValueError("temperature must be a number in [0, 2]", "temperature")
    p = data.get("top_p")
    if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
        raise ValueError("top_p must be a number in (0, 1]", "top_p")
    stop = data.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ValueError("stop must be a non-empty string or a list of up to 4 of them", "stop")
    seed = data.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError("seed must be a non-negative integer", "seed")
    if data.get("n", 1) != 1:
        raise ValueError("n must be 1 (one choice per request)", "n")
    return dict(max_tokens=n, temperature=float(t), top_p=None if p is None or p == 1 else float(p), stop=stop,
                seed=seed, stream=bool(data.get("stream", False)))


class _Served:
    """What the routes need of the model: prompts as ids, the end tokens, the context."""

    def __init__(self, lm, template, settings: ServeSettings):
        self.lm, self.template, self.settings = lm, template, settings
        self.eos = frozenset(lm.eos_ids)
        end = template.end_of_turn() if template is not None else None
        tok_id = getattr(lm.tokenizer, "token_id", None)
        end_id = tok_id(end) if end and callable(tok_id) else None
        self.chat_stop_ids = self.eos | ({end_id} if end_id is not None else set())
        self.chat_stop = [end] if end and end_id is None else []      # a template's marker spelt out in pieces

    def encode(self, text: str, special: bool) -> list[int]:
        tok = self.lm.tokenizer
        try:
            return list(tok.encode(text, add_special_tokens=special))
        except TypeError:                     # attnlab's own tokenizers add no special tokens anyway
            return list(tok.encode(text))

    def request(self, data: dict, chat: bool) -> tuple[Request, bool]:
        opts = _check(data, self.settings, chat)
        if chat:
            if self.template is None:
                raise ValueError("this model has no chat template; use /v1/completions", "messages")
            ids = self.encode(self.template.render(data["messages"], add_generation_prompt=True), False)
        else:
            ids = self.encode(data["prompt"], True) if data["prompt"] else []
            ids = ids or ([self.lm.start_id] if self.lm.start_id is not None else [])
        if not ids:
            raise ValueError("the prompt is empty and the model has no start token", "prompt")
        context = self.lm.context
        if context is not None and len(ids) >= context:
            raise ValueError(f"the prompt is {len(ids)} tokens; the model's context is {context}", "messages"
                             if chat else "prompt")
        n = opts["max_tokens"] if context is None else min(opts["max_tokens"], context - len(ids))
        request = Request(ids, n, opts["temperature"], opts["top_p"], opts["seed"],
                          opts["stop"] + (self.chat_stop if chat else []),
                          self.chat_stop_ids if chat else self.eos, time.monotonic() + self.settings.timeout)
        return request, opts["stream"]


def _json(status: int, body: dict):
    from fastapi.responses import JSONResponse
    return JSONResponse(body, status_code=status)


def create_app(lm, engine: Engine, settings: ServeSettings, template=None):
    """The FastAPI application serving ``lm`` through ``engine`` (started and stopped by the caller)."""
    from fastapi import FastAPI
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import StreamingResponse
    from starlette.exceptions import HTTPException

    served = _Served(lm, template, settings)
    app = FastAPI(title="attnlab", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException):
        message = "no such route" if e.status_code == 404 else str(e.detail)
        return _json(e.status_code, error_body(e.status_code, message))

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        first = (e.errors() or [{}])[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _json(400, error_body(400, f"the request is not valid: {where} {first.get('msg', '')}".strip()))

    @app.exception_handler(Exception)
    async def internal(_, e: Exception):
        return _json(500, error_body(500, f"internal error ({type(e).__name__})"))

    @app.get("/health")
    async def health():
        return {"status": "ok", **engine.load}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": settings.model_name, "object": "model", "created": 0,
                                            "owned_by": "attnlab"}]}

    async def complete(http: HTTPRequest, chat: bool):
        body = await http.body()
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            return _json(400, error_body(400, f"the body is not valid JSON ({e.__class__.__name__})"))
        try:
            request, stream = served.request(data, chat)
        except ValueError as e:
            message, param = e.args if len(e.args) == 2 else (str(e), None)
            return _json(400, error_body(400, message, param))
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        try:
            handle = engine.submit(request, notify=lambda: loop.call_soon_threadsafe(wake.set))
        except QueueFull as e:
            return _json(429, error_body(429, str(e)))
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        chunks = _Chunks(ident, settings.model_name, chat)
        if stream:
            return StreamingResponse(_sse(handle, wake, chunks), media_type="text/event-stream",
                                     headers={"cache-control": "no-cache"})
        text, finished = [], None
        try:
            async for event in _events(handle, wake):
                if isinstance(event, Delta):
                    text.append(event.text)
                elif isinstance(event, Failed):
                    return _json(event.status, error_body(event.status, event.message))
                else:
                    finished = event
        finally:
            handle.cancel()                       # gone before the end (a client that left): free the row
        return chunks.whole("".join(text), finished)

    @app.post("/v1/chat/completions")
    async def chat_completions(http: HTTPRequest):
        return await complete(http, chat=True)

    @app.post("/v1/completions")
    async def completions(http: HTTPRequest):
        return await complete(http, chat=False)

    return _Guard(app, settings)


async def _events(handle, wake: asyncio.Event):
    """The handle's events, waiting on the event loop (the engine sets ``wake`` after each push)."""
    while True:
        event = handle.pop()
        if event is None:
            await wake.wait()
            wake.clear()
            continue
        yield event
        if isinstance(event, (Finished, Failed)):
            return


class _Chunks:
    """OpenAI's response objects for one request."""

    def __init__(self, ident: str, model: str, chat: bool):
        self.ident, self.model, self.chat, self.created = ident, model, chat, int(time.time())
        self.kind = "chat.completion" if chat else "text_completion"

    def _choice(self, text: str | None, reason: str | None, whole: bool) -> dict:
        if not self.chat:
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": reason}
        if whole:
            return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": reason}
        delta = {} if text is None else {"content": text}
        return {"index": 0, "delta": delta, "finish_reason": reason}

    def _usage(self, f: Finished) -> dict:
        return {"prompt_tokens": f.prompt_tokens, "completion_tokens": f.completion_tokens,
                "total_tokens": f.prompt_tokens + f.completion_tokens}

    def whole(self, text: str, f: Finished) -> dict:
        return {"id": self.ident, "object": self.kind, "created": self.created, "model": self.model,
                "choices": [self._choice(text, f.reason, True)], "usage": self._usage(f)}

    def chunk(self, text: str | None, reason: str | None = None, first: bool = False) -> str:
        choice = self._choice(text, reason, False)
        if first and self.chat:
            choice["delta"] = {"role": "assistant", "content": ""}
        body = {"id": self.ident, "object": self.kind + ("" if not self.chat else ".chunk"),
                "created": self.created, "model": self.model, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"


async def _sse(handle, wake: asyncio.Event, chunks: _Chunks):
    """Server-sent events: a first chunk (the chat's role), one per piece of text, the finish reason,
    ``[DONE]``. A client that goes away cancels the generator here, and the request leaves the batch."""
    try:
        if chunks.chat:
            yield chunks.chunk(None, first=True)
        async for event in _events(handle, wake):
            if isinstance(event, Delta):
                yield chunks.chunk(event.text)
            elif isinstance(event, Failed):
                yield f"data: {json.dumps(error_body(event.status, event.message))}\n\n"
            else:
                yield chunks.chunk(None, event.reason)
        yield "data: [DONE]\n\n"
    finally:
        handle.cancel()


class Server:
    """The engine and the application on uvicorn: ``run()`` blocks (the command), ``start()`` runs in a
    thread and returns once the socket listens (tests, benchmarks); ``port`` 0 takes a free one."""

    def __init__(self, lm, settings: ServeSettings, template=None, host: str = "127.0.0.1", port: int = 8000,
                 max_batch: int = 8, max_waiting: int = 64, log_level: str = "warning"):
        import uvicorn
        self.engine = Engine(lm, max_batch=max_batch, max_waiting=max_waiting)
        self.app = create_app(lm, self.engine, settings, template)
        config = uvicorn.Config(self.app, host=host, port=port, log_level=log_level, access_log=False,
                                timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.host, self._thread = host, None

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def run(self) -> None:
        self.engine.start()
        try:
            self.server.run()
        finally:
            self.engine.close()

    def start(self, timeout: float = 30.0) -> "Server":
        import threading
        self.engine.start()
        self._thread = threading.Thread(target=self.server.run, name="attnlab-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine.close()
