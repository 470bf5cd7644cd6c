"""/metrics in Prometheus' text format, the way vLLM exposes its engine (names prefixed `course:`).

Prometheus scrapes a page of lines `name{labels} value`, each metric announced by `# HELP` and
`# TYPE` (gauge: a value now; counter: a running total that only grows; rates come from its slope):

    # HELP course:num_requests_running Requests in the batch.
    # TYPE course:num_requests_running gauge
    course:num_requests_running{model_name="SmolLM2-135M-Instruct"} 3

A histogram counts observations into cumulative buckets (`le`: less than or equal), plus their sum
and count, so a dashboard computes quantiles and means over any time window:

    course:time_to_first_token_seconds_bucket{le="0.1",model_name="..."} 12      (12 requests at <= 100 ms)
    course:time_to_first_token_seconds_bucket{le="+Inf",model_name="..."} 15
    course:time_to_first_token_seconds_sum{model_name="..."} 1.93
    course:time_to_first_token_seconds_count{model_name="..."} 15

vLLM's counterparts (same names after the prefix, same buckets): num_requests_running/waiting,
kv_cache_usage_perc, prefix_cache_queries/hits, prompt_tokens_total, generation_tokens_total,
num_preemptions_total; the histograms time_to_first_token_seconds, inter_token_latency_seconds,
e2e_request_latency_seconds, request_prompt_tokens, request_generation_tokens; and
request_success_total{finished_reason="stop"|"length"|"abort"}. Gauges and token counters come from
the engine (LLMEngine.metrics()); the per-request histograms and finish reasons from the HTTP layer
(`RequestStats`), which alone knows that a request ended on a stop string or because its client left.
"""
from __future__ import annotations

import bisect
import time

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# (name, type, help, key in LLMEngine.metrics() or a function of it)
METRICS = [
    ("num_requests_running", "gauge", "Requests in the batch.", "running"),
    ("num_requests_waiting", "gauge", "Requests waiting for a place in the batch.", "waiting"),
    ("kv_blocks_used", "gauge", "KV cache blocks held by running requests.", "kv_blocks_used"),
    ("kv_blocks_free", "gauge", "KV cache blocks no request holds (some keep cached prefixes).", "kv_blocks_free"),
    ("kv_cache_usage_perc", "gauge", "Fraction of KV cache blocks in use (0 to 1).",
     lambda m: m["kv_blocks_used"] / m["kv_blocks_total"]),
    ("prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    ("prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache.", "prefix_cache_hits"),
    ("prefix_cache_hit_rate", "gauge", "Prefix cache hits over queries since start (0 to 1).", "prefix_cache_hit_rate"),
    ("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", "prompt_tokens"),
    ("generation_tokens_total", "counter", "Tokens generated.", "generation_tokens"),
    ("num_preemptions_total", "counter", "Requests preempted when KV blocks ran out.", "preemptions"),
    # structured outputs (course's own; read with .get: an engine or app without them reports 0)
    ("grammar_compiles_total", "counter", "Grammars compiled for response_format (cache misses).",
     lambda m: m.get("grammar_compiles", 0)),
    ("grammar_cache_hits_total", "counter", "response_format requests that found their grammar compiled (or compiling).",
     lambda m: m.get("grammar_cache_hits", 0)),
    ("grammar_compile_seconds_total", "counter", "Seconds spent compiling grammars and their token masks.",
     lambda m: m.get("grammar_compile_seconds", 0)),
    ("grammar_mask_seconds_total", "counter", "Seconds the engine's steps spent masking constrained requests' logits.",
     lambda m: m.get("grammar_mask_seconds", 0)),
    ("grammar_masked_rows_total", "counter", "Rows of logits masked by a grammar (one per constrained token).",
     lambda m: m.get("grammar_masked_rows", 0)),
]
FINISH_REASONS = ("stop", "length", "abort")


def tokens_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's build_1_2_5_buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(float(m * scale))
        scale *= 10


TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0]


class Histogram:
    """Counts per bucket (upper bounds, ascending; +Inf implied), a sum and a count."""

    def __init__(self, name: str, help_text: str, buckets: list[float]):
        self.name, self.help, self.bounds = name, help_text, sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)               # not cumulative; the last one is +Inf
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1   # le: a value equal to a bound falls in it
        self.sum += value
        self.count += 1

    def lines(self, prefix: str, label: str) -> list[str]:
        out = [f"# HELP {prefix}{self.name} {self.help}", f"# TYPE {prefix}{self.name} histogram"]
        running = 0
        for bound, n in zip([*map(_number, self.bounds), "+Inf"], self.counts):
            running += n
            out.append(f'{prefix}{self.name}_bucket{{le="{bound}",{label}}} {running}')
        return out + [f"{prefix}{self.name}_sum{{{label}}} {_number(self.sum)}",
                      f"{prefix}{self.name}_count{{{label}}} {self.count}"]


class RequestStats:
    """Per-request histograms and finish reasons, recorded by the HTTP layer.

        rec = stats.start(prompt_tokens)      # when the request is queued
        rec.token()                           # at every output token the engine returns
        rec.finish("stop")                    # once: stop, length or abort (later calls do nothing)
    """

    def __init__(self, max_model_len: int = 8192, clock=time.perf_counter):
        self.clock = clock
        self.ttft = Histogram("time_to_first_token_seconds", "Time to first token in seconds.", TTFT_BUCKETS)
        self.itl = Histogram("inter_token_latency_seconds", "Time between two output tokens in seconds.", ITL_BUCKETS)
        self.e2e = Histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds.", E2E_BUCKETS)
        self.prompt = Histogram("request_prompt_tokens", "Prompt tokens per finished request.",
                                tokens_buckets(max_model_len))
        self.generation = Histogram("request_generation_tokens", "Generated tokens per finished request.",
                                    tokens_buckets(max_model_len))
        self.finished = dict.fromkeys(FINISH_REASONS, 0)

    def start(self, prompt_tokens: int) -> "_Record":
        return _Record(self, prompt_tokens)

    def lines(self, prefix: str, label: str) -> list[str]:
        out = []
        for h in (self.ttft, self.itl, self.e2e, self.prompt, self.generation):
            out += h.lines(prefix, label)
        out += [f"# HELP {prefix}request_success_total Requests finished, by reason (stop: EOS or a stop string; "
                "length: max_tokens or the context; abort: the client left or the engine failed).",
                f"# TYPE {prefix}request_success_total counter"]
        return out + [f'{prefix}request_success_total{{finished_reason="{r}",{label}}} {n}' for r, n in self.finished.items()]


class _Record:
    """One request's clock."""

    def __init__(self, stats: RequestStats, prompt_tokens: int):
        self.stats, self.prompt_tokens = stats, prompt_tokens
        self.start = self.last = stats.clock()
        self.tokens, self.done = 0, False

    def token(self) -> None:
        now = self.stats.clock()
        (self.stats.itl if self.tokens else self.stats.ttft).observe(now - self.last)
        self.last, self.tokens = now, self.tokens + 1

    def finish(self, reason: str) -> None:
        if self.done:
            return
        self.done = True
        s = self.stats
        s.finished[reason if reason in s.finished else "abort"] += 1
        s.e2e.observe(s.clock() - self.start)
        s.prompt.observe(self.prompt_tokens)
        s.generation.observe(self.tokens)


def render(values: dict[str, float], model_name: str, prefix: str = "course:",
           requests: RequestStats | None = None) -> str:
    """The exposition text of `values` (LLMEngine.metrics()) and of `requests`' histograms and finish
    reasons, every sample labelled with the model."""
    label = 'model_name="' + model_name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    lines = []
    for name, kind, help_text, key in METRICS:
        value = key(values) if callable(key) else values[key]
        lines += [f"# HELP {prefix}{name} {help_text}", f"# TYPE {prefix}{name} {kind}",
                  f"{prefix}{name}{{{label}}} {_number(value)}"]
    if requests is not None:
        lines += requests.lines(prefix, label)
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """Exact for counts (1234567, not 1.23457e+06), shortest round-trip form otherwise."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def parse(text: str) -> dict[str, float]:
    """{metric: value} from exposition text, for tests and notebooks that read /metrics: the first
    sample of each name, keyed by the name alone when its only label is model_name, else by the name
    and its other labels (`course:request_success_total{finished_reason="stop"}`); histogram buckets
    are left out (their _sum and _count stay)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        sample, value = line.rsplit(" ", 1)
        name, _, labels = sample.partition("{")
        if name.endswith("_bucket"):
            continue
        others = [kv for kv in labels.rstrip("}").split(",") if kv and not kv.startswith("model_name=")]
        out.setdefault(name + ("{" + ",".join(others) + "}" if others else ""), float(value))
    return out
