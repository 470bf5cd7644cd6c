"""Lab 02, section 3: where a decode step's time goes (a profile, launch overhead), CUDA graphs and
Problem 2 (capture the step), and the measurement: eager, graph and torch.compile side by side.

Assembled into the notebook by lab02.py (GRAPH_CELLS, after the roofline and batching section).
"""
from autograder.authoring import code, md, solution, tests

# Tiny random decoders for the hidden tests: large weights, so a stale input changes every logit.
HIDDEN_TINY = r'''
def _tiny_llama(seed, n_layer=2):
    torch.manual_seed(seed)
    c = course.ModelConfig(family="llama", vocab_size=96, n_layer=n_layer, n_head=4, n_kv_head=2, d_model=32,
                           d_ff=64, max_seq_len=64)
    m = course.Decoder(c).eval().to(env.device)
    with torch.no_grad():
        for p_ in m.parameters():
            p_.copy_(torch.randn_like(p_) * 0.5)
    return m
def _eager(m, ids, pos):
    # the reference: one plain forward pass, no graph
    with torch.no_grad():
        return m(ids, pos)
def _close(got, want, what):
    tol = 1e-4 if want.dtype == torch.float32 else 3e-2
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(1.0, want.float().abs().max().item()), \
        f"{what}: logits differ from a plain forward pass by {err:.3g}"
'''.strip("\n")

GRAPH_CELLS = [
md(r'''
## 3. Where the time of a decode step goes

The roofline counts the work: FLOPs and bytes. It does not count what it costs to *start* each
piece of work. Our decoder's decode step is many small operations: per layer two norms (each a
handful of element-wise ops), four projections, RoPE (a few more), attention, the MLP's three
matrices and an activation, two residual adds; then the final norm and the `lm_head`. PyTorch
hands each operation to the device one at a time, from Python. On a CPU the operation then runs on
that same thread. On a GPU the CPU *launches* a kernel (one or more per operation) into a queue,
and the GPU runs it.

A profiler lists them. `course.timing.profile_step(fn, device)` runs `fn` once under
`torch.profiler` and counts what the host handed out (the kernels and copies the GPU ran, or the
ops Python called on a CPU), how long the device spent computing them, and when.
`course.timing.launch_cost(device)` times the smallest possible piece of work, an in-place add to a
one-element tensor, to give what one launch costs the host on this machine.
'''),
code(r'''
from course.timing import launch_cost, profile_step

step_ids, step_pos = prompt[:, :1], positions(1)              # one token, batch 1: the step we timed above
prof = profile_step(lambda: model(step_ids, step_pos), env.device)
print(prof.table(8))
per_launch = launch_cost(env.device)
launch_floor = prof.n_launches * per_launch
rows = [("measured step (eager)", t_step),
        ("roofline bound (section 2)", bound["decode step"]),
        (f"launches: {prof.n_launches} x {per_launch * 1e6:.1f} us", launch_floor),
        ("device busy (profiled)", prof.busy_s)]
print(f"\nOne decode step, batch 1, {WHERE}:")
for name, seconds in rows:
    print(f"  {name:34} {seconds * 1e3:9.3f} ms")

fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3), layout="constrained", width_ratios=[1.7, 1])
ax1.broken_barh([(a * 1e3, (b - a) * 1e3) for a, b in prof.intervals], (0, 1), color="C0")
ax1.set_xlim(0, max(prof.span_s, 1e-9) * 1e3); ax1.set_yticks([]); ax1.set_xlabel("ms into the step")
ax1.set_title(f"One profiled step ({WHERE}): blue = the device computes, {1 - prof.idle_share:.0%} of the time", fontsize=10)
ms = [max(r[1], 1e-7) * 1e3 for r in rows]
ax2.barh([r[0] for r in rows], ms, color=["C3", "C2", "C1", "C0"])
ax2.set_xscale("log"); ax2.set_xlim(min(ms) / 3, max(ms) * 2); ax2.invert_yaxis(); ax2.grid(alpha=0.3, axis="x")
ax2.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}")); ax2.xaxis.set_minor_formatter(plt.NullFormatter())
ax2.set_xlabel("ms (log scale: the bars span orders of magnitude)")
plt.show()
'''),
md(r'''
Read your four numbers. Two limits compete: the **work** (the roofline bound) and **handing the
work out**, one piece at a time (the launch line: how many pieces, times what one costs).

- **On a CPU** an op runs on the thread that dispatched it, and the big ones (the matrix products,
  `aten::linear` at the top of your table) take far longer than dispatching them. The launch line
  is a small share of the step, and the device computes through most of it (your timeline is
  nearly solid blue). No trick that only removes launches can save more than that share.
- **On a GPU** the CPU only launches each kernel and moves on; the GPU runs it in a few
  microseconds, often less than the launch took. For a 135 M model the kernels are so small that
  the GPU finishes each before the CPU has launched the next, so it waits through most of the step
  (thin slivers of blue), and the step lasts far longer than its kernels: a thousand or so of them,
  each handed out by Python, PyTorch and the driver in 5-20 µs, against a roofline bound under a
  millisecond. The model is
  **launch-bound**: neither FLOPs nor bytes set its speed.

Which one is your machine? The cell below says, from your numbers.
'''),
code(r'''
share = launch_floor / t_step
print(f"launches alone would take {launch_floor * 1e3:.2f} ms: {share:.0%} of your {t_step * 1e3:.2f} ms step "
      f"({WHERE}); the roofline bound is {bound['decode step'] / t_step:.1%} of it")
print(f"the device computed through {1 - prof.idle_share:.0%} of the profiled step")
if math.isnan(prof.idle_share):      # the profiler saw no device activity (no CUPTI on this machine)
    print("-> the profile holds no device times here: judge by the launch share in the first line.")
elif prof.idle_share > 0.5:   # judged by the device's idle time: a launch cost measured on a bare add is only a floor
    print("-> bound by launches: the device waits through most of the step for its next piece of work. "
          "Removing the launches should pay off.")
else:
    print(f"-> bound by the work itself: the device computes through most of the step; removing every launch "
          f"would save at most about {min(share, 1):.0%} of it.")
'''),
md(r'''
### CUDA graphs: launch a whole step at once

A **CUDA graph** records the kernels of one call, with their arguments, once; `replay()` then
launches the whole recorded sequence with a single call, and the GPU runs the kernels back to back:

```
 eager    CPU  |launch|launch|launch|launch|launch|launch| ...    one launch per kernel
          GPU     |k|    |k|    |k|    |k|    |k|    |k|   ...    each kernel done long before the next arrives
 graph    CPU  |replay|
          GPU  |k|k|k|k|k|k|k|k|k|k|k|k| ...                      the same kernels, back to back
```

What the graph records is fixed, and that is the price. Three rules:

1. **Fixed memory.** Every kernel reads and writes the addresses it had at capture. New inputs must
   be **copied into** the tensors the step read during capture (its *static input buffers*);
   handing the Python code a new tensor changes nothing the graph sees.
2. **Fixed outputs.** The outputs are static tensors too: the next replay **overwrites** them. Copy
   out what you want to keep.
3. **Fixed shapes and control flow.** One graph per shape: a batch of 4 needs its own graph (engines
   capture one per batch-size *bucket* and pad a batch up to the next bucket). Nothing inside may read
   a value back to the host (`.item()`, `int(t)`, `.tolist()`, an `if` on a tensor) or make a shape that
   depends on values (boolean masks): there is no Python at replay time to hand it to.

`course.engine.StepGraph(device)` gives one interface for both devices: `out = g.capture(fn)` runs
`fn` (no arguments) on its static inputs and returns its outputs as static tensors; `g.replay()`
reruns the captured work, updating `out` in place. On a GPU it is `torch.cuda.CUDAGraph` (warmed up
on a side stream first, as PyTorch's documentation asks). On a CPU it is a **stand-in** with the same
rules: capture records every aten op of one call of `fn`, with the tensors it touched, and replay
reruns those ops on those tensors. It shows the semantics, not a speedup. Watch the first two rules:
'''),
code(r'''
from course.engine import StepGraph

x = torch.zeros(3, device=env.device)            # a static input buffer
g = StepGraph(env.device)
y = g.capture(lambda: x * 2 + 1)                 # y: the static output
x.copy_(torch.tensor([1.0, 2.0, 3.0], device=env.device)); g.replay()
print("copied into x, replayed:       ", y.tolist())
first = y                                        # the static output itself, not a copy
x.copy_(torch.tensor([5.0, 5.0, 5.0], device=env.device)); g.replay()
print("copied again, replayed; first: ", first.tolist(), "(overwritten: copy out what you keep)")
x = torch.tensor([10.0, 20.0, 30.0], device=env.device); g.replay()
print("a new tensor named x, replayed:", y.tolist(), "(unchanged: the graph still reads the old buffer)")
'''),
md(r'''
## Problem 2: Capture the decode step in a graph (3 points)

Wrap our model's one-token forward pass in a graph, the way engines wrap their decode step.

- `GraphedStep(model, max_batch)` allocates static input buffers for `max_batch` rows of one token
  (`input_ids` and `position_ids`, each `(max_batch, 1)`, `torch.long`, on the model's device),
  and captures `model(ids, pos)` on them with a `StepGraph`: its output is the static logits,
  `(max_batch, 1, V)`.
- Calling it, `step(input_ids, position_ids)` with a batch of `B` rows, `1 <= B <= max_batch`, each
  `(B, 1)`: copies the batch into the first `B` rows of the static buffers (the other rows keep
  whatever they held: their logits are simply not read), replays, and returns the first `B` rows of
  the logits, `(B, 1, V)`, as a **copy** the caller may keep.
- It raises `ValueError` for a batch it cannot run: not two-dimensional, more than one token per row,
  `B` outside `1..max_batch`, or `position_ids` of another shape.

A call must not run the model's Python code at all: only `replay()`. The tests check that.

**Deliverable:** the class `GraphedStep` below, whose calls give the logits of `model(input_ids,
position_ids)` for every batch up to `max_batch`.
'''),
solution("graphed_step", r'''
class GraphedStep:
    """model(input_ids, position_ids) for one token per row, B <= max_batch rows, replayed from one graph."""

    def __init__(self, model, max_batch: int):
        ### BEGIN SOLUTION
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        dev = model.device
        self.max_batch = max_batch
        self.ids = torch.zeros(max_batch, 1, dtype=torch.long, device=dev)   # static inputs: the graph reads these
        self.pos = torch.zeros(max_batch, 1, dtype=torch.long, device=dev)
        self.graph = StepGraph(dev)
        self.logits = self.graph.capture(lambda: model(self.ids, self.pos))  # (max_batch, 1, V): the static output
        ### END SOLUTION

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        ### BEGIN SOLUTION
        if input_ids.dim() != 2 or input_ids.shape[1] != 1 or not 1 <= input_ids.shape[0] <= self.max_batch \
                or position_ids.shape != input_ids.shape:
            raise ValueError(f"need input_ids and position_ids of shape (B, 1) with 1 <= B <= {self.max_batch}; "
                             f"got {tuple(input_ids.shape)} and {tuple(position_ids.shape)}")
        B = input_ids.shape[0]
        self.ids[:B].copy_(input_ids)           # copy in: the graph sees only its own buffers
        self.pos[:B].copy_(position_ids)
        self.graph.replay()
        return self.logits[:B].clone()          # copy out: the next replay overwrites self.logits
        ### END SOLUTION
'''),
code(r'''
step = GraphedStep(model, max_batch=2)
two = torch.cat([prompt[:, :1], prompt[:, 1:2]])                       # two sequences, one token each
got = step(two, torch.zeros_like(two))
with torch.no_grad():
    want = model(two, torch.zeros_like(two))
print(f"graph vs eager, 2 rows ({WHERE}): largest logit difference {(got - want).abs().max().item():.2e}; "
      f"same next tokens: {got[:, -1].argmax(-1).tolist() == want[:, -1].argmax(-1).tolist()}")
'''),
tests("graphed_step_tests", 2, r'''
from course.expect import expect_tensor


def logits_of(step, ids, pos, what):   # what a GraphedStep call returned, checked before it is compared
    return expect_tensor(step(ids, pos), what, dtype=model.dtype, shape=(ids.shape[0], 1, cfg.vocab_size),
                         device=env.device)


def close(got, want, what):
    tol = 1e-4 if want.dtype == torch.float32 else 3e-2
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(1.0, want.float().abs().max().item()), f"{what}: logits differ from a plain forward by {err:.3g}"


a = torch.tensor([[5], [17], [42]], device=env.device)
b = torch.tensor([[8], [3], [99]], device=env.device)
pos_a, pos_b = torch.zeros_like(a), torch.full_like(b, 3)
step = GraphedStep(model, 3)
with torch.no_grad():
    want_a, want_b = model(a, pos_a), model(b, pos_b)
out_a = logits_of(step, a, pos_a, "step(a, pos_a)")
close(out_a, want_a, "the first call: copy the call's inputs INTO the static buffers the graph was captured with, "
      "then replay (the graph never sees a new tensor, only the buffers it read during capture)")
out_b = logits_of(step, b, pos_b, "step(b, pos_b)")
close(out_b, want_b, "a second call with other tokens and positions: copy each call's inputs INTO the static buffers "
      "(a graph never sees a new tensor)")
close(out_a, want_a, "the first call's result after a second call: return a copy (the next replay overwrites the "
      "static logits)")
### BEGIN HIDDEN TESTS
''' + HIDDEN_TINY + r'''
m = _tiny_llama(11)
for max_batch in (1, 4):
    st = GraphedStep(m, max_batch)
    kept = []
    for i in range(5):                                    # every size up to max_batch, in an order that shrinks and grows
        B = [max_batch, 1, max_batch, 1, max_batch][i]
        ids_ = torch.randint(0, 96, (B, 1), generator=torch.Generator().manual_seed(i)).to(env.device)
        pos_ = torch.randint(0, 60, (B, 1), generator=torch.Generator().manual_seed(100 + i)).to(env.device)
        got_ = expect_tensor(st(ids_, pos_), f"GraphedStep(m, {max_batch}) on {B} rows", dtype=m.dtype,
                             shape=(B, 1, 96), device=env.device)
        _close(got_, _eager(m, ids_, pos_), f"max_batch {max_batch}, call {i + 1} with {B} rows "
               f"(copy into the first B rows, return the first B rows)")
        kept.append((got_, _eager(m, ids_, pos_)))
    for i, (got_, want_) in enumerate(kept):
        _close(got_, want_, f"max_batch {max_batch}: call {i + 1}'s result, read after later calls (return a copy)")
# the caller's tensors are left alone, and changing them after a call changes nothing returned
st = GraphedStep(m, 2)
ids_ = torch.tensor([[7], [9]], device=env.device)
pos_ = torch.tensor([[1], [2]], device=env.device)
got_ = st(ids_, pos_)
ids_[0, 0] = 50
assert ids_.tolist() == [[50], [9]] and pos_.tolist() == [[1], [2]], "do not modify input_ids or position_ids"
_close(got_, _eager(m, torch.tensor([[7], [9]], device=env.device), pos_), "a returned result must not change afterwards")
# the real model, a batch of 1 after a batch of 2
st = GraphedStep(model, 2)
st(torch.tensor([[1], [2]], device=env.device), torch.tensor([[4], [4]], device=env.device))
one = torch.tensor([[123]], device=env.device)
_close(expect_tensor(st(one, torch.tensor([[9]], device=env.device)), "GraphedStep(model, 2) on 1 row", dtype=model.dtype,
                     shape=(1, 1, cfg.vocab_size), device=env.device),
       _eager(model, one, torch.tensor([[9]], device=env.device)), "SmolLM2, one row after two")
del st, kept
### END HIDDEN TESTS
'''),
tests("graphed_step_replay_tests", 1, r'''
from course.expect import expect_tensor

calls = []
hook = model.lm_head.register_forward_hook(lambda *args: calls.append(1))   # fires whenever the model's Python runs
try:
    step = GraphedStep(model, 2)
    assert calls, "GraphedStep(model, max_batch) must capture the step when it is built (run the model once, in capture)"
    calls.clear()
    ids = torch.tensor([[3], [4]], device=env.device)
    expect_tensor(step(ids, torch.zeros_like(ids)), "step(ids, pos)", dtype=model.dtype, shape=(2, 1, cfg.vocab_size),
                  device=env.device)
    assert not calls, "a call must replay the captured graph, not run the model again (no model(...) in __call__)"
finally:
    hook.remove()
### BEGIN HIDDEN TESTS
''' + HIDDEN_TINY + r'''
m = _tiny_llama(12)
st = GraphedStep(m, 3)
seen = []
h = m.lm_head.register_forward_hook(lambda *args: seen.append(1))
try:
    for B in (3, 2, 1):
        x_ = torch.full((B, 1), B, dtype=torch.long, device=env.device)
        expect_tensor(st(x_, x_), f"a call on {B} rows", dtype=m.dtype, shape=(B, 1, 96), device=env.device)
    assert not seen, "every call must be a replay: no forward pass of the model in __call__"
finally:
    h.remove()
ok = torch.zeros(1, 1, dtype=torch.long, device=env.device)
for bad_ids, bad_pos, why in (
        (torch.zeros(4, 1, dtype=torch.long, device=env.device), torch.zeros(4, 1, dtype=torch.long, device=env.device),
         "4 rows in a graph captured for 3 (capture one shape, replay another: pick a bigger graph or fall back)"),
        (torch.zeros(2, 2, dtype=torch.long, device=env.device), torch.zeros(2, 2, dtype=torch.long, device=env.device),
         "two tokens per row (the graph holds one)"),
        (torch.zeros(0, 1, dtype=torch.long, device=env.device), torch.zeros(0, 1, dtype=torch.long, device=env.device),
         "an empty batch"),
        (torch.zeros(2, dtype=torch.long, device=env.device), torch.zeros(2, dtype=torch.long, device=env.device),
         "a 1-D input"),
        (ok, torch.zeros(2, 1, dtype=torch.long, device=env.device), "position_ids of another shape")):
    try:
        st(bad_ids, bad_pos)
    except ValueError:
        pass
    else:
        raise AssertionError(f"GraphedStep(m, 3) must raise ValueError for {why}")
### END HIDDEN TESTS
'''),
md(r'''
### Measure: eager, graph, and `torch.compile`

Your `GraphedStep` at batch 1 against the eager step, timed the same way (median after a warm-up,
synchronized). On a GPU, in full mode, a third contender: `torch.compile(model,
mode="reduce-overhead")`, which fuses small ops into fewer kernels (generated with Triton) and then
replays them from CUDA graphs too, after a compile that takes tens of seconds.
'''),
code(r'''
from course.report import record

graphed = GraphedStep(model, 1)
eager_timing = benchmark(lambda: model(step_ids, step_pos), warmup=1, repeats=repeats, device=env.device)  # again, now
graph_timing = benchmark(lambda: graphed(step_ids, step_pos), warmup=2, repeats=repeats, device=env.device)
t_eager, t_graph = eager_timing.median, graph_timing.median
results = {"eager": eager_timing, "your CUDA graph" if env.gpu else "your graph (CPU stand-in)": graph_timing}  # Timings
if env.gpu and not env.quick:
    try:
        compiled = torch.compile(model, mode="reduce-overhead")
        start = clock(env.device)
        with torch.inference_mode():                 # as benchmark runs it: another grad mode would compile again
            for _ in range(3):                       # compile, then record its graphs
                compiled(step_ids, step_pos)
        compile_s = clock(env.device) - start
        results["torch.compile (reduce-overhead)"] = benchmark(lambda: compiled(step_ids, step_pos), warmup=2,
                                                               repeats=repeats, device=env.device)
        print(f"torch.compile took {compile_s:.0f} s before its first fast step")
    except Exception as e:  # noqa: BLE001 - a GPU without a working compiler still gets the rest
        print(f"torch.compile did not run here ({type(e).__name__}: {str(e)[:120]})")
elif env.gpu:
    print("torch.compile: full mode only (its compile takes tens of seconds)")
else:
    print("torch.compile: skipped on a CPU. It would generate C++ for each fused kernel (minutes on a laptop), "
          "to remove launch overhead that your profile shows is a small share of a CPU step.")

print(f"\none decode step, batch 1, {WHERE}; roofline bound {bound['decode step'] * 1e3:.3f} ms")
for name, timing in results.items():                 # median, then the fastest and slowest of the runs
    print(f"  {name:34} {timing.median * 1e3:9.2f} ms  {t_eager / timing.median:6.1f}x eager   "
          f"(runs {min(timing.runs) * 1e3:.2f} to {max(timing.runs) * 1e3:.2f} ms, spread {timing.spread:.0%})")
record("decode_step_eager_ms", t_eager * 1e3, "ms", "an eager decode step, batch 1", device=env.device, dtype=DTYPE)
record("decode_step_graph_ms", t_graph * 1e3, "ms", "the same step replayed from a CUDA graph", device=env.device, dtype=DTYPE)
record("graph_speedup", t_eager / t_graph, "x", "on a GPU the graph replays the step several times faster than eager; "
       "on a CPU about 1x (no launches to remove), a third either way on a busy machine", device=env.device, dtype=DTYPE)
record("launch_share", share, "", "launches are most of a GPU step and a small share of a CPU step",
       device=env.device, dtype=DTYPE)
if "torch.compile (reduce-overhead)" in results:
    record("decode_step_compile_ms", results["torch.compile (reduce-overhead)"].median * 1e3, "ms",
           "torch.compile(mode='reduce-overhead'), batch 1", device=env.device, dtype=DTYPE)

fig, ax = plt.subplots(figsize=(8, 2.4), layout="constrained")
ms = [timing.median * 1e3 for timing in results.values()] + [bound["decode step"] * 1e3]
ax.barh(list(results), ms[:-1], color=["C3", "C0", "C2"][:len(results)])
ax.axvline(ms[-1], color="gray", ls="--", label="roofline bound")
ax.set_xscale("log"); ax.set_xlim(min(ms) / 2, max(ms) * 1.5); ax.invert_yaxis()
ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda v, _: f"{v:g}")); ax.xaxis.set_minor_formatter(plt.NullFormatter())
ax.set_xlabel(f"ms per decode step ({WHERE}, log scale)"); ax.legend(fontsize=8); ax.grid(alpha=0.3, axis="x")
plt.show()
'''),
md(r'''
Read the speedup column against your profile. **On a GPU** the graph removes the launches, and the
step drops several-fold, down to about the "device busy" line of your profile: what is left is the
kernels themselves, a thousand or so, each a microsecond or a few even with nobody waiting for
Python, still far above the roofline bound. `torch.compile` goes further (your third line, in full
mode) because it attacks that remainder: it **fuses** runs of small ops into fewer, generated
kernels, then replays those from graphs too, after a compile of tens of seconds. **On a CPU** your graph is the stand-in: it reruns the same ops one by one from
Python (it skips the modules' Python code, but copies every result into its static buffer), so it
should take about eager's time. On a busy machine two medians of the same work can still differ by a
third either way: read the range of runs you printed next to each median, and count a gap smaller
than those ranges as noise. That is not a failure of the idea: your profile showed that a CPU step
spends its time in the work, not in launching it.

Every serving engine runs its decode steps this way on a GPU: vLLM, SGLang and nano-vllm capture
one graph per batch-size bucket at start-up (1, 2, 4, 8, 16, ...), pad each decode batch up to the
next bucket, and run prefills, whose shapes vary, eagerly. The course's engine does the same from
lab 03 on (`course/engine/graphs.py`): read it once you have passed the tests above.

### Batching, again, without the launches

Section 2's batch sweep measured eager steps. On a GPU, repeat it with graphs: one graph per batch
size, as an engine captures them.
'''),
code(r'''
if env.gpu:
    sizes = env.pick([1, 2, 4, 8, 16, 32, 64, 128, 256], [1, 8, 64])
    eager_ms, graph_ms = [], []
    for b in sizes:
        ids = prompt[:, :1].repeat(b, 1)
        pos = torch.zeros_like(ids)
        eager_ms.append(1e3 * benchmark(lambda: model(ids, pos), warmup=1, repeats=repeats, device=env.device).median)
        g_b = GraphedStep(model, b)
        graph_ms.append(1e3 * benchmark(lambda: g_b(ids, pos), warmup=1, repeats=repeats, device=env.device).median)
        print(f"batch {b:4}: eager {eager_ms[-1]:7.2f} ms, graph {graph_ms[-1]:6.2f} ms per step; "
              f"{b / eager_ms[-1] * 1e3:9.0f} vs {b / graph_ms[-1] * 1e3:9.0f} tokens/s")
    fig, ax = plt.subplots(figsize=(7, 3.5), layout="constrained")
    ax.plot(sizes, [b / t * 1e3 for b, t in zip(sizes, eager_ms)], "o-", color="C3", label="eager")
    ax.plot(sizes, [b / t * 1e3 for b, t in zip(sizes, graph_ms)], "s-", color="C0", label="CUDA graph")
    ax.set_xscale("log", base=2); ax.set_yscale("log"); ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens per second"); ax.set_title(f"Batching with and without launches ({WHERE})", fontsize=10)
    ax.grid(alpha=0.3); ax.legend(); plt.show()
    record("graph_speedup_largest_batch", eager_ms[-1] / graph_ms[-1], "x",
           "the graph's gain shrinks as the batch's own work grows", device=env.device, dtype=DTYPE, batch=sizes[-1])
else:
    print("GPU only: on a CPU the stand-in reruns the same ops, so its curve would repeat section 2's eager one.")
'''),
md(r'''
On a GPU both curves climb with the batch, because both steps are dominated by something other than
the batch's arithmetic: launches for eager, the fixed cost of a thousand small kernels for the
graph. The graph's advantage shrinks as the batch grows and each kernel gets real work to do
(compare your two times at the largest batch); at batches large enough for the step to be bound by
its FLOPs and bytes the two would meet, often beyond this plot. That is
why engines bother with graphs for **decode** (small, fixed shapes, run thousands of times) and not
for prefill (big kernels, shapes that change with every prompt).
'''),
]
