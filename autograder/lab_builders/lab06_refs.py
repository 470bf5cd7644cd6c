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
