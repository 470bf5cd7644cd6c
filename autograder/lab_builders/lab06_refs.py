"""Lab 06's independent references for the hidden tests (pasted into hidden blocks only).

They never call `course.engine` or the student's code. Dense float64 attention and the NaN-padded
paged inputs (`HIDDEN_ATTENTION`) are lab 05's, from hidden_refs.py; this file adds the references
of the split-KV and the causal prefill kernels.
"""

from autograder.lab_builders.hidden_refs import HIDDEN_ATTENTION  # noqa: F401 (shared with lab 05)

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

HIDDEN_BIG = r"""
def _fp16_big(case):
    # a _paged_case built in float32, made fp16 with queries and keys of 72 + 4 * randn (values kept): q . k of
    # about 80,000 before the scale, past fp16's largest number (65,504); times a scale of 1/1024, ordinary scores
    q, kcache, vcache, bt, cl, ks, vs = case
    big = lambda x: (72 + 4 * x).to(torch.float16)
    return big(q), big(kcache), vcache.half(), bt, cl, [big(k) for k in ks], [v.half() for v in vs]
""".strip("\n")

HIDDEN_TTIR = r"""
def _tt_dots(ttir):
    # the element types of each tl.dot's two operands in a kernel's Triton IR
    import re
    return re.findall(r"tt\.dot .*?: tensor<(?:\d+x)+(\w+)> \* tensor<(?:\d+x)+(\w+)>", ttir)
def _slot_products_in_32_bits(ttir):
    # store_kv_kernel's Triton IR: 32-bit multiplications of a value loaded through slot_ptr (its 5th argument)
    # that feed the address of a store into k_cache_ptr or v_cache_ptr (its 3rd and 4th)
    import re
    defs, stores, params = {}, [], []
    for line in ttir.splitlines():
        if "tt.func" in line:
            params = re.findall(r"(%[\w.]+): !tt", line)
            continue
        body = line.split(" loc(")[0].strip()
        d = re.match(r"(%[\w.]+)(?::\d+)? = ([\w.]+)(.*)$", body)
        if d:
            args, _, ty = d.group(3).rpartition(" : ")
            defs[d.group(1)] = (d.group(2), re.findall(r"%[\w.]+", args or d.group(3)), ty.strip())
        elif body.startswith("tt.store "):
            stores.append(re.findall(r"%[\w.]+", body)[0])
    def upstream(names):
        seen, todo = set(), list(names)
        while todo:
            x = todo.pop()
            if x not in seen:
                seen.add(x)
                todo += defs.get(x, ("", [], ""))[1]
        return seen
    if len(params) < 5:                               # an IR this reader does not know: no verdict
        return []
    into_cache = upstream([s for s in stores if upstream([s]) & set(params[2:4])])
    slots = {x for x, (op, args, _) in defs.items() if op == "tt.load" and params[4] in upstream(args)}
    return [x for x in into_cache if x in defs and defs[x][0] in ("arith.muli", "arith.shli")
            and re.search(r"(^|x)i32>?$", defs[x][2]) and slots & upstream([x])]
""".strip("\n")

# v1's and v2's fp16 check (KERNEL, WHAT, EXTRA filled in), after HIDDEN_ATTENTION and HIDDEN_BIG. Outputs are
# softmax-weighted randn values (|o| < 4): fp16 rounds them to 11 bits, so 4e-3 is 2 to 4 half-ulps, while fp16
# arithmetic on these scores overflows (NaN) or loses whole digits.
FP16_BIG = r"""
# fp16 with queries and keys that share a large part (72 + 4 * randn): q . k before the scale is about 80,000, past
# fp16's largest number (65,504); times 1/1024 the scores are ordinary. In float32 (on a GPU too) nothing overflows.
q, kcache, vcache, bt, cl, ks, vs = _fp16_big(_paged_case([1, 16, 33, 48], 8, 2, 16, 16, torch.float32, seed=6))
out = expect_tensor(KERNEL(q, kcache, vcache, bt, cl, 1 / 1024EXTRA), "KERNEL (fp16)", dtype=torch.float16,
                    shape=tuple(q.shape), device=dev)
err = (out.cpu().double() - _dense(q, ks, vs, 1 / 1024)).abs().max().item()   # 4e-3: 2 to 4 half-ulps of fp16 at |o| < 4
assert err < 4e-3, f"WHAT, fp16, q . k before the scale about 80,000, past fp16's largest number (65,504): max |diff| " \
    f"{err:.1e} against dense attention: " + ("NaN: your scores overflow to inf in fp16" if err != err else
    "your scores lose digits in fp16") + ": convert q, k and v to float32 right after loading them (.to(tl.float32))"
""".strip("\n")
