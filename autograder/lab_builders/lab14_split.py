"""Lab 14, sections 1-3: why mixture of experts, MoEfication (problem 1), the router and perplexity
against k (problem 2). Assembled by lab14.py."""
from autograder.authoring import code, md, solution, tests

# A tiny random SwiGLU MLP for the tests (the decoder's own MLP class), built in the test cells.
TINY_MLP = r'''
def _tiny_mlp(seed, d_model=16, d_ff=24, dtype=torch.float32):
    torch.manual_seed(seed)
    c = course.ModelConfig(family="llama", vocab_size=32, n_layer=1, n_head=2, n_kv_head=1, d_model=d_model,
                           d_ff=d_ff, max_seq_len=16)
    m = course.Decoder(c).blocks[0].mlp.to(device=env.device, dtype=dtype).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m
'''.strip("\n")

CELLS = [
md(r"""
## 1. Where the FLOPs of a decoder go

Count the multiply-adds of one token in the course model. Attention's projections take
4·C·(heads·head_dim) (fewer for GQA's keys and values), the MLP takes 3·C·d_ff, in every layer.
The MLP is most of the model: in SmolLM2-135M it is three quarters of each layer's weights, and in
large models more. So the MLP is where sparsity pays.
"""),
code(r'''
D = cfg.head_dim
attn = cfg.d_model * D * (2 * cfg.n_head + 2 * cfg.n_kv_head)       # q, o; k, v (GQA)
mlp = 3 * cfg.d_model * cfg.d_ff                                    # gate, up, down
print(f"per layer: attention {attn / 1e6:.2f} M weights, MLP {mlp / 1e6:.2f} M: the MLP is {mlp / (attn + mlp):.0%}")
for k in (1, 2, 4, 8):
    print(f"  top-{k} of {E} experts: a token reads and multiplies {k / E:.0%} of the MLP, "
          f"{(attn + mlp * k / E) / (attn + mlp):.0%} of the layer")
'''),
md(r"""
A trained MoE such as Mixtral has 8 experts per layer and routes each token to 2: a quarter of the
MLP's FLOPs. SmolLM2 was trained dense, so we first have to make experts out of it.

## 2. MoEfication: cut a dense MLP into experts

A SwiGLU MLP is a **sum over its d_ff neurons**. Neuron i has a row g_i of `gate_proj`, a row u_i of
`up_proj`, and a column d_i of `down_proj`:

    mlp(x) = down(silu(gate(x)) * up(x)) = sum_i silu(g_i · x) · (u_i · x) · d_i

Cut the neurons into E groups S_0, ..., S_{E-1} of N = d_ff / E each, and the sum falls into E
smaller SwiGLU MLPs, the experts:

    mlp(x) = sum_e expert_e(x),   expert_e = rows S_e of gate and up, columns S_e of down

With all E experts on, this is the dense MLP, summed in another order. With only k of them, a token
skips most of the work. How much that costs depends on the grouping: neurons that fire on the same
tokens should share an expert, so that a token finds most of its activation in a few experts. This is
**MoEfication** (Zhang et al., 2022). The course ships a grouping for every layer, made by a balanced
k-means on each neuron's activations over a calibration text (every expert gets exactly 192 of the
1536 neurons, so every expert is a GEMM of the same shape). You will use it below.

An engine stores the experts stacked, as vLLM does: `w_gate` and `w_up` of shape (E, N, C), and
`w_down` of shape (E, C, N), each expert's matrix the way `nn.Linear` stores it (out, in).

## Problem 1: Experts from a dense MLP (3 points)

**Deliverable:** `split_experts(mlp, neurons)` returns the stacked expert weights `(w_gate, w_up,
w_down)` of a dense SwiGLU MLP, where expert e holds the neurons `neurons[e]`.

- `mlp` is the decoder's MLP: `gate_proj.weight` and `up_proj.weight` are (d_ff, C), `down_proj.weight`
  is (C, d_ff). `neurons` is a (E, N) integer tensor holding every neuron index exactly once.
- `w_gate[e]` and `w_up[e]` are the rows `neurons[e]` of gate and up: (E, N, C). `w_down[e]` is the
  columns `neurons[e]` of down: (E, C, N). Keep the weights' dtype and device; detach them.
- Raise `ValueError` when `neurons` is not 2-D or does not hold each of the d_ff neurons exactly once.
"""),
solution("split_experts", r'''
def split_experts(mlp: nn.Module, neurons: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stacked expert weights of a dense SwiGLU MLP: expert e is the neurons neurons[e].
    Returns w_gate (E, N, C), w_up (E, N, C), w_down (E, C, N)."""
    ### BEGIN SOLUTION
    gate, up, down = (m.weight.detach() for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))   # (F, C), (F, C), (C, F)
    d_ff = gate.shape[0]
    if not isinstance(neurons, torch.Tensor) or neurons.dim() != 2:
        raise ValueError(f"neurons must be a (E, N) tensor, got {getattr(neurons, 'shape', type(neurons).__name__)}")
    if sorted(neurons.flatten().tolist()) != list(range(d_ff)):
        raise ValueError(f"neurons must hold each of the {d_ff} neurons exactly once")
    idx = neurons.to(device=gate.device, dtype=torch.long)                  # (E, N)
    w_gate = gate[idx]                                                      # (E, N, C): rows of gate
    w_up = up[idx]                                                          # (E, N, C)
    w_down = down[:, idx].permute(1, 0, 2).contiguous()                     # (C, E, N) -> (E, C, N): columns of down
    return w_gate, w_up, w_down
    ### END SOLUTION
'''),
md(r"""
Now cut a real layer with the shipped grouping, and check the claim: the sum of the 8 experts is the
dense MLP. Then see why the grouping matters: for each token, what share of its activation mass
(the sum of |silu(g_i·x)·(u_i·x)| over an expert's neurons) lies in its 2 heaviest experts, with the
shipped grouping and with neurons dealt out at random.
"""),
code(r'''
from course.moe.router import mlp_inputs

neurons = [m.neurons for m in moe_layers(moe)]                      # the shipped grouping: (E, N) per layer
LAYER = cfg.n_layer // 2
probe = HELDOUT[:env.pick(256, 32, cpu=128)]
X = [x.to(env.device) for x in mlp_inputs(model, probe)]             # what each MLP receives on the text: (T, C) per layer
x = X[LAYER].to(env.dtype)
w_gate, w_up, w_down = split_experts(model.blocks[LAYER].mlp, neurons[LAYER])
with torch.no_grad():
    dense_out = model.blocks[LAYER].mlp(x)                            # (T, C)
    experts_out = sum(swiglu(x, w_gate[e], w_up[e], w_down[e]) for e in range(E))
print(f"layer {LAYER}: experts {tuple(w_gate.shape)}, {tuple(w_down.shape)}; "
      f"max |sum of the {E} experts - dense MLP| = {(experts_out - dense_out).abs().max().item():.2e} "
      f"(outputs up to {dense_out.abs().max().item():.1f}, {str(env.dtype)[6:]})")

def top2_share(w_gate, w_up, x):
    mass = expert_mass(x.float(), w_gate.float(), w_up.float())        # (T, E)
    return (mass.topk(2, dim=-1).values.sum(-1) / mass.sum(-1)).mean().item()

g = torch.Generator().manual_seed(0)
random_split = torch.randperm(cfg.d_ff, generator=g).to(env.device).view(E, -1)
print(f"share of a token's activation mass in its 2 heaviest of {E} experts (an even spread would give {2 / E:.0%}):")
for li in (0, LAYER, cfg.n_layer - 1):
    xi = X[li].to(env.dtype)
    shipped = top2_share(*split_experts(model.blocks[li].mlp, neurons[li])[:2], xi)
    rand = top2_share(*split_experts(model.blocks[li].mlp, random_split)[:2], xi)
    print(f"  layer {li:>2}: shipped grouping {shipped:.0%}, neurons dealt out at random {rand:.0%}")
'''),
md(r"""
The shipped grouping puts more of each token's activation into its heaviest experts than a random
one, which does little better than an even spread, and more so in the last layers than in the
first. Still, the two heaviest experts hold well under all of the mass: SwiGLU neurons are not sparse
the way the ReLU neurons of the models MoEfication was invented for are. Keep that in mind for
section 3.

Now the whole model. `load_moe` replaced every MLP of `moe` (the second copy of the model) by an
`MoEMLP` built from the same grouping: the same stacked weights your function makes, and a router.
With all 8 experts on, its logits must be the dense model's, up to the order of float sums.
"""),
code(r'''
prompt = torch.tensor(HELDOUT[:32], device=env.device)[None]             # (1, 32)
pos = torch.arange(prompt.shape[1], device=env.device)[None]
set_top_k(moe, E)                                                        # every expert: the dense MLP
with torch.no_grad():
    dense_logits, moe_logits = model(prompt, pos).float(), moe(prompt, pos).float()
same_top = (dense_logits.argmax(-1) == moe_logits.argmax(-1)).float().mean().item()
print(f"all {E} experts vs dense: max |logits difference| {(dense_logits - moe_logits).abs().max().item():.2e} "
      f"(logits up to {dense_logits.abs().max().item():.0f}); same next token at {same_top:.0%} of positions")
'''),
tests("split_experts_tests", 3, TINY_MLP + r"""
mlp_t = _tiny_mlp(0)                                   # d_ff 24, C 16
nrn = torch.randperm(24).to(env.device).view(4, 6)     # 4 experts of 6 neurons, shuffled
out = expect_tuple(split_experts(mlp_t, nrn), "split_experts(mlp, neurons)", 3)
wg = expect_tensor(out[0], "w_gate", shape=(4, 6, 16), dtype=torch.float32, device=env.device)
wu = expect_tensor(out[1], "w_up", shape=(4, 6, 16), dtype=torch.float32, device=env.device)
wd = expect_tensor(out[2], "w_down", shape=(4, 16, 6), dtype=torch.float32, device=env.device)
assert torch.equal(wg[1], mlp_t.gate_proj.weight[nrn[1]].detach()), "w_gate[e] is the ROWS neurons[e] of gate_proj.weight"
assert torch.equal(wu[3], mlp_t.up_proj.weight[nrn[3]].detach()), "w_up[e] is the rows neurons[e] of up_proj.weight"
assert torch.equal(wd[2], mlp_t.down_proj.weight[:, nrn[2]].detach()), \
    "w_down[e] must be the COLUMNS neurons[e] of down_proj.weight, (C, N): indexing gives (C, E, N), and (C, E, N) -> (E, C, N) is a permute, not a reshape"
x_t = torch.randn(5, 16, device=env.device)
with torch.no_grad():
    total = sum(swiglu(x_t, wg[e], wu[e], wd[e]) for e in range(4))
    assert torch.allclose(total, mlp_t(x_t), atol=1e-5), "the sum of all experts must be the dense MLP"
### BEGIN HIDDEN TESTS
def _ref_experts_sum(m, groups, x):
    # the dense MLP's neuron terms, summed group by group: no stacked weights at all
    g = x @ m.gate_proj.weight.T
    u = x @ m.up_proj.weight.T
    h = F.silu(g) * u                                   # (T, F)
    return [h[:, grp] @ m.down_proj.weight[:, grp].T for grp in groups.tolist()]
for seed, (Ex, Nx), C_, dtype in ((1, (3, 8), 16, torch.float64), (2, (8, 3), 8, torch.float32), (3, (1, 24), 16, torch.float32),
                                  (4, (24, 1), 8, torch.float64)):
    m = _tiny_mlp(seed, d_model=C_, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    grp = torch.randperm(24, generator=g).to(env.device).view(Ex, Nx)
    a, b, c = expect_tuple(split_experts(m, grp), "split_experts(mlp, neurons)", 3)
    a = expect_tensor(a, "w_gate", shape=(Ex, Nx, C_), dtype=dtype, device=env.device)
    b = expect_tensor(b, "w_up", shape=(Ex, Nx, C_), dtype=dtype, device=env.device)
    c = expect_tensor(c, "w_down", shape=(Ex, C_, Nx), dtype=dtype, device=env.device)
    assert not (a.requires_grad or b.requires_grad or c.requires_grad), "detach the weights: experts are not trained here"
    xh = torch.randn(7, C_, device=env.device, dtype=dtype)
    with torch.no_grad():
        want = _ref_experts_sum(m, grp, xh)
        for e in range(Ex):
            got = (F.silu(xh @ a[e].T) * (xh @ b[e].T)) @ c[e].T
            assert torch.allclose(got, want[e], atol=1e-5), f"expert {e} of {Ex} is not the neurons neurons[{e}] of the dense MLP"
for bad, what in ((torch.arange(24, device=env.device), "a 1-D tensor"),
                  (torch.cat([torch.arange(23, device=env.device), torch.zeros(1, dtype=torch.long, device=env.device)]).view(4, 6),
                   "neuron 0 twice, 23 missing"),
                  (torch.arange(20, device=env.device).view(4, 5), "20 of the 24 neurons")):
    try:
        split_experts(mlp_t, bad)
    except ValueError:
        pass
    else:
        raise AssertionError(f"neurons with {what} must raise ValueError")
### END HIDDEN TESTS
"""),
md(r"""
## 3. The router: which k experts, and with what weight

A router is one linear layer: `logits = router(x)`, one score per expert. Each token goes to the k
experts with the highest scores. Their outputs are added with **weights**: Mixtral and Qwen-MoE take
a softmax over the k chosen scores, so the weights of a token sum to 1 (written as "softmax over all E,
keep the top k, renormalize", it is the same thing). A softmax over all E experts **without**
renormalizing would shrink every token's MLP output by the mass of the experts it skipped.

    logits (T, E) -> ids (T, k): the k best experts, best first
                  -> weights (T, k): softmax over those k logits

## Problem 2: Top-k routing (3 points)

**Deliverable:** `topk_route(logits, k)` returns `(ids, weights)` for router logits (T, E): `ids` (T,
k) `torch.long`, each token's k highest-scoring experts, best first; `weights` (T, k) `torch.float32`,
the softmax over those k logits only (computed in float32 whatever the logits' dtype). Raise
`ValueError` unless `logits` is a 2-D float tensor and k is an int from 1 to E.
"""),
solution("topk_route", r'''
def topk_route(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k best experts of each token, best first, and their renormalized softmax weights."""
    ### BEGIN SOLUTION
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float tensor (T, E), got {getattr(logits, 'shape', type(logits).__name__)}")
    if type(k) is not int or not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k must be an int from 1 to {logits.shape[1]}, got {k!r}")
    top, ids = torch.topk(logits.float(), k, dim=-1)                        # (T, k), sorted: best first
    weights = torch.softmax(top, dim=-1)                                    # renormalized over the k chosen
    return ids, weights
    ### END SOLUTION
'''),
tests("topk_route_tests", 3, r"""
lg = torch.tensor([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 0.0]], device=env.device)
out = expect_tuple(topk_route(lg, 2), "topk_route(logits, 2)", 2)
ids = expect_tensor(out[0], "ids", shape=(2, 2), dtype=torch.long, device=env.device)
w = expect_tensor(out[1], "weights", shape=(2, 2), dtype=torch.float32, device=env.device)
assert ids.tolist() == [[1, 3], [0, 2]], f"the 2 highest logits of each row, best first: [[1, 3], [0, 2]], got {ids.tolist()}"
assert torch.allclose(w.sum(-1), torch.ones(2, device=env.device)), \
    "the weights of a token must sum to 1: renormalize the softmax over the k chosen experts, not over all E"
assert torch.allclose(w[0], torch.softmax(torch.tensor([3.0, 2.0], device=env.device), -1)), "weights: softmax of the chosen logits"
### BEGIN HIDDEN TESTS
def _ref_route(lg, k):
    # brute force: sort each row by hand, softmax of the best k in float64
    ids, ws = [], []
    for row in lg.double().cpu().tolist():
        order = sorted(range(len(row)), key=lambda e: -row[e])[:k]
        m = max(row[e] for e in order)
        ex = [math.exp(row[e] - m) for e in order]
        ids.append(order); ws.append([v / sum(ex) for v in ex])
    return ids, ws
for seed, T, Ex, k, dtype in ((0, 9, 8, 2, torch.float32), (1, 5, 8, 1, torch.float32), (2, 4, 6, 6, torch.float64),
                              (3, 16, 16, 4, torch.bfloat16), (4, 1, 3, 3, torch.float16)):
    g = torch.Generator().manual_seed(seed)
    lg = torch.randperm(T * Ex, generator=g).to(env.device).view(T, Ex)
    lg = (lg.float() - T * Ex // 2).to(dtype)             # distinct integer scores: exact in every dtype
    i_, w_ = expect_tuple(topk_route(lg, k), f"topk_route(logits {tuple(lg.shape)} {dtype}, {k})", 2)
    i_ = expect_tensor(i_, "ids", shape=(T, k), dtype=torch.long, device=env.device)
    w_ = expect_tensor(w_, "weights", shape=(T, k), dtype=torch.float32, device=env.device)
    want_i, want_w = _ref_route(lg, k)
    assert i_.tolist() == want_i, f"{dtype}, k={k}: the k best experts, best first"
    want_w = torch.tensor(want_w, dtype=torch.float64)   # cpu: the reference
    assert torch.allclose(w_.double().cpu(), want_w, atol=1e-5), \
        f"{dtype}, k={k}: the weights must be the softmax over the k chosen logits (renormalize), in float32"
for bad in (lambda: topk_route(lg.float(), 0), lambda: topk_route(lg.float(), 4), lambda: topk_route(lg.float(), 2.0),
            lambda: topk_route(lg.float()[0], 1), lambda: topk_route(torch.ones(2, 3, dtype=torch.long, device=env.device), 1)):
    try:
        bad()
    except ValueError:
        pass
    else:
        raise AssertionError("bad logits (not 2-D float) or a k outside 1..E must raise ValueError")
### END HIDDEN TESTS
"""),
md(r"""
SmolLM2 has no router: it was never trained with one. The course fit one per layer after the fact,
by least squares (`course/moe/router.py`): on a calibration text (not the held-out text), the
router's 8 scores are fit to each expert's activation mass for each token. A few lines of linear
algebra per layer, no training loop. How good is it? Take the tokens of the probe text above, ask
your `topk_route` for the router's 2 best experts, and compare them with the 2 experts that truly
carry the most mass (the oracle, which needs to run every expert to know).
"""),
code(r'''
router = moe_layers(moe)[LAYER].router
with torch.no_grad():
    mass = expert_mass(X[LAYER].float(), w_gate.float(), w_up.float())        # (T, E): the oracle's view
    chosen, weights = topk_route(router(X[LAYER].float()), 2)                   # your routing
best, _ = topk_route(mass, 2)
recall = (F.one_hot(chosen, E).sum(1) * F.one_hot(best, E).sum(1)).sum().item() / best.numel()
print(f"layer {LAYER}: the router finds {recall:.0%} of each token's 2 heaviest experts (random picks: {2 / E:.0%})")
print(f"first 6 tokens: experts {chosen[:6].tolist()}, weights {[[round(v, 2) for v in r] for r in weights[:6].tolist()]}")
'''),
md(r"""
Now the price in quality. `perplexity_vs_k` scores the held-out text with k experts per token in
every layer (set_top_k), all else equal. Two details:

- **Weights.** MoEfied experts are pieces of a sum: the dense MLP is their plain sum, so each chosen
  expert should count fully (weight 1, `weighting="ones"`). Softmax weights belong to models *trained*
  with them; here they would scale the MLP's output down by about k times. (The full-size run below
  shows it.)
- **Layer 0.** The first layer suffers most from sparsity. DeepSeek-V3 keeps its first 3 layers
  dense; the second curve keeps layer 0 dense (`dense_layers=(0,)`).
"""),
code(r'''
PPL_WINDOW = min(PPL_TOKENS, 1024)
text = HELDOUT[:PPL_TOKENS]
KS = env.pick((1, 2, 4, 6, 8), (2, 4, 8), cpu=(2, 4, 6, 8))
start = time.perf_counter()
ppl = perplexity_vs_k(moe, text, ks=KS, window=PPL_WINDOW)
ppl_l0 = perplexity_vs_k(moe, text, ks=tuple(k for k in KS if k < E and k >= env.pick(2, 4)), window=PPL_WINDOW, dense_layers=(0,))
if not env.quick:
    soft = perplexity_vs_k(moe, text, ks=(4,), weighting="softmax", window=PPL_WINDOW)[4]
print(f"perplexity on {len(text)} held-out tokens ({time.perf_counter() - start:.0f} s on {env.device}, {str(env.dtype)[6:]}):")
for k in KS:
    extra = f"   layer 0 dense: {ppl_l0[k]:>9,.1f}" if k in ppl_l0 else ""
    print(f"  top-{k} of {E}: {ppl[k]:>10,.1f}{'  (all experts = the dense model)' if k == E else ''}{extra}")
if not env.quick:
    print(f"  top-4 with softmax weights instead of ones: {soft:,.1f}")
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.semilogy(list(ppl), list(ppl.values()), "o-", label="every layer sparse")
if ppl_l0:
    ax.semilogy(list(ppl_l0), list(ppl_l0.values()), "s--", label="layer 0 dense")
ax.axhline(ppl[E], color="gray", ls=":", label="dense model")
ax.set_xlabel(f"experts per token (k of {E})"); ax.set_ylabel("perplexity (log scale)")
ax.set_title("MoEfied SmolLM2-135M, no fine-tuning"); ax.legend(); plt.show()
'''),
md(r"""
Read the curve honestly: every expert you switch off costs perplexity, and at top-2 the model is
broken. (On the whole held-out text, 5,130 tokens, in float32 on a CPU, we measured 26 dense, about
250 at top-4 of 8, 112 with layer 0 dense, and about 12,000 at top-2; your slice gives numbers of
the same size.) Cutting
a trained dense model into experts after the fact loses a lot, for three reasons you have now seen:
SwiGLU activations are spread over many neurons (the 2 heaviest experts hold well under the whole
mass), a router fit by least squares misses some of the heavy experts, and errors compound through 30
layers. MoEfication papers recover most of it by fine-tuning the model with its experts, and models
that are MoEs from the start (Mixtral, DeepSeek, Qwen-MoE) learn experts that *specialize*, because
the router and the experts are trained together. What this lab builds does not depend on any of that: the dispatch,
the kernel, expert parallelism and the load statistics are the same for a trained MoE. The rest of
the lab keeps the quality question aside and works on speed.
"""),
]
