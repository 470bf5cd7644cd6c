"""The released parts of lab 11's load generator: one streaming client that timestamps what it
receives, and a random workload. (Arrival times, running many clients at once, and the metrics are
the lab's problems.) It speaks plain OpenAI-compatible HTTP, so it measures any such server: this
course's, or vLLM on a GPU (`vllm serve HuggingFaceTB/SmolLM2-135M-Instruct`, then base_url
"http://127.0.0.1:8000" and that model name).

    async with httpx.AsyncClient(timeout=60) as client:
        rec = await send_completion(client, "http://127.0.0.1:8000", "SmolLM2-135M-Instruct", prompt_ids, 32)
    rec.ttft, rec.itl, rec.latency, rec.output_tokens

What a record holds follows vLLM's serving benchmark (`vllm bench serve`): the time to the first
chunk that carries text, the gap before every later such chunk, and the time until the stream ended.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx
import numpy as np


@dataclass
class RequestRecord:
    """What the client saw of one request. Times in seconds; `start` on the time.perf_counter clock."""

    ok: bool = False
    start: float = 0.0
    ttft: float = 0.0                                      # first text chunk - start
    itl: list[float] = field(default_factory=list)         # gaps between text chunks, in order
    latency: float = 0.0                                   # end of the stream - start (end-to-end latency)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str = ""


async def send_completion(client: httpx.AsyncClient, base_url: str, model: str, prompt: str | list[int],
                          max_tokens: int, *, temperature: float = 0.0, ignore_eos: bool = True,
                          extra: dict | None = None) -> RequestRecord:
    """POST one streamed /v1/completions request and time every chunk that carries text.
    `ignore_eos` (a vLLM extension this course's server has too) makes every request produce exactly
    max_tokens tokens, so runs compare like with like. Errors are recorded, never raised."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos} | (extra or {})
    rec = RequestRecord(start=time.perf_counter(), prompt_tokens=len(prompt) if isinstance(prompt, list) else 0)
    last, pieces, chunks = rec.start, [], 0
    try:
        async with client.stream("POST", f"{base_url.rstrip('/')}/v1/completions", json=body) as response:
            if response.status_code != 200:
                rec.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:300]}"
                return rec
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue                               # the empty line between events
                data = line[len("data: "):]
                if data == "[DONE]":
                    rec.ok = True
                    break
                event = json.loads(data)
                if event.get("usage"):
                    rec.output_tokens = event["usage"]["completion_tokens"]
                    rec.prompt_tokens = event["usage"]["prompt_tokens"]
                text = event["choices"][0].get("text", "") if event.get("choices") else ""
                if text:
                    now = time.perf_counter()
                    if chunks == 0:
                        rec.ttft = now - rec.start
                    else:
                        rec.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    pieces.append(text)
        rec.latency = time.perf_counter() - rec.start
        rec.text = "".join(pieces)
        rec.output_tokens = rec.output_tokens or chunks
        if not rec.ok:
            rec.error = "the stream ended without data: [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        rec.ok, rec.error = False, f"{type(e).__name__}: {e}"
    return rec


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, vocab: int = 49152,
                    seed: int = 0) -> list[tuple[list[int], int]]:
    """n (prompt token ids, output length) pairs, lengths uniform in [len * (1 - r), len * (1 + r)],
    prompts of random token ids (vLLM's `--dataset-name random`). Token ids 1000.. avoid special tokens."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    lo_in, hi_in = max(1, int(input_len * (1 - range_ratio))), int(input_len * (1 + range_ratio))
    lo_out, hi_out = max(1, int(output_len * (1 - range_ratio))), int(output_len * (1 + range_ratio))
    ins, outs = rng.integers(lo_in, hi_in + 1, n), rng.integers(lo_out, hi_out + 1, n)
    return [(rng.integers(1000, vocab, int(k)).tolist(), int(m)) for k, m in zip(ins, outs)]
