"""Lab 11, section 6: the load generator. Problem 5 (arrivals and concurrent clients), Problem 6 (the
metrics of vLLM's serving benchmark), and a measurement under Poisson load."""
from autograder.authoring import code, md, solution, tests

# Hidden reference for Problem 6: records whose metrics are worked out by hand in the comments.
HIDDEN_TRACE = r'''
def _rec(ok, ttft, itl, latency, out, prompt=10):
    return RequestRecord(ok=ok, start=0.0, ttft=ttft, itl=list(itl), latency=latency, prompt_tokens=prompt, output_tokens=out)
# four requests over 2.0 s, one failed
#   A: ttft 0.1, gaps 0.1 0.1 0.3, latency 0.6, 5 tokens -> tpot (0.6 - 0.1) / 4 = 0.125
#   B: ttft 0.3, gaps 0.2,         latency 0.5, 2 tokens -> tpot (0.5 - 0.3) / 1 = 0.2
#   C: ttft 0.2, no gap,           latency 0.2, 1 token  -> no tpot (0 for goodput)
#   D: failed: left out of everything
_T = [_rec(True, 0.1, [0.1, 0.1, 0.3], 0.6, 5), _rec(True, 0.3, [0.2], 0.5, 2), _rec(True, 0.2, [], 0.2, 1),
      _rec(False, 0.0, [], 0.0, 0)]
# ttft 100, 300, 200 ms: mean 200, p50 200, p90 = 200 + 0.8 * 100 = 280, p99 = 200 + 0.98 * 100 = 298
# tpot 125, 200 ms: mean 162.5, p50 162.5, p90 125 + 0.9 * 75 = 192.5, p99 = 125 + 0.99 * 75 = 199.25
# itl 100, 100, 300, 200 ms: sorted 100 100 200 300; mean 175; p50 150; p90 at rank 2.7 = 200 + 0.7 * 100 = 270; p99 at 2.97 = 297
# e2el 600, 500, 200 ms: mean 433.33..; p50 500; p90 = 500 + 0.8 * 100 = 580; p99 = 598
_WANT = {"completed": 3, "failed": 1, "request_throughput": 1.5, "output_throughput": 4.0,
         "ttft_ms": (200, 200, 280, 298), "tpot_ms": (162.5, 162.5, 192.5, 199.25), "itl_ms": (175, 150, 270, 297),
         "e2el_ms": (1300 / 3, 500, 580, 598)}
'''.strip("\n")

cells = [
md(r"""
## 6. Measuring a server: the load generator

How fast is the server? "Tokens per second" of one run is not the answer users care about. A
serving benchmark sends requests **the way users do**, many at once, arriving at random moments, and
measures what each of them experiences. vLLM's `vllm bench serve` is the reference; we write our own
and use the same definitions, so our numbers can be compared with vLLM's.

**Arrivals.** Users act independently, so requests arrive as a **Poisson process**: the gaps between
arrivals are exponential, with mean `1 / rate`. vLLM generalizes with a **burstiness** knob: gaps
follow a gamma distribution with shape `burstiness` and scale `theta = 1 / (rate * burstiness)`. The
mean gap stays `1 / rate`; burstiness 1 is Poisson, below 1 the requests come in bursts with long
silences (the coefficient of variation of the gaps is `1 / sqrt(burstiness)`), above 1 they come more
evenly. `rate = inf` sends everything at time 0 (a pure throughput test).

```
rate 4/s, burstiness 0.25:  ||||       |         ||||||            |     (bursts, then silence)
rate 4/s, burstiness 1:     |  | ||   |  |   | |   ||  |  |   |  |       (Poisson)
rate 4/s, burstiness 4:     |   |   |  |   |   |  |   |   |  |   |       (nearly regular)
```

The rates below are fractions of a rough capacity estimated from one decode step on your machine
(`decode_step_ms()`, given: the median of a few steps of 4 requests), and
the SLO scales with it too (TTFT at most 10 decode steps, TPOT at most 2), so that the same cell tells
the same story on a laptop and on a GPU.

**Clients.** Each request is one **streaming** client, started at its arrival time whatever the
others are doing: a slow server does not slow the arrivals down (that is what makes queues build up,
as they do in production). The client (given: `send_completion` in `course/serve/loadgen.py`) posts
one streamed completion and records, like vLLM's, when each chunk with text arrives:

```
RequestRecord(ok, start, ttft, itl, latency, prompt_tokens, output_tokens, text, error)
   ttft:    first text chunk - start                itl: the gap before every later text chunk
   latency: end of the stream - start (end-to-end)  output_tokens: from the usage chunk
```

## Problem 5: Arrivals and concurrent clients (3 points)

**Deliverable:**
- `arrival_times(n, rate, burstiness=1.0, seed=0)`: a list of `n` Python floats, the send times in
  seconds from the start: the first at 0, then each a gap after the previous one, the `n - 1` gaps
  drawn with `np.random.default_rng(seed).gamma(shape, scale, size)` as above; all 0 when
  `rate == float("inf")`. Raise `ValueError` if `n < 0`, `rate <= 0` or `burstiness <= 0`.
- `run_load(send, requests, arrivals, max_concurrency=None)`, a coroutine: for each `i`, start
  `send(requests[i])` (a coroutine function) `arrivals[i]` seconds after `run_load` started, all of
  them concurrently; with `max_concurrency`, at most that many in flight at once (an
  `asyncio.Semaphore`; vLLM's `--max-concurrency`). Return `(results, duration)`: the results of
  `send` in the order of `requests`, and the seconds from the start until the last one finished
  (use `time.perf_counter()`).

Graded case by case: each scenario of the tests earns its share of the 3 points, and the feedback lists the
cases that failed.
"""),
solution("load_generator", r'''
def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times (s) of n requests: gamma gaps with mean 1/rate; burstiness 1 = Poisson; rate inf = all at 0."""
    ### BEGIN SOLUTION
    if n < 0 or not rate > 0 or not burstiness > 0:
        raise ValueError(f"need n >= 0, rate > 0 and burstiness > 0; got n={n}, rate={rate}, burstiness={burstiness}")
    if n == 0:
        return []
    if rate == float("inf"):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0] + np.cumsum(gaps).tolist()
    ### END SOLUTION


async def run_load(send: Callable, requests: Sequence, arrivals: Sequence[float],
                   max_concurrency: int | None = None) -> tuple[list, float]:
    """Start send(requests[i]) at arrivals[i] s, concurrently; (results in request order, duration in s)."""
    ### BEGIN SOLUTION
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    start = time.perf_counter()

    async def one(request, at: float):
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        async with limit:
            return await send(request)

    results = await asyncio.gather(*[one(r, at) for r, at in zip(requests, arrivals)])
    return list(results), time.perf_counter() - start
    ### END SOLUTION
'''),
code(r'''
fig, ax = plt.subplots(figsize=(9, 2.2))
for row, b in enumerate([0.25, 1.0, 4.0]):
    t = arrival_times(40, rate=4.0, burstiness=b, seed=1)
    ax.plot(t, [row] * len(t), "|", markersize=14, label=f"burstiness {b}")
ax.set_yticks([0, 1, 2], ["0.25 (bursty)", "1 (Poisson)", "4 (regular)"]); ax.set_xlabel("seconds")
ax.set_title("40 arrivals at 4 requests/s"); plt.tight_layout(); plt.show()
'''),
tests("load_generator_tests", 3, r"""
from course.expect import Cases
cases = Cases(points=3)        # one share of the 3 points per case: the feedback lists the cases that failed
with cases("arrival_times(5, 2.0, seed=3): from 0, never decreasing, reproducible"):
    t = expect_floats(arrival_times(5, rate=2.0, seed=3), "arrival_times(5, 2.0)", length=5)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:])), f"the first request at 0, then later and later: {t}"
    assert t == arrival_times(5, rate=2.0, seed=3), "the same seed must give the same arrivals"
with cases("arrival_times(4, inf): all at 0"):
    assert expect_floats(arrival_times(4, float("inf")), "arrival_times(4, inf)", length=4) == [0.0] * 4, "rate inf: all at 0"
with cases("arrival_times at 4 requests/s: Poisson gaps"):
    gaps = np.diff(expect_floats(arrival_times(20001, rate=4.0, seed=0), "arrival_times(20001, 4.0)", length=20001))
    assert abs(gaps.mean() - 0.25) < 0.01, f"rate 4/s: the mean gap must be 1/4 s, got {gaps.mean():.3f}"
    assert abs(gaps.std() / gaps.mean() - 1) < 0.05, "burstiness 1 (Poisson): gaps are exponential, std == mean"
for bad in (dict(n=3, rate=0.0), dict(n=3, rate=-1.0), dict(n=3, rate=1.0, burstiness=0.0), dict(n=-1, rate=1.0)):
    with cases(f"arrival_times({', '.join(f'{k}={v}' for k, v in bad.items())}) is refused"):
        try:
            arrival_times(**bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"arrival_times({bad}) must raise ValueError (n < 0, rate <= 0 or burstiness <= 0)")

async def _load():
    in_flight, peak, started = 0, 0, {}
    t0 = time.perf_counter()
    async def send(i):
        nonlocal in_flight, peak
        started[i] = time.perf_counter() - t0
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.2)
        in_flight -= 1
        return i * 10
    results, duration = expect_tuple(await run_load(send, list(range(6)), [0.0, 0.0, 0.05, 0.05, 0.1, 0.3]), "run_load(...)", 2)
    return results, duration, peak, started
with cases("run_load: 6 requests, concurrent, each at its arrival time"):
    results, duration, peak, started = run(_load())
    assert expect_ints(results, "run_load results", length=6) == [0, 10, 20, 30, 40, 50], "results in request order"
    assert expect_int(peak, "peak") == 5, \
        f"requests must run concurrently: 5 start within 0.1 s and take 0.2 s each, but at most {peak} ran at once"
    assert all(started[i] >= at - 0.005 for i, at in enumerate([0.0, 0.0, 0.05, 0.05, 0.1, 0.3])), \
        f"no request may start before its arrival time: {started}"
    assert 0.45 <= expect_float(duration, "duration") < 5, \
        f"duration: from the start until the last finished (0.3 + 0.2 s), got {duration:.3f}"
### BEGIN HIDDEN TESTS
# gamma shape and scale: mean 1/rate, coefficient of variation 1/sqrt(burstiness), for several knobs
for rate, b in ((1.0, 0.25), (10.0, 4.0), (0.5, 1.0)):
    with cases(f"arrival_times at rate {rate}, burstiness {b}"):
        t = np.array(expect_floats(arrival_times(40001, rate, b, seed=7), "arrival_times(...)", length=40001))
        g = np.diff(t)
        assert t[0] == 0 and (g >= 0).all(), "the first request at 0, and no gap is negative"
        assert abs(g.mean() * rate - 1) < 0.03, f"rate {rate}, burstiness {b}: the mean gap is {g.mean():.4f} s; it must be 1 / rate"
        assert abs(g.std() / g.mean() - 1 / np.sqrt(b)) < 0.05, f"burstiness {b}: the gaps' std/mean must be 1/sqrt(b)"
        assert (np.array(arrival_times(40001, rate, b, seed=8)) != t).any(), "another seed, other arrivals"
with cases("arrival_times of one request, and of none"):
    assert expect_floats(arrival_times(1, 3.0), "one request", length=1) == [0.0], "one request: sent at 0"
    assert expect_floats(arrival_times(0, 3.0), "no request", length=0) == [], "no request: an empty list"
with cases("arrival_times draws the gaps with vLLM's recipe"):
    # the gamma draw: exactly vLLM's recipe with this generator
    g = np.random.default_rng(5).gamma(shape=2.0, scale=1 / (3.0 * 2.0), size=9)
    assert np.allclose(expect_floats(arrival_times(10, 3.0, 2.0, seed=5), "arrivals", length=10), np.concatenate([[0], np.cumsum(g)])), \
        "draw the n - 1 gaps in one call: np.random.default_rng(seed).gamma(shape=burstiness, scale=1/(rate*burstiness), size=n-1)"
# max_concurrency caps what is in flight; nothing starts early; arrivals all at 0 start together
async def _cap(cap, arrivals, hold=0.05):
    state = {"now": 0, "peak": 0, "starts": []}
    t0 = time.perf_counter()
    async def send(r):
        state["starts"].append((r, time.perf_counter() - t0))
        state["now"] += 1
        state["peak"] = max(state["peak"], state["now"])
        await asyncio.sleep(hold)
        state["now"] -= 1
        return -r
    out, dur = expect_tuple(await run_load(send, list(range(len(arrivals))), arrivals, max_concurrency=cap), "run_load(...)", 2)
    return out, dur, state
with cases("run_load with max_concurrency=2"):
    out, dur, st = run(_cap(2, [0.0] * 8))
    assert expect_ints(out, "results", length=8) == [-i for i in range(8)] and expect_int(st["peak"], "peak") == 2, \
        f"max_concurrency=2: at most 2 in flight (got {st['peak']})"
    assert expect_float(dur, "duration") >= 0.19, "8 requests of 0.05 s, 2 at a time: at least 0.2 s"
with cases("run_load with no cap, every arrival at 0"):
    out, dur, st = run(_cap(None, [0.0] * 10))
    expect_ints(out, "results", length=10)
    assert st["peak"] == 10, f"rate inf, no cap: every request in flight at once, got at most {st['peak']}"
with cases("run_load waits for each arrival time"):
    arr = [0.0, 0.12, 0.12, 0.2]
    out, dur, st = run(_cap(None, arr, hold=0.01))
    expect_ints(out, "results", length=4)
    assert all(s >= arr[r] - 0.005 for r, s in st["starts"]), f"requests started before their arrival: {st['starts']}"
with cases("run_load with no request"):
    out, dur, st = run(_cap(None, [], hold=0.01))
    assert expect_type(out, "results", list) == [] and 0 <= expect_float(dur, "duration") < 1, "no request: no result, at once"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
## Problem 6: The metrics of a serving benchmark (3 points)

vLLM's `bench serve` reports, over the requests that succeeded:

- **TTFT**, time to first token: `ttft` of each request. What a user waits before anything appears.
- **TPOT**, time per output token: `(latency - ttft) / (output_tokens - 1)` of each request with more
  than one token: its average gap **after** the first token (the first is TTFT's business).
- **ITL**, inter-token latency: **every** gap of every request (`itl`), one value per gap. TPOT
  averages within a request and hides a single long stall; ITL keeps every stall, so its p99 shows them.
- **E2EL**, end-to-end latency: `latency` of each request.
- for each: the mean and the percentiles p50, p90, p99 (`np.percentile`, its default linear
  interpolation), in **milliseconds**;
- **throughput**: completed requests per second and output tokens per second, over the whole run's
  `duration` (first send to last finish);
- **goodput** (DistServe, 2024): requests per second that met **every** service-level objective
  (SLO) given, a dict whose keys are among `"ttft"`, `"tpot"` and `"e2el"` (vLLM's `--goodput` keys),
  e.g. `{"ttft": 500, "tpot": 100}`, in ms; a request is good when each of its metrics is
  at most its SLO (a one-token request counts as TPOT 0). Throughput counts work done; goodput counts
  the work users were happy with.

**Deliverable:** `summarize(records, duration, slo=None)` returns a dict of Python numbers
(`float(...)` around what NumPy returns):
`{"completed": int, "failed": int, "request_throughput": req/s, "output_throughput": tokens/s,
"ttft_ms": {"mean", "p50", "p90", "p99"}, "tpot_ms": {...}, "itl_ms": {...}, "e2el_ms": {...},
"good": int, "goodput": req/s}`. Failed records (`ok` False) count in `"failed"` only; a metric with no
values has 0.0 everywhere; with no SLO every completed request is good.

Graded case by case: each scenario of the tests earns its share of the 3 points, and the feedback lists the
cases that failed.
"""),
solution("metrics", r'''
PERCENTILES = (50, 90, 99)


def summarize(records: list[RequestRecord], duration: float, slo: dict | None = None) -> dict:
    """vLLM's serving metrics over the successful records; times in ms, rates per second."""
    ### BEGIN SOLUTION
    done = [r for r in records if r.ok]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    values = {"ttft": [r.ttft for r in done], "tpot": tpots, "itl": [g for r in done for g in r.itl],
              "e2el": [r.latency for r in done]}

    def stats(xs: list[float]) -> dict:
        ms = [1e3 * x for x in xs] or [0.0]
        return {"mean": float(np.mean(ms)), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}

    def good(r: RequestRecord) -> bool:
        per = {"ttft": r.ttft, "e2el": r.latency,
               "tpot": (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0}
        return all(1e3 * per[k] <= limit for k, limit in (slo or {}).items())

    n_good = sum(good(r) for r in done)
    return {"completed": len(done), "failed": len(records) - len(done),
            "request_throughput": len(done) / duration,
            "output_throughput": sum(r.output_tokens for r in done) / duration,
            **{f"{k}_ms": stats(v) for k, v in values.items()},
            "good": n_good, "goodput": n_good / duration}
    ### END SOLUTION
'''),
tests("metrics_tests", 3, r"""
from course.expect import Cases
cases = Cases(points=3)        # one share of the 3 points per case: the feedback lists the cases that failed
recs = [RequestRecord(ok=True, ttft=0.1, itl=[0.1, 0.1], latency=0.3, output_tokens=3),
        RequestRecord(ok=True, ttft=0.5, itl=[0.3], latency=0.8, output_tokens=2),
        RequestRecord(ok=False, error="HTTP 500")]
def summary(records, duration, slo=None):
    m = expect_type(summarize(records, duration, slo=slo), "summarize(...)", dict)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        expect_type(m[key], key, dict)
    return m
with cases("completed and failed"):
    m = summary(recs, 2.0)
    assert expect_int(m["completed"], "completed") == 2 and expect_int(m["failed"], "failed") == 1, "2 succeeded, 1 failed"
with cases("throughput"):
    m = summary(recs, 2.0)
    assert abs(expect_float(m["request_throughput"], "request_throughput") - 1.0) < 1e-9, "2 requests in 2 s: 1 req/s"
    assert abs(expect_float(m["output_throughput"], "output_throughput") - 2.5) < 1e-9, "5 tokens in 2 s: 2.5 tokens/s"
with cases("TTFT"):
    ttft = summary(recs, 2.0)["ttft_ms"]
    assert abs(expect_float(ttft["mean"], "ttft mean") - 300) < 1e-6 and abs(expect_float(ttft["p50"], "ttft p50") - 300) < 1e-6, \
        "TTFT in ms: 100 and 500, mean and median 300 (the failed request counts in no metric)"
with cases("TPOT"):
    assert abs(expect_float(summary(recs, 2.0)["tpot_ms"]["mean"], "tpot mean") - 200) < 1e-6, \
        "TPOT excludes the first token: (300 - 100) / (3 - 1) = 100 ms and (800 - 500) / (2 - 1) = 300 ms, mean 200"
with cases("ITL"):
    assert abs(expect_float(summary(recs, 2.0)["itl_ms"]["p50"], "itl p50") - 100) < 1e-6, \
        "ITL: every gap of every request (100, 100, 300 ms): median 100"
with cases("E2EL"):
    assert abs(expect_float(summary(recs, 2.0)["e2el_ms"]["p99"], "e2el p99") - 795) < 1e-6, \
        "E2EL p99 of 300 and 800 ms with linear interpolation: 795"
with cases("goodput with a TTFT SLO"):
    g = summary(recs, 2.0, slo={"ttft": 200})
    assert expect_int(g["good"], "good") == 1 and abs(expect_float(g["goodput"], "goodput") - 0.5) < 1e-9, \
        "only the first request meets TTFT <= 200 ms"
### BEGIN HIDDEN TESTS
""" + HIDDEN_TRACE + r"""
_RULE = {"ttft_ms": "the ttft of each successful request",
         "tpot_ms": "(latency - ttft) / (output_tokens - 1) of each successful request with more than one token",
         "itl_ms": "every gap (itl) of every successful request, one value per gap",
         "e2el_ms": "the latency of each successful request"}
with cases("completed and failed, on a trace with a failed request"):
    m = summary(_T, 2.0)
    assert expect_int(m["completed"], "completed") == 3 and expect_int(m["failed"], "failed") == 1, \
        "completed counts the records with ok True, failed the others"
with cases("throughput, on a trace with a failed request"):
    m = summary(_T, 2.0)
    assert abs(expect_float(m["request_throughput"], "request_throughput") - 1.5) < 1e-9, \
        "request_throughput: completed requests / duration"
    assert abs(expect_float(m["output_throughput"], "output_throughput") - 4.0) < 1e-9, \
        "output_throughput: the output tokens of the successful requests / duration (a failed one adds none)"
for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
    with cases(f"{key}: mean, p50, p90, p99"):
        got = summary(_T, 2.0)[key]
        for name, want in zip(("mean", "p50", "p90", "p99"), _WANT[key]):
            assert abs(expect_float(got[name], f"{key}[{name!r}]") - want) < 1e-6, \
                f"{key} {name} is {got[name]}, which is wrong: {key} is over {_RULE[key]}, in ms; " \
                "percentiles with np.percentile (linear interpolation)"
for what, slos in (("one SLO", (({"ttft": 200}, 2), ({"ttft": 100}, 1), ({"tpot": 150}, 2), ({"tpot": 124}, 1), ({"e2el": 500}, 2))),
                   ("several SLOs", (({"ttft": 250, "tpot": 150, "e2el": 600}, 2), ({"ttft": 250, "tpot": 150, "e2el": 550}, 1))),
                   ("a TPOT SLO of 0", (({"tpot": 0}, 1),)), ("no SLO", (({}, 3), (None, 3)))):
    with cases(f"goodput with {what}"):
        for slo, good in slos:
            g = summary(_T, 2.0, slo=slo)
            got = expect_int(g["good"], "good")
            assert got == good, (f"SLO {slo}: {got} good requests is wrong: a request is good when each of its metrics is at "
                                 "most its SLO in ms (<=), every SLO given at once; a one-token request has TPOT 0; no SLO: every completed request")
            assert abs(expect_float(g["goodput"], "goodput") - good / 2.0) < 1e-9, "goodput: good requests per second"
with cases("nothing succeeded"):
    z = summary([_rec(False, 0, [], 0, 0)], 1.0)
    assert expect_int(z["completed"], "completed") == 0 and expect_int(z["failed"], "failed") == 1, "nothing succeeded"
    assert expect_int(z["good"], "good") == 0 and expect_float(z["goodput"], "goodput") == 0, "nothing succeeded: no goodput"
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert all(expect_float(v, key) == 0.0 for v in z[key].values()) and set(z[key]) == {"mean", "p50", "p90", "p99"}, \
            f"{key} with no values: 0.0 for mean, p50, p90 and p99"
with cases("only one-token requests"):
    o = summary([_rec(True, 0.2, [], 0.2, 1), _rec(True, 0.4, [], 0.4, 1)], 1.0, slo={"tpot": 1})
    assert expect_float(o["tpot_ms"]["mean"], "tpot mean") == 0.0 and expect_float(o["itl_ms"]["p99"], "itl p99") == 0.0, \
        "one-token requests have no TPOT and no gap"
    assert expect_int(o["good"], "good") == 2, "a one-token request meets any TPOT SLO"
    assert abs(expect_float(o["ttft_ms"]["p90"], "ttft p90") - 380) < 1e-6, "p90 of 200 and 400 ms: 380 (np.percentile, linear)"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
### Measure: your server under Poisson load

Everything together: your engine, your API, your load generator, your metrics. The workload is
vLLM's "random" dataset: prompts of random token ids (the cost of a prompt does not depend on what it
says) of about `input_len` tokens, `output_len` tokens to generate each (`ignore_eos`, so every run
does the same work), at a few request rates. Each rate gets a fresh server (the same engine settings),
so one run's cached prefixes or queue cannot help the next.
"""),
code(r'''
def serve(policy="prefill_first", budget=4096, max_running=8, max_waiting=64):
    """A fresh server on your parts: use as `with serve(...) as server:`."""
    core = make_core(policy, budget=budget, max_running=max_running)
    app = build_app(AsyncEngine(core, max_waiting=max_waiting), tokenizer, MODEL_NAME, parse_completion=parse_completion,
                    completion_events=completion_events, text_stream=TextStream)
    server = ServerThread(app)
    server.core = core
    return server

async def benchmark_server(base_url, requests, rate, burstiness=1.0, slo=None, seed=0, max_concurrency=None):
    """Your load generator against any OpenAI-compatible server: (summary, records, duration)."""
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        send = lambda req: send_completion(client, base_url, MODEL_NAME, req[0], req[1])
        await send(requests[0])                                        # warm-up: one request alone
        records, duration = await run_load(send, requests, arrival_times(len(requests), rate, burstiness, seed),
                                           max_concurrency)
    return summarize(records, duration, slo), records, duration

decode_ms = decode_step_ms()                                         # one decode step of 4 requests, here
n_requests, input_len, output_len = env.pick((32, 256, 64), (8, 32, 12), cpu=(16, 64, 24))
capacity = 8 / (output_len * 1.5 * decode_ms / 1e3)    # rough: 8 running requests, steps of about 1.5 x 4 requests' step
rates = [round(f * capacity, 2) for f in env.pick([0.5, 1.0, 2.0], [0.5], cpu=[0.5, 1.0, 2.0])]
SLO = {"ttft": round(10 * decode_ms), "tpot": round(2 * decode_ms)}   # scaled to this machine's decode step
workload = random_requests(n_requests, input_len, output_len, range_ratio=0.5, seed=0)
results = {}
for rate in rates:
    with serve() as server:
        summary, records, duration = await asyncio.wait_for(benchmark_server(server.url, workload, rate, slo=SLO), 900)
    results[rate] = summary
    errors = [r.error for r in records if not r.ok]
    print(f"rate {rate:5.1f} req/s: {summary['completed']} ok, {summary['failed']} failed {errors[:1]}, {duration:5.1f} s")
print(f"\n{env.device}, {str(env.dtype).removeprefix('torch.')}, {n_requests} requests of ~{input_len} prompt tokens -> {output_len} tokens;"
      f" rough capacity {capacity:.2f} req/s; SLO {SLO} ms")
print(f"{'rate':>6} {'req/s':>6} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} {'TPOT p50':>9} {'ITL p50':>8} {'p99':>7} {'E2EL p99':>9} {'goodput':>8}")
for rate, s in results.items():
    print(f"{rate:6.1f} {s['request_throughput']:6.2f} {s['output_throughput']:7.1f} {s['ttft_ms']['p50']:9.0f} {s['ttft_ms']['p99']:7.0f} "
          f"{s['tpot_ms']['p50']:9.0f} {s['itl_ms']['p50']:8.0f} {s['itl_ms']['p99']:7.0f} {s['e2el_ms']['p99']:9.0f} {s['goodput']:8.2f}")
'''),
code(r'''
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.2))
xs = list(results)
for key, style in (("ttft_ms", "o-"), ("itl_ms", "s-")):
    ax1.plot(xs, [results[r][key]["p50"] for r in xs], style, label=f"{key[:-3].upper()} p50")
    ax1.plot(xs, [results[r][key]["p99"] for r in xs], style.replace("-", "--"), label=f"{key[:-3].upper()} p99")
ax1.set_xlabel("request rate (req/s)"); ax1.set_ylabel("ms"); ax1.set_yscale("log"); ax1.legend(fontsize=8)
ax2.plot(xs, [results[r]["request_throughput"] for r in xs], "o-", label="throughput")
ax2.plot(xs, [results[r]["goodput"] for r in xs], "s--", label="goodput (SLO met)")
ax2.plot(xs, xs, ":", color="gray", label="offered rate")
ax2.set_xlabel("request rate (req/s)"); ax2.set_ylabel("requests/s"); ax2.legend(fontsize=8)
for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
plt.suptitle(f"your server on {env.device} ({str(env.dtype).removeprefix('torch.')}), prefill-first"); plt.tight_layout(); plt.show()
'''),
md(r"""
Read your table from the top. At the lowest rate (half the rough capacity) the server keeps up: two
or three requests share each step, TTFT is about one prefill, TPOT about one decode step of a small
batch, plus the prefills of newcomers that interrupt it (on a CPU, where a prefill is long,
noticeably more). With a few dozen requests, the run's duration also holds the last requests'
drain, so the measured throughput sits a little below the offered rate even here (with only a few
requests, as in quick mode, random arrivals can also bunch up and push it above). As the rate
grows, requests share steps (each step is a little slower, but serves more requests: throughput
grows with the rate), until the offered rate passes what the server can do: then requests queue,
throughput stops following the offered rate, TTFT grows with the queue (it now includes the wait),
and goodput falls below throughput: the server still works hard, but for users who are no longer
happy. Where that knee sits is the server's **capacity** under this SLO, the number a capacity
planner needs. (Quick mode measures one rate, one point; run the notebook in full mode for the
curve.)

**The same client against vLLM.** Your `benchmark_server` only speaks HTTP. On a machine with a GPU:

```bash
pip install vllm
vllm serve HuggingFaceTB/SmolLM2-135M-Instruct --port 8000
```

then `await benchmark_server("http://127.0.0.1:8000", random_requests(32, 256, 64, range_ratio=0.5,
seed=0), rate=8.0, slo={"ttft": 500, "tpot": 50})` (with `MODEL_NAME =
"HuggingFaceTB/SmolLM2-135M-Instruct"`), and compare with vLLM's own `vllm bench serve --base-url
http://127.0.0.1:8000 --model HuggingFaceTB/SmolLM2-135M-Instruct --dataset-name random --num-prompts 32
--random-input-len 256 --random-output-len 64 --random-range-ratio 0.5 --ignore-eos --request-rate 8
--burstiness 1 --goodput ttft:500 tpot:50`: the same number of requests, lengths, rate and SLOs.
The two use the same definitions, so their numbers should agree within the noise of two runs (the
random arrivals and prompts differ), which checks your load generator against the reference one.
"""),
]
