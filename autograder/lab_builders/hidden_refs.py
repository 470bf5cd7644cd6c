"""Hidden-test references that several labs share, as source text pasted into their hidden blocks.

They live only in the instructors' sources (nbgrader strips hidden blocks from releases), and they
never call `course.engine` or the student's code: that is what makes them independent.

- `_ref_greedy(m, prompt, n, eos=None)`: greedy tokens with no cache at all, the whole sequence
  through `m.forward` at every step (labs 04, 05, 08).
- `_tiny(family, seed, n_kv_head=None)`: a 2-layer random decoder with large weights, so its top
  tokens are decisive (no near-ties for float sums to flip), on the lab's device (`env.device`).
"""


def greedy_and_tiny(max_seq_len: int) -> str:
    """The text of `_ref_greedy` and `_tiny`, for models of at most `max_seq_len` positions."""
    return r'''
def _ref_greedy(m, prompt, n, eos=None):
    # new tokens of `prompt` alone, no cache: the whole sequence through m.forward every step
    out = []
    with torch.no_grad():
        for _ in range(n):
            x = torch.tensor([list(prompt) + out], device=m.device)
            out.append(int(m(x, torch.arange(x.shape[1], device=m.device)[None])[0, -1].argmax()))
            if out[-1] == eos:
                break
    return out
def _tiny(family, seed, n_kv_head=None):
    torch.manual_seed(seed)
    if n_kv_head is None:
        n_kv_head = 2 if family == "llama" else 4
    cfg = course.ModelConfig(family=family, vocab_size=64, n_layer=2, n_head=4, n_kv_head=n_kv_head,
                             d_model=32, d_ff=64, max_seq_len=MAX_SEQ_LEN)
    m = course.Decoder(cfg).eval().to(env.device)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    return m
'''.strip("\n").replace("MAX_SEQ_LEN", str(max_seq_len))
