"""The OpenAI API's request checks and response shapes, for /v1/completions and /v1/chat/completions.

A server people depend on answers a bad request with a 4xx status and an error body a client can
read, and keeps serving. OpenAI's error body, which vLLM and every compatible server copy:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

`parse_completion` and `parse_chat` turn a raw request body into a `GenerationRequest` or raise
`APIError`: malformed JSON, a body that is not an object, a missing or unknown field, a wrong type
(a bool is not a number here, though Python says it is), a value out of range, an unknown model (404),
or a prompt that leaves no room for `max_tokens` in the context (400, code context_length_exceeded).
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from course.engine.sampler import SamplingParams

MAX_STOP = 4                   # OpenAI accepts up to 4 stop sequences
DEFAULT_MAX_TOKENS = 16        # OpenAI's default for /v1/completions


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
    """A checked request, in the engine's terms."""

    model: str
    prompt_ids: list[int]
    max_tokens: int = DEFAULT_MAX_TOKENS
    params: SamplingParams = field(default_factory=SamplingParams)
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False


# field -> (accepted JSON types, description for the error message); bool is never a number
COMMON = {"model": ((str,), "a string"), "max_tokens": ((int,), "an integer"),
          "temperature": ((int, float), "a number"), "top_p": ((int, float), "a number"),
          "seed": ((int,), "an integer"), "stop": ((str, list), "a string or a list of strings"),
          "stream": ((bool,), "a boolean"), "stream_options": ((dict,), "an object"),
          "n": ((int,), "an integer"), "user": ((str,), "a string"),
          "top_k": ((int,), "an integer"), "min_p": ((int, float), "a number"), "ignore_eos": ((bool,), "a boolean")}
COMPLETION_FIELDS = {**COMMON, "prompt": ((str, list), "a string or a list of token ids")}
CHAT_FIELDS = {**COMMON, "messages": ((list,), "a list of messages"), "max_completion_tokens": ((int,), "an integer")}


def _load(body: bytes | str, fields: dict, required: tuple[str, ...]) -> dict:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request ({e}). The body must be a JSON object.") from None
    if not isinstance(data, dict):
        raise APIError(400, f"The request body must be a JSON object, got {type(data).__name__}.")
    for name in data:
        if name not in fields:
            raise APIError(400, f"Unrecognized request argument supplied: {name}", param=name)
    for name in required:
        if name not in data:
            raise APIError(400, f"Missing required parameter: '{name}'.", param=name)
    for name, value in data.items():
        types, what = fields[name]
        bad_number = isinstance(value, float) and not math.isfinite(value)
        if type(value) not in types or bad_number:
            raise APIError(400, f"Invalid type for '{name}': expected {what}, but got {_json_type(value)}.", param=name)
    return data


def _json_type(value) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)


def _common(data: dict, served_model: str) -> dict:
    """Checks shared by both endpoints; returns the engine-side settings."""
    if data["model"] != served_model:
        raise APIError(404, f"The model `{data['model']}` does not exist.", param="model", code="model_not_found")
    ranges = {"temperature": (0, 2), "top_p": (0, 1), "min_p": (0, 1)}
    for name, (lo, hi) in ranges.items():
        if name in data and not (lo < data[name] <= hi if name == "top_p" else lo <= data[name] <= hi):
            interval = f"({lo}, {hi}]" if name == "top_p" else f"[{lo}, {hi}]"
            raise APIError(400, f"'{name}' must be in {interval}, got {data[name]}.", param=name)
    for name in ("max_tokens", "max_completion_tokens"):
        if name in data and data[name] < 1:
            raise APIError(400, f"'{name}' must be at least 1, got {data[name]}.", param=name)
    if data.get("n", 1) != 1:
        raise APIError(400, f"Only n=1 is supported, got {data['n']}.", param="n")
    if not 0 <= data.get("seed", 0) < 2**63:
        raise APIError(400, f"'seed' must be in [0, 2**63), got {data['seed']}.", param="seed")
    if data.get("top_k", 0) < 0:
        raise APIError(400, f"'top_k' must be >= 0 (0 = off), got {data['top_k']}.", param="top_k")
    stop = data.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if len(stop) > MAX_STOP or not all(isinstance(s, str) and s for s in stop):
        raise APIError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOP} non-empty strings.",
                       param="stop")
    options = data.get("stream_options")
    if options is not None:
        if not data.get("stream", False):
            raise APIError(400, "'stream_options' is only allowed when 'stream' is true.", param="stream_options")
        if set(options) - {"include_usage"} or type(options.get("include_usage", False)) is not bool:
            raise APIError(400, "'stream_options' accepts only {'include_usage': true|false}.", param="stream_options")
    params = SamplingParams(temperature=float(data.get("temperature", 1.0)), top_p=float(data.get("top_p", 1.0)),
                            top_k=data.get("top_k", 0), min_p=float(data.get("min_p", 0.0)), seed=data.get("seed"))
    return dict(model=data["model"], params=params, stop=stop, stream=data.get("stream", False),
                include_usage=bool((options or {}).get("include_usage", False)), ignore_eos=data.get("ignore_eos", False))


def _fit(prompt_ids: list[int], max_tokens: int | None, max_model_len: int, param: str) -> int:
    """max_tokens (None: what the context leaves), checked against the context length."""
    room = max_model_len - len(prompt_ids)
    if max_tokens is None:
        max_tokens = room
    if len(prompt_ids) + max_tokens > max_model_len or room < 1:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                       f"{len(prompt_ids) + max_tokens} tokens ({len(prompt_ids)} in the {param}, {max_tokens} in the "
                       "completion). Please reduce the length of the prompt or completion.",
                       param=param, code="context_length_exceeded")
    return max_tokens


def parse_completion(body: bytes | str, served_model: str, tokenize: Callable[[str], list[int]],
                     max_model_len: int, vocab_size: int | None = None) -> GenerationRequest:
    """A /v1/completions body -> GenerationRequest, or APIError naming what is wrong."""
    data = _load(body, COMPLETION_FIELDS, ("model", "prompt"))
    common = _common(data, served_model)
    prompt = data["prompt"]
    if isinstance(prompt, str):
        ids = tokenize(prompt)
    elif all(type(t) is int and 0 <= t < (vocab_size or 1 << 62) for t in prompt):
        ids = list(prompt)
    else:
        raise APIError(400, "'prompt' must be a string or a list of token ids (a batch of prompts is not supported).",
                       param="prompt")
    if not ids:
        raise APIError(400, "'prompt' must not be empty.", param="prompt")
    max_tokens = _fit(ids, data.get("max_tokens", DEFAULT_MAX_TOKENS), max_model_len, "prompt")
    return GenerationRequest(prompt_ids=ids, max_tokens=max_tokens, **common)


def parse_chat(body: bytes | str, served_model: str, apply_chat_template: Callable[[list[dict]], list[int]],
               max_model_len: int) -> GenerationRequest:
    """A /v1/chat/completions body -> GenerationRequest (the prompt made by the model's chat template)."""
    data = _load(body, CHAT_FIELDS, ("model", "messages"))
    common = _common(data, served_model)
    messages = data["messages"]
    roles = {"system", "user", "assistant"}
    if not messages or not all(isinstance(m, dict) and set(m) <= {"role", "content", "name"} and m.get("role") in roles
                               and isinstance(m.get("content"), str) for m in messages):
        raise APIError(400, "'messages' must be a non-empty list of {'role': 'system'|'user'|'assistant', "
                       "'content': string} objects.", param="messages")
    ids = apply_chat_template([{"role": m["role"], "content": m["content"]} for m in messages])
    max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
    return GenerationRequest(prompt_ids=ids, max_tokens=_fit(ids, max_tokens, max_model_len, "messages"), **common)
