"""The OpenAI-compatible HTTP API over an AsyncEngine, as an ASGI app (Starlette; uvicorn serves it).

    app = build_app(engine, tokenizer, "SmolLM2-135M-Instruct")
    POST /v1/completions        {"model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream"}
    POST /v1/chat/completions   {"model", "messages", ...}: the prompt comes from the model's chat template
    GET  /v1/models   /health   /metrics (Prometheus text)

Starlette rather than FastAPI: FastAPI would check request bodies for us (pydantic) and answer 422
with its own body; checking them is part of the lab, and OpenAI answers 400 with its error body.
Streams are plain `StreamingResponse`s of SSE text: the framing is ours, nothing hides it. When a
client disconnects, Starlette cancels the task that iterates the stream, and the response's
background task aborts the request in any case, so its KV blocks are freed even if the stream
never started. The lab plugs its own parts in: `parse_completion`, `completion_events`, `text_stream`.
"""
from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from course.serve import metrics as prom
from course.serve import protocol, streaming
from course.serve.async_engine import QueueFull


def error_response(e: protocol.APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def build_app(engine, tokenizer, model_name: str, *, parse_completion: Callable = protocol.parse_completion,
              completion_events: Callable = streaming.completion_events,
              text_stream: Callable = streaming.TextStream, retry_after_s: int = 1) -> Starlette:
    """The API over `engine` (an AsyncEngine: add, stream, abort, num_waiting, start, stop, core)."""
    core = engine.core

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    def chat_ids(messages: list[dict]) -> list[int]:
        return encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    async def completions(request: Request) -> Response:
        try:
            req = parse_completion(await request.body(), model_name, encode, core.max_model_len)
        except protocol.APIError as e:
            return error_response(e)
        return await respond(request, req, chat=False)

    async def chat(request: Request) -> Response:
        try:
            req = protocol.parse_chat(await request.body(), model_name, chat_ids, core.max_model_len)
        except protocol.APIError as e:
            return error_response(e)
        return await respond(request, req, chat=True)

    async def respond(request: Request, req: protocol.GenerationRequest, chat: bool) -> Response:
        vocab = core.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in req.prompt_ids):
            return error_response(protocol.APIError(400, f"'prompt' holds token ids outside the vocabulary (0..{vocab - 1}).",
                                                    param="prompt"))
        try:
            rid = engine.add(req.prompt_ids, req.params, req.max_tokens, ignore_eos=req.ignore_eos)
        except QueueFull as e:
            return error_response(protocol.APIError(429, f"The server is busy: {e}. Retry after {retry_after_s} s.",
                                                    type="rate_limit_error", code="rate_limit_exceeded"),
                                  headers={"Retry-After": str(retry_after_s)})
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "created": int(time.time()), "model": model_name,
                "prompt_tokens": len(req.prompt_ids)}
        text = text_stream(decode, req.stop)
        if req.stream:
            if chat:                                # the lab's own function streams /v1/completions only
                events = streaming.completion_events(engine.stream(rid), text, meta, req.include_usage, chat=True)
            else:
                events = completion_events(engine.stream(rid), text, meta, req.include_usage)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(engine.abort, rid))
        try:
            result = await _unless_gone(request, streaming.collect(engine.stream(rid), text))
        finally:
            engine.abort(rid)                       # a no-op when it finished
        if result is None:
            return Response(status_code=499)        # the client left; nobody reads this
        whole, finish, n = result
        choice = ({"index": 0, "message": {"role": "assistant", "content": whole}, "logprobs": None, "finish_reason": finish}
                  if chat else {"index": 0, "text": whole, "logprobs": None, "finish_reason": finish})
        return JSONResponse({"id": meta["id"], "object": "chat.completion" if chat else "text_completion",
                             "created": meta["created"], "model": model_name, "choices": [choice],
                             "usage": streaming.usage(len(req.prompt_ids), n)})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                                         "owned_by": "course", "max_model_len": core.max_model_len}]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics_page(request: Request) -> Response:
        values = core.metrics() | {"waiting": engine.num_waiting}
        return Response(prom.render(values, model_name), media_type=prom.CONTENT_TYPE)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(protocol.APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(protocol.APIError(500, f"The server had an error: {exc!r}", type="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await engine.stop()

    started = int(time.time())
    routes = [Route("/v1/completions", completions, methods=["POST"]), Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics_page)]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={HTTPException: http_error, Exception: server_error})


async def _unless_gone(request: Request, work):
    """The result of `work`, or None (and `work` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        return None
    return task.result()
