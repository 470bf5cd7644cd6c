"""Lab 08, the end of section 5 and section 6: the trace widget, the measurements (acceptance rate,
tokens per target pass and wall-clock speedup per drafter and draft length, on fresh and on
repeating text), the real model pairs, then the summary and going further."""
from autograder.authoring import answer, code, md

CELLS = [
md(r"""
### See it: the trace

Every step of a run, replayed. Underlined green: drafts the target accepted; struck-out red: the
first rejected draft; grey: drafts after it, discarded unchecked; orange: the target's correction;
blue: a bonus token (all drafts passed); light grey: a plain step (no draft to check). Pick a drafter and move the slider: one position is one
target pass. The table lists the latest passes.
"""),
code(r"""
from course.widgets import spec_trace

trace_prompt = "Once upon a time, there was a fox who"
trace_ids = tokenizer(trace_prompt).input_ids
trace_new = env.pick(64, 24, cpu=40)
runs = {}
for drafter in (ModelDrafter(draft, draft_name), NgramDrafter(model.cfg.vocab_size)):
    _, runs[drafter.name] = speculative_generate(model, drafter, trace_ids, trace_new, gamma=4)
spec_trace(runs, lambda t: tokenizer.decode([t]), prompt=trace_prompt)
"""),
md(r"""
Where does the trained draft fail? Often on the first token of a new idea (a name, a number, a
rare word: the draft's head does not even have most rare tokens) and rarely inside a common phrase.
Prompt lookup proposes nothing until the text repeats itself; this story barely does, so it rarely
has a draft and almost never hits. The repeating prompts at the end of section 6 show where it shines.

## 6. Measure

Three numbers per drafter and draft length $\gamma$:

- **acceptance rate** $\alpha$: accepted drafts over *checked* drafts (the accepted ones plus the
  one rejection that ends a step; drafts discarded after it were never checked);
- **tokens per target pass**: new tokens over steps. If each draft were accepted independently
  with probability $\alpha$, a step would yield $1 + \alpha + \alpha^2 + \dots + \alpha^\gamma =
  \frac{1 - \alpha^{\gamma+1}}{1 - \alpha}$ tokens (Leviathan et al., 2023). Compare;
- **speedup**: the wall time of `plain_generate` over that of `speculative_generate`, same prompt,
  same number of tokens. It depends on the draft's cost too: $\gamma$ draft passes per step.

A few prompts the draft never saw in training. The cell prints a table and plots it; it takes about
a minute on a CPU (more prompts, tokens and values of $\gamma$ on a GPU). Timings on a shared or busy
machine are noisy: rerun the cell if a number looks odd.

On a GPU the cell first turns on CUDA graphs for every cache the generators get (lab 02): the
target's verify pass ($\gamma + 1$ tokens, or 1 when the drafter had nothing), the draft's passes
and the plain decoding baseline each replay a captured graph instead of launching hundreds of
kernels one by one. It then reruns the plain baseline and the best drafter without graphs, so you see
what launch overhead does to speculative decoding. On a CPU every pass runs eagerly: a CPU has no
launches to remove.
"""),
code(r"""
import matplotlib.pyplot as plt
import numpy as np
from course.widgets.spec_trace import trace_stats

measure_texts = ["The history of the printing press begins in", "Here is a simple recipe for banana bread:",
                 "def bubble_sort(items):\n    ", "My grandfather told me a story about"]
# Sized to a few minutes: on a GPU an eager pass of this small model costs tens of ms, bound by its launches (lab 02)
n_prompts, new_tokens = env.pick((3, 64), (1, 16), cpu=(2, 32))
gammas = env.pick([1, 2, 4, 6], [2], cpu=[1, 2, 4])
measure_prompts = [tokenizer(t).input_ids for t in measure_texts[:n_prompts]]
repeats = env.pick(2, 1, cpu=2)
caches.graphs = env.gpu        # on a GPU every pass from here on replays a CUDA graph (captured on first use)

def run_all(drafter, gamma, temperature=0.0, prompts=None, n_new=None):
    '''Steps of every prompt, and the median wall time of generating them all (the measure prompts by default).'''
    prompts, n_new, out = prompts or measure_prompts, n_new or new_tokens, {}
    def run():
        out["steps"] = [s for p in prompts for s in speculative_generate(model, drafter, p, n_new, gamma, temperature, seed=0)[1]]
    seconds = benchmark(run, warmup=1 if caches.graphs else 0, repeats=repeats, device=dev).median   # (capture untimed)
    return out["steps"], seconds

def plain_time(prompts=None, n_new=None):
    '''Median wall time of plain greedy decoding of every prompt.'''
    prompts, n_new = prompts or measure_prompts, n_new or new_tokens
    return benchmark(lambda: [plain_generate(model, p, n_new) for p in prompts], repeats=repeats, device=dev).median

base = plain_time()
print(f"plain cached greedy decoding: {n_prompts * new_tokens / base:.1f} tokens/s ({n_prompts} prompts x {new_tokens} tokens)\n")
drafters = {draft_name: ModelDrafter(draft, draft_name), "prompt lookup": NgramDrafter(model.cfg.vocab_size)}
rows = {}
print(f"{'drafter':15} {'gamma':>5} {'accept':>7} {'tok/pass':>8} {'formula':>8} {'tokens/s':>9} {'speedup':>8}")
for name, drafter in drafters.items():
    for gamma in gammas:
        steps, secs = run_all(drafter, gamma)
        st = trace_stats(steps)
        a = st.acceptance_rate
        formula = gamma + 1.0 if a == 1 else (1 - a ** (gamma + 1)) / (1 - a)     # nan when nothing was checked
        rows[name, gamma] = dict(alpha=a, per_pass=st.tokens_per_pass, formula=formula, speedup=base / secs)
        print(f"{name:15} {gamma:5d} {a:7.2f} {st.tokens_per_pass:8.2f} {formula:8.2f} "
              f"{n_prompts * new_tokens / secs:9.1f} {base / secs:7.2f}x")
from course.report import record
for name in drafters:
    best = max(gammas, key=lambda g: rows[name, g]["speedup"])
    record("spec_best_speedup_" + name.replace(" ", "_"), rows[name, best]["speedup"], "x",
           "the best drafter against plain decoding on the wall clock, fresh text",
           device=dev, dtype=env.dtype, gamma=best, acceptance=round(rows[name, best]["alpha"], 3),
           prompts=n_prompts, new_tokens=new_tokens, workload="fresh text")
if caches.graphs:                # the best drafter again, every pass launched op by op
    best_name, best_gamma = max(rows, key=lambda k: rows[k]["speedup"])
    caches.graphs = False
    base_eager = plain_time()
    _, secs_eager = run_all(drafters[best_name], best_gamma)
    caches.graphs = True
    print(f"\nwithout CUDA graphs: plain decoding {n_prompts * new_tokens / base_eager:.1f} tokens/s, {best_name} "
          f"(gamma {best_gamma}) {base_eager / secs_eager:.2f}x; with graphs: {rows[best_name, best_gamma]['speedup']:.2f}x")
    record("spec_eager_best_speedup", base_eager / secs_eager, "x", "the best drafter without CUDA graphs",
           device=dev, dtype=env.dtype, gamma=best_gamma, drafter=best_name)
ee_steps, _ = run_all(ModelDrafter(early_exit, "early exit"), gammas[0])
print(f"\nuntrained early exit (4 blocks, full head), gamma {gammas[0]}: acceptance rate {trace_stats(ee_steps).acceptance_rate:.2f}")

fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
for name, color in zip(drafters, ("C0", "C2")):
    xs = gammas
    axes[0].plot(xs, [rows[name, g]["per_pass"] for g in xs], "o", color=color, label=f"{name}: measured")
    axes[0].plot(xs, [rows[name, g]["formula"] for g in xs], "x--", color=color, label=f"{name}: (1-a^(g+1))/(1-a)")
    axes[1].plot(xs, [rows[name, g]["speedup"] for g in xs], "o-", color=color, label=name)
axes[0].set_xlabel("draft length gamma"); axes[0].set_ylabel("tokens per target pass"); axes[0].legend(fontsize=8)
axes[1].axhline(1, color="gray", lw=1); axes[1].set_xlabel("draft length gamma"); axes[1].set_ylabel("speedup over plain decoding")
axes[1].legend(fontsize=8)
for ax in axes:
    ax.grid(alpha=0.3)
plt.tight_layout(); plt.show()
"""),
md(r"""
Read your table:

- Does the formula track the measured tokens per pass? It assumes every draft is accepted with the
  same probability, independently. Prompt lookup breaks that twice: it proposes fewer than $\gamma$
  tokens (or none) when no n-gram matches, and its guesses come in runs (a repeated passage is
  right for many tokens, then wrong).
- Why does the speedup stop growing, or fall, with $\gamma$, while tokens per pass keep rising? Each
  extra draft costs a draft pass for sure and pays only if all earlier drafts were accepted. With
  draft cost $c$ (a draft pass over a target pass) the expected speedup is
  $\frac{1 - \alpha^{\gamma+1}}{(1 - \alpha)(\gamma c + 1)}$, assuming a target pass over
  $\gamma + 1$ tokens costs what a pass over one does (check that against your first measurement).
- The untrained early exit is what you get from a draft that does not match the target: almost
  nothing is accepted, and the draft passes are pure loss. Training the adapter is what made the
  4-block draft's guesses acceptable; whether they also save time depends on $c$. On a CPU a pass
  costs about what its weights do: the trained draft's 4 blocks of 30, its adapter and its 8,192-row
  head are about a sixth of the target's ($c \approx 0.16$); the early exit, with the full head, about
  a third ($c \approx 0.3$). On a GPU without graphs every pass costs what launching its kernels costs
  (lab 02), and each step adds small launches and host reads of its own (the probability rows, the
  argmaxes, the tokens read back to Python) that cost next to nothing on a CPU. On a GPU, compare the
  line printed under your table (no graphs) with the table (graphs): the difference is what launch
  overhead costs speculative decoding there. Prompt lookup's draft costs almost nothing, so it pays
  wherever the text repeats itself.

### Text that repeats itself

The prompts above ask for fresh text, where nothing can be copied. Much real traffic is not like
that: a model asked to edit code or a document writes most of it back unchanged, and structured output
repeats its keys on every record. That is where engines switch prompt lookup on (vLLM calls it
`ngram` speculation). Two such prompts: a passage to copy word for word, and a list of records in one
format. The same drafters, against plain decoding on the same prompts:
"""),
code(r"""
repeat_texts = ["Text: The quick brown fox jumps over the lazy dog. The dog sleeps in the warm sun all afternoon, "
                "while the fox runs into the forest to find its friends.\nThe same text, copied word for word: The quick brown fox",
                '[{"name": "Alice", "age": 30, "city": "Paris", "email": "alice@example.com"},\n'
                ' {"name": "Bob", "age": 25, "city": "London", "email": "bob@example.com"},\n {"name": "Carol",']
repeat_prompts = [tokenizer(t).input_ids for t in repeat_texts[:env.pick(2, 1)]]
repeat_tokens, repeat_gammas = env.pick(48, 16, cpu=32), env.pick([2, 4, 6, 8], [4], cpu=[2, 4, 6])
n_repeat = len(repeat_prompts) * repeat_tokens
base_repeat = plain_time(repeat_prompts, repeat_tokens)
print(f"plain decoding: {n_repeat / base_repeat:.1f} tokens/s ({len(repeat_prompts)} prompts x {repeat_tokens} tokens, {dev}, {env.dtype})")
print(f"{'drafter':15} {'gamma':>5} {'accept':>7} {'tok/pass':>8} {'tokens/s':>9} {'speedup':>8}")
repeat_rows = {}
for name, drafter in drafters.items():
    for gamma in repeat_gammas:
        steps, secs = run_all(drafter, gamma, prompts=repeat_prompts, n_new=repeat_tokens)
        st = trace_stats(steps)
        repeat_rows[name, gamma] = dict(alpha=st.acceptance_rate, per_pass=st.tokens_per_pass, speedup=base_repeat / secs)
        print(f"{name:15} {gamma:5d} {st.acceptance_rate:7.2f} {st.tokens_per_pass:8.2f} {n_repeat / secs:9.1f} {base_repeat / secs:7.2f}x")
for name in drafters:
    best = max(repeat_gammas, key=lambda g: repeat_rows[name, g]["speedup"])
    record("spec_best_speedup_repeating_" + name.replace(" ", "_"), repeat_rows[name, best]["speedup"], "x",
           "the best drafter against plain decoding on the wall clock, text that repeats itself",
           device=dev, dtype=env.dtype, gamma=best, acceptance=round(repeat_rows[name, best]["alpha"], 3),
           prompts=len(repeat_prompts), new_tokens=repeat_tokens, workload="text that repeats itself")
"""),
md(r"""
Compare the two tables. On text that repeats itself prompt lookup's acceptance rate is high, its runs
are long, and tokens per pass keep climbing with $\gamma$: a draft of several tokens is accepted
whole. The draft model does not know what is being copied, so it gains nothing from the repetition
(its acceptance rate may even fall). Whether the
wall clock follows depends on what a target pass over $\gamma + 1$ tokens costs next to a pass
over one, on your machine: read the speedup column.

### Sampling

At temperature 1 the check is the rejection rule, and acceptance depends on how close the draft's
whole distribution is to the target's: $\alpha = \sum_x \min(p(x), q(x))$ on average, not just
agreement on the top token.
"""),
code(r"""
sample_gamma = 4
base = plain_time()        # measured again beside the runs it is compared with: the machine may have changed
for name, drafter in drafters.items():
    steps, secs = run_all(drafter, sample_gamma, temperature=1.0)
    st = trace_stats(steps)
    print(f"temperature 1, {name:14}: acceptance rate {st.acceptance_rate:.2f}, {st.tokens_per_pass:.2f} tokens per pass, "
          f"speedup {base / secs:.2f}x (the baseline is greedy: sampling costs about the same)")
out, _ = speculative_generate(model, drafters[draft_name], measure_prompts[0], env.pick(40, 12), sample_gamma,
                              temperature=1.0, seed=1)
print("\nsampled with speculative decoding:", repr(measure_texts[0] + tokenizer.decode(out)))
"""),
md(r"""
Prompt lookup's one-hot $q$ is accepted only with probability $p(x)$, the target's own probability
of the copied token: below its greedy acceptance, by how much depends on how sure the target is of
what it copies (compare with your greedy table). (A speedup above 1x at 1.00 tokens per pass is
noise: no pass was saved. Rerun the cell.)

### Real pairs, if you choose to download them

Our draft was cut out of its target. The usual pair is two models of one family, trained apart, with
one tokenizer: SmolLM2-135M drafting for SmolLM2-360M, or distilgpt2 (6 layers) for gpt2 (12). The
next cell measures their greedy acceptance rate with your `speculative_generate`. SmolLM2-135M is
the course's own model; the other three (SmolLM2-360M, gpt2 and distilgpt2) come from the Hugging
Face hub (about 1.6 GB in all), so it runs only if you set `DOWNLOAD = True` and the hub can be
reached (Colab, most laptops); offline, as on the grading machine, it says so.
Compare with the 4-block draft: a separately trained small model usually agrees with its big sibling
far more often, at a higher cost per draft token.
"""),
code(r"""
from course.models.loading import ModelUnavailableError

def pair_acceptance(target_name: str, draft_name: str, gamma: int = 4):
    '''Greedy acceptance rate and tokens per pass of draft_name drafting for target_name, on the measure prompts.'''
    tok = course.load_tokenizer(target_name)
    target, drafter = course.load_model(target_name, device=dev, dtype=env.dtype), ModelDrafter(course.load_model(draft_name, device=dev, dtype=env.dtype))
    steps = [s for text in measure_texts[:n_prompts]
             for s in speculative_generate(target, drafter, tok(text).input_ids, new_tokens, gamma)[1]]
    return trace_stats(steps)

DOWNLOAD = False   # True: fetch SmolLM2-360M, gpt2 and distilgpt2 from the hub (about 1.6 GB; -135M is the course's)
for big, small in (("smollm2-360m", "smollm2-135m"), ("gpt2", "distilgpt2")):      # (target, draft)
    if not DOWNLOAD:
        print(f"{small} drafting for {big}: not run (set DOWNLOAD = True to run it)")
        continue
    try:
        st = pair_acceptance(big, small)
        print(f"{small} drafting for {big}, gamma 4: acceptance rate {st.acceptance_rate:.2f}, "
              f"{st.tokens_per_pass:.2f} tokens per target pass")
    except ModelUnavailableError as e:
        print(f"{small} drafting for {big}: skipped ({str(e).split(': ', 1)[-1].split('.')[0]})")
"""),
md(r"""
## Summary

- Decoding is one token per pass; a pass over a few more tokens costs less than a pass per token
  (on a GPU, about the same as one; on a CPU, your first measurement says how much less).
  Speculative decoding spends that slack on the draft's guesses.
- The target checks $\gamma$ drafts in **one** pass over the last token and the drafts; its
  $\gamma + 1$ rows give a verdict for every draft plus one token of its own.
- The KV cache **appends** the drafts and **rolls back** the rejected ones, in the target and in the
  draft: a rollback only moves the length back.
- **Greedy acceptance** keeps the drafts equal to the target's argmax: the output is exactly the
  target's greedy text.
- **Rejection sampling** accepts with $\min(1, p/q)$ and resamples from $\max(0, p - q)$ normalized,
  with a bonus token from the last row: the output has exactly the target's distribution.
- The gain depends on the acceptance rate, the draft length and the draft's cost; a draft that does
  not match the target makes decoding *slower*.

**Questions**. Answer in the cell under each group, in a few sentences of your own and with **your**
numbers where a question asks for them; a person grades them (4 points in all).
1. The workshop this course grew from says the target "verifies these tokens in parallel; worst case, re-run from
   that point". What does the worst case cost with your implementation, compared with plain decoding?
2. Why must the draft share the target's tokenizer? What would it take to use a draft with another vocabulary?
"""),
answer("worst_case_vocab_answer", 1, "questions 1 and 2", model=r"""
1. The worst case is every step's first draft rejected. Nothing is re-run: the same target pass that
   rejected `d_1` gives the correction from its row 0, and rolling back only moves the cache lengths.
   So a step still yields one token per target pass, like plain decoding, but pays for it with `gamma`
   draft passes (`gamma x c` of a target pass) and a target pass over `gamma + 1` tokens instead of one
   (about the same on a GPU, somewhat more on a CPU: the first measurement says how much). The step
   costs about `1 + gamma x c` plain steps (plus the verify overhead): a slowdown, never a wrong token.
2. The draft's proposals are token ids that the target reads as input and checks against its own rows:
   greedy compares `d_i` with the target's argmax, and rejection sampling divides `p(x)` by `q(x)` for
   the same token `x`. Both only mean something when the two models number the same strings the same
   way. With another vocabulary one must translate: decode the draft's tokens to text and re-encode it
   with the target's tokenizer (token boundaries differ, so the last, possibly partial, token must be
   held back), check the re-encoded tokens greedily, and map the cache lengths back on the draft's
   side; exact rejection sampling then needs the two distributions over a common space (strings, or
   the tokens both vocabularies share), which is what "universal" assisted decoding schemes build.
""", rubric=r"""
- 0.5: question 1: one token per target pass (the correction comes from the same pass; rollback is
  free), plus the wasted gamma draft passes and a wider verify pass: about 1 + gamma c of a plain step.
- 0.5: question 2: ids and per-token probabilities must refer to the same tokens; another vocabulary
  needs text-level translation (detokenize, retokenize, align) and, for sampling, a common space.
"""),
md(r"""
3. Explain, with the two terms $\min(p, q)$ and $\max(0, p - q)$, why rejection sampling gives exactly
   $p$. Would the chi-square check in the test under Problem 5 catch resampling from $p$ instead? Work out the first token's distribution in that case.
"""),
answer("rejection_sampling_answer", 1, "question 3", model=r"""
A draft `x` is proposed with probability `q(x)` and kept with `min(1, p(x)/q(x))`, so it is output as
an accepted draft with probability `min(p(x), q(x))`. A rejection happens with probability
`1 - sum_y min(p(y), q(y)) = sum_y max(0, p(y) - q(y))`, and then `x` is drawn from the normalized
residual, which gives it `max(0, p(x) - q(x))`. In total `min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x)`.
Resampling from `p` instead gives `min(p(x), q(x)) + (1 - sum_y min(p(y), q(y))) p(x)`. In the test,
`p = (0.40, 0.25, 0.15, 0.10, 0.10)` and `q = (0.10, 0.15, 0.25, 0.40, 0.10)`: `min(p, q)` =
`(0.10, 0.15, 0.15, 0.10, 0.10)`, sum 0.60, so the rejection rate is 0.40 and the first token comes out
as `(0.10 + 0.16, 0.15 + 0.10, 0.15 + 0.06, 0.10 + 0.04, 0.10 + 0.04)` = `(0.26, 0.25, 0.21, 0.14, 0.14)`
instead of `p`. Over 3,500 steps the expected counts are `(1400, 875, 525, 350, 350)` and this rule
gives about `(910, 875, 735, 490, 490)`: a chi-square statistic near 370, far beyond the test's
threshold (about 38, where its p-value reaches 1e-7). Yes, it is caught, every time.
""", rubric=r"""
- 0.5: the derivation: accepted mass min(p, q), rejection mass sum max(0, p - q), residual share
  max(0, p(x) - q(x)), sum = p(x).
- 0.5: the wrong rule's first-token distribution (0.26, 0.25, 0.21, 0.14, 0.14), or the formula
  min(p, q) + 0.4 p worked out, and why the chi-square check catches it (a statistic in the hundreds).
"""),
md(r"""
4. From your two tables: which $\gamma$ is best for each drafter, on fresh and on repeating text?
   When can prompt lookup afford a longer draft than the draft model, and why?
5. Your draft costs $c$ of a target pass. Using the speedup formula, what acceptance rate would it
   need to reach 2x at $\gamma = 4$? Why does a big GPU target (a 70B model) make $c$ much smaller
   than it is for this 135M target?
"""),
answer("gamma_cost_answer", 1, "questions 4 and 5", model=r"""
4. (From the student's tables; a typical reading:) the trained draft does best at a small to moderate
   `gamma` (2-4) on fresh text, and no better on repeating text; the untrained early exit loses at
   every `gamma` (its drafts are almost never accepted); prompt lookup barely drafts on fresh text
   (about 1x at any `gamma`) and is best at the largest `gamma` on repeating text, where its tokens per
   pass keep climbing. Prompt lookup can afford a longer draft because a guess costs it almost nothing
   (a list search, no model pass: `c` near 0), so an extra guess only widens the verify pass, and its
   guesses come in runs: when it has found the passage being copied it is right for many tokens in a
   row. Each extra token of the model draft costs a draft pass for sure and pays only if every earlier
   draft was accepted.
5. Speedup `(1 - a^5) / ((1 - a)(4c + 1)) = 2`, so `1 + a + a^2 + a^3 + a^4 = 2 (4c + 1)`. With the
   trained draft's `c` of about 0.16 on a CPU: `1 + a + ... + a^4 = 3.28`, `a` of about 0.79; with the
   early exit's `c` of about 0.3: 4.4, `a` of about 0.94; with a free draft (`c = 0`): 2, `a` of about
   0.52. A big target's decode pass on a GPU is bound by reading its weights (140 GB for a 70B model in
   bf16, tens of milliseconds per pass), and a small draft (1B, or a few layers) reads about a hundredth
   of that: `c` is about the ratio of their sizes. For this 135M target the draft is a sizeable
   fraction of its target (4 blocks of 30 plus a head: about a sixth of its bytes on a CPU), and on a
   GPU both passes are bound by kernel launches, which a small draft pays almost as much as the target.
""", rubric=r"""
- 0.5: question 4: the best gamma per drafter and text read from the student's tables, and why prompt
  lookup can draft longer (near-zero cost per guess, correlated runs of correct guesses).
- 0.5: question 5: the equation set up with the student's c and solved (about 0.79 for c = 0.16), and
  why c shrinks for a big target (memory-bound pass proportional to the weights' bytes; launch-bound
  small models make c close to 1).
"""),
md(r"""
6. In a batched server (lab 04), each request accepts a different number of drafts per step. What
   does that do to the batch, and to the paged KV cache of lab 05 (which blocks must be freed)?
7. Why does speculative decoding help most at small batch sizes, and less when the batch already
   fills the GPU's compute?
"""),
answer("batched_speculation_answer", 1, "questions 6 and 7", model=r"""
6. The requests advance by different amounts (1 to `gamma + 1` tokens) at every step, so their
   lengths and positions drift apart: the next verify pass is ragged (padding, or a kernel that takes
   per-request lengths), the step costs what its widest request costs, and per-request bookkeeping
   (positions, slot mappings, stop checks) changes every step. In the paged cache, every request must
   first get slots for all `gamma + 1` tokens it may keep (which can run out of blocks and force a
   preemption); after the check, each rolls back to its own accepted length: a block that holds only
   rejected positions is freed (its reference count drops and it returns to the pool), the last kept
   block keeps its stale slots past the length (overwritten later), and the block table is cut
   accordingly. The draft's cache is trimmed the same way.
7. At a small batch a decode step leaves the GPU's arithmetic idle (memory- or launch-bound), so
   checking `gamma + 1` tokens per request costs about one pass: the drafts ride on spare compute.
   A large batch already fills the compute (its intensity is past the ridge): verifying `gamma + 1`
   tokens per request multiplies the FLOPs of the step, rejected drafts are wasted arithmetic, the
   draft passes add more, and the weight reads that speculation amortizes are already shared by the
   batch, so the gain shrinks and can turn into a loss.
""", rubric=r"""
- 0.5: question 6: a ragged batch (different advances, lengths, padding or per-request handling) and,
  in the paged cache, slots reserved for all drafts then a per-request rollback that frees blocks
  holding only rejected positions.
- 0.5: question 7: small batches leave compute idle so verification is nearly free; at large batches
  the step is compute-bound and the extra (rejected) tokens cost real time.
"""),
md(r"""

## Going further

- **A bigger target**: with the hub, try `("smollm2-1.7b", "smollm2-135m")` in the real-pairs cell
  (a GPU helps). The bigger the gap between the two, the smaller the draft's cost $c$.
- **vLLM** supports draft models, n-gram (prompt lookup), Medusa, MLP speculators and EAGLE; its
  rejection sampler runs batched on the GPU, and the scheduler reserves KV slots for the drafts.
  **SGLang** uses EAGLE with a tree of drafts. **TGI** offers n-gram and Medusa speculation.
  **llama.cpp** has draft-model and lookup decoding.
- **Self-drafting**: Medusa (extra heads on the target predict tokens 2, 3, ... ahead), EAGLE 1-3
  (a one-layer draft on the target's hidden features, a reduced draft vocabulary like ours), LayerSkip
  (early exit trained into the model) and Draft & Verify (skipping layers of the target).
- **Token trees**: SpecInfer and EAGLE-2 check a tree of alternative drafts in one pass, with a
  tree-shaped attention mask, to accept more per pass.
- **Lookahead decoding** drafts n-grams from Jacobi iterations of the target itself.
- Papers: Leviathan, Kalman and Matias, *Fast Inference from Transformers via Speculative Decoding*
  (2023); Chen et al., *Accelerating Large Language Model Decoding with Speculative Sampling* (2023);
  Cai et al., *Medusa* (2024); Li et al., *EAGLE* (2024); Saxena, *Prompt Lookup Decoding* (2023).
"""),
]
