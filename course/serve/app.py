"""The OpenAI-compatible HTTP API over an AsyncEngine, as an ASGI app (Starlette; uvicorn serves it).

    app = build_app(engine, tokenizer, "SmolLM2-135M-Instruct")
    POST /v1/completions        {"prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", ...}
    POST /v1/chat/completions   {"messages", ...}: the prompt comes from the model's chat template
    GET  /v1/models   /health   /metrics (Prometheus text)

Starlette rather than FastAPI: FastAPI would check request bodies for us (pydantic) and answer 422
with its own body; checking them is part of the lab (protocol.py holds the contract), and OpenAI
answers 400 with its error body. Bodies larger than `max_body_bytes` get 413 before they are parsed.
Streams are plain `StreamingResponse`s of SSE text: the framing is ours, nothing hides it. When a
client disconnects, Starlette cancels the task that iterates the stream, and the response's
background task aborts the request in any case, so its KV blocks are freed even if the stream
never started. The lab plugs its own parts in: `parse_completion`, `completion_events`,
`text_stream`; they serve what they know (one prompt, text only), and the course's own parts serve
the rest (a list of prompts, logprobs, echo, usage in every chunk).

Structured outputs (`response_format` json_object or json_schema, on both endpoints): served when the
engine's `add_request` takes a `grammar` (the course's LLMEngine does; a lab's engine may not, and
then they are refused by name). The grammar comes from a GrammarCache (grammars.py): compiled in a
worker thread the first time a schema is seen, then shared; a schema outside the subset is a 400
naming the keyword, before anything reaches the engine. The engine masks each constrained request's
logits at every step (engine.py); text streams and responses are built exactly as for text.

A list of prompts runs as separate engine requests at once (the engine batches them anyway); their
choices come back in order, each with its `index`, streamed interleaved as they come. Every request
is timed for /metrics (metrics.RequestStats): first token, gaps between tokens, the whole request,
and how it ended (stop, length, abort), known here and not in the engine: a stop string is a
client-side stop the engine only sees as an abort.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import inspect
import time
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from course.serve import metrics as prom
from course.serve import protocol, streaming
from course.serve.async_engine import QueueFull
from course.serve.grammars import GrammarCache
from course.serve.logprobs import ChatLogprobs, CompletionLogprobs

MAX_BODY_BYTES = 4 << 20           # 4 MiB: far more than the longest context in token ids or text


def error_response(e: protocol.APIError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def build_app(engine, tokenizer, model_name: str, *, parse_completion: Callable = protocol.parse_completion,
              completion_events: Callable = streaming.completion_events,
              text_stream: Callable = streaming.TextStream, retry_after_s: int = 1,
              max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The API over `engine` (an AsyncEngine: add, stream, abort, num_waiting, start, stop, core)."""
    core = engine.core
    vocab = core.model.cfg.vocab_size
    stats = prom.RequestStats(core.max_model_len)
    structured = _takes_grammar(core)
    grammars = GrammarCache(tokenizer, vocab, eos_token_id=getattr(core, "eos_token_id", None))

    def encode(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False).input_ids

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True)

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(token: int) -> str:              # one token's text in logprobs (special tokens shown)
        return tokenizer.decode([token])

    def chat_ids(messages: list[dict]) -> list[int]:
        return encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))

    async def read_body(request: Request) -> bytes:
        """The body, or 413 past max_body_bytes: the rest is read and dropped (a client still sending
        would otherwise see its connection closed instead of the answer), never stored."""
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size <= max_body_bytes:
                chunks.append(chunk)
            else:
                chunks.clear()
        if size > max_body_bytes:
            raise protocol.APIError(413, f"The request body is larger than this server accepts ({max_body_bytes} bytes).")
        return b"".join(chunks)

    async def completions(request: Request) -> Response:
        try:
            body = await read_body(request)
            req = (protocol.parse_completion(body, model_name, encode, core.max_model_len, vocab, structured=structured)
                   if parse_completion is protocol.parse_completion
                   else parse_completion(body, model_name, encode, core.max_model_len))
        except protocol.APIError as e:
            return error_response(e)
        return await respond(request, req, chat=False)

    async def chat(request: Request) -> Response:
        try:
            req = protocol.parse_chat(await read_body(request), model_name, chat_ids, core.max_model_len, vocab,
                                      structured=structured)
        except protocol.APIError as e:
            return error_response(e)
        return await respond(request, req, chat=True)

    async def respond(request: Request, req: protocol.GenerationRequest, chat: bool) -> Response:
        prompts = req.all_prompts
        if any(not 0 <= t < vocab for p in prompts for t in p):
            return error_response(protocol.APIError(400, f"'prompt' holds token ids outside the vocabulary (0..{vocab - 1}).",
                                                    param="prompt"))
        if any(not 0 <= t < vocab for t in req.params.logit_bias or ()):   # a bad id would fail the engine's step
            return error_response(protocol.APIError(400, f"'logit_bias' keys must be token ids in 0..{vocab - 1}.",
                                                    param="logit_bias"))
        options = {"ignore_eos": req.ignore_eos}                 # only what is on: a lab's engine may know no more
        for name, value, off in (("min_tokens", req.min_tokens, 0), ("logprobs", req.logprobs, None),
                                 ("stop_token_ids", req.stop_token_ids, ())):
            if value != off:
                options[name] = value
        if req.echo and req.logprobs is not None:
            options["prompt_logprobs"] = req.logprobs
        if req.response_format is not None:                     # compiled off the event loop, once per schema
            try:
                options["grammar"] = await grammars.get(req.response_format)
            except protocol.APIError as e:
                return error_response(e)
        rids = []
        try:
            for p in prompts:                                    # echo with max_tokens 0 still runs one step
                rids.append(engine.add(p, req.params, max(req.max_tokens, 1), **options))
        except QueueFull as e:
            for rid in rids:
                engine.abort(rid)
            return error_response(protocol.APIError(429, f"The server is busy: {e}. Retry after {retry_after_s} s.",
                                                    type="rate_limit_error", code="rate_limit_exceeded"),
                                  headers={"Retry-After": str(retry_after_s)})
        records = [stats.start(len(p)) for p in prompts]
        meta = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rids[0]}", "created": int(time.time()), "model": model_name,
                "prompt_tokens": sum(len(p) for p in prompts)}
        texts = [text_stream(decode, req.stop) if req.max_tokens > 0 else _Mute() for _ in prompts]
        streams = [_observed(engine.stream(rid), rec, text, echo_only=req.max_tokens == 0)
                   for rid, rec, text in zip(rids, records, texts)]

        def abort_all():
            for rid, rec in zip(rids, records):
                engine.abort(rid)
                rec.finish("abort")                              # a no-op for the finished ones

        def formatter(i: int):
            if req.logprobs is None:
                return None
            if chat:
                return ChatLogprobs(token_text)
            return CompletionLogprobs(token_text, list(prompts[i]) if req.echo else None, generated=req.max_tokens > 0)

        def echo_text(i: int) -> str:
            if not req.echo:
                return ""
            sent = req.prompt_texts[i] if i < len(req.prompt_texts) else None
            return sent if sent is not None else decode(prompts[i])

        if req.stream:
            if req.plain:                                        # the lab's parts serve a plain stream
                events = (streaming.completion_events(streams[0], texts[0], meta, req.include_usage, chat=True) if chat
                          else completion_events(streams[0], texts[0], meta, req.include_usage))
            else:
                per = [streaming.completion_events(s, t, meta | {"prompt_tokens": len(p)}, chat=chat, index=i,
                                                   logprobs=formatter(i), continuous_usage=req.continuous_usage,
                                                   echo=echo_text(i), done=False)
                       for i, (s, t, p) in enumerate(zip(streams, texts, prompts))]
                head = {"id": meta["id"], "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": meta["created"], "model": model_name}
                events = _merged(per, head, req.include_usage, meta["prompt_tokens"], records)
            return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"},
                                     background=BackgroundTask(abort_all))

        async def one(i: int) -> dict:
            whole, read, finish, _ = await streaming.collect_outputs(streams[i], texts[i])
            lp = formatter(i)(read) if req.logprobs is not None else None
            if chat:
                return {"index": i, "message": {"role": "assistant", "content": whole}, "logprobs": lp,
                        "finish_reason": finish}
            return {"index": i, "text": echo_text(i) + whole, "logprobs": lp, "finish_reason": finish}

        try:
            result = await _unless_gone(request, asyncio.gather(*[one(i) for i in range(len(prompts))]))
        finally:
            abort_all()                                          # a no-op for the finished ones
        if result is None:
            return Response(status_code=499)                     # the client left; nobody reads this
        return JSONResponse({"id": meta["id"], "object": "chat.completion" if chat else "text_completion",
                             "created": meta["created"], "model": model_name, "choices": result,
                             "usage": streaming.usage(meta["prompt_tokens"], sum(r.tokens for r in records))})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                                         "owned_by": "course", "max_model_len": core.max_model_len}]})

    async def health(request: Request) -> Response:
        return Response(status_code=200)

    async def metrics_page(request: Request) -> Response:
        values = core.metrics() | grammars.metrics() | {"waiting": engine.num_waiting}
        return Response(prom.render(values, model_name, requests=stats), media_type=prom.CONTENT_TYPE)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(protocol.APIError(exc.status_code, f"{request.method} {protocol.cut(request.url.path)}: "
                                                f"{exc.detail}", type=kind))

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(protocol.APIError(500, f"The server had an error: {protocol.cut(repr(exc))}",
                                                type="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        yield
        await engine.stop()

    started = int(time.time())
    routes = [Route("/v1/completions", completions, methods=["POST"]), Route("/v1/chat/completions", chat, methods=["POST"]),
              Route("/v1/models", models), Route("/health", health), Route("/metrics", metrics_page)]
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error, Exception: server_error})
    app.state.request_stats = stats
    app.state.grammars = grammars
    return app


def _takes_grammar(core) -> bool:
    """Can this engine constrain decoding? True when its add_request takes a `grammar` (the course's does)."""
    try:
        return "grammar" in inspect.signature(core.add_request).parameters
    except (AttributeError, TypeError, ValueError):
        return False


async def _observed(outputs: AsyncIterator, rec, text, echo_only: bool = False) -> AsyncIterator:
    """The engine's outputs, timed into `rec`; when the stream ends, `rec` learns how: the engine's
    finish reason, "stop" when the text stream found a stop string, else "abort" (the client left).
    echo_only (echo with max_tokens 0): the first output alone, its token never shown, "length"."""
    reason = "abort"
    try:
        async for out in outputs:
            rec.token()
            if echo_only:                                   # the prompt scored: its token is not the answer's
                rec.tokens, reason = 0, "length"
                yield dataclasses.replace(out, finish_reason="length")
                return
            reason = out.finish_reason or reason
            yield out
    finally:
        rec.finish("stop" if reason == "abort" and getattr(text, "stopped", False) else reason)
        await outputs.aclose()


class _Mute:
    """The text stream of echo with max_tokens 0: no text beyond the prompt."""

    stopped = False

    def push(self, token: int) -> str:
        return ""

    def flush(self) -> str:
        return ""


async def _merged(streams: list, head: dict, include_usage: bool, prompt_tokens: int, records):
    """The SSE events of several choices, interleaved as they come, then usage and [DONE]."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(events):
        try:
            async for e in events:
                await queue.put(e)
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            await queue.put(exc)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        live = len(tasks)
        while live:
            e = await queue.get()
            if e is None:
                live -= 1
            elif isinstance(e, Exception):
                raise e
            else:
                yield e
    finally:
        for t in tasks:
            t.cancel()
    if include_usage:
        yield streaming.sse(head | {"choices": [], "usage": streaming.usage(prompt_tokens, sum(r.tokens for r in records))})
    yield streaming.sse("[DONE]")


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
        task.add_done_callback(lambda t: t.cancelled() or t.exception())   # retrieved: asyncio logs nothing
        return None
    return task.result()
