"""Lab 12, section 5: pipeline parallelism (problem 4). Assembled by lab12.py."""
from autograder.authoring import code, md, solution, tests

CELLS = [
md(r"""
## 5. Pipeline parallelism: split the stack

The other way to cut the model: give each rank a contiguous run of layers, a **stage**. Stage 0 embeds
the tokens and runs its layers, sends the activation (B, T, C) to stage 1, and so on; the last stage
applies the output head. Only one activation crosses each stage boundary per batch, instead of two
all-reduces per layer: pipeline parallelism is what spans machines.

The catch is waiting. With one batch, stage 1 idles while stage 0 works, and stage 0 idles after.
Cut the batch into m **micro-batches**: while stage 1 works on micro-batch 0, stage 0 already computes
micro-batch 1 (GPipe, Huang et al. 2019). Stage s works on micro-batch j at tick s + j:

```
tick:      0    1    2    3    4    5                 p = 3 stages, m = 4 micro-batches
stage 0:  [0]  [1]  [2]  [3]   .    .                 m + p - 1 = 6 ticks
stage 1:   .   [0]  [1]  [2]  [3]   .                 each stage busy m = 4 of them
stage 2:   .    .   [0]  [1]  [2]  [3]                idle slots ("the bubble"): p - 1 per stage
```

If every stage takes the same time per micro-batch, the share of stage-time spent idle is

    bubble = (p - 1) / (m + p - 1)

One micro-batch (m = 1) wastes (p - 1)/p of the machine; many micro-batches shrink the bubble. Inference
has no backward pass, so this forward-only schedule is the whole story; a server keeps the pipeline
full with the decode steps of different batches of requests (vLLM runs one batch per stage in flight).
Note what pipelining does **not** do: a request still passes through every layer one after the other,
plus a hop between stages. It buys memory (each rank holds 1/p of the layers) and throughput, not latency.

## Problem 4: A pipeline stage (3 points)

**Deliverable:**
- `pipeline_stage(comm, compute, inputs, shape, dtype=torch.float32)`: the loop of stage `comm.rank` of
  `comm.world_size` over the `len(inputs)` micro-batches, in order. For micro-batch j: stage 0 takes
  `inputs[j]`, every other stage receives its input from the stage before (a new tensor of `shape` and
  `dtype`, on the device of `inputs[j]`); then `y = compute(j, x)`; every stage but the last sends `y`
  to the next stage (start the send with `isend` and wait for all sends at the end, so a stage never
  waits for the next one to be ready), the last stage keeps it. Record `(j, start, end)` around each `compute` call with
  `time.perf_counter()`. Returns `(outputs, timeline)`: the last stage's results in order (an empty
  list on other stages) and the timeline.
- `bubble_fraction(p, m)`: (p - 1)/(m + p - 1) as a float; `ValueError` if p or m is below 1.
- `measured_bubble(timelines)`: from each stage's timeline (a list of them, stage 0 first), the share
  of stage-time spent idle between the first start and the last end of any stage:
  1 - (busy time of all stages) / (p × (last end - first start)).

Graded case by case: each check of the tests earns its share of the 3 points, and the feedback lists the
cases that failed.
"""),
solution("pipeline_stage", r'''
def pipeline_stage(comm, compute, inputs: list, shape: tuple, dtype=torch.float32) -> tuple[list, list]:
    """Stage comm.rank of a GPipe forward over len(inputs) micro-batches: (outputs, timeline)."""
    ### BEGIN SOLUTION
    s, p = comm.rank, comm.world_size
    outputs, timeline, sends = [], [], []
    for j in range(len(inputs)):
        if s == 0:
            x = inputs[j]
        else:
            x = torch.empty(shape, dtype=dtype, device=inputs[j].device)
            comm.recv(x, s - 1)                                           # from the stage before
        start = time.perf_counter()
        y = compute(j, x)
        timeline.append((j, start, time.perf_counter()))
        if s < p - 1:
            sends.append(comm.isend(y.contiguous(), s + 1))               # on to the next stage, no waiting
        else:
            outputs.append(y)
    for work in sends:
        work.wait()
    return outputs, timeline
    ### END SOLUTION


def bubble_fraction(p: int, m: int) -> float:
    """Idle share of a GPipe forward of m equal micro-batches through p equal stages."""
    ### BEGIN SOLUTION
    if p < 1 or m < 1:
        raise ValueError(f"p (stages) and m (micro-batches) must be >= 1, got p={p}, m={m}")
    return (p - 1) / (m + p - 1)
    ### END SOLUTION


def measured_bubble(timelines: list[list[tuple[int, float, float]]]) -> float:
    """1 - busy / (p x span), span from the first start to the last end over all stages."""
    ### BEGIN SOLUTION
    first = min(start for tl in timelines for _, start, _ in tl)
    last = max(end for tl in timelines for _, _, end in tl)
    busy = sum(end - start for tl in timelines for _, start, end in tl)
    return 1 - busy / (len(timelines) * (last - first))
    ### END SOLUTION
'''),
md(r"""
Run the default model as a pipeline of 2 stages (15 layers each, one process each) over a batch of
sequences cut into m micro-batches. The last stage's logits must match the whole model's. Then
compare the bubble you measure with the formula, and draw your timeline.
"""),
code(r'''
P = 2
PP_B, PP_T = env.pick((8, 64), (4, 16), cpu=(8, 32))
MICRO = env.pick([1, 2, 4, 8], [1, 4])
pp_ids = torch.randint(100, cfg.vocab_size, (PP_B, PP_T), generator=torch.Generator().manual_seed(0), device="cpu")
print([Stage(cpu_model, s, P) for s in range(P)])


def pp_rank(comm, model, ids, m):
    stage = Stage(model, comm.rank, comm.world_size)
    micro = list(ids.chunk(m))                                     # m micro-batches of B / m sequences
    b, t = micro[0].shape
    pos = torch.arange(t, device="cpu")[None].expand(b, t)
    act = torch.randn(b, t, model.cfg.d_model, device="cpu")       # any activation of the right shape
    stage(micro[0] if stage.first else act, pos)                   # warm-up, as in whole_rank: a fresh process starts slow
    comm.barrier()                                                 # then all stages start together
    return pipeline_stage(comm, lambda j, x: stage(x, pos), micro, (b, t, model.cfg.d_model))


def whole_rank(comm, model, ids, repeats):
    whole = Stage(model, 0, 1)                                     # every layer, the head on the last position: the same work
    pos = torch.arange(ids.shape[1], device="cpu")[None].expand(ids.shape)
    logits = whole(ids, pos)                                       # (also the warm-up)
    return logits, benchmark(lambda: whole(ids, pos), warmup=0, repeats=repeats, device="cpu").median


pp_want, t_whole = launch(whole_rank, 1, cpu_model, pp_ids, env.pick(3, 1), timeout=LAUNCH_S)[0]
pp_runs = {}
print(f"\nbatch of {PP_B} x {PP_T} tokens; the whole model in one process (one stage of every layer: the same work): {t_whole:.2f} s")
print(f"{'m':>3} {'bubble (measured)':>18} {'(p-1)/(m+p-1)':>14} {'first start to last end':>24} {'max |logit diff|':>17}")
for m in MICRO:
    res = launch(pp_rank, P, cpu_model, pp_ids, m, timeout=LAUNCH_S)
    timelines = [tl for _, tl in res]
    out = torch.cat(res[-1][0])                                     # the last stage's outputs, in order
    span = max(e for tl in timelines for _, _, e in tl) - min(s for tl in timelines for _, s, _ in tl)
    pp_runs[m] = timelines
    print(f"{m:>3} {measured_bubble(timelines):>18.3f} {bubble_fraction(P, m):>14.3f} {span:>22.2f} s "
          f"{(out - pp_want).abs().max().item():>17.1e}")
plot_pipeline(pp_runs[MICRO[-1]], title=f"your pipeline: {P} stages, {MICRO[-1]} micro-batches (processes, real layers)")
plt.show()
'''),
md(r"""
Two real stages on two cores: the measured bubble should sit close to 1/(m + 1). Where it is off,
look at the timeline: a stage waiting for a message, or the two stages not equally fast (their layers
are equal, but stage 0 also embeds and stage 1 runs the output head; and on a busy machine a stage
that loses its core for a while stretches its bars). The span is the time the batch
took: does it beat the whole model in one process, and by how much? Smaller micro-batches also make
smaller, less efficient matmuls: the formula counts ticks, not how long a tick is.

Four real stages would need four free cores. To see the schedule with p = 4 on any machine, let
each stage's `compute` **sleep** for a fixed time instead of running layers: the processes, messages
and your loop are real; only the work is a stand-in. On a busy machine a sleep can overrun by a few
milliseconds; the bars show where.
"""),
code(r'''
def sleepy_rank(comm, m, seconds, shape):
    micro = [torch.zeros(shape, device="cpu") for _ in range(m)]
    return pipeline_stage(comm, lambda j, x: (time.sleep(seconds), x)[1], micro, shape)[1]


P4, NAP = 4, 0.05                                             # 50 ms: long next to a message or a late wake-up
sleep_m = env.pick([1, 2, 4, 8, 16], [1, 4])
sleep_bubble = {}
for m in sleep_m:
    sleep_bubble[m] = launch(sleepy_rank, P4, m, NAP, (4, 64), timeout=LAUNCH_S)
    print(f"p = {P4}, m = {m:>2}: measured bubble {measured_bubble(sleep_bubble[m]):.3f}, formula {bubble_fraction(P4, m):.3f}")
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.2), gridspec_kw={"width_ratios": [1, 2]})
ms = range(1, max(sleep_m) + 1)
ax1.plot(ms, [bubble_fraction(P4, m) for m in ms], "-", label=f"(p-1)/(m+p-1), p={P4}")
ax1.plot(sleep_m, [measured_bubble(sleep_bubble[m]) for m in sleep_m], "o", label=f"measured, p={P4} (sleeps)")
ax1.plot(ms, [bubble_fraction(P, m) for m in ms], "-", label=f"(p-1)/(m+p-1), p={P}")
ax1.plot(MICRO, [measured_bubble(pp_runs[m]) for m in MICRO], "s", label=f"measured, p={P} (layers)")
ax1.set_xlabel("micro-batches m"); ax1.set_ylabel("bubble"); ax1.legend(fontsize=7)
plot_pipeline(sleep_bubble[sleep_m[-1]], ax=ax2, title=f"{P4} stages, {sleep_m[-1]} micro-batches (sleeps)")
plt.tight_layout(); plt.show()
'''),
tests("pipeline_stage_tests", 3, r"""
from course.expect import Cases
cases = Cases(points=3)        # one share of the 3 points per case: the feedback lists the cases that failed
def _timeline(tl, m, what="timeline"):
    tl = expect_type(tl, what, list)
    assert len(tl) == m, f"the {what} holds one (j, start, end) per micro-batch, {m} here, got {len(tl)}"
    out = []
    for i, e in enumerate(tl):
        j, a, b = expect_tuple(e, f"{what}[{i}]", 3)
        out.append((expect_int(j, f"{what}[{i}][0]"), expect_float(a, f"{what}[{i}][1]"), expect_float(b, f"{what}[{i}][2]")))
    return out
with cases("bubble_fraction: (p - 1) / (m + p - 1)"):
    assert expect_float(bubble_fraction(4, 4), "bubble_fraction(4, 4)") == 3 / 7, "(p - 1) / (m + p - 1) = 3/7"
    assert expect_float(bubble_fraction(1, 5), "bubble_fraction(1, 5)") == 0, "one stage never waits"
with cases("measured_bubble of an ideal GPipe timeline"):
    perfect = [[(0, 0.0, 1.0), (1, 1.0, 2.0)], [(0, 1.0, 2.0), (1, 2.0, 3.0)]]     # p = 2, m = 2, ideal GPipe
    assert abs(expect_float(measured_bubble(perfect), "measured_bubble(...)") - 1 / 3) < 1e-12, \
        "2 stages x 3 ticks, 4 busy: 1 - 4 / (2 x 3) = 1/3: every stage's time counts, 1 - busy / (p x (last end - first start))"
def _pipe(comm, m):
    inputs = [torch.full((2, 3), float(j), device=env.device) for j in range(m)]
    seen = []
    def compute(j, x):
        seen.append((j, x.clone()))
        return x * 2 + comm.rank + 1
    out, tl = expect_tuple(pipeline_stage(comm, compute, inputs, (2, 3)), "pipeline_stage(...)", 2)
    return out, tl, seen, list(comm.stats.log)
with cases("pipeline_stage: the last stage's outputs"):
    out = run_threads(_pipe, 3, 4)[2][0]
    out = [expect_tensor(o, "the last stage's outputs[j]", shape=(2, 3), device=env.device) for o in expect_type(out, "outputs", list)]
    assert len(out) == 4, f"the last stage returns one output per micro-batch, 4 here, got {len(out)}"
    for j, o in enumerate(out):
        want = ((j * 2 + 1) * 2 + 2) * 2 + 3
        assert torch.equal(o, torch.full((2, 3), float(want), device=env.device)), \
            f"micro-batch {j} must go through stage 0, 1, 2 in turn: expected {want}, got {o[0, 0].item()}"
with cases("pipeline_stage: what each stage receives and sends"):
    res = run_threads(_pipe, 3, 4)
    assert expect_type(res[0][0], "outputs of stage 0", list) == [] and [e[0] for e in res[0][3]] == ["send"] * 4, \
        "stage 0 receives nothing and sends each of its 4 results on; only the last stage returns outputs"
    assert [e[0] for e in res[1][3]] == ["recv", "send"] * 4, "a middle stage receives, computes, sends, per micro-batch"
with cases("pipeline_stage: the timeline"):
    tl = _timeline(run_threads(_pipe, 3, 4)[2][1], 4)
    assert [j for j, *_ in tl] == [0, 1, 2, 3] and all(a <= b for _, a, b in tl), "one (j, start, end) per compute call, in order"
### BEGIN HIDDEN TESTS
with cases("bubble_fraction of more shapes"):
    for p, m in ((1, 1), (1, 3), (2, 1), (3, 7), (8, 8), (4, 100)):
        assert abs(expect_float(bubble_fraction(p, m), "bubble_fraction") - (p - 1) / (m + p - 1)) < 1e-12, \
            f"bubble_fraction({p}, {m}) must be (p - 1) / (m + p - 1)"
with cases("bubble_fraction below one stage or micro-batch: ValueError"):
    for p, m in ((0, 3), (3, 0), (2, -1)):
        try:
            bubble_fraction(p, m)
        except ValueError:
            pass
        else:
            raise AssertionError(f"bubble_fraction({p}, {m}): raise ValueError for p or m below 1")
import random as _random
with cases("measured_bubble of random timelines"):
    rng = _random.Random(3)
    for _ in range(5):   # measured_bubble on random timelines against the definition
        p = rng.randint(1, 5)
        tls = [[(j, s0, s0 + rng.random()) for j, s0 in enumerate(sorted(rng.uniform(0, 10) for _ in range(rng.randint(1, 4))))]
               for _ in range(p)]
        first = min(a for tl_ in tls for _, a, _ in tl_)
        last = max(b for tl_ in tls for _, _, b in tl_)
        want = 1 - sum(b - a for tl_ in tls for _, a, b in tl_) / (p * (last - first))
        assert abs(expect_float(measured_bubble(tls), "measured_bubble") - want) < 1e-9, "1 - busy / (p x (last end - first start))"
def _pipe2(comm, m, shape, dtype):
    g = torch.Generator().manual_seed(17)
    inputs = [torch.randn(shape, generator=g, dtype=dtype).to(env.device) for _ in range(m)]
    got = []
    def compute(j, x):
        got.append((j, x.clone()))
        return torch.sin(x) * (comm.rank + 2) + j
    out, tl = expect_tuple(pipeline_stage(comm, compute, inputs, shape, dtype), "pipeline_stage(...)", 2)
    return out, tl, got, inputs, comm.stats.sends, comm.stats.recvs
for p, m, shape, dtype in ((2, 1, (3,), torch.float32), (4, 5, (2, 2, 2), torch.float64), (1, 3, (4,), torch.float32),
                           (3, 2, (1, 5), torch.float32), (5, 3, (2,), torch.float64)):
    with cases(f"{p} stages, {m} micro-batches of shape {shape}, {dtype}"):
        res = run_threads(_pipe2, p, m, shape, dtype)
        inputs = res[0][3]
        for s, (out, tl, got, _, sends, recvs) in enumerate(res):
            assert sends == (m if s < p - 1 else 0) and recvs == (m if s > 0 else 0), \
                f"p={p}, stage {s}: {m} receives (not on stage 0) and {m} sends (not on the last stage)"
            assert [j for j, _ in got] == list(range(m)), "compute once per micro-batch, in order"
            tl = _timeline(tl, m)
            assert [j for j, *_ in tl] == list(range(m)) and all(a <= b for _, a, b in tl), \
                "the timeline holds one (j, start, end) per micro-batch, in order, times from time.perf_counter()"
            assert expect_type(out, "outputs", list) == [] or s == p - 1, "only the last stage returns outputs"
        xs = list(inputs)
        for s in range(p):
            for j, (_, seen_x) in enumerate(res[s][2]):
                assert seen_x.dtype == dtype and seen_x.shape == shape and torch.allclose(seen_x, xs[j]), \
                    f"p={p}: stage {s} must compute micro-batch {j} on what stage {s - 1} sent for it (shape {shape}, {dtype})"
            xs = [torch.sin(x) * (s + 2) + j for j, x in enumerate(xs)]
        out = [expect_tensor(o, "outputs[j]", shape=shape, dtype=dtype, device=env.device) for o in res[-1][0]]
        assert len(out) == m and all(torch.allclose(o, w) for o, w in zip(out, xs)), f"p={p}, m={m}: wrong results on the last stage"
        tls = [_timeline(r_[1], m) for r_ in res]
        for s in range(1, p):     # data dependency: stage s starts j only after stage s-1 finished it
            for j in range(m):
                assert tls[s][j][1] >= tls[s - 1][j][2] - 1e-6, "a stage computes a micro-batch only after receiving it"
# sends do not wait for the next stage: stage 0 finishes its 4 micro-batches while stage 1 is still busy
def _slow(comm):
    inputs = [torch.zeros(2, device=env.device) for _ in range(4)]
    nap = 0.0 if comm.rank == 0 else 0.15
    return expect_tuple(pipeline_stage(comm, lambda j, x: (time.sleep(nap), x + 1)[1], inputs, (2,)), "pipeline_stage(...)", 2)[1]
with cases("a send does not wait for the next stage"):
    tl0, tl1 = (_timeline(t_, 4) for t_ in run_threads(_slow, 2))
    assert tl0[-1][2] < tl1[1][1], "use isend: stage 0 must not wait for stage 1 to receive before computing its next micro-batch"
### END HIDDEN TESTS
cases.score()
"""),
]
