"""Lab 09, section 4 and Problem 4: the engine prefills only what is not cached."""
from autograder.authoring import code, locked, md, solution, tests
from autograder.lab_builders.hidden_refs import greedy_and_tiny

# the hidden tests' independent references: a greedy loop with no cache at all, tiny random models
HIDDEN_REF = greedy_and_tiny(max_seq_len=128)

CELLS = [
md(r"""
## 4. The engine skips what is cached

The engine of lab 05, now on the prefix cache. Lab 05's answers come from `course.engine`, where the
course releases them for the labs after it (`write_kv` and `paged_attention`), and one new piece:
`forward_extend`, a prefill that starts in the middle.
Lab 05's prefill assumed nothing was cached, so its new tokens attended only to each other. Here the
new tokens (positions `n_cached` onwards) must also attend to the cached tokens before them. So each
layer writes the new keys and values into their slots, gathers the first `n_cached + T` keys and values
of the sequence through its block table, and runs causal attention with the new tokens as queries.
"""),
locked("given_paged", r'''
from course.engine import paged_attention, write_kv   # lab 05's answers, released in course.engine


@torch.no_grad()
def forward_extend(model, input_ids, position_ids, cache: PagedKVCache, slot_mapping, block_table: list[int]):
    """Prefill of one sequence whose first position_ids[0, 0] tokens are already in its blocks.
    input_ids, position_ids: (1, T), the new tokens; slot_mapping: (T,); returns logits (1, T, V)."""
    cfg = model.cfg
    check_ids(input_ids, position_ids, cfg)
    B, T = input_ids.shape
    if B != 1 or slot_mapping.shape != (T,):
        raise ValueError(f"forward_extend takes one sequence: input_ids (1, T) and slot_mapping (T,); "
                         f"got {(B, T)} and {tuple(slot_mapping.shape)}")
    H, Hkv, D, bs = cfg.n_head, cfg.n_kv_head, cfg.head_dim, cache.block_size
    L = int(position_ids[0, -1]) + 1                                        # context: cached + new tokens
    if len(block_table) * bs < L:
        raise ValueError(f"the block table holds {len(block_table) * bs} slots; the context needs {L}")
    blocks = torch.tensor(block_table[:-(-L // bs)], device=cache.device)
    mask = torch.arange(L, device=cache.device)[None, :] <= position_ids[0, :, None]   # (T, L): causal
    x, rope = embed(model, input_ids, position_ids)                         # (1, T, C)
    for i, block in enumerate(model.blocks):
        q, k, v = project_qkv(model, block, x, rope)                        # (1, H, T, D), (1, Hkv, T, D) x 2
        k_cache, v_cache = cache.layer(i)
        write_kv(k_cache, v_cache, k[0].transpose(0, 1).to(k_cache.dtype).contiguous(),   # (T, Hkv, D), row after row:
                 v[0].transpose(0, 1).to(v_cache.dtype).contiguous(), slot_mapping)        # what a Triton store reads
        kk = k_cache[blocks].reshape(-1, Hkv, D)[:L].transpose(0, 1)[None].to(q.dtype)   # (1, Hkv, L, D)
        vv = v_cache[blocks].reshape(-1, Hkv, D)[:L].transpose(0, 1)[None].to(q.dtype)
        kk, vv = kk.repeat_interleave(cfg.group_size, dim=1), vv.repeat_interleave(cfg.group_size, dim=1)
        y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)      # (1, H, T, D)
        x = x + block.attn.o_proj(y.transpose(1, 2).reshape(1, T, H * D))
        x = x + block.mlp(block.mlp_norm(x))
    return model.lm_head(model.norm(x))                                     # (1, T, V)
'''),
md(r"""
## Problem 4: Prefill only what is not cached (3 points)

**Deliverable:** `prefill(model, kv, pc, seq, tokens)`: allocate the sequence in the prefix cache `pc`,
run `forward_extend` over the tokens that did not come from the cache only (with their true positions:
they start at `n_cached`, not 0), register the new full blocks with `pc.commit`, and return the
logits of the last token, shape `(V,)`. `kv` is the `PagedKVCache` that holds the keys and values.
(The test runs it with the course's prefix cache, `CoursePrefixCache` above, and the float32 model.)
"""),
solution("prefill", r'''
def prefill(model, kv: PagedKVCache, pc: PrefixCache, seq, tokens: list[int]) -> torch.Tensor:
    """Prefill of a new sequence that skips its cached blocks; logits of its last token (V,)."""
    ### BEGIN SOLUTION
    dev = kv.device
    n_cached, slots = pc.allocate(seq, tokens)
    ids = torch.tensor([tokens[n_cached:]], device=dev)                     # (1, T)
    pos = torch.arange(n_cached, len(tokens), device=dev)[None]             # (1, T)
    logits = forward_extend(model, ids, pos, kv, torch.tensor(slots, device=dev), pc.tables[seq])
    pc.commit(seq, tokens)
    return logits[0, -1]
    ### END SOLUTION
'''),
md(r"""
The engine (given) is lab 05's continuous batching with your prefill: every step, running requests
get a slot for their newest token and are decoded together; waiting requests are admitted while the
batch has room, each prefilled on its own (so the next newcomer already finds the blocks of the one
before); finished requests release their blocks, which stay cached. It records, per request, the
prompt tokens that came from the cache and how long its prefill took, and a snapshot of the blocks
after every step for the widget. `Engine(model, n_blocks, block_size, prefix_caching=False)` is the
same engine with no cache hits: the baseline.
"""),
locked("engine", r'''
@dataclass(eq=False)
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    n_cached: int = 0          # prompt tokens that came from the cache
    prefill_s: float = 0.0     # seconds its prefill took: its time to first token once admitted


@dataclass
class Run:
    outputs: list[list[int]]
    requests: list[Request]
    seconds: float
    steps: list[dict] = field(default_factory=list)     # per step: the widget's snapshot
    labels: list[str] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens actually run through the model."""
        return sum(len(r.prompt) - r.n_cached for r in self.requests)


class Engine:
    """Greedy continuous batching on a paged KV cache with prefix caching. The cache lives as long as
    the engine: call run() again (the next turn of a chat) and it still holds the earlier blocks."""

    def __init__(self, model, n_blocks: int, block_size: int, prefix_caching: bool = True, hash_fn=hash_block):
        self.model = model
        self.pc = PrefixCache(n_blocks, block_size, hash_fn=hash_fn, enabled=prefix_caching)
        self.kv = PagedKVCache(model.cfg, n_blocks, block_size, dtype=model.dtype, device=model.device)

    def snapshot(self, running) -> dict:
        pool, bs = self.pc.pool, self.pc.block_size
        reqs = {r.rid: (list(self.pc.tables[r.rid]), (r.prompt + r.output)[:self.pc.lengths[r.rid]], r.n_cached // bs)
                for r in running}
        return {"requests": reqs, "cached": [b for b in pool.free_queue if pool.hash_of[b] is not None]}

    def run(self, requests: list[Request], max_batch_size: int = 4, eos_token_id: int | None = None) -> Run:
        if not requests or len({r.rid for r in requests}) != len(requests) or any(r.output for r in requests):
            raise ValueError("requests must be fresh Request objects with distinct rids")
        dev, pc = self.model.device, self.pc
        waiting, running, run = deque(requests), [], Run([], list(requests), 0.0)
        start = clock(dev)
        while waiting or running:
            try:
                decoding = [(r, pc.append(r.rid, 1)[0]) for r in running]
            except OutOfBlocks as e:
                raise OutOfBlocks(f"the pool of {pc.pool.n_blocks} blocks is too small for the running requests "
                                  f"(this engine does not preempt): {e}") from None
            admitted = []
            while waiting and len(running) < max_batch_size:
                r, before, t0 = waiting[0], pc.cached_tokens, clock(dev)
                try:
                    logits = prefill(self.model, self.kv, pc, r.rid, r.prompt)
                except OutOfBlocks:
                    if running:
                        break                                   # wait for blocks to be released
                    raise
                r.prefill_s, r.n_cached = clock(dev) - t0, pc.cached_tokens - before
                r.output.append(int(logits.argmax()))
                waiting.popleft(); running.append(r); admitted.append(r)
            if decoding:
                ids = torch.tensor([[r.output[-1]] for r, _ in decoding], device=dev)                        # (B, 1)
                pos = torch.tensor([[len(r.prompt) + len(r.output) - 1] for r, _ in decoding], device=dev)   # (B, 1)
                tables = block_table_tensor([pc.tables[r.rid] for r, _ in decoding], dev)
                lens = torch.tensor([pc.lengths[r.rid] for r, _ in decoding], dtype=torch.int32, device=dev)
                logits = forward_paged(self.model, ids, pos, self.kv, torch.tensor([s for _, s in decoding], device=dev),
                                       tables, lens, write_kv=write_kv, attention=paged_attention)
                for (r, _), tok in zip(decoding, logits[:, -1].argmax(dim=-1).tolist()):
                    r.output.append(tok)
                    pc.commit(r.rid, r.prompt + r.output)
            done = [r for r in running if len(r.output) >= r.max_new_tokens or r.output[-1] == eos_token_id]
            for r in done:
                running.remove(r)
                pc.free(r.rid)
            run.steps.append(self.snapshot(running))
            said = [f"admitted {[(r.rid, f'{r.n_cached} of {len(r.prompt)} cached') for r in admitted]}" if admitted else "",
                    f"finished {[r.rid for r in done]}" if done else ""]
            run.labels.append(", ".join(s for s in said if s) or "decode")
        run.seconds = clock(dev) - start
        run.outputs = [r.output for r in requests]
        return run
'''),
code(r'''
BLOCK = 16
new_tokens = env.pick(12, 4, cpu=8)
def workload(prompts):
    return [Request(i, p, new_tokens) for i, p in enumerate(prompts)]

runs = {}
for name, caching in (("no cache", False), ("prefix cache", True)):
    engine = Engine(model, n_blocks=64, block_size=BLOCK, prefix_caching=caching)
    runs[name] = engine.run(workload(prompts), max_batch_size=4)
for name, run in runs.items():
    print(f"{name:>12}: {run.prefill_tokens} prompt tokens computed, cached per request "
          f"{[r.n_cached for r in run.requests]}, {run.seconds:.1f} s in all")
print("same tokens with and without the cache:", runs["no cache"].outputs == runs["prefix cache"].outputs)
for p, out in list(zip(QUESTIONS, runs["prefix cache"].outputs))[:3]:
    print(f"  {p!r} -> {tokenizer.decode(out)!r}")
'''),
tests("prefill_tests", 3, r"""
from course.expect import expect_tensor, substituted
from course.tolerance import for_decoder, order_tol

def prefilled(m, kv, pc, seq, tokens):
    '''Your prefill, its answer checked first: the last token's logits (V,) on the model's device.'''
    return expect_tensor(prefill(m, kv, pc, seq, tokens), f"prefill(model, kv, pc, {seq!r}, tokens)", dtype=m.dtype,
                         shape=(m.cfg.vocab_size,), device=dev)

# Graded on its own: here prefill runs on the course's prefix cache (Problems 1-3), and the engine on
# model_fp32: with and without the cache, the tokens must agree one for one.
with substituted(globals(), PrefixCache=CoursePrefixCache):
    with torch.no_grad():
        want = model_fp32(torch.tensor([prompts[1]], device=dev), torch.arange(len(prompts[1]), device=dev)[None])[0, -1]
    eng = Engine(model_fp32, n_blocks=64, block_size=BLOCK)
    prefilled(model_fp32, eng.kv, eng.pc, 0, prompts[0])
    got = prefilled(model_fp32, eng.kv, eng.pc, 1, prompts[1])
    common = next((k for k, (x, y) in enumerate(zip(prompts[0], prompts[1][:-1])) if x != y), min(len(prompts[0]), len(prompts[1]) - 1))
    assert eng.pc.lengths[1] == len(prompts[1]) and eng.pc.cached_tokens == common // BLOCK * BLOCK, \
        f"prefill allocates the sequence in pc and commits its blocks: prompt 1 must find the {common // BLOCK} full blocks it shares with prompt 0"
    assert (got - want).abs().max() < 1e-3, "the last token's logits must equal the uncached model's (positions start at n_cached)"
    graded = {name: Engine(model_fp32, n_blocks=64, block_size=BLOCK, prefix_caching=caching).run(workload(prompts), max_batch_size=4)
              for name, caching in (("no cache", False), ("prefix cache", True))}
    assert graded["no cache"].outputs == graded["prefix cache"].outputs, \
        "the prefix cache must not change a single token (positions of the new tokens start at n_cached)"
    done = graded["prefix cache"].requests
    def shared_blocks(i):                 # full blocks of prompt i[:-1] that an earlier request computed
        best = max((common for j in range(i) for common in [next((k for k, (x, y) in enumerate(
            zip(done[i].prompt[:-1], done[j].prompt + done[j].output[:-1])) if x != y),
            min(len(done[i].prompt) - 1, len(done[j].prompt) + len(done[j].output) - 1))]), default=0)
        return best // BLOCK
    assert done[0].n_cached == 0, "the first request finds an empty cache"
    assert all(r.n_cached == shared_blocks(i) * BLOCK for i, r in enumerate(done)), \
        f"each request must reuse every full block an earlier one computed (the system prompt has {sys_len // BLOCK})"
    assert graded["prefix cache"].prefill_tokens < graded["no cache"].prefill_tokens, "the cache must save prefill tokens"
### BEGIN HIDDEN TESTS
""" + HIDDEN_REF + r"""
with substituted(globals(), PrefixCache=CoursePrefixCache):
    # tiny models, several block sizes and pool sizes (small pools evict), shared prefixes of every length
    for family, seed, kv in (("llama", 3, 2), ("gpt2", 4, 4), ("llama", 5, 1)):
        tiny = _tiny(family, seed, kv)
        g = random.Random(seed)
        stem = [g.randrange(1, 64) for _ in range(13)]
        prompts_t = [stem[:n] + [g.randrange(1, 64) for _ in range(k)] for n, k in ((13, 3), (13, 0), (9, 2), (4, 5), (13, 7), (1, 1), (8, 0))]
        news = [5, 3, 6, 2, 4, 7, 3]
        refs = [_ref_greedy(tiny, p, n) for p, n in zip(prompts_t, news)]
        for bs, n_blocks, B in ((4, 64, 1), (1, 80, 3), (3, 14, 2), (2, 40, 4)):
            eng = Engine(tiny, n_blocks, bs)
            run = eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(prompts_t, news))], max_batch_size=B)
            assert run.outputs == refs, f"{family}, block_size {bs}, {n_blocks} blocks: outputs differ from the request alone"
            assert sum(r.n_cached for r in run.requests) > 0, "shared prefixes must give cache hits"
            assert eng.pc.pool.n_free == n_blocks, "every block must be released when the requests are done"
            run2 = eng.run([Request(i, p, n) for i, (p, n) in enumerate(zip(prompts_t, news))], max_batch_size=B)
            assert run2.outputs == refs, f"{family}, block_size {bs}: a second pass over a warm cache changes the outputs"
            if n_blocks >= 40:
                assert all(r.n_cached == (len(r.prompt) - 1) // bs * bs for r in run2.requests), \
                    "a big warm cache holds every full block of tokens[:-1]"
        # a prompt that is an exact block multiple, fully cached: the last block is recomputed
        eng = Engine(tiny, 20, 4)
        p = stem[:12]
        a = eng.run([Request(0, p, 3)]).outputs[0]
        r = Request(1, p, 3)
        b = eng.run([r]).outputs[0]
        assert a == b == _ref_greedy(tiny, p, 3) and r.n_cached == 8, "12 tokens, fully cached: 8 from the cache, the last block recomputed"
        # prefill returns the last token's logits for a partly cached prompt
        eng = Engine(tiny, 20, 4)
        prefilled(tiny, eng.kv, eng.pc, "x", stem); eng.pc.free("x")
        logits = prefilled(tiny, eng.kv, eng.pc, "y", stem[:10] + [7, 7])
        with torch.no_grad():
            want = tiny(torch.tensor([stem[:10] + [7, 7]], device=dev), torch.arange(12, device=dev)[None])[0, -1]
        # another order of the same sums (cached keys, then the rest): float32's budget for this model, not a fixed 1e-4
        assert torch.allclose(logits, want, **order_tol(want, **for_decoder(tiny.cfg))), \
            "logits of the last token of a partly cached prompt (attend to the cached blocks at positions 0..n_cached-1)"
        assert eng.pc.lengths["y"] == 12 and eng.pc.pool.ref_count[eng.pc.tables["y"][0]] == 1, \
            "prefill allocates the sequence in pc (its first block shared with nobody now)"
    # with a colliding hash the outputs stay right (the token check)
    tiny = _tiny("llama", 9, 2)
    g = random.Random(9)
    stem = [g.randrange(1, 64) for _ in range(10)]
    ps = [stem + [g.randrange(1, 64) for _ in range(3)] for _ in range(3)] + [[g.randrange(1, 64) for _ in range(12)] for _ in range(3)]
    refs = [_ref_greedy(tiny, p, 3) for p in ps]
    eng = Engine(tiny, 40, 2, hash_fn=lambda parent, block: 1)
    assert eng.run([Request(i, p, 3) for i, p in enumerate(ps)], max_batch_size=2).outputs == refs, \
        "with a hash where everything collides, outputs must not change"
### END HIDDEN TESTS
"""),
md(r"""
### See it: which blocks each request reuses

Your engine's run with the cache, step by step. Each row is a running request: green blocks came
from the cache (their tokens skipped prefill), blue ones it computed itself, the dashed last block is
its own partial block. In the pool, blocks in use show their reference count (thick border: shared
by several requests), and blocks that hold cached tokens but have no user wait in LRU order. Note
which blocks the first request computes and every later one reuses, and that the block where the
system prompt ends is computed again by every request: it holds the last system tokens and the
first tokens of the question, and the questions differ.
"""),
code(r'''
from course.widgets import prefix_blocks

def token_texts(ids):
    return [tokenizer.decode([t]) for t in ids]

def widget_steps(run):
    return [{"requests": {f"req {rid}": (tab, token_texts(toks), hits) for rid, (tab, toks, hits) in s["requests"].items()},
             "cached": s["cached"]} for s in run.steps]

run = runs["prefix cache"]
prefix_blocks(widget_steps(run), block_size=BLOCK, n_blocks=64, labels=run.labels,
              title=f"{len(prompts)} requests sharing a system prompt, blocks of {BLOCK}")
'''),
]
