"""Lab 14, sections 6-8: expert parallelism (problem 5), load statistics and capacity (problem 6), the
measurements (load, capacity vs perplexity, experts touched, the flow plot), summary and going
further. Assembled by lab14.py."""
from autograder.authoring import answer, code, md, solution, tests
from autograder.lab_builders.lab14_dispatch import REF_MOE

CELLS = [
md(r"""
## 6. Expert parallelism: experts on different processes

DeepSeek-V3 has 256 routed experts per layer, 671 billion parameters in all: no GPU holds them. An
engine spreads the experts over W GPUs, **expert parallelism** (EP): rank r holds experts
r·E/W ... (r+1)·E/W - 1. Attention runs data-parallel, each rank on its own requests, with a copy of
the router. In every MoE layer the tokens travel to their experts and back:

```
rank 0: tokens a b c  -- route --> pairs for experts 0-3 (stay) and 4-7 (leave) --\      all-to-all:
rank 1: tokens d e    -- route --> pairs for experts 0-3 (leave) and 4-7 (stay) --/   rank q's chunk to rank q
        each rank runs its experts on what arrived, then a second all-to-all sends the results home,
        where each token adds its k results with their weights (the combine of Problem 3)
```

An **all-to-all** is the collective where every rank sends a different chunk to every other rank
(`torch.distributed.all_to_all_single` does it with one call; NCCL, DeepEP and others make it fast).
Here you build it from point-to-point messages, as in lab 12: `comm.isend`, `comm.recv`, and a
`.wait()` on each send at the end (a blocking send in a circle of ranks deadlocks). The receiver must
know how many rows come, so one layer makes three exchanges:

1. **counts**: rank r sends rank q its counts for q's E/W experts (E/W integers): now every rank knows
   how many rows it will receive from each rank, for each of its experts;
2. **rows**: the pairs' token rows, sorted by expert (so grouped by owner rank);
3. **results**: the experts' outputs go back, with the split sizes swapped.

Bytes rank r sends per layer, payload only (b bytes per value, C = d_model, int64 counts):

    C · b · (its pairs for other ranks' experts + the rows it returns to other ranks) + 8 · (E/W) · (W - 1)

Under a uniform router a pair leaves its rank with probability (W - 1)/W, so a token costs about
2·k·(W - 1)/W·C·b bytes per layer. For the course model in bf16, k = 2, W = 2: 2,304 bytes per token
per layer.

## Problem 5: Expert parallelism (4 points)

**Deliverable:**
- `all_to_all(comm, chunks, recv_rows)`: `chunks` is a list of W tensors with the same trailing shape
  and dtype, `chunks[q]` for rank q; `recv_rows[q]` is the number of rows rank q sends here. Returns a
  list of W tensors, item q the rows rank q sent (item `comm.rank` is this rank's own chunk, not sent).
  Send nothing for a chunk of 0 rows, and receive nothing when 0 rows come.
- `ep_moe(comm, x, topk_ids, topk_weights, w_gate, w_up, w_down, n_experts)`: one MoE layer on one rank
  under expert parallelism: `x` (T, C) this rank's tokens (T may be 0), `topk_ids`/`topk_weights` (T, k)
  their routing over all `n_experts`, `w_*` only this rank's E/W experts (stacked as in Problem 1).
  Make the three exchanges above with your `all_to_all`, and return (T, C) in `x`'s dtype: what one
  process holding every expert returns. Use `course.moe.sort_by_expert` (given, it returns `.order`,
  `.counts` and `.offsets` as your `sort_pairs` does) and `swiglu`.
"""),
solution("expert_parallel", r'''
def all_to_all(comm, chunks: list[torch.Tensor], recv_rows: list[int]) -> list[torch.Tensor]:
    """chunks[q] goes to rank q; returns the chunks every rank sent here (this rank's own, kept)."""
    ### BEGIN SOLUTION
    W, r = comm.world_size, comm.rank
    if len(chunks) != W or len(recv_rows) != W:
        raise ValueError(f"need one chunk and one row count per rank ({W}), got {len(chunks)} and {len(recv_rows)}")
    tail, dtype, device = chunks[r].shape[1:], chunks[r].dtype, chunks[r].device
    sends = [comm.isend(chunks[q].contiguous(), q) for q in range(W) if q != r and chunks[q].shape[0]]
    out = []
    for q in range(W):
        if q == r:
            out.append(chunks[r])                                           # my own chunk: no message
            continue
        buf = torch.empty((recv_rows[q], *tail), dtype=dtype, device=device)
        if recv_rows[q]:
            comm.recv(buf, q)
        out.append(buf)
    for s in sends:
        s.wait()                                                            # my chunks may be reused now
    return out
    ### END SOLUTION


def ep_moe(comm, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate: torch.Tensor,
           w_up: torch.Tensor, w_down: torch.Tensor, n_experts: int) -> torch.Tensor:
    """One MoE layer under expert parallelism: this rank's tokens out to their experts' ranks and back."""
    ### BEGIN SOLUTION
    W, r = comm.world_size, comm.rank
    per = n_experts // W                                                     # experts per rank
    T, k = topk_ids.shape
    s = sort_by_expert(topk_ids, n_experts)                                  # pairs by expert, hence by owner rank
    xs = x[s.order // k]                                                     # (P, C)
    send_rows = s.counts.view(W, per).sum(1).tolist()                        # rows for each rank
    # 1. counts: rank q learns how many rows of each of its experts come from me
    recv_counts = torch.stack(all_to_all(comm, list(s.counts.view(W, per)), [per] * W))   # (W, per): [q, e]
    recv_rows = recv_counts.sum(1).tolist()
    # 2. rows there: they arrive by source rank, and inside each by my local expert
    xr = torch.cat(all_to_all(comm, list(xs.split(send_rows)), recv_rows))  # (R, C)
    local = torch.repeat_interleave(torch.arange(per, device=x.device).repeat(W), recv_counts.reshape(-1))   # (R,)
    yr = torch.empty_like(xr)
    for e in range(per):
        rows = torch.nonzero(local == e).flatten()
        if rows.numel():
            yr[rows] = swiglu(xr[rows], w_gate[e], w_up[e], w_down[e])
    # 3. results home, the split sizes swapped: back in my sorted order
    ys = torch.cat(all_to_all(comm, list(yr.split(recv_rows)), send_rows))  # (P, C)
    w = topk_weights.reshape(-1)[s.order].float()                            # (P,): weight of each sorted pair
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    out.index_add_(0, s.order // k, ys.float() * w[:, None])                 # un-permute, weight, add
    return out.to(x.dtype)
    ### END SOLUTION
'''),
tests("expert_parallel_tests", 4, r"""
from course.moe import moe_reference, topk_route as course_route
def _a2a(comm):
    W, r = comm.world_size, comm.rank
    chunks = [torch.full((q + r, 2), 10.0 * r + q, device=env.device) for q in range(W)]   # rank r sends q + r rows to q
    return all_to_all(comm, chunks, [r + q for q in range(W)])
for r, got in enumerate(run_threads(_a2a, 3)):
    assert isinstance(got, list) and len(got) == 3, "all_to_all returns a list of W tensors"
    for q in range(3):
        g_ = expect_tensor(got[q], f"rank {r}: all_to_all(...)[{q}]", shape=(q + r, 2), device=env.device)
        assert bool((g_ == 10.0 * q + r).all()), f"rank {r}: item {q} must hold the rows rank {q} sent to rank {r}"
g = torch.Generator().manual_seed(0)
Ev, Cv, Nv = 4, 8, 6
wg_v, wu_v = torch.randn(Ev, Nv, Cv, generator=g).to(env.device), torch.randn(Ev, Nv, Cv, generator=g).to(env.device)
wd_v = torch.randn(Ev, Cv, Nv, generator=g).to(env.device)
xs_v = [torch.randn(T_, Cv, generator=g).to(env.device) for T_ in (5, 3)]
routes_v = [course_route(torch.randn(T_, Ev, generator=g).to(env.device), 2) for T_ in (5, 3)]   # the course's routing
def _ep(comm):
    sl = slice(comm.rank * 2, comm.rank * 2 + 2)
    y = ep_moe(comm, xs_v[comm.rank], *routes_v[comm.rank], wg_v[sl], wu_v[sl], wd_v[sl], Ev)
    return y, comm.stats.bytes_sent, comm.stats.all_reduce_calls
res = run_threads(_ep, 2)
for r, (y, sent, calls) in enumerate(res):
    y = expect_tensor(y, f"rank {r}: ep_moe(...)", shape=(xs_v[r].shape[0], Cv), dtype=torch.float32, device=env.device)
    want = moe_reference(xs_v[r], wg_v, wu_v, wd_v, *routes_v[r])
    assert torch.allclose(y, want, atol=1e-4), \
        f"rank {r}: ep_moe must return what one process with every expert returns; the results come back in sorted (expert) order: un-permute them with the same order before the weighted sum"
    assert calls == 0, "no all-reduce: point-to-point messages only"
want_bytes = bytes_formula([ids for ids, _ in routes_v], Ev, Cv, 4)
assert [s for _, s, _ in res] == want_bytes, \
    f"bytes each rank sent: {[s for _, s, _ in res]}; the formula (counts, rows out, rows back) says {want_bytes}"
### BEGIN HIDDEN TESTS
""" + REF_MOE + r"""
for W, Ex, k, Ts, dtype in ((2, 4, 1, (4, 0), torch.float32), (4, 8, 2, (3, 6, 1, 5), torch.float32),
                            (2, 2, 2, (7, 2), torch.float64), (4, 4, 3, (2, 2, 2, 9), torch.float32), (1, 4, 2, (6,), torch.float32)):
    g = torch.Generator().manual_seed(W * 10 + Ex)
    wg_h, wu_h = (torch.randn(Ex, 5, 6, generator=g).to(device=env.device, dtype=dtype) for _ in range(2))
    wd_h = torch.randn(Ex, 6, 5, generator=g).to(device=env.device, dtype=dtype)
    xs_h = [torch.randn(T_, 6, generator=g).to(device=env.device, dtype=dtype) for T_ in Ts]
    routes_h = [_routing(T_, Ex, k, seed=i, skew=(i == 0)) for i, T_ in enumerate(Ts)]
    def _ep_h(comm):
        per = Ex // comm.world_size
        sl = slice(comm.rank * per, (comm.rank + 1) * per)
        y = ep_moe(comm, xs_h[comm.rank], *routes_h[comm.rank], wg_h[sl], wu_h[sl], wd_h[sl], Ex)
        return y, comm.stats.bytes_sent, [e for e in comm.stats.log if e[0] == "send"]
    res = run_threads(_ep_h, W)
    for r, (y, sent, log_) in enumerate(res):
        y = expect_tensor(y, "ep_moe", shape=(Ts[r], 6), dtype=dtype, device=env.device)
        want = _ref_moe(xs_h[r], wg_h, wu_h, wd_h, *routes_h[r])
        assert torch.allclose(y.double().cpu(), want, atol=1e-4), f"W={W} E={Ex} k={k} T={Ts}: rank {r} differs from one process"
        per = Ex // W
        owner = [ids.reshape(-1).cpu() // per for ids, _ in routes_h]
        out_rows = int((owner[r] != r).sum())
        in_rows = sum(int((owner[q] == r).sum()) for q in range(W) if q != r)
        assert sent == 6 * y.element_size() * (out_rows + in_rows) + 8 * per * (W - 1), \
            f"W={W}: rank {r} sent {sent} bytes; counts (8 bytes each, E/W per other rank) + rows out + rows back say otherwise"
        assert all(e[2][0] > 0 for e in log_), "send nothing for a chunk of 0 rows"
### END HIDDEN TESTS
"""),
md(r"""
Now the real thing: the course model, MoEfied, top-2, on 2 processes started from this notebook
(`launch`, gloo over 127.0.0.1, as in lab 12). Every MLP of each rank's copy becomes an `EPLayer`
(below) that keeps only the rank's 4 experts and calls your `ep_moe`. Each rank runs its own prompt.
The logits must equal the single-process model's, and the bytes each rank sent must equal the
formula, computed from both ranks' routing alone. The ranks run on the CPU in float32, also on a GPU
machine (a forked process cannot use its parent's CUDA).
"""),
code(r'''
class EPLayer(nn.Module):
    """An MoEMLP's place in a block on one rank: its router and knobs, this rank's E/W experts, your ep_moe."""

    def __init__(self, moe_mlp, comm):
        super().__init__()
        per = moe_mlp.n_experts // comm.world_size
        sl = slice(comm.rank * per, (comm.rank + 1) * per)
        self.inner, self.comm, self.routes = moe_mlp, comm, []
        self.w = [w.detach()[sl].clone() for w in (moe_mlp.w_gate, moe_mlp.w_up, moe_mlp.w_down)]

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])                                  # (T, C)
        ids, weights = self.inner.route(flat)                              # the MoEMLP's router, top_k, weighting
        self.routes.append(ids)
        return ep_moe(self.comm, flat, ids, weights, *self.w, self.inner.n_experts).reshape(x.shape)


def ep_rank(comm, m, prompts):
    layers = [EPLayer(b.mlp, comm) for b in m.blocks]
    for b, layer in zip(m.blocks, layers):
        b.mlp = layer                                                      # this process's copy only
    ids = prompts[comm.rank]
    comm.stats.reset()
    start = time.perf_counter()
    with torch.no_grad():
        logits = m(ids[None], torch.arange(ids.numel(), device="cpu")[None])[0]
    return logits, comm.stats.bytes_sent, [layer.routes[0] for layer in layers], time.perf_counter() - start


cpu_moe = moe if not env.gpu else load_moe(course.load_model(device="cpu", dtype=torch.float32))
set_top_k(cpu_moe, 2)
prompts = [torch.tensor(HELDOUT[i * 40:i * 40 + n], device="cpu") for i, n in enumerate(env.pick((48, 32), (16, 12)))]
results = launch(ep_rank, 2, cpu_moe, prompts, timeout=LAUNCH_S)
with torch.no_grad():
    alone = [cpu_moe(p[None], torch.arange(p.numel(), device="cpu")[None])[0] for p in prompts]
C_b = cfg.d_model * 4                                                      # bytes of one float32 row
for r, (logits, sent, routes, secs) in enumerate(results):
    formula = sum(bytes_formula([res[2][i] for res in results], E, cfg.d_model, 4)[r] for i in range(cfg.n_layer))
    same = (logits.argmax(-1) == alone[r].argmax(-1)).float().mean().item()
    print(f"rank {r}: {prompts[r].numel()} tokens, max |EP logits - one process| = {(logits - alone[r]).abs().max().item():.1e} "
          f"(same next token at {same:.0%} of positions); sent {sent:,} bytes, formula {formula:,}; "
          f"{sent / prompts[r].numel() / cfg.n_layer:,.0f} bytes per token per layer ({1e3 * secs:.0f} ms forward, CPU, float32, 1 thread)")
print(f"uniform router, 2 ranks, k = 2, float32: 2·k·(W-1)/W·C·b = {2 * 2 * 0.5 * C_b:,.0f} bytes per token per layer")
set_top_k(cpu_moe, E)
'''),
md(r"""
The logits agree to float tolerance: each expert now multiplies a different set of rows at once, so
its sums round differently, and 30 layers of sparse routing carry those last bits along (a token
whose two best experts nearly tie can even switch experts). The bytes match the formula to the byte,
and the measured bytes per token sit near the uniform estimate: how far from it depends on how many
of each rank's pairs stay home. On a GPU cluster the
all-to-alls are the cost of EP: two per layer, on the critical path, and the slowest link and the
busiest rank set their time. That is what the next section measures.

## 7. What sets the speed: load, capacity, experts touched

Experts run in parallel, in one grouped GEMM or one rank each, so a layer takes as long as its
**busiest** expert or rank. The **imbalance** max/mean of the load says how much slower that is than
an even spread: an imbalance of 2 halves the throughput that the FLOPs promise. Trained MoEs add a
load-balancing loss so that the router spreads tokens; our router was fit for quality only.

A **capacity factor** caps the busiest expert: each expert takes at most ceil(factor · T·k / E)
pairs, and drops the rest (a dropped pair adds nothing; the token passes that expert by on the
residual stream). Who is dropped first? GShard's rule: every token's first choice is served before
anyone's second choice, and inside a choice, in token order.

## Problem 6: Load statistics and capacity (3 points)

**Deliverable:**
- `expert_load(topk_ids, n_experts)`: pairs per expert, (E,) `long`.
- `imbalance(counts)`: max / mean of a load (a `float`; 1.0 is even); `ValueError` if it holds no pair.
- `capacity_keep(topk_ids, n_experts, capacity)`: which pairs experts with room for `capacity` rows
  keep, (T, k) `bool`: all first choices (slot 0) in token order, then all second choices, and so on;
  an expert keeps pairs until it is full.
"""),
solution("load_stats", r'''
def expert_load(topk_ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Pairs per expert: (E,) long."""
    ### BEGIN SOLUTION
    return torch.bincount(topk_ids.reshape(-1).long(), minlength=n_experts)
    ### END SOLUTION


def imbalance(counts: torch.Tensor) -> float:
    """max / mean of the load: the busiest expert's (or rank's) work over an even share."""
    ### BEGIN SOLUTION
    if counts.numel() == 0 or int(counts.sum()) == 0:
        raise ValueError("imbalance needs a load with at least one pair")
    c = counts.double()
    return float(c.max() / c.mean())
    ### END SOLUTION


def capacity_keep(topk_ids: torch.Tensor, n_experts: int, capacity: int) -> torch.Tensor:
    """(T, k) bool: the pairs kept by experts of `capacity` rows, first choices before second choices."""
    ### BEGIN SOLUTION
    T, k = topk_ids.shape
    dev = topk_ids.device
    # the priority of pair (t, j) is j * T + t: every token's first choice, then every second choice, ...
    priority = (torch.arange(k, device=dev)[None, :] * T + torch.arange(T, device=dev)[:, None]).reshape(-1)   # (T*k,)
    flat = topk_ids.reshape(-1).long()                                      # (T*k,): the expert of each pair
    order = torch.argsort(flat * (T * k) + priority)                        # by expert, then by priority
    counts = torch.bincount(flat, minlength=n_experts)
    starts = counts.cumsum(0) - counts                                      # (E,): where each expert's queue starts
    place = torch.empty(T * k, dtype=torch.long, device=dev)
    place[order] = torch.arange(T * k, device=dev) - starts[flat[order]]    # each pair's place in its expert's queue
    return (place < capacity).view(T, k)                                    # the first `capacity` of each queue
    ### END SOLUTION
'''),
tests("load_stats_tests", 3, r"""
ids_v = torch.tensor([[0, 1], [0, 2], [1, 0]], device=env.device)
c_v = expect_tensor(expert_load(ids_v, 4), "expert_load(ids, 4)", shape=(4,), dtype=torch.long, device=env.device)
assert c_v.tolist() == [3, 2, 1, 0], f"pairs per expert: [3, 2, 1, 0], got {c_v.tolist()}"
assert abs(expect_float(imbalance(c_v), "imbalance(counts)") - 2.0) < 1e-9, "max / mean: 3 / 1.5 = 2.0"
keep_v = expect_tensor(capacity_keep(ids_v, 3, 1), "capacity_keep(ids, 3, capacity=1)", shape=(3, 2), dtype=torch.bool, device=env.device)
assert keep_v.tolist() == [[True, False], [False, True], [True, False]], \
    ("every token's first choice before anyone's second choice: expert 0 keeps token 0's first choice, expert 1 token 2's "
     f"first choice (so token 0's second choice is dropped), expert 2 token 1's second; want [[T, F], [F, T], [T, F]], got {keep_v.tolist()}")
### BEGIN HIDDEN TESTS
def _ref_keep(ids, Ex, cap):
    T, k = ids.shape
    used, keep = [0] * Ex, [[False] * k for _ in range(T)]
    rows = ids.tolist()
    for j in range(k):
        for t in range(T):
            e = rows[t][j]
            if used[e] < cap:
                used[e] += 1
                keep[t][j] = True
    return keep
for seed, (T, Ex, k) in enumerate(((20, 8, 2), (9, 4, 3), (1, 4, 1), (30, 2, 2), (16, 16, 4))):
    g = torch.Generator().manual_seed(seed)
    ids_h = torch.stack([torch.randperm(Ex, generator=g)[:k] for _ in range(T)])   # cpu: moved below
    ids_h[:T // 2, 0] = 0                                  # a hot expert
    ids_h = ids_h.to(env.device)
    c_h = expect_tensor(expert_load(ids_h, Ex), "expert_load", shape=(Ex,), dtype=torch.long, device=env.device)
    want_c = [ids_h.reshape(-1).tolist().count(e) for e in range(Ex)]
    assert c_h.tolist() == want_c, f"T={T} E={Ex}: pairs per expert"
    assert abs(expect_float(imbalance(c_h), "imbalance") - max(want_c) / (sum(want_c) / Ex)) < 1e-9, "imbalance is max / mean"
    for cap in (0, 1, 2, 5, T * k):
        got = expect_tensor(capacity_keep(ids_h, Ex, cap), "capacity_keep", shape=(T, k), dtype=torch.bool, device=env.device)
        assert got.tolist() == _ref_keep(ids_h, Ex, cap), \
            f"T={T} E={Ex} k={k} capacity {cap}: first choices before second choices, token order inside a choice"
assert abs(expect_float(imbalance(torch.tensor([0, 0, 4], device=env.device)), "imbalance") - 3.0) < 1e-9, "all on one of 3 experts: 3.0"
try:
    imbalance(torch.zeros(4, dtype=torch.long, device=env.device))
except ValueError:
    pass
else:
    raise AssertionError("a load with no pair has no imbalance: raise ValueError")
### END HIDDEN TESTS
"""),
md(r"""
### Measure: the real router's load

Record the routing of every layer on the held-out slice at top-2 (`record_routing` runs the model
and keeps each layer's ids), then read it with your functions: the imbalance per layer over experts,
and over ranks for W = 2 and 4 (rank r holds a contiguous run of experts).
"""),
code(r'''
set_top_k(moe, 2)
routes = record_routing(moe, text, window=PPL_WINDOW)                     # one (T, 2) tensor per layer, on the CPU
set_top_k(moe, E)
loads = torch.stack([expert_load(r.to(env.device), E) for r in routes]).cpu()     # (layers, E)
imb = [imbalance(c) for c in loads]
imb_rank = {W: [imbalance(c.view(W, -1).sum(1)) for c in loads] for W in (2, 4)}
worst = max(range(len(imb)), key=imb.__getitem__)
print(f"{routes[0].shape[0]} tokens, top-2 of {E}: imbalance over experts, mean over layers {sum(imb) / len(imb):.2f}, "
      f"worst {max(imb):.2f} (layer {worst}: {loads[worst].tolist()})")
for W, v in imb_rank.items():
    print(f"  over {W} ranks: mean {sum(v) / len(v):.2f}, worst {max(v):.2f}")
fig, axes = plt.subplots(1, 2, figsize=(10, 3.2))
axes[0].plot(imb, "o-", label="experts"); axes[0].plot(imb_rank[2], "s-", label="2 ranks"); axes[0].plot(imb_rank[4], "^-", label="4 ranks")
axes[0].axhline(1, color="gray", ls=":"); axes[0].set_xlabel("layer"); axes[0].set_ylabel("max / mean load"); axes[0].legend()
axes[0].set_title("load imbalance, top-2")
axes[1].bar(range(E), loads[worst].tolist(), color=[plt.get_cmap("tab10")(e // (E // 2)) for e in range(E)])
axes[1].set_xlabel("expert (colour: rank of 2)"); axes[1].set_ylabel("pairs"); axes[1].set_title(f"layer {worst}, the worst")
plt.tight_layout(); plt.show()
'''),
md(r"""
Read the worst layer: with k = 2 of 8 the mean load is T/4 pairs, so an imbalance of 4 is the most
there can be. It means one expert got every token, and its rank does the work while the others wait.

Now capacity. What share of the pairs would a capacity factor drop, layer by layer, with your
`capacity_keep` on the recorded routing (no model run needed)? Then what it does to perplexity:
`perplexity_vs_capacity` runs the model with every layer capped (top-4 here, layer 0 dense, the
best sparse setting of section 3), counting capacity over each forward's tokens as an engine counts
over a batch.
"""),
code(r'''
FACTORS = env.pick((1.0, 1.25, 1.5, 2.0), (1.0, 1.25))
PPL_FACTORS = env.pick(FACTORS, (1.0,))                                   # a forward each: fewer in quick mode
for f in FACTORS:
    shares = []
    for r in routes:
        cap = capacity(r.shape[0], 2, E, f)
        shares.append(1 - capacity_keep(r.to(env.device), E, cap).float().mean().item())
    print(f"capacity factor {f:<4}: top-2 drops {sum(shares) / len(shares):.1%} of the pairs on average, "
          f"{max(shares):.1%} in the worst layer")
start = time.perf_counter()
cap_ppl = perplexity_vs_capacity(moe, text, k=4, factors=PPL_FACTORS, window=PPL_WINDOW, dense_layers=(0,))
cap_ppl["no limit"] = (ppl_l0[4], 0.0)                                   # the same setting in section 3
print(f"\ntop-4, layer 0 dense, perplexity on {len(text)} tokens ({time.perf_counter() - start:.0f} s):")
for f, (p, dropped) in cap_ppl.items():
    print(f"  capacity factor {str(f):<5}: perplexity {p:>9,.1f}, {dropped:.1%} of the pairs dropped")
set_top_k(moe, E)
'''),
md(r"""
A capacity factor trades quality for a bounded step time: the busiest expert can do no more than
factor × the average. (At top-4 of 8, a factor of 2 gives each expert room for T pairs, one per
token: nothing can be dropped.) With a router this uneven even a generous factor drops many pairs,
and every dropped pair costs perplexity. Switch Transformer used 1.25 in training; inference engines for large MoEs
(vLLM, SGLang) usually drop nothing and live with the imbalance, or move hot experts around (EPLB,
below).

### Measure: how many experts does a decode batch wake?

At decode each request adds one token to the batch. A batch of B tokens reads the weights of every
expert any of them chose. With k of E experts per token and a uniform router, the expected share is
1 - (1 - k/E)^B. Draw random batches of B tokens from the recorded routing and count.
"""),
code(r'''
g = torch.Generator().manual_seed(0)
sizes = [b for b in (1, 2, 4, 8, 16, 32, 64) if b <= routes[0].shape[0]]
touched = {}
for B in sizes:
    shares = []
    for _ in range(env.pick(100, 20)):
        rows = torch.randperm(routes[0].shape[0], generator=g)[:B]   # cpu: indexes the recorded routing (on the CPU)
        shares += [(expert_load(r[rows], E) > 0).float().mean().item() for r in routes]
    touched[B] = sum(shares) / len(shares)
for B in sizes:
    print(f"decode batch {B:>3}: experts touched {touched[B]:.0%} (uniform router {touched_uniform(B, 2, E):.0%}); "
          f"weights read {touched[B]:.0%} of the MLP's, FLOPs {2 / E:.0%} of the dense MLP's per token")
fig, ax = plt.subplots(figsize=(6, 3.2))
ax.semilogx(sizes, [touched[b] for b in sizes], "o-", label="recorded routing")
ax.semilogx(sizes, [touched_uniform(b, 2, E) for b in sizes], "--", label="uniform: 1 - (1 - k/E)^B")
ax.set_xlabel("tokens in the decode batch"); ax.set_ylabel("share of experts touched"); ax.legend()
ax.set_title(f"top-2 of {E}"); plt.show()
'''),
md(r"""
Under a uniform router a batch of 8 tokens already touches 90% of the experts: a decode step reads
almost all of the MLP's weights while computing with a quarter of them. Our router touches fewer,
because its load is uneven (a few experts take most pairs, and neighbouring tokens of one text choose
alike), but its curve climbs the same way. Either way MoE decode is memory-bound on the **total**
parameters, not the active ones, once the batch holds more than a few tokens. That is why MoE serving
wants large batches, and expert parallelism, which splits those weight reads over GPUs.

### One batch, drawn

Your routing of the first tokens of the text in one layer, through the experts to 2 ranks: a line
per pair (thickness: its weight), and a capacity factor of 1.0 applied with your `capacity_keep`
(dashed red: dropped).
"""),
code(r'''
from course.moe.plots import plot_flow

n_show = 12
x_show = X[LAYER][:n_show].float()
ids_show, w_show = topk_route(layer.router(x_show.to(layer.router.weight.dtype)).float(), 2)
keep_show = capacity_keep(ids_show, E, capacity(n_show, 2, E, 1.0))
words = [tokenizer.decode([t]) for t in probe[:n_show]]
plot_flow(words, ids_show, w_show, E, world_size=2, keep=keep_show,
          title=f"layer {LAYER}: {n_show} tokens, top-2 of {E}, 2 ranks, capacity factor 1.0")
plt.show()
'''),
md(r"""
## Summary

- A mixture-of-experts layer replaces one MLP by E experts and a router that sends each token to k
  of them: k/E of the MLP's FLOPs per token. A dense SwiGLU MLP is a sum over neurons, so it can be
  cut into experts exactly (MoEfication); with all experts on it is the dense MLP.
- Without training, running only k experts loses a lot: on the whole held-out text (float32)
  perplexity 26 became about 250 at top-4 and 12,000 at top-2 on this model. Real MoEs train the router and the experts together, with a
  load-balancing loss.
- An engine regroups pairs by expert (sort, counts, offsets), pads each group to the kernel's block,
  and un-permutes the results with their weights; fixed-size arrays keep it free of host
  synchronization.
- A grouped GEMM runs every expert in one launch: each row block knows its expert from the aligned
  layout.
- Expert parallelism spreads experts over ranks with two all-to-alls per layer; each token costs
  about 2·k·(W-1)/W·C·b bytes per layer.
- Speed is set by the busiest expert or rank (imbalance), capacity limits trade dropped pairs for a
  bounded step, and at decode a batch of a few dozen tokens reads most of the experts' weights.

**Questions** Answer in the cell under each pair, in a few sentences of your own and with **your**
numbers where a question asks for them; a person grades them (3 points in all).

1. Why is the sum of all 8 experts equal to the dense MLP only "to float tolerance", and why does
   grouping co-activated neurons matter once k < E?
2. Why would softmax weights over all E experts, not renormalized, hurt a model trained with
   renormalized top-k weights? Why are plain weights of 1 right for MoEfied experts?
"""),
answer("moefy_router_answer", 1, "questions 1 and 2", model=r"""
1. The experts compute the same neuron terms, but add them in another order: each expert sums its
   192 neurons, then the 8 partial sums are added. Float addition is not associative, so the result
   differs in the last bits (about 1e-5 here on outputs up to 30, float32). Once k < E a token loses
   the experts it skips. If the neurons that fire together on a token share an expert, most of that
   token's activation lies in a few experts and skipping the rest loses little; with neurons dealt out
   at random, every expert holds about 1/E of it, and any k < E loses about (1 - k/E) of the output
   (the lab measured 36-59% of the mass in the top 2 with the shipped grouping, against 28-35% at random).
2. A trained MoE learned with weights that sum to 1 over its k experts. A softmax over all E, kept for
   only k, sums to less than 1 (the mass of the skipped experts), and that sum changes from token to
   token: the MLP's output is scaled down by an amount the model never saw, and the error compounds
   through the layers. MoEfied experts are pieces of a sum: the dense MLP is their plain sum, so each
   chosen expert should contribute its full output (weight 1); a softmax would shrink the output by
   about k times.
""", rubric=r"""
- 0.5: question 1: the same terms summed in another order (float rounding); grouping puts a token's
  mass in few experts, so skipping the others loses little (random: about (1 - k/E) lost).
- 0.5: question 2: unnormalized weights sum to less than 1, token-dependent, a shift the model was not
  trained for; MoEfied experts sum to the dense MLP, so weight 1 each.
"""),
md(r"""
3. Why do the dispatch arrays have a fixed length, the worst case, instead of the exact padded total?
   What does a CUDA graph need here?
4. For a decode batch of 8 tokens, top-2 of 8 experts, block_m = 64: how many rows does the grouped
   GEMM compute, and how many are real? What would you change?
"""),
answer("dispatch_kernel_answer", 1, "questions 3 and 4", model=r"""
3. The exact padded total depends on the routing, which exists only on the GPU. Allocating an array
   of that size, or sizing the kernel's grid from it, would need the count on the host: a
   synchronization that stalls the launch queue at every layer. A CUDA graph replays fixed shapes,
   pointers and grids and cannot read anything back. The worst case, P + E·(block_m - 1) rounded up
   to a block, does not depend on the routing: the arrays and the grid are fixed, and the blocks past
   `n_padded` (read by the kernel from device memory) return at once.
4. 16 pairs. Each expert that gets at least one pair gets at least one block of 64 rows: with the
   lab's routing about 5 of 8 experts per layer (64% touched at B = 8), so about 5 × 64 = 320 rows
   computed (a uniform router: about 7 experts, 448 rows), of which 16 are real: 3-5%. Use a smaller
   block_m for small batches (16, tl.dot's smallest tile), which is what tuned per-batch-size
   configurations do, or a decode kernel that puts the few tokens on the narrow side of the product
   (swap the roles of tokens and weights); at decode the cost is reading the weights anyway.
""", rubric=r"""
- 0.5: question 3: the size depends on the routing (on the device); an exact size needs a host
  synchronization; CUDA graphs need fixed shapes and grids; blocks past n_padded exit.
- 0.5: question 4: 16 real rows, one 64-row block per touched expert (a few hundred rows); smaller
  block_m or a decode-specific kernel.
"""),
md(r"""
5. Expert parallelism over 8 GPUs, DeepSeek-V3 shape (C = 7168, k = 8 routed experts, bf16): how many
   bytes does one token send per MoE layer under a uniform router? How does that compare with tensor
   parallelism's all-reduces of the same token over 8 GPUs (lab 12)?
6. Your router's imbalance was about the value printed in section 7. What does it cost in throughput,
   and what are three ways to reduce it (at training time, at serving time)?
"""),
answer("ep_load_answer", 1, "questions 5 and 6", model=r"""
5. 2·k·(W - 1)/W·C·b = 2 × 8 × 7/8 × 7168 × 2 = 200,704 bytes, about 200 KB per token per MoE layer
   (there and back). Tensor parallelism's two ring all-reduces of the token's activation send
   2 × 2(W - 1)/W·C·b = 2 × 2 × 7/8 × 7168 × 2 = 50,176 bytes: EP sends about 4 times more, because
   every token travels to k = 8 experts. That is why DeepSeek limits each token to experts on at most 4
   nodes and why DeepEP sends a token once per destination GPU rather than once per expert. EP's gain is
   elsewhere: each GPU holds 1/8 of the experts' weights and runs whole experts, with no split matmuls.
6. The layer waits for its busiest expert or rank, so its MoE part runs at about 1/imbalance of the
   throughput its FLOPs allow: with a mean imbalance of about 3 over experts (about 1.3 over 2 ranks)
   in the lab's run, the experts are a third as fast as an even spread would make them. Remedies: at
   training time, an auxiliary load-balancing loss (Switch, GShard) or DeepSeek-V3's per-expert bias
   nudged toward balance, or expert-choice routing; at serving time, a capacity factor (drops pairs,
   costs quality), EPLB (replicate hot experts and re-place experts by measured load), and larger
   batches, whose load is smoother.
""", rubric=r"""
- 0.5: question 5: about 200 KB per token per layer, about 4x TP's 50 KB, with the reason (k copies)
  and one mitigation or what EP buys.
- 0.5: question 6: throughput about 1/imbalance (with the student's number), and three remedies that
  include at least one at training time and one at serving time.
"""),
md(r"""
## Going further

- **Shared experts** (DeepSeekMoE, Dai et al., 2024; DeepSeek-V3): one or two experts every token
  always uses, plus many small routed experts (fine-grained experts, 256 in V3 with k = 8). The
  shared expert learns what all tokens need; the routed ones specialize.
- **Other routers**: DeepSeek-V3 scores experts with a sigmoid instead of a softmax, adds a
  per-expert bias that is nudged up or down to balance the load without an auxiliary loss, and
  limits each token to experts on a few nodes (group-limited routing) so its all-to-all stays
  short. Expert-choice routing (Zhou et al., 2022) lets experts pick their tokens: perfect balance,
  but a token may get no expert.
- **EPLB** (DeepSeek's expert-parallel load balancer, also in vLLM and SGLang): replicates the hot
  experts and rearranges experts over GPUs from the measured load.
- **DeepEP**: DeepSeek's all-to-all kernels for EP, one set for throughput (prefill, NVLink and
  RDMA), one for low latency (decode, fixed-size buffers, no host synchronization), sending a token
  once per destination GPU rather than once per pair.
- **Fused MoE kernels**: vLLM's `fused_moe` (the aligned layout you built, tuned tile configurations
  per GPU and shape, FP8 and INT4 weights), SGLang's, and grouped GEMMs in CUTLASS; Megablocks
  (Gale et al., 2022) computes MoE layers as block-sparse products with no dropped tokens.
- **Making an MoE**: training from scratch (Switch Transformer, Fedus et al., 2021; Mixtral),
  **sparse upcycling** (Komatsuzaki et al., 2022: copy a dense MLP into every expert and keep
  training), and MoEfication with fine-tuning (Zhang et al., 2022), which recovers much of the
  quality you saw lost.
"""),
]
