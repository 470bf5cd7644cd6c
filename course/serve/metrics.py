"""/metrics in Prometheus' text format, the way vLLM exposes its engine (names prefixed `course:`).

Prometheus scrapes a page of lines `name{labels} value`, each metric announced by `# HELP` and
`# TYPE` (gauge: a value now; counter: a running total that only grows; rates come from its slope):

    # HELP course:num_requests_running Requests in the batch.
    # TYPE course:num_requests_running gauge
    course:num_requests_running{model_name="SmolLM2-135M-Instruct"} 3

vLLM's counterparts: vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc,
vllm:prefix_cache_queries / vllm:prefix_cache_hits (tokens), vllm:prompt_tokens_total,
vllm:generation_tokens_total, vllm:request_success_total, vllm:num_preemptions_total.
"""
from __future__ import annotations

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
    ("request_success_total", "counter", "Requests that finished (length or stop).", "requests_finished"),
    ("request_aborted_total", "counter", "Requests aborted (client gone, stop string).", "requests_aborted"),
    ("num_preemptions_total", "counter", "Requests preempted when KV blocks ran out.", "preemptions"),
]


def render(values: dict[str, float], model_name: str, prefix: str = "course:") -> str:
    """The exposition text of `values` (LLMEngine.metrics()), every sample labelled with the model."""
    label = model_name.replace("\\", "\\\\").replace('"', '\\"')
    lines = []
    for name, kind, help_text, key in METRICS:
        value = key(values) if callable(key) else values[key]
        lines += [f"# HELP {prefix}{name} {help_text}", f"# TYPE {prefix}{name} {kind}",
                  f'{prefix}{name}{{model_name="{label}"}} {_number(value)}']
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """Exact for counts (1234567, not 1.23457e+06), shortest round-trip form otherwise."""
    value = float(value)
    return str(int(value)) if value.is_integer() else repr(value)


def parse(text: str) -> dict[str, float]:
    """{metric name: value} from exposition text (first sample of each name; labels dropped): for tests
    and notebooks that read /metrics."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out.setdefault(name.split("{", 1)[0], float(value))
    return out
