"""The OpenAI API's request checks and response shapes, for /v1/completions and /v1/chat/completions.

A server people depend on answers a bad request with a 4xx status and an error body a client can
read, and keeps serving. OpenAI's error body, which vLLM and every compatible server copy:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

`parse_completion` and `parse_chat` turn a raw request body into a `GenerationRequest` or raise
`APIError`. The contract, field by field, follows OpenAI's API reference; where it is silent, vLLM:

- `null` means "not given" for every optional field (clients send `"stop": null`); `model` may be
  left out (the one served model answers); another model's name gets 404 model_not_found.
- Applied: max_tokens (completions: default 16; chat: max_completion_tokens or max_tokens, default
  what the context leaves), temperature [0, 2], top_p (0, 1], seed (any 64-bit integer: SDKs send
  negative ones; mapped into the generator's range with seed % 2**64), stop (up to 4 strings),
  stream, stream_options {include_usage, continuous_usage_stats (vLLM), include_obfuscation (ignored)},
  frequency_penalty and presence_penalty [-2, 2], logit_bias {"token id": [-100, 100]}, n = 1,
  completions' logprobs (0..5) and echo (max_tokens may be 0 with echo: the prompt scored, nothing
  generated), chat's logprobs and top_logprobs (0..20), a list of prompts (a batch: one choice each),
  chat content as a list of text parts (joined with "\\n", as vLLM does), the developer role (as system).
  vLLM's extensions: top_k (-1 or 0: off), min_p, repetition_penalty (> 0), min_tokens, ignore_eos,
  stop_token_ids.
- response_format (structured outputs, lab 13; on both endpoints, as vLLM) when the server says its
  engine can constrain decoding (`structured=True`, which build_app passes for the course's engine):
  {"type": "text"}; {"type": "json_object"}; {"type": "json_schema", "json_schema": {"name", "schema",
  "strict", "description"}}, OpenAI's shape (name: 1-64 of a-z A-Z 0-9 _ -). Checked here: the
  shape, field by field. Checked when the grammar compiles (app.py): whether the schema is inside
  course.structured's subset (a 400 naming the keyword).
- Accepted and ignored, as they cannot change the text: user, store, metadata, service_tier,
  parallel_tool_calls, prompt_cache_key, safety_identifier, prediction (a latency hint),
  tools [] with tool_choice "none" or "auto", modalities ["text"],
  best_of 1, suffix "", a message's name.
- Refused with 400 "'<param>' is not supported by this server": tools, functions and tool/function
  messages, tool_choice "required" or a named tool, n > 1, best_of > 1, a suffix, response_format
  json_object or json_schema where the engine cannot constrain (structured=False), audio and the audio modality,
  reasoning_effort, verbosity, web_search_options, content parts other than text.
- Anything else: "Unrecognized request argument supplied: <name>".

Bad input never reaches a 500: not JSON, nesting too deep for the parser (RecursionError), a body
that is not an object, a wrong type (a bool is not a number here, though Python says it is), NaN or
Infinity ("must be a finite number"), a value out of range, a prompt that leaves no room in the
context (code context_length_exceeded). Messages quote values cut to 40 characters.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from course.engine.sampler import SamplingParams

MAX_STOP = 4                   # OpenAI accepts up to 4 stop sequences
DEFAULT_MAX_TOKENS = 16        # OpenAI's default for /v1/completions
MAX_LOGPROBS = 5               # completions' logprobs (OpenAI: at most 5)
MAX_TOP_LOGPROBS = 20          # chat's top_logprobs (OpenAI: 0 to 20)
SHOWN = 40                     # characters of a value quoted in an error message


class APIError(Exception):
    """A request the server refuses: HTTP `status` and OpenAI's error fields."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __repr__(self) -> str:
        return f"APIError({self.status}, {self.message!r}, param={self.param!r})"


@dataclass(frozen=True)
class GenerationRequest:
    """A checked request, in the engine's terms. The fields after ignore_eos are the server's
    additions; their defaults are a plain request's (lab 11's parser leaves them so)."""

    model: str
    prompt_ids: list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None            # top log-probabilities per token (None: no logprobs at all)
    echo: bool = False                     # completions: the prompt (and its logprobs) before the completion
    continuous_usage: bool = False         # usage in every streamed chunk (vLLM)
    stop_token_ids: tuple[int, ...] = ()
    prompts: tuple[list[int], ...] = ()    # completions given a list of prompts: all of them (prompt_ids first)
    prompt_texts: tuple[str | None, ...] = ()   # the prompts as sent, for echo (None: sent as token ids)
    # structured outputs: (kind, spec) for course.structured.compile_grammar, ("json_object", None) or
    # ("json_schema", schema); None for text
    response_format: tuple[str, dict | None] | None = None

    @property
    def all_prompts(self) -> tuple[list[int], ...]:
        return self.prompts or (self.prompt_ids,)

    @property
    def plain(self) -> bool:
        """True when lab 11's parts (one prompt, text only) can serve it."""
        return len(self.all_prompts) == 1 and self.logprobs is None and not self.echo and not self.continuous_usage


STR, INT, NUM, BOOL, OBJ, ARR = ((str,), "a string"), ((int,), "an integer"), ((int, float), "a number"), \
    ((bool,), "a boolean"), ((dict,), "an object"), ((list,), "an array")
COMMON = {"model": STR, "max_tokens": INT, "temperature": NUM, "top_p": NUM, "seed": INT,
          "stop": ((str, list), "a string or an array of strings"), "stream": BOOL, "stream_options": OBJ, "n": INT,
          "user": STR, "frequency_penalty": NUM, "presence_penalty": NUM, "logit_bias": OBJ,
          # vLLM's extensions
          "top_k": INT, "min_p": NUM, "repetition_penalty": NUM, "ignore_eos": BOOL, "min_tokens": INT,
          "stop_token_ids": ARR}
COMPLETION_FIELDS = {**COMMON, "prompt": ((str, list), "a string, an array of strings or an array of token ids"),
                     "logprobs": INT, "echo": BOOL, "best_of": INT, "suffix": STR, "response_format": OBJ}
CHAT_FIELDS = {**COMMON, "messages": ((list,), "an array of messages"), "max_completion_tokens": INT,
               "logprobs": BOOL, "top_logprobs": INT, "store": BOOL, "metadata": OBJ, "service_tier": STR,
               "parallel_tool_calls": BOOL, "prompt_cache_key": STR, "safety_identifier": STR, "prediction": OBJ,
               "response_format": OBJ, "tools": ARR, "tool_choice": ((str, dict), "a string or an object"),
               "functions": ARR, "function_call": ((str, dict), "a string or an object"), "modalities": ARR,
               "audio": OBJ, "reasoning_effort": STR, "verbosity": STR, "web_search_options": OBJ}
NOT_SUPPORTED = ("reasoning_effort", "verbosity", "web_search_options", "audio")      # chat fields refused whatever their value


def not_supported(name: str, why: str = "") -> APIError:
    return APIError(400, f"'{name}' is not supported by this server" + (f": {why}" if why else "."), param=name)


def cut(text: str) -> str:
    """Text for an error message: at most SHOWN characters, then "...", lone surrogates as "?" (JSON
    allows "\\ud800", UTF-8 does not, and the error body is UTF-8)."""
    text = text if len(text) <= SHOWN else text[:SHOWN] + "..."
    return text.encode("utf-8", "replace").decode("utf-8")


def _utf8(text: str, param: str) -> str:
    """`text`, if it is valid Unicode: a tokenizer cannot read a lone surrogate ("\\ud800" in JSON)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"'{param}' holds a lone surrogate (an unpaired \\ud800-\\udfff escape): "
                       "text must be valid Unicode.", param=param) from None
    return text


def show(value) -> str:
    """A value for an error message: JSON for a string or a number (cut), the type and size of a container."""
    if isinstance(value, (list, dict)):
        return f"{_json_type(value)} of {len(value)} items"
    try:
        return cut(json.dumps(value) if isinstance(value, str) else str(value))
    except ValueError:                                       # an int too long for str(): json would not parse it
        return "a very long number"


def _json_type(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _load(body: bytes | str, fields: dict, required: tuple[str, ...]) -> dict:
    """The body as a dict of the fields given (nulls dropped), each of an allowed JSON type."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(400, "The JSON body of your request is nested too deeply.") from None
    except ValueError as e:                                  # JSONDecodeError, UnicodeDecodeError, a 5000-digit number
        raise APIError(400, f"We could not parse the JSON body of your request ({cut(str(e))}). "
                       "The body must be a JSON object.") from None
    if not isinstance(data, dict):
        raise APIError(400, f"The request body must be a JSON object, got {_json_type(data)}.")
    for name in data:
        if name not in fields:
            raise APIError(400, f"Unrecognized request argument supplied: {cut(name)}", param=cut(name))
    data = {k: v for k, v in data.items() if v is not None}
    for name in required:
        if name not in data:
            raise APIError(400, f"Missing required parameter: '{name}'.", param=name)
    for name, value in data.items():
        types, what = fields[name]
        if type(value) not in types:
            raise APIError(400, f"Invalid type for '{name}': expected {what}, but got {_json_type(value)}.", param=name)
        if isinstance(value, float) and not math.isfinite(value):
            raise APIError(400, f"'{name}' must be a finite number, got {json.dumps(value)}.", param=name)
    return data


def _in(data: dict, name: str, lo, hi, *, lo_open: bool = False) -> None:
    """Refuse data[name] outside [lo, hi] ((lo, hi] with lo_open)."""
    if name in data:
        v = data[name]
        if not ((lo < v if lo_open else lo <= v) and v <= hi):
            raise APIError(400, f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {show(v)}.", param=name)


def _common(data: dict, served_model: str, vocab_size: int | None) -> dict:
    """Checks shared by both endpoints; returns the engine-side settings."""
    if data.get("model", served_model) != served_model:
        raise APIError(404, f"The model `{cut(data['model'])}` does not exist.", param="model",
                       code="model_not_found")
    _in(data, "temperature", 0, 2)
    _in(data, "top_p", 0, 1, lo_open=True)
    _in(data, "min_p", 0, 1)
    _in(data, "frequency_penalty", -2, 2)
    _in(data, "presence_penalty", -2, 2)
    _in(data, "repetition_penalty", 0, 1e6, lo_open=True)   # vLLM: > 0; a bound keeps it finite
    _in(data, "top_k", -1, 1 << 31)
    _in(data, "seed", -(1 << 63), (1 << 64) - 1)
    _in(data, "min_tokens", 0, 1 << 31)
    n = data.get("n", 1)
    if n != 1:
        _in(data, "n", 1, 1 << 31)
        raise not_supported("n", f"one choice per request (n=1), got {show(n)}.")
    stop = data.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOP} non-empty strings.",
                       param="stop")
    vocab = vocab_size or 1 << 62
    stop_ids = data.get("stop_token_ids", [])
    if not all(type(t) is int and 0 <= t < vocab for t in stop_ids):
        raise APIError(400, f"'stop_token_ids' must be a list of token ids (0..{vocab - 1}).", param="stop_token_ids")
    options = data.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not data.get("stream", False):
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        allowed = {"include_usage", "continuous_usage_stats", "include_obfuscation"}
        if set(options) - allowed or any(type(v) is not bool for v in options.values() if v is not None):
            raise APIError(400, f"'stream_options' accepts only {sorted(allowed)}, each true or false.",
                           param="stream_options")
        include_usage = bool(options.get("include_usage"))
        continuous = include_usage and bool(options.get("continuous_usage_stats"))   # vLLM needs both
    bias = {}
    for key, value in data.get("logit_bias", {}).items():
        if not (re.fullmatch(r"[0-9]{1,12}", key) and int(key) < vocab):
            raise APIError(400, f"'logit_bias' keys must be token ids in 0..{vocab - 1}, got {show(key)}.",
                           param="logit_bias")
        if type(value) not in (int, float) or not -100 <= value <= 100:     # NaN and Infinity fail the range
            raise APIError(400, f"'logit_bias' values must be finite numbers in [-100, 100], got {show(value)} "
                           f"for token {key}.", param="logit_bias")
        bias[int(key)] = float(value)
    top_k = data.get("top_k", 0)
    params = _params(data, top_k, bias)
    return dict(model=served_model, params=params, stop=stop, stream=data.get("stream", False),
                include_usage=include_usage, continuous_usage=continuous, ignore_eos=data.get("ignore_eos", False),
                min_tokens=data.get("min_tokens", 0), stop_token_ids=tuple(stop_ids))


def _params(data: dict, top_k: int, bias: dict) -> SamplingParams:
    """The sampler's settings (the ranges were checked; a slip here is still a 400, never a 500)."""
    try:
        return SamplingParams(temperature=float(data.get("temperature", 1.0)), top_p=float(data.get("top_p", 1.0)),
                              top_k=0 if top_k == -1 else top_k, min_p=float(data.get("min_p", 0.0)),
                              seed=data["seed"] % (1 << 64) if "seed" in data else None,
                              repetition_penalty=float(data.get("repetition_penalty", 1.0)),
                              frequency_penalty=float(data.get("frequency_penalty", 0.0)),
                              presence_penalty=float(data.get("presence_penalty", 0.0)), logit_bias=bias or None)
    except (ValueError, OverflowError) as e:
        raise APIError(400, cut(str(e))) from None


def _fit(prompt_ids: list[int], max_tokens: int | None, max_model_len: int, param: str) -> int:
    """max_tokens (None: what the context leaves), checked against the context length."""
    room = max_model_len - len(prompt_ids)
    if max_tokens is None:
        max_tokens = room
    if len(prompt_ids) + max(max_tokens, 1) > max_model_len:
        asked = show(len(prompt_ids) + max_tokens)
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{asked} tokens ({len(prompt_ids)} in the {param}, {show(max_tokens)} in the "
                       "completion). Please reduce the length of the prompt or completion.",
                       param=param, code="context_length_exceeded")
    return max_tokens


def _prompts(prompt, tokenize: Callable[[str], list[int]], vocab: int) -> tuple[list[list[int]], list[str | None]]:
    """A completions prompt -> (token ids of each prompt, each as sent when it was a string)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif prompt and all(type(t) is int for t in prompt):
        prompt = [prompt]
    if not prompt or not (all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt)):
        raise APIError(400, "'prompt' must be a string, a list of token ids, or a non-empty list of either "
                       "(a batch).", param="prompt")
    ids, texts = [], []
    for p in prompt:
        if isinstance(p, list) and not all(type(t) is int and 0 <= t < vocab for t in p):
            raise APIError(400, f"'prompt' token ids must be integers in 0..{vocab - 1}.", param="prompt")
        ids.append(tokenize(_utf8(p, "prompt")) if isinstance(p, str) else list(p))
        texts.append(p if isinstance(p, str) else None)
        if not ids[-1]:
            raise APIError(400, "'prompt' must not be empty.", param="prompt")
    return ids, texts


def parse_completion(body: bytes | str, served_model: str, tokenize: Callable[[str], list[int]],
                     max_model_len: int, vocab_size: int | None = None, *,
                     structured: bool = False) -> GenerationRequest:
    """A /v1/completions body -> GenerationRequest, or APIError naming what is wrong.
    structured: the engine can constrain decoding (response_format json_object / json_schema)."""
    data = _load(body, COMPLETION_FIELDS, ("prompt",))
    common = _common(data, served_model, vocab_size)
    common["response_format"] = parse_response_format(data.get("response_format"), structured)
    if data.get("best_of", 1) != 1:
        _in(data, "best_of", 1, 1 << 31)
        raise not_supported("best_of", "one candidate per choice (best_of=1).")
    if data.get("suffix"):
        raise not_supported("suffix", "no insertion (fill-in-the-middle) mode.")
    _in(data, "logprobs", 0, MAX_LOGPROBS)
    echo = data.get("echo", False)
    max_tokens = data.get("max_tokens", DEFAULT_MAX_TOKENS)
    if max_tokens < (0 if echo else 1):
        raise APIError(400, f"'max_tokens' must be at least {0 if echo else 1}{'' if echo else ' (0 only with echo)'}, "
                       f"got {show(max_tokens)}.", param="max_tokens")
    _check_min_tokens(common["min_tokens"], max_tokens)
    ids, texts = _prompts(data["prompt"], tokenize, vocab_size or 1 << 62)
    for p in ids:
        max_tokens = _fit(p, max_tokens, max_model_len, "prompt")
    return GenerationRequest(prompt_ids=ids[0], max_tokens=max_tokens, logprobs=data.get("logprobs"), echo=echo,
                             prompts=tuple(ids) if len(ids) > 1 else (), prompt_texts=tuple(texts), **common)


def _check_min_tokens(min_tokens: int, max_tokens: int | None) -> None:
    if max_tokens is not None and min_tokens > max_tokens:
        raise APIError(400, f"'min_tokens' ({show(min_tokens)}) must be at most max_tokens ({show(max_tokens)}).",
                       param="min_tokens")


ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MESSAGE_KEYS = {"role", "content", "name", "refusal", "tool_calls", "function_call", "audio", "annotations"}


def _message(i: int, m) -> dict:
    """One chat message -> {"role", "content": str}, or APIError naming messages[i]."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise APIError(400, f"'{where}' must be an object with 'role' and 'content', got {_json_type(m)}.",
                       param=where)
    role = m.get("role")
    if role in ("tool", "function"):
        raise not_supported(f"{where}.role", f"role '{role}' (this server serves no tools).")
    if role not in ROLES:
        raise APIError(400, f"'{where}.role' must be one of {sorted(ROLES)}, got {show(role)}.", param=f"{where}.role")
    extra = set(m) - MESSAGE_KEYS
    if extra:
        name = cut(sorted(extra)[0])
        raise APIError(400, f"Unrecognized request argument supplied: {where}.{name}", param=f"{where}.{name}")
    for key in ("tool_calls", "function_call", "audio"):
        if m.get(key):
            raise not_supported(f"{where}.{key}", "this server serves no tools or audio.")
    for key in ("name", "refusal"):
        if m.get(key) is not None and not isinstance(m[key], str):
            raise APIError(400, f"Invalid type for '{where}.{key}': expected a string.", param=f"{where}.{key}")
    content = m.get("content")
    if content is None and role == "assistant":
        content = ""                                         # an assistant turn that only called tools, or refused
    if isinstance(content, list):
        content = "\n".join(_text_part(f"{where}.content[{j}]", part, role) for j, part in enumerate(content))
    if not isinstance(content, str):
        raise APIError(400, f"'{where}.content' must be a string or a list of text parts, got {_json_type(content)}.",
                       param=f"{where}.content")
    return {"role": ROLES[role], "content": _utf8(content, f"{where}.content")}


def _text_part(where: str, part, role: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" or (kind == "refusal" and role == "assistant"):
        text = part.get(kind)
        if not isinstance(text, str) or set(part) - {"type", kind}:
            raise APIError(400, f"'{where}' must be {{'type': '{kind}', '{kind}': string}}.", param=where)
        return text
    if isinstance(kind, str):
        raise not_supported(where, f"content parts of type {show(kind)} (only text parts are).")
    raise APIError(400, f"'{where}' must be an object {{'type': 'text', 'text': string}}.", param=where)


FORMATS = ("text", "json_object", "json_schema")
JSON_SCHEMA_FIELDS = {"name": STR, "schema": OBJ, "strict": BOOL, "description": STR}
SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")      # OpenAI's rule for json_schema.name


def parse_response_format(fmt: dict | None, structured: bool = True) -> tuple[str, dict | None] | None:
    """response_format -> None (text) or (kind, spec) for course.structured.compile_grammar:
    ("json_object", None) or ("json_schema", schema). APIError names the bad field
    ('response_format.json_schema.name', ...). Whether the schema is in the supported subset is
    learned when it compiles, not here. structured=False: only {"type": "text"} is served."""
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind not in FORMATS:
        raise APIError(400, f"'response_format.type' must be one of {list(FORMATS)}, got {show(kind)}.",
                       param="response_format.type")
    if kind != "text" and not structured:
        raise not_supported("response_format", f"{kind} (structured outputs); only {{'type': 'text'}}.")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    extra = sorted(set(fmt) - allowed)
    if extra:
        name = f"response_format.{cut(extra[0])}"
        raise APIError(400, f"Unrecognized request argument supplied: {name} (a {kind} response_format has only "
                       f"{sorted(allowed)}).", param=name)
    if kind == "text":
        return None
    if kind == "json_object":
        return ("json_object", None)
    return ("json_schema", _json_schema_field(fmt.get("json_schema")))


def _json_schema_field(spec) -> dict:
    """response_format.json_schema ({"name", "schema", "strict", "description"}) -> the schema."""
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise APIError(400, f"'{where}' must be an object {{'name': string, 'schema': object, 'strict': boolean}}, "
                       f"got {_json_type(spec)}.", param=where)
    spec = {k: v for k, v in spec.items() if v is not None}
    for name in spec:
        if name not in JSON_SCHEMA_FIELDS:
            raise APIError(400, f"Unrecognized request argument supplied: {where}.{cut(name)}",
                           param=f"{where}.{cut(name)}")
    for name in ("name", "schema"):
        if name not in spec:
            raise APIError(400, f"Missing required parameter: '{where}.{name}'.", param=f"{where}.{name}")
    for name, value in spec.items():
        types, what = JSON_SCHEMA_FIELDS[name]
        if type(value) not in types:
            raise APIError(400, f"Invalid type for '{where}.{name}': expected {what}, but got {_json_type(value)}.",
                           param=f"{where}.{name}")
    if not SCHEMA_NAME.fullmatch(spec["name"]):
        raise APIError(400, f"'{where}.name' must be 1 to 64 characters of a-z, A-Z, 0-9, _ and -, got "
                       f"{show(spec['name'])}.", param=f"{where}.name")
    return spec["schema"]


def _chat_unsupported(data: dict) -> None:
    """The chat fields the server accepts only in their harmless forms."""
    for name in NOT_SUPPORTED:
        if name in data:
            raise not_supported(name)
    for name in ("tools", "functions"):
        if data.get(name):
            raise not_supported(name, "this server serves no tools (send [] or leave it out).")
    for name in ("tool_choice", "function_call"):
        if name in data and data[name] not in ("none", "auto"):
            raise not_supported(name, "with no tools, only 'none' (or 'auto').")
    modalities = data.get("modalities", ["text"])
    if modalities != ["text"]:
        if all(isinstance(x, str) for x in modalities) and set(modalities) <= {"text", "audio"} and modalities:
            raise not_supported("modalities", "text only.")
        raise APIError(400, "'modalities' must be [\"text\"] here.", param="modalities")


def parse_chat(body: bytes | str, served_model: str, apply_chat_template: Callable[[list[dict]], list[int]],
               max_model_len: int, vocab_size: int | None = None, *, structured: bool = False) -> GenerationRequest:
    """A /v1/chat/completions body -> GenerationRequest (the prompt made by the model's chat template).
    structured: the engine can constrain decoding (response_format json_object / json_schema)."""
    data = _load(body, CHAT_FIELDS, ("messages",))
    common = _common(data, served_model, vocab_size)
    _chat_unsupported(data)
    common["response_format"] = parse_response_format(data.get("response_format"), structured)
    _in(data, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if "top_logprobs" in data and not data.get("logprobs"):
        raise APIError(400, "'top_logprobs' needs 'logprobs': true.", param="top_logprobs")
    messages = data["messages"]
    if not messages:
        raise APIError(400, "'messages' must be a non-empty list of {'role', 'content'} objects.", param="messages")
    turns = [_message(i, m) for i, m in enumerate(messages)]
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    for name in ("max_completion_tokens", "max_tokens"):
        if name in data and data[name] < 1:
            raise APIError(400, f"'{name}' must be at least 1, got {show(data[name])}.", param=name)
    _check_min_tokens(common["min_tokens"], max_tokens)
    ids = apply_chat_template(turns)
    return GenerationRequest(prompt_ids=ids, max_tokens=_fit(ids, max_tokens, max_model_len, "messages"),
                             logprobs=data.get("top_logprobs", 0) if data.get("logprobs") else None, **common)
