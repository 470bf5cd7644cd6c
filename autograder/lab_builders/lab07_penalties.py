"""Lab 07, section 5 and Problem 6: repetition, frequency and presence penalties and logit bias, what a
server adds before the sampler, in vLLM's order; (a) the penalties as a logits processor, (b) the
server's sampler (bias, penalties, then Problem 5's sampler); a greedy loop broken by them."""
from autograder.authoring import code, locked, md, solution, tests

# The independent reference of the hidden tests: one row at a time, plain Python over token ids, in
# float64, following the definitions (CTRL's repetition penalty; OpenAI's frequency and presence).
HIDDEN_PENALTIES = r'''
def _ref_penalized(row, prompt, output, r, f, p, bias=None):
    # row: one row of logits (list of floats) -> the row after logit bias, repetition, frequency, presence
    z = [float(v) for v in row]
    for t, v in (bias or {}).items():
        z[t] += v
    for t in set(prompt) | set(output):                    # repetition: each token seen anywhere, once
        z[t] = z[t] / r if z[t] > 0 else z[t] * r
    for t in set(output):
        c = output.count(t)                                # frequency: per occurrence in the output
        z[t] -= f * c + p                                  # presence: once, for occurring at all
    return z
def _far(got_row, ref):
    # the tokens where a row of your logits differs from the reference (float32 against float64:
    # float32 keeps about 7 significant digits, so 1e-5 relative is far beyond its rounding)
    got = got_row.double().cpu().tolist()
    return [t for t in range(len(ref)) if abs(got[t] - ref[t]) > 1e-5 * (1 + abs(ref[t]))]
def _ref_argmax(z):
    best = max(range(len(z)), key=lambda i: z[i])
    margin = z[best] - max(v for i, v in enumerate(z) if i != best)
    return best, margin
'''.strip("\n")

CELLS = [
md(r"""
## 5. Penalties: what a server adds before the sampler

Section 1's greedy text fell into a loop ("I'm not sure what to do with it." again and again, on a
CPU). Small models do this often. Sampling makes a loop rarer, not impossible, and a request at
temperature 0 (what many clients send, to get the same answer every time) has no randomness at all.
So serving APIs offer a direct remedy: **penalties** that lower the logits of tokens the text already
holds, before the sampler of Problem 5 sees them. They are fields of the request, and each is off by
default:

| request field | from | range (off) | what it does to a token's logit $z$ |
|---|---|---|---|
| `repetition_penalty` $r$ | vLLM and HF, after CTRL (Keskar et al., 2019) | $r > 0$ (1) | a token seen in the **prompt or the output**: $z / r$ if $z > 0$, else $z \cdot r$ |
| `frequency_penalty` $f$ | OpenAI | $[-2, 2]$ (0) | $z - f \cdot c$, where $c$ is the token's count in the **output** so far |
| `presence_penalty` $p$ | OpenAI | $[-2, 2]$ (0) | $z - p$ if $c > 0$: once, however often the token occurs |
| `logit_bias` | OpenAI | token id $\to [-100, 100]$ (none) | $z + \text{bias}$: $-100$ practically bans a token, $+100$ practically forces it |

Each detail has a reason, and the tests check all of them:

- **Repetition scales, by the sign of the logit.** Dividing a positive logit by $r > 1$ lowers it. Dividing a
  negative one would *raise* it toward 0 and make the token more likely, so a negative logit is multiplied
  instead. Both moves push a seen token down for $r > 1$ (and up for $r < 1$). It is not a subtraction: it
  scales the logit.
- **Repetition counts the prompt, once per token.** A token seen once or ten times, in the prompt or in the
  output, is divided once: the question is whether it appeared at all. Counting the prompt stops the model
  from copying its input back. It is also the penalty's weak spot: every common token of the prompt
  ("the", ".", "I") is pushed down too.
- **Frequency and presence count the output only.** OpenAI defines them on the tokens sampled so far, in one
  line of its documentation: `mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence`.
  Frequency grows with every repeat, so a loop pays more each time round. Presence is a fixed price for
  having used a token at all, which nudges the text toward new words. Negative values *reward* repeats.

**The order** is vLLM's (its V1 sampler, `vllm/v1/sample/sampler.py`), and each step of it changes the
result:

```
logit bias -> repetition (prompt + output) -> frequency, presence (output counts)
    -> greedy rows: argmax    other rows: temperature -> min-p -> top-k -> top-p -> draw (Problem 5)
```

1. **Before the greedy argmax.** Problem 5's sampler takes the greedy rows' argmax of the logits it is
   given. Penalties applied after that would do nothing for requests at temperature 0, the ones that loop
   the most. So the penalties come first, and a greedy row takes the argmax of the penalized logits: they
   change greedy text. (vLLM's sampler runs the logit bias and the penalties before its greedy step for
   this reason: they can change a greedy choice.)
2. **Before temperature.** The sampler then divides by the temperature: $(z - f c) / \tau$. The penalty is
   scaled together with the model's scores, so `frequency_penalty=0.5` weighs the same against the
   model's preferences at every temperature. Applied after, $z / \tau - f c$, it would count for less at a
   low temperature (at $\tau = 0.5$ the scores double, the penalty does not) and for more at a high one.
   (A repetition penalty commutes with a temperature, since both scale. The subtractions do not.)
3. **Bias, then repetition, then frequency and presence.** These do not commute either. A token with
   $z = 1$, a bias of $+3$ and $r = 2$ gets $(1 + 3) / 2 = 2$ in this order, and $1/2 + 3 = 3.5$ in the other.

The course's server (`python -m course.serve`, lab 11) takes these fields in its request body, as vLLM's
server does, and its sampler (`course.engine.sampler`) applies them in this order. (OpenAI's API has no
`repetition_penalty`; vLLM adds it, with HF's meaning.) JSON keys are strings, so `logit_bias` names its
token ids as strings. Token 2 (`<|im_end|>`) ends SmolLM2's texts, so this request cannot stop early:

```bash
curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "I like to eat",
     "max_tokens": 48, "temperature": 0, "frequency_penalty": 0.5, "presence_penalty": 0.3,
     "repetition_penalty": 1.1, "logit_bias": {"2": -100}}'
```

## Problem 6: Penalties, in vLLM's order (3 points)

Two parts, each with its own tests: (a) the three penalties as a logits processor, (b) the server's
sampler, which puts the logit bias, your penalties and your sampler of Problem 5 in vLLM's order.

**Deliverable (a), 2 points:** `apply_penalties(logits, prompts, outputs, repetition, frequency, presence)`
takes `logits` `(B, V)`, each row's token ids so far (`prompts[b]` and `outputs[b]`: lists of ints, maybe
empty, tokens may repeat) and one setting per row (`(B,)` tensors), and returns new logits `(B, V)`. In
row `b`: first the repetition penalty `repetition[b]` on every token of `prompts[b]` or `outputs[b]`, then
minus `frequency[b]` times each token's count in `outputs[b]`, then minus `presence[b]` once for each token
that occurs in `outputs[b]`. It never modifies its input.

Build two `(B, V)` tensors first: each token's count in the output (`Tensor.index_add_` adds ones at the
token ids) and whether it was seen in the prompt or the output. Then a few whole-batch lines
(`torch.where`, arithmetic with `(B, 1)` settings) do the rest.
"""),
solution("penalties", r'''
def apply_penalties(logits: torch.Tensor, prompts: list[list[int]], outputs: list[list[int]],
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """Row b: repetition over prompts[b] + outputs[b], then frequency and presence over outputs[b]."""
    B, V = logits.shape
    if not len(prompts) == len(outputs) == B:
        raise ValueError(f"need one prompt and one output per row: B={B}, got {len(prompts)} and {len(outputs)}")
    ### BEGIN SOLUTION
    d = logits.device
    counts = torch.zeros(B, V, dtype=logits.dtype, device=d)              # (B, V): each token's count in the output
    seen = torch.zeros(B, V, dtype=torch.bool, device=d)                  # (B, V): in the prompt or the output
    for b in range(B):
        out = torch.tensor(list(outputs[b]), dtype=torch.long, device=d)
        counts[b].index_add_(0, out, torch.ones(len(out), dtype=logits.dtype, device=d))
        seen[b, torch.tensor(list(prompts[b]) + list(outputs[b]), dtype=torch.long, device=d)] = True
    r, f, p = (torch.as_tensor(s, dtype=logits.dtype, device=d)[:, None] for s in (repetition, frequency, presence))
    z = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)   # down for r > 1, whatever the sign
    z = z - f * counts                                                    # frequency: f per occurrence in the output
    return z - p * (counts > 0)                                           # presence: p once, if it occurs at all
    ### END SOLUTION
'''),
tests("penalties_tests", 2, r"""
from course.expect import Cases, expect_tensor

def penalized(z, prompts, outputs, r, f, p, what=None):
    '''Your apply_penalties, its answer checked first: new (B, V) logits of z's dtype, on z's device.'''
    setting = lambda v: torch.tensor(v, dtype=torch.float32, device=dev)
    what = what or f"apply_penalties(logits, prompts={prompts}, outputs={outputs}, repetition={r}, frequency={f}, presence={p})"
    return expect_tensor(apply_penalties(z, prompts, outputs, setting(r), setting(f), setting(p)), what, dtype=z.dtype,
                         shape=tuple(z.shape), device=dev)

cases = Cases(points=2)        # partial credit: each case below is worth its share of the points
z = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]], device=dev)
with cases("repetition 2 divides a seen positive logit"):
    got = penalized(z.clone(), [[0, 5]], [[]], [2.0], [0.0], [0.0])
    assert torch.allclose(got, torch.tensor([[1.0, -1.0, 0.5, 3.0, -2.0, 0.5]], device=dev)), \
        "repetition 2, tokens 0 and 5 in the prompt: their positive logits are divided by 2 (2 -> 1, 1 -> 0.5); unseen tokens stay"
with cases("repetition 2 multiplies a seen negative logit"):
    got = penalized(z.clone(), [[]], [[1, 4]], [2.0], [0.0], [0.0])
    assert torch.allclose(got, torch.tensor([[2.0, -2.0, 0.5, 3.0, -4.0, 1.0]], device=dev)), \
        ("repetition 2, tokens 1 and 4 in the output: a negative logit is multiplied by r (-1 -> -2): "
         "dividing it would raise it to -0.5 and make the token more likely")
with cases("frequency 0.5 counts the output only"):
    got = penalized(z.clone(), [[5]], [[3, 3, 0]], [1.0], [0.5], [0.0])
    assert torch.allclose(got[0, 5], z[0, 5]), "token 5 is only in the prompt: frequency counts the output only, so it stays"
    assert torch.allclose(got, torch.tensor([[1.5, -1.0, 0.5, 2.0, -2.0, 1.0]], device=dev)), \
        "frequency 0.5 minus 0.5 times the count in the output: token 3 (twice) 3 -> 2, token 0 (once) 2 -> 1.5"
with cases("presence 0.5 is paid once per token"):
    got = penalized(z.clone(), [[5]], [[3, 3, 0]], [1.0], [0.0], [0.5])
    assert torch.allclose(got, torch.tensor([[1.5, -1.0, 0.5, 2.5, -2.0, 1.0]], device=dev)), \
        ("presence 0.5: minus 0.5 once for each token in the output, however often (token 3, twice: 3 -> 2.5); "
         "the prompt's token 5 is not counted")
with cases("the input is left alone"):
    given = z.clone()
    penalized(given, [[0]], [[1, 3]], [1.5], [0.5], [0.5])
    assert torch.equal(given, z), "do not modify the input logits"
### BEGIN HIDDEN TESTS
""" + HIDDEN_PENALTIES + r"""
one = torch.tensor([[6.0, -3.0, 4.0, -1.0, 2.0, 0.5, 3.0, -2.5]], device=dev)
row = one[0].tolist()
def _case(name, prompt, output, r, f, p, why):
    with cases(name):
        got = penalized(one.clone(), [prompt], [output], [r], [f], [p])
        bad = _far(got[0], _ref_penalized(row, prompt, output, r, f, p))
        assert not bad, f"{why} (tokens {bad} differ)"
_case("repetition scales a logit, it does not subtract", [], [0], 1.5, 0.0, 0.0,
      "repetition 1.5 on a seen logit of 6: 6 / 1.5 = 4 (the penalty divides, it is not 6 - 1.5)")
_case("repetition multiplies negative logits", [], [1, 3], 1.5, 0.0, 0.0,
      "repetition 1.5 on seen logits -3 and -1: multiplied, -4.5 and -1.5 (dividing a negative logit raises it)")
_case("repetition counts the prompt", [2, 5], [], 2.0, 0.0, 0.0,
      "repetition 2 on tokens that are only in the prompt: penalized too (4 -> 2, 0.5 -> 0.25)")
_case("repetition counts the output", [], [4, 6], 2.0, 0.0, 0.0,
      "repetition 2 on tokens that are only in the output: penalized (2 -> 1, 3 -> 1.5)")
_case("repetition applies once, however often a token occurs", [0, 0, 6], [0, 6, 6, 0], 2.0, 0.0, 0.0,
      "repetition 2 on token 0, seen 4 times: divided once (6 -> 3, not 6 / 2**4)")
_case("frequency ignores the prompt", [2, 2, 2, 6], [6], 1.0, 1.0, 0.0,
      "frequency 1: token 2 is only in the prompt and stays; token 6, 3 times in the prompt and once in the output, "
      "loses 1 (the prompt is not counted)")
_case("frequency counts every occurrence in the output", [], [4] * 50 + [5], 1.0, 0.1, 0.0,
      "frequency 0.1 on token 4, 50 times in the output: minus 5.0")
_case("presence is not scaled by the count", [], [0, 0, 0, 0, 3], 1.0, 0.0, 0.75,
      "presence 0.75: minus 0.75 once per token in the output, for token 0 too, which occurs 4 times")
_case("presence ignores the prompt", [1, 2], [], 1.0, 0.0, 0.75,
      "presence 0.75: tokens only in the prompt do not pay it")
_case("repetition first, then frequency and presence", [], [6], 2.0, 0.5, 0.5,
      "repetition 2, frequency 0.5, presence 0.5 on token 6 (logit 3, once in the output): 3 / 2 - 0.5 - 0.5 = 0.5 "
      "(the repetition divides the model's logit, before the subtractions)")
_case("repetition below 1 rewards seen tokens", [], [0, 2], 0.5, 0.0, 0.0,
      "repetition 0.5: seen logits 6 and 4 become 12 and 8")
_case("negative frequency and presence reward repeats", [], [3, 5], 1.0, -0.5, -1.0,
      "frequency -0.5, presence -1: tokens 3 and 5 (once each in the output) gain 0.5 + 1 = 1.5")
_case("empty prompt and output: nothing to penalize", [], [], 2.0, 1.0, 1.0,
      "with no tokens so far, nothing is penalized")
with cases("all off: the row is unchanged"):
    assert torch.equal(penalized(one.clone(), [[0, 1, 2]], [[3, 3, 4]], [1.0], [0.0], [0.0]), one), \
        "repetition 1, frequency 0 and presence 0 are off: the row is unchanged"
# a batch: every row its own history and settings
g = torch.Generator().manual_seed(6)                         # test data drawn on the CPU: the same numbers on every device
V = 40
Z = torch.randn(6, V, generator=g).to(dev) * 3
prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (7, 5, 9, 4, 0, 6)]
outputs = [torch.randint(0, 12, (n,), generator=g).tolist() for n in (10, 8, 12, 6, 9, 0)]   # ids below 12: repeats
rs, fs, ps = [1.3, 1.0, 0.8, 2.0, 1.0, 1.5], [0.5, 0.0, -0.5, 0.0, 1.2, 0.3], [0.4, 0.0, 0.0, 1.0, 0.0, -0.6]
for b in range(6):
    with cases(f"row {b} of a batch: repetition {rs[b]}, frequency {fs[b]}, presence {ps[b]}"):
        got = penalized(Z.clone(), prompts, outputs, rs, fs, ps, what="apply_penalties(a batch of 6)")
        ref = _ref_penalized(Z[b].tolist(), prompts[b], outputs[b], rs[b], fs[b], ps[b])
        bad = _far(got[b], ref)
        assert not bad, (f"row {b}: wrong logits at tokens {bad[:5]}, e.g. token {bad[0]} ({prompts[b].count(bad[0])} times in "
                         f"the prompt, {outputs[b].count(bad[0])} in the output): got {got[b, bad[0]].item():.4f}, expected "
                         f"{ref[bad[0]]:.4f}. Row b uses prompts[b], outputs[b] and the settings of row b only")
with cases("a batch: the input is left alone"):
    given = Z.clone()
    penalized(given, prompts, outputs, rs, fs, ps, what="apply_penalties(a batch of 6)")
    assert torch.equal(given, Z), "apply_penalties must not modify its input"
with cases("a real vocabulary: 49,152 tokens"):
    big = torch.randn(2, 49152, generator=g).to(dev) * 4
    hist = [(torch.randint(0, 49152, (60,), generator=g).tolist(), torch.randint(0, 300, (200,), generator=g).tolist()),
            (torch.randint(0, 49152, (30,), generator=g).tolist(), [49151, 49151, 0])]
    got = penalized(big.clone(), [h[0] for h in hist], [h[1] for h in hist], [1.2, 1.1], [0.4, 0.2], [0.3, 0.1],
                    what="apply_penalties(logits (2, 49152), ...)")
    for b in range(2):
        bad = _far(got[b], _ref_penalized(big[b].tolist(), hist[b][0], hist[b][1], [1.2, 1.1][b], [0.4, 0.2][b], [0.3, 0.1][b]))
        assert not bad, f"row {b} of a (2, 49152) batch: wrong logits at tokens {bad[:5]} (the first and last ids too?)"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
**Part (b).** A request's settings, as the server reads them: the sampler's of Problem 5, plus the request
fields of this section (a small version of vLLM's `SamplingParams`, which holds them all):
"""),
locked("server_params", r'''
from dataclasses import field


@dataclass(frozen=True)
class ServerParams(SamplingParams):
    """One request's settings: the sampler's (Problem 5), plus the penalties and logit bias of its body."""
    repetition_penalty: float = 1.0      # vLLM's extension, > 0; 1: off
    frequency_penalty: float = 0.0       # OpenAI, [-2, 2]; 0: off
    presence_penalty: float = 0.0        # OpenAI, [-2, 2]; 0: off
    logit_bias: dict[int, float] | None = field(default=None, hash=False)   # OpenAI: token id -> added to its logit

    def __post_init__(self):
        super().__post_init__()
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {getattr(self, name)}")
'''),
md(r"""
**Deliverable (b), 1 point:** `sample_penalized(logits, params, history, generators=None)` takes `logits`
`(B, V)`, one `ServerParams` per row, `history` with one `(prompt_ids, output_ids)` pair per row, and the
generators of Problem 5, and returns `(B,)` `torch.long` token ids: each row's `logit_bias` added to its
logits, then your `apply_penalties` with each row's settings, then your `sample` (which takes the greedy
rows' argmax, and applies temperature and truncation to the others). It never modifies `logits`. (Careful:
`logits.float()` returns `logits` itself when it is already float32.) The tests run it on the course's
`apply_penalties` and sampler, so a mistake in part (a) or in Problem 5 costs only their own points.
"""),
solution("penalized_sampler", r'''
def sample_penalized(logits: torch.Tensor, params: list[ServerParams], history: list[tuple[list[int], list[int]]],
                     generators: list[torch.Generator | None] | None = None) -> torch.Tensor:
    """The server's sampler: logit bias, then the penalties, then Problem 5's sampler (greedy rows included)."""
    B = logits.shape[0]
    if len(params) != B or len(history) != B:
        raise ValueError(f"need one ServerParams and one (prompt, output) pair per row: B={B}, "
                         f"got {len(params)} params and {len(history)} pairs")
    ### BEGIN SOLUTION
    d = logits.device
    z = logits.float().clone()                                            # (B, V): a copy, never the input
    for b, q in enumerate(params):
        if q.logit_bias:                                                  # 1. the bias, added
            ids = torch.tensor(list(q.logit_bias), dtype=torch.long, device=d)
            z[b, ids] += torch.tensor(list(q.logit_bias.values()), dtype=z.dtype, device=d)
    settings = [torch.tensor([getattr(q, name) for q in params], dtype=torch.float32, device=d)
                for name in ("repetition_penalty", "frequency_penalty", "presence_penalty")]
    z = apply_penalties(z, [list(h[0]) for h in history], [list(h[1]) for h in history], *settings)   # 2. the penalties
    return sample(z, params, generators)                                  # 3. greedy argmax, or temperature -> ... -> draw
    ### END SOLUTION
'''),
tests("penalized_sampler_tests", 1, r"""
from course.engine import logits as course_logits
from course.engine.penalties import apply_penalties as course_penalties
from course.engine.sampler import sample as course_sample
from course.expect import Cases, expect_tensor, substituted

# Graded on its own: here your sample_penalized runs on the course's apply_penalties (part (a)) and the
# course's sampler and processors (Problems 1-5), so a mistake there costs only their own points.
def plain_sample(logits, params, generators=None):
    '''The course's sampler of Problem 5, given the sampler's settings of each row.'''
    return course_sample(logits, [SamplingParams(q.temperature, q.top_k, q.top_p, q.min_p, q.seed) for q in params], generators)
given_parts = dict(apply_penalties=course_penalties, sample=plain_sample, apply_temperature=course_logits.apply_temperature,
                   apply_top_k=course_logits.apply_top_k, apply_top_p=course_logits.apply_top_p,
                   apply_min_p=course_logits.apply_min_p)

def picked(z, params, history, generators=None):
    '''Your sample_penalized, its answer checked first: (B,) torch.long token ids on the logits' device.'''
    return expect_tensor(sample_penalized(z, params, history, generators), "sample_penalized(logits, params, history)",
                         dtype=torch.long, shape=(z.shape[0],), device=dev)

cases = Cases(points=1)        # partial credit: each case below is worth its share of the points
with substituted(globals(), **given_parts):
    z = torch.tensor([[2.0, 1.8, 0.0, -1.0]], device=dev)
    with cases("all off: the sampler's choice"):
        assert picked(z.clone(), [ServerParams(temperature=0.0)], [([3], [0])]).tolist() == [0], \
            "no penalty and no bias: a greedy row takes the argmax (token 0)"
    with cases("a greedy row sees the penalties"):
        assert picked(z.clone(), [ServerParams(temperature=0.0, frequency_penalty=0.5)], [([3], [0])]).tolist() == [1], \
            ("temperature 0, frequency 0.5, token 0 once in the output: 2.0 - 0.5 = 1.5 < 1.8, so token 1. Greedy rows take "
             "the argmax of the penalized logits: apply the penalties before the sampler")
    with cases("logit_bias"):
        assert picked(z.clone(), [ServerParams(temperature=0.0, logit_bias={2: 5.0})], [([], [])]).tolist() == [2], \
            "logit_bias {2: 5.0} adds 5 to token 2's logit (0 -> 5), and the greedy row takes it"
    with cases("the logits are left alone"):
        given = z.clone()
        picked(given, [ServerParams(temperature=0.0, frequency_penalty=1.0, logit_bias={3: 2.0})], [([1], [0])])
        assert torch.equal(given, z), "do not modify the logits (logits.float() is logits itself when it is float32: clone it)"
### BEGIN HIDDEN TESTS
""" + HIDDEN_PENALTIES + r"""
with substituted(globals(), **given_parts):
    with cases("penalties before temperature: frequency"):
        got = picked(torch.tensor([[3.0, 2.6, 0.0, 0.0]], device=dev),
                     [ServerParams(temperature=0.5, top_k=1, frequency_penalty=0.5)], [([], [0])]).item()
        assert got == 1, ("temperature 0.5, top_k 1, frequency 0.5 on token 0 (once in the output): (3.0 - 0.5) / 0.5 = 5.0 "
                          "< 2.6 / 0.5 = 5.2, so token 1. Penalties come before temperature (not 3.0 / 0.5 - 0.5)")
    with cases("penalties before temperature: presence"):
        got = picked(torch.tensor([[3.0, 2.0, 0.0, 0.0]], device=dev),
                     [ServerParams(temperature=2.0, top_k=1, presence_penalty=0.8)], [([], [0, 0])]).item()
        assert got == 0, ("temperature 2, top_k 1, presence 0.8 on token 0: (3.0 - 0.8) / 2 = 1.1 > 2.0 / 2 = 1.0, so token 0. "
                          "Penalties come before temperature (not 3.0 / 2 - 0.8)")
    with cases("logit bias before the repetition penalty"):
        got = picked(torch.tensor([[1.0, 2.2, 0.0]], device=dev),
                     [ServerParams(temperature=0.0, repetition_penalty=2.0, logit_bias={0: 3.0})], [([0], [])]).item()
        assert got == 1, ("bias +3 on token 0 (logit 1, in the prompt), repetition 2: (1 + 3) / 2 = 2.0 < 2.2, so token 1. "
                          "The bias comes first, then the penalties (not 1 / 2 + 3)")
    with cases("logit_bias -100 bans a token"):
        got = picked(torch.tensor([[9.0, 8.0, 0.0]], device=dev), [ServerParams(temperature=0.0, logit_bias={0: -100.0})],
                     [([], [])]).item()
        assert got == 1, "logit_bias -100 on the top token: the next best wins"
    # a batch of greedy and (top_k 1) sampled rows, each with its own settings and history
    g = torch.Generator().manual_seed(7)                     # test data drawn on the CPU: the same numbers on every device
    Zb = torch.randn(5, 30, generator=g).to(dev) * 2
    top = Zb.argmax(-1).tolist()
    hist = [([top[0], 3], [top[0], 5]), ([], [top[1], top[1], 2]), ([top[2]], []), ([4, 4], [top[3], 1]), ([], [top[4]])]
    settings = [dict(temperature=0.0, repetition_penalty=1.8), dict(temperature=0.0, frequency_penalty=1.5),
                dict(temperature=0.9, top_k=1, repetition_penalty=3.0, logit_bias={7: 1.0}),
                dict(temperature=0.0, presence_penalty=2.0, frequency_penalty=0.5),
                dict(temperature=0.0, logit_bias={top[4]: 4.0}, presence_penalty=1.0)]
    qs = [ServerParams(**s) for s in settings]
    shown = [", ".join(f"{k}={v}" for k, v in s.items()) for s in settings]
    want = []
    for b, q in enumerate(qs):
        best, margin = _ref_argmax(_ref_penalized(Zb[b].tolist(), hist[b][0], hist[b][1], q.repetition_penalty,
                                                  q.frequency_penalty, q.presence_penalty, q.logit_bias))
        assert margin > 1e-3, "self-check: no near-tie in the test data"
        want.append(best)
    assert sum(w != t for w, t in zip(want, top)) >= 3, "self-check: the penalties change most rows' choice"
    for b, q in enumerate(qs):
        with cases(f"row {b} of a batch: {shown[b]}"):
            got = picked(Zb.clone(), qs, hist)
            assert got[b].item() == want[b], (f"row {b} (prompt {hist[b][0]}, output {hist[b][1]}): got token {got[b].item()}, "
                                              f"expected {want[b]}. Row b's bias, then its penalties on its own history, "
                                              f"then the sampler")
    with cases("a batch: the logits are left alone"):
        given = Zb.clone()
        picked(given, qs, hist)
        assert torch.equal(given, Zb), "sample_penalized must not modify the logits"
    with cases("each row's generator is passed on"):
        flat = torch.zeros(2, 40, device=dev)
        twins = [torch.Generator(device=dev).manual_seed(9), torch.Generator(device=dev).manual_seed(9)]
        pair = [ServerParams(frequency_penalty=0.1)] * 2
        draws = [picked(flat, pair, [([], [5])] * 2, twins).tolist() for _ in range(25)]
        assert all(a == b for a, b in draws), "two rows with equally seeded generators draw equal tokens: pass generators on"
        assert len({a for a, _ in draws}) > 5, "each generator must advance with every draw"
### END HIDDEN TESTS
cases.score()
"""),
md(r"""
### See it: a greedy loop, and the penalties that break it

Section 1's prompt, greedy every time: its text of section 1 first, then one request per row, each
with a penalty, all in one batch. The `generate` loop of section 1 only hands `pick` the logits, so
`pick` keeps each row's output so far itself: the penalties need it.
"""),
code(r"""
def penalized_generate(model, prompts, params, max_new_tokens, eos_token_id=None):
    '''generate() with the server's fields: pick() keeps each row's output so far, for the penalties.'''
    outputs = [[] for _ in prompts]
    generators = [None if q.seed is None else torch.Generator(device=model.device).manual_seed(q.seed) for q in params]
    def pick(logits):
        tokens = sample_penalized(logits, params, list(zip(prompts, outputs)), generators)
        for out, t in zip(outputs, tokens.tolist()):
            out.append(t)
        return tokens
    return generate(model, prompts, max_new_tokens, pick, eos_token_id)

rows = {"frequency_penalty=0.5": ServerParams(temperature=0.0, frequency_penalty=0.5),
        "presence_penalty=0.5": ServerParams(temperature=0.0, presence_penalty=0.5),
        "repetition_penalty=1.1": ServerParams(temperature=0.0, repetition_penalty=1.1),
        "repetition_penalty=1.3": ServerParams(temperature=0.0, repetition_penalty=1.3)}
n_new = env.pick(64, 24, cpu=48)                     # new tokens per row
penalized_texts = penalized_generate(model, [story] * len(rows), list(rows.values()), n_new, eos_token_id=EOS)
for name, out in [("greedy (section 1)", greedy_story[:n_new])] + list(zip(rows, penalized_texts)):
    print(f"{name:>22}: repetition {repetition(out):.2f}  {tokenizer.decode(out)!r}")
"""),
md(r"""
Read the rows. The first repeats section 1's loop. Frequency and presence penalties of 0.5 change a
token where the loop would start again, and the text moves on; over a long run a longer loop can still
form, since half a logit is little against a phrase the model finds ever more likely. A gentle repetition
penalty (1.1) changes the text the most. A strong one (1.3) can derail it: it also lowers every token of
the prompt and every common token used so far (".", "I", "a"), until an odd continuation or the end of
the text wins. That is why every penalty is off by default, and why the usual advice is a repetition
penalty close to 1 (CTRL, which introduced it, used 1.2 with greedy decoding). Penalties treat a symptom:
sampling with top-p, and larger models, loop less in the first place.
"""),
]
