"""Split-KV decode attention: versions of stage 1 side by side, checked and timed (issue 16's target:
>= 50% of HBM bandwidth at 32 sequences x 1k tokens on an H100), in the manner of llm.c's dev/cuda.

    python dev/split_kv.py --out split.json        # a GPU: check every version, then time them all
    python dev/split_kv.py --budget-s 180 --out split.json   # the same, the sweep stopped after 180 s
    python dev/split_kv.py --check                 # a CPU: the check alone, in Triton's interpreter

Versions of stage 1 (each followed by the lab's merge, `split_stage2`):
  lab       the lab's solution kernel, from labs/06_triton_kernels, as the student writes it.
  prefetch  the same arithmetic, with the next tile's keys and values loaded before this tile's dot
            products, and block ids two tiles ahead. Why: compiled for sm_90, the lab's loop waits for
            every copy in flight at its top (`cp.async.wait_group 0`), computes, and only then issues the
            next tile's loads, for every num_stages the launcher tunes: its gathered loads (the address
            comes from a block-table load in the same loop) get one tile in flight and no overlap with
            the arithmetic. Here the loads are plain register loads, issued first.
            dev/lab06_lookahead.patch makes it the lab's solution (Problem 4).

Timing: CUDA-graph replays over input copies that outrun the L2 cache (`course.kernels.bench_replayed`),
in bf16 (fp16 without bf16), for every version x split length x configuration (TILE, num_warps,
num_stages), stage 2 launched in order and, on sm_90 and later, with programmatic dependent launch;
beside them the lab's own launcher (autotuned, its split length) and SDPA on the same keys and values
gathered contiguous. Prints the fastest rows per shape and writes every row to --out (JSON), after the
check and again after each shape, so that a run stopped at a time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import types
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

if not torch.cuda.is_available():            # Triton reads it when first imported: set before that
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from autograder.lab_kernels import load_lab_module  # noqa: E402

GPU = torch.cuda.is_available()


@triton.jit
def _kv_tile(k_cache_ptr, v_cache_ptr, block, pos, valid, kv_head, d, dtype: tl.constexpr,
             BLOCK_SIZE: tl.constexpr, H_KV: tl.constexpr, D: tl.constexpr):
    """Keys and values (TILE, D) at positions `pos` of one sequence, their blocks given: as in the lab."""
    offs = (block * BLOCK_SIZE + pos % BLOCK_SIZE)[:, None] * (H_KV * D) + kv_head * D + d[None, :]
    k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(dtype)
    v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(dtype)
    return k, v


@triton.jit
def split_prefetch_kernel(part_out_ptr, part_lse_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                          context_lens_ptr, scale, max_blocks, split_len, n_splits,
                          H: tl.constexpr, H_KV: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                          BLOCK_SIZE: tl.constexpr, D: tl.constexpr, TILE: tl.constexpr, DOT_F32: tl.constexpr,
                          USE_PDL: tl.constexpr):
    """The lab's stage 1 with its loads issued a tile ahead: (seq, kv_head, split) as there."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
    ctx = tl.load(context_lens_ptr + seq)
    start = split * split_len
    end = tl.minimum(start + split_len, ctx)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D)
    j = tl.arange(0, TILE)
    head = kv_head * GROUP + g
    head_ok = g < GROUP
    q = tl.load(q_ptr + seq * H * D + head[:, None] * D + d[None, :], mask=head_ok[:, None], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)
    table = block_tables_ptr + seq * max_blocks
    # before the loop: the first tile's keys and values, the second tile's block ids
    pos = start + j
    valid = pos < end
    block = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    k, v = _kv_tile(k_cache_ptr, v_cache_ptr, block, pos, valid, kv_head, d, q.dtype, BLOCK_SIZE, H_KV, D)
    pos_1 = pos + TILE
    valid_1 = pos_1 < end
    block_1 = tl.load(table + pos_1 // BLOCK_SIZE, mask=valid_1, other=0).to(tl.int64)
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D], tl.float32)
    for t0 in range(start, end, TILE):
        # first the loads: the next tile's keys and values (its block ids are here), the block ids after it
        k_1, v_1 = _kv_tile(k_cache_ptr, v_cache_ptr, block_1, pos_1, valid_1, kv_head, d, q.dtype, BLOCK_SIZE, H_KV, D)
        pos_2 = pos_1 + TILE
        valid_2 = pos_2 < end
        block_2 = tl.load(table + pos_2 // BLOCK_SIZE, mask=valid_2, other=0).to(tl.int64)
        # then this tile's arithmetic, as in the lab
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
        m = m_new
        k, v, valid = k_1, v_1, valid_1
        pos_1, valid_1, block_1 = pos_2, valid_2, block_2
    l_safe = tl.where(l > 0, l, 1.0)
    lse = m + tl.log(l_safe)
    row = (seq * H + head) * n_splits + split
    tl.store(part_out_ptr + row[:, None] * D + d[None, :], acc / l_safe[:, None], mask=head_ok[:, None])
    tl.store(part_lse_ptr + row, lse, mask=head_ok)


# (TILE, num_warps, num_stages): the lab's autotuned set and a few around it
CONFIGS = [(16, 2, 1), (32, 2, 2), (32, 4, 1), (64, 4, 1), (64, 4, 2), (64, 4, 3), (128, 4, 1), (128, 4, 3), (128, 8, 2)]


def split_attention(lab, kernel, q, k_cache, v_cache, tables, lens, scale, split_len, config, pdl):
    """Stage 1 by `kernel` with one configuration, then the lab's merge: (B, H, D) in q's dtype."""
    B, H, D = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    n_splits = -(-tables.shape[1] * block_size // split_len)
    part_out = torch.empty(B, H, n_splits, D, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(B, H, n_splits, dtype=torch.float32, device=q.device)
    tile, warps, stages = config
    meta = dict(num_warps=warps, num_stages=stages) if q.is_cuda else {}
    group = H // Hkv
    kernel[(B, Hkv, n_splits)](part_out, part_lse, q, k_cache, v_cache, tables, lens, scale, tables.shape[1], split_len,
                               n_splits, H=H, H_KV=Hkv, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
                               BLOCK_SIZE=block_size, D=D, TILE=tile, DOT_F32=not q.is_cuda, USE_PDL=pdl, **meta)
    return lab.split_stage2(part_out, part_lse, torch.empty_like(q), pdl=pdl)


# (H, Hkv, block_size, lengths, split lengths): ragged lengths, a split of one block, splits that end inside
# a block and a tile, more splits than a sequence has tokens, one split longer than every context
CHECK_CASES = [(9, 3, 4, [1, 5, 13, 22], (4, 8, 40)), (8, 1, 8, [2, 8, 25], (3, 16, 33))]


def versions(lab) -> dict:
    return {"lab": lab.paged_decode_split_kernel, "prefetch": split_prefetch_kernel}


def check(lab, device) -> list[dict]:
    """Every version against the course's reference (`paged_attention`, float32 inside, rounded to the
    inputs' dtype), in fp32, fp16 and (where the GPU has it) bf16: on a GPU
    every configuration in the dtype it times, in the interpreter TILE 16. Returns one row per run."""
    dtypes = [torch.float32, torch.float16]
    if device == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        dtypes.append(torch.bfloat16)
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 5e-2}
    timed = torch.bfloat16 if torch.bfloat16 in dtypes else torch.float16
    rows = []
    for name, kernel in versions(lab).items():
        for H, Hkv, bs, lens, split_lens in CHECK_CASES:
            for dtype in dtypes:
                args = lab.paged_case(lens, H, Hkv, 16, bs, dtype=dtype, seed=H + bs)   # on the lab's device
                want = lab.paged_attention(*args, 0.25).cpu().double()                # the course's reference
                # a GPU: every configuration in the dtype it times, one in the others; the interpreter: TILE 16
                configs = [(16, 4, 1)] if device != "cuda" else CONFIGS if dtype == timed else CONFIGS[3:4]
                for split_len in split_lens:
                    for config in configs:
                        got = split_attention(lab, kernel, *args, 0.25, split_len, config, pdl=lab.PDL)
                        err = (got.cpu().double() - want).abs().max().item()
                        rows.append(dict(version=name, case=f"H={H} Hkv={Hkv} bs={bs} {lens}", dtype=str(dtype),
                                         split_len=split_len, config=config, err=err, ok=err < tol[dtype]))
    return rows


def time_all(lab, shapes, dtype, device="cuda", bench=None, peak=None, configs=CONFIGS, budget_s=None,
             on_shape=None, clock=time.perf_counter) -> list[dict]:
    """Every version x split length x configuration at each (batch, ctx), in microseconds per call.
    `bench` (default bench_replayed: ms per call) and `peak` (bytes/s) stand in for a GPU's in a dry run.
    `budget_s`: seconds for the sweep, shared evenly between the shapes. The sweep runs in groups, each
    every version at one split length and configuration (the launcher's split length first), and a
    shape's sweep stops between groups once its share is spent, saying how many rows it left out: what
    was timed compares like with like. `on_shape(rows)` after each shape, to write what is measured so
    far (a run cut off at its limit keeps it)."""
    import torch.nn.functional as F

    if bench is None:
        from course.kernels import bench_replayed as bench
    if peak is None:
        from course.hardware import device_peak
        peak = device_peak(types.SimpleNamespace(device=device, quick=True), dtype).bytes_per_s
    bench_replayed = bench
    H, Hkv, D, bs = 9, 3, 64, 16                     # SmolLM2-135M
    scale = D ** -0.5
    rows = []
    started = clock()
    for i, (batch, ctx) in enumerate(shapes):
        stop_at = float("inf") if budget_s is None else started + budget_s * (i + 1) / len(shapes)
        args = lab.paged_case([ctx] * batch, H, Hkv, D, bs, dtype=dtype)                  # on the lab's device
        nbytes = 2 * batch * ctx * Hkv * D * dtype.itemsize
        shape = f"{batch}x{ctx}"

        def add(name, us, **how):
            rows.append(dict(shape=shape, version=name, us=us, gbs=nbytes / us / 1e3, of_peak=nbytes / (us * 1e-6) / peak, **how))

        kd = args[1][args[3].long()].reshape(batch, -1, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
        vd = args[2][args[3].long()].reshape(batch, -1, Hkv, D)[:, :ctx].transpose(1, 2).contiguous()
        qd = args[0].view(batch, Hkv, H // Hkv, D)
        add("sdpa (gathered)", bench_replayed(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=scale), qd, kd, vd) * 1e3)
        del kd, vd
        lab.paged_attention_split(*args, scale)                        # autotunes once, outside the graph
        chosen = lab.choose_split_len(batch, Hkv, ctx)
        add("lab launcher", bench_replayed(lab.paged_attention_split, *args, scale) * 1e3, split_len=chosen, pdl=lab.PDL)
        want = lab.paged_attention_split(*args, scale).float()
        others = sorted({128, 256, 512, 1024} & set(range(128, ctx + 1)) - {chosen})
        sweep = [(split_len, config, name, kernel) for split_len in [chosen] + others for config in configs
                 for name, kernel in versions(lab).items()]
        for n_done, (split_len, config, name, kernel) in enumerate(sweep):
            if n_done % len(versions(lab)) == 0 and clock() > stop_at:      # a whole group, or none of it
                rows.append(dict(shape=shape, left_out=len(sweep) - n_done, why=f"past the budget of {budget_s:g} s"))
                print(f"  {shape}: budget spent, {len(sweep) - n_done} of {len(sweep)} sweep rows left out", flush=True)
                break
            fn = partial(split_attention, lab, kernel, split_len=split_len, config=config, pdl=lab.PDL)
            try:
                err = (fn(*args, scale).float() - want).abs().max().item()
                us = bench_replayed(fn, *args, scale) * 1e3
            except Exception as e:  # noqa: BLE001 - one configuration out of resources is a row, not the end
                rows.append(dict(shape=shape, version=name, split_len=split_len, config=config, error=str(e)[:200]))
                continue
            add(name, us, split_len=split_len, config=config, pdl=lab.PDL, max_diff_vs_lab=err)
        if lab.PDL:                                                    # the fastest row of each version, in order
            for name, kernel in versions(lab).items():
                best = min((r for r in rows if r["shape"] == shape and r.get("version") == name and "us" in r),
                           key=lambda r: r["us"], default=None)
                if best is None:
                    continue
                fn = partial(split_attention, lab, kernel, split_len=best["split_len"], config=best["config"], pdl=False)
                add(name, bench_replayed(fn, *args, scale) * 1e3, split_len=best["split_len"], config=best["config"], pdl=False)
        where = torch.cuda.get_device_name(0) if device == "cuda" else device
        print(f"\n{shape}, {dtype} on {where} ({nbytes / 1e6:.1f} MB of K/V, "
              f"peak {peak / 1e9:,.0f} GB/s):")
        mine = sorted((r for r in rows if r["shape"] == shape and "us" in r), key=lambda r: r["us"])
        shown = mine[:12] + [r for r in mine[12:] if r["version"] in ("sdpa (gathered)", "lab launcher")]
        for r in shown:
            how = f"split_len {r['split_len']:5d} TILE/warps/stages {r['config']} pdl {r['pdl']}" if "config" in r else \
                  (f"split_len {r['split_len']:5d} autotuned pdl {r['pdl']}" if "split_len" in r else "")
            print(f"  {r['version']:<16} {r['us']:8.1f} us {r['gbs']:7.0f} GB/s {r['of_peak']:5.1%}   {how}")
        for name in versions(lab):
            best = min((r for r in mine if r["version"] == name), key=lambda r: r["us"], default=None)
            if best:
                print(f"  fastest {name}: {best['us']:.1f} us, {best['of_peak']:.1%} of peak "
                      f"(split_len {best['split_len']}, {best['config']}, pdl {best['pdl']})")
        if on_shape:
            on_shape(rows)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="check the versions only (what a CPU can do)")
    parser.add_argument("--shapes", default="32x1024,8x8192", help="batch x context pairs to time (GPU)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds for the timing sweep, shared between the shapes (default: no limit)")
    parser.add_argument("--out", type=Path, help="write every row (check and timing) to this JSON file, "
                                                 "after the check and again after each shape")
    args = parser.parse_args(argv)
    if args.budget_s is not None and args.budget_s <= 0:
        parser.error(f"--budget-s must be a number of seconds > 0, got {args.budget_s:g}")
    started = time.time()
    checked, timed = [], []

    def write(rows=None):
        if args.out:
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0) if GPU else "cpu", "check": checked,
                                            "timing": timed if rows is None else rows,
                                            "seconds": round(time.time() - started, 1)}, indent=1))

    with tempfile.TemporaryDirectory(prefix="split-kv-dev-") as tmp:
        lab = load_lab_module(gpu=GPU, directory=Path(tmp))
        device = "cuda" if GPU else "cpu"
        checked = check(lab, device)
        bad = [r for r in checked if not r["ok"]]
        print(f"check on {device}: {len(checked) - len(bad)} of {len(checked)} runs agree with the course's reference",
              flush=True)
        for r in bad:
            print(f"  FAIL {r['version']} {r['case']} {r['dtype']} split_len {r['split_len']} {r['config']}: {r['err']:.1e}")
        write()
        if GPU and not args.check and not bad:
            dtype = torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
            shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",")]
            timed = time_all(lab, shapes, dtype, budget_s=args.budget_s, on_shape=write)
        elif not GPU and not args.check:
            print("no GPU here: nothing to time (pass --check to say so)")
    write()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
