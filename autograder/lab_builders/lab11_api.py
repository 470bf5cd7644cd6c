"""Lab 11, sections 4-5: Problem 4 (checking requests, OpenAI-style errors), then the server itself:
uvicorn in a thread, curl, the openai client, /metrics, and what a server must survive."""
from autograder.authoring import code, md, solution, tests

# Hidden cases for Problem 4: (body, status, param, code, the rule it breaks) for bad bodies.
HIDDEN_BODIES = r'''
_M = "served"
_tok = lambda s: [ord(c) for c in s]                  # a tokenizer: one token per character
def _j(**kw):
    return json.dumps({"model": _M, "prompt": "hello"} | kw)
_NOT_JSON = "not JSON (or not UTF-8): 400 with param None"
_NOT_OBJECT = "JSON that is not an object: 400 with param None"
_BOOL = "JSON true/false is a bool, not a number: compare type(value) with FIELDS, not isinstance (bool is a subclass of int)"
_BAD = [
    (b"", 400, None, None, _NOT_JSON), (b"{\"model\": ", 400, None, None, _NOT_JSON),
    (b"\xff\xfe{}", 400, None, None, _NOT_JSON),
    (b"null", 400, None, None, _NOT_OBJECT), (b"\"text\"", 400, None, None, _NOT_OBJECT),
    (b"[1, 2]", 400, None, None, _NOT_OBJECT), (b"42", 400, None, None, _NOT_OBJECT),
    (_j(best_of=2), 400, "best_of", None, "a field not in FIELDS is refused, naming it"),
    (_j(logprobs=1), 400, "logprobs", None, "a field not in FIELDS is refused, naming it"),
    (json.dumps({"model": _M}), 400, "prompt", None, "prompt is required"),
    (_j(model=7), 400, "model", None, "model must be a string"),
    (_j(model="other"), 404, "model", "model_not_found", "a model that is not served_model: 404, code model_not_found"),
    (_j(prompt=5), 400, "prompt", None, "prompt must be a string or a list"),
    (_j(prompt=None), 400, "prompt", None, "null means 'not given', and prompt is required"),
    (_j(prompt=""), 400, "prompt", None, "an empty prompt string is refused"),
    (_j(prompt=[]), 400, "prompt", None, "an empty prompt list is refused"),
    (_j(prompt=["a", "b"]), 400, "prompt", None, "a list prompt holds token ids (integers), not strings"),
    (_j(prompt=[1, "a"]), 400, "prompt", None, "every item of a list prompt must be an integer"),
    (_j(prompt=[1, True]), 400, "prompt", None, "true in a list prompt is a bool, not a token id: check type(t) is int"),
    (_j(prompt=[1.0]), 400, "prompt", None, "1.0 is a float, not a token id"),
    (_j(max_tokens=0), 400, "max_tokens", None, "max_tokens must be at least 1"),
    (_j(max_tokens=-5), 400, "max_tokens", None, "max_tokens must be at least 1"),
    (_j(max_tokens=True), 400, "max_tokens", None, _BOOL),
    (_j(max_tokens=3.0), 400, "max_tokens", None, "max_tokens must be an integer: 3.0 is a float"),
    (_j(max_tokens="3"), 400, "max_tokens", None, "max_tokens must be an integer, not a string"),
    (_j(temperature=-0.1), 400, "temperature", None, "temperature must be in [0, 2]"),
    (_j(temperature=2.5), 400, "temperature", None, "temperature must be in [0, 2]"),
    (_j(temperature="hot"), 400, "temperature", None, "temperature must be a number"),
    (_j(temperature=True), 400, "temperature", None, _BOOL),
    ('{"model": "served", "prompt": "hi", "temperature": NaN}', 400, "temperature", None,
     "json.loads accepts NaN: NaN is in no range (every comparison with it is False)"),
    ('{"model": "served", "prompt": "hi", "top_p": Infinity}', 400, "top_p", None, "Infinity is outside (0, 1]"),
    (_j(top_p=0), 400, "top_p", None, "top_p must be in (0, 1]: 0 is excluded"),
    (_j(top_p=1.5), 400, "top_p", None, "top_p must be in (0, 1]"),
    (_j(seed="1"), 400, "seed", None, "seed must be an integer, not a string"),
    (_j(seed=1.5), 400, "seed", None, "seed must be an integer"),
    (_j(seed=False), 400, "seed", None, _BOOL),
    (_j(stop=""), 400, "stop", None, "an empty stop string is refused"),
    (_j(stop=[""]), 400, "stop", None, "every stop string must be non-empty"),
    (_j(stop=[1]), 400, "stop", None, "stop strings must be strings"),
    (_j(stop=["a", "b", "c", "d", "e"]), 400, "stop", None, "at most 4 stop strings"),
    (_j(stop=7), 400, "stop", None, "stop must be a string or a list"),
    (_j(stream="yes"), 400, "stream", None, "stream must be true or false"),
    (_j(stream=1), 400, "stream", None, "stream must be a bool: 1 is an integer"),
    (_j(stream_options=True), 400, "stream_options", None, "stream_options must be an object"),
    (_j(ignore_eos="no"), 400, "ignore_eos", None, "ignore_eos must be true or false"),
    (_j(prompt="x" * 95, max_tokens=6), 400, "prompt", "context_length_exceeded",
     "prompt tokens + max_tokens > max_model_len: the context does not fit"),
    (_j(prompt=list(range(101))), 400, "prompt", "context_length_exceeded",
     "prompt tokens + max_tokens > max_model_len (max_tokens defaults to 16)"),
]
_FULL = "the context may be exactly full: prompt tokens + max_tokens == max_model_len is allowed (refuse only when it is >)"
# what is accepted: ints for numbers, the edges of every range, the context exactly full, four stop strings
_GOOD = [
    (_j(temperature=1), dict(temperature=1.0), "an integer temperature is allowed, as a float"),
    (_j(temperature=2), dict(temperature=2.0), "temperature 2 is allowed: the range [0, 2] includes both ends"),
    (_j(temperature=0.0), dict(temperature=0.0), "temperature 0 is allowed: the range [0, 2] includes both ends"),
    (_j(top_p=1), dict(top_p=1.0), "top_p 1 is allowed: the range (0, 1] includes 1"),
    (_j(top_p=0.01), dict(top_p=0.01), "a small top_p above 0 is allowed"),
    (_j(seed=0), dict(seed=0), "seed 0 is a seed (not 'no seed')"),
    (_j(prompt="x" * 94, max_tokens=6), dict(max_tokens=6, n=94), _FULL),
    (_j(prompt=list(range(99)), max_tokens=1), dict(max_tokens=1, n=99), _FULL),
    (_j(stop=["a", "b", "c", "d"]), dict(stop=["a", "b", "c", "d"]), "four stop strings are allowed"),
    (_j(stop=[]), dict(stop=[]), "an empty list of stop strings is allowed"),
    (_j(stream=False, ignore_eos=True), dict(ignore_eos=True), "ignore_eos is passed on"),
    (_j(stream=True, stream_options={}), dict(stream=True, include_usage=False),
     "stream_options without include_usage: include_usage is False"),
    (json.dumps({"prompt": "hello"}), dict(), "model may be left out: the server serves its one model"),
    (_j(model=None, top_p=None, stop=None), dict(top_p=1.0, stop=[]),
     "null means 'not given' (clients send \"stop\": null): the defaults apply"),
    (_j(max_tokens=None, temperature=None, seed=None, stream_options=None), dict(max_tokens=16, temperature=1.0),
     "null means 'not given', for every optional field"),
    (_j(seed=-7), dict(seed=-7), "a negative seed is a seed (the SDKs send them): passed on as given"),
]
'''.strip("\n")

cells = [
md(r"""
## 4. Checking requests

A server cannot trust its clients. Bodies arrive cut in half, with a field misspelled, with
`"max_tokens": "100"`, with a prompt longer than the model's context. Each must get a **4xx** answer
that says what is wrong, and the server must go on serving everyone else: one bad request must never
crash the engine loop, leak blocks, or reach the model. OpenAI's API answers with a status and a body
that every client library reads:

```
HTTP 400   {"error": {"message": "Invalid type for 'max_tokens': expected an integer, but got a string.",
                      "type": "invalid_request_error", "param": "max_tokens", "code": null}}
```

400 means "your request is wrong" (fix it before retrying); 404 "no such model" (OpenAI adds the code
`model_not_found`); 429 "too many requests right now" (retry later: section 5). `APIError(status,
message, type="invalid_request_error", param=None, code=None)` carries them; the server turns it into
that body. A checked request becomes a `GenerationRequest`:

```python
GenerationRequest(model, prompt_ids, max_tokens=16, params=SamplingParams(temperature, top_p, seed=...),
                  stop=[...], stream=False, include_usage=False, ignore_eos=False)
```

One Python trap: JSON `true` is a Python `bool`, and `bool` is a subclass of `int`, so
`isinstance(True, int)` is `True`. A server that accepts `"max_tokens": true` as 1 is wrong: compare
`type(value)` with the allowed types. (And `json.loads` accepts `NaN` and `Infinity`, which no range holds.)

## Problem 4: Request checks and OpenAI errors (4 points)

**Deliverable:** `parse_completion(body, served_model, tokenize, max_model_len)`: `body` is the raw
request body (`bytes`), `tokenize(text)` gives token ids. Return a `GenerationRequest`, or raise
`APIError` (status and `param` as in the table; any clear message):

| what is wrong | status | param |
|---|---|---|
| not JSON (or not UTF-8), or JSON that is not an object | 400 | `None` |
| a field that is not in `FIELDS` | 400 | that field |
| `prompt` missing (or `null`) | 400 | `"prompt"` |
| a value whose JSON type is not allowed by `FIELDS` | 400 | that field |
| `model` is given and is not `served_model` | 404, `code="model_not_found"` | `"model"` |
| `max_tokens` < 1, `temperature` outside [0, 2], `top_p` outside (0, 1] | 400 | that field |
| `stop` is not a non-empty string nor a list of at most 4 non-empty strings | 400 | `"stop"` |
| `prompt` is neither a non-empty string nor a non-empty list of integers (token ids) | 400 | `"prompt"` |
| prompt tokens + `max_tokens` > `max_model_len` | 400, `code="context_length_exceeded"` | `"prompt"` |

Three rules come from the clients people really use, and vLLM's server follows them too. JSON `null`
means "not given": the OpenAI SDK and benchmark tools send `"stop": null` or `"seed": null` for every
setting left at its default, so drop the `null` fields first and check the rest. `model` may be left
out: this server has one model, and serves it. Any integer `seed` is a seed, negative ones included
(the SDKs send them); pass it on as given.

A valid body gives `prompt_ids` (the string tokenized, or the list as it is), `max_tokens`
(default 16), `params=SamplingParams(temperature=..., top_p=..., seed=...)`, with temperature and top_p as Python
floats (JSON `1` becomes `1.0`; defaults 1.0, 1.0, None),
`stop` as a list (a string becomes a one-item list; default `[]`), `stream` (default False),
`include_usage` from `stream_options` (`{"include_usage": true}`; default False) and `ignore_eos`
(default False, a vLLM extension the load generator uses).

The tests send many bodies, good and bad, and each one is a case of its own: a slip at one boundary
costs that case's share of the 4 points, not all of them, and the feedback lists the cases that failed.
"""),
solution("parse_completion", r'''
FIELDS = {"model": (str,), "prompt": (str, list), "max_tokens": (int,), "temperature": (int, float),
          "top_p": (int, float), "seed": (int,), "stop": (str, list), "stream": (bool,),
          "stream_options": (dict,), "ignore_eos": (bool,)}      # allowed Python types after json.loads


def parse_completion(body: bytes, served_model: str, tokenize: Callable[[str], list[int]],
                     max_model_len: int) -> GenerationRequest:
    """A /v1/completions request body -> GenerationRequest, or APIError."""
    ### BEGIN SOLUTION
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"The body is not valid JSON: {e}") from None
    if type(data) is not dict:
        raise APIError(400, "The body must be a JSON object.")
    for name in data:
        if name not in FIELDS:
            raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name)
    data = {name: value for name, value in data.items() if value is not None}   # null means "not given"
    if "prompt" not in data:
        raise APIError(400, "Missing required parameter: 'prompt'.", param="prompt")
    for name, value in data.items():
        if type(value) not in FIELDS[name]:
            raise APIError(400, f"Invalid type for '{name}': got {type(value).__name__}.", param=name)
    if data.get("model", served_model) != served_model:
        raise APIError(404, f"The model `{data['model']}` does not exist.", param="model", code="model_not_found")
    max_tokens = data.get("max_tokens", 16)
    temperature, top_p = data.get("temperature", 1.0), data.get("top_p", 1.0)
    if max_tokens < 1:
        raise APIError(400, f"'max_tokens' must be at least 1, got {max_tokens}.", param="max_tokens")
    if not 0 <= temperature <= 2:
        raise APIError(400, f"'temperature' must be in [0, 2], got {temperature}.", param="temperature")
    if not 0 < top_p <= 1:
        raise APIError(400, f"'top_p' must be in (0, 1], got {top_p}.", param="top_p")
    stop = data.get("stop", [])
    stop = [stop] if type(stop) is str else stop
    if len(stop) > 4 or not all(type(s) is str and s for s in stop):
        raise APIError(400, "'stop' must be a non-empty string or a list of at most 4 non-empty strings.", param="stop")
    prompt = data["prompt"]
    ids = tokenize(prompt) if type(prompt) is str else prompt
    if not ids or not all(type(t) is int for t in ids):
        raise APIError(400, "'prompt' must be a non-empty string or a non-empty list of token ids.", param="prompt")
    if len(ids) + max_tokens > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; you asked for "
                       f"{len(ids) + max_tokens} ({len(ids)} in the prompt, {max_tokens} to generate).",
                       param="prompt", code="context_length_exceeded")
    options = data.get("stream_options", {})
    return GenerationRequest(model=served_model, prompt_ids=list(ids), max_tokens=max_tokens,
                             params=SamplingParams(temperature=float(temperature), top_p=float(top_p), seed=data.get("seed")),
                             stop=stop, stream=data.get("stream", False),
                             include_usage=bool(options.get("include_usage", False)),
                             ignore_eos=data.get("ignore_eos", False))
    ### END SOLUTION
'''),
code(r'''
for body in [b'{"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 4, "stop": "\\n"}',
             b'{"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": "4"}',
             b'{"model": "gpt-4o", "prompt": "Hi"}', b'{"model": "SmolLM2-135M-Instruct", "prompt": "Hi"']:
    try:
        print("OK  ", parse_completion(body, MODEL_NAME, encode, 2048))
    except APIError as e:
        print(e.status, e.body())
'''),
tests("parse_completion_tests", 4, r"""
import re
from course.expect import Cases
cases = Cases(points=4)        # one share of the 4 points per case: the feedback lists the cases that failed
tok = lambda s: [ord(c) for c in s]
def short(body):               # a body as a case names it: long runs shortened
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    text = re.sub(r"(.)\1{9,}", lambda m: f"{m.group(1)}...({len(m.group(0))} times)", text)
    return re.sub(r"\[(?:\d+, ){9,}\d+\]", lambda m: f"[{m.group(0).count(',') + 1} token ids]", text)
def refused(body, status, param, code=None, why=""):
    body = body if isinstance(body, bytes) else body.encode()
    try:
        got = parse_completion(body, "served", tok, 100)
    except APIError as e:
        expect_int(e.status, f"the status for {short(body)}")
        expect_type(e.param, f"the param for {short(body)}", str, type(None))
        expect_type(e.code, f"the code for {short(body)}", str, type(None))
        assert e.status == status and e.param == param, \
            f"{why}: must be refused with status {status} and param {param!r}, got {e.status} with param {e.param!r} ({e.message})"
        assert code is None or e.code == code, f"{why}: the error's code must be {code!r}, got {e.code!r}"
        return
    raise AssertionError(f"{why}: must raise APIError({status}, param={param!r}); it returned {type(got).__name__}")
def accepted(body, why, model="served"):
    body = body if isinstance(body, bytes) else body.encode()
    try:
        got = parse_completion(body, model, tok, 100)
    except APIError as e:
        raise AssertionError(f"{why}: must be accepted; it raised APIError({e.status}, param={e.param!r}): {e.message}") from None
    got = expect_type(got, f"parse_completion({short(body)}, ...)", GenerationRequest)
    expect_type(got.params, "params", SamplingParams)
    return got
with cases("a string prompt, every default"):
    ok = accepted(b'{"model": "served", "prompt": "hi"}', "a model and a prompt are all a request needs")
    assert expect_ints(ok.prompt_ids, "prompt_ids") == [104, 105] and expect_int(ok.max_tokens, "max_tokens") == 16, \
        "a string prompt is tokenized; max_tokens defaults to 16"
    assert expect_type(ok.stop, "stop", list) == [] and expect_bool(ok.stream, "stream") is False, "stop defaults to [], stream to False"
    assert ok.params.temperature == 1.0 and ok.params.top_p == 1.0 and ok.params.seed is None, \
        "temperature and top_p default to 1.0, seed to None"
with cases("null means not given; model may be left out; a negative seed"):
    sdk = accepted(b'{"prompt": "hi", "stop": null, "temperature": null, "max_tokens": null, "seed": -1}',
                   "null is 'not given' and model may be left out, as the OpenAI SDK sends them")
    assert sdk.stop == [] and sdk.params.temperature == 1.0 and sdk.max_tokens == 16, "a null field takes its default"
    assert sdk.params.seed == -1, "a negative seed is passed on as given"
with cases("every field given"):
    full = accepted(json.dumps({"model": "served", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "top_p": 0.5,
                                "seed": 9, "stop": "\n", "stream": True, "stream_options": {"include_usage": True}}),
                    "every field within its range")
    assert expect_ints(full.prompt_ids, "prompt_ids") == [5, 6, 7], "a list of token ids is the prompt as it is"
    assert full.params.temperature == 0.0 and full.params.top_p == 0.5 and full.params.seed == 9, "temperature, top_p, seed go into params"
    assert full.stop == ["\n"] and full.stream is True and full.include_usage is True, "stop as a list; stream; include_usage"
for body, status, param, code, why in [
        (b"{not json", 400, None, None, "not JSON: 400 with param None"),
        (b'{"model": "served", "prompt": "hi", "foo": 1}', 400, "foo", None, "a field not in FIELDS is refused, naming it"),
        (b'{"model": "served"}', 400, "prompt", None, "prompt is required"),
        (b'{"model": "served", "prompt": null}', 400, "prompt", None, "null means 'not given', and prompt is required"),
        (b'{"model": "served", "prompt": "hi", "max_tokens": "10"}', 400, "max_tokens", None, "max_tokens must be an integer, not a string"),
        (b'{"model": "served", "prompt": "hi", "max_tokens": true}', 400, "max_tokens", None,
         "JSON true is a bool, not a number: compare type(value) with FIELDS, not isinstance (bool is a subclass of int)"),
        (b'{"model": "served", "prompt": "hi", "max_tokens": 0}', 400, "max_tokens", None, "max_tokens must be at least 1"),
        (b'{"model": "gpt-4o", "prompt": "hi"}', 404, "model", "model_not_found", "a model that is not served_model: 404, code model_not_found"),
        (json.dumps({"model": "served", "prompt": "x" * 90, "max_tokens": 11}), 400, "prompt", "context_length_exceeded",
         "90 prompt tokens + 11 to generate > max_model_len 100: the context does not fit")]:
    with cases(f"refuses {short(body)}"):
        refused(body, status, param, code, why)
### BEGIN HIDDEN TESTS
""" + HIDDEN_BODIES + r"""
for body, status, param, code, why in _BAD:
    with cases(f"refuses {short(body)}"):
        refused(body, status, param, code, why)
for body, want, why in _GOOD:
    with cases(f"accepts {short(body)}"):
        got = accepted(body, why, _M)
        prompt = json.loads(body)["prompt"]
        assert expect_ints(got.prompt_ids, "prompt_ids") == (_tok(prompt) if isinstance(prompt, str) else prompt), \
            "prompt_ids: the string tokenized, or the list as it is"
        assert len(got.prompt_ids) == want.get("n", 5), "prompt_ids must hold the whole prompt"
        for k in ("temperature", "top_p", "seed"):
            if k in want:
                v = getattr(got.params, k)
                assert v == want[k] and type(v) is type(want[k]), \
                    f"params.{k} is {v!r} ({type(v).__name__}): {why} (temperature and top_p as Python floats; seed as given)"
        expect_int(got.max_tokens, "max_tokens")
        expect_type(got.stop, "stop", list)
        for k in ("stream", "include_usage", "ignore_eos"):
            expect_bool(getattr(got, k), k)
        for k in ("max_tokens", "stop", "stream", "include_usage", "ignore_eos"):
            if k in want:
                assert getattr(got, k) == want[k], f"{k} is {getattr(got, k)!r}: {why}"
        assert expect_type(got.model, "model", str) == _M, "model: the served model's name"
with cases("the defaults, and the served model's name"):
    d = accepted(_j(), "a plain request", _M)
    assert (d.max_tokens, d.stop, d.stream, d.include_usage, d.ignore_eos) == (16, [], False, False, False), \
        "defaults: max_tokens 16, stop [], stream, include_usage and ignore_eos False"
    assert (d.params.temperature, d.params.top_p, d.params.seed) == (1.0, 1.0, None), \
        "default sampling settings: temperature 1.0, top_p 1.0, seed None"
    assert expect_type(d.model, "model", str) == _M, "model: the served model's name"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
## 5. Serving it

Now the pieces go together. `build_app` (given, in `course/serve/app.py`) is the ASGI application:
the HTTP routes over your `AsyncEngine`, with your `parse_completion`, `TextStream` and
`completion_events` plugged in. It is written with **Starlette**, the toolkit under FastAPI: FastAPI
would check bodies for us with pydantic and answer 422 in its own format, and checking them was the
point of Problem 4. **uvicorn** is the server: it speaks HTTP on a socket, and calls the app with one
coroutine per request. The routes:

| route | what |
|---|---|
| `POST /v1/completions` | a prompt in, text out; `"stream": true` streams SSE |
| `POST /v1/chat/completions` | `"messages"` in; the prompt comes from the model's chat template |
| `GET /v1/models` | the served model's name (what clients send as `"model"`) |
| `GET /health` | 200 while the server runs (load balancers poll it) |
| `GET /metrics` | the engine's gauges and counters in Prometheus' text format |

A notebook cell cannot block in `uvicorn.run`, so `ServerThread` runs uvicorn in a background
thread, on a free port of 127.0.0.1 (this machine only), and stops it cleanly: uvicorn stops
accepting, lets open responses end, runs the app's shutdown (your engine's `stop`), and the thread
ends. From a shell, the same server is one command (the course's own engine, with every option):

```bash
python -m course.serve --port 8000 --chunk-size 256 --max-running 16 --max-waiting 64
```
"""),
code(r'''
server_engine = AsyncEngine(make_core("prefill_first", max_running=4), max_waiting=4)
app = build_app(server_engine, tokenizer, MODEL_NAME, parse_completion=parse_completion,
                completion_events=completion_events, text_stream=TextStream)
server = ServerThread(app).start()        # stopped at the end of this section: server.stop()
BASE_URL = server.url
print(server)
'''),
md(r"""
**curl**, the client every server is first tried with (`-N`: print the stream as it comes):
"""),
code(r'''
import shlex
import shutil
import subprocess

def curl(path: str, body: dict | None = None) -> None:
    cmd = ["curl", "-s", "-N", f"{BASE_URL}{path}"]
    if body is not None:
        cmd += ["-H", "Content-Type: application/json", "-d", json.dumps(body)]
    print("$", shlex.join(cmd))
    if shutil.which("curl") is None:
        print("(curl is not installed here: run the command in a terminal)")
        return
    print(subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout)

curl("/v1/models")
curl("/v1/completions", {"model": MODEL_NAME, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
curl("/v1/completions", {"model": MODEL_NAME, "prompt": "Count: one, two,", "max_tokens": 6, "temperature": 0, "stream": True})
'''),
md(r"""
**The `openai` client.** Any program written against OpenAI's API talks to this server if you change
its base URL: that is what "OpenAI-compatible" buys. The chat endpoint formats the messages with the
model's chat template (SmolLM2 is an instruction-tuned model, so this is how it expects to be asked).
"""),
code(r'''
try:
    import openai
except ImportError:
    openai = None
    print("the openai package is not installed: pip install openai")
if openai is not None:
    client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="not-needed", timeout=120, max_retries=0)
    reply = client.completions.create(model=MODEL_NAME, prompt="The three primary colors are", max_tokens=10, temperature=0)
    print(repr(reply.choices[0].text), reply.choices[0].finish_reason, reply.usage)
    chat = client.chat.completions.create(model=MODEL_NAME, max_tokens=env.pick(40, 12, cpu=24), temperature=0, stream=True,
                                          messages=[{"role": "user", "content": "Give me one tip to sleep better."}])
    for chunk in chat:
        if chunk.choices and chunk.choices[0].delta.content:
            print(chunk.choices[0].delta.content, end="", flush=True)
    print()
'''),
md(r"""
**/metrics.** Prometheus (and Grafana on top) scrapes this page every few seconds; an operator
watches queue lengths and cache usage, and an autoscaler may act on them. The names follow vLLM's
(`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`, ...), with our prefix.
"""),
code(r'''
page = httpx.get(f"{BASE_URL}/metrics", timeout=30).text
print("\n".join(page.splitlines()[:6]) + "\n...")
for name, value in parse_metrics(page).items():
    print(f"{name:40} {value:g}")
'''),
md(r"""
### Where a streamed token's time goes

Between two tokens a client waits for the model's step, and for the serving layer's own work:
detokenizing, building the JSON chunk and its SSE frame, the HTTP layer and the event loop. Here are
the pieces measured one by one on this machine (medians), beside the gap the client sees. Your
`TextStream` decodes every id at every token, so its cost grows with the text; the course's
(`course.serve.streaming.TextStream`) decodes a window of a few ids, as vLLM's detokenizer does.
"""),
code(r'''
import statistics
from course.serve.streaming import TextStream as WindowedTextStream   # vLLM's offsets: a few ids per token

n_tok = env.pick(64, 24, cpu=48)
story = "Write a short story about a river."
body = {"model": MODEL_NAME, "prompt": story, "max_tokens": n_tok, "temperature": 0, "stream": True, "ignore_eos": True}
arrivals = []
with httpx.Client(base_url=BASE_URL, timeout=120) as http, http.stream("POST", "/v1/completions", json=body) as r:
    for line in r.iter_lines():
        if line.startswith("data: {"):
            arrivals.append(time.perf_counter())
client_gap = statistics.median(b - a for a, b in zip(arrivals, arrivals[1:]))

core = make_core("prefill_first", max_running=1)                 # the same engine, alone: the model's step
core.add_request("timing", encode(story), SamplingParams(temperature=0), n_tok, ignore_eos=True)
step_s, story_ids = [], []
while core.has_work():
    t0 = time.perf_counter()
    story_ids += [o.token for o in core.step()]
    step_s.append(time.perf_counter() - t0)
model_step = statistics.median(step_s[1:])                       # the first step is the prefill

def per_push(stream_class) -> float:
    ts, t0 = stream_class(decode), time.perf_counter()
    for t in story_ids:
        ts.push(t)
    return (time.perf_counter() - t0) / len(story_ids)

chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL_NAME,
         "choices": [{"index": 0, "text": " river", "logprobs": None, "finish_reason": None}]}
t0 = time.perf_counter()
for rep in range(1000):
    frame = f"data: {json.dumps(chunk)}\n\n".encode()
json_sse = (time.perf_counter() - t0) / 1000

# HTTP and the event loop alone: a server that streams ready-made frames, no model between them
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route

async def ready_frames(request):
    async def frames():
        for _ in range(2000):
            yield frame
            await asyncio.sleep(0)                                  # let the loop run, as between engine steps
    return StreamingResponse(frames(), media_type="text/event-stream")

with ServerThread(Starlette(routes=[Route("/frames", ready_frames)])) as echo:
    with httpx.Client(timeout=60) as http, http.stream("GET", f"{echo.url}/frames") as r:
        t0 = time.perf_counter()
        n_bytes = sum(len(b) for b in r.iter_bytes())
        http_loop = (time.perf_counter() - t0) / (n_bytes / len(frame))

ms = lambda s: f"{s * 1e3:8.3f} ms"
print(f"per token, {len(story_ids)} tokens, {env.device}, {str(env.dtype).replace('torch.', '')} (the step and the wait: medians; the rest: means of many):")
print(f"  the model's step (the engine alone, batch of 1)   {ms(model_step)}")
print(f"  detokenizing: your TextStream (all ids)          {ms(per_push(TextStream))}")
print(f"  detokenizing: a window of ids (vLLM's way)        {ms(per_push(WindowedTextStream))}")
print(f"  JSON chunk + SSE frame                            {ms(json_sse)}")
print(f"  HTTP and the event loop, per chunk                {ms(http_loop)}")
print(f"  what the client waits between tokens              {ms(client_gap)} (the engine serving this one request)")
'''),
md(r"""
Read your own numbers: the client's wait is about the model's step, and the serving layer's pieces
are small beside it here. They do not shrink on a GPU, though, while the model's step does, to a few
milliseconds: there the serving layer's share grows. That
is why vLLM's newer engine runs the model loop in a process of its own, with tokenizing, detokenizing
and HTTP in another, so the two overlap instead of taking turns.
"""),
md(r"""
### What a server must survive

Three things clients do. (1) Send nonsense: every bad request gets its 4xx and the next request is
served. (2) Hang up mid-stream: the connection drops, Starlette cancels the task reading your
stream, your `stream`'s `finally` aborts the request, and its KV blocks come back: we watch
`course:kv_blocks_used` in `/metrics` return to 0. (3) Arrive all at once: the server holds at most
`max_waiting` requests waiting (4 here) and answers the rest **429 Too Many Requests** with a
`Retry-After` header, rather than queuing without bound until every client times out.
"""),
code(r'''
with httpx.Client(base_url=BASE_URL, timeout=120) as http:
    for body in ['{"model": "SmolLM2-135M-Instruct", "prompt": ', '{"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": -1}',
                 json.dumps({"model": MODEL_NAME, "prompt": "Hi " * 10_000})]:
        r = http.post("/v1/completions", content=body)
        print(r.status_code, r.json()["error"]["message"][:110])
    print("still serving:", http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2}).status_code)

    used = lambda: parse_metrics(http.get("/metrics").text)["course:kv_blocks_used"]
    long = {"model": MODEL_NAME, "prompt": "Write a long essay about rivers.", "max_tokens": 500, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/completions", json=long) as r:
        lines = r.iter_lines()
        first = [next(lines) for _ in range(6)]           # three events (and their empty lines), then hang up
        print(f"mid-stream: {used():.0f} KV blocks in use")
    deadline = time.monotonic() + 30
    while used() > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    print(f"after the client hung up: {used():.0f} KV blocks in use")

async def flood(n: int) -> list:
    async with httpx.AsyncClient(base_url=BASE_URL, timeout=120) as ac:
        body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
        return await asyncio.gather(*[ac.post("/v1/completions", json=body) for _ in range(n)])

answers = await asyncio.wait_for(flood(16), 300)
codes = [r.status_code for r in answers]
print(f"16 requests at once: {codes.count(200)} served, {codes.count(429)} refused with 429, "
      f"Retry-After: {next((r.headers['retry-after'] for r in answers if r.status_code == 429), None)}")
'''),
code(r'''
server.stop()
print(server, "| its log (the last lines):", *server.logs[-3:], sep="\n  ")
'''),
]
