"""Lab 13, sections 4-5: a JSON Schema subset as a regular expression (Problem 4), jump-forward decoding
(Problem 5: forced bytes and a constrained generation that skips the model where one token is left), and
the step-by-step trace of one generation."""
from autograder.authoring import code, locked, md, solution, tests

# Hidden-test reference for Problem 4: jsonschema says what is valid; Python's re runs the student's pattern.
HIDDEN_INSTANCES = r'''
import random as _random
def _instances(schema, rng, n):
    # random values valid under `schema` (our subset), each written by json.dumps
    def value(s, depth=0):
        if "enum" in s:
            return rng.choice(s["enum"])
        t = s["type"]
        if t == "string":
            return rng.choice(["", "a", "Ada Lovelace", 'say "hi"', "back\\slash", "tab\there", "é中", "line\nbreak"])
        if t == "integer":
            return rng.choice([0, 7, -3, 42, 1000000, -250])
        if t == "number":
            return rng.choice([0, 1.5, -2.25, 3, 1e-05, 6.02e+23])
        if t == "boolean":
            return rng.choice([True, False])
        if t == "null":
            return None
        if t == "array":
            return [value(s["items"], depth + 1) for _ in range(rng.choice([0, 1, 2, 3]))]
        req = set(s.get("required", []))
        return {k: value(v, depth + 1) for k, v in s.get("properties", {}).items() if k in req or rng.random() < 0.5}
    return [json.dumps(value(schema)) for _ in range(n)]
def _invalid(schema, rng, n):
    # JSON texts near valid ones that jsonschema rejects (or that do not parse)
    val = jsonschema.Draft202012Validator(schema)
    out = []
    for text in _instances(schema, rng, 4 * n):
        for bad in (text.replace('"', "'", 1), text[:-1], text + " ", text.replace(": ", ":", 1), text.replace(", ", ",", 1),
                    text.replace("true", '"true"').replace("false", "0"), text.replace("{", '{"extra": 1, ', 1),
                    text.replace('": 0', '": 0.5').replace('": 7', '": "7"'), "[" + text + "]", text.replace("[", "[1, ", 1)):
            if bad == text:
                continue
            try:
                ok = val.is_valid(json.loads(bad)) and json.dumps(json.loads(bad)) == bad
            except ValueError:
                ok = False
            if not ok:
                out.append(bad)
    rng.shuffle(out)
    return out[:n]
'''.strip("\n")

CELLS = [
md(r"""
## 4. JSON Schema, as a regular expression

A JSON Schema describes values, and for the schemas that APIs ask for (objects with typed fields) the
set of JSON texts that match is a **regular language**: a regular expression can describe it, provided we
fix two things a parser would leave free.

- **Whitespace.** JSON allows any amount of it between tokens. We fix one form, `json.dumps`'s: a space
  after each `:` and `,`, none anywhere else. A model writes it naturally, and a fixed form keeps the
  automaton small. (Allowing free whitespace is legal and easy, but a small model may then write
  spaces or newlines forever.)
- **Property order.** JSON objects are unordered, but a regular expression reads left to right. We
  write properties in the order the schema declares them, as xgrammar and OpenAI's strict mode do.

The leaves are given: a JSON string (any character but `"`, `\` and control characters, or an escape),
an integer (no leading zeros, no `-0`), a number, a boolean, null.

**Optional properties** are the one subtle part. Commas go *between* properties, so whether a comma
comes before property `k` depends on whether any property before it was written. With `a` optional
and `b` required, `{"b": 1}` is valid and `{, "b": 1}` is not. Build the object's body from the end,
with one flag: "has anything been written yet?" The first property written has no comma before it;
every later one has `, ` before it.
"""),
locked("json_leaves", r'''
STRING = r'"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
INTEGER = r"(?:0|-?[1-9][0-9]*)"
NUMBER = r"(?:-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)"
LEAVES = {"string": STRING, "integer": INTEGER, "number": NUMBER, "boolean": "(?:true|false)", "null": "null"}
print("a string:", STRING)
'''),
md(r"""
## Problem 4: A JSON Schema as a regular expression (4 points)

**Deliverable:** `schema_regex(schema)` returns a regular expression (a `str`) that fully matches
exactly the `json.dumps` texts of the values valid under `schema`, properties in declared order.

The subset: `{"enum": [...]}` (any JSON values: each is its `json.dumps` text, escaped with
`re.escape`); `{"type": t}` for the five leaves; `{"type": "array", "items": s}` (zero or more items,
`, ` between them); `{"type": "object", "properties": {...}, "required": [...]}` (only the listed
properties, declared order, the required ones always present). Keywords such as
`additionalProperties: false`, `title` or `description` change nothing here. Anything else may raise a
`ValueError`. Group alternatives with `(?:...)`: later cells compile your pattern with the course's
automaton (`course.structured.compile_regex`), which reads the same syntax as Python's `re`.
"""),
solution("schema_regex", r'''
def schema_regex(schema: dict) -> str:
    """A regular expression for the json.dumps texts of the values valid under `schema` (our subset)."""
    ### BEGIN SOLUTION
    if "enum" in schema:
        return "(?:" + "|".join(re.escape(json.dumps(v)) for v in schema["enum"]) + ")"
    kind = schema.get("type")
    if kind in LEAVES:
        return LEAVES[kind]
    if kind == "array":
        item = schema_regex(schema["items"])
        return rf"\[(?:{item}(?:, {item})*)?\]"
    if kind == "object":
        props = list(schema.get("properties", {}).items())
        required = set(schema.get("required", []))

        def rest(i: int, first: bool) -> str:
            """Properties i.. of the body; `first`: nothing written yet, so no comma before the next one."""
            if i == len(props):
                return ""
            name, sub = props[i]
            item = ("" if first else ", ") + re.escape(json.dumps(name)) + ": " + schema_regex(sub)
            with_it = item + rest(i + 1, False)
            if name in required:
                return with_it
            return f"(?:{with_it}|{rest(i + 1, first)})"

        return r"\{" + rest(0, True) + r"\}"
    raise ValueError(f"unsupported schema: {schema!r}")
    ### END SOLUTION
'''),
tests("schema_regex_tests", 4, r"""
from course.structured import compile_regex as _course_compile
cases = Cases(points=4)
def pattern_of(schema):
    return expect_type(schema_regex(schema), f"schema_regex({json.dumps(schema)})", str)
def matches(schema, text):
    return re.fullmatch(pattern_of(schema), text) is not None
with cases("leaves"):
    assert matches({"type": "integer"}, "42") and not matches({"type": "integer"}, "042"), "an integer: 42, not 042"
    assert matches({"type": "string"}, '"a \\"quote\\""'), "a JSON string with escaped quotes"
with cases("enum"):
    s = {"enum": ["red", "green", 3, None]}
    assert matches(s, '"red"') and matches(s, "3") and matches(s, "null"), "each enum value as json.dumps writes it"
    assert not matches(s, "red") and not matches(s, '"blue"'), "a string enum value keeps its quotes; nothing else matches"
with cases("arrays"):
    s = {"type": "array", "items": {"type": "boolean"}}
    assert matches(s, "[]") and matches(s, "[true]") and matches(s, "[true, false]"), "[], [true], [true, false]"
    assert not matches(s, "[true,false]") and not matches(s, "[true, ]"), "', ' between items, none after the last"
with cases("objects, optional properties and commas"):
    s = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["b"]}
    assert matches(s, '{"a": 1, "b": 2}') and matches(s, '{"b": 2}'), \
        ("a optional, b required: both {\"a\": 1, \"b\": 2} and {\"b\": 2} match; when an optional property is left out, "
         "the next one written has no comma before it if it comes first")
    assert not matches(s, '{, "b": 2}') and not matches(s, '{"a": 1}'), "no leading comma; b is required"
with cases("the course's automaton reads your pattern"):
    _course_compile(pattern_of(PERSON))
### BEGIN HIDDEN TESTS
""" + HIDDEN_INSTANCES + r"""
SCHEMAS = [
    PERSON,
    {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "null"}, "z": {"type": "boolean"}}},
    {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
                                      "size": {"enum": ["S", "M", "L"]}}, "required": ["tags"]},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "integer"}, "r": {"type": "string"}},
                                            "required": ["r"]}, "n": {"type": "array", "items": {"type": "integer"}}},
     "required": ["p", "n"]},
    {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": [1, "one", True, None]}}, "required": ["k"]}},
    {"enum": ["a \"quoted\" value", "dot.star*", 2.5, False]},
]
for i, s in enumerate(SCHEMAS):
    rng = _random.Random(i)
    with cases(f"schema {i}: every valid instance matches"):
        pat = pattern_of(s)
        for text in _instances(s, rng, 40):
            assert jsonschema.Draft202012Validator(s).is_valid(json.loads(text)), f"the test's own instance {text!r} is invalid"
            assert re.fullmatch(pat, text), f"schema {json.dumps(s)[:80]}: the valid {text!r} does not match your pattern"
    with cases(f"schema {i}: nothing invalid matches"):
        for text in _invalid(s, rng, 40):
            assert not re.fullmatch(pat, text), f"schema {json.dumps(s)[:80]}: {text!r} matches, but it is not valid (jsonschema) or not json.dumps' form"
with cases("all optional: the empty object"):
    s = SCHEMAS[1]
    assert matches(s, "{}") and matches(s, '{"z": true}') and matches(s, '{"y": null, "z": false}'), \
        "with every property optional, {} and any subset in declared order match, with no leading comma"
    assert not matches(s, '{"z": true, "x": 1}'), "declared order: x before z"
with cases("the course's automaton agrees with re on your pattern"):
    pat = pattern_of(SCHEMAS[2])
    dfa = _course_compile(pat)
    for text in _instances(SCHEMAS[2], _random.Random(9), 20):
        assert dfa.fullmatch(text), f"the course's automaton reads your pattern differently from re on {text!r}"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
Now the whole chain works on a schema: your pattern, the course's automaton and trie walk (the same
algorithms as yours, faster: NumPy over the trie's levels, a minimal DFA), a mask at every step. The
course's `generate` (in `course/structured/decode.py`) is the loop: one model step, the mask of the
current state applied to the logits, the token drawn, the state advanced. The grammar caches one packed
mask per state, so the second request that reaches a state pays a lookup. Section 5 runs it.
"""),
code(r'''
from course.structured import (FINISHED, Grammar, Vocabulary, apply_token_mask_, compile_grammar, compile_regex,
                               generate, schema_to_regex)

vocab = Vocabulary.from_tokenizer(tokenizer, V)                  # the token bytes and the trie, once per tokenizer
print(vocab)
person = Grammar.from_json_schema(PERSON, vocab)                  # the course's pattern, for the sections below
mine = Grammar(compile_regex(schema_regex(PERSON)), vocab)         # your pattern
print(mine, "| the course's pattern:", compile_regex(schema_to_regex(PERSON)))
ada = json.dumps({"name": "Ada", "age": 36, "city": "London"})
print(ada, "matches:", mine.dfa.fullmatch(ada), "| allowed first tokens:", tokenizer.convert_ids_to_tokens(mine.allowed_ids(0).tolist()))
'''),
md(r"""
## 5. Jump-forward: where the grammar decides, skip the model

Look at a person object being written: `{"name": "` comes before the model has any choice, and so
does `", "age": ` after the name, and `}` plus the end of text at the end. Where the automaton has
**one way on**, the model's step is wasted: the mask would leave one option. **Jump-forward
decoding** (SGLang's *compressed finite-state machine*) writes those bytes without asking the model.
The forced tokens still go into the model's input, and so into the KV cache, but together with the
next step's token: one forward pass over several tokens, like a short prefill, instead of one pass per
token.

**Forced bytes.** From a state, follow the only byte that leads on, while there is exactly one and
the state does not accept (in an accepting state, stopping is a second option). On `{"name": "` the
forced bytes after `{` are `"name": "`.

**Token boundaries make it subtle.** The grammar forces *bytes*; the model writes *tokens*. How do
the forced bytes become tokens? Two ways, each with its cost:

- **exact**: skip the model only where the mask allows **exactly one token**. Greedy decoding then
  gives the very same output as without jump-forward: the model would have had to take that token.
  But with 49,152 tokens, one allowed token is rare: `"name": "` can be written as `"`, then `name`,
  or as `"name`, or as `"na`... so most forced text still costs model steps.
- **text**: tokenize the forced bytes with the tokenizer and append those tokens. This saves many more
  steps, but the tokenizer's split need not be the one the model would have written, and a model
  reads a text written in an unusual split as a slightly different text. The last forced token is the
  worst: it may be a prefix of a longer token that also covers free text (` ` then `true`, or ` true`?).
  Forcing ` ` makes the model continue from a split it never saw in training. The course's version
  holds back such a last token and lets the model choose it, under the mask (llguidance does the
  same). SGLang instead re-tokenizes the text after a jump and recomputes the cache where the tokens
  changed. Either way the output stays valid; it may differ from the output without jump-forward.

## Problem 5: Jump-forward (4 points)

Two parts, on the course's `Grammar` (its `dfa` is a minimal DFA with integer states: `dfa.trans` is
an `(n_states, 256)` int array, the next state for each byte, `-1` dead; `dfa.accept` an
`(n_states,)` bool array; `grammar.allowed_ids(state)` the allowed token ids, ascending;
`grammar.mask(state)` their packed words; `next_state` below, the state after a token).

**Deliverable (a):** `forced_bytes(dfa, state)`: the bytes every continuation from `state` starts
with (follow the only live byte while there is exactly one and the state does not accept).

**Deliverable (b):** `constrained_generate(m, prompt_ids, grammar, max_new_tokens, jump_forward)`
returns `(new token ids, model steps)`: greedy decoding under the grammar's masks, stopping after EOS
(kept in the output) or at `max_new_tokens`. A model step is one forward pass (the prefill counts).
With `jump_forward=True`, wherever the grammar allows exactly one token, append it **without** a
model step (exact jump-forward); it goes into the model's input with the next step. The output must
then be token for token the output without jump-forward. Use `SlotKVCache` and `forward_cached` as in
section 1 (one slot), and `apply_token_mask_(logits, words)` (the course's version of your Problem 3).
"""),
locked("next_state", r'''
def next_state(grammar: Grammar, state: int, token: int) -> int:
    """The DFA state after `token`: FINISHED after an EOS where the state accepts; -1 if not allowed."""
    if token in grammar.vocab.eos:
        return FINISHED if grammar.dfa.accepts(state) else -1
    data = grammar.vocab.tokens[token] if token < len(grammar.vocab.tokens) else None
    return grammar.dfa.walk(state, data) if data else -1
'''),
solution("jump_forward", r'''
def forced_bytes(dfa, state: int) -> bytes:
    """The bytes every continuation from `state` starts with: the only live byte, while there is one
    and the state does not accept."""
    ### BEGIN SOLUTION
    out = bytearray()
    while state >= 0 and not dfa.accept[state]:
        live = np.flatnonzero(dfa.trans[state] >= 0)
        if len(live) != 1:
            break
        out.append(int(live[0]))
        state = int(dfa.trans[state, live[0]])
    return bytes(out)
    ### END SOLUTION


@torch.no_grad()
def constrained_generate(m, prompt_ids: list[int], grammar: Grammar, max_new_tokens: int,
                         jump_forward: bool = False) -> tuple[list[int], int]:
    """Greedy under `grammar`: (new token ids, EOS included if reached; forward passes). With
    jump_forward, a state that allows one token only gets it without a forward pass."""
    ### BEGIN SOLUTION
    cache = SlotKVCache(m.cfg, n_slots=1, max_len=len(prompt_ids) + max_new_tokens, dtype=m.dtype, device=dev)
    slot = torch.zeros(1, dtype=torch.long, device=dev)
    state, out, feed, steps = grammar.dfa.start, [], list(prompt_ids), 0
    while len(out) < max_new_tokens and state != FINISHED:
        allowed = grammar.allowed_ids(state)
        if jump_forward and len(allowed) == 1:
            t = int(allowed[0])                                   # no choice: no model step
        else:
            start = int(cache.lengths[0])
            ids = torch.tensor([feed], dtype=torch.long, device=dev)                   # (1, T)
            pos = torch.arange(start, start + len(feed), device=dev)[None]             # (1, T)
            logits = forward_cached(m, ids, pos, cache, slot)[:, -1].float()           # (1, V)
            steps += 1
            words = torch.from_numpy(grammar.mask(state)).to(dev)[None]               # (1, W)
            t = int(apply_token_mask_(logits, words).argmax())
            feed = []
        out.append(t)
        feed.append(t)                                            # into the model with the next step
        state = next_state(grammar, state, t)
    return out, steps
    ### END SOLUTION
'''),
tests("jump_forward_tests", 4, r"""
cases = Cases(points=4)
person = Grammar.from_json_schema(PERSON, vocab)
def forced(d, state):
    return expect_type(forced_bytes(d, state), "forced_bytes(dfa, state)", bytes)
with cases("(a) forced bytes of a JSON object"):
    d = person.dfa
    got = forced(d, d.walk(0, b"{"))
    assert got == b'"name": "', f"after '{{' the grammar forces '\"name\": \"' (the name's first character is free), got {got!r}"
    assert forced(d, d.walk(0, b'{"name": "A')) == b"", "inside the name the next byte is free: nothing is forced"
with cases("(a) an accepting state forces nothing"):
    d = compile_regex("ab(cd)?")
    assert forced(d, 0) == b"ab", ("from the start of 'ab(cd)?', 'ab' is forced and nothing more: the state after "
                                         "'ab' accepts, so stopping there is a choice")
    assert forced(d, d.walk(0, b"ab")) == b"", ("after 'ab' the output may stop (the state accepts) or go on with "
                                                     "'cd': stopping is a choice, so nothing is forced")
count = Grammar(compile_regex("[0-9]\n[0-9]\n[0-9]\n[0-9]"), vocab)
count_prompt = tokenizer("Count down: 9\n8\n7\n").input_ids
def run(grammar, prompt, n, jump):
    got = expect_tuple(constrained_generate(model_fp32, prompt, grammar, n, jump), "constrained_generate(...)", 2)
    return expect_ints(got[0], "its token ids"), expect_int(got[1], "its model steps", min=0)
off_ids, off_steps = [], 0
with cases("(b) without jump-forward: one step per token"):
    off_ids, off_steps = run(count, count_prompt, 12, False)
    assert count.dfa.fullmatch(tokenizer.decode(off_ids, skip_special_tokens=True)) and off_ids[-1] == EOS, \
        f"the output must match the grammar and end with EOS, got {tokenizer.decode(off_ids)!r}"
    assert off_steps == len(off_ids), f"without jump-forward every token costs a model step: {len(off_ids)} tokens, {off_steps} steps"
with cases("(b) exact jump-forward: the same tokens, fewer steps"):
    assert off_ids, "the generation without jump-forward failed (see the case above)"
    on_ids, on_steps = run(count, count_prompt, 12, True)
    st, n_one = count.dfa.start, 0
    for t in off_ids:
        n_one += len(count.allowed_ids(st)) == 1
        st = next_state(count, st, t)
    assert on_ids == off_ids, (f"with jump_forward the tokens must equal those without it (greedy), got {tokenizer.decode(on_ids)!r} "
                               f"instead of {tokenizer.decode(off_ids)!r}: did every forced token go into the model's input "
                               "(feed it with the next step)?")
    assert on_steps == len(off_ids) - n_one, (f"{n_one} of the {len(off_ids)} tokens were the only one allowed (newlines, EOS): "
                                              f"{len(off_ids) - n_one} model steps expected, got {on_steps}")
### BEGIN HIDDEN TESTS
_xgr = xgr
with cases("(a) forced bytes equal xgrammar's jump-forward string, along a JSON generation"):
    _info = _xgr.TokenizerInfo([t or b"" for t in vocab.tokens], _xgr.VocabType.RAW, vocab_size=vocab.size, stop_token_ids=vocab.eos)
    _compiled = _xgr.GrammarCompiler(_info).compile_json_schema(json.dumps(PERSON), any_whitespace=False, separators=(", ", ": "))
    _m = _xgr.GrammarMatcher(_compiled)
    text = json.dumps({"name": "Ada", "age": 36, "city": "London"}).encode()
    st = 0
    for k in range(len(text) + 1):
        ours = forced(person.dfa, st)
        theirs = _m.find_jump_forward_string().encode()
        assert ours == theirs, f"after {text[:k]!r}: forced {ours!r}, xgrammar's jump-forward string is {theirs!r}"
        if k < len(text):
            assert _m.accept_string(text[k:k + 1].decode()), f"xgrammar refuses {text[:k + 1]!r} (the test's own text)"
            st = person.dfa.step(st, text[k])
with cases("(a) forced bytes by brute force over the 256 bytes"):
    for p in ["(abc|abd)e", "x[0-9]{2}yz", "(true|false)", "é中?", "a+b"]:
        d = compile_regex(p)
        for prefix in [b"", b"a", b"ab", b"x1", b"t", b"\xc3", b"aa"]:
            s = d.walk(0, prefix)
            if s < 0:
                continue
            exp = bytearray()
            while not d.accepts(s):
                nxt = [b for b in range(256) if d.step(s, b) >= 0]
                if len(nxt) != 1:
                    break
                exp.append(nxt[0])
                s = d.step(s, nxt[0])
            got = forced(d, d.walk(0, prefix))
            assert got == bytes(exp), f"{p!r} after {prefix!r}: forced {got!r}, expected {bytes(exp)!r}"
with cases("(b) the tokens equal the course's constrained generation"):
    prompt = tokenizer("A baker in Lyon, as JSON: ").input_ids          # short: a cheap prefill
    ref = generate(model_fp32, tokenizer, prompt, person, 24, jump_forward="off").token_ids
    mine_ids, mine_steps = run(person, prompt, 24, False)
    assert mine_ids == ref, f"your greedy constrained tokens differ from the reference: {tokenizer.decode(mine_ids)!r} vs {tokenizer.decode(ref)!r}"
    assert mine_steps == len(ref), "without jump-forward, one model step per token"
with cases("(b) max_new_tokens cuts the output"):
    ids, steps = run(person, tokenizer("A nurse:").input_ids, 5, True)
    assert len(ids) == 5 and steps <= 5 and EOS not in ids, "5 new tokens at most, and no EOS before the object is complete"
with cases("(b) after the only free choice, EOS costs no step"):
    only = Grammar(compile_regex("[0-9]"), vocab)
    ids, steps = run(only, count_prompt, 4, True)
    assert len(ids) == 2 and ids[-1] == EOS and steps == 1, \
        f"grammar [0-9]: one step picks the digit, then EOS is the only token left (no step): got {ids}, {steps} steps"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
With exact jump-forward, greedy output is unchanged, so your loop can be checked token for token. The
course's `generate` has a third mode, `jump_forward="text"`, which forces the tokenizer's tokens for the
forced bytes (holding back a last token that could grow). Compare the three on a few people: the model
steps each needs, and whether the output changed. (Exact jump-forward's greedy output is the output
without it, as your tests showed, so its steps are counted along that output: one saved for every
state that allowed one token.)
"""),
code(r'''
jf_people = people[:env.pick(4, 1, cpu=2)]
print(f"{'person':34} {'off':>5} {'exact':>6} {'text':>5}  same text?")
total = {"off": 0, "exact": 0, "text": 0}
trace = []                                       # the first text run's steps, for the plot below
for who, p in zip(jf_people, prompts):
    off = generate(model, tokenizer, p, person, 64, jump_forward="off")
    text = generate(model, tokenizer, p, person, 64, jump_forward="text", trace=None if trace else trace)
    st, one = person.dfa.start, 0                # exact: greedy output = off's; a step saved per one-token state
    for t in off.token_ids:
        one += len(person.allowed_ids(st)) == 1
        st = next_state(person, st, t)
    steps = {"off": off.model_steps, "exact": off.model_steps - one, "text": text.model_steps}
    for mode in total:
        total[mode] += steps[mode]
    print(f"{who:34} {steps['off']:5} {steps['exact']:6} {steps['text']:5}  {text.text == off.text}   {text.text}")
print(f"model steps in all: off {total['off']}, exact {total['exact']}, text {total['text']} "
      f"({1 - total['text'] / total['off']:.0%} fewer with text jump-forward)")
'''),
md(r"""
### One generation, step by step

Which tokens did the mask keep at each step, and which did the model want? The first `text` run above
was given `trace=[]`: `generate` records, for every new token, the automaton's state before it, how many tokens the mask allowed, the
token written, and the model's own top token without the mask (`None` where jump-forward wrote the
token). The plot shows the number of allowed tokens per step (log scale), and marks the steps where
the mask overruled the model.
"""),
code(r'''
fig, ax = plt.subplots(figsize=(max(6, 0.32 * len(trace)), 3.4))
colors = ["0.7" if r["wanted"] is None else ("C3" if r["wanted"] != r["token"] else "C2") for r in trace]
ax.bar(range(len(trace)), [r["allowed"] for r in trace], color=colors)
ax.set_yscale("log"); ax.set_ylabel("tokens the mask allows")
ax.set_xticks(range(len(trace)))
ax.set_xticklabels([tokenizer.decode([r["token"]]) if r["token"] != EOS else "EOS" for r in trace], rotation=90, fontsize=8)
ax.set_title("grey: written by jump-forward; green: the model's own top token; red: the mask overruled the model")
plt.tight_layout(); plt.show()
print(f"{'step':>4} {'state':>5} {'allowed':>8}  {'written':14} model wanted")
for k, r in enumerate(trace):
    wanted = "(forced)" if r["wanted"] is None else repr(tokenizer.decode([r["wanted"]]))
    print(f"{k:4} {r['state']:5} {r['allowed']:8}  {tokenizer.decode([r['token']])!r:14} {wanted}")
'''),
md(r"""
The same trace in a widget: move the slider to replay the generation token by token. Each token is
coloured by how it was chosen; under the text, the latest state, how many tokens its mask keeps (the
first few listed), and what the model wanted.
"""),
code(r'''
from course.widgets import grammar_trace

grammar_trace([dict(r, kept=person.allowed_ids(r["state"])[:12].tolist()) for r in trace],
              lambda t: "<EOS>" if t == EOS else tokenizer.decode([t]))
'''),
md(r"""
Inside the name and the city, the mask allows tens of thousands of tokens and the model picks its own
favourite. At the edges of the structure the mask allows a handful, and that is where it overrules
the model (a red bar): where the model, unconstrained, would have closed the object early, or opened
a code fence. The grey bars are free steps.
"""),
]
