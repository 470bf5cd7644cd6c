"""Lab 12, sections 6-7: prefill-decode disaggregation (problem 5), the measurement, and running the
tensor-parallel model under torchrun; then the summary and going further. Assembled by lab12.py."""
from autograder.authoring import answer, code, md, solution, tests

STORY = (
    "The lighthouse keeper wrote down the weather every morning: the wind, the height of the waves, the colour of "
    "the sky over the northern cliffs. Ships came by twice a week, and their captains asked for the book, because "
    "forty years of mornings told them more than any forecast. One winter the lamp failed during a storm, and the "
    "keeper climbed the tower with a lantern in each hand, counting the steps aloud so that he would not fall asleep. "
)

CELLS = [
md(r"""
## 6. Prefill-decode disaggregation

The workshop this course grew from gives the reason in two lines: prefill is compute-bound and
decode memory-bound (for large models on a GPU), so one machine tuned for both serves neither well.
Here is the problem it causes. An engine that serves prefills and decodes together (lab 11) runs, at
each step, the prefill of any request that just arrived and one decode step for every running
request. On a CPU, and for large models on a GPU, a long prompt's prefill takes several decode steps
or more (a small model's eager steps on a GPU are launch-bound: there a few hundred tokens cost
about one step), so every running request waits for it before its next token: its **inter-token
latency** (ITL) jumps from one decode step to a whole prefill. Chunked prefill (lab 11) cuts the
jump into smaller pieces; it does not remove it.

**Disaggregation** (Splitwise, DistServe; 2024) gives the two phases different machines. Prefill workers
only prefill; each finished request's KV cache is sent to a decode worker, which only decodes, so no
prefill ever stands between two decode steps. Each pool can be sized and parallelized for its phase
(DistServe picks TP and PP separately for each). The price: a second copy of the model, and the KV
cache crosses the network once per request.

```
colocated (each worker does both)           disaggregated
worker 0: [prefill A][d][d][prefill C][d]   prefill worker: [prefill A][prefill B][prefill C]
worker 1: [prefill B][d][d][d][d][d][d]                          | KV A       | KV B       | KV C
               a decode waits for C ^       decode worker:   [d][d][d][d][d][d][d][d][d][d][d]
```

How long is the wait? Time one prefill of a long prompt and one decode step, on one rank (one thread).
"""),
code(r'''
STORY = ''' + repr(STORY) + r'''
corpus = tokenizer(STORY * 40).input_ids                 # prompts are windows of this text
P_LEN = env.pick(256, 64, cpu=128)


def phase_times(comm, model, prompt, repeats):
    """Median seconds of one prefill of `prompt`, and of one decode step of 2 running requests."""
    calls = repeats + 1                                   # the warm-up call, then the timed ones
    engine = Engine(model, n_blocks=calls * -(-(len(prompt) + calls) // 16), block_size=16)   # every prompt, its decoded tokens
    seqs = iter(range(calls))                            # each prefill is a new request
    prefill = benchmark(lambda: engine.prefill(next(seqs), prompt), warmup=1, repeats=repeats, device="cpu")
    decode = benchmark(lambda: engine.decode([0, 1], [5, 5]), warmup=1, repeats=repeats, device="cpu")
    return prefill.median, decode.median


PREFILL_S, DECODE_S = launch(phase_times, 1, cpu_model, corpus[:P_LEN], env.pick(3, 1), timeout=LAUNCH_S)[0]
print(f"prefill of {P_LEN} tokens: {1e3 * PREFILL_S:.0f} ms; one decode step (2 requests): {1e3 * DECODE_S:.0f} ms")
print(f"a running request that waits behind one prefill waits {PREFILL_S / DECODE_S:.1f} decode steps for its next token")
'''),
md(r"""
## Problem 5: Ship a request's KV blocks (4 points)

The prefill worker has written a request's keys and values into blocks of **its** paged pool (lab 05's
`PagedKVCache`: `cache.k` and `cache.v` are (n_layer, n_blocks, block_size, Hkv, D)); `table` lists them
in order. The decode worker has its own pool and its own allocator (`BlockAllocator`, lab 05): the
request gets **other** block ids there. A receiver must know the shape of what comes before it can
receive it, so a small header goes first:

```
prefill worker (sender)                                   decode worker (receiver)
header = [n_tokens, first_token, n_blocks]   (3,) int64   -> recv header; alloc.append(seq, n_tokens); my_table = alloc.block_tables[seq]
K = cache.k[:, table]   (n_layer, n_blocks, bs, Hkv, D)   -> recv into a buffer, then cache.k[:, my_table] = it
V = cache.v[:, table]                                      -> recv, then cache.v[:, my_table] = it
```

`first_token` is the token the prefill produced: the decode worker continues from it, at position
`n_tokens`. Send whole blocks (the last one may be partly filled: its extra slots are never read).
One trap: `cache.k[:, my_table]` with a list of ids is a **copy**; writing into that copy changes
nothing. Assign to it instead (`cache.k[:, my_table] = buf`), which writes into the pool.

**Deliverable:**
- `send_kv(comm, dst, cache, table, n_tokens, first_token)`: send the header, then K, then V of the
  blocks in `table` to rank `dst`, as above; return the number of bytes sent (an int).
- `recv_kv(comm, src, cache, alloc, seq)`: receive one request from rank `src`: the header, room for
  `n_tokens` tokens for sequence `seq` in `alloc`, K and V into those blocks of `cache`; return
  `(n_tokens, first_token)` as Python ints.
"""),
solution("kv_transfer", r'''
def send_kv(comm, dst: int, cache, table: list[int], n_tokens: int, first_token: int) -> int:
    """Send one request's KV blocks: a header [n_tokens, first_token, n_blocks], then K, then V."""
    ### BEGIN SOLUTION
    header = torch.tensor([n_tokens, first_token, len(table)], dtype=torch.long, device=cache.k.device)
    k = cache.k[:, table].contiguous()                                    # (n_layer, n_blocks, bs, Hkv, D)
    v = cache.v[:, table].contiguous()
    comm.send(header, dst)
    comm.send(k, dst)
    comm.send(v, dst)
    return header.nbytes + k.nbytes + v.nbytes
    ### END SOLUTION


def recv_kv(comm, src: int, cache, alloc, seq) -> tuple[int, int]:
    """Receive one request's KV blocks into this rank's pool, in blocks allocated here for `seq`."""
    ### BEGIN SOLUTION
    header = torch.empty(3, dtype=torch.long, device=cache.k.device)
    comm.recv(header, src)
    n_tokens, first_token, n_blocks = header.tolist()
    alloc.append(seq, n_tokens)                                           # this pool's blocks for it
    table = alloc.block_tables[seq]
    shape = (cache.k.shape[0], n_blocks, *cache.k.shape[2:])             # (n_layer, n_blocks, bs, Hkv, D)
    k = torch.empty(shape, dtype=cache.k.dtype, device=cache.k.device)
    v = torch.empty(shape, dtype=cache.v.dtype, device=cache.v.device)
    comm.recv(k, src)
    comm.recv(v, src)
    cache.k[:, table] = k                                                 # write into the pool (not a copy)
    cache.v[:, table] = v
    return n_tokens, first_token
    ### END SOLUTION
'''),
tests("kv_transfer_tests", 4, r"""
cfg_k = course.ModelConfig("llama", 64, 2, 4, 2, 16, 32, 64)          # 2 layers, 2 KV heads of 4
def _pool(seed, n_blocks=8, bs=4, dtype=torch.float32):
    c = PagedKVCache(cfg_k, n_blocks, bs, dtype=dtype, device=env.device)
    g = torch.Generator().manual_seed(seed)
    c.k.copy_(torch.randn(c.k.shape, generator=g).to(env.device))
    c.v.copy_(torch.randn(c.v.shape, generator=g).to(env.device))
    return c
src_pool, dst_pool = _pool(1), _pool(2)
k_before, v_before = dst_pool.k.clone(), dst_pool.v.clone()
alloc = BlockAllocator(8, 4)
alloc.append("other", 9)                                               # blocks 0, 1, 2 belong to another request
table = [6, 1, 3]                                                      # 10 tokens: 3 blocks of 4
def _transfer(comm):
    if comm.rank == 0:
        return send_kv(comm, 1, src_pool, table, 10, 42)
    return recv_kv(comm, 0, dst_pool, alloc, "r")
sent, got = run_threads(_transfer, 2)
n_tok, first = expect_tuple(got, "recv_kv(...)", 2)
assert (expect_int(n_tok, "n_tokens"), expect_int(first, "first_token")) == (10, 42), "recv_kv returns (n_tokens, first_token) from the header"
assert alloc.lengths.get("r") == 10 and len(alloc.block_tables["r"]) == 3, "allocate room for n_tokens tokens for seq in alloc"
mine = alloc.block_tables["r"]
for i, (theirs, ours) in enumerate(zip(table, mine)):
    assert torch.equal(dst_pool.k[:, ours], src_pool.k[:, theirs]) and torch.equal(dst_pool.v[:, ours], src_pool.v[:, theirs]), \
        f"block {i} of the request: the sender's block {theirs} must land in the receiver's own block {ours}: send K then V " \
        "of the blocks of `table` in order, and write them into the pool (cache.k[:, my_table] = buf, not into a copy)"
others = [b for b in range(8) if b not in mine]
assert torch.equal(dst_pool.k[:, others], k_before[:, others]) and torch.equal(dst_pool.v[:, others], v_before[:, others]), \
    "the receiver's other blocks must not change"
block_bytes = 2 * 4 * 2 * 4 * 4                                        # n_layer x block_size x Hkv x D x 4 bytes
assert expect_int(sent, "send_kv(...)") == 3 * 8 + 2 * 3 * block_bytes, "bytes sent: the header (3 int64), then K and V of 3 blocks"
### BEGIN HIDDEN TESTS
def _ref_recv(comm, src):          # the protocol, read independently of the student's recv_kv
    h = torch.zeros(3, dtype=torch.long, device=env.device)
    comm.recv(h, src)
    n, f, nb = h.tolist()
    shape = (cfg_k.n_layer, nb, 4, cfg_k.n_kv_head, cfg_k.head_dim)
    k = torch.zeros(shape, device=env.device)
    v = torch.zeros(shape, device=env.device)
    comm.recv(k, src)
    comm.recv(v, src)
    return n, f, nb, k, v
def _ref_send(comm, dst, c, tab, n, f):
    comm.send(torch.tensor([n, f, len(tab)], dtype=torch.long, device=env.device), dst)
    comm.send(c.k[:, tab].contiguous(), dst)
    comm.send(c.v[:, tab].contiguous(), dst)
# the student's sender against the reference receiver: exactly the protocol
for tab, n in (([5], 1), ([2, 7], 8), ([0, 4, 1, 6], 13)):
    def _s(comm):
        if comm.rank == 0:
            return send_kv(comm, 1, src_pool, tab, n, 7)
        return _ref_recv(comm, 0)
    sent_h, (n_h, f_h, nb_h, k_h, v_h) = run_threads(_s, 2)
    assert (n_h, f_h, nb_h) == (n, 7, len(tab)), f"header must be [n_tokens, first_token, n_blocks], got {[n_h, f_h, nb_h]}"
    assert torch.equal(k_h, src_pool.k[:, tab]) and torch.equal(v_h, src_pool.v[:, tab]), \
        "send K then V of the blocks of `table`, in table order, each (n_layer, n_blocks, block_size, Hkv, D)"
    assert expect_int(sent_h, "send_kv(...)") == 24 + 2 * len(tab) * block_bytes, "return the bytes of the header, K and V"
# the reference sender against the student's receiver: several requests in a row, one pool
dst2 = _pool(5)
alloc2 = BlockAllocator(8, 4)
alloc2.append("x", 3)                                                  # block 0 is someone else's
before_k = dst2.k.clone()
reqs = [([3, 5], 8, 11), ([7], 1, 12), ([2, 0, 4], 9, 13)]
def _r(comm):
    if comm.rank == 0:
        for tab, n, f in reqs:
            _ref_send(comm, 1, src_pool, tab, n, f)
        return None
    return [recv_kv(comm, 0, dst2, alloc2, f"req{i}") for i in range(len(reqs))]
_, outs = run_threads(_r, 2)
for i, ((tab, n, f), got_i) in enumerate(zip(reqs, expect_type(outs, "recv_kv results", list))):
    n_i, f_i = expect_tuple(got_i, "recv_kv(...)", 2)
    assert (expect_int(n_i, "n_tokens"), expect_int(f_i, "first_token")) == (n, f), f"request {i}: (n_tokens, first_token) from its header"
    assert alloc2.lengths[f"req{i}"] == n and len(alloc2.block_tables[f"req{i}"]) == -(-n // 4), \
        f"request {i}: {n} tokens need {-(-n // 4)} blocks of 4 in the receiver's allocator"
    ours = alloc2.block_tables[f"req{i}"]
    assert torch.equal(dst2.k[:, ours], src_pool.k[:, tab]) and torch.equal(dst2.v[:, ours], src_pool.v[:, tab]), \
        f"request {i}: the blocks did not arrive in the receiver's blocks {ours} (exact multiple of the block size: {n % 4 == 0})"
assert torch.equal(dst2.k[:, 0], before_k[:, 0]), "the receiver wrote into a block it did not allocate"
assert alloc2.n_free == 8 - 1 - 2 - 1 - 3, "allocate exactly the blocks each request needs"
# other dtypes: the buffers follow the pool's dtype
src16, dst16 = _pool(3, dtype=torch.float16), _pool(4, dtype=torch.float16)
alloc3 = BlockAllocator(8, 4)
def _h(comm):
    if comm.rank == 0:
        return send_kv(comm, 1, src16, [4, 2], 6, 3)
    return recv_kv(comm, 0, dst16, alloc3, 0)
sent16, got16 = run_threads(_h, 2)
assert expect_int(sent16, "send_kv(...)") == 24 + 2 * 2 * block_bytes // 2, "float16 blocks are half the bytes"
assert torch.equal(dst16.k[:, alloc3.block_tables[0]], src16.k[:, [4, 2]]) and torch.equal(dst16.v[:, alloc3.block_tables[0]], src16.v[:, [4, 2]]), \
    "a float16 pool: receive into float16 buffers (the pool's dtype)"
### END HIDDEN TESTS
"""),
md(r"""
## 7. Measure: decode latency while long prompts arrive

Now the experiment, on two processes (one core each) both times:

- **colocated**: two replicas of the whole engine; requests alternate between them. Each loop of a
  replica prefills whatever has arrived, then runs one decode step for its running requests.
- **disaggregated**: rank 0 only prefills, and sends each request's KV blocks with your `send_kv`; rank
  1 only decodes, taking each transfer with your `recv_kv` between two decode steps.

Requests arrive one after another, a bit slower than one prefill worker takes them when it runs
alone (every 1.5 prefill times, from your measurement above), each with a long prompt and enough new
tokens to be still decoding when the next prompts arrive. Same requests, same model, same greedy
tokens: only *where* the prefills run changes. Every worker first warms its engine (one prefill and
one decode step, before the clock starts): a freshly forked process runs its first passes several
times slower, and that is not what we measure. (`Engine`, `colocated_worker` and
`disaggregated_worker` are given: read them in `course/dist/disagg.py`.)
"""),
code(r'''
GAP = 1.5 * PREFILL_S                                       # 1.5 prefill times, as measured alone
NEW = max(4, min(env.pick(64, 16), math.ceil(5 * GAP / DECODE_S)))   # still decoding when the next prompts come
N_REQ = env.pick(8, 4)


def serve_requests():
    return [ServeRequest(i, corpus[17 * i:17 * i + P_LEN], NEW, arrival=i * GAP) for i in range(N_REQ)]


N_BLOCKS = N_REQ * math.ceil((P_LEN + NEW) / 16)           # room for every request at once, blocks of 16 tokens
print(f"{N_REQ} requests of {P_LEN} prompt tokens and {NEW} new tokens, one every {GAP:.2f} s")
serve_runs = {
    "colocated": launch(colocated_worker, 2, cpu_model, serve_requests(), N_BLOCKS, timeout=LAUNCH_S),
    "disaggregated": launch(disaggregated_worker, 2, cpu_model, serve_requests(), N_BLOCKS, send_kv=send_kv,
                            recv_kv=recv_kv, timeout=LAUNCH_S),
}
results = {}
for name, logs in serve_runs.items():
    outputs, times = merge_logs(logs)
    itl = sorted(b - a for ts in times.values() for a, b in zip(ts, ts[1:]))
    ttft = [times[r.rid][0] - r.arrival for r in serve_requests()]
    results[name] = dict(outputs=outputs, itl=itl, ttft=ttft, end=max(t for ts in times.values() for t in ts))
same = sum(results["colocated"]["outputs"][r] == results["disaggregated"]["outputs"][r] for r in range(N_REQ))
print(f"same tokens as the colocated engine for {same} of {N_REQ} requests\n")
print(f"{'':>14} {'ITL p50':>9} {'ITL p90':>9} {'ITL max':>9} {'TTFT mean':>10} {'last token at':>14}")
for name, res in results.items():
    itl = res["itl"]
    print(f"{name:>14} {1e3 * itl[len(itl) // 2]:>7.0f}ms {1e3 * itl[int(0.9 * (len(itl) - 1))]:>7.0f}ms "
          f"{1e3 * itl[-1]:>7.0f}ms {statistics.mean(res['ttft']):>9.2f}s {res['end']:>13.2f}s")
sender = next(g for g in serve_runs["disaggregated"] if g.role == "prefill")
receiver = next(g for g in serve_runs["disaggregated"] if g.role == "decode")
recv_s = [e - s for kind, s, e, _ in receiver.events if kind == "recv"]
kv_bytes = [b for _, b, _ in sender.transfers]
print(f"\nKV transfer per request: {statistics.mean(kv_bytes) / 1e6:.2f} MB ({P_LEN} tokens x "
      f"{kv_bytes_per_token(cfg, 4):,} bytes + header), received in {1e3 * statistics.median(recv_s):.1f} ms "
      f"({statistics.mean(kv_bytes) / statistics.median(recv_s) / 1e9:.2f} GB/s)")
fig, ax = plt.subplots(figsize=(6, 3.2))
for name, res in results.items():
    ax.plot([1e3 * x for x in res["itl"]], [(i + 1) / len(res["itl"]) for i in range(len(res["itl"]))], label=name)
ax.set_xlabel("inter-token latency (ms)"); ax.set_ylabel("share of token gaps ≤ x")
ax.set_title("decode latency while long prompts arrive"); ax.legend(); plt.show()
plot_serving(serve_runs); plt.show()
'''),
md(r"""
Read the table and the two pictures from your run. The tokens should be the same: the KV blocks
arrive bit for bit. (Only a near-tie between two tokens could flip: a request decoded in a batch
with other neighbours gets logits that differ in the last bits.) In the colocated engine, a decode
step that comes after a prefill waits for all of it: the largest token gaps are at least a whole
prefill long (an orange bar between two blue ones). In the disaggregated engine the decode worker
never prefills: its gaps stay within a few of its own decode steps, plus a KV transfer now and then
(milliseconds here: the thin green marks; compare the two ITL max). The median gap may move either
way: the decode worker runs bigger batches, but no prefill ever runs beside it. Then look at time to
first token. Prompts arrive every 1.5 prefill times as measured alone (`GAP`). Check rank 0's row
in the disaggregated panel: gaps between its bars mean one prefill worker kept up; back-to-back bars
mean prefills ran slower here than `PREFILL_S` (the processes share the cores) and prompts queued.
Make them come faster than one worker prefills (`GAP` below `PREFILL_S`) and they queue at that
worker in any case, while two colocated replicas would share them. That is why DistServe sizes the
two pools separately, for the latency each phase must meet (its goodput: requests per second that
meet both the TTFT and the ITL target). The KV cache of a request (46 KB per token of the default
model in float32, a third of a MB per token for Llama-3-70B in bf16) crosses the network once; real
systems stream it layer by layer while the prefill still runs, so the transfer hides behind compute.

## 8. On several GPUs: torchrun and NCCL

The processes in this notebook are forked from it and talk over gloo on the CPU. On real machines each
rank is a process started by `torchrun`, one per GPU, and NCCL moves the tensors between GPUs (NVLink
inside a machine, InfiniBand or Ethernet between machines). Your functions do not change: they only
talk to `comm`. Write them to a file, then start one rank per GPU:

```bash
torchrun --nproc-per-node=3 -m course.dist.torchrun_tp --answers my_tp.py          # one machine, 3 GPUs
torchrun --nnodes=2 --node-rank=0 --nproc-per-node=8 --rdzv-endpoint=HOST:29500 \
         -m course.dist.torchrun_tp --answers my_tp.py --model smollm2-1.7b        # the first of 2 machines
```

Each rank loads the model on its own GPU (`cuda:LOCAL_RANK`) and joins the process group with NCCL
(`course.dist.init_from_env`); with fewer GPUs than ranks it uses gloo on the CPU, as here. The default
model needs 1 or 3 ranks (its 3 KV heads). In full mode the cell below runs it on this machine.
"""),
code(r'''
# a new folder of your own (not the lab's folder: the file holds your answers; not a fixed name in /tmp, which
# on a shared JupyterHub is everyone's: another student's torchrun could run your file, or you theirs)
answers = answers_file([column_parallel, row_parallel, shard_block, tp_attention, tp_mlp])
cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3", "-m", "course.dist.torchrun_tp",
       "--answers", str(answers)]
print(f"wrote {answers} (copy it to the GPU machine)\n$ torchrun " + " ".join(cmd[3:]))
if env.quick:
    print("(not run in quick mode: three fresh processes load the model, which takes half a minute)")
else:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    print(done.stdout.strip() or done.stderr.strip()[-2000:])
'''),
md(r"""
## Summary

- A model that does not fit one GPU is split. **Tensor parallelism** splits every layer: column-parallel
  q, k, v (whole heads, GQA's KV heads with their query heads) and gate/up, row-parallel o and down, one
  all-reduce per attention and per MLP. Every rank holds 1/W of every layer's weights and of the KV
  cache, and every layer waits twice for the interconnect.
- A ring all-reduce sends 2(W - 1)/W of the buffer per rank; tensor parallelism sends
  4 n_layer C (W - 1)/W values per token per rank. Fast links only: TP stays inside a machine.
- **Pipeline parallelism** splits the stack into stages; only activations cross. With m micro-batches
  through p stages, (p - 1)/(m + p - 1) of the stage-time is idle. It buys memory and throughput, not
  the latency of one request.
- **Disaggregation** runs prefill and decode on different workers and ships each request's KV blocks
  between them. Decode steps no longer wait behind prefills; the price is the transfer, a second copy of
  the model, and the tuning of two pools.

**Questions** (from the workshop this course grew from, and a few more). Answer in the cell under
each group, in a few sentences of your own and with **your** numbers where a question asks for them;
a person grades them (4 points in all).

1. What do you do when the model does not fit in memory? For Llama-3-70B on 80 GB GPUs, what is the
   smallest TP degree that leaves room for a KV cache of 100,000 tokens in bf16? (Use your
   `param_count` and `kv_bytes_per_token`.)
2. Where are the all-reduces of a tensor-parallel layer, and why is there none between `q` and `o`, or
   between `up` and `down`? What would it cost to split `o` column-wise instead?
"""),
answer("tp_fit_answer", 1, "questions 1 and 2", model=r"""
1. Split it over several GPUs: tensor parallelism (every layer split), pipeline parallelism (the stack
   split), or both; or make it smaller (8- or 4-bit weights), or offload part of it to CPU memory at a
   large cost in speed. Llama-3-70B: `param_count` = 70.55 B, 141.1 GB in bf16; `kv_bytes_per_token` =
   `2 x 80 x 8 x 128 x 2` = 327,680 bytes, so 100,000 tokens take 32.8 GB; 173.9 GB in all. TP splits
   both evenly, and W must divide 64 query heads and 8 KV heads: W = 2 gives 86.9 GB per GPU (too much
   for 80 GB), W = 4 gives 43.5 GB per GPU, with room left for activations and more cache. The smallest
   TP degree is **4** (3 would fit by size, but divides neither head count).
2. One all-reduce after `o` (attention) and one after `down` (the MLP): the two row-parallel layers,
   whose outputs are partial sums. `q`, `k`, `v` are column-parallel by whole heads, and a head's
   attention needs only its own q, k, v: each rank computes its heads' outputs completely, which are
   exactly the input columns its row-parallel slice of `o` multiplies. Likewise `gate` and `up` give each
   rank a slice of the `d_ff` features, `SiLU(gate) x up` is element by element, and `down`'s row slice
   takes exactly that slice. Split column-wise, `o` would need every head's output on every rank (an
   all-gather of the attention output before it) and would leave each rank with a slice of the
   residual's features (an all-gather after it, to make the residual whole for the next norm): two
   collectives instead of one, at least as many bytes, and the attention output replicated in memory.
""", rubric=r"""
- 0.5: question 1: the ways out (split: TP/PP; quantize; offload), and TP = 4 with the arithmetic
  (141 GB + 33 GB; per GPU 87 GB at W = 2, 43 GB at W = 4; W must divide 64 and 8).
- 0.5: question 2: all-reduces after o and down; column-then-row pairs keep each rank's slice local
  (whole heads; element-wise SiLU x up); o column-wise needs gathers before and after it.
"""),
md(r"""
3. Why must W divide the number of KV heads here? What does vLLM do when W is larger than the number of
   KV heads, and what does it cost in memory?
4. TP + PP: 16 GPUs in two machines of 8. Which dimension goes inside a machine and which across, and why?
"""),
answer("kv_heads_layout_answer", 1, "questions 3 and 4", model=r"""
3. Each rank holds whole query heads and must hold the KV heads they read: with `H / W` query heads per
   rank, rank `r`'s heads read exactly KV heads `r x Hkv / W` to `(r + 1) x Hkv / W - 1`, a whole slice of
   `k` and `v`, only when W divides Hkv. Otherwise a group of query heads would be cut between ranks and
   its KV head would be needed on two ranks, which this split does not provide (SmolLM2's 3 KV heads:
   W = 1 or 3).
   When W is larger than Hkv and a multiple of it, vLLM replicates each KV head on `W / Hkv` ranks
   (`QKVParallelLinear`): each rank keeps one KV head, for its query heads. The cost is memory: the `k`
   and `v` weights and, above all, the KV cache are stored `W / Hkv` times, so each rank's cache per
   token stops shrinking below one head per layer (Llama-3-70B, 8 KV heads, on 16 ranks: every KV head
   twice, double the cache of an ideal split).
4. Tensor parallelism inside each machine (TP = 8 over NVLink) and pipeline parallelism across the two
   (PP = 2 over the network). TP waits for two all-reduces per layer, each of the whole activation
   (`4 x n_layer x C x (W - 1) / W` values per token per rank): it needs hundreds of GB/s and
   microsecond latencies, which only NVLink gives. PP sends one activation (C values per token) per
   stage boundary, once per micro-batch, and tolerates the slower links between machines (tens of GB/s).
""", rubric=r"""
- 0.5: question 3: query heads and their KV head must live on the same rank (whole groups per rank);
  vLLM replicates KV heads when W > Hkv, multiplying the KV cache (and k/v weights) by W / Hkv.
- 0.5: question 4: TP inside (frequent, large all-reduces need NVLink), PP across (little traffic).
"""),
md(r"""
5. Your pipeline's bubble with m = 1: why is pipeline parallelism still used for inference?
"""),
answer("pipeline_answer", 1, "question 5", model=r"""
With one micro-batch the bubble is `(p - 1) / p`: with 2 stages each is idle half the time (the
student's measured bubble is close to 1/2, the timeline shows one stage waiting while the other
works), and a request is no faster than on one device (slower by the hops). Pipeline parallelism is
still used because it buys **memory** with very little communication: each GPU holds `1 / p` of the
layers (and of the KV cache), so a model too large for one machine fits, with only one activation per
stage boundary crossing the slower links between machines. And a server is never at m = 1: it has
many requests, so it keeps every stage busy with a different batch (vLLM runs one batch per stage in
flight: decode steps of different batches follow each other down the pipeline), and the bubble
remains only at start-up and drain. It buys throughput and capacity, not the latency of one request.
""", rubric=r"""
- 0.5: the bubble at m = 1 ((p - 1)/p, with the student's measurement), and no latency gain.
- 0.5: why it is used anyway: memory (1/p of the layers) with little communication (across machines),
  and a server fills the pipeline with many batches in flight.
"""),
md(r"""
6. Prefill is compute-bound and decode memory-bound. Which GPUs, batch sizes and parallelism would you
   give each pool? What goes wrong if the decode pool is too small?
7. Your KV transfer took some milliseconds per request here. Estimate it for a 4,000-token prompt of the
   70B model over a 400 Gb/s network. How can the transfer overlap the prefill?
"""),
answer("disaggregation_answer", 1, "questions 6 and 7", model=r"""
6. Prefill pool: GPUs with the most FLOP/s (H100, B200), batches of a few prompts (enough tokens per
   step to saturate the compute; more only adds waiting), and tensor parallelism to cut each long
   prompt's TTFT (its latency target). Decode pool: GPUs with the most memory bandwidth and capacity
   (H200, more HBM per GPU), large batches (many requests share each weight read), enough memory for
   every running request's KV cache, with TP (or PP) sized for capacity and the TPOT target; DistServe
   picks the two configurations separately. If the decode pool is too small, it runs out of KV memory
   and batch room: finished prefills wait to be transferred (their first decode and TTFT slip, and their
   caches pile up on the prefill side), the decode batch grows and its ITL breaks the target, or
   requests are preempted and recomputed. The pools must be sized together for the traffic.
7. The KV cache of the 70B model takes `2 x 80 x 8 x 128 x 2` = 327,680 bytes per token, so 4,000 tokens
   are 1.31 GB. 400 Gb/s is 50 GB/s: about 26 ms, more in practice (30-40 ms at a realistic share of
   the link); the student's transfer here moved SmolLM2's 46 KB per token (float32) over loopback.
   The prefill itself (about `2 x 70 B x 4,000` = 560 TFLOP) takes hundreds of milliseconds
   even on 8 GPUs, so the transfer can hide behind it: send each layer's keys and values as soon as that
   layer has computed them, while the next layers run (layer by layer, or chunk by chunk with chunked
   prefill), and with TP every GPU sends its own share over its own network card, dividing the time by W.
""", rubric=r"""
- 0.5: question 6: compute-rich GPUs, small token-saturating batches and TP for prefill; bandwidth- and
  memory-rich GPUs, large batches for decode; a too-small decode pool means queued transfers, KV
  memory exhaustion or preemption, and broken ITL/TTFT targets.
- 0.5: question 7: about 1.3 GB and about 26 ms at 50 GB/s (the arithmetic shown), and layer-by-layer
  (or chunk-wise) streaming during the prefill.
"""),
md(r"""

## Going further

- **Megatron-LM** (Shoeybi et al., 2019): the column/row split of attention and MLP you built.
  Sequence parallelism (Korthikanti et al., 2022) also splits the norms and dropout along tokens.
- **vLLM**: `ColumnParallelLinear`, `RowParallelLinear` and `QKVParallelLinear` (which replicates KV heads
  when the TP degree exceeds them), `VocabParallelEmbedding` (the embedding and output head split too,
  which this lab kept whole); a custom all-reduce for small messages over NVLink; pipeline parallelism
  with one batch in flight per stage. **SGLang** and **nano-vllm** shard the same way (nano-vllm in a few
  hundred lines).
- **NCCL** picks ring or tree algorithms by size and topology; its "bus bandwidth" is the bytes of the
  formula above divided by the time. Expert parallelism (MoE) adds all-to-all exchanges.
- **GPipe** (Huang et al., 2019) and 1F1B / interleaved schedules (Narayanan et al., 2021) for training,
  where the backward pass makes the bubble harder.
- **DistServe** (Zhong et al., OSDI 2024): disaggregation with TP/PP chosen per phase for goodput (up to
  7.4x more requests within the SLOs). **Splitwise** (Patel et al., ISCA 2024): 1.4x throughput at 20%
  lower cost. **Mooncake** (Kimi): a KV-cache-centric design with a distributed KV store.
- **vLLM's disaggregated prefill** (KV connectors: LMCache, NIXL) and **SGLang's PD disaggregation**
  move KV blocks between GPUs with RDMA, layer by layer, without a copy through the CPU.
"""),
]
