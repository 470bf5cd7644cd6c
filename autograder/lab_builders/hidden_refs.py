"""Hidden-test references that several labs share, as source text pasted into their hidden blocks.

They live only in the instructors' sources (nbgrader strips hidden blocks from releases), and they
never call `course.engine` or the student's code: that is what makes them independent.

- `_ref_greedy(m, prompt, n, eos=None)`: greedy tokens with no cache at all, the whole sequence
  through `m.forward` at every step (labs 04, 05, 08).
- `_tiny(family, seed, n_kv_head=None)`: a 2-layer random decoder with large weights, so its top
  tokens are decisive (no near-ties for float sums to flip), on the lab's device (`env.device`).
- `HIDDEN_ATTENTION`: `_dense(q, ks, vs, scale)`, attention in float64 on the CPU from per-sequence
  keys and values, and `_paged_case(...)`, paged inputs built by scattering those into shuffled
  blocks whose unused slots hold NaN (stale memory), moved to the lab's device (labs 05, 06).
"""


def greedy_and_tiny(max_seq_len: int) -> str:
    """The text of `_ref_greedy` and `_tiny`, for models of at most `max_seq_len` positions."""
    return r'''
def _ref_greedy(m, prompt, n, eos=None):
    # new tokens of `prompt` alone, no cache: the whole sequence through m.forward every step
    out = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([list(prompt) + out], device=m.device)
            out.append(int(m(x, torch.arange(x.shape[1], device=m.device)[None])[0, -1].argmax()))
            if out[-1] == eos:
                break
    return out
def _tiny(family, seed, n_kv_head=None):
    torch.manual_seed(seed)
    if n_kv_head is None:
        n_kv_head = 2 if family == "llama" else 4
    cfg = course.ModelConfig(family=family, vocab_size=64, n_layer=2, n_head=4, n_kv_head=n_kv_head,
                             d_model=32, d_ff=64, max_seq_len=MAX_SEQ_LEN)
    m = course.Decoder(cfg).eval().to(env.device)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m
'''.strip("\n").replace("MAX_SEQ_LEN", str(max_seq_len))


HIDDEN_ATTENTION = r"""
def _dense(q, ks, vs, scale):
    # q (B, H, D); ks[b], vs[b]: (L_b, Hkv, D) -> (B, H, D): float64 on the CPU, no paging at all
    out = []
    for b, (k, v) in enumerate(zip(ks, vs)):
        g = q.shape[1] // k.shape[1]
        kk, vv = k.cpu().double().repeat_interleave(g, 1), v.cpu().double().repeat_interleave(g, 1)
        s = torch.einsum("hd,lhd->hl", q[b].cpu().double(), kk) * scale
        out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv))
    return torch.stack(out)
def _paged_case(lens, H, Hkv, D, bs, dtype, seed, pad_width=0):
    # dense K/V per sequence, scattered into shuffled physical blocks whose other slots hold NaN
    # (stale memory); built on the CPU from a seeded generator, then moved to the lab's device
    g = torch.Generator().manual_seed(seed)
    n_blocks = sum(-(-L // bs) for L in lens) + 2
    k_cache = torch.full((n_blocks, bs, Hkv, D), float("nan"), dtype=dtype, device="cpu")
    v_cache = torch.full((n_blocks, bs, Hkv, D), float("nan"), dtype=dtype, device="cpu")
    free = torch.randperm(n_blocks, generator=g).tolist()
    tables, ks, vs = [], [], []
    for L in lens:
        t = [free.pop() for _ in range(-(-L // bs))]
        k = torch.randn(L, Hkv, D, generator=g, device="cpu").to(dtype)
        v = torch.randn(L, Hkv, D, generator=g, device="cpu").to(dtype)
        for p in range(L):
            k_cache[t[p // bs], p % bs] = k[p]
            v_cache[t[p // bs], p % bs] = v[p]
        tables.append(t); ks.append(k); vs.append(v)
    width = max(len(t) for t in tables) + pad_width
    bt = torch.zeros(len(lens), width, dtype=torch.int32, device="cpu")
    for i, t in enumerate(tables):
        bt[i, :len(t)] = torch.tensor(t, dtype=torch.int32, device="cpu")
    q = torch.randn(len(lens), H, D, generator=g, device="cpu").to(dtype)
    dev = env.device
    return (q.to(dev), k_cache.to(dev), v_cache.to(dev), bt.to(dev),
            torch.tensor(lens, dtype=torch.int32, device=dev), ks, vs)
""".strip("\n")
