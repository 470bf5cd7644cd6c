"""The OpenAI-compatible server (lab 11) over a real uvicorn on 127.0.0.1: routes, SSE streams, errors
that leave the server serving, a client that disconnects (its KV blocks come back, seen in /metrics),
a full queue (429 + Retry-After), many concurrent streaming clients (every response whole and their
own), the openai client, the real model once, and `python -m course.serve`.

A tiny random model with the real tokenizer's vocabulary keeps each test to a second or two. Every
wait polls with a deadline; every request loop is bounded."""
import asyncio
import json
import os
import random
import subprocess
import sys
import time

import httpx
import pytest
import torch

import course
from course.engine import SamplingParams
from course.serve import (APIError, AsyncEngine, LLMEngine, ServerThread, TextStream, build_app, parse_chat,
                          parse_completion, random_requests, send_completion)
from course.serve.metrics import parse as parse_metrics
from tiny_models import tiny_llama

NAME = "tiny"


@pytest.fixture(scope="module")
def tokenizer():
    return course.load_tokenizer()


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return tiny_llama(len(tokenizer))


def start(model, tokenizer, *, max_running=4, max_waiting=8, n_blocks=256, budget=32, policy="chunked"):
    core = LLMEngine(model, n_blocks=n_blocks, block_size=16, max_running=max_running, budget=budget, policy=policy,
                     eos_token_id=tokenizer.eos_token_id)
    server = ServerThread(build_app(AsyncEngine(core, max_waiting=max_waiting), tokenizer, NAME)).start()
    server.core = core
    return server


@pytest.fixture(scope="module")
def server(tiny, tokenizer):
    s = start(tiny, tokenizer, max_waiting=64)
    yield s
    s.stop()


def greedy_text(model, tokenizer, prompt_ids, n):
    """The reference: greedy tokens with no cache, stopping at EOS, decoded as the server decodes."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.tensor([prompt_ids + out])
            out.append(int(model(ids, torch.arange(ids.shape[1])[None])[0, -1].argmax()))
            if out[-1] == tokenizer.eos_token_id:
                break
    return tokenizer.decode(out, skip_special_tokens=True), out


def wait_for(cond, seconds=10.0):
    deadline = time.monotonic() + seconds
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def sse_payloads(lines):
    """Check the SSE framing of a whole stream (data lines separated by empty lines, [DONE] last)."""
    lines = list(lines)
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", f"the stream must end with [DONE]: {lines[-3:]}"
    data = [ln for ln in lines if ln]
    assert all(ln.startswith("data: ") for ln in data), "every non-empty line is a data line"
    assert all(lines[i + 1] == "" for i, ln in enumerate(lines[:-1]) if ln), "an empty line after every event"
    return [json.loads(ln[6:]) for ln in data[:-1]]


# --- routes -------------------------------------------------------------------------------------

def test_health_models_and_metrics(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        models = http.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == NAME
        r = http.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    from prometheus_client.parser import text_string_to_metric_families
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name in ("course:num_requests_running", "course:num_requests_waiting", "course:kv_blocks_used",
                 "course:kv_blocks_free", "course:prefix_cache_hit_rate"):
        assert name in families and families[name].type == "gauge", name
    for name in ("course:generation_tokens", "course:prefix_cache_queries", "course:prompt_tokens"):
        assert families[name].type == "counter", name          # the parser drops the _total suffix
    assert families["course:kv_blocks_free"].samples[0].labels == {"model_name": NAME}


def test_completion_whole_and_streamed_equal_the_reference(server, tiny, tokenizer):
    prompt = "The capital of France is"
    want, _ = greedy_text(tiny, tokenizer, tokenizer(prompt, add_special_tokens=False).input_ids, 12)
    body = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        whole = http.post("/v1/completions", json=body).json()
        assert whole["object"] == "text_completion" and whole["choices"][0]["text"] == want
        assert whole["usage"]["prompt_tokens"] == 5 and whole["choices"][0]["finish_reason"] in ("length", "stop")
        with http.stream("POST", "/v1/completions", json=body | {"stream": True, "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            chunks = sse_payloads(r.iter_lines())
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == whole["choices"][0]["finish_reason"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert len({c["id"] for c in chunks}) == 1


def test_chat_completion_uses_the_chat_template(server, tiny, tokenizer):
    messages = [{"role": "user", "content": "Hi!"}]
    ids = tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False).input_ids
    want, _ = greedy_text(tiny, tokenizer, ids, 6)
    body = {"model": NAME, "messages": messages, "max_tokens": 6, "temperature": 0}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        reply = http.post("/v1/chat/completions", json=body).json()
        assert reply["object"] == "chat.completion" and reply["choices"][0]["message"]["content"] == want
        with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
            chunks = sse_payloads(r.iter_lines())
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == want


def test_stop_strings_end_the_text_and_free_the_request(server, tiny, tokenizer):
    ids = tokenizer("Once upon a time", add_special_tokens=False).input_ids
    want, _ = greedy_text(tiny, tokenizer, ids, 20)
    stop = want[3:6] if len(want) > 6 else None
    if not stop or not stop.strip():
        pytest.skip("the tiny model's text has no usable stop string")
    with httpx.Client(base_url=server.url, timeout=30) as http:
        reply = http.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 20, "temperature": 0,
                                                   "stop": stop}).json()
        assert reply["choices"][0]["text"] == want[:want.index(stop)]
        assert reply["choices"][0]["finish_reason"] == "stop"
        assert wait_for(lambda: parse_metrics(http.get("/metrics").text)["course:kv_blocks_used"] == 0)


# --- what a server must survive -----------------------------------------------------------------

BAD = [
    (b"{", 400, None), (b"[]", 400, None), (b'"x"', 400, None), (b'{"model": "tiny"}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": null}', 400, "prompt"), (b'{"model": "tiny", "prompt": "a", "foo": 1}', 400, "foo"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": "3"}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": true}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": 0}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "a", "max_tokens": -2}', 400, "max_tokens"),
    (b'{"model": "tiny", "prompt": "a", "temperature": "hot"}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": "a", "temperature": NaN}', 400, "temperature"),
    (b'{"model": "tiny", "prompt": [1, "a"]}', 400, "prompt"), (b'{"model": "tiny", "prompt": ""}', 400, "prompt"),
    (b'{"model": "tiny", "prompt": [999999]}', 400, "prompt"),
    (b'{"model": "other", "prompt": "a"}', 404, "model"),
    (json.dumps({"model": NAME, "prompt": "hi " * 5000}).encode(), 400, "prompt"),
    (b'{"model": "tiny", "messages": []}', 400, "messages"),
]


def test_bad_requests_get_4xx_and_the_server_keeps_serving(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for body, status, param in BAD:
            path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
            r = http.post(path, content=body, headers={"Content-Type": "application/json"})
            assert r.status_code == status, (body[:60], r.status_code, r.text[:200])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["param"] == param and err["message"], err
        assert http.get("/nope").status_code == 404 and "error" in http.get("/nope").json()
        assert http.get("/v1/completions").status_code == 405
        ok = http.post("/v1/completions", json={"model": NAME, "prompt": "a", "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
        m = parse_metrics(http.get("/metrics").text)
    assert m["course:num_requests_running"] == 0 and m["course:kv_blocks_used"] == 0


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server):
    body = {"model": NAME, "prompt": "Tell me everything.", "max_tokens": 3000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        used = lambda: parse_metrics(http.get("/metrics").text)["course:kv_blocks_used"]  # noqa: E731
        key = 'course:request_success_total{finished_reason="abort"}'
        aborted = parse_metrics(http.get("/metrics").text)[key]
        with http.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for _ in range(6):
                next(lines)
            assert used() > 0, "mid-stream the request holds blocks"
        assert wait_for(lambda: used() == 0), "the blocks of a disconnected client must be freed"
        assert wait_for(lambda: parse_metrics(http.get("/metrics").text)[key] == aborted + 1), "counted as aborted"

        async def leave_early():              # a non-streamed request whose client gives up
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as ac:
                task = asyncio.ensure_future(ac.post("/v1/completions", json=body | {"stream": False}))
                for _ in range(500):
                    if server.core.running:
                        break
                    await asyncio.sleep(0.01)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        asyncio.run(leave_early())
        assert wait_for(lambda: used() == 0 and not server.core.running), "a non-streamed request is aborted too"


def test_a_full_queue_answers_429_with_retry_after(tiny, tokenizer):
    s = start(tiny, tokenizer, max_running=1, max_waiting=2)
    try:
        async def flood():
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as ac:
                body = {"model": NAME, "prompt": "a", "max_tokens": 40, "ignore_eos": True}
                return await asyncio.gather(*[ac.post("/v1/completions", json=body) for _ in range(8)])
        answers = asyncio.run(flood())
        codes = sorted(r.status_code for r in answers)
        assert set(codes) == {200, 429} and codes.count(200) >= 1, codes
        refused = [r for r in answers if r.status_code == 429]
        assert all(r.headers.get("retry-after") == "1" and r.json()["error"]["code"] == "rate_limit_exceeded" for r in refused)
        assert all(r.json()["usage"]["completion_tokens"] == 40 for r in answers if r.status_code == 200)
        assert httpx.get(f"{s.url}/health", timeout=30).status_code == 200
    finally:
        s.stop()


def test_concurrent_streaming_clients_get_whole_responses_of_their_own(server, tiny, tokenizer):
    rng = random.Random(0)
    refs = {}

    async def client(c, deadline):
        done = 0
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as ac:
            while time.monotonic() < deadline and done < 4:
                prompt = [rng.randrange(1000, 49000) for _ in range(rng.randint(1, 30))]
                n = rng.randint(1, 24)
                rec = await send_completion(ac, server.url, NAME, prompt, n, ignore_eos=False)
                refs[(c, done)] = (rec, prompt, n)
                done += 1

    async def main():
        deadline = time.monotonic() + 3.0
        await asyncio.gather(*[client(c, deadline) for c in range(8)])
    asyncio.run(asyncio.wait_for(main(), 120))
    assert len(refs) >= 8
    for (c, i), (rec, prompt, n) in refs.items():
        want, toks = greedy_text(tiny, tokenizer, prompt, n)
        assert rec.ok, rec.error
        assert rec.text == want, f"client {c} request {i}: a response must be whole and its own"
        assert rec.output_tokens == len(toks)
    assert wait_for(lambda: server.core.pc.blocks_in_use == 0 and not server.core.running)


# --- clients, the real model, the command line ------------------------------------------------

def test_the_openai_client_talks_to_it(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=30, max_retries=0)
    assert client.models.list().data[0].id == NAME
    r = client.completions.create(model=NAME, prompt="Hello", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens <= 4 and isinstance(r.choices[0].text, str)
    parts = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0, stream=True) if c.choices]
    assert isinstance("".join(parts), str)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=NAME, prompt="Hello", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="Hello")


@pytest.mark.slow
def test_the_real_model_answers_through_the_server(tokenizer):
    model = course.load_model()
    s = start(model, tokenizer, n_blocks=64)
    try:
        r = httpx.post(f"{s.url}/v1/completions", timeout=120,
                       json={"model": NAME, "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
        want, _ = greedy_text(model, tokenizer, tokenizer("The capital of France is", add_special_tokens=False).input_ids, 3)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want and "Paris" in want
    finally:
        s.stop()


def test_the_load_generator_measures_a_server(server):
    async def main():
        async with httpx.AsyncClient(timeout=60) as ac:
            return await asyncio.gather(*[send_completion(ac, server.url, NAME, p, n) for p, n in
                                          random_requests(4, 8, 6, range_ratio=0.5, seed=1)])
    recs = asyncio.run(main())
    assert all(r.ok and r.ttft > 0 and r.latency >= r.ttft and r.prompt_tokens > 0 for r in recs)
    assert all(r.output_tokens == n for r, (_, n) in zip(recs, random_requests(4, 8, 6, range_ratio=0.5, seed=1)))
    assert all(len(r.itl) <= r.output_tokens - 1 for r in recs)
    bad = asyncio.run(_one(server.url, "no-such-model"))
    assert not bad.ok and bad.error.startswith("HTTP 404")


async def _one(url, model):
    async with httpx.AsyncClient(timeout=30) as ac:
        return await send_completion(ac, url, model, [1000, 1001], 2)


def test_parsers_and_text_stream_directly(tokenizer):
    enc = lambda t: tokenizer(t, add_special_tokens=False).input_ids  # noqa: E731
    req = parse_completion(b'{"model": "m", "prompt": "hi", "stop": "x", "seed": 3}', "m", enc, 100)
    assert req.prompt_ids == enc("hi") and req.stop == ["x"] and req.params == SamplingParams(seed=3)
    with pytest.raises(APIError) as e:
        parse_completion(b'{"model": "m", "prompt": "hi", "stream_options": {"include_usage": true}}', "m", enc, 100)
    assert e.value.param == "stream_options", "stream_options need stream: true"
    chat = parse_chat(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 2}',
                      "m", lambda msgs: [1, 2, 3], 10)
    assert chat.prompt_ids == [1, 2, 3] and chat.max_tokens == 2
    assert parse_chat(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', "m", lambda m: [1], 10).max_tokens == 9
    ids = enc("Crème 😀 brûlée. User: more")
    ts = TextStream(lambda i: tokenizer.decode(i, skip_special_tokens=True), ["User:"])
    pieces = [ts.push(t) for t in ids] + [ts.flush()]
    assert "".join(pieces) == "Crème 😀 brûlée. " and ts.stopped and "\ufffd" not in "".join(pieces)


def test_python_m_course_serve(tmp_path):
    from course.serve.__main__ import parse_args
    args = parse_args(["--port", "0", "--chunk-size", "64", "--max-running", "4"])
    assert (args.port, args.chunk_size, args.max_running, args.host) == (0, 64, 4, "127.0.0.1")
    for bad in (["--chunk-size", "2", "--max-running", "8"], ["--n-blocks", "0"], ["--max-waiting", "-1"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
    out = subprocess.run([sys.executable, "-m", "course.serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--chunk-size" in out.stdout and "--max-waiting" in out.stdout


@pytest.mark.slow
def test_python_m_course_serve_serves(tmp_path):
    """The command line end to end: start on a free port, ask, stop (our own child process, by its pid)."""
    proc = subprocess.Popen([sys.executable, "-m", "course.serve", "--port", "0", "--n-blocks", "64"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "COURSE_QUICK": "1"})
    try:
        url, deadline = None, time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            if "Uvicorn running on" in line:
                url = line.split("Uvicorn running on ")[1].split()[0]
        assert url, "the server did not start"
        r = httpx.post(f"{url}/v1/completions", timeout=120,
                       json={"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["text"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
