"""Lab 12, sections 1-4: why split a model, ranks and their messages, tensor parallelism (problems 1
and 2), and the ring all-reduce (problem 3). Assembled by lab12.py."""
from autograder.authoring import code, md, solution, tests

# A tiny random decoder for the tests, built in the test cells themselves (large weights: no near-ties).
TINY = r'''
def _tiny(family, n_head=4, n_kv_head=2, seed=0, n_layer=2):
    torch.manual_seed(seed)
    cfg_t = course.ModelConfig(family=family, vocab_size=64, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                               d_model=8 * n_head, d_ff=48, max_seq_len=64)
    m = course.Decoder(cfg_t).to(env.device).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m
'''.strip("\n")

# The hidden reference split (problem 2's tests): whole heads by index arithmetic, written apart from
# the student's answer to problem 1.
REF_SHARD = r'''
def _ref_linear(w, b):
    lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
        if b is not None:
            lin.bias.copy_(b)
    return lin
def _ref_cols(lin, r, W):      # output features r*n/W .. (r+1)*n/W
    n = lin.weight.shape[0] // W
    return _ref_linear(lin.weight[r * n:(r + 1) * n], None if lin.bias is None else lin.bias[r * n:(r + 1) * n])
def _ref_rows(lin, r, W):      # input features; the bias on rank 0 only
    n = lin.weight.shape[1] // W
    return _ref_linear(lin.weight[:, r * n:(r + 1) * n], lin.bias if (lin.bias is not None and r == 0) else None)
def _ref_shard(blk, c, r, W):
    llama = c.family == "llama"
    a, m = blk.attn, blk.mlp
    return TPBlock(rank=r, world_size=W, family=c.family, n_head=c.n_head // W, n_kv_head=c.n_kv_head // W,
                   head_dim=c.head_dim, attn_norm=blk.attn_norm, mlp_norm=blk.mlp_norm,
                   q=_ref_cols(a.q_proj, r, W), k=_ref_cols(a.k_proj, r, W), v=_ref_cols(a.v_proj, r, W),
                   o=_ref_rows(a.o_proj, r, W), up=_ref_cols(m.up_proj if llama else m.fc, r, W),
                   down=_ref_rows(m.down_proj if llama else m.proj, r, W),
                   gate=_ref_cols(m.gate_proj, r, W) if llama else None)
'''.strip("\n")

CELLS = [
md(r"""
## 1. When the model does not fit

A GPU holds the weights, the KV cache of every running request, and the activations of the step
in flight. Count the weights first. Below, `param_count` adds up the shapes of a Llama-family model
(embedding, per layer the four attention projections and the three MLP matrices, the norms, the
output head). Check it against the parameters of the model you loaded, then read off the larger
members of the family.
"""),
code(r'''
def param_count(c) -> int:
    """Parameters of a Llama-family decoder from its shapes."""
    D = c.head_dim
    attention = c.d_model * c.n_head * D * 2 + c.d_model * c.n_kv_head * D * 2   # q and o; k and v (GQA: fewer)
    mlp = 3 * c.d_model * c.d_ff                                                  # gate, up, down
    per_layer = attention + mlp + 2 * c.d_model                                    # + two norms
    embedding = c.vocab_size * c.d_model * (1 if c.tie_embeddings else 2)          # + an untied output head
    return c.n_layer * per_layer + embedding + c.d_model


def kv_bytes_per_token(c, dtype_bytes: int) -> int:
    return 2 * c.n_layer * c.n_kv_head * c.head_dim * dtype_bytes               # keys and values, every layer


print(f"{DEFAULT}: param_count = {param_count(cfg):,}; the loaded model has {cpu_model.num_parameters():,}")
LLAMA3 = {  # published shapes of Llama 3 (Meta, 2024)
    "Llama-3-8B": course.ModelConfig("llama", 128256, 32, 32, 8, 4096, 14336, 8192, tie_embeddings=False),
    "Llama-3-70B": course.ModelConfig("llama", 128256, 80, 64, 8, 8192, 28672, 8192, tie_embeddings=False),
    "Llama-3.1-405B": course.ModelConfig("llama", 128256, 126, 128, 8, 16384, 53248, 8192, tie_embeddings=False),
}
HBM = 80e9   # bytes on one H100 (80 GB)
print(f"\n{'model':>16} {'parameters':>12} {'weights, bf16':>14} {'KV per token':>13} {'H100s for the weights':>22}")
for name, c in [(DEFAULT, cfg), *LLAMA3.items()]:
    n = param_count(c)
    print(f"{name:>16} {n / 1e9:>11.2f}B {2 * n / 1e9:>11.1f} GB {kv_bytes_per_token(c, 2) / 1e6:>10.3f} MB "
          f"{2 * n / HBM:>22.2f}")
'''),
md(r"""
Seventy billion parameters are 141 GB in bf16: almost two H100s for the weights alone, before a single
token of KV cache. A server also wants room for many requests' caches (about a third of a megabyte
per token for the 70B model), so it spreads the model over 4 or 8 GPUs. The seeds' question, "what
do you do when the model does not fit in memory?", has two answers, and a third for serving:

```
tensor parallel (TP): every layer split     pipeline parallel (PP): the stack split      disaggregation
  GPU 0: half of every weight matrix          GPU 0: layers  0-39                           GPU 0: prefills
  GPU 1: the other half                       GPU 1: layers 40-79                           GPU 1: decodes
  they add partial results twice per layer    activations flow from one to the next         KV caches flow 0 -> 1
```

All three need processes that talk. That is where we start.

## 2. Ranks and messages

A distributed program is W copies of one function, the **ranks** 0 .. W-1 (W is the **world size**),
each in its own process, usually one per GPU. They talk in two ways:

- **collectives**, which every rank calls together: `all_reduce(x)` replaces each rank's `x` by the sum
  of all ranks' `x`. Every rank must make the same collective calls in the same order, or they wait
  for each other forever.
- **point to point**: `send(x, dst)` and `recv(buffer, src)`. The receiver must know the shape and
  dtype of what comes (it passes a buffer to fill), and with gloo a `send` waits until its receiver
  has taken the message.

`torch.distributed` provides both, with backends for GPUs (NCCL) and CPUs (gloo). In this lab a rank
gets a `comm` object with exactly those calls (`comm.rank`, `comm.world_size`, `comm.all_reduce`,
`comm.send`, `comm.recv`, `comm.isend`, `comm.irecv`, `comm.barrier`), which passes them to
`torch.distributed` and counts every byte (`comm.stats`). vLLM wraps its process groups in a similar
object (`GroupCoordinator`).

Two ways to start ranks, both given:

- `launch(fn, W, *args)` runs `fn(comm, *args)` in W processes **forked from this notebook** (so they
  have your functions and the model without copying them), connected by gloo over TCP on 127.0.0.1,
  exactly as `torchrun` connects ranks on real machines. Each rank uses one CPU thread (the ranks share
  the cores, and a forked process must not reuse its parent's thread pool). If a rank raises, the
  others are stopped and you get its error; nothing is left running.
- `run_threads(fn, W, *args)` runs the same `fn` in W threads of this process, with the same rules
  (a send waits for its receiver; collectives must match). The tests use it: it starts in
  microseconds, and it names a deadlock instead of hanging.

The ranks run on the CPU with gloo, also on a GPU machine: one GPU cannot hold several NCCL ranks,
and a forked process cannot use the CUDA of its parent. Section 8 runs the same code on several
GPUs with `torchrun` and NCCL.
"""),
code(r'''
def hello(comm):
    x = torch.tensor([float(comm.rank)], device="cpu")
    comm.all_reduce(x)                                    # every rank now holds 0 + 1 + 2
    print(f"I am rank {comm.rank} of {comm.world_size}; the sum of our ranks is {x.item():g}")
    return os.getpid()


pids = launch(hello, 3, timeout=LAUNCH_S)
print(f"three processes {pids}; this notebook is process {os.getpid()}")
print("three threads of this notebook:", run_threads(hello, 3))
'''),
md(r"""
What does a message cost? Time an all-reduce of growing buffers between two ranks. Small messages cost
a fixed **latency** (system calls, a round trip through the network stack); large ones are limited
by **bandwidth**. Here the "network" is the loopback device of this machine, so the bandwidth is a
memory copy through the kernel; between GPUs it is NVLink (NVIDIA specifies 900 GB/s in all for an
H100 SXM) or a network card between machines (25-50 GB/s for 200-400 Gb/s InfiniBand). Each size
keeps the fastest of 9 runs: on a busy machine the slower ones also include waiting for a core, which
is not the cost of the message.
"""),
code(r'''
def all_reduce_cost(comm, sizes: list[int], repeats: int) -> list[float]:
    """Fastest seconds of one all-reduce of each size (bytes of float32) over `repeats` runs."""
    out = []
    for n_bytes in sizes:
        x = torch.ones(n_bytes // 4, device="cpu")
        comm.all_reduce(x)                                # warm-up: the first call of a size sets up buffers
        runs = []
        for _ in range(repeats):
            comm.barrier()                                # start together
            start = time.perf_counter()
            comm.all_reduce(x)
            runs.append(time.perf_counter() - start)
        out.append(min(runs))                             # the slower runs also waited for a core
    return out


sizes = [2 ** k for k in range(10, env.pick(27, 23, cpu=25), 2)]
ar_seconds = launch(all_reduce_cost, 2, sizes, 9, timeout=LAUNCH_S)[0]
AR_LATENCY = min(t for n, t in zip(sizes, ar_seconds) if n <= 16384)   # small messages: (almost) all latency
AR_BANDWIDTH = sizes[-1] / max(ar_seconds[-1] - AR_LATENCY, ar_seconds[-1] / 2)   # the largest: bytes past the latency
for n, t in zip(sizes, ar_seconds):
    print(f"{n:>11,} bytes: {1e6 * t:>9.1f} µs  ({n / t / 1e9:6.2f} GB/s)")
print(f"\nthis machine, gloo on loopback, 2 ranks: latency ~{1e6 * AR_LATENCY:.0f} µs, "
      f"bandwidth ~{AR_BANDWIDTH / 1e9:.1f} GB/s")
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.loglog(sizes, [1e6 * t for t in ar_seconds], "o-", label="measured")
ax.loglog(sizes, [1e6 * (AR_LATENCY + n / AR_BANDWIDTH) for n in sizes], "--", label="latency + bytes / bandwidth")
ax.set_xlabel("bytes per rank"); ax.set_ylabel("µs per all-reduce"); ax.set_title("all-reduce, 2 ranks, gloo, CPU")
ax.legend(); plt.show()
'''),
md(r"""
Keep these two numbers: they say what each all-reduce of tensor parallelism will cost here.

## 3. Tensor parallelism: split every layer

A linear layer computes `Y = X M^T`, its weight `M` of shape (out, in) (that is how `nn.Linear` stores
it). There are two ways to share the work between W ranks (Megatron-LM, Shoeybi et al. 2019):

```
column-parallel: split M by OUTPUT rows            row-parallel: split M by INPUT columns
  rank 0: Y[:, :n/2] = X M[:n/2]^T                   rank 0: P0 = X[:, :k/2] M[:, :k/2]^T   (all n outputs, partial)
  rank 1: Y[:, n/2:] = X M[n/2:]^T                   rank 1: P1 = X[:, k/2:] M[:, k/2:]^T
  each rank owns some outputs: no communication      Y = P0 + P1: one all-reduce
```

The trick is to **pair** them: a column-parallel layer leaves each rank with a slice of the features,
which is exactly the input slice a row-parallel layer needs. Nothing moves in between, and one
all-reduce after the pair makes every rank's output whole again.

- **Attention**: heads are independent of each other. Split `q`, `k` and `v` column-wise by heads
  (rank r computes its own heads' attention, start to end), and `o` row-wise by the same heads.
  One all-reduce.
- **MLP**: `gate` and `up` column-wise (SiLU(gate) * up is element by element: it stays local),
  `down` row-wise. One all-reduce. GPT-2's MLP is the same with `fc` for up and `proj` for down.

Two all-reduces per layer, each of one (B, T, C) activation. Every rank holds 1/W of every weight
matrix and computes 1/W of every matmul. Three details make or break it:

1. **Whole heads.** Cut the rows of `q` at head boundaries (units of `head_dim` rows).
2. **GQA.** Query head h reads KV head h // (H / Hkv). If rank r holds query heads
   r·H/W .. (r+1)·H/W - 1, the KV heads they read are exactly r·Hkv/W .. (r+1)·Hkv/W - 1: the same
   slice of `k` and `v`, so W must divide both H and Hkv. The default model has 9 query heads and 3 KV
   heads: W can be 1 or 3, **not 2**. (vLLM, when W is larger than Hkv and a multiple of it,
   replicates each KV head on W / Hkv ranks; 2 ranks and 3 KV heads cannot work either way.)
3. **Biases** (GPT-2). A column-parallel bias is split with its rows. A row-parallel layer's output is
   a partial sum; the all-reduce adds the partial sums, so its bias must be added **once**: keep it
   on rank 0 only.

```
      x (B, T, C), the same on every rank
      |-- rank 0: q,k,v heads 0-2 -> attention -> o[:, cols of heads 0-2] -> partial --\
      |-- rank 1: q,k,v heads 3-5 -> attention -> o[:, cols of heads 3-5] -> partial ---+-- all-reduce -> (B, T, C)
      |-- rank 2: q,k,v heads 6-8 -> attention -> o[:, cols of heads 6-8] -> partial --/
```

## Problem 1: Split the weights (4 points)

**Deliverable:**
- `column_parallel(linear, rank, world, unit=1)`: a new `nn.Linear` holding this rank's share of the
  **output** features of `linear` (rows of the weight, and of the bias if there is one): the
  `rank`-th of `world` equal pieces, each made of whole units of `unit` rows.
- `row_parallel(linear, rank, world, unit=1)`: a new `nn.Linear` holding this rank's share of the
  **input** features (columns of the weight), with the bias on rank 0 only (no bias on other ranks).
- Both keep the weights' dtype and device, and raise `ValueError` when the features cannot be cut
  into `world` pieces of whole units, or `rank` is not in 0 .. world - 1.
- `shard_block(block, cfg, rank, world)`: this rank's `TPBlock` (given, see `help(TPBlock)`) of a
  `Block` of the course model: `q`, `k`, `v` column-parallel and `o` row-parallel by whole heads
  (`unit=cfg.head_dim`), `gate` and `up` column-parallel and `down` row-parallel (GPT-2: `up` is
  `mlp.fc`, `down` is `mlp.proj`, no `gate`), the norms shared as they are, and this rank's head
  counts. Check `n_head` first, then `n_kv_head`, and raise `ValueError` naming the first one that
  `world` does not divide.

Graded case by case: each check of the tests earns its share of the 4 points, and the feedback lists the
cases that failed.

**One rule for these answers and Problem 2's.** Section 8 runs them in fresh processes under `torchrun`,
from a file that `answers_file` writes: their source, the source of helper functions of yours they
call, and imports for the course's functions and the libraries they use. A notebook's data cannot go
into a file: an answer that reads the model, a tensor or a dict of this notebook as a global fails
there (pass it as an argument, or build it inside the function). The tests write your answers to such
a file and run them from it.
"""),
solution("shard_weights", r'''
def column_parallel(linear: nn.Linear, rank: int, world: int, unit: int = 1) -> nn.Linear:
    """This rank's share of the OUTPUT features of `linear`: rows of its weight (out, in) and of its
    bias, the rank-th of `world` equal pieces of whole units of `unit` rows."""
    ### BEGIN SOLUTION
    n = linear.out_features
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    if n % (unit * world):
        raise ValueError(f"column_parallel: {n} output features make {n / unit:g} units of {unit}, "
                         f"which world={world} ranks cannot share evenly")
    per = n // world
    rows = slice(rank * per, (rank + 1) * per)
    part = nn.Linear(linear.in_features, per, bias=linear.bias is not None,
                     device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        part.weight.copy_(linear.weight[rows])                           # (per, in)
        if linear.bias is not None:
            part.bias.copy_(linear.bias[rows])
    return part
    ### END SOLUTION


def row_parallel(linear: nn.Linear, rank: int, world: int, unit: int = 1) -> nn.Linear:
    """This rank's share of the INPUT features of `linear`: columns of its weight. Its output is a
    partial sum; the all-reduce adds the partial sums, so the bias goes in once: on rank 0."""
    ### BEGIN SOLUTION
    n = linear.in_features
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in 0..{world - 1}, got {rank}")
    if n % (unit * world):
        raise ValueError(f"row_parallel: {n} input features make {n / unit:g} units of {unit}, "
                         f"which world={world} ranks cannot share evenly")
    per = n // world
    cols = slice(rank * per, (rank + 1) * per)
    keep_bias = linear.bias is not None and rank == 0
    part = nn.Linear(per, linear.out_features, bias=keep_bias,
                     device=linear.weight.device, dtype=linear.weight.dtype)
    with torch.no_grad():
        part.weight.copy_(linear.weight[:, cols])                        # (out, per)
        if keep_bias:
            part.bias.copy_(linear.bias)
    return part
    ### END SOLUTION


def shard_block(block, cfg, rank: int, world: int) -> TPBlock:
    """Rank `rank`'s share of one Block: whole heads of attention, a slice of the MLP's hidden units."""
    ### BEGIN SOLUTION
    for name, heads in (("n_head", cfg.n_head), ("n_kv_head", cfg.n_kv_head)):
        if heads % world:
            raise ValueError(f"world={world} does not divide {name}={heads}: every rank must hold whole heads")
    D = cfg.head_dim
    attn, mlp = block.attn, block.mlp
    llama = cfg.family == "llama"
    return TPBlock(
        rank=rank, world_size=world, family=cfg.family,
        n_head=cfg.n_head // world, n_kv_head=cfg.n_kv_head // world, head_dim=D,
        attn_norm=block.attn_norm, mlp_norm=block.mlp_norm,               # small: every rank has them
        q=column_parallel(attn.q_proj, rank, world, unit=D),              # this rank's query heads,
        k=column_parallel(attn.k_proj, rank, world, unit=D),              # the KV heads they read
        v=column_parallel(attn.v_proj, rank, world, unit=D),
        o=row_parallel(attn.o_proj, rank, world, unit=D),                 # partial sums: all-reduce
        gate=column_parallel(mlp.gate_proj, rank, world) if llama else None,
        up=column_parallel(mlp.up_proj if llama else mlp.fc, rank, world),
        down=row_parallel(mlp.down_proj if llama else mlp.proj, rank, world))   # partial sums: all-reduce
    ### END SOLUTION
'''),
code(r'''
for world in (2, 3):
    try:
        shard = shard_block(cpu_model.blocks[0], cfg, 0, world)
    except ValueError as e:
        print(f"W = {world}: ValueError: {e}\n")
        continue
    print(f"W = {world}: every rank holds {shard.n_head} query heads and {shard.n_kv_head} KV head of each layer")
    whole = whole_block(cpu_model.blocks[0], cfg)
    for name in ("q", "k", "v", "o", "gate", "up", "down"):
        print(f"  {name:>4}: {str(tuple(getattr(whole, name).weight.shape)):>12} -> {tuple(getattr(shard, name).weight.shape)}")
rank0_bytes = sum(shard_block(b, cfg, 0, 3).parameter_bytes() for b in cpu_model.blocks)     # every rank holds as much
shared = sum(p.nbytes for p in cpu_model.embed.parameters()) + sum(p.nbytes for p in cpu_model.norm.parameters())
whole_bytes = sum(whole_block(b, cfg).parameter_bytes() for b in cpu_model.blocks)
print(f"\nblocks: {whole_bytes / 1e6:.0f} MB whole, {rank0_bytes / 1e6:.0f} MB on each of 3 ranks "
      f"(+ {shared / 1e6:.0f} MB of embedding every rank keeps whole here)")
print(f"KV cache per token: {kv_bytes_per_token(cfg, 4):,} bytes whole; each rank caches only its own "
      f"KV heads: {kv_bytes_per_token(cfg, 4) // 3:,} bytes")
'''),
tests("shard_weights_tests", 4, r"""
from course.expect import Cases
cases = Cases(points=4)        # one share of the 4 points per case: the feedback lists the cases that failed
lin = nn.Linear(6, 8, device=env.device)
def rows_of(r, world=2):
    return expect_type(row_parallel(lin, r, world), f"row_parallel(lin, {r}, {world})", nn.Linear)
with cases("column_parallel keeps output rows and their bias"):
    col = expect_type(column_parallel(lin, 1, 2), "column_parallel(lin, 1, 2)", nn.Linear)
    w = expect_tensor(col.weight.detach(), "column_parallel(...).weight", shape=(4, 6), dtype=lin.weight.dtype, device=env.device)
    assert torch.equal(w, lin.weight[4:8].detach()), \
        "column-parallel keeps OUTPUT features: rows 4..7 of the weight (nn.Linear stores (out, in)), not columns"
    b = expect_tensor(col.bias.detach() if col.bias is not None else None, "column_parallel(...).bias", shape=(4,), device=env.device)
    assert torch.equal(b, lin.bias[4:8].detach()), "the bias is split with the rows it belongs to"
with cases("row_parallel keeps input columns"):
    w1 = expect_tensor(rows_of(1).weight.detach(), "row_parallel(lin, 1, 2).weight", shape=(8, 3), device=env.device)
    assert torch.equal(w1, lin.weight[:, 3:6].detach()), "row-parallel keeps INPUT features: columns 3..5 of the weight"
with cases("row-parallel partial sums add up to the layer"):
    rows = [rows_of(r) for r in range(2)]
    x = torch.randn(5, 6, device=env.device)
    with torch.no_grad():
        total = rows[0](x[:, :3]) + rows[1](x[:, 3:])
    assert torch.allclose(total, lin(x).detach(), atol=1e-5), \
        "the partial sums of the ranks must add up to the whole layer: keep the bias on rank 0 only (the all-reduce adds it W times otherwise)"
for what, bad in (("6 features in units of 3 over 3 ranks", lambda: column_parallel(nn.Linear(4, 6, device=env.device), 0, 3, unit=3)),
                  ("6 input features over 4 ranks", lambda: row_parallel(lin, 0, 4))):
    with cases(f"{what}: ValueError"):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError(f"{what} cannot be cut into equal pieces of whole units: raise ValueError")
def _tiny(family, n_head=4, n_kv_head=2, seed=0, n_layer=2):
    torch.manual_seed(seed)
    cfg_t = course.ModelConfig(family=family, vocab_size=64, n_layer=n_layer, n_head=n_head, n_kv_head=n_kv_head,
                               d_model=8 * n_head, d_ff=48, max_seq_len=64)
    m = course.Decoder(cfg_t).to(env.device).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return m
tiny = _tiny("llama")                       # 4 query heads, 2 KV heads, head_dim 8
blk = tiny.blocks[0]
def shard_1_of_2():
    return expect_type(shard_block(blk, tiny.cfg, 1, 2), "shard_block(block, cfg, 1, 2)", TPBlock)
with cases("shard_block: this rank's head counts"):
    s = shard_1_of_2()
    assert (expect_int(s.n_head, "shard.n_head"), expect_int(s.n_kv_head, "shard.n_kv_head"),
            expect_int(s.head_dim, "shard.head_dim")) == (2, 1, 8), "rank 1 of 2 holds 2 of the 4 query heads and 1 of the 2 KV heads"
with cases("shard_block: q, k, gate and up column-parallel"):
    s = shard_1_of_2()
    for name, full, rows_ in (("q", blk.attn.q_proj, slice(16, 32)), ("k", blk.attn.k_proj, slice(8, 16)),
                              ("gate", blk.mlp.gate_proj, slice(24, 48)), ("up", blk.mlp.up_proj, slice(24, 48))):
        got = expect_tensor(expect_type(getattr(s, name), f"shard.{name}", nn.Linear).weight.detach(), f"shard.{name}.weight",
                            device=env.device)
        assert got.shape == full.weight[rows_].shape and torch.equal(got, full.weight[rows_].detach()), \
            f"shard.{name} must be column-parallel: rank 1 keeps rows {rows_.start}..{rows_.stop - 1} (whole heads for q, k, v)"
with cases("shard_block: o row-parallel over the same heads"):
    s = shard_1_of_2()
    got = expect_tensor(expect_type(s.o, "shard.o", nn.Linear).weight.detach(), "shard.o.weight", device=env.device)
    assert got.shape == (32, 16) and torch.equal(got, blk.attn.o_proj.weight[:, 16:32].detach()), \
        "shard.o is row-parallel over the same heads as q: columns 16..31"
with cases("shard_block names the head count the world does not divide"):
    for world, what in ((3, "n_head"), (4, "n_kv_head")):
        try:
            shard_block(blk, tiny.cfg, 0, world)
        except ValueError as e:
            assert what in str(e), f"the error for world={world} must name {what}, got: {e}"
        else:
            raise AssertionError(f"world={world} does not divide the heads (4 query, 2 KV): raise ValueError naming {what}")
with cases("run from the file torchrun loads (section 8)"):
    try:
        from_file = import_answers(answers_file([column_parallel, row_parallel, shard_block]))
    except ValueError as e:
        raise AssertionError(f"your answers cannot be written to a file for torchrun: {e}") from None
    col = expect_type(from_file.column_parallel(lin, 1, 2), "column_parallel (from the file)", nn.Linear)
    assert torch.equal(expect_tensor(col.weight.detach(), "column_parallel(...).weight (from the file)", device=env.device),
                       lin.weight[4:8].detach()), "run from the answers file, column_parallel must give the same rows 4..7"
### BEGIN HIDDEN TESTS
def _w(m, what):
    return expect_tensor(expect_type(m, what, nn.Linear).weight.detach(), what + ".weight", device=env.device)
# every rank, several worlds and units: rows / columns in order, shapes, dtype, bias
for dtype in (torch.float32, torch.float64):
    with cases(f"column_parallel and row_parallel on every rank, {dtype}"):
        full = nn.Linear(12, 24, bias=True, device=env.device, dtype=dtype)
        nob = nn.Linear(24, 12, bias=False, device=env.device, dtype=dtype)
        for world, unit in ((1, 1), (2, 4), (3, 2), (4, 3), (6, 1), (12, 2)):
            got_rows = [_w(column_parallel(full, r, world, unit), "column_parallel") for r in range(world)]
            assert all(g.dtype == dtype for g in got_rows), "keep the weight's dtype"
            assert torch.equal(torch.cat(got_rows, 0), full.weight.detach()), \
                f"world={world}: the ranks' rows, in rank order, must be the whole weight"
            biases = [column_parallel(full, r, world, unit).bias for r in range(world)]
            assert all(bb is not None for bb in biases) and torch.equal(torch.cat([bb.detach() for bb in biases]), full.bias.detach()), \
                "a column-parallel layer keeps the bias of its rows"
            got_cols = [_w(row_parallel(nob, r, world, unit), "row_parallel") for r in range(world)]
            assert torch.equal(torch.cat(got_cols, 1), nob.weight.detach()), "the ranks' columns, in order, are the whole weight"
            assert all(row_parallel(nob, r, world, unit).bias is None for r in range(world)), "no bias stays no bias"
            assert all(column_parallel(nn.Linear(3, 24, bias=False, device=env.device), r, world, unit).bias is None
                       for r in range(world)), "a layer without bias gives pieces without bias"
    with cases(f"row-parallel partial sums add up, the bias once, {dtype}"):
        xs = torch.randn(3, 2, 24, device=env.device, dtype=dtype)
        full2 = nn.Linear(24, 5, device=env.device, dtype=dtype)
        for world in (2, 3, 4):
            parts = [expect_type(row_parallel(full2, r, world), "row_parallel(...)", nn.Linear) for r in range(world)]
            assert parts[0].bias is not None and all(p.bias is None or not bool(p.bias.detach().abs().sum())
                                                      for p in parts[1:]), "the bias of a row-parallel layer: rank 0 only"
            n = 24 // world
            with torch.no_grad():
                tot = sum(p(xs[..., r * n:(r + 1) * n]) for r, p in enumerate(parts))
                assert torch.allclose(tot, full2(xs), atol=1e-5 if dtype == torch.float32 else 1e-10), \
                    f"world={world}: partial sums of the row-parallel ranks must add up to the layer (bias once)"
with cases("uneven pieces, units cut in two, ranks out of range: ValueError"):
    for bad in ((lambda: column_parallel(nn.Linear(4, 10, device=env.device), 0, 4)),
                (lambda: column_parallel(nn.Linear(4, 12, device=env.device), 0, 4, unit=6)),
                (lambda: row_parallel(nn.Linear(9, 4, device=env.device), 0, 2)),
                (lambda: row_parallel(nn.Linear(12, 4, device=env.device), 0, 3, unit=8)),
                (lambda: column_parallel(nn.Linear(4, 12, device=env.device), 4, 4)),
                (lambda: row_parallel(nn.Linear(12, 4, device=env.device), -1, 2))):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("uneven pieces, units cut in two, and a rank outside 0..world-1 must raise ValueError")
# the GPT-2 family (MHA, biases) and every rank of several worlds
for family, H, Hkv, world in (("gpt2", 4, 4, 2), ("gpt2", 4, 4, 4), ("llama", 4, 2, 2), ("llama", 6, 3, 3), ("llama", 4, 4, 1)):
    with cases(f"shard_block of a {family} block, {H} query and {Hkv} KV heads, on each of {world} ranks"):
        t = _tiny(family, H, Hkv, seed=world)
        c, blk_t = t.cfg, t.blocks[1]
        D = c.head_dim
        for r in range(world):
            s = expect_type(shard_block(blk_t, c, r, world), "shard_block(...)", TPBlock)
            got_fields = tuple(expect_int(getattr(s, f), f"shard.{f}") for f in ("rank", "world_size", "n_head", "n_kv_head", "head_dim"))
            assert got_fields == (r, world, H // world, Hkv // world, D) and expect_type(s.family, "shard.family", str) == family, \
                "rank, world_size, family, this rank's head counts and head_dim"
            assert s.attn_norm is blk_t.attn_norm and s.mlp_norm is blk_t.mlp_norm, "the norms are shared as they are"
            qh, kh = H // world * D, Hkv // world * D
            for name, fullm, sl, col in (("q", blk_t.attn.q_proj, slice(r * qh, (r + 1) * qh), True),
                                        ("k", blk_t.attn.k_proj, slice(r * kh, (r + 1) * kh), True),
                                        ("v", blk_t.attn.v_proj, slice(r * kh, (r + 1) * kh), True),
                                        ("o", blk_t.attn.o_proj, slice(r * qh, (r + 1) * qh), False)):
                want = fullm.weight[sl] if col else fullm.weight[:, sl]
                got = _w(getattr(s, name), f"shard.{name}")
                assert got.shape == want.shape and torch.equal(got, want.detach()), \
                    f"{family}, rank {r} of {world}: shard.{name} holds the wrong slice (whole heads, GQA: KV heads of the same ranks)"
                if fullm.bias is not None and col:
                    assert getattr(s, name).bias is not None and torch.equal(getattr(s, name).bias.detach(), fullm.bias[sl].detach()), \
                        f"GPT-2: shard.{name} keeps the bias of its heads"
            up_full = blk_t.mlp.up_proj if family == "llama" else blk_t.mlp.fc
            dn_full = blk_t.mlp.down_proj if family == "llama" else blk_t.mlp.proj
            f = c.d_ff // world
            assert torch.equal(_w(s.up, "shard.up"), up_full.weight[r * f:(r + 1) * f].detach()), "up (GPT-2: fc) is column-parallel"
            assert torch.equal(_w(s.down, "shard.down"), dn_full.weight[:, r * f:(r + 1) * f].detach()), "down (GPT-2: proj) is row-parallel"
            if family == "llama":
                assert torch.equal(_w(s.gate, "shard.gate"), blk_t.mlp.gate_proj.weight[r * f:(r + 1) * f].detach()), "gate is column-parallel"
            else:
                assert s.gate is None, "GPT-2 has no gate"
                hasb = [p.bias is not None and bool(p.bias.detach().abs().sum()) for p in (s.o, s.down)]
                assert hasb == [r == 0, r == 0], "row-parallel biases (o and proj) on rank 0 only"
# the default model's shape: 9 query heads, 3 KV heads
smol = course.ModelConfig("llama", 64, 1, 9, 3, 72, 48, 16)
b9 = course.Decoder(smol).to(env.device).blocks[0]
with cases("shard_block of the default model's shape: 9 query heads, 3 KV heads"):
    s9 = expect_type(shard_block(b9, smol, 2, 3), "shard_block(..., 2, 3)", TPBlock)
    assert (expect_int(s9.n_head, "shard.n_head"), expect_int(s9.n_kv_head, "shard.n_kv_head")) == (3, 1) and _w(s9.k, "k").shape == (8, 72), \
        "9 query heads and 3 KV heads over 3 ranks: 3 query heads and 1 KV head (8 rows of k) each"
with cases("shard_block of 9 and 3 heads over worlds that do not divide them"):
    for world, what in ((2, "n_head"), (9, "n_kv_head"), (6, "n_head")):
        try:
            shard_block(b9, smol, 0, world)
        except ValueError as e:
            assert what in str(e), f"world={world} with 9 query and 3 KV heads: the error must name {what}"
        else:
            raise AssertionError(f"world={world} does not divide 9 query heads and 3 KV heads: ValueError")
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
## Problem 2: The tensor-parallel block (4 points)

Now the forward pass of one block on one rank. Every rank gets the same input `h` (the block's input
after its norm, (B, T, C)) and its own `TPBlock`. Attention: project `h` to this rank's query, key and
value heads, rotate queries and keys (`apply_rope`, when `rope` is not None), let each query head read
its KV head (GQA: `repeat_interleave` by the group size, which is the same on every rank), causal
attention, then the rank's slice of `o`: a (B, T, C) partial sum. One `comm.all_reduce` adds the ranks'
partial sums: after it, every rank holds the same complete attention output. The MLP: `gate` and `up`
(GPT-2: `up` with GELU, `approximate="tanh"`), `down`, one all-reduce.

Use this rank's head counts (`shard.n_head`, `shard.n_kv_head`), not the model's. `tp_forward`
(given) runs the whole model with your two functions:

    x = embed(ids)                                    # replicated
    for each layer:  x = x + tp_attention(attn_norm(x), shard, rope, comm)
                     x = x + tp_mlp(mlp_norm(x), shard, comm)
    logits = lm_head(norm(x))                         # replicated

**Deliverable:** `tp_attention(h, shard, rope, comm)` and `tp_mlp(h, shard, comm)`: each returns the
complete (B, T, C) output of its half of the block, identical on every rank, after exactly one
`comm.all_reduce` (and no other communication).
"""),
solution("tp_block", r'''
def tp_attention(h: torch.Tensor, shard: TPBlock, rope, comm) -> torch.Tensor:
    """Attention of this rank's heads, then one all-reduce. h: (B, T, C), the same on every rank."""
    ### BEGIN SOLUTION
    B, T, _ = h.shape
    H, Hkv, D = shard.n_head, shard.n_kv_head, shard.head_dim
    q = shard.q(h).view(B, T, H, D).transpose(1, 2)                       # (B, H, T, D): this rank's heads
    k = shard.k(h).view(B, T, Hkv, D).transpose(1, 2)                     # (B, Hkv, T, D)
    v = shard.v(h).view(B, T, Hkv, D).transpose(1, 2)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    k = k.repeat_interleave(H // Hkv, dim=1)                              # (B, H, T, D): GQA, within the rank
    v = v.repeat_interleave(H // Hkv, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)          # (B, H, T, D)
    out = shard.o(y.transpose(1, 2).reshape(B, T, H * D))                # (B, T, C): a partial sum
    comm.all_reduce(out)                                                  # the sum over ranks: complete
    return out
    ### END SOLUTION


def tp_mlp(h: torch.Tensor, shard: TPBlock, comm) -> torch.Tensor:
    """The MLP on this rank's hidden units, then one all-reduce. h: (B, T, C)."""
    ### BEGIN SOLUTION
    if shard.gate is not None:
        a = F.silu(shard.gate(h)) * shard.up(h)                           # (B, T, d_ff / W): local
    else:
        a = F.gelu(shard.up(h), approximate="tanh")
    out = shard.down(a)                                                   # (B, T, C): a partial sum
    comm.all_reduce(out)
    return out
    ### END SOLUTION
'''),
md(r"""
Run the model on 3 processes, each with its third of every layer, and compare with the whole model in
one process (one thread each, so the comparison is fair). The ranks add their partial sums in another
order than one matmul does, so float32 logits agree to about 1e-4, not bit for bit (the tests allow
2e-4 on tiny models).
"""),
code(r'''
prompt = tokenizer("The capital of France is Paris. The capital of Italy is").input_ids
tp_ids = torch.tensor([prompt], device="cpu")
tp_pos = torch.arange(len(prompt), device="cpu")[None]
TP_T, TP_W, TP_REPEATS = len(prompt), 3, env.pick(5, 1)


def tp_rank(comm, model, ids, pos, repeats):
    shards = [shard_block(b, model.cfg, comm.rank, comm.world_size) for b in model.blocks]
    run = lambda: tp_forward(model, shards, ids, pos, comm, attention=tp_attention, mlp=tp_mlp)
    logits = run()                                                    # warm-up
    comm.stats.reset()
    timing = benchmark(lambda: (comm.barrier(), run()), warmup=0, repeats=repeats, device="cpu")   # all ranks start together
    return logits, timing.median, comm.stats


def single_rank(comm, model, ids, pos, repeats):
    with torch.no_grad():
        logits = model(ids, pos)
    return logits, benchmark(lambda: model(ids, pos), warmup=0, repeats=repeats, device="cpu").median


tp_out = launch(tp_rank, TP_W, cpu_model, tp_ids, tp_pos, TP_REPEATS, timeout=LAUNCH_S)
ref_logits, t_single = launch(single_rank, 1, cpu_model, tp_ids, tp_pos, TP_REPEATS, timeout=LAUNCH_S)[0]
logits0, t_tp, stats0 = tp_out[0]
diff = max((lg - ref_logits).abs().max().item() for lg, _, _ in tp_out)
print(f"max |TP logits - single-process logits| over {TP_W} ranks: {diff:.2e} (largest logit {ref_logits.abs().max():.1f})")
print("the ranks agree with each other bit for bit:", all(torch.equal(lg, logits0) for lg, _, _ in tp_out))
print("next token, TP:", repr(tokenizer.decode(int(logits0[0, -1].argmax()))),
      "| single process:", repr(tokenizer.decode(int(ref_logits[0, -1].argmax()))))
print(f"all-reduces per forward: {stats0.all_reduce_calls // TP_REPEATS} (2 per layer x {cfg.n_layer} layers); "
      f"bytes handed to all-reduce per token: {stats0.all_reduce_bytes // TP_REPEATS // TP_T:,} "
      f"= 2 x {cfg.n_layer} x {cfg.d_model} x 4")
print(f"one forward of {TP_T} tokens: {1e3 * t_tp:.0f} ms on {TP_W} ranks, {1e3 * t_single:.0f} ms in one process "
      f"(one thread per rank; this machine has {os.cpu_count()} cores)")
predicted = 2 * cfg.n_layer * (AR_LATENCY + TP_T * cfg.d_model * 4 / AR_BANDWIDTH)
print(f"what section 2's all-reduce cost predicts for the {2 * cfg.n_layer} all-reduces: {1e3 * predicted:.0f} ms")
'''),
md(r"""
Read your numbers. The logits agree to float32 rounding, and the next token is the same. The last line
prices the 60 all-reduces with section 2's latency and bandwidth: how much of your TP forward is
communication? Whether tensor parallelism was faster here depends on this machine: it pays off when each rank has its own
compute (a GPU, or a free core) and the all-reduces are cheap next to the matmuls. With more ranks than
free cores, or small matmuls, the ranks mostly wait for each other: every layer is a meeting point,
twice, and the slowest rank sets the pace. On GPUs joined by NVLink the all-reduce of a decode
step's (1, C) activation takes microseconds, and TP is how a 70B model is served with low latency.

Tensor parallelism also divides the KV cache: each rank caches only its own KV heads.
"""),
tests("tp_block_tests", 4, TINY + r"""
tiny = _tiny("llama")
B, T = 2, 5
ids_t = torch.randint(0, 64, (B, T), device=env.device)
pos_t = torch.arange(T, device=env.device)[None].expand(B, T)
with torch.no_grad():
    x0 = tiny.embed(ids_t)
    rope_t = rope_cos_sin(pos_t, tiny.cfg.head_dim, tiny.cfg.rope_theta)
    blk = tiny.blocks[0]
    h = blk.attn_norm(x0)
    want_attn, want_mlp = blk.attn(h, rope_t), blk.mlp(blk.mlp_norm(x0))
def _one(comm):                         # world 1: the whole block on one rank
    s = whole_block(blk, tiny.cfg)
    with torch.no_grad():
        a = tp_attention(h, s, rope_t, comm)
        n_attn = comm.stats.all_reduce_calls
        m = tp_mlp(blk.mlp_norm(x0), s, comm)
    return a, m, n_attn, list(comm.stats.log)
a, m, n_attn, log = run_threads(_one, 1)[0]
a = expect_tensor(a, "tp_attention(h, shard, rope, comm)", shape=(B, T, 32), dtype=h.dtype, device=env.device)
m = expect_tensor(m, "tp_mlp(h, shard, comm)", shape=(B, T, 32), dtype=h.dtype, device=env.device)
assert torch.allclose(a, want_attn, atol=1e-4), "with one rank holding every head, tp_attention must equal block.attn(h, rope)"
assert torch.allclose(m, want_mlp, atol=1e-4), "with one rank, tp_mlp must equal block.mlp(h)"
assert n_attn == 1 and log == [("all_reduce", (B, T, 32)), ("all_reduce", (B, T, 32))], \
    f"one all-reduce of the (B, T, C) output in each of tp_attention and tp_mlp, nothing else; the comm saw {log}"
try:                                    # what section 8's torchrun loads: the rule under Problem 1
    from_file = import_answers(answers_file([tp_attention, tp_mlp]))
except ValueError as e:
    raise AssertionError(f"your answers cannot be written to a file for torchrun: {e}") from None
assert callable(from_file.tp_attention) and callable(from_file.tp_mlp), "the answers file defines tp_attention and tp_mlp"
### BEGIN HIDDEN TESTS
""" + REF_SHARD + r"""
def _ref_logits_check(t, world, B, T, seed):
    g = torch.Generator().manual_seed(seed)
    ids_h = torch.randint(0, 64, (B, T), generator=g).to(env.device)
    pos_h = torch.arange(T, device=env.device)[None].expand(B, T)
    with torch.no_grad():
        want = t(ids_h, pos_h)
    def rank_fn(comm):
        shards = [_ref_shard(b, t.cfg, comm.rank, comm.world_size) for b in t.blocks]
        out = tp_forward(t, shards, ids_h, pos_h, comm, attention=tp_attention, mlp=tp_mlp)
        return out, comm.stats.all_reduce_calls, list(comm.stats.log), comm.stats.sends
    res = run_threads(rank_fn, world)
    for r, (out, calls, log_, sends) in enumerate(res):
        out = expect_tensor(out, "tp_forward(...) logits", shape=(B, T, 64), device=env.device, finite=True)
        assert torch.allclose(out, want, atol=2e-4, rtol=1e-4), \
            f"{t.cfg.family}, world {world}, rank {r}: logits differ from the single-process model by " \
            f"{(out - want).abs().max().item():.3g} (all-reduce after o and after down, this rank's head counts)"
        assert calls == 2 * t.cfg.n_layer and sends == 0, f"exactly 2 all-reduces per layer and no sends, got {calls} and {sends}"
        assert all(e == ("all_reduce", (B, T, t.cfg.d_model)) for e in log_), "every all-reduce is of the (B, T, C) output"
        assert torch.equal(out, res[0][0]), "every rank must end with the same logits (the all-reduced sums)"
for family, H, Hkv, world, B, T, seed in (("llama", 4, 2, 2, 2, 5, 1), ("llama", 4, 4, 4, 1, 7, 2), ("gpt2", 4, 4, 2, 2, 6, 3),
                                          ("llama", 6, 3, 3, 2, 4, 4), ("llama", 4, 2, 1, 1, 3, 5), ("gpt2", 4, 4, 4, 1, 1, 6),
                                          ("llama", 4, 2, 2, 3, 1, 7)):
    _ref_logits_check(_tiny(family, H, Hkv, seed=seed), world, B, T, seed)
# each function alone: one all-reduce each, the same result on every rank
t = _tiny("gpt2", 4, 4, seed=9)
xh = torch.randn(2, 3, 32, device=env.device)
with torch.no_grad():
    want_a = t.blocks[0].attn(xh, None)
    want_m = t.blocks[0].mlp(xh)
def _parts(comm):
    s = _ref_shard(t.blocks[0], t.cfg, comm.rank, comm.world_size)
    with torch.no_grad():
        a = tp_attention(xh, s, None, comm)
        n1 = comm.stats.all_reduce_calls
        m = tp_mlp(xh, s, comm)
    return a, m, n1, comm.stats.all_reduce_calls
for r, (a, m, n1, n2) in enumerate(run_threads(_parts, 2)):
    a = expect_tensor(a, "tp_attention(...)", shape=(2, 3, 32), device=env.device)
    m = expect_tensor(m, "tp_mlp(...)", shape=(2, 3, 32), device=env.device)
    assert n1 == 1 and n2 == 2, "tp_attention makes one all-reduce, tp_mlp one"
    assert torch.allclose(a, want_a, atol=1e-4), "GPT-2 attention (no RoPE, biases): add o's bias once (it is on rank 0 only)"
    assert torch.allclose(m, want_m, atol=1e-4), "GPT-2 MLP: GELU (tanh) of fc, then proj, then the all-reduce"
### END HIDDEN TESTS
"""),
md(r"""
## 4. What an all-reduce moves: the ring

How does an all-reduce add up W buffers of N bytes? The simplest way, every rank sends its whole
buffer to every other rank, sends (W - 1)·N bytes per rank: it grows with W. NCCL and gloo use a
**ring** for large buffers. Cut each buffer into W chunks and pass chunks around the ring
0 → 1 → ... → W-1 → 0:

1. **reduce-scatter**, W - 1 steps: at step s, rank r sends its chunk (r - s) mod W to its right
   neighbour and adds the chunk it receives from its left neighbour, chunk (r - s - 1) mod W, into its
   own. After W - 1 steps rank r holds the **complete** sum of chunk (r + 1) mod W.
2. **all-gather**, W - 1 steps: at step s, rank r sends chunk (r + 1 - s) mod W (complete) to the right
   and **replaces** its chunk (r - s) mod W by the one it receives.

```
W = 3, chunks a b c         after reduce-scatter             after all-gather
rank 0:  a0  b0  c0         rank 0:  .    b012 .              rank 0:  a012 b012 c012
rank 1:  a1  b1  c1   ->    rank 1:  .    .    c012    ->     rank 1:  a012 b012 c012
rank 2:  a2  b2  c2         rank 2:  a012 .    .              rank 2:  a012 b012 c012
```

Each step sends one chunk of N/W bytes; there are 2(W - 1) steps. A rank sends **2(W - 1)/W · N** bytes:
under 2N however many ranks there are, which is why the ring is bandwidth-optimal. (It pays 2(W - 1)
latencies instead: small messages use other algorithms, trees or one-shot exchanges.)

One trap. `comm.send` waits until the receiver has taken the message. If every rank first sends to the
right and then receives from the left, every rank waits in its send and nobody receives: a deadlock
(`run_threads` names it; real processes just hang). Start the send with `comm.isend`, receive with
`comm.recv`, then `.wait()` for the send.

## Problem 3: Ring all-reduce (3 points)

**Deliverable:**
- `ring_all_reduce(x, comm)`: replaces `x` (any shape, contiguous) in place by the sum of all ranks' `x`
  and returns it, using only `isend`/`recv` to the neighbours as above (no `comm.all_reduce`). Cut the
  flattened `x` into `world_size` chunks with `torch.tensor_split` (chunks may differ in size by one).
  With one rank, return `x` unchanged.
- `tp_bytes_per_token(cfg, world, dtype_bytes)`: the bytes each rank sends per token of input in a
  tensor-parallel forward whose all-reduces are rings (a float).
"""),
solution("ring_all_reduce", r'''
def ring_all_reduce(x: torch.Tensor, comm) -> torch.Tensor:
    """Sum x over all ranks, in place, by reduce-scatter then all-gather around the ring."""
    ### BEGIN SOLUTION
    W, r = comm.world_size, comm.rank
    if W == 1:
        return x
    chunks = list(torch.tensor_split(x.view(-1), W))                    # views into x
    right, left = (r + 1) % W, (r - 1) % W
    for step in range(W - 1):                                            # reduce-scatter
        send, get = (r - step) % W, (r - step - 1) % W
        buf = torch.empty_like(chunks[get])
        work = comm.isend(chunks[send].contiguous(), right)
        comm.recv(buf, left)
        work.wait()
        chunks[get] += buf
    for step in range(W - 1):                                            # all-gather
        send, get = (r + 1 - step) % W, (r - step) % W
        buf = torch.empty_like(chunks[get])
        work = comm.isend(chunks[send].contiguous(), right)
        comm.recv(buf, left)
        work.wait()
        chunks[get].copy_(buf)
    return x
    ### END SOLUTION


def tp_bytes_per_token(cfg, world: int, dtype_bytes: int) -> float:
    """Bytes one rank sends per token of a TP forward: 2 ring all-reduces of (1, C) per layer."""
    ### BEGIN SOLUTION
    return 2 * cfg.n_layer * cfg.d_model * dtype_bytes * 2 * (world - 1) / world
    ### END SOLUTION
'''),
code(r'''
def ring_rank(comm, model, ids, pos):
    shards = [shard_block(b, model.cfg, comm.rank, comm.world_size) for b in model.blocks]
    ring = CustomAllReduce(comm, ring_all_reduce)     # its all_reduce is your ring over comm's isend/recv
    tp_forward(model, shards, ids, pos, ring, attention=tp_attention, mlp=tp_mlp)   # warm-up: a fresh process starts slow
    comm.stats.reset()
    comm.barrier()
    start = time.perf_counter()
    logits = tp_forward(model, shards, ids, pos, ring, attention=tp_attention, mlp=tp_mlp)
    return logits, time.perf_counter() - start, comm.stats.bytes_sent, comm.stats.sends


ring_out = launch(ring_rank, TP_W, cpu_model, tp_ids, tp_pos, timeout=LAUNCH_S)
print(f"max |ring TP logits - single process|: {max((lg - ref_logits).abs().max().item() for lg, *_ in ring_out):.2e}")
for r, (_, secs, sent, n) in enumerate(ring_out):
    print(f"rank {r}: {n} sends, {sent / TP_T:,.0f} bytes sent per token; formula {tp_bytes_per_token(cfg, TP_W, 4):,.0f}; "
          f"forward {1e3 * secs:.0f} ms (the same forward with gloo's all-reduce: {1e3 * t_tp:.0f} ms)")
print()
for name, c, world, nbytes in [(DEFAULT, cfg, 3, 4), ("Llama-3-70B", LLAMA3["Llama-3-70B"], 8, 2)]:
    per_token = tp_bytes_per_token(c, world, nbytes)
    print(f"{name}, TP={world}, {nbytes} bytes per value: {per_token / 1e6:.3f} MB sent per rank per token; "
          f"a 1,000-token prefill: {per_token * 1000 / 1e9:.2f} GB per rank")
'''),
md(r"""
The count of your ring's sends matches the formula to the byte: that is the traffic of tensor
parallelism. Per token it is small next to the weights, but it crosses the interconnect twice per
layer, and every layer waits for it. For a 1,000-token prefill of the 70B model on 8 GPUs it is a few
GB per GPU: milliseconds over NVLink (hundreds of GB/s), a significant fraction of the step between
machines (tens of GB/s). That is why tensor parallelism stays **inside** a machine, and pipeline
parallelism, which sends far less, goes **across** machines.
"""),
tests("ring_all_reduce_tests", 3, r"""
def _ring_fn(comm, n):
    x = (torch.arange(n, device=env.device, dtype=torch.float32) + 1) * (comm.rank + 1)
    y = ring_all_reduce(x, comm)
    return x, y is x, comm.stats.bytes_sent, comm.stats.all_reduce_calls
for world in (2, 3):
    for r, (x, same, sent, calls) in enumerate(run_threads(_ring_fn, world, 6)):
        x = expect_tensor(x, "x after ring_all_reduce(x, comm)", shape=(6,), device=env.device)
        want = (torch.arange(6, device=env.device, dtype=torch.float32) + 1) * sum(range(1, world + 1))
        wrong = [i for i, (a, b) in enumerate(zip(x.tensor_split(world), want.tensor_split(world))) if not torch.equal(a, b)]
        assert not wrong, (f"world {world}, rank {r}: x must become the sum over ranks, in place; got {x.tolist()}: chunks {wrong} "
                           "do not hold the sum. After the reduce-scatter rank r holds the complete chunk (r + 1) mod W; at "
                           "all-gather step s it sends chunk (r + 1 - s) mod W and replaces its chunk (r - s) mod W")
        assert expect_bool(same, "ring_all_reduce(x, comm) is x") and calls == 0, "return x itself, and use isend/recv, not comm.all_reduce"
        assert sent == 2 * (world - 1) * 6 * 4 // world, f"world {world}: a rank sends 2(W-1)/W of the buffer, {2 * (world - 1) * 24 // world} bytes; it sent {sent}"
cfg_t = course.ModelConfig("llama", 64, 30, 9, 3, 576, 1536, 64)
got = expect_float(tp_bytes_per_token(cfg_t, 3, 4), "tp_bytes_per_token(cfg, 3, 4)")
assert abs(got - 2 * 30 * 576 * 4 * 4 / 3) < 1e-6, "2 all-reduces per layer of one (1, C) activation, each sending 2(W-1)/W of it"
### BEGIN HIDDEN TESTS
def _ring_gen(comm, shape, dtype, seed):
    g = torch.Generator().manual_seed(seed + comm.rank)
    x = torch.randint(-50, 50, shape, generator=g).to(device=env.device, dtype=dtype)   # integers: exact sums in any order
    start = x.clone()
    ring_all_reduce(x, comm)
    return start, x, comm.stats.bytes_sent, comm.stats.sends, comm.stats.all_reduce_calls, list(comm.stats.log)
for world, shape, dtype in ((2, (4, 3), torch.float32), (3, (7,), torch.float64), (4, (2, 2, 3), torch.float32),
                            (5, (10,), torch.float32), (4, (3,), torch.float32), (1, (5,), torch.float32), (3, (2, 6), torch.float16)):
    res = run_threads(_ring_gen, world, shape, dtype, world)
    total = sum(s for s, *_ in res)
    n = math.prod(shape)
    for r, (start, x, sent, sends, calls, log_) in enumerate(res):
        x = expect_tensor(x, "x", shape=shape, dtype=dtype, device=env.device)
        assert torch.equal(x, total), f"world {world}, shape {shape}: rank {r} does not hold the sum"
        assert calls == 0, "no comm.all_reduce inside the ring"
        assert sends == 2 * (world - 1), f"world {world}: 2(W-1) sends per rank, got {sends}"
        assert all(e[0] != "send" or e[1] == (r + 1) % world for e in log_), "send only to the right neighbour (rank + 1) % W"
        assert all(e[0] != "recv" or e[1] == (r - 1) % world for e in log_), "receive only from the left neighbour"
        if n % world == 0:
            assert sent == 2 * (world - 1) * n * x.element_size() // world, "2(W-1)/W of the buffer's bytes"
for world in (2, 3, 4, 8):
    c = course.ModelConfig("llama", 64, 7, 8, 4, 48, 96, 64)
    got = expect_float(tp_bytes_per_token(c, world, 2), "tp_bytes_per_token")
    assert abs(got - 2 * 7 * 48 * 2 * 2 * (world - 1) / world) < 1e-6, f"world {world}: wrong bytes per token"
assert expect_float(tp_bytes_per_token(c, 1, 4), "tp_bytes_per_token(cfg, 1, 4)") == 0, "one rank sends nothing"
### END HIDDEN TESTS
"""),
]
