"""Lab 06's independent references for the hidden tests (pasted into hidden blocks only).

They never call `course.engine` or the student's code: dense attention in float64 on the CPU from
per-sequence keys and values, and paged inputs built by scattering those into shuffled blocks
whose unused slots hold NaN (stale memory), moved to the lab's device before any kernel sees them.
"""

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

HIDDEN_SPLIT = r"""
def _split_ref(q, ks, vs, scale, split_len, n_splits):
    # what stage 1 writes, from dense K/V in float64: o (B, H, S, D) and lse (B, H, S); empty split: 0, -inf
    B, H, D = q.shape
    o = torch.zeros(B, H, n_splits, D, dtype=torch.float64, device="cpu")
    lse = torch.full((B, H, n_splits), float("-inf"), dtype=torch.float64, device="cpu")
    for b, (k, v) in enumerate(zip(ks, vs)):
        g = H // k.shape[1]
        kk, vv = k.cpu().double().repeat_interleave(g, 1), v.cpu().double().repeat_interleave(g, 1)
        s = torch.einsum("hd,lhd->hl", q[b].cpu().double(), kk) * scale           # (H, L)
        for i in range(n_splits):
            a, e = i * split_len, min((i + 1) * split_len, k.shape[0])
            if a < e:
                lse[b, :, i] = torch.logsumexp(s[:, a:e], -1)
                o[b, :, i] = torch.einsum("hl,lhd->hd", s[:, a:e].softmax(-1), vv[a:e])
    return o, lse
""".strip("\n")

HIDDEN_CAUSAL = r"""
def _causal_ref(q, k, v, scale):
    # q (T, H, D): the last T of the L tokens whose dense keys/values are k, v (L, Hkv, D) -> (T, H, D) float64
    T, H, _ = q.shape
    L, g = k.shape[0], H // k.shape[1]
    kk, vv = k.cpu().double().repeat_interleave(g, 1), v.cpu().double().repeat_interleave(g, 1)
    s = torch.einsum("thd,lhd->htl", q.cpu().double(), kk) * scale                   # (H, T, L)
    seen = torch.arange(L, device="cpu")[None, :] <= torch.arange(L - T, L, device="cpu")[:, None]   # (T, L)
    return torch.einsum("htl,lhd->thd", s.masked_fill(~seen, float("-inf")).softmax(-1), vv)
""".strip("\n")
