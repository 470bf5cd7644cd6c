"""Log-probabilities in OpenAI's two response shapes, from the engine's StepOutputs.

/v1/chat/completions (`"logprobs": true, "top_logprobs": k`), one entry per generated token:

    {"content": [{"token": " Paris", "logprob": -0.03, "bytes": [32, 80, 97, 114, 105, 115],
                  "top_logprobs": [{"token": " Paris", "logprob": -0.03, "bytes": [...]}, ...k]}], "refusal": null}

/v1/completions (`"logprobs": k`, OpenAI's legacy shape), parallel lists over the tokens of `text`;
with `"echo": true` the prompt's tokens come first, the very first with null (nothing predicts it):
what evaluation harnesses read to score a continuation (lm-eval's loglikelihood):

    {"tokens": ["The", " capital"], "token_logprobs": [null, -7.1], "top_logprobs": [null, {" capital": -7.1, ...}],
     "text_offset": [0, 3]}

As vLLM does: a token's text is `tokenizer.decode([id])` (special tokens shown), its bytes that
text's UTF-8 (a token holding half a character shows as U+FFFD), the log-probabilities are the
model's own (before penalties, bias and temperature), -inf is written -9999.0 (JSON has no
infinity), and the legacy top_logprobs also hold the chosen token. text_offset counts characters
from the start of the choice's `text`.
"""
from __future__ import annotations

import math
from collections.abc import Callable

FLOOR = -9999.0


def _lp(x: float) -> float:
    return x if math.isfinite(x) else FLOOR


class ChatLogprobs:
    """Formats the chat shape; called once per chunk (or once for a whole response) with its outputs."""

    def __init__(self, token_text: Callable[[int], str]):
        self.token_text = token_text

    def entry(self, token: int, logprob: float) -> dict:
        text = self.token_text(token)
        return {"token": text, "logprob": _lp(logprob), "bytes": list(text.encode("utf-8", "replace"))}

    def __call__(self, outputs: list) -> dict:
        content = [self.entry(o.token, o.logprob) | {"top_logprobs": [self.entry(t, lp) for t, lp in o.top_logprobs]}
                   for o in outputs if o.logprob is not None]
        return {"content": content, "refusal": None}


class CompletionLogprobs:
    """Formats the legacy shape; keeps the running text offset across the chunks of a stream. With
    `echo`, the first call puts the prompt's entries (from the first output) first; `generated=False`
    leaves the generated tokens out (echo with max_tokens 0: the prompt scored, nothing generated)."""

    def __init__(self, token_text: Callable[[int], str], prompt_ids: list[int] | None = None, generated: bool = True):
        self.token_text, self.prompt_ids, self.generated, self.offset = token_text, prompt_ids, generated, 0

    def __call__(self, outputs: list) -> dict:
        tokens, lps, tops = [], [], []
        if self.prompt_ids is not None and outputs:
            scored = outputs[0].prompt_logprobs or (None,) * len(self.prompt_ids)
            for t, entry in zip(self.prompt_ids, scored):
                tokens.append(t)
                lps.append(None if entry is None else entry[0])
                tops.append(None if entry is None else entry[1])
            self.prompt_ids = None
        for o in outputs if self.generated else ():
            tokens.append(o.token)
            lps.append(o.logprob)
            tops.append(o.top_logprobs)
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in zip(tokens, lps, tops):
            text = self.token_text(t)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else _lp(lp))
            if top is None:
                out["top_logprobs"].append(None)
            else:
                out["top_logprobs"].append({self.token_text(i): _lp(v) for i, v in top} | {text: _lp(lp)})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out
