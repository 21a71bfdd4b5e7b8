"""The OpenAI-compatible HTTP server (Starlette on uvicorn) in front of one `Scheduler`.

Every choice, streamed chunks included, also carries its generated `token_ids` (the stop token
excluded), and `usage.jaxspec` the request's speculation figures (iterations, accepted drafts by
depth, latency).

Routes: POST /v1/completions and /v1/chat/completions (streamed as server-sent events with
`stream`, one chunk per segment's accepted tokens), GET /v1/models, /health and /metrics
(Prometheus text). Bad input is a 400 with an OpenAI-style error body (`{"error": {"message",
"type", "param", "code"}}`), as are an unknown route (404) or method (405) and a body larger than a
prompt of the server's context could be (413); an unknown model 404; a full queue 429; a server
shutting down 503. Prompts are tokenized off the event loop.
A client that disconnects gives its slot back; a request that fails fails alone.

The scheduler calls a request's listener from its own thread; the listener hands each `Delta` to the
event loop (`call_soon_threadsafe`), where the request's handler awaits it.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.errors import JaxspecError
from jaxspec.serving.requests import Delta, QueueFull, Request
from jaxspec.serving.scheduler import Scheduler

COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                 "stream", "stream_options", "n", "user"}
# OpenAI fields accepted only at their default, or null (jaxspec does not implement them); chat's
# logprobs is a boolean (false), completions' a count (null)
DEFAULT_ONLY = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": {}, "logprobs": False, "best_of": 1,
                "echo": False, "suffix": None, "top_logprobs": None}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt"} | set(DEFAULT_ONLY)
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens"} | set(DEFAULT_ONLY) - {"echo", "suffix", "best_of"}
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
BODY_BYTES_PER_TOKEN = 64  # a body's limit per token of context (and 64 KB besides): JSON-escaped text stays below


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    kind = "rate_limit_error" if status == 429 else "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


def create_app(scheduler: Scheduler, model_name: str) -> Starlette:
    """The ASGI app serving `scheduler` as model `model_name` (the scheduler must be started)."""
    created = int(time.time())
    tokenizer = scheduler.tokenizer

    async def health(_: HttpRequest) -> Response:
        if scheduler.stopping:
            return error_response(503, "the server is shutting down")
        return JSONResponse({"status": "ok"})

    async def models(_: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "jaxspec", "max_model_len": scheduler.max_len,
            "jaxspec": {**scheduler.spec.describe(), "slots": scheduler.slots, "max_top_k": scheduler.max_top_k,
                        **({"auto": scheduler.refinement.describe()} if scheduler.refinement else {})},
        }]})

    async def metrics(_: HttpRequest) -> Response:
        return PlainTextResponse(scheduler.metrics.render(), media_type="text/plain; version=0.0.4")

    async def completions(http: HttpRequest) -> Response:
        return await serve(http, chat=False)

    async def chat_completions(http: HttpRequest) -> Response:
        return await serve(http, chat=True)

    async def serve(http: HttpRequest, chat: bool) -> Response:
        try:
            body = await read_json(http, (1 << 16) + BODY_BYTES_PER_TOKEN * scheduler.max_len)
            model = body.get("model", model_name)
            if not isinstance(model, str):
                raise BadRequest("model must be a string", "model")
            if model != model_name:
                raise BadRequest(f"model {model!r} does not exist; this server serves {model_name!r}", "model", 404,
                                 "model_not_found")
            ids = await asyncio.to_thread(chat_prompt if chat else completion_prompt, body, tokenizer)
            request, stream, usage_chunk = parse_request(body, ids, chat, scheduler.max_len)
            loop, deltas = asyncio.get_running_loop(), asyncio.Queue()
            handle = scheduler.submit(request, lambda d: loop.call_soon_threadsafe(deltas.put_nowait, d))
        except BadRequest as e:
            return error_response(e.status, str(e), e.param, e.code)
        except JaxspecError as e:
            status = 503 if scheduler.stopping else 400
            return error_response(status, str(e))
        except QueueFull as e:
            return error_response(429, str(e))
        ident = ("chatcmpl-" if chat else "cmpl-") + handle.id
        shape = ChatChunks(ident, model_name) if chat else CompletionChunks(ident, model_name)
        if stream:
            return StreamingResponse(sse(handle, deltas, shape, usage_chunk), media_type="text/event-stream")
        return await complete(http, handle, deltas, shape)

    async def http_error(_: HttpRequest, e: HTTPException) -> Response:  # unknown routes and methods
        response = error_response(e.status_code, e.detail)
        response.headers.update(e.headers or {})  # a 405's Allow
        return response

    app = Starlette(routes=[
        Route("/health", health), Route("/v1/models", models), Route("/metrics", metrics),
        Route("/v1/completions", completions, methods=["POST"]), Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ], exception_handlers={HTTPException: http_error})
    app.router.redirect_slashes = False  # a route with a trailing slash is not found, not redirected
    return app


async def read_json(http: HttpRequest, limit: int) -> dict:
    """The body, a JSON object of at most `limit` bytes, whose strings are text (no lone surrogates)."""
    too_large = BadRequest(f"the request body is larger than this server takes ({limit} bytes)", status=413)
    size = http.headers.get("content-length", "")
    if size.isdigit() and int(size) > limit:
        raise too_large
    data = bytearray()
    try:
        async for chunk in http.stream():
            data += chunk
            if len(data) > limit:
                raise too_large
    except ClientDisconnect:
        raise BadRequest("the client disconnected before its body ended") from None
    try:
        body = json.loads(bytes(data))
        json.dumps(body, ensure_ascii=False).encode()  # a lone surrogate (an unpaired \ud800 escape) is no text
    except (ValueError, RecursionError) as e:  # ValueError: bad JSON, bytes or text, or an integer of > 4,300 digits
        raise BadRequest(f"the request body is not valid JSON text: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    return body


def completion_prompt(body: dict, tokenizer) -> list[int]:
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if not prompt:
            raise BadRequest("prompt is empty", "prompt")
        return tokenizer.encode(prompt, add_special_tokens=True)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise BadRequest("prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def chat_prompt(body: dict, tokenizer) -> list[int]:
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a role", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                raise BadRequest(f"messages[{i}]: only text content parts are supported", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content must be a string", "messages")
        plain.append({"role": m["role"], "content": content})
    if not tokenizer.has_chat_template:
        raise BadRequest("this model has no chat template; use /v1/completions", "messages")
    try:
        rendered = tokenizer.apply_chat_template(plain, add_generation_prompt=True)
    except Exception as e:  # the template's own checks (roles, order)
        raise BadRequest(f"the chat template rejected the messages: {e}", "messages") from None
    return tokenizer.encode(rendered)


def check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise BadRequest(f"unknown field {unknown[0]!r}", unknown[0])
    for name, default in DEFAULT_ONLY.items():
        value = body.get(name)
        # null, or the default itself; a boolean is not a number here (completions' logprobs 0 is not false)
        if not (value is None or (isinstance(value, bool) == isinstance(default, bool) and value == default)):
            raise BadRequest(f"{name} is not supported (only its default, {default!r})", name)


def parse_request(body: dict, ids: list[int], chat: bool, max_len: int) -> tuple[Request, bool, bool]:
    """(the scheduler's Request, stream, whether to send a usage chunk) from a checked body."""

    def number(name, default, kind=float, low=-math.inf, high=math.inf, open_low=False, open_high=False):
        value = body.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                kind is int and isinstance(value, float) and not value.is_integer()):
            raise BadRequest(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}", name)
        ok = (value > low if open_low else value >= low) and (value < high if open_high else value <= high)
        if not ok or isinstance(value, float) and not math.isfinite(value):  # (an int of any size compares exactly)
            interval = f"{'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}"
            raise BadRequest(f"{name} must be in {interval}, got {value!r}", name)
        return kind(value)

    number("n", 1, int, 1, 1)  # n = 1 only
    limit = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = number(limit, max_len - len(ids) if chat else COMPLETION_DEFAULT_MAX_TOKENS, int, 1)
    temperature = number("temperature", 1.0, float, 0, 2)
    top_p = number("top_p", 1.0, float, 0, 1, open_low=True)
    top_k = number("top_k", 0, int, -1)
    min_p = number("min_p", 0.0, float, 0, 1, open_high=True)
    seed = number("seed", None, int)
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) for s in stop):
        raise BadRequest("stop must be a string or a list of at most 4 strings", "stop")
    stop_ids = body.get("stop_token_ids")
    stop_ids = [] if stop_ids is None else stop_ids
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise BadRequest("stop_token_ids must be a list of token ids", "stop_token_ids")
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise BadRequest("ignore_eos must be true or false", "ignore_eos")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    options = body.get("stream_options")
    options = {} if options is None else options
    if not isinstance(options, dict) or set(options) - {"include_usage"} or not isinstance(
            options.get("include_usage", False), bool):
        raise BadRequest("stream_options takes include_usage (true or false) only", "stream_options")
    if not isinstance(body.get("user", ""), str):
        raise BadRequest("user must be a string", "user")
    sampling = SamplingConfig(temperature=temperature, top_k=0 if top_k == -1 else top_k, top_p=top_p, min_p=min_p)
    request = Request(tuple(ids), max_tokens, sampling, seed, tuple(stop), tuple(stop_ids), ignore_eos)
    return request, stream, bool(options.get("include_usage"))


class CompletionChunks:
    """The /v1/completions bodies: streamed chunks and the whole response."""

    object = "text_completion"

    def __init__(self, ident: str, model: str):
        self.ident, self.model, self.created = ident, model, int(time.time())

    def head(self) -> dict:
        return {"id": self.ident, "object": self.object, "created": self.created, "model": self.model}

    def chunk(self, text: str, finish_reason: str | None, token_ids: tuple[int, ...] = ()) -> dict:
        return {**self.head(), "choices": [{"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None,
                                            "token_ids": list(token_ids)}]}

    def first(self) -> dict | None:
        return None

    def whole(self, text: str, finish_reason: str, token_ids: list[int]) -> dict:
        return self.chunk(text, finish_reason, token_ids)


class ChatChunks(CompletionChunks):
    object = "chat.completion.chunk"

    def chunk(self, text: str, finish_reason: str | None, token_ids: tuple[int, ...] = ()) -> dict:
        delta = {"content": text} if text or finish_reason is None else {}
        return {**self.head(), "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None,
                                            "token_ids": list(token_ids)}]}

    def first(self) -> dict:
        return {**self.head(), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                                           "logprobs": None}]}

    def whole(self, text: str, finish_reason: str, token_ids: list[int]) -> dict:
        message = {"role": "assistant", "content": text}
        return {**self.head(), "object": "chat.completion", "choices": [
            {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None, "token_ids": token_ids}]}


def usage(delta: Delta) -> dict:
    s = delta.stats
    return {"prompt_tokens": s.prompt_tokens, "completion_tokens": s.completion_tokens,
            "total_tokens": s.prompt_tokens + s.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
            "jaxspec": {"iterations": s.iterations, "draft_tokens": s.drafted, "accepted_tokens": s.accepted,
                        "tokens_per_iteration": (s.accepted + s.iterations) / s.iterations if s.iterations else 0.0,
                        "acceptance_by_depth": list(s.accepted_by_depth), "queued_s": s.queued_s,
                        "time_to_first_token_s": s.first_token_s, "total_s": s.total_s}}


async def complete(http: HttpRequest, handle, deltas: asyncio.Queue, shape: CompletionChunks) -> Response:
    """Waits for the whole output; a client gone meanwhile cancels the request."""
    text, tokens = [], []
    while True:
        try:
            delta = await asyncio.wait_for(deltas.get(), timeout=0.5)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                handle.cancel()
                return Response(status_code=499)
            continue
        text.append(delta.text)
        tokens += delta.token_ids
        if delta.finish_reason is None:
            continue
        if delta.error is not None:
            return error_response(500, f"the request failed: {delta.error}")
        return JSONResponse({**shape.whole("".join(text), delta.finish_reason, tokens), "usage": usage(delta)})


async def sse(handle, deltas: asyncio.Queue, shape: CompletionChunks, usage_chunk: bool):
    """Server-sent events: a chunk per delta, the finish reason, the usage (if asked), [DONE]. A
    client that goes away (the generator is closed or cancelled) cancels the request."""
    event = lambda body: f"data: {json.dumps(body)}\n\n"
    done = False
    try:
        first = shape.first()
        if first is not None:
            yield event(first)
        while True:
            delta: Delta = await deltas.get()
            if delta.error is not None:
                done = True
                yield event({"error": {"message": f"the request failed: {delta.error}", "type": "server_error",
                                       "param": None, "code": None}})
                break
            if delta.text or delta.token_ids or delta.finish_reason is None:
                yield event(shape.chunk(delta.text, None, delta.token_ids))
            if delta.finish_reason is not None:
                done = True
                yield event(shape.chunk("", delta.finish_reason))
                if usage_chunk:
                    yield event({**shape.head(), "choices": [], "usage": usage(delta)})
                break
        yield "data: [DONE]\n\n"
    finally:
        if not done:
            handle.cancel()

