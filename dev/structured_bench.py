"""What a token mask costs per step, beside the model's step: course.structured against xgrammar.

    python dev/structured_bench.py                     # the person schema, on this machine's CPU
    python dev/structured_bench.py --device cuda       # the model step and the mask's apply on a GPU

One constrained greedy generation gives a path of DFA states (and tokens). Along it we time, per step
(median over the steps of several replays, after a warm-up replay):
- ours, first visit: the trie walk of a state never seen (what a new schema's first request pays;
  the median over the path's states, and the slowest: a state inside a string allows ~49k tokens);
- ours, cached: the cached packed row put in the batch's mask, and the mask applied to the logits;
- xgrammar: `fill_next_token_bitmask` + `accept_token`, and its `apply_token_bitmask_inplace`;
- one decode step of the model (one token, through the KV cache) on --device, in its dtype;
and, once each, the schema's compile time (regex -> DFA ours, compile_json_schema xgrammar's).
A benchmark, not a test: the numbers depend on the machine.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import course  # noqa: E402
from course.engine.runner import forward_cached_eager  # noqa: E402
from course.engine.slot_cache import SlotKVCache  # noqa: E402
from course.structured import (  # noqa: E402
    Grammar, GrammarState, TokenMask, Vocabulary, compile_regex, generate, pack, schema_to_regex,
)

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
    "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "hobbies"]}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=60, help="max new tokens of the generation")
    ap.add_argument("--repeats", type=int, default=5, help="replays of the path timed (after one warm-up)")
    args = ap.parse_args()
    device = torch.device(args.device)

    tok = course.load_tokenizer()
    model = course.load_model(device=str(device))
    V = model.cfg.vocab_size
    vocab = Vocabulary.from_tokenizer(tok, V)

    t = time.perf_counter()
    dfa = compile_regex(schema_to_regex(SCHEMA))
    ours_compile = time.perf_counter() - t
    grammar = Grammar(dfa, vocab)
    msgs = [{"role": "user", "content": "Describe a person as JSON: name, age, city, hobbies."}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    run = generate(model, tok, prompt, grammar, args.tokens)
    ids = run.token_ids
    st = GrammarState(grammar)
    states = []
    for t_id in ids:
        states.append(st.state)
        st.advance(t_id)
    print(f"generation: {len(ids)} tokens, {dfa.n_states} DFA states, {len(set(states))} visited: {run.text}")

    # ours, first visit: a fresh trie walk per distinct state
    cold = []
    for s in dict.fromkeys(states):
        t = time.perf_counter()
        pack(vocab.allowed(dfa, s))
        cold.append(time.perf_counter() - t)

    # ours, cached: lookup + fill the batch's row; then the apply on the logits' device
    mask = TokenMask(1, V)
    logits = torch.randn(1, V, device=device)
    fill, apply = [], []
    for rep in range(args.repeats + 1):
        for s in states:
            t = time.perf_counter()
            mask.fill(0, grammar.mask(s))
            t1 = time.perf_counter()
            mask.apply_(logits)
            sync(device)
            t2 = time.perf_counter()
            if rep:
                fill.append(t1 - t)
                apply.append(t2 - t1)

    # xgrammar on the same path
    xg = None
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar is not installed: its columns are left out (pip install xgrammar==0.2.8)")
    else:
        info = xgr.TokenizerInfo([b or b"" for b in vocab.tokens], xgr.VocabType.RAW, vocab_size=V,
                                 stop_token_ids=vocab.eos)
        compiler = xgr.GrammarCompiler(info)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
        xg_compile = time.perf_counter() - t
        bitmask = xgr.allocate_token_bitmask(1, V)
        xg_fill, xg_apply = [], []
        for rep in range(args.repeats + 1):
            matcher = xgr.GrammarMatcher(compiled)
            for t_id in ids:
                t = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                matcher.accept_token(t_id)
                t1 = time.perf_counter()
                xgr.apply_token_bitmask_inplace(logits, bitmask.to(device, non_blocking=True))
                sync(device)
                t2 = time.perf_counter()
                if rep:
                    xg_fill.append(t1 - t)
                    xg_apply.append(t2 - t1)
        xg = (xg_compile, xg_fill, xg_apply)

    # one decode step of the model at this context length
    cache = SlotKVCache(model.cfg, 1, len(prompt) + len(ids) + args.repeats * 4 + 8, dtype=model.dtype, device=device)
    slot = torch.zeros(1, dtype=torch.long, device=device)
    with torch.no_grad():
        forward_cached_eager(model, torch.tensor([prompt + ids], device=device),
                             torch.arange(len(prompt) + len(ids), device=device)[None], cache, slot)
        steps = []
        for k in range(args.repeats * 4 + 2):
            pos = int(cache.lengths[0])
            sync(device)
            t = time.perf_counter()
            token, at = torch.tensor([[ids[-2]]], device=device), torch.tensor([[pos]], device=device)
            forward_cached_eager(model, token, at, cache, slot)
            sync(device)
            if k >= 2:
                steps.append(time.perf_counter() - t)

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"
    print(f"device: {where}; model {course.DEFAULT_MODEL} in {model.dtype}; vocabulary {V}; "
          f"median over {len(fill)} steps")
    rows = [("ours: mask, first visit of a state (trie walk + pack)", median_ms(cold)),
            ("ours: mask, first visit, slowest state (inside a string)", 1e3 * max(cold)),
            ("ours: mask, cached (lookup + fill the row)", median_ms(fill)),
            ("ours: apply the mask to (1, V) logits", median_ms(apply))]
    if xg:
        rows += [("xgrammar: fill_next_token_bitmask + accept_token", median_ms(xg[1])),
                 ("xgrammar: apply_token_bitmask_inplace", median_ms(xg[2]))]
    rows.append((f"model: one decode step ({device.type}, {model.dtype})", median_ms(steps)))
    for name, ms in rows:
        print(f"  {name:<58} {ms:9.3f} ms")
    print(f"  compile, ours (schema -> regex -> DFA)                    {1e3 * ours_compile:9.1f} ms")
    if xg:
        print(f"  compile, xgrammar (compile_json_schema)                   {1e3 * xg[0]:9.1f} ms")
    print(f"  ours, all first visits of this path                        {1e3 * sum(cold):9.1f} ms")


if __name__ == "__main__":
    main()
