"""Lab 13, sections 6-7: validity against the baseline, the mask's cost beside the model's step, compile
cost and its cache, the same schema through xgrammar (equal masks, its cost); serving with
response_format through `python -m course.serve` and the openai client; summary, going further."""
from autograder.authoring import answer, code, md

CELLS = [
md(r"""
## 6. Measure

### Validity

The same people as in section 1, now under the schema's grammar (jump-forward `text`), greedy and
sampled at the same temperature:
"""),
code(r'''
constrained, paths = {}, []
for name, q in (("greedy", SamplingParams(temperature=0.0)), ("sampled, T=0.8", SamplingParams(temperature=0.8, seed=1))):
    gens = [generate(model, tokenizer, p, person, N_NEW + 24, params=q, jump_forward="text") for p in prompts]
    paths += [g.token_ids for g in gens]
    checks = [check_json(g.text, PERSON) for g in gens]
    constrained[name] = (np.mean([c[0] for c in checks]), np.mean([c[1] for c in checks]))
    print(f"--- {name}: {constrained[name][0]:.0%} parse, {constrained[name][1]:.0%} match the schema; "
          f"{sum(g.model_steps for g in gens)} model steps for {sum(len(g.token_ids) for g in gens)} tokens")
    for g in gens[:3]:
        print(repr(g.text))
fig, ax = plt.subplots(figsize=(6, 3))
labels = [f"{n}\n{k}" for n in baseline for k in ("free", "constrained")]
values = [v for n in baseline for v in (baseline[n][1], constrained[n][1])]
ax.bar(labels, [100 * v for v in values], color=["C3", "C2"] * len(baseline))
ax.set_ylabel("% valid under the schema"); ax.set_ylim(0, 105)
ax.set_title(f"{len(prompts)} prompts, {course.DEFAULT_MODEL}")
plt.tight_layout(); plt.show()
'''),
md(r"""
Every constrained output parses and validates, whatever the sampler draws: the mask makes every other
output impossible. (One way remains to fail: the token limit. A grammar cannot make the model finish
in time; a string field may run on. Engines report `finish_reason: "length"` then, and schemas can bound
strings with `maxLength`.) The *content* is still the model's: a grammar guarantees the form, not that
the age is right.

### What a mask costs, beside a model step

A mask is work on the CPU at every step, for every constrained request. Is it small next to the
model's step? Along the states of the generations above, time each piece (median after a warm-up):

- **first visit**: the trie walk of a state the grammar has not seen (the course's NumPy walk);
- **cached**: the state's packed row from the cache, copied into the batch's mask;
- **apply**: the packed mask applied to a `(1, V)` row of logits on the lab's device;
- **model step**: one decode step of the model (one token through the KV cache), on the lab's device.
"""),
code(r'''
from course.structured import TokenMask
from course.timing import benchmark

def path_states(grammar, ids):
    out, st = [], grammar.dfa.start
    for t in ids:
        out.append(st)
        st = next_state(grammar, st, t)
        if st < 0:
            break
    return out
states = sorted({s for ids in paths for s in path_states(person, ids)})
first = [benchmark(lambda s=s: vocab.allowed(person.dfa, s), warmup=0, repeats=1).median for s in states]
batch_mask = TokenMask(1, V)
cached = benchmark(lambda: [batch_mask.fill(0, person.mask(s)) for s in states], warmup=1, repeats=5).median / len(states)
row = torch.randn(1, V, device=dev, dtype=torch.float32)
words = batch_mask.words.to(dev)
apply_t = benchmark(lambda: apply_token_mask_(row.clone(), words), warmup=2, repeats=10, device=dev).median
step_prompt = torch.tensor([prompts[0]], device=dev)
step_cache = SlotKVCache(model.cfg, n_slots=1, max_len=step_prompt.shape[1] + 64, dtype=model.dtype, device=dev)
slot0 = torch.zeros(1, dtype=torch.long, device=dev)
forward_cached(model, step_prompt, torch.arange(step_prompt.shape[1], device=dev)[None], step_cache, slot0)
def one_step():
    n = int(step_cache.lengths[0])
    forward_cached(model, step_prompt[:, -1:], torch.tensor([[n]], device=dev), step_cache, slot0)
model_t = benchmark(one_step, warmup=2, repeats=env.pick(20, 5), device=dev).median
where = f"{env.device}, {str(model.dtype).replace('torch.', '')}"
costs = {"first visit (trie walk, CPU)": statistics.median(first), "cached row (CPU)": cached,
         f"apply to logits ({env.device})": apply_t, f"model step ({where})": model_t}
for name, t in costs.items():
    print(f"{name:34} {1e3 * t:9.3f} ms   {t / model_t:7.2%} of a model step")
print(f"{len(states)} states on these paths; slowest first visit {1e3 * max(first):.1f} ms (inside a string: most tokens allowed)")
'''),
md(r"""
Cached, a mask costs a small fraction of a model step; the first visit of a state costs more, once per
grammar. On a GPU the model's step shrinks (milliseconds for this model, less with CUDA graphs), and
the CPU's share grows: that is why engines overlap mask computation with the GPU's forward pass
(xgrammar fills the next step's bitmask while the GPU computes, vLLM's structured-output manager runs
beside the scheduler), and why the bitmask is packed before it crosses to the GPU.

### Compile cost and the grammar cache

A new schema costs a compile: the regular expression, the NFA, the DFA (subset construction and
minimization). Then each state costs one trie walk when a generation first reaches it. A server sees
the same schema again and again (one per tool, one per endpoint), so it keys compiled grammars by the
schema's text and keeps them, as `compile_grammar` does (an LRU of 64). The second request pays a
dictionary lookup:
"""),
code(r'''
from course.structured import decode as _decode_module
_decode_module._CACHE.clear()                               # start cold, for the measurement
t0 = time.perf_counter(); g1 = compile_grammar("json_schema", PERSON, vocab); t_compile = time.perf_counter() - t0
t0 = time.perf_counter(); g2 = compile_grammar("json_schema", PERSON, vocab); t_hit = time.perf_counter() - t0
walks = sum(first)
print(f"compile (schema -> regex -> DFA, {g1.dfa.n_states} states): {1e3 * t_compile:.1f} ms; the same schema again: "
      f"{1e6 * t_hit:.1f} us (the same object: {g1 is g2})")
print(f"first request's trie walks over {len(states)} states: {1e3 * walks:.1f} ms in all, "
      f"{walks / model_t:.1f} model steps' worth; a later request reuses them")
'''),
md(r"""
### The same schema through xgrammar

xgrammar (used by vLLM and SGLang) compiles the schema into a **pushdown automaton** (an automaton
with a stack, for context-free grammars), and precomputes per state which tokens are decided
without the stack. Give it the same vocabulary bytes and the same whitespace (`", "` and `": "`),
and it describes the same language: its mask must equal ours at every step. Walk the token paths of
the generations above through both:
"""),
code(r'''
import xgrammar as xgr

t0 = time.perf_counter()
xgr_info = xgr.TokenizerInfo([t or b"" for t in vocab.tokens], xgr.VocabType.RAW, vocab_size=V, stop_token_ids=vocab.eos)
xgr_compiler = xgr.GrammarCompiler(xgr_info)
xgr_person = xgr_compiler.compile_json_schema(json.dumps(PERSON), any_whitespace=False, separators=(", ", ": "))
t_xgr_compile = time.perf_counter() - t0
theirs = xgr.allocate_token_bitmask(1, V)
compared, fill_t, ours_t = 0, [], []
for ids in paths:
    matcher, st = xgr.GrammarMatcher(xgr_person), person.dfa.start
    for t in ids:
        t0 = time.perf_counter(); matcher.fill_next_token_bitmask(theirs); fill_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter(); ours = person.mask(st); ours_t.append(time.perf_counter() - t0)
        assert np.array_equal(ours, theirs[0].numpy()), f"step {compared}: the masks differ"
        assert matcher.accept_token(t)
        st = next_state(person, st, t)
        compared += 1
print(f"masks equal to xgrammar's on all {compared} steps of {len(paths)} generations")
row_cpu = torch.randn(1, V, dtype=torch.float32).to(dev)
xgr_apply = benchmark(lambda: xgr.apply_token_bitmask_inplace(row_cpu.clone(), theirs.to(dev)), warmup=2, repeats=10, device=dev).median
print(f"{'':24} {'course':>10} {'xgrammar':>10}")
print(f"{'compile (ms)':24} {1e3 * t_compile:10.2f} {1e3 * t_xgr_compile:10.2f}   (xgrammar's includes its tokenizer info)")
print(f"{'mask per step (ms, CPU)':24} {1e3 * statistics.median(ours_t):10.4f} {1e3 * statistics.median(fill_t):10.4f}   (ours: cached lookup)")
print(f"{'apply (ms, ' + env.device + ')':24} {1e3 * apply_t:10.4f} {1e3 * xgr_apply:10.4f}")
'''),
md(r"""
Equal masks on every step: your chain of ideas (automaton, trie, bitmask) is what a production library
computes. The costs differ in how they are paid: our grammar caches a whole mask per DFA state, which
is cheap for a flat schema and grows with the number of states; xgrammar's pushdown automaton handles
recursion (nested JSON of any depth, a programming language) and keeps the per-step work small by
splitting tokens into those it can decide ahead of time and the few that need the stack.

## 7. Serving it: `response_format`

OpenAI's API asks for structured output with one field of the request:
`"response_format": {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}`,
or `{"type": "json_object"}` for any JSON object. A server compiles the schema (cached), attaches a
grammar state to the request, and at every step fills that request's row of the batch's bitmask;
requests without a format get a row of ones. The course's server, `python -m course.serve` (lab 11),
does this with `course.structured`. Start it as a separate process, as in production, and call it with
the `openai` client:
"""),
code(r'''
import socket
import subprocess
import sys
import tempfile

import httpx
import openai

SERVE = not env.quick          # quick mode (tests, grading) skips this demo: a second process loading the model
if SERVE:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        PORT = sock.getsockname()[1]
    server_log = tempfile.TemporaryFile()                       # the server's own log, out of the notebook
    server = subprocess.Popen([sys.executable, "-m", "course.serve", "--port", str(PORT), "--max-running", "4"],
                              stdout=server_log, stderr=subprocess.STDOUT)
    BASE_URL = f"http://127.0.0.1:{PORT}"
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 300 and server.poll() is None:
        try:
            if httpx.get(f"{BASE_URL}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    print(f"server on {BASE_URL}: {'up' if server.poll() is None else 'exited'} after {time.perf_counter() - t0:.1f} s")
else:
    print("quick mode: the server is not started (run the lab without COURSE_QUICK=1 to see this section)")
'''),
code(r'''
def ask_server(response_format: dict, request: str) -> str | None:
    """One chat request with a response_format; the reply's text (None if the server refused it)."""
    client = openai.OpenAI(base_url=f"{BASE_URL}/v1", api_key="not-needed", timeout=300, max_retries=0)
    name = client.models.list().data[0].id
    try:
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": request}],
                                               max_tokens=64, temperature=0, response_format=response_format)
    except openai.APIStatusError as e:                  # a server without structured outputs answers 400
        print(f"the server refused response_format ({e.status_code}): {e.message}")
        return None
    print(repr(reply.choices[0].message.content), "| finish reason:", reply.choices[0].finish_reason)
    return reply.choices[0].message.content

if SERVE:
    request = "Describe a retired teacher from Lisbon as JSON with a name, an age and a city."
    text = ask_server({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}, request)
    if text is not None:
        print("parses, valid under the schema:", check_json(text, PERSON))
    text = ask_server({"type": "json_object"}, request)
    if text is not None:
        print("parses:", check_json(text, {})[0])
'''),
code(r'''
if SERVE:
    server.terminate()
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
    server_log.close()
    print("server stopped")
'''),
md(r"""
The request is ordinary: a client that never heard of automata gets JSON that parses, and a schema
that a server cannot express (a `pattern`, a `$ref`, recursion beyond its depth) is refused with a
400 that names the keyword, before any work is done, rather than silently ignored.

## Summary

- Asking for JSON in the prompt is not enough for a small model; a **grammar in the sampler** makes
  every invalid output impossible: before each draw, tokens that would leave the grammar get `-inf`.
- A **regular expression** becomes an automaton by Thompson's construction (fragments glued with free
  moves) and the subset construction (a state is a set of NFA states, computed lazily and cached).
  Working on **bytes** lets it read any token, even one that ends inside a character.
- A state's **allowed tokens** come from a walk of the vocabulary's **trie**, pruned where the state
  dies; EOS is allowed where the state accepts. The result depends on the state only: **cache it**.
- The mask travels as a **packed bitmask**, 32 tokens per int32 word (bit `j` of word `i` is token
  `32 i + j`), and is applied on the logits' device.
- A **JSON Schema** (objects, required properties, typed leaves, enums, arrays) is a regular
  language once whitespace and property order are fixed; optional properties need care with commas.
- **Jump-forward** skips the model where the grammar leaves one way on. Exact jump-forward (one
  allowed token) keeps greedy output unchanged but saves little; forcing the tokenizer's tokens for
  the forced bytes saves many steps but can change the output, because of token boundaries.
- Cached masks cost a small share of a model step on a CPU; the first visit of a state and the
  compile of a new schema cost more, once. Our masks equal xgrammar's on every step.

**Questions** (from the workshop and a few more). Answer in the cell under each group, in a few
sentences of your own and with **your** numbers where a question asks for them; a person grades them
(3 points in all).

1. Why is checking the output with `json.loads` after generation, and retrying on failure, worse than
   masking during generation? Use your baseline numbers.
2. Why must the automaton read bytes rather than characters? Give a token of this vocabulary that a
   character automaton could not step on.
"""),
answer("validity_bytes_answer", 1, "questions 1 and 2", model=r"""
1. A retry costs a whole generation each time, and nothing guarantees that the next try is valid: with
   a validity rate `p`, the expected number of generations is `1 / p`, unbounded in the worst case, and
   the latency of a request multiplies. (Example, CPU: greedy 0% and sampled 0% of the outputs
   matched the schema unconstrained: the model wrapped them in code fences or added prose.) Greedy
   retries give the same invalid output again. Masking costs a fraction of a step per token and makes
   every output valid on the first try (100% here).
2. A byte-level BPE token is a byte string, and some tokens end or start inside a multi-byte UTF-8
   character: SmolLM2's vocabulary holds pieces such as `Ã` (the byte C3 alone, the first half of `é`
   and other accented letters) and tokens made of continuation bytes. A character automaton cannot step
   on half a character; a byte automaton simply moves to a state "inside a character", which only the
   right continuation bytes leave alive.
""", rubric=r"""
- 0.5: question 1: retries cost whole generations and guarantee nothing (1/p expected tries; greedy
  repeats itself), with the student's baseline rates; masking is cheap and always valid.
- 0.5: question 2: tokens are bytes and may split a character, with an example from the vocabulary.
"""),
md(r"""
3. Why does an engine cache masks per automaton state, and what does the cache's size depend on? What
   would break the caching if the mask depended on something else than the state (say, the request's
   sampling settings)?
4. Exact jump-forward saved few steps and `text` jump-forward many. Explain the difference with token
   boundaries, and say when `text` jump-forward changes the output.
"""),
answer("cache_jump_answer", 1, "questions 3 and 4", model=r"""
3. The allowed set depends only on the state (and the vocabulary), never on the request, so every
   request and every step that reaches the state reuses one trie walk: the walk costs much more than a
   lookup (e.g. a few ms against a few microseconds on this CPU). The cache holds one packed row
   (V/32 words, 6 KB here) per visited state, so its size grows with the number of DFA states a schema
   has (tens for a flat object, many more for long enums or nested objects) times the grammars kept.
   Anything else in the key (sampling settings, the position) would multiply the entries and lower the
   hit rate; settings belong to the sampler, applied after the mask.
4. The grammar forces bytes, the model writes tokens. With a large vocabulary there are almost always
   several tokens that cover a forced text's beginning (`"`, `"n`, `"name`...), so "exactly one allowed
   token" happens rarely (the last `}` then EOS). Forcing the tokenizer's tokens for all forced bytes
   skips those steps (example: 12 instead of 22 model steps), but the tokenizer's split of the forced
   text alone may differ from what the model would have written in context (the model writes `{` then
   `"`, the tokenizer `{"`), and a last forced token may be a prefix of a longer token that would also
   cover free text. Then the model continues from an unusual tokenization and its following choices may
   change; the output is still valid.
""", rubric=r"""
- 0.5: question 3: the mask depends only on the state, so caching amortizes the trie walk across steps
  and requests; size ~ states x V/32 words; other keys would fragment the cache.
- 0.5: question 4: several tokens cover a forced text, so one-allowed-token states are rare; text
  jump-forward's tokenization may differ from the model's own, changing later choices.
"""),
md(r"""
5. A DFA cannot check that brackets balance at any depth. Which JSON Schemas does that rule out for
   our approach, and how does xgrammar handle them?
6. With speculative decoding (lab 08), the drafter proposes several tokens that the grammar must
   check before the target verifies them. What does the grammar state need in order to support
   rejected tokens, and how does `GrammarState.rollback` provide it?
"""),
answer("limits_answer", 1, "questions 5 and 6", model=r"""
5. A regular language has no memory of unbounded depth: recursive schemas (`$ref` to itself: a tree,
   a comment with replies), and "any JSON value" (`json_object`, `additionalProperties: true`) nest to
   any depth, so a DFA can only express them up to a fixed depth (the course bounds it). xgrammar
   compiles such grammars to a pushdown automaton: a stack records the open brackets and rules; it
   keeps the mask cheap by precomputing, per automaton position, the tokens whose validity does not
   depend on the stack (most of them), and checking only the rest at run time with the stack.
6. The grammar state must be able to go back: after verification, the tokens the target rejected must
   be removed from the grammar's state too, or the next mask would follow a text that does not exist.
   With a DFA the state after each token is one integer, so keeping the list of states (one per
   accepted token) makes rollback a pop of the last n entries; the masks for the drafted positions are
   the masks of the states along the draft. (xgrammar keeps a history of its stack states and offers
   `rollback(n)` too.)
""", rubric=r"""
- 0.5: question 5: recursion/unbounded nesting is not regular; bounded depth at best; xgrammar's
  pushdown automaton with a stack, and the context-independent tokens precomputed.
- 0.5: question 6: keep the state per token (history), roll back by n on rejection; masks for the
  drafted positions come from the states along the draft.
"""),
md(r"""
## Going further

- **xgrammar** (Dong et al., *XGrammar: Flexible and Efficient Structured Generation Engine for Large
  Language Models*): context-free grammars as a pushdown automaton; tokens split into
  context-independent ones (precomputed per position) and context-dependent ones (checked with the
  stack); mask computation overlapped with the GPU's step. The default backend of vLLM and SGLang.
- **Outlines** (Willard and Louf, *Efficient Guided Generation for Large Language Models*): the idea of
  this lab, a regular expression's automaton indexed against the vocabulary once, then a lookup per
  step. Its Rust core, `outlines-core`, is one of vLLM's backends.
- **llguidance** (Microsoft, used in Guidance and as a vLLM backend): a lexer automaton plus an Earley
  parser, masks computed on the fly quickly enough to need no precomputation; careful handling of
  token boundaries ("token healing", fast-forward tokens).
- **SGLang**'s compressed finite-state machine: jump-forward over forced text, with re-tokenization of
  the output after a jump and a recompute of the KV cache where the tokens changed.
- **vLLM**'s structured-output manager: grammars compiled asynchronously and cached; the batch's
  bitmask filled on the CPU while the GPU runs, then applied to the logits before sampling;
  speculative tokens checked against the grammar and rolled back when rejected.
- **Tool calling** is structured output: each tool's parameters are a JSON Schema, and `tool_choice:
  "required"` or a named tool constrains the output to a call. OpenAI's strict mode and Anthropic's
  tool use rely on the same masks.
"""),
]
