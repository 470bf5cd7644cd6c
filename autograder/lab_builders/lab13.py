"""Builds the lab 13 source notebook (structured outputs). Edit this file or its sections, then run
from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab13

Sections: this file (title, setup, section 1: the problem measured), lab13_automaton.py (sections 2-3:
the regex automaton, token bytes and the trie, the packed bitmask: problems 1-3), lab13_json.py
(sections 4-5: JSON Schema to a regular expression, jump-forward, the step trace: problems 4-5),
lab13_measure.py (sections 6-7: measurements beside xgrammar, serving, summary, going further).
"""
from autograder.authoring import code, locked, md, write_notebook  # noqa: E402
from autograder.lab_builders import lab13_automaton, lab13_json, lab13_measure  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402

HEADER = [
md(r"""
# Lab 13: Structured outputs

A program that calls a model usually wants data, not prose: a JSON object with the fields it
expects, a date, a yes or a no. Asking nicely in the prompt is not enough. A small model writes
a code fence around its JSON, forgets a quote, invents a field, or keeps talking after the closing
brace, and the program's `json.loads` fails. Serving engines solve this in the sampler. Before each
token is drawn, a **grammar** says which tokens could still lead to a valid output, and every other
token's logit becomes minus infinity. The model still chooses, but only among tokens that keep the
output valid, so the output always parses. This is what `response_format` does in OpenAI's API and
in vLLM and SGLang, through libraries such as xgrammar, Outlines and llguidance.

**You will**
- measure how often the course model's JSON parses and matches a schema when you only ask for it;
- build a regular-expression matcher as an automaton, one byte at a time;
- lift it to tokens: read each token's bytes, walk a trie of the vocabulary, pack the allowed tokens
  into a bitmask of 32 tokens per word, and apply it to the logits;
- turn a JSON Schema into a regular expression, and generate JSON that always validates;
- skip the model where the grammar leaves no choice (jump-forward decoding), and count the steps saved;
- measure validity, the mask's cost beside the model's step, and check your masks against xgrammar's;
- ask the course's server for structured output with the `openai` client.

**Time:** about 3 hours 30 minutes: 45 minutes of reading, five problems (the automaton about 40
minutes, the trie and its walk 35, the bitmask 20, the schema 35, jump-forward 30), 20 minutes for the
written questions at the end, and about a minute and a half of running on a laptop CPU (80 s measured
on 2 cores).

**Hardware:** everything runs on a laptop CPU. On a GPU the model and the mask's application run
there; the automaton and the trie always run on the CPU, as in vLLM and SGLang.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
code(r'''
import json
import re
import statistics
import time

import jsonschema
import matplotlib.pyplot as plt
import numpy as np
import torch
import xgrammar as xgr              # the reference library of section 6 (and of the tests)

from course.engine import SamplingParams, SlotKVCache, forward_cached, sample
from course.expect import Cases, expect_bool, expect_int, expect_ints, expect_tensor, expect_tuple, expect_type

tokenizer = course.load_tokenizer()
model = course.load_model(device=env.device, dtype=env.dtype)
model_fp32 = model if env.dtype == torch.float32 else course.load_model(device=env.device)   # for exact comparisons
dev = env.device
EOS = tokenizer.eos_token_id
V = model.cfg.vocab_size
print(f"{course.DEFAULT_MODEL}: vocabulary of {V} tokens, end of text = {EOS} ({tokenizer.decode([EOS])!r})")
'''),
md(r"""
## 1. The problem, measured

We want the model to describe a person as a JSON object that a program can read. The contract is a
**JSON Schema**: a JSON document that says what the object must hold. Ours asks for a name (a string),
an age (an integer) and a city (a string), all three required, and nothing else:
"""),
locked("schema", r'''
PERSON = {"type": "object",
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
          "required": ["name", "age", "city"], "additionalProperties": False}
PEOPLE = ["a retired teacher from Lisbon", "a young chess player from Oslo", "a baker in Lyon",
          "a nurse who lives in Toronto", "a student in Nairobi", "a pilot from Sydney"]


def chat_ids(request: str) -> list[int]:
    """The prompt ids of one user message, formatted with the model's chat template."""
    messages = [{"role": "system", "content": "Answer with one JSON object that matches this JSON Schema, and nothing "
                                              "else: " + json.dumps(PERSON)},
                {"role": "user", "content": request}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def check_json(text: str, schema: dict) -> tuple[bool, bool]:
    """(the whole text parses as JSON, and it is valid under `schema`): what a program reading it needs."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False, False
    return True, jsonschema.Draft202012Validator(schema).is_valid(value)
'''),
md(r"""
The model runs without any constraint first: greedy, and sampled at temperature 0.8. A static batch
(lab 04) with per-request settings (lab 07) keeps it cheap: one prefill for all prompts, then one step
per token for all of them.
"""),
code(r'''
@torch.no_grad()
def free_generate(m, prompts: list[list[int]], max_new_tokens: int, params: list[SamplingParams]) -> list[list[int]]:
    """Unconstrained generation of a static batch (left padding), lab 07's sampler; a row stops at EOS."""
    B, T = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((B, T), dtype=torch.long, device=dev)
    mask = torch.zeros((B, T), dtype=torch.long, device=dev)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = torch.tensor(p, device=dev), 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)                                  # (B, T)
    cache = SlotKVCache(m.cfg, n_slots=B, max_len=T + max_new_tokens, dtype=m.dtype, device=dev)
    slots = torch.arange(B, device=dev)
    logits = forward_cached(m, ids, pos, cache, slots, mask)[:, -1]          # (B, V)
    gens = [q.generator(dev) for q in params]
    out, done, nxt = [[] for _ in prompts], [False] * B, pos[:, -1:] + 1
    for _ in range(max_new_tokens):
        tok = sample(logits.float(), params, gens)                           # (B,)
        for b in range(B):
            if not done[b]:
                out[b].append(int(tok[b]))
                done[b] = int(tok[b]) == EOS
        if all(done):
            break
        logits = forward_cached(m, tok[:, None], nxt, cache, slots)[:, -1]     # the cache remembers the pads
        nxt = nxt + 1
    return out

people = PEOPLE[:env.pick(6, 1, cpu=3)]
N_NEW = env.pick(64, 24, cpu=48)
prompts = [chat_ids(f"Describe {who} as a JSON object with a name, an age and a city.") for who in people]
modes = {"greedy": SamplingParams(temperature=0.0), "sampled, T=0.8": SamplingParams(temperature=0.8, seed=1)}
outs = free_generate(model, prompts * len(modes), N_NEW, [q for q in modes.values() for _ in prompts])   # one batch
baseline = {}
for k, name in enumerate(modes):
    texts = [tokenizer.decode(o, skip_special_tokens=True) for o in outs[k * len(prompts):(k + 1) * len(prompts)]]
    checks = [check_json(t, PERSON) for t in texts]
    baseline[name] = (np.mean([c[0] for c in checks]), np.mean([c[1] for c in checks]))
    print(f"--- {name}: {baseline[name][0]:.0%} parse, {baseline[name][1]:.0%} match the schema")
    for t in texts[:3]:
        print(repr(t[:160]))
'''),
md(r"""
Read the texts, not only the numbers. The model knows what JSON looks like; what goes wrong is the
edges: a code fence (` ```json `) around the object, prose before or after it, a field of its own
invention, an age written as a string, or an object cut off by the token limit. A program can try to
repair some of this (strip the fences, find the first `{`), but each repair is a guess. The rest of
this lab makes invalid output impossible instead: the sampler never draws a token that leaves the
grammar.

The plan has four layers, each a section:

1. a **regular expression** becomes an **automaton**: a machine that reads the output one byte at a
   time and knows, after each byte, whether the output can still become a match;
2. the automaton is lifted to **tokens**: from a state, which of the 49,152 tokens keep it alive
   (their bytes, read one by one, never leave the language), as a **bitmask** over the logits;
3. a **JSON Schema** becomes a regular expression, so the whole machinery applies to it;
4. where the automaton allows one continuation only, the engine writes it without asking the model
   (**jump-forward**).
"""),
]

cells = HEADER + lab13_automaton.CELLS + lab13_json.CELLS + lab13_measure.CELLS + [md(CHECK_YOUR_WORK)]

if __name__ == "__main__":
    path = write_notebook("labs/13_structured_outputs/13_structured_outputs.ipynb", cells)
    print(f"wrote {path} ({len(cells)} cells)")
