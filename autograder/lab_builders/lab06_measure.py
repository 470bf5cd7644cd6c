"""Lab 06, Problem 7 and the measurements: bytes and bandwidth, the model of the kernels on CPU, the
perf_report benchmark against SDPA and the HBM roofline on a GPU, the prefill against SDPA's flash
backend, a profile, your kernels inside the engine; then the summary and going further."""
from autograder.authoring import answer, code, md, solution, tests

CELLS = [
md(r"""
## 5. Measure: bytes, bandwidth and the roofline

A decode step's attention must read every cached key and value of every sequence once (per KV head:
GQA's query heads share them), and does one multiply-add per element it reads for each query head of
the group: `4 * H * L * D` FLOPs for `4 * Hkv * L * D` bytes in bf16. In lab 02's words its
**arithmetic intensity** is `H / Hkv` FLOPs per byte (3 for SmolLM2), far left of any GPU's ridge
point (hundreds of FLOPs per byte): it is memory-bound, and its floor is **bytes / bandwidth**. A kernel's **achieved bandwidth** is the bytes it
had to read divided by its time; divided by the GPU's peak, it is the fraction of the **roofline** the
kernel reaches. (The queries and outputs are a few kilobytes: next to megabytes of keys and values,
leave them out.) Bandwidths are quoted in GB/s with 1 GB = 10^9 bytes, as on datasheets.
"""),
md(r"""
## Problem 7: Bytes and bandwidth (2 points)

**Deliverable:** `kv_bytes(context_lens, n_kv_head, head_dim, dtype)`: the bytes of keys **and** values
one decode attention call must read for sequences of these lengths (a Python int; `dtype.itemsize`
is the bytes of one element), and `bandwidth(seconds, nbytes, peak_bytes_per_s)`: the pair
(achieved GB/s, fraction of the peak), both Python floats. The measurements below call them.
"""),
solution("bandwidth", r'''
def kv_bytes(context_lens, n_kv_head, head_dim, dtype):
    """Bytes of keys and values a decode attention call reads at least: each cached token's K and V, once per KV head."""
    ### BEGIN SOLUTION
    return 2 * sum(context_lens) * n_kv_head * head_dim * dtype.itemsize
    ### END SOLUTION


def bandwidth(seconds, nbytes, peak_bytes_per_s):
    """(achieved GB/s, fraction of the peak) of a kernel that moved nbytes in `seconds`."""
    ### BEGIN SOLUTION
    achieved = nbytes / seconds
    return achieved / 1e9, achieved / peak_bytes_per_s
    ### END SOLUTION
'''),
tests("bandwidth_tests", 2, r"""
from course.expect import expect_float, expect_int, expect_tuple
n = expect_int(kv_bytes([1024] * 32, 3, 64, torch.bfloat16), "kv_bytes([1024] * 32, 3, 64, torch.bfloat16)", min=0)
assert n == 25_165_824, f"32 sequences x 1024 tokens x 3 KV heads x 64 dims x 2 bytes, for K and V: 25,165,824 bytes, got {n:,}"
gbs, frac = expect_tuple(bandwidth(40e-6, 25_165_824, 3.35e12), "bandwidth(40e-6, 25_165_824, 3.35e12)", 2)
gbs, frac = expect_float(gbs, "the achieved GB/s"), expect_float(frac, "the fraction of the peak")
assert abs(gbs - 629.1456) < 1e-3, f"25,165,824 bytes in 40 us is 629.1 GB/s (1 GB = 1e9 bytes), got {gbs}"
assert abs(frac - 629.1456e9 / 3.35e12) < 1e-6, f"629.1 GB/s of a 3,350 GB/s peak is a fraction of 0.188 (not a percentage), got {frac}"
### BEGIN HIDDEN TESTS
for lens, hkv, d, dtype, want in (([1, 17, 300], 4, 16, torch.float32, 2 * 318 * 4 * 16 * 4),     # ragged: the sum, not B x max
                                  ([5], 1, 128, torch.float16, 2 * 5 * 128 * 2),
                                  ([2048, 1], 8, 64, torch.bfloat16, 2 * 2049 * 8 * 64 * 2),
                                  ([], 3, 64, torch.float32, 0)):
    got = expect_int(kv_bytes(lens, hkv, d, dtype), f"kv_bytes({lens}, {hkv}, {d}, {dtype})", min=0)
    assert got == want, f"kv_bytes({lens}, {hkv}, {d}, {dtype}) is {want:,}, got {got:,} (K and V; every token of every sequence; bytes per element)"
for seconds, nbytes, peak, want in ((1e-3, 2_000_000_000, 2e12, (2000.0, 1.0)), (0.5, 10**9, 4e9, (2.0, 0.5)),
                                    (2e-6, 3_000_000, 320e9, (1500.0, 4.6875))):
    got = expect_tuple(bandwidth(seconds, nbytes, peak), f"bandwidth({seconds}, {nbytes}, {peak})", 2)
    a, b = expect_float(got[0], "the achieved GB/s"), expect_float(got[1], "the fraction of the peak")
    assert abs(a - want[0]) < 1e-6 * want[0] and abs(b - want[1]) < 1e-9, \
        f"bandwidth({seconds}, {nbytes}, {peak}) is {want}, got {(a, b)} (seconds, not ms; 1 GB = 1e9 bytes; a fraction, not %)"
### END HIDDEN TESTS
"""),
md(r"""
### What the hardware allows, and how the kernels use it (any machine)

This needs no GPU: your `kv_bytes` with the datasheet bandwidths of three GPUs (`course.hardware.GPUS`)
give the **floor** of one layer's decode attention for SmolLM2, the time a kernel running at 100% of the
memory bandwidth would take. Next to it, how many programs each version launches on an H100 (132
SMs), with `choose_split_len`, the launcher of your split-KV kernel:
"""),
code(r"""
from course.hardware import GPUS

gpus = {"T4": GPUS["T4"], "A100": GPUS["A100-80GB SXM"], "H100": GPUS["H100 SXM"]}
print("SmolLM2 decode attention, one layer, bf16 (fp16 on a T4: the same bytes)")
print(f"{'batch x context':>16}{'K/V bytes':>14}" + "".join(f"{'floor on ' + n:>16}" for n in gpus)
      + f"{'v2 programs':>14}{'split_len':>11}{'split-KV programs':>19}")
for B, ctx in ((32, 1024), (8, 8192), (1, 8192)):
    nbytes = kv_bytes([ctx] * B, cfg.n_kv_head, cfg.head_dim, torch.bfloat16)
    floors = "".join(f"{nbytes / (g.bandwidth_gbs * 1e9) * 1e6:>13.1f} us" for g in gpus.values())
    split_len = choose_split_len(B, cfg.n_kv_head, ctx, n_sm=132)
    split_programs = B * cfg.n_kv_head * -(-ctx // split_len)
    print(f"{f'{B} x {ctx}':>16}{nbytes:>14,}{floors}{B * cfg.n_kv_head:>14}{split_len:>11}{split_programs:>19}")
"""),
md(r"""
Two things to take from the table. First, the floors are microseconds: launching a kernel from
Python costs tens of microseconds of CPU time (the profile below measures it on a GPU), so at this
size launches are not free, and split-KV launches two kernels. Second, v2's programs cannot use an
H100 at 8 x 8k, whatever their speed; the split-KV launcher asks for at least two programs per SM.

On a CPU your kernels run in the interpreter. Its time says nothing about a GPU: it counts
program-iterations (each costs milliseconds of NumPy). That is why v2, with four times fewer
iterations, beats v1 here, and why split-KV, with tiles of 16 tokens in the interpreter and a second
kernel, does not beat v2:
"""),
code(r"""
if env.gpu:
    print("on a GPU: see the benchmark below")
else:
    lens = [256] * 4                      # about 2 s in all on a 2-core CPU; shorter ones hide what v2's tiles save
    case = paged_case(lens, H=cfg.n_head, Hkv=cfg.n_kv_head, D=cfg.head_dim, block_size=16)
    split_len = choose_split_len(len(lens), cfg.n_kv_head, max(lens))
    timed = {"PyTorch reference": lambda: paged_attention(*case, 0.125),
             "Triton v1 (interpreter)": lambda: paged_attention_v1(*case, 0.125),
             "Triton v2 (interpreter)": lambda: paged_attention_v2(*case, 0.125),
             "Triton split-KV (interpreter)": lambda: paged_attention_split(*case, 0.125)}
    for name, fn in timed.items():
        start = time.perf_counter(); fn(); seconds = time.perf_counter() - start
        print(f"{name:>30}: {seconds * 1e3:8.1f} ms   (interpreter time, not performance)")
    programs, n_splits = len(lens) * cfg.n_kv_head, -(-max(lens) // split_len)
    print(f"program-iterations: v1 {programs * (lens[0] // 16)}, v2 {programs * -(-lens[0] // 64)}, split-KV "
          f"{programs * n_splits * -(-min(split_len, lens[0]) // 16)} + {len(lens) * cfg.n_head} merge programs")
"""),
md(r"""
### On a GPU: your kernels against SDPA and the roofline

`triton.testing.do_bench` runs a function many times, empties the L2 cache before each run (so keys
and values come from memory, as in a real step, not from cache) and reports the mean (the median with
`return_mode="median"`, or the quantiles you pass). It times the
GPU between two events around each call, and that hides a trap for kernels this short: a split-KV call
is two Triton launches, and Python can take longer to launch them than the GPU takes to run them
(on the H100 we tried, about 90 µs of CPU for about 10 µs of GPU work; the profile below measures
both on yours). Between the events the GPU then waits for Python, and do_bench times
Python. An engine never pays that: it replays its decode steps from CUDA graphs (lab 02). So the
measurements here use `course.kernels.bench_replayed`, which does the same: it times many calls
replayed from one CUDA graph (`triton.testing.do_bench_cudagraph`), and hands each call its own copy
of the inputs, cycling through enough copies to outrun the L2 cache, so every call still reads from
memory. The
benchmark below is written the way Triton's tutorials write theirs: a `triton.testing.perf_report`
sweep over context length and over batch size, with a line for each of your versions, for PyTorch's
`scaled_dot_product_attention` on the same keys and values **already gathered** into contiguous
tensors (the gather not counted, so it is a strong competitor: a library kernel on the friendliest
layout; each KV head's 3 query heads go in as 3 query rows, so it too reads every key once), and for
the roofline (your `bandwidth` of the peak). On a CPU it says why it cannot run.
"""),
code(r"""
if not env.gpu:
    print("skipped: no GPU here. do_bench and autotuning time the GPU's clock; the interpreter has none to time.")
else:
    from course.hardware import device_peak
    from course.kernels import bench_replayed, run_perf_report

    peak = device_peak(env)                    # a GPU course.hardware knows: its datasheet; another: measured here
    gpu, dt, dt_name = torch.cuda.get_device_name(0), env.dtype, str(env.dtype).removeprefix("torch.")
    Hkv, G, D, scale = cfg.n_kv_head, cfg.group_size, cfg.head_dim, cfg.head_dim ** -0.5
    inputs = {}

    def decode_case(batch, ctx):
        # paged inputs (shuffled blocks of 16) and the same keys and values gathered contiguous, one shape at a time
        if (batch, ctx) not in inputs:
            inputs.clear()
            q, k_cache, v_cache, tables, lens = paged_case([ctx] * batch, cfg.n_head, Hkv, D, 16, dtype=dt)
            kd = k_cache[tables.long()].reshape(batch, -1, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()   # (B, Hkv, ctx, D)
            vd = v_cache[tables.long()].reshape(batch, -1, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
            inputs[(batch, ctx)] = ((q, k_cache, v_cache, tables, lens, scale), (q.view(batch, Hkv, G, D), kd, vd))
        return inputs[(batch, ctx)]

    def decode_time(batch, ctx, provider, quantiles=None):
        paged, (qd, kd, vd) = decode_case(batch, ctx)
        fn, args = {"v1": (paged_attention_v1, paged), "v2": (paged_attention_v2, paged),
                    "split": (paged_attention_split, paged),
                    "sdpa": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=scale), (qd, kd, vd))}[provider]
        return bench_replayed(fn, *args, quantiles=quantiles)   # ms, replayed from a CUDA graph, inputs from memory

    providers = ["v1", "v2", "split", "sdpa", "roofline"]
    common = dict(line_arg="provider", line_vals=providers, ylabel="GB/s", x_log=True,
                  line_names=["your v1", "your v2", "your split-KV", "SDPA, gathered K/V", "HBM roofline"],
                  styles=[("tab:gray", "-"), ("tab:blue", "-"), ("tab:red", "-"), ("black", "--"), ("tab:green", ":")])

    @triton.testing.perf_report([
        triton.testing.Benchmark(x_names=["ctx"], x_vals=env.pick([256, 512, 1024, 2048, 4096, 8192], [1024, 8192]),
                                 args={"batch": 8}, xlabel="context length (tokens), 8 sequences",
                                 plot_name=f"decode attention, 8 sequences, {dt_name}, {gpu}", **common),
        triton.testing.Benchmark(x_names=["batch"], x_vals=env.pick([1, 4, 16, 32, 64], [32]),
                                 args={"ctx": 1024}, xlabel="sequences of 1024 tokens",
                                 plot_name=f"decode attention, 1k context, {dt_name}, {gpu}", **common)])
    def decode_bandwidth(batch, ctx, provider):
        if provider == "roofline":
            return peak.bytes_per_s / 1e9
        nbytes = kv_bytes([ctx] * batch, Hkv, D, dt)
        median, fast, slow = decode_time(batch, ctx, provider, quantiles=[0.5, 0.2, 0.8])
        return tuple(bandwidth(ms * 1e-3, nbytes, peak.bytes_per_s)[0] for ms in (median, slow, fast))

    paged, (qd, kd, vd) = decode_case(32, 1024)
    check = (paged_attention_split(*paged).float() - F.scaled_dot_product_attention(qd, kd, vd, scale=scale).reshape(32, -1, D).float())
    print(f"your split-KV against SDPA at 32 x 1024: max |diff| {check.abs().max().item():.1e} ({dt_name})")
    sweeps = run_perf_report(decode_bandwidth)

    # the same measurements as time per call: bytes / (GB/s); the roofline line becomes the floor
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained")
    for ax, rows, x_name, fixed in zip(axes, sweeps, ("ctx", "batch"), ({"batch": 8}, {"ctx": 1024})):
        shape = lambda r: {**fixed, x_name: int(r[x_name])}
        for (name, (color, style)) in zip(common["line_names"], common["styles"]):
            us = [kv_bytes([shape(r)["ctx"]] * shape(r)["batch"], Hkv, D, dt) / (r[name] * 1e9) * 1e6 for r in rows]
            ax.plot([int(r[x_name]) for r in rows], us, "o" + style if name != "HBM roofline" else style, color=color,
                    label=name if name != "HBM roofline" else "floor: bytes / bandwidth")
        ax.set_xscale("log"); ax.set_yscale("log")
        ax.set_xlabel(x_name if x_name == "batch" else "context length (tokens)"); ax.set_ylabel("us per call")
        ax.set_title(f"{'8 sequences' if x_name == 'ctx' else '1k context'}, {dt_name}, {gpu}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    plt.show()
"""),
code(r"""
if env.gpu:
    from course.report import record

    print(f"{gpu}, {dt_name}; memory bandwidth {peak.bytes_per_s / 1e9:,.0f} GB/s ({peak.source})")
    for batch, ctx in ((32, 1024), (8, 8192)):
        nbytes = kv_bytes([ctx] * batch, Hkv, D, dt)
        t_split, t_sdpa = (decode_time(batch, ctx, p) * 1e-3 for p in ("split", "sdpa"))
        gbs, frac = bandwidth(t_split, nbytes, peak.bytes_per_s)
        print(f"{batch:3d} x {ctx:5d}: your split-KV {t_split * 1e6:7.1f} us = {gbs:6.0f} GB/s = {frac:4.0%} of the roofline; "
              f"SDPA on gathered K/V {t_sdpa * 1e6:7.1f} us; yours runs at {t_sdpa / t_split:.2f}x SDPA's speed")
        where = dict(device=gpu, dtype=dt_name, shape=f"{batch}x{ctx}", timing="CUDA-graph replay")
        record(f"split_kv_roofline_{batch}x{ctx}", frac, "of peak", "split-KV decode reaches >= 0.5 of the HBM roofline on an H100", **where)
        record(f"split_kv_vs_sdpa_{batch}x{ctx}", t_sdpa / t_split, "x", "split-KV decode >= 0.8x SDPA on gathered K/V on an H100", **where)
    tuned = autotuned(paged_decode_split_kernel, DECODE_CONFIGS, SPLIT_TUNE_KEY)   # the wrapper the launcher used
    print("the configuration autotuning kept:", getattr(tuned, "best_config", None))
"""),
md(r"""
### On a GPU: launch stage 2 before stage 1 ends

Replayed from a CUDA graph, the launches cost no Python, but the GPU still runs the two kernels one
after the other: stage 1's last programs finish, their stores are made visible, stage 2 is launched,
and its programs start and load what stage 1 stored. Between stage 1's last load and stage 2's
first, memory sits idle, and at 32 x 1k the whole call's floor is a few microseconds (the table
above). GPUs of compute capability 9.0 and later (H100, H200) can overlap the launch with the
kernel before it: **programmatic dependent launch** (PDL). A kernel launched with `launch_pdl=True`
may start while the kernel before it still runs, once every program of that kernel has called
`gdc_launch_dependents()` (or finished); its programs then wait at `gdc_wait()` until that kernel
has finished and its stores are visible. The merge stays exact: whatever starts early, nothing is
read before the wait.

Those are the two given lines under `if USE_PDL:` in your kernels: stage 1 lets stage 2 launch as its
programs start, stage 2 waits before its first load. The launchers pass `USE_PDL=PDL` to both kernels
and, when it is on, `launch_pdl=True` to stage 2, with `PDL = pdl_available()` (and `pdl=False` turns
it off for one call). What it saves is the time between the two kernels, which you measure here; on
a GPU without PDL the cell says so.
"""),
code(r"""
if not env.gpu:
    print("skipped: no GPU here")
elif not PDL:
    major, minor = torch.cuda.get_device_capability(0)
    print(f"{gpu} has compute capability {major}.{minor}: programmatic dependent launch needs 9.0 or later (or a "
          "newer Triton), so stage 2 launches after stage 1 ends")
else:
    from functools import partial
    from course.report import record

    print(f"split-KV with stage 2 launched in order and with PDL, {dt_name} on {gpu}:")
    for batch, ctx in ((32, 1024), (8, 8192)):
        paged, _ = decode_case(batch, ctx)
        nbytes = kv_bytes([ctx] * batch, Hkv, D, dt)
        t_order, t_pdl = (bench_replayed(partial(paged_attention_split, pdl=pdl), *paged) * 1e-3 for pdl in (False, True))
        fracs = [bandwidth(t, nbytes, peak.bytes_per_s)[1] for t in (t_order, t_pdl)]
        print(f"{batch:3d} x {ctx:5d}: in order {t_order * 1e6:6.1f} us ({fracs[0]:4.0%} of the roofline), with PDL "
              f"{t_pdl * 1e6:6.1f} us ({fracs[1]:4.0%}): {(t_order - t_pdl) * 1e6:+.1f} us saved per call")
        record(f"split_kv_pdl_saving_{batch}x{ctx}", (t_order - t_pdl) * 1e6, "us",
               "launching stage 2 early (PDL) shortens a split-KV call on a GPU that has it",
               device=gpu, dtype=dt_name, shape=f"{batch}x{ctx}", timing="CUDA-graph replay")
"""),
md(r"""
### On a GPU: the split length is a knob

`choose_split_len` guesses how many tokens each split should take: enough splits for at least two
programs per SM. It is a rule of thumb, and your GPU may disagree with it. More splits put more
programs to work and more loads in flight; fewer splits give each program a longer loop to pipeline
and stage 2 fewer rows to merge. The cell times your split-KV kernel at both shapes for every split
length, the launcher's choice marked with `<`:
"""),
code(r"""
if not env.gpu:
    print("skipped: no GPU here")
else:
    from course.report import record

    for batch, ctx in env.pick(((32, 1024), (8, 8192)), ((32, 1024),)):
        paged, _ = decode_case(batch, ctx)
        nbytes, chosen = kv_bytes([ctx] * batch, Hkv, D, dt), choose_split_len(batch, Hkv, ctx)
        print(f"{batch} x {ctx}, {dt_name} on {gpu}:")
        best = None
        for split_len in sorted({128, 256, 384, 512, 1024, 2048, chosen} & set(range(128, ctx + 1))):
            seconds = bench_replayed(lambda *a: paged_attention_split(*a, split_len=split_len), *paged) * 1e-3
            gbs, frac = bandwidth(seconds, nbytes, peak.bytes_per_s)
            programs = batch * Hkv * -(-ctx // split_len)
            print(f"  split_len {split_len:5d}: {programs:5d} programs {seconds * 1e6:7.1f} us = {gbs:6.0f} GB/s = "
                  f"{frac:4.0%} of the roofline"
                  + ("   < the launcher's choice" if split_len == chosen else ""))
            best = min(best or (seconds, split_len, frac), (seconds, split_len, frac))
        print(f"  fastest: split_len {best[1]} at {best[2]:.0%} of the roofline")
        where = dict(device=gpu, dtype=dt_name, shape=f"{batch}x{ctx}", timing="CUDA-graph replay", split_len=best[1])
        record(f"split_kv_roofline_best_split_{batch}x{ctx}", best[2], "of peak",
               "split-KV decode at its fastest split length reaches >= 0.5 of the HBM roofline on an H100", **where)
"""),
md(r"""
### On a GPU: the prefill against SDPA's flash backend

The same measurement for Problem 6, one sequence at several prompt lengths, against PyTorch's
FlashAttention backend (sm_80 and later; a T4 gets the memory-efficient one) on keys and values that
are contiguous and already expanded to every query head. Prefill is compute-bound: the figure of
merit is FLOP/s (two matrix products over the causal half of the scores: `4 * D * H * T (T + 1) / 2`).
"""),
code(r"""
if not env.gpu:
    print("skipped: no GPU here")
else:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    flash = torch.cuda.get_device_capability(0) >= (8, 0)
    backends = [SDPBackend.FLASH_ATTENTION] if flash else [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    H = cfg.n_head
    print(f"causal prefill, one sequence, {dt_name} on {gpu}; SDPA backend: {'flash' if flash else 'memory-efficient'}")
    for T in env.pick([4096, 2048, 1024, 512], [4096]):
        _, k_cache, v_cache, tables, _ = paged_case([T], H, Hkv, D, 16, dtype=dt)
        q = torch.randn(T, H, D, device=dev, dtype=dt)
        kd = k_cache[tables[0].long()].reshape(-1, Hkv, D)[:T].transpose(0, 1).repeat_interleave(G, 0)[None]   # (1, H, T, D)
        vd = v_cache[tables[0].long()].reshape(-1, Hkv, D)[:T].transpose(0, 1).repeat_interleave(G, 0)[None]
        qd = q.transpose(0, 1)[None].contiguous()

        def sdpa(qd, kd, vd):
            with sdpa_kernel(backends):
                return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)

        mine = lambda q, k_cache, v_cache: paged_prefill(q, k_cache, v_cache, tables[0], T, scale)
        diff = (mine(q, k_cache, v_cache).float() - sdpa(qd, kd, vd)[0].transpose(0, 1).float()).abs().max().item()
        t_mine = bench_replayed(mine, q, k_cache, v_cache) * 1e-3
        t_sdpa = bench_replayed(sdpa, qd, kd, vd) * 1e-3
        flops = 4 * D * H * T * (T + 1) / 2
        print(f"T={T:5d}: yours {t_mine * 1e6:8.1f} us ({flops / t_mine / 1e12:5.1f} TFLOP/s), SDPA {t_sdpa * 1e6:8.1f} us "
              f"({flops / t_sdpa / 1e12:5.1f} TFLOP/s): yours runs at {t_sdpa / t_mine:.2f}x SDPA's speed; max |diff| {diff:.1e}")
        if T == 4096:
            from course.report import record
            record("prefill_vs_sdpa_4096", t_sdpa / t_mine, "x", "the paged prefill kernel >= 0.5x SDPA's flash backend at 4k tokens on an H100",
                   device=gpu, dtype=dt_name, backend="flash" if flash else "efficient", timing="CUDA-graph replay")
    tuned = autotuned(paged_prefill_kernel, PREFILL_CONFIGS, PREFILL_TUNE_KEY)     # the wrapper the launcher used
    print("the configuration autotuning kept:", getattr(tuned, "best_config", None))
"""),
md(r"""
### On a GPU: read a profile

Where does the time of one split-KV call go? `torch.profiler` records every kernel the GPU ran and every
operation the CPU issued. Read the table: your two kernels (device time per call), the `empty`
allocations of the partial buffers, and the CPU time it takes Python to check the arguments and
launch both kernels. When the CPU time per call is longer than the GPU time, the GPU waits for
Python between calls: in a real engine, CUDA graphs (lab 02) replay the launches without Python, and
that is why the benchmark above timed replays. (The profile reruns one set of inputs, so its keys and
values sit in the L2 cache: its kernel times can come out below the benchmark's, which reads them
from memory. And it launches stage 2 in order: with PDL, stage 2's time would start while stage 1
runs and count its wait.)
"""),
code(r"""
if not env.gpu:
    print("skipped: no GPU here")
else:
    from functools import partial
    from torch.profiler import ProfilerActivity, profile

    paged, _ = decode_case(32, 1024)
    split_in_order = partial(paged_attention_split, pdl=False)     # with PDL, stage 2's time would include its wait
    split_in_order(*paged)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            split_in_order(*paged)
        torch.cuda.synchronize()
    events = prof.key_averages()
    print(events.table(sort_by="device_time_total", row_limit=8))
    gpu_us = {e.key: e.device_time_total / 20 for e in events if e.device_time_total > 0}
    stage1 = sum(t for k, t in gpu_us.items() if "paged_decode_split_kernel" in k)
    stage2 = sum(t for k, t in gpu_us.items() if "split_reduce_kernel" in k)
    start = time.perf_counter()
    for _ in range(100):
        split_in_order(*paged)
    cpu_us = (time.perf_counter() - start) / 100 * 1e6
    torch.cuda.synchronize()
    print(f"per call at 32 x 1024: stage 1 {stage1:.1f} us and stage 2 {stage2:.1f} us on the GPU; "
          f"{cpu_us:.1f} us of CPU time to launch them")
    from course.report import record
    record("split_kv_stage2_share", stage2 / max(stage1 + stage2, 1e-9), "of GPU time", "stage 2 is a small part of a split-KV call",
           device=gpu, dtype=dt_name, shape="32x1024")
    record("split_kv_cpu_launch_us", cpu_us, "us", "launching from Python costs microseconds of CPU per call", device=gpu)
"""),
md(r"""
### Explain the gap (write it down)

Answer in your own words, in the cell under each question, with **your** numbers (on a CPU, with the
floors and program counts above, and say what you expect a GPU to show). A person grades these
(4 points in all).

1. At 32 x 1k and at 8 x 8k, what fraction of the roofline does your best kernel reach, and how fast is
   it next to SDPA on gathered keys and values? Which of the two shapes is closer to the roofline, and why?
"""),
answer("gap_roofline_answer", 1, "question 1", model=r"""
(Example: the course's H100 run, bf16, CUDA-graph replays; each student quotes their own numbers.)
At 32 x 1k a call must read `32 x 1,024 x 3 x 64 x 2 x 2` = 25.2 MB of keys and values, a floor of
7.5 us at 3,350 GB/s; the split-KV kernel reached 48% of the roofline (about 16 us) and ran at 0.98x
SDPA's speed on keys and values already gathered. At 8 x 8k (50.3 MB, a floor of 15 us) it reached
61% and ran 2.98x as fast as SDPA. (On an H200: 43% and 51%, 1.23x and 3.63x.) The long shape is
closer to the roofline: each call moves twice the bytes, so the fixed costs of a call (two kernels
in a row and the gap between them, the programs' start-up and the last, partly filled wave, stage
2's merge) are a smaller share of it, and each program's loop is long enough to keep loads in
flight. SDPA falls furthest behind at 8 x 8k, most likely because a kernel written for many query
rows gets little parallelism from 24 (sequence, KV head) pairs of 3 queries each: the problem
split-KV fixes. On a CPU the answer is what the floors predict (a few to a few tens of microseconds
per layer) and the expectation that the long shape comes closer to its floor.
""", rubric=r"""
- 0.5: both fractions of the roofline and both speed ratios against SDPA, from the student's run (on a
  CPU, the floors from the table and a stated expectation for a GPU).
- 0.5: the long shape is closer, because fixed per-call costs (launch gap, stage 2, start-up and tail)
  weigh less against more bytes (and SDPA lacks the split that fills the SMs at 8 x 8k).
"""),
md(r"""
2. From the profile: what share of a call is stage 2? How much did launching it early (PDL) save on
   your GPU, and what is left of the gap between the two kernels? What would it cost to merge inside
   stage 1 instead?
"""),
answer("gap_stage2_answer", 1, "question 2", model=r"""
Stage 2 does little work (it reads `n_splits` partial outputs of 64 floats and one lse per head: at
32 x 1k, 32 x 9 x 4 x 65 x 4 bytes, about 0.3 MB) but is a second kernel that can only start when stage
1 has finished: in the profile its kernel is a small share of the call's GPU time (around a tenth),
and the gap around it costs as much again (on the H200 we tried, stage 1 alone took 10.5 us and the
pair 12.2 us: the merge and its launch about 1.7 us, 14%). PDL lets stage 2 launch and start its
programs while stage 1 runs, which hides the launch latency (the saving the cell printed, of the
order of a microsecond at 32 x 1k, less in relative terms at 8 x 8k). What is left: stage 2 must still wait (`gdc_wait`) until every stage-1
program has finished and its stores are visible, so the tail of stage 1 (its slowest program) and
stage 2's own loads and stores stay on the critical path. Merging inside stage 1 (each program
stores its part, takes a ticket from an atomic counter, and the last one of a (sequence, KV head)
merges) saves the second launch but adds atomics and a fence, a counter to reset, and a serial round
of loads behind the slowest split; on the H200 it was slower (13.2 us against 12.2 us).
""", rubric=r"""
- 0.5: stage 2's share from the student's profile, and the PDL saving from their run (or, without
  PDL or a GPU, what they expect and why).
- 0.5: what remains (the wait for stage 1 to finish and its stores, stage 2's own work) and the cost of
  merging inside stage 1 (atomic ticket, extra loads behind the slowest split; no guaranteed gain).
"""),
md(r"""
3. Name two more reasons your kernel is below the roofline that you can see in your numbers (think of
   the gap between two kernels of a graph against a floor of microseconds, the number of programs
   against the SMs, the last wave of programs, the padded rows of `tl.dot`, the `TILE` autotuning
   picked, the split length the sweep found fastest). What would `triton.testing.do_bench`, which
   launches every call from Python, have reported at 32 x 1k, judging by the profile's CPU time per
   call?
4. Why can v2 not reach the roofline at 8 x 8k, however well it is tuned?
"""),
answer("gap_reasons_answer", 2, "questions 3 and 4", model=r"""
3. Any two, backed by the student's numbers, for example: the gap between the two kernels of the graph
   (a microsecond or two) against a floor of 7.5 us at 32 x 1k; the programs against the SMs: 384
   programs at 32 x 1k are 2.9 per SM on an H100's 132, so the last wave leaves SMs idle while the
   slowest programs finish (at 8 x 8k, 312 programs: 2.4 per SM); each program covers only 256 (32 x 1k)
   or 640 (8 x 8k) tokens, two to five tiles, too short a loop to keep enough loads in flight, and the
   key addresses come from the block table, which limits how far ahead the loads can be issued; the
   split length the sweep found fastest differs from the launcher's choice (the rule of thumb is not
   your GPU's optimum); the `TILE` autotuning kept; the 13 padded rows of `tl.dot` cost registers (not
   bytes). `do_bench`, launching from Python, would have timed the CPU: at 32 x 1k the profile showed
   tens of microseconds of CPU time per call (about 90 us on the H100 we tried) against about 10-16 us of
   GPU work, so it would have reported roughly the CPU time, a fraction of the bandwidth (around 10%
   of the roofline instead of about 50%).
4. v2 runs one program per (sequence, KV head): 8 x 3 = 24 programs at 8 x 8k, and one program runs on
   one SM, so at most 24 of an H100's 132 SMs (18%) work. Each SM can keep only a limited number of
   loads in flight, so 24 SMs cannot pull the whole memory bandwidth, whatever the tile size, warps or
   stages. Only more programs help: splitting each sequence's context (split-KV) or more sequences.
""", rubric=r"""
- 1: question 3: two distinct reasons, each tied to a number of the student's (0.25 each); the do_bench
  answer: it would time Python's launches, about the profile's CPU time per call, far above the GPU
  time (0.5). On a CPU, the same reasons argued from the program counts and floors.
- 1: question 4: 24 programs (B x Hkv) on 132 SMs; programs cannot spread over idle SMs, so no tuning
  of a program reaches the bandwidth; the remedy is more programs (split-KV).
"""),
md(r"""
## 6. Your kernels in the engine

On a GPU, the engine of lab 05 runs with your Triton kernels in place of the PyTorch functions:
`store_kv` writes every new key and value, your split-KV kernel does every decode attention. It must
give the same tokens as the contiguous engine of lab 04 and, with a kernel that reads the blocks in
place, run about as fast or faster. In bf16 or fp16 two kernels that add up the same numbers in a
different order can break a near-tie between two tokens differently, and from there the texts part:
over 64 tokens most requests may. Where they part does not tell a near-tie from a bug. This model's
two best tokens can lie a few hundredths of a logit apart as early as the third new token, and
bf16 rounds a logit near 20 to steps of 0.125. float32 rounds about 65,000 times finer, so the cell
runs the six prompts once more in float32: there every request must agree, and one that does not
points to a bug. In the interpreter a forward pass would launch thousands of slow programs per step,
so on a CPU this cell only says so.
"""),
code(r"""
if not env.gpu:
    print("skipped: no GPU here. In the interpreter the engine would take minutes per step; the kernels were checked above.")
else:
    texts = ["The capital of France is", "Once upon a time, in a small village by the sea, there lived",
             "def fibonacci(n):", "The three primary colors are", "My trip to Yosemite was", "The quick brown fox"]
    n_req, new_tokens, B = env.pick((32, 64, 16), (8, 16, 8))
    def workload(n=n_req):                          # n requests, the texts in turn
        return [Request(i, tokenizer(texts[i % len(texts)]).input_ids, new_tokens) for i in range(n)]
    max_len = max(len(r.prompt) for r in workload()) + new_tokens
    n_blocks = B * -(-max_len // 16)
    yours = dict(attention=paged_attention_split, write_kv=store_kv)
    contiguous_generate(model, workload()[:2], 2, max_len)                          # warm-up (and autotuning)
    paged_generate(model, workload()[:2], 2, n_blocks, 16, **yours)
    runs = {"contiguous (slots, SDPA)": contiguous_generate(model, workload(), B, max_len),
            "paged (PyTorch reference)": paged_generate(model, workload(), B, n_blocks, 16),
            "paged (your Triton kernels)": paged_generate(model, workload(), B, n_blocks, 16, **yours)}
    print(f"{n_req} requests x {new_tokens} tokens, batches of {B}, {env.dtype} on {torch.cuda.get_device_name(0)}")
    pairs = list(zip(runs["paged (your Triton kernels)"].outputs, runs["contiguous (slots, SDPA)"].outputs))
    same = sum(a == b for a, b in pairs)
    # where each pair that differs parts: its first differing token (a shorter output parts where it ends)
    first_diff = sorted(next(i for i, (x, y) in enumerate(zip(a + [None], b + [-1])) if x != y) for a, b in pairs if a != b)
    print(f"requests with the same tokens as the contiguous engine: {same} of {n_req}"
          + (f"; the others part at new token {first_diff[0] + 1} at the earliest, {first_diff[len(first_diff) // 2] + 1} "
             f"in the median (of {new_tokens})" if first_diff else ""))
    for name, run in runs.items():
        print(f"{name:>30}: {run.throughput:7.1f} tokens/s   (decode steps: {getattr(run, 'graphs', 'eager')})")
    ratio = runs["paged (your Triton kernels)"].throughput / runs["contiguous (slots, SDPA)"].throughput
    print(f"the paged engine with your kernels runs at {ratio:.2f}x the contiguous engine's throughput")
    from course.report import record
    where = dict(device=torch.cuda.get_device_name(0), dtype=str(env.dtype), requests=n_req, batch=B)
    record("engine_paged_triton_vs_contiguous", ratio, "x", "the paged engine with your kernels runs about as fast as the contiguous one (>= 0.9x on an H100)", **where)
    record("engine_same_tokens", same / n_req, "of requests", "the engine with your kernels gives the contiguous engine's tokens (a near-tie may part them)", **where)
    if env.dtype != torch.float32:                      # float32 tells a near-tie from a bug
        model32 = course.load_model(device=env.device, dtype=torch.float32)
        n = len(texts)                                  # each text once
        ref32 = contiguous_generate(model32, workload(n), n, max_len).outputs
        yours32 = paged_generate(model32, workload(n), n, n * -(-max_len // 16), 16, **yours).outputs
        same32 = sum(a == b for a, b in zip(yours32, ref32))
        print(f"in float32: {same32} of {n} prompts give the contiguous engine's {new_tokens} tokens"
              + (": the partings above are near-ties" if same32 == n else ": in float32 all must agree, so look for a bug"))
        record("engine_same_tokens_fp32", same32 / n, "of requests", "in float32 the engine with your kernels gives the contiguous engine's tokens", **dict(where, dtype="torch.float32", requests=n, batch=n))
        del model32
"""),
md(r"""
## Summary

- A Triton kernel is the work of one **program**; a **grid** of programs runs in parallel, each finding
  its share from `tl.program_id`. Programs load and store tiles, and **masks** switch off the lanes
  outside the data: past a sequence's length or a split's end, padded heads and rows, a negative slot.
- Paged decode attention keeps an **online softmax** across the blocks it reads through the block table;
  one program per (sequence, KV head) serves a whole GQA group with one read of each key.
- Decode attention is memory-bound: its floor is the bytes of keys and values over the memory bandwidth,
  and a kernel is judged by the fraction of that roofline it reaches.
- **Split-KV** gives long contexts enough programs to use every SM: each split writes its partial output
  and log-sum-exp, and a second kernel merges them with a softmax over the log-sum-exps. Stacking a
  group's query heads as the rows of a tile turns decode into `tl.dot`s. On an H100 or H200,
  programmatic dependent launch starts the second kernel while the first one ends.
- **FlashAttention-style prefill** tiles queries against keys with the same online softmax, skips the
  tiles above the causal diagonal, and works the same for a chunk after cached tokens.
- Check every version against a reference, over dtypes, head layouts and edge cases; compile for the
  GPUs you do not have; time with the GPU's clock and compare with the roofline and a library kernel.

**Questions**. Answer in the cell under each group, in a few sentences of your own, with the
arithmetic where a question asks for a number (about 20 minutes); a person grades them (3 points in all).
1. Your v1 kernel loads each key once per KV head, not once per query head. By how much does that cut
   the bytes read for SmolLM2 (9 query heads, 3 KV heads)?
2. What does each mask in your kernels protect against? Remove one at a time and rerun the check.
3. How many programs do v2 and your split-KV kernel launch for 8 sequences of 8k tokens on an H100?
   What limits the split count from above?
"""),
answer("masks_programs_answer", 1, "questions 1 to 3", model=r"""
1. By the group size, 9 / 3 = 3x: a kernel per query head would read each KV head's keys and values
   three times; v1 reads them once for its group of 3 (at 32 x 1k, 25.2 MB per layer instead of 75.5 MB).
2. `store_kv`: the lane mask (`< Hkv * D`, 192 of 256 lanes) keeps a token from reading past its row
   and writing into the next slot; the slot mask skips padding tokens (slot -1 would write before the
   cache). v1/v2: the head mask (`GROUP_PAD` = 4 rows for 3 heads) keeps the padded row from loading,
   and storing into, the next group's query head (or past the buffer for the last KV head); the
   position mask (`< context_len`) keeps the last block's stale slots (old data, even NaN) out of the
   softmax; v2's block-id mask keeps padding or the next row of the block table from being used as a
   block id. Split-KV: positions `< end` keep a split from counting the next split's tokens;
   `l_safe` keeps an empty split from writing NaN; the real-heads store mask keeps the 13 padded rows
   from overwriting other heads' partials. Stage 2: rows past `n_splits` get lse `-inf` and output 0.
   Prefill: rows `< T`, keys `< hi` and the causal mask (no key after the row's own position). Removed
   one at a time, each shows up in the check as a large difference or NaN, or as memory written where
   it must not be (some only on the cases that exercise them: a partly full block, MQA, an empty split).
3. v2: one program per (sequence, KV head): `8 x 3 = 24`. Split-KV: `choose_split_len(8, 3, 8192, 132)`
   asks for `ceil(2 x 132 / 24) = 11` splits, `8192 // 11 = 744`, rounded down to 640 tokens, so 13
   splits: `24 x 13 = 312` stage-1 programs, then `8 x 9 = 72` stage-2 programs. From above: a split
   must be at least a tile (the launcher never goes below 128 tokens); every split writes a partial
   output and lse per head that stage 2 must read and merge; shorter splits mean shorter loops, less
   latency hidden per program and more fixed cost per token (loading q, storing the part); and once
   every SM has a few programs, more splits add no parallelism.
""", rubric=r"""
- 0.25: question 1: 3x fewer key/value bytes (the group size).
- 0.5: question 2: at least four masks named with what each protects (stale or NaN slots, padded heads
  or rows, padding slots, block-table padding, split boundaries or empty splits, causal/`hi` in
  prefill), and what removing them did in the check (or would do).
- 0.25: question 3: 24 programs for v2, 312 (+72 merge) for split-KV, or the student's count with
  the launcher's arithmetic shown; one valid upper limit on splits.
"""),
md(r"""
4. Why does the merge weight split `i` by `exp(lse_i - max lse)` and not by `exp(lse_i)`? What would an
   fp32 kernel compute for scores around 150?
5. The split-KV kernel computes 16 rows of `tl.dot` for SmolLM2's 3 query heads. Why does that waste
   cost (almost) nothing in decode, and would it in prefill?
"""),
answer("merge_padding_answer", 1, "questions 4 and 5", model=r"""
4. The weights are a softmax over the lse's: `exp(lse_i) / sum_k exp(lse_k)`. Multiplying every term by
   `exp(-max lse)` changes nothing mathematically, and keeps every exponent at or below 0, so the largest
   weight is 1 and nothing overflows. In fp32 `exp(x)` overflows to `inf` above about 88.7. With scores
   around 150, each `lse_i` is about `150 + log(split_len)`, so every `exp(lse_i)` is `inf` and the
   merge computes `inf / inf` = NaN for every output.
5. Decode is memory-bound: its intensity is about 3 FLOPs per byte, against a ridge of hundreds, so
   the tensor cores wait for keys most of the time. One `mma` instruction covers 16 rows anyway, so the
   13 zero rows add no instruction and no memory traffic (their loads are masked, their stores
   skipped); they cost registers, a little occupancy. Prefill is compute-bound: its tiles have 64 or
   128 real query rows and no padding; padding them would waste tensor-core time in proportion, and
   the time is the tensor cores' there.
""", rubric=r"""
- 0.5: question 4: subtracting the max keeps exponents <= 0 (same softmax); scores around 150 overflow
  fp32 exp (limit about 88), giving inf / inf = NaN.
- 0.5: question 5: decode is memory-bound (spare arithmetic; the mma's 16-row minimum; no extra bytes);
  in prefill the arithmetic is the limit, so wasted rows would cost time (prefill tiles are full anyway).
"""),
md(r"""
6. Estimate the arithmetic intensity of the prefill at 4k tokens (FLOPs over the bytes of Q, K, V and the
   output) and compare it with your GPU's ridge point from lab 02. Which roofline applies?
7. At `start = 0`, what fraction of the key tiles does the causal stop at `hi` skip? And for a chunk of
   512 queries after 3,584 cached tokens?
"""),
answer("prefill_roofline_answer", 1, "questions 6 and 7", model=r"""
6. Per layer, `T = 4,096`, bf16: FLOPs `4 x D x H x T (T + 1) / 2 = 4 x 64 x 9 x 4,096 x 4,097 / 2` = 19.3
   GFLOP. Bytes: Q and the output `T x 9 x 64 x 2` = 4.7 MB each, K and V `T x 3 x 64 x 2` = 1.6 MB each,
   12.6 MB in all. Intensity: about 1,540 FLOPs per byte. An H100's bf16 ridge is about 295 FLOP/byte
   (989 TFLOP/s over 3.35 TB/s), an A100's about 150: the prefill sits five to ten times past the ridge,
   so the **compute** roofline applies (judge it in TFLOP/s against the tensor-core peak, as the
   benchmark does), the opposite of decode.
7. At `start = 0`, query tile `j` reads key tiles `0..j` only (with `BLOCK_M = BLOCK_N`), so of `n x n`
   tile pairs it reads `n (n + 1) / 2`: it skips `(n - 1) / (2n)`, just under half (49% for `n = 64`
   tiles of 64 at 4k). For 512 queries after 3,584 cached tokens (4,096 keys): every query tile reads
   all 3,584 cached keys, and only the triangle over the 512 new keys can be skipped: about
   `512 / (2 x 4,096)` = 6% of the key tiles (28 of 512 tile pairs with tiles of 64, 5.5%). Chunked
   prefill after a long past gets almost nothing from the causal stop.
""", rubric=r"""
- 0.5: question 6: FLOPs and bytes of the right order (about 19 GFLOP, 12-13 MB per layer, intensity
  about 1,500), compared with the ridge (a few hundred on a datacenter GPU), and the compute roofline.
  Counting all 30 layers, or fp32, with consistent arithmetic, is fine.
- 0.5: question 7: about half skipped at start = 0; about 5-6% for the chunk after 3,584 cached tokens.
"""),
md(r"""

## Going further

- **Flash-Decoding** (Dao, Haziza, Massa, Sizov, 2023) introduced split-KV for long-context decode;
  **FlashDecoding++** (Hong et al., 2024) avoids the merge's synchronisation with a unified maximum.
- **Fuse the merge?** Stage 2 is a second launch for a few kilobytes. To fold it into stage 1, each
  program stores its partial result, then takes a ticket from a counter of its (sequence, KV head):
  `tl.atomic_add` returns how many splits finished before it (call `tl.debug_barrier()` first, so the
  stores of every thread are out). The program that draws the last ticket merges all the splits and
  resets the counter to 0 for the next call. It saves a launch but adds a round of loads behind the
  slowest split, so whether it pays depends on the GPU: time it beside your two kernels with
  `bench_replayed`. (On the H200 we tried, at 32 x 1k, it did not: 13.2 µs against 12.2 µs.)
- **Read the loop you compiled.** `compile_report(kernel_source(paged_decode_split_kernel), jobs,
  ptx=True)`, with a job for stage 1 as in the compile check above, returns each kernel's PTX under
  `"ptx"` (no GPU needed). With Triton 3.6 or 3.7 for sm_90, a stage 1 written as the steps above
  say compiles to a loop that begins with `cp.async.wait_group 0` (wait for every copy in flight),
  runs its `mma`s, and only then issues the next tile's copies, for each `num_stages` the launcher
  tunes: a key's address comes from a block-table load in the same loop, and the pipeliner gives
  such gathered loads one tile of lead, issued after the arithmetic. Prefetch by hand: at the top
  of the loop load the next tile's keys and values (their block ids loaded one iteration earlier)
  and the block ids after them, then compute with the tile you already hold, and pass the new one
  to the next iteration. Check it against `split_reference` and time both with `bench_replayed`:
  whether it pays is your GPU's call.
- **vLLM**: its first CUDA kernel (PagedAttention v1) gave each thread group one block at a time, like
  your v1; "PagedAttention v2" split the context into partitions of 512 tokens and reduced them, like your
  split-KV; its V1 engine added a *unified* Triton attention backend (one kernel for mixed prefill and
  decode batches), next to its FlashAttention and FlashInfer backends.
- **SGLang**'s Triton decode attention (from LightLLM) has the same two stages, with a group of query
  heads per program and `tl.dot`, as here.
- **FlashInfer** (Ye et al., 2025) generates paged attention kernels for every layout and reaches close
  to the memory bandwidth on long contexts; **FlashAttention-2/3** (Dao 2023; Shah et al. 2024) are the
  prefill kernels most engines call (FA3 uses Hopper's `wgmma` and TMA asynchronously).
- Triton's tutorials (`06-fused-attention.py`): the same online softmax with block pointers, a separate
  loop for the diagonal tiles, and `exp2` with the scale folded in.
"""),
]
