"""Serving (lab 11): the course's engine behind an OpenAI-compatible HTTP API.

    from course.serve import LLMEngine, AsyncEngine, build_app, ServerThread
    core = LLMEngine(model, n_blocks=256, block_size=16, max_running=8, budget=256, policy="chunked",
                     eos_token_id=tokenizer.eos_token_id)
    app = build_app(AsyncEngine(core, max_waiting=32), tokenizer, "SmolLM2-135M-Instruct")
    with ServerThread(app) as server:          # uvicorn on a free port of 127.0.0.1, in a thread
        ...                                    # curl / openai / httpx against server.url

From a shell: `python -m course.serve --port 8000` (see `python -m course.serve --help`).

Files: engine.py (LLMEngine: one step of scheduling, paged blocks, prefix cache, forward, sampling),
async_engine.py (streams per request, cancellation, a bounded queue), protocol.py (the OpenAI
request contract, error bodies), streaming.py (incremental detokenization with offsets, stop
strings, SSE), logprobs.py (OpenAI's two logprobs shapes), app.py (the ASGI routes), metrics.py
(Prometheus text: gauges, counters, latency histograms), grammars.py (response_format's grammars,
compiled once per schema off the event loop, lab 13), server.py (uvicorn in a thread),
loadgen.py (a timed streaming client and random workloads), __main__.py (the command line).
"""
from course.serve.app import build_app
from course.serve.async_engine import AsyncEngine, QueueFull
from course.serve.engine import LLMEngine, StepOutput
from course.serve.grammars import GrammarCache
from course.serve.loadgen import RequestRecord, random_requests, send_completion
from course.serve.protocol import APIError, GenerationRequest, parse_chat, parse_completion
from course.serve.server import ServerThread
from course.serve.streaming import TextStream, completion_events, sse

__all__ = ["APIError", "AsyncEngine", "GenerationRequest", "GrammarCache", "LLMEngine", "QueueFull", "RequestRecord",
           "ServerThread", "StepOutput", "TextStream", "build_app", "completion_events", "parse_chat", "parse_completion",
           "random_requests", "send_completion", "sse"]
