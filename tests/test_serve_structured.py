"""Structured outputs in the server (issue 46, lab 13): `response_format` json_object and json_schema on
both endpoints, the openai SDK's `chat.completions.parse` with a pydantic model, grammars compiled once
per schema, every constrained output valid (greedy, sampled, streamed, batched beside unconstrained
requests, which stay what they were), a 400 naming an unsupported keyword, and no KV block left held.

A tiny random model with the real tokenizer keeps it fast. A random model writes strings forever, so
the schemas here force an end (enums, maxLength, maxItems), or logit_bias steers toward closing
quotes and brackets, which also shows that no bias can bring back a token the grammar forbids."""
import asyncio
import enum
import json
import time

import httpx
import jsonschema
import pydantic
import pytest
import torch

import course
from course.engine import SamplingParams
from course.serve import AsyncEngine, LLMEngine, ServerThread, build_app, parse_chat, parse_completion
from course.serve.metrics import parse as parse_metrics
from course.structured import generate
from tiny_models import tiny_llama

NAME = "tiny"
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 6},
    "kind": {"enum": ["cat", "dog", "bird"]},
    "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"enum": ["a", "b", 3, None]}, "maxItems": 3},
    "size": {"anyOf": [{"type": "null"}, {"const": 1.5}]}},
    "required": ["name", "kind", "ok", "tags"], "additionalProperties": False}
AS_SCHEMA = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}
OBJECT = {"type": "object"}                                # what json_object promises
CLOSE = {"18": 30, "77": 20, "109": 20, "28": 10}          # '"' ']' '}' ',': close strings, then lists, objects


class Color(str, enum.Enum):
    red = "red"
    green = "green"


class Plain(pydantic.BaseModel):
    """A plain pydantic model: the SDK sends it as a strict json_schema, its enum as a $ref into $defs."""
    name: str
    age: int
    score: float
    ok: bool
    color: Color
    tags: list[str]


@pytest.fixture(scope="module")
def tokenizer():
    return course.load_tokenizer()


@pytest.fixture(scope="module")
def tiny(tokenizer):
    return tiny_llama(len(tokenizer))


@pytest.fixture(scope="module")
def server(tiny, tokenizer):
    core = LLMEngine(tiny, n_blocks=256, block_size=16, max_running=8, budget=64, eos_token_id=tokenizer.eos_token_id)
    s = ServerThread(build_app(AsyncEngine(core, max_waiting=64), tokenizer, NAME)).start()
    s.core, s.grammars = core, s.app.state.grammars
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def greedy_ids(model, prompt, n):
    """The unconstrained reference: greedy tokens from a dense uncached forward."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            ids = torch.tensor([prompt + out])
            out.append(int(model(ids, torch.arange(ids.shape[1])[None])[0, -1].argmax()))
    return out


def idle(server, seconds=10.0) -> bool:
    """The engine holds no request and no KV block (waits for aborts to land)."""
    deadline = time.monotonic() + seconds
    while server.core.running or server.core.waiting or server.core.pc.blocks_in_use:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def metrics(server) -> dict:
    return parse_metrics(httpx.get(f"{server.url}/metrics", timeout=30).text)


def valid_prefix(server, fmt, text) -> bool:
    """An output cut by max_tokens ("length") is still a prefix of the grammar's language."""
    grammar = asyncio.run(server.grammars.get(fmt))
    return grammar.dfa.walk(grammar.dfa.start, text.encode()) >= 0


# --- the request contract ----------------------------------------------------------------------

def test_response_format_is_parsed_on_both_endpoints_and_bad_shapes_name_the_field():
    chat = lambda fmt, **kw: parse_chat(json.dumps({"messages": [{"role": "user", "content": "a"}],  # noqa: E731
                                                    "response_format": fmt}), "m", lambda m: [1, 2], 100, 1000, **kw)
    done = lambda fmt: parse_completion(json.dumps({"prompt": "a", "response_format": fmt}), "m",  # noqa: E731
                                        lambda s: [1], 100, 1000, structured=True)
    assert chat({"type": "text"}, structured=True).response_format is None
    assert chat({"type": "json_object"}, structured=True).response_format == ("json_object", None)
    assert chat(AS_SCHEMA, structured=True).response_format == ("json_schema", SCHEMA)
    assert done(AS_SCHEMA).response_format == ("json_schema", SCHEMA), "completions take it too (as vLLM)"
    with pytest.raises(course.serve.APIError, match="not supported by this server") as e:
        chat({"type": "json_object"})                         # an engine that cannot constrain: refused by name
    assert e.value.param == "response_format"
    bad = [({"type": "xml"}, "response_format.type"), ({}, "response_format.type"),
           ({"type": "json_object", "schema": {}}, "response_format.schema"),
           ({"type": "json_schema"}, "response_format.json_schema"),
           ({"type": "json_schema", "json_schema": {"schema": SCHEMA}}, "response_format.json_schema.name"),
           ({"type": "json_schema", "json_schema": {"name": "a b", "schema": SCHEMA}}, "response_format.json_schema.name"),
           ({"type": "json_schema", "json_schema": {"name": "p"}}, "response_format.json_schema.schema"),
           ({"type": "json_schema", "json_schema": {"name": "p", "schema": []}}, "response_format.json_schema.schema"),
           ({"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "strict": "yes"}},
            "response_format.json_schema.strict"),
           ({"type": "json_schema", "json_schema": {"name": "p", "schema": {}, "extra": 1}},
            "response_format.json_schema.extra")]
    for fmt, param in bad:
        with pytest.raises(course.serve.APIError) as e:
            chat(fmt, structured=True)
        assert e.value.status == 400 and e.value.param == param and param in e.value.message, (fmt, e.value)


# --- through the server ------------------------------------------------------------------------

def test_the_sdk_parses_a_pydantic_model(server, client):
    before = metrics(server)
    for seed in (None, 1):                                  # greedy, then sampled
        sampling = {"temperature": 0.0} if seed is None else {"temperature": 1.0, "seed": seed}
        done = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "a pet"}],
                                             response_format=Plain, max_tokens=96, logit_bias=CLOSE, **sampling)
        choice = done.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Plain), "the SDK validated the answer into the model"
        assert Plain.model_validate_json(choice.message.content) == choice.message.parsed
    after = metrics(server)
    assert after["course:grammar_compiles_total"] - before["course:grammar_compiles_total"] == 1, \
        "one schema, compiled once: the second request finds it cached"
    assert after["course:grammar_cache_hits_total"] > before["course:grammar_cache_hits_total"]
    assert after["course:grammar_compile_seconds_total"] > 0 and after["course:grammar_mask_seconds_total"] > 0
    assert idle(server)


def test_json_schema_and_json_object_in_one_batch_with_unconstrained_requests(server, tiny, tokenizer):
    import openai
    prompt = encode(tokenizer, "A pet as JSON:")
    grammar = asyncio.run(server.grammars.get(("json_schema", SCHEMA)))
    want = generate(tiny, tokenizer, prompt, grammar, 64, params=SamplingParams(temperature=0.0))
    plain_want = [tokenizer.decode(greedy_ids(tiny, p, 12), skip_special_tokens=True) for p in (prompt, prompt[:3])]
    messages = [{"role": "user", "content": "a pet"}]

    async def main():
        ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=60, max_retries=0)
        jobs = [ac.completions.create(model=NAME, prompt=prompt, max_tokens=64, temperature=0.0,
                                      extra_body={"response_format": AS_SCHEMA})]
        jobs += [ac.chat.completions.create(model=NAME, messages=messages, max_tokens=64, temperature=1.0, seed=s,
                                            response_format=AS_SCHEMA) for s in (1, 2, 3)]
        jobs += [ac.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=1.0, seed=4,
                                            response_format={"type": "json_object"}),
                 ac.chat.completions.create(model=NAME, messages=messages, max_tokens=24, temperature=1.0, seed=5,
                                            response_format={"type": "json_object"}, presence_penalty=-2,
                                            logit_bias={"107": 100, "109": 100, str(tokenizer.eos_token_id): 100})]
        jobs += [ac.completions.create(model=NAME, prompt=p, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True})
                 for p in (prompt, prompt[:3])]
        try:
            return await asyncio.gather(*jobs)
        finally:
            await ac.close()

    server.core.record_trace()
    rows_before = server.core.stats.masked_rows
    out = asyncio.run(asyncio.wait_for(main(), 120))
    greedy, sampled, objects, plain = out[0], out[1:4], out[4:6], out[6:]
    assert greedy.choices[0].text == want.text and greedy.choices[0].finish_reason == "stop", \
        "greedy under the grammar = course.structured.generate, token for token"
    for r in sampled:
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    cut, braced = objects[0].choices[0], objects[1].choices[0]
    if cut.finish_reason == "stop":
        jsonschema.validate(json.loads(cut.message.content), OBJECT)
    else:
        assert cut.finish_reason == "length" and valid_prefix(server, ("json_object", None), cut.message.content)
    assert braced.finish_reason == "stop" and json.loads(braced.message.content) == {}, \
        "'{', '}' and EOS biased +100: at the start '}' and EOS stay masked ('{' wins), then '}' closes the object"
    assert [r.choices[0].text for r in plain] == plain_want, "unconstrained requests are what they were"
    rid = {r.id.split("-", 1)[1]: r for r in out}
    constrained = {k for k, r in rid.items() if r not in plain}
    mixed = [step for step in server.core.trace if {k for k, s in step.items() if s == "decode"} & constrained
             and {k for k, s in step.items() if s == "decode"} - constrained]
    assert mixed, "some step decoded constrained and unconstrained requests together"
    assert server.core.stats.masked_rows > rows_before
    server.core.trace = None
    assert idle(server), "no KV block held after the batch"


def test_streaming_with_response_format(server):
    body = {"model": NAME, "messages": [{"role": "user", "content": "a pet"}], "max_tokens": 64, "stream": True,
            "temperature": 0.8, "seed": 7, "response_format": AS_SCHEMA}
    for path, key in (("/v1/chat/completions", "chat"), ("/v1/completions", "text")):
        if key == "text":
            body = {k: v for k, v in body.items() if k != "messages"} | {"prompt": "a pet:"}
        text, finish = "", None
        with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["delta"].get("content", "") if key == "chat" else choice["text"]
                    finish = choice["finish_reason"] or finish
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body | {"max_tokens": 200}, timeout=60) as r:
        next(r.iter_lines())                                # a client that leaves after the first event
    assert idle(server), "a constrained stream left early frees its blocks"


UNSUPPORTED = [({"type": "object", "patternProperties": {"^x": {"type": "string"}}}, "patternProperties"),
               ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "$ref"),
               ({"$defs": {"T": {"type": "array", "items": {"$ref": "#/$defs/T"}}}, "$ref": "#/$defs/T"}, "$ref"),
               ({"type": "string", "pattern": "^a+$"}, "pattern"),
               ({"type": "integer", "minimum": 0}, "minimum")]


@pytest.mark.parametrize("schema, keyword", UNSUPPORTED, ids=[k + str(i) for i, (_, k) in enumerate(UNSUPPORTED)])
def test_an_unsupported_keyword_gets_a_400_naming_it_and_the_server_serves_on(server, schema, keyword):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]}),
                       ("/v1/completions", {"prompt": "a"})):
        r = httpx.post(f"{server.url}{path}", json=body | {"model": NAME, "response_format": fmt}, timeout=30)
        error = r.json()["error"]
        assert r.status_code == 400 and error["param"] == "response_format.json_schema.schema", error
        assert f"'{keyword}'" in error["message"], error["message"]
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                    json={"model": NAME, "messages": [{"role": "user", "content": "a"}], "max_tokens": 96, "temperature": 0,
                          "response_format": AS_SCHEMA})
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(ok.json()["choices"][0]["message"]["content"]), SCHEMA)
    assert idle(server)


# --- the engine directly ---------------------------------------------------------------------------

def test_the_engine_masks_each_constrained_row_and_stops_when_the_grammar_ends(server, tiny, tokenizer):
    grammar = asyncio.run(server.grammars.get(("json_schema", SCHEMA)))
    core = LLMEngine(tiny, n_blocks=64, block_size=16, max_running=4, budget=64, eos_token_id=tokenizer.eos_token_id)
    prompt = encode(tokenizer, "pet:")
    bias = {tokenizer.eos_token_id: 100.0, 18: 100.0}        # EOS and '"' pushed hard: only allowed ones survive
    core.add_request("bias", prompt, SamplingParams(temperature=1.0, seed=3, logit_bias=bias, repetition_penalty=0.5,
                                                    presence_penalty=-2.0), max_tokens=64, grammar=grammar)
    core.add_request("min", prompt, SamplingParams(temperature=0.0), max_tokens=64, min_tokens=60, grammar=grammar)
    core.add_request("free", prompt, SamplingParams(temperature=0.0), max_tokens=5, ignore_eos=True)
    out: dict = {}
    while core.has_work():
        for o in core.step():
            out.setdefault(o.rid, []).append(o)
    for rid in ("bias", "min"):
        assert out[rid][-1].finish_reason == "stop", rid
        text = tokenizer.decode([o.token for o in out[rid]], skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMA)
    assert len(out["min"]) < 60, "min_tokens yields to a grammar that has ended"
    assert [o.token for o in out["free"]] == greedy_ids(tiny, prompt, 5)
    assert core.pc.blocks_in_use == 0 and core.stats.masked_rows == len(out["bias"]) + len(out["min"])
    with pytest.raises(ValueError, match="grammar must be a course.structured Grammar"):
        core.add_request("x", prompt, grammar="{}")
