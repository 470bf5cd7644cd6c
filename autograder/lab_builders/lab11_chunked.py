"""Lab 11, section 7 and the end: Problem 7 (a chunked-prefill scheduler with a token budget), the
batch timeline of both policies, the measurement under a mixed load, summary and going further."""
from autograder.authoring import answer, code, md, solution, tests

# Hidden reference for Problem 7: an engine simulation written here (sequences, blocks as a counter,
# arrivals), so only the student's scheduler is under test.
HIDDEN_SIM = r'''
import random as _random
def _seqs(specs):
    # specs: (prompt_len, max_tokens[, num_computed]) -> fresh Seq objects
    out = []
    for i, sp in enumerate(specs):
        s = Seq(f"r{i}", list(range(1, sp[0] + 1)), sp[1])
        if len(sp) > 2:
            s.num_computed = sp[2]
        out.append(s)
    return out
def _snapshot(seqs):
    return [(s.rid, len(s.prompt), len(s.output), s.num_computed) for s in seqs]
def _plan(running, waiting, budget, max_running, admit):
    # call the student's scheduler; check the plan's shape and that the inputs are unchanged
    r0, w0 = _snapshot(running), _snapshot(waiting)
    lr, lw = list(running), list(waiting)
    plan = schedule_chunked(lr, lw, budget, max_running, admit)
    expect_type(plan, "schedule_chunked(...)", list)
    for item in plan:
        expect_tuple(item, "a plan entry (seq, n_tokens)", 2)
        expect_type(item[0], "a planned sequence", Seq)
        expect_int(item[1], "a planned token count", min=1)
    assert lr == list(running) and lw == list(waiting), "schedule_chunked must not change the running and waiting lists"
    assert _snapshot(running) == r0, "schedule_chunked must not change the running sequences"
    return plan
def _simulate(arrivals, budget, max_running, n_blocks, block_size, seed):
    # arrivals: {step: [(prompt_len, max_tokens, cached_prefix)]}; admit reserves ceil(tokens/block) blocks
    rng = _random.Random(seed)
    free = [n_blocks]
    running, waiting, done, waits, held, asked = [], [], [], {}, {}, []
    def admit(s):
        asked.append(s)
        need = -(-s.num_tokens // block_size)
        assert s in waiting and s.rid not in held, "admit must be called once per sequence, on waiting sequences only"
        if need > free[0]:
            return False
        free[0] -= need
        held[s.rid] = need
        s.num_computed = min(s.cached, s.num_tokens - 1)
        return True
    step, rid = 0, 0
    while step < 5000:
        for spec in arrivals.get(step, []):
            s = Seq(f"s{rid}", [rng.randrange(50) + 1 for _ in range(spec[0])], spec[1])
            s.cached = spec[2]
            waiting.append(s); rid += 1
        if step > max(arrivals) and not running and not waiting:
            break
        asked.clear()
        decodes_before = [s for s in running if s.remaining == 1]
        prefilling_before = [s for s in running if s.remaining > 1]
        plan = _plan(running, waiting, budget, max_running, admit)
        total = sum(n for _, n in plan)
        assert total <= budget, f"step {step}: {total} tokens planned, budget {budget}"
        planned = [s for s, _ in plan]
        assert len(set(map(id, planned))) == len(planned), "a sequence appears twice in the plan"
        admitted = [s for s in planned if s in waiting]
        assert admitted == waiting[:len(admitted)], "admit waiting sequences in arrival order, nobody overtaken"
        assert all(s.rid in held for s in admitted), "plan only sequences that admit() accepted"
        assert not [s for s in waiting if s not in admitted and s.rid in held], "a sequence admit() accepted must be in the plan"
        assert len(running) + len(admitted) <= max_running, f"step {step}: more than max_running ({max_running}) sequences"
        for s in decodes_before:
            assert (s, 1) in [(p, n) for p, n in plan], f"step {step}: decode {s.rid} left out: a decode must never wait for a prefill"
        for s, n in plan:
            assert n <= s.remaining, f"{s.rid} planned {n} tokens, it has {s.remaining} left (plan after admit())"
        chunk = [n for s, n in plan if s in prefilling_before]
        new = [n for s, n in plan if s in admitted]
        left = budget - len(decodes_before)
        # work-conserving: running prefills take what they can before any newcomer
        for s in prefilling_before:
            got = dict((id(p), n) for p, n in plan).get(id(s), 0)
            want = min(s.remaining, max(0, left))
            assert got == want, (f"step {step}: running prefill {s.rid} got {got} tokens: after the decodes, running prefills, "
                              "oldest first, each get min(remaining, tokens left)")
            left -= want
        if total < budget and len(running) + len(admitted) < max_running and len(admitted) < len(waiting):
            head = waiting[len(admitted)]
            assert head in asked and head.rid not in held, \
                f"step {step}: tokens and room were left, so admit({head.rid}) must be asked (and the plan stops only if it refuses)"
        # apply the plan, as the engine does
        for s in admitted:
            waiting.remove(s); running.append(s)
        for s, n in plan:
            s.num_computed += n
            if s.num_computed == s.num_tokens:
                s.output.append(7)
                waits.setdefault(s.rid, []).append(step)
                if len(s.output) == s.max_tokens:
                    running.remove(s); free[0] += held.pop(s.rid); done.append(s)
        step += 1
    assert not running and not waiting, "the simulation never ended: a request starved"
    return done, waits
'''.strip("\n")

cells = [
md(r"""
## 7. Chunked prefill

Back to section 1's stall. Under prefill-first, a step that prefills a long prompt takes as long as
that prompt, and every running request waits for it. In your table of section 6 it hides in the ITL
p99; with long prompts in the mix it dominates what chat users feel. **Sarathi-Serve** (Agrawal et al.,
OSDI 2024) fixes it with two ideas:

- **a token budget per step**: a step computes at most `budget` tokens in all, so its duration is
  bounded, and so is every decode's wait;
- **decodes first, then prefill chunks**: every running request decodes its one token, and the rest
  of the budget goes to prompts, cut into **chunks** that continue over the following steps (the
  chunk attends to the prompt's earlier chunks, already in the cache: `forward_extend`).

```
prefill-first                                          chunked, budget 64 (2 decodes + chunks of 62)
step:     1   2   3   4------------------5   6         step:     1   2   3   4   5   6   7   8   9   10
chat A:   d   d   d   .  (waits)         d   d         chat A:   d   d   d   d   d   d   d   d   d   d
chat B:   d   d   d   .  (waits)         d   d         chat B:   d   d   d   d   d   d   d   d   d   d
doc:                  P (300 tokens)                   doc:                  62  62  62  62  52+first token
```

The decodes **piggyback** on the chunks: one forward pass, one read of the weights, serves both
(one step's fixed cost pays for both: on a GPU its kernel launches, on any device one pass over the
weights; for large models on a GPU, prefill is bound by arithmetic and decode by memory traffic, so
mixing them also fills both). The costs:
the long prompt's own TTFT grows (its prefill shares steps and is spread over several of them), each
chunk re-reads the keys and values of the chunks before it, and a step has a fixed cost, so a smaller
budget means more steps. The budget is the knob: Sarathi-Serve picks it from the SLO on the time
between tokens. vLLM's V1 engine schedules this way by default (`--max-num-batched-tokens` is the
budget), as do SGLang and TGI.

## Problem 7: A chunked-prefill scheduler (4 points)

The engine calls the policy at every step with its running and waiting sequences (`Seq`: `prompt`,
`output`, `num_computed`, and `remaining = num_tokens - num_computed`, 1 for a decode), and
`admit(seq)`, which reserves a waiting sequence's KV blocks and returns False when they do not fit
(it also sets `seq.num_computed` to the tokens found in the prefix cache). The engine then admits the
waiting sequences the plan names, runs the plan, and samples a token for every sequence whose
tokens are all computed. The released prefill-first policy is `schedule_prefill_first` (in
`course/engine/scheduler.py`, next to a `Seq`).

**Deliverable:** `schedule_chunked(running, waiting, budget, max_running, admit)` returns the plan,
a list of `(seq, n_tokens)`, and changes neither list nor any sequence (only `admit` may):
1. every running sequence with `remaining == 1` (a decode), in order, gets 1 token;
2. then every running sequence still prefilling (`remaining > 1`), in order, gets
   `min(seq.remaining, tokens left)`, while tokens are left;
3. then the waiting sequences in order, first come first served: while tokens are left and the running
   sequences plus those admitted so far are fewer than `max_running`, call `admit(seq)`. If it refuses,
   stop: nobody may overtake a request that does not fit yet (that is what guarantees no request waits
   forever). If it accepts, plan `min(seq.remaining, tokens left)` tokens (read `remaining` after
   `admit`: the prefix cache may have changed it).

The plan never holds more than `budget` tokens, and never an entry with 0 tokens. (The engine checks
`budget >= max_running`, so every decode fits.)

Graded case by case: each scenario of the tests earns its share of the 4 points, and the feedback lists the
cases that failed.
"""),
solution("chunked_scheduler", r'''
def schedule_chunked(running: list[Seq], waiting: list[Seq], budget: int, max_running: int,
                     admit: Callable[[Seq], bool]) -> list[tuple[Seq, int]]:
    """One step's plan under a token budget: decodes, then running prefills, then newcomers (FCFS)."""
    ### BEGIN SOLUTION
    plan, left = [], budget
    for seq in running:
        if seq.remaining == 1 and left > 0:
            plan.append((seq, 1))
            left -= 1
    for seq in running:
        if seq.remaining > 1 and left > 0:
            n = min(seq.remaining, left)
            plan.append((seq, n))
            left -= n
    admitted = 0
    for seq in waiting:
        if left == 0 or len(running) + admitted >= max_running or not admit(seq):
            break
        admitted += 1
        n = min(seq.remaining, left)
        plan.append((seq, n))
        left -= n
    return plan
    ### END SOLUTION
'''),
tests("chunked_scheduler_tests", 4, r"""
from course.expect import Cases
cases = Cases(points=4)        # one share of the 4 points per case: the feedback lists the cases that failed
def seq(rid, n, done=0):                           # a prompt of n tokens, `done` of them computed
    s = Seq(rid, list(range(1, n + 1)), max_tokens=8)
    s.num_computed = done
    return s
def planned(plan):
    expect_type(plan, "schedule_chunked(...)", list)
    return [(expect_type(s, "a planned sequence", Seq).rid, expect_int(n, "a token count"))
            for s, n in (expect_tuple(p, "a plan entry (seq, n)", 2) for p in plan)]
yes = lambda s: True
def decodes():                                     # two decodes (remaining 1 each)
    return seq("a", 4, 3), seq("b", 5, 4)
with cases("decodes first, then a newcomer's first chunk"):
    a, b = decodes()
    doc = seq("doc", 300)                          # a long prompt waiting
    got = planned(schedule_chunked([a, b], [doc], 64, 8, yes))
    assert got == [("a", 1), ("b", 1), ("doc", 62)], \
        f"decodes first (1 token each), then the newcomer gets min(its 300 tokens, the 62 tokens left of the budget of 64); got {got}"
    assert doc.num_computed == 0 and doc.output == [], "the scheduler never changes a sequence"
with cases("decodes first wherever they are in running"):
    a, b = decodes()
    doc = seq("doc", 300, 62)                      # the engine ran a chunk; doc runs now
    got = planned(schedule_chunked([doc, a, b], [], 64, 8, yes))
    assert got == [("a", 1), ("b", 1), ("doc", 62)], f"decodes first wherever they are in running, then the next chunk; got {got}"
with cases("a running prefill's last chunk, then a newcomer"):
    a, b = decodes()
    got = planned(schedule_chunked([a, b, seq("doc", 300, 290)], [seq("c", 100)], 64, 8, yes))
    assert got == [("a", 1), ("b", 1), ("doc", 10), ("c", 52)], f"doc needs its last 10 tokens; the newcomer takes the 52 left; got {got}"
with cases("admit refuses: nobody overtakes"):
    a, b = decodes()
    asked = []
    got = planned(schedule_chunked([a], [seq("w1", 8), seq("w2", 8)], 64, 8, lambda s: asked.append(s.rid) or False))
    assert got == [("a", 1)] and asked == ["w1"], "admit refuses w1: stop there, without asking for (or admitting) w2 behind it"
with cases("max_running caps the newcomers"):
    a, b = decodes()
    got = planned(schedule_chunked([a, b], [seq("w1", 8), seq("w2", 8)], 64, 3, yes))
    assert got == [("a", 1), ("b", 1), ("w1", 8)], f"max_running=3 with 2 running: admit one newcomer only; got {got}"
### BEGIN HIDDEN TESTS
""" + HIDDEN_SIM + r"""
# the budget holds; decodes first every step; running prefills before newcomers; FCFS admission that stops
# at the first refusal; max_running; a request admitted is planned; every request finishes (no starvation)
for seed, budget, max_running, n_blocks, bs in ((0, 16, 4, 40, 4), (1, 8, 8, 64, 2), (2, 32, 3, 30, 8), (3, 5, 5, 200, 1),
                                                (4, 64, 6, 25, 16), (5, 6, 6, 12, 4)):
    with cases(f"a simulated run: budget {budget}, max_running {max_running}, {n_blocks} blocks of {bs}"):
        rng = _random.Random(seed)
        arrivals = {}
        for i in range(14):
            arrivals.setdefault(rng.randrange(40), []).append((rng.choice([1, 2, 3, 7, 20, 45]), rng.randint(1, 9), rng.choice([0, 0, 4, 8])))
        done, waits = _simulate(arrivals, budget, max_running, n_blocks, bs, seed)
        assert len(done) == 14, f"seed {seed}: {len(done)} of 14 requests finished"
        for s in done:
            # after its first token, a decode is served at every step until it finishes: one token per step
            steps = waits[s.rid]
            assert steps == list(range(steps[0], steps[0] + len(steps))), \
                f"seed {seed}: request {s.rid} got tokens at steps {steps}: a decode must get a token at every step"
with cases("a prefix-cache hit: plan what is left after admit"):
    s, = _seqs([(50, 4)])
    def _hit(seq):
        seq.num_computed = 48
        return True
    plan = _plan([], [s], 100, 4, _hit)
    assert [(p.rid, n) for p, n in plan] == [("r0", 2)], "read remaining after admit(): 48 tokens came from the cache, 2 are left"
with cases("no token left: admit is not called"):
    calls = []
    plan = _plan(_seqs([(3, 5, 2)] * 4), _seqs([(9, 2)]), 4, 8, lambda q: calls.append(q) or True)
    assert [n for _, n in plan] == [1, 1, 1, 1] and calls == [], "all 4 tokens went to decodes: admit must not be called"
with cases("max_running reached: admit is not called"):
    calls = []
    plan = _plan(_seqs([(3, 5, 2)] * 2), _seqs([(9, 2)]), 50, 2, lambda q: calls.append(q) or True)
    assert [n for _, n in plan] == [1, 1] and calls == [], "max_running reached: admit must not be called"
with cases("several running prefills: oldest first"):
    p1, p2, p3 = _seqs([(30, 2, 10), (30, 2, 25), (30, 2, 0)])
    plan = _plan([p1, p2, p3], [], 25, 8, lambda q: True)
    assert [(p.rid, n) for p, n in plan] == [("r0", 20), ("r1", 5)], \
        ("three prefills of 30 tokens with 10, 25 and 0 computed, a budget of 25: in order, each takes min(remaining, "
         f"tokens left), 20 for r0, then the last 5 for r1; got {[(p.rid, n) for p, n in plan]}")
with cases("a decode after a prefill in running is served first"):
    p, d = _seqs([(40, 2, 0), (4, 2, 3)])
    plan = _plan([p, d], [], 10, 8, lambda q: True)
    assert (d, 1) in plan and dict((q.rid, n) for q, n in plan) == {"r1": 1, "r0": 9}, "decodes first, wherever they are in running"
with cases("nothing to do: an empty plan"):
    assert _plan([], [], 10, 4, lambda q: True) == [], "nothing to do: an empty plan"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
### See it: the two policies on a batch timeline

A mixed load, measured through your server: a few chat requests (short prompts, long answers) start
together, and long documents arrive while they decode. The same requests run through two fresh
servers: prefill-first, and your `schedule_chunked` with a token budget. The document arrival times are
set from a decode step measured just before (`decode_ms`), so that they land while the chats decode,
on any machine. Each server's engine records its steps for the timeline.
"""),
code(r'''
decode_ms = decode_step_ms()                                          # measured again, just before the runs
n_chat, chat_out = env.pick((6, 96), (4, 24), cpu=(4, 64))
n_doc, doc_len = env.pick((3, 4096), (2, 256), cpu=(3, 768))
BUDGET = env.pick(512, 64, cpu=128)
repeats = env.pick(3, 1, cpu=3)
chat_reqs = [(random_ids(24, seed=100 + i), chat_out) for i in range(n_chat)]
doc_reqs = [(random_ids(doc_len, seed=200 + i), 4) for i in range(n_doc)]
mixed = chat_reqs + doc_reqs
# the chats start together; document i arrives about 8 + 10 i decode steps later, while the chats decode
mixed_arrivals = [0.002 * i for i in range(n_chat)] + [decode_ms / 1e3 * (8 + 10 * i) for i in range(n_doc)]
MIXED_SLO = {"ttft": round(20 * decode_ms), "tpot": round(4 * decode_ms)}

async def mixed_run(policy, budget):
    """One run of the mixed load through a fresh server: (summary, records, duration, trace, step times)."""
    with serve(policy, budget=budget, max_running=n_chat + n_doc) as server:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as client:
            send = lambda req: send_completion(client, server.url, MODEL_NAME, req[0], req[1])
            await send((random_ids(32, seed=7), 2))                        # warm-up: one request alone
            server.core.record_trace()
            records, duration = await run_load(send, mixed, mixed_arrivals)
        trace, times = server.core.trace, server.core.step_times
    return summarize(records, duration, MIXED_SLO), records, duration, trace, times

policies = {"prefill-first": ("prefill_first", 1 << 20), f"chunked ({BUDGET} tokens/step)": (schedule_chunked, BUDGET)}
runs = {name: [] for name in policies}
for rep in range(repeats):
    for name, (policy, budget) in policies.items():                    # alternate, so drifts hit both alike
        runs[name].append(await asyncio.wait_for(mixed_run(policy, budget), 900))
print(f"{n_chat} chats ({chat_out} tokens each) + {n_doc} documents of {doc_len} tokens; {repeats} run(s) per policy; "
      f"{env.device}, {str(env.dtype).removeprefix('torch.')}")
'''),
code(r'''
from course.widgets import batch_timeline

labels = {f"req-{i + 1}": i for i in range(len(mixed))}      # req-0 was the warm-up
def relabel(trace):
    return [{labels[rid]: st for rid, st in step.items() if rid in labels} for step in trace]
last = {name: r[-1] for name, r in runs.items()}
print(f"rows 0-{n_chat - 1}: chat requests; rows {n_chat}-{n_chat + n_doc - 1}: documents")
batch_timeline({name: relabel(r[3]) for name, r in last.items()}, times={name: r[4] for name, r in last.items()},
               title=f"{n_chat} chats and {n_doc} long prompts: prefill-first vs chunked")
'''),
md(r"""
In the prefill-first grid, each document's arrival is one dark blue cell (its whole prompt in one
step), and in that column every chat row is orange: they got no token. Hover over the cells, or read
the times at the right. In the chunked grid the documents' prompts are light blue **chunks** spread
over several steps, and the chat rows stay green: they decode at every step. Count the steps too: the
chunked schedule needs no step of its own for a document, since its chunks ride along with the
decodes. On a CPU a step that carries a chunk is longer than a plain decode step, but far shorter than
a whole prefill; on a GPU with eager steps they are closer together, but a long prefill still costs
several decode steps: the times at the right say how many (the end of the next section says why they
are closer).

### Measure: the tail of the inter-token latency, and what it costs

The median over the runs of each policy: inter-token latency (p50, p99 and the worst gap), TTFT of
the chats and of the documents, throughput, and goodput under the SLO printed below (TTFT and TPOT).
"""),
code(r'''
def median_of(rs, f):
    return float(np.median([f(r) for r in rs]))

def chat_docs(records, f):
    return f(records[:n_chat]), f(records[n_chat:])

table = {}
for name, rs in runs.items():
    table[name] = {
        "ITL p50": median_of(rs, lambda r: r[0]["itl_ms"]["p50"]),
        "ITL p99": median_of(rs, lambda r: r[0]["itl_ms"]["p99"]),
        "ITL max": median_of(rs, lambda r: 1e3 * max(g for rec in r[1] for g in rec.itl)),
        "TTFT chat": median_of(rs, lambda r: 1e3 * np.median([rec.ttft for rec in r[1][:n_chat]])),
        "TTFT doc": median_of(rs, lambda r: 1e3 * np.median([rec.ttft for rec in r[1][n_chat:]])),
        "tok/s": median_of(rs, lambda r: r[0]["output_throughput"]),
        "goodput": median_of(rs, lambda r: r[0]["goodput"]),
        "steps": median_of(rs, lambda r: len(r[3])),
    }
cols = list(next(iter(table.values())))
print(f"SLO: TTFT <= {MIXED_SLO['ttft']:.0f} ms, TPOT <= {MIXED_SLO['tpot']:.0f} ms (times in ms, rates per second)")
print(f"{'':32}" + "".join(f"{c:>11}" for c in cols))
for name, row in table.items():
    print(f"{name:32}" + "".join(f"{row[c]:11.1f}" for c in cols))
pf, ch = table.values()
print(f"\nchunked / prefill-first: ITL p99 x{ch['ITL p99'] / pf['ITL p99']:.2f}, "
      f"ITL max x{ch['ITL max'] / pf['ITL max']:.2f}, throughput x{ch['tok/s'] / pf['tok/s']:.2f}, "
      f"document TTFT x{ch['TTFT doc'] / pf['TTFT doc']:.2f}")
steps_ms = [1e3 * np.diff(r[4]) for r in runs["prefill-first"]]    # step times from the step end times
longest, typical = np.median([s.max() for s in steps_ms]), np.median([np.median(s) for s in steps_ms])
print(f"prefill-first steps: median {typical:.0f} ms, longest {longest:.0f} ms (a whole document's prefill, "
      f"{longest / typical:.1f} median steps).\nA step with a chunk costs more than a plain decode, so chunking "
      f"can cut the ITL tail to about x{typical / longest:.2f} of prefill-first's at best")
'''),
md(r"""
Read your numbers; the effect is what the picture predicted. Under prefill-first, every document
prefill stretches one gap of every chat: the step that prefills it, plus the decode step that then
delivers the chat's token. With a few dozen gaps per chat, those few long ones **are** the p99 (and
the max). Under chunked prefill the longest gap is one step of at most `BUDGET` tokens, so the p99
drops by about the ratio of a document's prefill to one chunked step. In full mode the median moves
little: most steps are plain decodes under both policies. (Quick mode's run is short and chunks ride
in a large share of its steps, so its median moves more.)
Throughput stays close, and may even grow: the same tokens are computed, and the chunks'
steps also carry the decodes, so the documents' prompts cost no steps of their own in which the
chats wait. The price is paid by the documents: their TTFT grows, since their prompt now shares its
steps with the decodes and spreads over several of them (look at "TTFT doc"). Goodput moves with
whichever SLO binds: a TPOT SLO (a mean over the request) barely sees the stalls that ITL p99 shows,
which is why Sarathi-Serve states its SLO on the time between tokens.

On a GPU the ratio depends on the step's fixed cost. This model is small enough that an eager step
is **launch-bound**: its time is set by the kernels it launches, not by the tokens it computes (lab 02
showed you the count and the cost of one launch on your device). So a prefill of a few hundred tokens
costs about as much as a decode step, and there is little stall to remove; the full-size GPU run uses
4k-token documents for that reason. Once decode steps run as CUDA graphs (lab 02's replay, several
times faster) while mixed steps stay eager, the stall comes back, and so does chunked prefill's
benefit; with larger models (7B and up) prefill is compute-bound, and Sarathi-Serve reports 2.6x
more serving capacity under a time-between-tokens SLO (Mistral-7B, one A100). Your numbers say which
regime your device is in.

## Summary

- A server runs an **engine loop** that owns the engine and runs each step in a worker thread, while
  an event loop serves connections; requests and cancellations are notes applied between steps.
  Each request reads its own **stream**; a client that leaves aborts its request and frees its KV
  blocks; a **bounded queue** answers 429 instead of letting every request time out.
- Text comes out of a stream of tokens through **incremental detokenization** (never send half a
  character) with **stop strings** held back until they cannot match; **SSE** frames each chunk as
  `data: <json>` and ends with `data: [DONE]`.
- An OpenAI-compatible API checks every request and answers mistakes with a **4xx** and an error
  body; `/metrics` exposes the engine's state to Prometheus.
- A **load generator** sends requests at gamma-distributed (Poisson when burstiness is 1) arrival
  times from concurrent streaming clients; **TTFT, TPOT, ITL, E2EL** percentiles, **throughput** and
  **goodput** under an SLO are how serving systems are compared (vLLM's `bench serve`).
- **Chunked prefill** gives each step a token budget, decodes first: where a long prefill costs many
  steps (a CPU; a large model, or CUDA-graph decodes, on a GPU), the tail of the inter-token latency
  shrinks by about the ratio of a long prefill to one budgeted step, for a small cost in throughput
  and a larger TTFT for the long prompts.

**Questions**. Answer in the cell under each group, in a few sentences of your own and with **your**
numbers where a question asks for them; a person grades them (5 points in all).
1. The engine loop runs `core.step()` in a worker thread but applies new requests and aborts on the
   event loop, between steps. What could go wrong if `abort` called `core.abort` directly while a step
   runs? Describe one interleaving.
2. Why must `TextStream` hold back a tail that could start a stop string, instead of sending it and
   "taking it back" later? What would a client see?
"""),
answer("threads_stop_answer", 1, "questions 1 and 2", model=r"""
1. `core.step()` runs in another thread and reads and changes the core's state (the running list, the
   block tables, the pool) across a forward pass that takes milliseconds. A direct `core.abort` from
   the event loop changes the same state in the middle of it. One interleaving: the step builds its
   batch with request R (its slots and block table); the client hangs up and `core.abort(R)` removes R
   from `running` and returns its blocks to the pool; the step goes on, writes R's new keys and values
   into those freed blocks, samples R's token and then finds R gone (a `KeyError`, or a `ValueError`
   from `list.remove`), or frees R's blocks a second time, putting a block in the free list twice, so
   that two later requests share it and overwrite each other's cache. Another: the abort removes an
   item while the step iterates over `running`, which skips a request or raises. Such bugs show once
   in thousands of requests. Applying aborts on the loop, between steps, makes them impossible.
2. A stream only goes forward: once text is sent over SSE, the client has shown it (or handed it to
   its program), and the OpenAI protocol has no way to retract it. If the stream sent `" Use"` and the
   next token completed `"User:"`, the client would already show `"... Use"`, text the request said it
   must never see (part of the stop string), and an end where the answer looks cut off; a "take it
   back" message would be ignored or misread by every existing client. Holding back only the tail that
   could still become a stop string delays a few characters and never sends anything wrong.
""", rubric=r"""
- 0.5: question 1: a concrete interleaving in which the step and abort touch the same state (freed
  blocks still written, a double free, a list changed during iteration, a missing key), and its effect.
- 0.5: question 2: sent text cannot be recalled (append-only stream, no retraction in the protocol);
  the client would show part of the stop string.
"""),
md(r"""
3. A server without `max_waiting` accepts every request. Under an arrival rate above its capacity,
   what happens to TTFT over time? Why is a fast 429 better for the client, and for the other clients?
4. TPOT and ITL are both "time between tokens". Construct a request for which TPOT is small but the
   ITL p99 of the run is huge. Which one should an SLO for a chat product use?
"""),
answer("overload_itl_answer", 1, "questions 3 and 4", model=r"""
3. Above capacity requests arrive faster than they finish, so the queue grows without bound, linearly
   with time, and each new request's TTFT (its wait plus its prefill) grows with it: soon past every
   client's timeout. The server then spends its steps on requests whose clients have given up, goodput
   falls toward 0 and memory grows. A fast 429 costs the server nothing and tells the client at once
   to retry later (with backoff) or go to another replica, which a load balancer can do for it; and it
   keeps the queue bounded, so the requests already admitted keep the latency of a server at capacity
   instead of everyone waiting longer and longer.
4. A request of 101 tokens whose 100 gaps are 99 gaps of 10 ms and one of 2 s (the step that prefilled
   someone else's long document): TPOT = `(99 x 10 + 2,000) / 100` = about 30 ms, a fine average, while
   that 2-second gap is among the run's ITL values, and if many requests each meet one such stall in
   about 100 gaps, the ITL p99 is about 2 s. (With 1,000 tokens the TPOT is 12 ms.) A chat user sees the
   text freeze for 2 seconds: a chat product's SLO should bound the time between tokens, the ITL's tail
   (p99, or every gap, as Sarathi-Serve's TBT does), together with TTFT; TPOT averages the stall away.
""", rubric=r"""
- 0.5: question 3: TTFT grows without bound (linearly) as the queue grows; the 429 lets the client act
  at once and protects the admitted requests' latency.
- 0.5: question 4: a concrete request with many short gaps and one long stall (numbers that work), and
  ITL (its tail) as the chat SLO, with why TPOT hides it.
"""),
md(r"""
5. In your Poisson measurement, where is the knee of the curve? What sets the capacity of this
   server: the step time, `max_running`, or the KV cache?
6. How does the ITL p99 of chunked prefill depend on the budget? What would a budget of 1 token
   (per decode) do, and a budget larger than any prompt?
"""),
answer("capacity_budget_answer", 2, "questions 5 and 6", model=r"""
5. (From the student's table.) At half the rough capacity the throughput follows the offered rate and
   TTFT is about one prefill; at about the estimated capacity (1x) and above, throughput stops
   following the rate, TTFT grows with the queue and goodput falls below throughput: the knee is near
   the 1x rate (between 1x and 2x in most runs). The capacity is set by **`max_running` and the step
   time**: at most 8 requests decode per step (the estimate itself is 8 requests over the time of
   their answers, at about 1.5 times the step of 4 requests), so the server finishes at most
   `max_running / (output_len x step time)` requests per second; the step time grows slowly with the
   batch and the newcomers' prefills. The KV cache is not the limit here: SmolLM2 takes 23 KB per
   token and 8 requests of a few hundred tokens fill a small part of the pool (no preemptions, low
   `kv_cache_usage` in `/metrics`). With a larger `max_running`, longer requests or a bigger model, the
   cache would become the limit.
6. The longest gap under chunked prefill is one step of at most `budget` tokens, so the ITL p99 grows
   with the budget (about a fixed cost plus the budget's tokens' worth of compute): a smaller budget
   gives a smaller tail, and more steps per prompt. A budget of 1 token per decode (equal to the number
   of running requests, the smallest the engine allows) leaves no token for prefills while every slot
   decodes: newcomers advance only as tokens free up, a few tokens per step, so their TTFT becomes
   enormous (and the per-step fixed cost is paid for almost nothing), while the running requests'
   gaps are as small as they can be. A budget larger than any prompt never splits a prompt: each
   prefill runs whole in one step, as in prefill-first (the decodes still ride in that step, so the
   stall is one long step instead of two), and the ITL p99 is back to the length of a long prefill.
""", rubric=r"""
- 1: question 5: the knee located with the student's own rates and numbers (where throughput stops
  following the rate, TTFT and goodput degrade), and the limit argued from their run: max_running and
  step time (KV cache not binding at these sizes, with evidence such as no preemption or low usage).
- 1: question 6: ITL p99 grows with the budget (one step of at most budget tokens); the two extremes:
  tiny budget starves prefills (huge TTFT, low throughput), huge budget is prefill-first again.
"""),
md(r"""
7. Goodput depends on the SLO. Find an SLO under which chunked prefill has the higher goodput, and
   one under which prefill-first does. What does this tell you about reporting one number?
8. The decodes "piggyback" on prefill chunks. Why is a step holding a chunk and 8 decodes cheaper
   than a chunk step plus a separate decode step? (Think about what a decode step reads, lab 02.)
"""),
answer("goodput_piggyback_answer", 1, "questions 7 and 8", model=r"""
7. Chunked prefill wins under an SLO on the time between tokens: for example a TPOT (or ITL) bound of
   about two decode steps with a loose TTFT: under prefill-first the chats whose gaps hold a document's
   whole prefill miss it. Prefill-first wins under a tight TTFT bound with a loose TPOT: for example
   TTFT of about one whole prefill of a document: chunking spreads the documents' prompts over several
   shared steps, so their TTFT grows past it while prefill-first meets it. (The student gives SLOs in
   the numbers of their own run.) One goodput number says as much about the SLO as about the server:
   reporting it means stating the SLO, and better, the percentiles of each metric and per kind of
   request (chats, documents), or goodput over a range of SLOs.
8. A decode step reads every weight of the model (and, on a GPU, launches every kernel) to compute one
   token per sequence: its cost is that fixed read, not the tokens' arithmetic (memory-bound, lab 02).
   A chunk step pays the same read once for its chunk. Putting the 8 decodes in the chunk's step adds
   8 tokens of arithmetic and their KV reads to a pass that reads the weights anyway: almost free. Run
   separately, the decode step pays the whole weight read (and launches) a second time. For large
   models on a GPU the mix also fills both limits at once: the chunk's arithmetic uses the compute that
   memory-bound decodes leave idle.
""", rubric=r"""
- 0.5: question 7: one SLO that favours each policy (TBT/TPOT-bound for chunked, TTFT-bound for
  prefill-first), and the lesson: a goodput number needs its SLO and the distributions behind it.
- 0.5: question 8: the weight read (or launches) is the step's fixed cost; a combined step pays it once.
"""),
md(r"""

## Going further

- **vLLM**: the V1 engine (`vllm/v1/engine/`: an engine core in its own process, fed over ZeroMQ
  by the API server, so Python's lock never stalls the HTTP side), its scheduler (chunked prefill on
  by default, `--max-num-batched-tokens`), the OpenAI-compatible server (FastAPI, `vllm serve`), and
  `vllm bench serve` with `--request-rate`, `--burstiness`, `--max-concurrency`, `--goodput`.
- **Sarathi-Serve** (Agrawal et al., OSDI 2024, "Taming Throughput-Latency Tradeoff in LLM Inference
  with Sarathi-Serve"): chunked prefills, stall-free batching, and the token budget from the TBT SLO.
- **DistServe** (Zhong et al., OSDI 2024) defines goodput and goes further than chunking: prefill and
  decode on **different GPUs** (disaggregation, lab 12), each sized for its own SLO; **Splitwise** and
  **Mooncake** do it in production.
- **SGLang** (its router and scheduler: cache-aware scheduling, chunked prefill, overlap of CPU
  scheduling with GPU work), **TGI** (a Rust router in front of Python shards), **nano-vllm**
  (`llm_engine.py`: the whole loop in a page).
- Load-balancing many replicas (the prefix-cache-aware routing of SGLang's router, llm-d and the
  Gateway API inference extension), and autoscaling on `/metrics` (KEDA, Prometheus adapters).
- **Structured outputs** (JSON schema, grammar-constrained sampling: XGrammar, Outlines), tool calls,
  and `n > 1` (parallel sampling: the forked blocks of lab 05) complete the OpenAI API.
"""),
]
