"""Lab 10, section 5: keys and values in 8 bits, int8 with per-token or per-head scales and fp8
e4m3 (Problems 4 and 5): memory, perplexity, attention time. Assembled by lab10.py."""
from autograder.authoring import code, md, solution, tests

# The hidden references: absmax quantization in float64, and the e4m3 grid read off torch's own
# cast (neither calls the course or the student's code).
HIDDEN_ABSMAX_REF = r'''
def _ref_absmax(x, dims, bits):
    qmax = 2 ** (bits - 1) - 1
    amax = x.double().abs().amax(dim=dims, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    return (x.double() / scale).round().clamp(-qmax, qmax), scale, qmax
def _check_absmax(x, dims, bits):
    what = f"quantize_absmax(x of shape {tuple(x.shape)}, dims={dims}, bits={bits})"
    got = expect_tuple(quantize_absmax(x, dims, bits), what, 2)
    want_q, want_s, qmax = _ref_absmax(x, dims, bits)
    q = expect_tensor(got[0], what + "[0]", dtype=torch.int8, shape=tuple(x.shape), device=x.device)
    s = expect_tensor(got[1], what + "[1]", dtype=torch.float32, shape=tuple(want_s.shape), device=x.device, finite=True)
    assert bool((s > 0).all()), f"{what}: every scale must be positive (an all-zero group too: any positive scale works)"
    amax = x.double().abs().amax(dim=dims, keepdim=True)
    live = (amax > 0).expand_as(q)
    assert torch.allclose(s.double()[amax > 0], want_s[amax > 0], rtol=1e-5, atol=0), \
        f"{what}: scale = max|x| / {qmax} over the group (dims {dims})"
    assert int(q.abs().max()) <= qmax, f"{what}: codes must stay within [-{qmax}, {qmax}]"
    diff = (q.double() - want_q).abs()
    assert float(diff.max()) <= 1 and float((diff > 0).double().mean()) < 0.01, \
        f"{what}: codes must be round(x / scale) (at most a tie away from the reference)"
    err = (q.double() * s.double() - x.double()).abs()
    assert bool((err <= s.double() / 2 * (1 + 1e-4) + 1e-7).all()), f"{what}: |dequantized - x| must stay within scale / 2"
    assert not bool(q[~live].any()), f"{what}: an all-zero group must give zero codes"
    top = (x.double().abs() == amax) & (amax > 0)
    assert bool((q.abs()[top] == qmax).all()), f"{what}: the largest |x| of each group must map to +-{qmax}"
'''.strip("\n")

cells = [
md(r"""
## 5. Store each token in fewer bits

The second lever: keep every token, but store each number in 8 bits instead of 16 or 32. The simplest
scheme is **absmax** (symmetric) quantization. A group of numbers shares one float `scale`; each
number becomes the nearest integer code of `x / scale`:

```
scale = max |x| / 127                 (the largest number of the group maps to 127 or -127)
code  = round(x / scale)              an int8 in [-127, 127]
x'    = code * scale                  what attention reads back: off by at most scale / 2
```

**Granularity** is what the group is. One scale for a whole layer's cache is set once (calibrated, or
1.0 by default) and lets one large value anywhere coarsen everything. vLLM's fp8 cache works this way:
e4m3's wide range absorbs much of the spread. int8 has no such range, so int8 caches use smaller
groups: a scale per **token** (all its KV heads together) or per **(token, head)** (an int8 KV cache proposed for nano-vllm
does this and saves 48% of the memory), stored next to the codes. The smaller the group, the better one outlier is contained, and
the more scales to store (Problem 1 counted them).

Two traps. A group of zeros has `max |x| = 0`: dividing by a zero scale gives NaN codes, so use any
positive scale there (the codes are 0 anyway). And 127, not 128: int8 reaches -128, but +128 would wrap
around to -128.

## Problem 4: int8 with per-token or per-head scales (4 points)

**Deliverable:** `quantize_absmax(x, dims, bits=8)`: returns `(codes, scale)`. `scale` is float32, the
shape of `x` with the axes in `dims` kept at size 1 (keepdim): `max |x|` over those axes divided by
`qmax = 2**(bits - 1) - 1` (1.0 where that max is 0). `codes` is int8, the shape of `x`: `round(x / scale)`
clamped to `[-qmax, qmax]`. Do not change `x`. In the cache's layout `(tokens, Hkv, D)`, `dims=(-1,)`
gives a scale per (token, head) and `dims=(-2, -1)` a scale per token. `dequantize(codes, scale)`
(given, from `course.quant`) reads them back.
"""),
solution("quantize_absmax", r'''
def quantize_absmax(x: torch.Tensor, dims: tuple[int, ...], bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization with one float32 scale per group (the axes `dims` form a group): (int8 codes, scale)."""
    ### BEGIN SOLUTION
    qmax = 2 ** (bits - 1) - 1
    amax = x.float().abs().amax(dim=dims, keepdim=True)
    scale = torch.where(amax > 0, amax / qmax, torch.ones_like(amax))
    codes = (x.float() / scale).round().clamp(-qmax, qmax).to(torch.int8)
    return codes, scale
    ### END SOLUTION
'''),
tests("quantize_absmax_tests", 4, r"""
x = torch.tensor([[[1.0, -2.54, 0.5, 0.013], [0.0, 0.0, 0.0, 0.0]],
                  [[4.0, 1.0, -1.0, 2.2], [0.1, -0.2, 0.3, 0.4]]], device=dev)      # (2 tokens, 2 KV heads, D = 4)
x0 = x.clone()
got = expect_tuple(quantize_absmax(x, (-1,)), "quantize_absmax(x, (-1,))", 2)
q = expect_tensor(got[0], "codes", dtype=torch.int8, shape=(2, 2, 4), device=dev)
s = expect_tensor(got[1], "scale", dtype=torch.float32, shape=(2, 2, 1), device=dev, finite=True)
assert torch.equal(x, x0), "quantize_absmax must not change its input"
assert abs(float(s[0, 0, 0]) - 0.02) < 1e-7, "token 0, head 0: max |x| = 2.54, so scale = 2.54 / 127 = 0.02"
assert q[0, 0].tolist() == [50, -127, 25, 1], f"codes round(x / 0.02) = [50, -127, 25, 1], got {q[0, 0].tolist()}"
assert not bool(q[0, 1].any()) and float(s[0, 1, 0]) > 0, "an all-zero head: codes 0 and a positive scale, never NaN"
assert torch.isfinite(dequantize(q, s)).all() and float((dequantize(q, s) - x).abs().max()) <= float(s.max()) / 2 + 1e-6, \
    "dequantize(codes, scale) is within scale / 2 of x"
got = expect_tuple(quantize_absmax(x, (-2, -1)), "quantize_absmax(x, (-2, -1))", 2)
s = expect_tensor(got[1], "per-token scale", dtype=torch.float32, shape=(2, 1, 1), device=dev, finite=True)
assert abs(float(s[0, 0, 0]) - 0.02) < 1e-7 and abs(float(s[1, 0, 0]) - 4 / 127) < 1e-7, \
    "dims (-2, -1): one scale per token, over all its heads"
got = expect_tuple(quantize_absmax(x, (-1,), bits=4), "quantize_absmax(x, (-1,), bits=4)", 2)
q4 = expect_tensor(got[0], "codes with bits=4", dtype=torch.int8, shape=(2, 2, 4), device=dev)
assert q4[1, 0].tolist() == [7, 2, -2, 4], "bits=4: qmax = 7, scale = 4 / 7: codes round([7, 1.75, -1.75, 3.85])"
### BEGIN HIDDEN TESTS
""" + HIDDEN_ABSMAX_REF + r"""
g = torch.Generator().manual_seed(10)
for shape, dims in (((5, 3, 64), (-1,)), ((5, 3, 64), (-2, -1)), ((7, 2, 16), (2,)), ((6, 40), (-1,)), ((6, 40), (0,)),
                    ((4, 3, 8), (0, 1, 2))):
    for bits in (8, 4):
        mag = torch.rand(shape[:1], generator=g).mul(5).reshape(-1, *[1] * (len(shape) - 1))  # cpu: a seeded draw, used below
        x = torch.randn(shape, generator=g).to(dev) * mag.to(dev)
        x[0] = 0.0                                            # a zero row
        _check_absmax(x, dims, bits)
x = torch.randn(3, 2, 8, generator=g).to(dev, torch.bfloat16)
_check_absmax(x, (-1,), 8)                                    # bf16 input: float32 scales
# an outlier in head 0 coarsens the other heads only when they share its scale
x = torch.randn(16, 3, 64, generator=g).to(dev)
x[:, 0, 5] = 60.0
err = {}
for name, dims in (("head", (-1,)), ("token", (-2, -1))):
    q, s = expect_tuple(quantize_absmax(x, dims), f"quantize_absmax(x, {dims})", 2)
    q = expect_tensor(q, "codes", dtype=torch.int8, shape=(16, 3, 64), device=dev)
    s = expect_tensor(s, "scale", dtype=torch.float32, ndim=3, device=dev, finite=True)
    err[name] = float((dequantize(q, s) - x)[:, 1:].abs().mean())
assert err["head"] * 5 < err["token"], (f"an outlier in head 0: per-head scales keep heads 1-2 precise (mean error "
                                        f"{err['head']:.4f}), a per-token scale does not ({err['token']:.4f})")
# exact values survive: multiples of the scale come back exactly
x = torch.tensor([[[-127.0, 64.0, 3.0, 0.0]]], device=dev) * 0.5
q, s = expect_tuple(quantize_absmax(x, (-1,)), "quantize_absmax(x, (-1,))", 2)
q = expect_tensor(q, "codes", dtype=torch.int8, shape=(1, 1, 4), device=dev)
s = expect_tensor(s, "scale", dtype=torch.float32, shape=(1, 1, 1), device=dev, finite=True)
assert torch.equal(dequantize(q, s), x), "numbers on the grid (multiples of the scale) must come back exactly"
### END HIDDEN TESTS
"""),
md(r"""
**An outlier.** Keys of trained models have a few channels far larger than the rest. Take real keys
of one layer and put a large value in one head of one token. With one scale per token, that token's
other heads share the outlier's scale and lose their precision; with a scale per head they do not.
"""),
code(r'''
from course.engine.runner import embed, project_qkv   # what every cached forward computes first (lab 03)

with torch.no_grad():
    x, rope = embed(model32, torch.tensor([text_ids[:64]], device=dev), torch.arange(64, device=dev)[None])
    _, k_real, _ = project_qkv(model32, model32.blocks[0], x, rope)
keys = k_real[0].transpose(0, 1).contiguous()                   # (64 tokens, Hkv, D): the cache's layout
print(f"real keys of layer 0: max |k| {keys.abs().max():.2f}, mean |k| {keys.abs().mean():.2f}")
spiky = keys.clone()
spiky[10, 0, 7] = 20 * keys.abs().max()                          # one outlier: token 10, head 0
for name, dims in (("per head", (-1,)), ("per token", (-2, -1))):
    for label, k in (("real keys", keys), ("with the outlier", spiky)):
        q, s = quantize_absmax(k, dims)
        err = (dequantize(q, s) - k).abs()
        print(f"  {name:>9}, {label:<16}: mean error {err.mean():.5f}; token 10's heads 1-2: {err[10, 1:].mean():.5f}")
'''),
md(r"""
Now the whole cache in int8, for the whole text: every key and value goes through quantize and
dequantize on its way into attention (that is what a quantized cache does: store codes, read
`codes * scale`), in one pass as in section 4.
"""),
code(r'''
def through(quantize):
    """A kv_transform: what attention reads back from a cache that stores quantize(x)."""
    return lambda x: dequantize(*quantize(x))


kv_formats = {"int8, a scale per head": (lambda x: quantize_absmax(x, (-1,)), 8, "head"),
              "int8, a scale per token": (lambda x: quantize_absmax(x, (-2, -1)), 8, "token"),
              "int4, a scale per head": (lambda x: quantize_absmax(x, (-1,), bits=4), 4, "head")}
if env.quick:
    del kv_formats["int8, a scale per token"]
base = nll["full cache"] if env.dtype == torch.float32 else \
    token_nll(model32, ids, kv_transform=lambda x: x.to(env.dtype).float())      # keys and values rounded to 16 bits
kv_results = {f"{str(env.dtype).removeprefix('torch.')} (no quantization)":
              (kv_bytes_per_token(cfg, 16 if env.gpu else 32), perplexity(base, late))}
for name, (quantize, bits, scales) in kv_formats.items():
    x = token_nll(model32, ids, kv_transform=through(quantize))
    kv_results[name] = (kv_bytes_per_token(cfg, bits, scales), perplexity(x, late))
for name, (b, p) in kv_results.items():
    print(f"{name:<28} {b:>6,} bytes/token   perplexity after position {late}: {p:7.2f}")
'''),
md(r"""
Read your numbers. Eight bits with small groups should leave perplexity within a fraction of a
percent of where it was: the rounding error, at most half a step out of 255, is far below what the
model is sensitive to. Four bits (15 levels) is a different story with these plain scales: KIVI (2024)
gets to 2 bits by giving keys a scale per **channel** (the outlier channels) and values a scale per
token, and by keeping the newest tokens in full precision.

## Problem 5: fp8 e4m3 (2 points)

fp8 **e4m3** is a tiny floating-point format: 1 sign bit, 4 exponent bits, 3 mantissa bits. Its
largest value is 448. Each number keeps 4 significant bits (about one decimal digit): the relative rounding error is at
most 1/16 for numbers between 2^-6 and 448, and below 2^-6 the steps stop shrinking (2^-9 at the
bottom), so small numbers lose precision and tiny ones round to 0. A scale puts each group's numbers
where the format is precise: `scale = max |x| / 448` maps the largest to 448. Without one (vLLM's default
KV scale is 1.0 unless you calibrate), a cache of small values wastes most of the range.

PyTorch stores `torch.float8_e4m3fn` on every device; casting to it rounds to the nearest fp8 number.
Arithmetic on fp8 tensors is another matter: only NVIDIA's Ada and Hopper GPUs (sm_89, sm_90) and newer
multiply fp8 in hardware (`torch._scaled_mm`). Elsewhere (a CPU, a T4, an A100) fp8 is only a
storage format; the next cell says which case you are in. Either way this lab casts to float32 to
compute: that is what `dequantize` does.

**Deliverable:** `quantize_fp8(x, dims)`: returns `(codes, scale)` like Problem 4, with `codes` of dtype
`torch.float8_e4m3fn` = `x / scale` clamped to [-448, 448], and `scale = max |x| / 448` over `dims`,
float32, keepdim (1.0 where that max is 0). Clamp even though the scale should keep you in range: a
rounding error can push `x / scale` just past 448, and whether a cast past 448 saturates or gives
NaN depends on the PyTorch release (the next cell casts 1000 without a clamp and shows what yours
does); many other converters and kernels turn an out-of-range number into NaN (e4m3fn has no
infinity).
"""),
solution("quantize_fp8", r'''
FP8_MAX = 448.0                                       # the largest float8_e4m3fn number


def quantize_fp8(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """x / scale stored as float8 e4m3, with one float32 scale per group (the axes `dims`): (codes, scale)."""
    ### BEGIN SOLUTION
    amax = x.float().abs().amax(dim=dims, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale
    ### END SOLUTION
'''),
tests("quantize_fp8_tests", 2, r"""
x = torch.tensor([[0.5, -1.0, 0.25, 1e-3], [0.0, 0.0, 0.0, 0.0], [1000.0, -3000.0, 7.0, 0.5]], device=dev)
got = expect_tuple(quantize_fp8(x, (-1,)), "quantize_fp8(x, (-1,))", 2)
q = expect_tensor(got[0], "codes", dtype=torch.float8_e4m3fn, shape=(3, 4), device=dev)
s = expect_tensor(got[1], "scale", dtype=torch.float32, shape=(3, 1), device=dev, finite=True)
assert abs(float(s[0, 0]) - 1 / 448) < 1e-9 and abs(float(s[2, 0]) - 3000 / 448) < 1e-4, "scale = max |x| / 448 per row"
assert float(s[1, 0]) > 0, "an all-zero row needs a positive scale (its codes are 0)"
back = dequantize(q, s)
assert torch.isfinite(back).all(), "no NaN or inf: clamp to [-448, 448] before the cast"
rel = ((back - x).abs() / x.abs().clamp(min=1e-30))[x != 0]
assert float(rel.max()) <= 1 / 16 + 1e-6, f"relative error at most 1/16 (3 mantissa bits); got {float(rel.max()):.3f}"
assert abs(float(back[0, 3]) - 1e-3) < 1e-4, "1e-3 survives because the row is scaled up first (unscaled it would round to 0)"
assert abs(float(back[2, 1]) + 3000.0) < 1e-3, "the largest |x| of a row maps to -448 or 448 exactly"
### BEGIN HIDDEN TESTS
g = torch.Generator().manual_seed(11)
for shape, dims in (((6, 3, 64), (-1,)), ((6, 3, 64), (-2, -1)), ((9, 40), (0,)), ((4, 5, 6), (0, 1, 2))):
    mag = 10.0 ** torch.randint(-4, 4, shape[:1], generator=g).reshape(-1, *[1] * (len(shape) - 1))  # cpu: a seeded draw
    x = torch.randn(shape, generator=g).to(dev) * mag.to(dev)
    x[1] = 0.0
    what = f"quantize_fp8(x of shape {shape}, dims={dims})"
    got = expect_tuple(quantize_fp8(x, dims), what, 2)
    q = expect_tensor(got[0], what + "[0]", dtype=torch.float8_e4m3fn, shape=shape, device=dev)
    amax = x.double().abs().amax(dim=dims, keepdim=True)
    s = expect_tensor(got[1], what + "[1]", dtype=torch.float32, shape=tuple(amax.shape), device=dev, finite=True)
    assert bool((s > 0).all()), f"{what}: scales must be positive"
    assert torch.allclose(s.double()[amax > 0], (amax / 448)[amax > 0], rtol=1e-5), f"{what}: scale = max |x| / 448"
    back = q.float().double() * s.double()
    assert torch.isfinite(back).all(), f"{what}: NaN or inf in the codes"
    scaled = (x.double() / s.double()).abs()
    bound = torch.where(scaled >= 2 ** -6, x.double().abs() / 16, s.double() * 2 ** -10) * (1 + 1e-5) + 1e-12
    assert bool(((back - x.double()).abs() <= bound).all()), \
        f"{what}: error above half an e4m3 step (1/16 relative; scale x 2^-10 below 2^-6)"
    assert bool((q.float()[(amax == 0).expand_as(x)] == 0).all()), f"{what}: zero groups give zero codes"
# saturation: a scale smaller than the data's (a calibrated per-layer scale that the data outgrew) must clamp
x = torch.tensor([[1.0, 2.0, 3.0]], device=dev) * 1e6
q, s = expect_tuple(quantize_fp8(x, (-1,)), "quantize_fp8(x, (-1,))", 2)
q = expect_tensor(q, "codes", dtype=torch.float8_e4m3fn, shape=(1, 3), device=dev)
assert torch.isfinite(q.float()).all() and float(q.float().abs().max()) == 448.0, \
    "the largest value of the group maps to 448 (clamp before the cast)"
### END HIDDEN TESTS
"""),
code(r'''
print(f"native fp8 math on this device: {fp8_native(dev)}"
      + ("" if fp8_native(dev) else " (fp8 is stored here and converted to float32 to compute: emulated)"))
grid = torch.tensor([0.001, 0.01, 0.1, 0.3, 1.0, 3.14159, 100.0, 447.0, 1000.0], device=dev)
print("x            ", [f"{v:.4g}" for v in grid.tolist()])
print("clamped, e4m3", [f"{v:.4g}" for v in grid.clamp(-448, 448).to(torch.float8_e4m3fn).float().tolist()])
unclamped = torch.tensor([1000.0], device=dev).to(torch.float8_e4m3fn).float().item()
print(f"1000 cast to e4m3 without a clamp: {unclamped:.4g} (448: your PyTorch saturates; nan: it does not)")
fp8_formats = {"fp8, a scale per head": (lambda x: quantize_fp8(x, (-1,)), 8, "head"),
               "fp8, no scale (1.0)": (lambda x: (x.clamp(-448, 448).to(torch.float8_e4m3fn), torch.ones_like(x[..., :1])), 8, "tensor")}
if env.quick:
    del fp8_formats["fp8, no scale (1.0)"]
for name, (quantize, bits, scales) in fp8_formats.items():
    x = token_nll(model32, ids, kv_transform=through(quantize))
    kv_results[name] = (kv_bytes_per_token(cfg, bits, scales), perplexity(x, late))
both = token_nll(model32, ids, attn_mask=window_mask(T, W, SINK, BS, device=dev),
                 kv_transform=through(lambda x: quantize_absmax(x, (-1,))))
kv_results[f"window {W} + sinks, int8 per head"] = (kv_bytes_per_token(cfg, 8, "head"), perplexity(both, late))
for name, (b, p) in kv_results.items():
    print(f"{name:<34} {b:>6,} bytes/token   perplexity after position {late}: {p:7.2f}")
'''),
md(r"""
The two levers multiply: the last line keeps a window plus sinks **and** stores them in int8.

**Memory for real, and time.** The same formats in a paged pool: `QuantKVPool` (from `course.quant`)
stores codes and float32 scales, writes through your quantizer, and reads by gathering the blocks
of each sequence, dequantizing them, and running lab 05's decode attention. Below: its bytes against
your formula, then the time of one layer's decode attention for a batch of sequences, against lab 05's
`paged_attention` on a plain pool. The bytes the attention must read from the cache shrink with the format.
"""),
code(r'''
B_ATT, L_ATT = env.pick((32, 2048), (4, 256), cpu=(8, 1024))     # sequences, tokens each
n_blk = B_ATT * L_ATT // BS
tables = torch.arange(n_blk, device=dev, dtype=torch.int32).reshape(B_ATT, -1)
lens = torch.full((B_ATT,), L_ATT, device=dev, dtype=torch.int32)
slots = torch.arange(n_blk * BS, device=dev)
g = torch.Generator().manual_seed(0)
k_new = torch.randn(n_blk * BS, cfg.n_kv_head, cfg.head_dim, generator=g).to(dev) * 2    # cpu draw, moved
v_new = torch.randn(n_blk * BS, cfg.n_kv_head, cfg.head_dim, generator=g).to(dev)
q_now = torch.randn(B_ATT, cfg.n_head, cfg.head_dim, generator=g).to(dev, env.dtype)
cfg1 = dataclasses.replace(cfg, n_layer=1)                      # one layer's pool is enough to time one layer
plain = PagedKVCache(cfg1, n_blk, BS, dtype=env.dtype, device=dev)
write_kv(*plain.layer(0), k_new, v_new, slots)
pools = {f"{str(env.dtype).removeprefix('torch.')} (lab 05)": None}
for name, storage, quantize in (("int8, a scale per head", torch.int8, lambda x: quantize_absmax(x, (-1,))),
                                ("fp8, a scale per head", torch.float8_e4m3fn, lambda x: quantize_fp8(x, (-1,)))):
    pools[name] = QuantKVPool(cfg1, n_blk, BS, storage=storage, scales="head", device=dev)
    pools[name].write(0, k_new, v_new, slots, quantize)
scale = 1 / math.sqrt(cfg.head_dim)
reference = paged_attention(q_now, *plain.layer(0), tables, lens, scale).float()
print(f"one layer's decode attention, {B_ATT} sequences x {L_ATT} tokens, {dev}, queries in {env.dtype}:")
for name, pool in pools.items():
    if pool is None:
        run = lambda: paged_attention(q_now, *plain.layer(0), tables, lens, scale)
        per_token, err = plain.bytes_per_token(), 0.0
    else:
        run = lambda: pool.attention(0, q_now, tables, lens, scale)
        per_token = pool.bytes_per_token()
        err = (run().float() - reference).abs().max().item()
    t = benchmark(run, repeats=env.pick(10, 3), device=dev).median
    print(f"  {name:<26} {per_token:>5,} bytes/token in one layer, reads {B_ATT * L_ATT * per_token / 2**20:6.1f} MiB: "
          f"{1e3 * t:7.2f} ms, max |out - plain| {err:.4f}")
print(f"your formula for all {cfg.n_layer} layers, int8 with a scale per head: {kv_bytes_per_token(cfg, 8, 'head'):,} bytes/token; "
      f"the pool's, per layer x {cfg.n_layer}: {pools['int8, a scale per head'].bytes_per_token() * cfg.n_layer:,}")
'''),
md(r"""
Read your timings (they name the device and dtype). Do not expect the 8-bit pools to be faster here,
though they hold a quarter of the fp32 bytes or half of the bf16 bytes. Both paths gather the blocks
and write a float32 copy before attention reads them (lab 05's `paged_attention` computes in float32
too); the 8-bit path adds a pass (codes times scales), and on a CPU fp8 is converted in software. The
bytes saved in the gather are spent again. At serving sizes decode attention is memory-bound (lab 02):
its time is the bytes it reads over the memory bandwidth (at this lab's small sizes, the cost of each
operation weighs more). So the gain needs a kernel that reads the 8-bit codes and converts them in
registers, never writing the float copy: vLLM's and FlashInfer's fp8 KV kernels do that, and read half
the bytes of a bf16 cache. On a GPU, compare the time of the 8-bit rows with the bf16 row and with the
bytes each reads: your numbers say whether this unfused reference's extra copy eats the saving there too.

The memory gain, on the other hand, holds everywhere: the same pool holds almost twice as many tokens
in 8 bits as in bf16 (1.9x with a scale per head), and almost four times as many as in fp32, and that is what lets a server run more requests at once.
"""),
]
