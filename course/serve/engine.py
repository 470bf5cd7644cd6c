"""The serving engine's core, assembled from the course's released parts: one `step()` at a time.

    core = LLMEngine(model, n_blocks=256, block_size=16, max_running=8, budget=256, policy="chunked")
    core.add_request("r1", prompt_ids, SamplingParams(temperature=0.0), max_tokens=32)
    while core.has_work():
        for out in core.step():        # one forward pass over every scheduled sequence
            print(out.rid, out.token, out.finish_reason)

Parts: continuous batching at token granularity with a token budget (course.engine.scheduler, lab 04,
chunked prefill from lab 11), a paged KV cache (lab 05) whose blocks a prefix cache hands out (lab 09),
`forward_extend` for steps that hold prefill chunks, and lab 07's batched sampler. A step:

    reserve: every running sequence gets a slot for its newest token; when blocks run out, the newest
             running sequence is preempted (its blocks freed; it recomputes later), as in lab 05
    plan:    the policy picks who computes how many tokens; admitted newcomers get their blocks
    run:     one forward pass: decode-only steps through `self.decode` (forward_paged's decode call,
             which replays CUDA graphs of the step when `graphs=True` captured them, lab 02), mixed
             steps through forward_extend (eager: their shapes change every step)
    sample:  every sequence whose tokens are all computed gets its next token; finished ones free
             their blocks (full blocks stay in the prefix cache)

What a server asks beyond that, per request (add_request's options, vLLM's names): `min_tokens`
(its stop tokens are masked until it has that many), `logprobs=k` (each token's log-probability and
the k most likely, from the raw logits as vLLM reports them by default) and `prompt_logprobs=k` (the
same for every prompt token, on the first output: one uncached forward of the prompt, since the
paged prefill keeps only each sequence's last logits and the prefix cache skips cached tokens).
Penalties read the request's prompt and output ids, which the engine holds (`sample(history=...)`).

Structured outputs (lab 13): `add_request(..., grammar=g)` with a course.structured Grammar gives the
request its own GrammarState. At each of its samples the state's packed mask (cached per DFA state)
sets the forbidden tokens of its row to -inf before the sampler runs, the state advances by the
token drawn, and the request stops ("stop") once the grammar is finished: EOS accepted, or a state
where only EOS may follow (the engine ends it there, without spending a step on the EOS). Masking
before the sampler is what vLLM does too, and nothing after it can bring a token back: -inf stays
-inf under logit_bias (+ a finite bias), the penalties (- a finite amount, or times a positive
factor), temperature (/ T > 0), and top-k/top-p/min-p (which only remove tokens, and must see the
masked distribution: a nucleus of forbidden tokens would leave nothing to draw). A step whose batch
holds no grammar skips all of this: unconstrained requests run exactly as before.

Not thread-safe: call add_request, abort and step from one thread at a time (the async engine
applies requests and aborts between steps, while no step runs).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Hashable
import math
from dataclasses import dataclass, field

import torch

from course.engine.block_manager import OutOfBlocks
from course.engine.extend import forward_extend
from course.engine.paged import PagedKVCache, block_table_tensor, forward_paged
from course.engine.paged_ops import paged_attention, write_kv
from course.engine.prefix_cache import PrefixCache
from course.engine.runner import embed
from course.engine.sampler import SamplingParams, sample
from course.engine.scheduler import POLICIES, Seq
from course.models.decoder import Decoder
from course.structured.decode import Grammar, GrammarState
from course.structured.tokens import TokenMask
from course.timing import synchronize


@dataclass(frozen=True)
class StepOutput:
    """One new token of one request. `finish_reason` is None while it runs, then "length" or "stop"."""

    rid: Hashable
    token: int
    index: int                      # 0 for the first token of the request
    finish_reason: str | None = None
    # with logprobs=k: this token's log-probability and the k most likely (token id, logprob) pairs
    logprob: float | None = field(default=None, compare=False)
    top_logprobs: tuple[tuple[int, float], ...] | None = field(default=None, compare=False)
    # with prompt_logprobs=k, on the first output: None for the first prompt token, then (logprob, top k)
    prompt_logprobs: tuple | None = field(default=None, compare=False, repr=False)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Request(Seq):
    """A Seq with what the engine needs to sample and stop it."""

    params: SamplingParams = field(default_factory=SamplingParams)
    stop_token_ids: frozenset = frozenset()
    generator: torch.Generator | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    grammar: GrammarState | None = None     # structured outputs: this request's place in its grammar


@dataclass
class Stats:
    """Counters since the engine started (what /metrics reports)."""

    steps: int = 0
    prompt_tokens: int = 0          # prompt tokens of admitted requests (cached ones included)
    computed_tokens: int = 0        # tokens run through the model (prefill and decode)
    generated_tokens: int = 0
    finished: int = 0
    aborted: int = 0
    preemptions: int = 0
    mask_seconds: float = 0.0       # time spent filling and applying grammar masks (structured outputs)
    masked_rows: int = 0            # rows of logits masked


class LLMEngine:
    """A paged, prefix-caching, continuously batching engine over the course's Decoder."""

    def __init__(self, model: Decoder, *, n_blocks: int = 256, block_size: int = 16, max_running: int = 8,
                 budget: int = 512, policy: str | Callable = "chunked", prefix_caching: bool = True,
                 eos_token_id: int | None = None, max_model_len: int | None = None, dtype: torch.dtype | None = None,
                 graphs: bool = False, graph_max_len: int = 1024):
        if not isinstance(model, Decoder):
            raise TypeError(f"model must be a course Decoder (course.load_model()), got {type(model).__name__}")
        for name, value in (("max_running", max_running), ("budget", budget), ("graph_max_len", graph_max_len)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if isinstance(policy, str) and policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)} or a function, got {policy!r}")
        if budget < max_running:
            raise ValueError(f"budget ({budget}) must be >= max_running ({max_running}): every decode needs a token")
        self.model, self.device = model, model.device
        self.policy = POLICIES[policy] if isinstance(policy, str) else policy
        self.policy_name = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
        self.budget, self.max_running, self.eos_token_id = budget, max_running, eos_token_id
        self.pc = PrefixCache(n_blocks, block_size, enabled=prefix_caching)
        self.kv = PagedKVCache(model.cfg, n_blocks, block_size, dtype=dtype or next(model.parameters()).dtype,
                               device=self.device)
        self.max_model_len = min(model.cfg.max_seq_len, n_blocks * block_size, max_model_len or 1 << 62)
        self.decode: Callable = forward_paged      # decode-only steps: replays CUDA graphs once they are captured
        if graphs:                                 # one graph per batch bucket, over this engine's KV cache
            # A replayed step reads its graph's whole width of blocks for every sequence, however short: graphs
            # as wide as max_model_len (8k tokens) would read far more than the eager step. So they cover
            # batches whose longest sequence fits graph_max_len tokens; wider batches run eagerly.
            from course.engine.graphs import capture_decode_graphs
            width = -(-min(self.max_model_len, graph_max_len) // block_size)
            capture_decode_graphs(model, self.kv, max_batch=max_running, max_blocks=width)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = Stats()
        self.start = time.perf_counter()
        self.trace: list[dict] | None = None       # record_trace(): one {rid: state} per step, for the timeline
        self.step_times: list[float] = []
        self.last_step_s = 0.0

    # --- requests ------------------------------------------------------------------------------

    def add_request(self, rid: Hashable, prompt: list[int], params: SamplingParams | None = None, max_tokens: int = 16,
                    stop_token_ids=(), ignore_eos: bool = False, min_tokens: int = 0, logprobs: int | None = None,
                    prompt_logprobs: int | None = None, grammar: Grammar | None = None) -> None:
        """Queue a request (token ids in, token ids out). Raises ValueError naming what is wrong.
        grammar: a course.structured Grammar over this model's vocabulary: every token obeys it."""
        if rid in self._rids():
            raise ValueError(f"request id {rid!r} is already in the engine")
        if not prompt or any(type(t) is not int or not 0 <= t < self.model.cfg.vocab_size for t in prompt):
            raise ValueError(f"prompt must be a non-empty list of token ids in 0..{self.model.cfg.vocab_size - 1}")
        if len(prompt) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                             f"({self.max_model_len})")
        for name, value in (("min_tokens", min_tokens), ("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and (type(value) is not int or not 0 <= value <= self.model.cfg.vocab_size):
                raise ValueError(f"{name} must be None or an int in 0..vocab_size, got {value!r}")
        V = self.model.cfg.vocab_size
        if grammar is not None and not (isinstance(grammar, Grammar) and grammar.vocab.size == V):
            raise ValueError(f"grammar must be a course.structured Grammar over the model's {V} logits "
                             f"(Vocabulary.from_tokenizer(tokenizer, model.cfg.vocab_size)), got {grammar!r}")
        params = params or SamplingParams()
        stops = set(stop_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None and not ignore_eos else set())
        self.waiting.append(Request(rid, list(prompt), max_tokens, arrival=time.perf_counter() - self.start,
                                    params=params, stop_token_ids=frozenset(stops),
                                    generator=params.generator(self.device), min_tokens=min_tokens or 0,
                                    logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                                    grammar=GrammarState(grammar) if grammar is not None else None))

    def abort(self, rid: Hashable) -> bool:
        """Drop a request wherever it is and free its blocks. False if the engine does not hold it."""
        for queue in (self.waiting, self.running):
            for req in list(queue):
                if req.rid == rid:
                    queue.remove(req)
                    if rid in self.pc.tables:
                        self.pc.free(rid)
                    self.stats.aborted += 1
                    return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _rids(self) -> set:
        return {r.rid for r in self.waiting} | {r.rid for r in self.running}

    # --- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """Reserve, plan, run, sample (see the module docstring). Returns the new tokens of this step."""
        t0 = time.perf_counter()
        preempted = self._reserve()
        plan = self.policy(list(self.running), list(self.waiting), self.budget, self.max_running,
                           lambda seq: not preempted and self._admit(seq))
        self._check_plan(plan)
        for seq, n in plan:
            if seq in self.waiting:
                self.waiting.remove(seq)
                self.running.append(seq)
        for req in self.waiting:                    # admitted by the policy but left out of its plan: undo
            if req.rid in self.pc.tables:
                self.pc.free(req.rid)
        outputs = self._run(plan) if plan else []
        synchronize(self.device)                    # a step with no host read would bill its GPU time to the next
        self.stats.steps += 1
        if self.trace is not None:
            self._record(plan, outputs)
            self.step_times.append(time.perf_counter() - self.trace_start)
        self.last_step_s = time.perf_counter() - t0
        return outputs

    def _check_plan(self, plan) -> None:
        seen = set()
        for item in plan:
            seq, n = item if isinstance(item, tuple) and len(item) == 2 else (None, None)
            if not (seq in self.running or seq in self.waiting) or id(seq) in seen:
                raise ValueError(f"the policy {self.policy_name!r} planned {item!r}: each entry must be (seq, n) "
                                 "with a running or admitted sequence, each sequence once")
            if type(n) is not int or not 1 <= n <= seq.remaining:
                raise ValueError(f"the policy {self.policy_name!r} gave request {seq.rid!r} {n!r} tokens; "
                                 f"it has {seq.remaining} left to compute")
            if seq in self.waiting and seq.rid not in self.pc.tables:
                raise ValueError(f"the policy {self.policy_name!r} planned waiting request {seq.rid!r} "
                                 "without admit(seq) accepting it")
            seen.add(id(seq))

    def _reserve(self) -> bool:
        """A slot for the newest token of every running sequence, oldest first; preempt the newest when
        blocks run out (it frees its blocks and waits at the front). True if anyone was preempted."""
        preempted = False
        for req in list(self.running):
            while req in self.running and self.pc.lengths[req.rid] < req.num_tokens:
                try:
                    self.pc.append(req.rid, req.num_tokens - self.pc.lengths[req.rid])
                except OutOfBlocks:
                    victim = self.running.pop()
                    self.pc.free(victim.rid)
                    victim.num_computed, preempted = 0, True
                    victim.preemptions += 1
                    self.stats.preemptions += 1
                    self.waiting.appendleft(victim)
        return preempted

    def _admit(self, req: Request) -> bool:
        """Blocks for a waiting request's tokens, its cached prefix shared; False when they do not fit."""
        try:
            n_cached, _ = self.pc.allocate(req.rid, req.tokens)
        except OutOfBlocks:
            return False
        req.num_computed = n_cached
        self.stats.prompt_tokens += len(req.prompt) if req.preemptions == 0 else 0
        return True

    def _run(self, plan: list[tuple[Request, int]]) -> list[StepOutput]:
        dev, pc = self.device, self.pc
        ids, pos, slots = [], [], []
        for req, n in plan:
            a = req.num_computed
            ids += req.tokens[a:a + n]
            pos += range(a, a + n)
            slots += [pc.slot(req.rid, p) for p in range(a, a + n)]
        tables = block_table_tensor([pc.tables[req.rid] for req, _ in plan], dev)
        ctx = torch.tensor([req.num_computed + n for req, n in plan], dtype=torch.int32, device=dev)
        t = lambda xs: torch.tensor(xs, dtype=torch.long, device=dev)  # noqa: E731
        if all(n == 1 for _, n in plan):        # decode-only: (B, 1), the graph-friendly shape
            logits = self.decode(self.model, t(ids)[:, None], t(pos)[:, None], self.kv, t(slots), tables, ctx,
                                 write_kv=write_kv, attention=paged_attention)[:, -1]
        else:
            logits = forward_extend(self.model, self.kv, t(ids), t(pos), t(slots), [n for _, n in plan], tables, ctx)
        ready = []                                                          # sequences with all tokens computed
        for row, (req, n) in enumerate(plan):
            req.num_computed += n
            pc.commit(req.rid, req.tokens[:req.num_computed])
            self.stats.computed_tokens += n
            if req.num_computed == req.num_tokens:
                ready.append((row, req))
        if not ready:
            return []
        reqs = [r for _, r in ready]
        z = logits[[row for row, _ in ready]]                               # (R, V)
        new = self._sample(z, reqs)
        outputs = []
        for i, (req, tok) in enumerate(zip(reqs, new)):
            lp = self._logprobs(z[i], tok, req.logprobs) if req.logprobs is not None else {}
            if req.prompt_logprobs is not None and not req.output:
                lp["prompt_logprobs"] = self._prompt_logprobs(req.prompt, req.prompt_logprobs)
            req.output.append(tok)
            self.stats.generated_tokens += 1
            reason = ("stop" if tok in req.stop_token_ids or self._grammar_done(req, tok) else
                      "length" if len(req.output) >= req.max_tokens or req.num_tokens >= self.max_model_len else None)
            outputs.append(StepOutput(req.rid, tok, len(req.output) - 1, reason, **lp))
            if reason is not None:
                self.running.remove(req)
                pc.free(req.rid)
                self.stats.finished += 1
        return outputs

    def _sample(self, z: torch.Tensor, reqs: list[Request]) -> list[int]:
        """The sampler over the ready rows, stop tokens masked for requests short of min_tokens (vLLM: first),
        then each grammar's mask (a grammar that allows only stop tokens wins over min_tokens)."""
        short = [(i, r) for i, r in enumerate(reqs) if len(r.output) < r.min_tokens and r.stop_token_ids]
        if short:
            z = z.clone()
            for i, r in short:
                if r.grammar is None or not _only(r.grammar, r.stop_token_ids):
                    z[i, list(r.stop_token_ids)] = -math.inf
        if any(r.grammar is not None for r in reqs):
            z = self._mask_grammars(z if short else z.clone(), reqs)
        history = [(r.prompt, r.output) for r in reqs] if any(getattr(r.params, "penalized", False) for r in reqs) else None
        return sample(z, [r.params for r in reqs], [r.generator for r in reqs], history=history).tolist()

    def _mask_grammars(self, z: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """z (R, V), in place: -inf for the tokens each request's grammar forbids. Only the constrained
        rows are unpacked and masked (an unpacked row costs about 0.1 ms on a CPU); the others are untouched."""
        t0 = time.perf_counter()
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None]
        mask = TokenMask(len(rows), z.shape[1])                             # packed: 32 tokens per int32 word
        for j, i in enumerate(rows):
            reqs[i].grammar.fill(mask, j)                                   # cached per DFA state: a lookup
        if len(rows) == len(reqs):
            mask.apply_(z)                                                  # unpacked on z's device
        else:
            z[rows] = mask.apply_(z[rows])
        self.stats.mask_seconds += time.perf_counter() - t0
        self.stats.masked_rows += len(rows)
        return z

    @staticmethod
    def _grammar_done(req: Request, token: int) -> bool:
        """Advance req's grammar by its new token; True when the output is complete (EOS accepted, or
        nothing but EOS may follow). Without a grammar, False."""
        state = req.grammar
        if state is None:
            return False
        state.advance(token)
        return state.finished or _only(state, state.grammar.vocab.eos)

    @staticmethod
    def _logprobs(logits: torch.Tensor, token: int, k: int) -> dict:
        """{"logprob", "top_logprobs"} of one token from one row of raw logits (V,), in float32."""
        lp = logits.float().log_softmax(dim=-1)
        top = lp.topk(k) if k else None
        pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if k else ()
        return {"logprob": float(lp[token]), "top_logprobs": pairs}

    def _prompt_logprobs(self, prompt: list[int], k: int, chunk: int = 512) -> tuple:
        """(None, (logprob of prompt[1], top k), ...): one uncached forward; the vocabulary projection
        runs `chunk` positions at a time, so a long prompt never holds a (T, V) float32 tensor."""
        m, dev = self.model, self.device
        x, rope = embed(m, torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev)[None])
        for block in m.blocks:
            x = block(x, rope)
        h = m.norm(x[0, :-1])                                               # (T-1, C): row t predicts token t+1
        out: list = [None]
        for a in range(0, len(prompt) - 1, chunk):
            lp = m.lm_head(h[a:a + chunk]).float().log_softmax(dim=-1)      # (c, V)
            nxt = torch.tensor(prompt[a + 1:a + 1 + chunk], device=dev)
            chosen = lp.gather(1, nxt[:, None])[:, 0].tolist()
            top = lp.topk(k) if k else None
            for j, c in enumerate(chosen):
                pairs = tuple(zip(top.indices[j].tolist(), top.values[j].tolist())) if k else ()
                out.append((c, pairs))
        return tuple(out)

    # --- what the server reports ---------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Gauges and counters for /metrics."""
        pool = self.pc.pool
        return {"running": len(self.running), "waiting": len(self.waiting),
                "kv_blocks_used": self.pc.blocks_in_use, "kv_blocks_free": pool.n_free, "kv_blocks_total": pool.n_blocks,
                "prefix_cache_queries": self.pc.queried_tokens, "prefix_cache_hits": self.pc.hit_tokens,
                "prefix_cache_hit_rate": self.pc.hit_rate, "prompt_tokens": self.stats.prompt_tokens,
                "generation_tokens": self.stats.generated_tokens, "requests_finished": self.stats.finished,
                "requests_aborted": self.stats.aborted, "preemptions": self.stats.preemptions,
                "steps": self.stats.steps, "grammar_mask_seconds": self.stats.mask_seconds,
                "grammar_masked_rows": self.stats.masked_rows}

    def record_trace(self) -> None:
        """From now on, record who does what at every step (`trace`) and when each step ends (`step_times`)."""
        self.trace, self.step_times, self.trace_start = [], [], time.perf_counter()
        self._seen: set = set()

    def _record(self, plan, outputs) -> None:
        done = {o.rid for o in outputs}
        states = {}
        for req, n in plan:
            first = req.num_computed - n < len(req.prompt) or req.rid not in self._seen
            states[req.rid] = ("decode" if not first else "prefill" if req.rid in done else "chunk")
            self._seen.add(req.rid)
        for req in list(self.running) + list(self.waiting):
            if req.rid not in states and (req.rid in self._seen or req in self.waiting):
                states[req.rid] = "waiting"
                self._seen.add(req.rid)
        self.trace.append(states)


def _only(state: GrammarState, tokens) -> bool:
    """True when every token `state` allows is one of `tokens` (a few ids: checked by count first,
    since a state inside a JSON string allows most of the vocabulary)."""
    ids = state.allowed_ids()
    return len(ids) <= len(tokens) and all(int(t) in tokens for t in ids)
