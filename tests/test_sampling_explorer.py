"""The distribution explorer (lab 07) without a browser: survivors, renormalized numbers, states, bad input."""
import math
import re

import ipywidgets as widgets
import pytest
import torch

from course.widgets.sampling_explorer import sampling_explorer, survivors

WORDS = ["Paris", " the", " a", " London", "\n", " Rome"]
PROBS = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]
LOGITS = torch.tensor(PROBS).log()


def process(z, temperature, top_k, top_p):
    """A reference written here (the course package holds no answer): temperature, top-k, top-p."""
    z = z / temperature
    if 0 < top_k < z.shape[0]:
        z = z.masked_fill(z < z.sort(descending=True).values[top_k - 1], float("-inf"))
    if top_p < 1:
        p = z.softmax(-1)
        srt, order = p.sort(descending=True)
        drop = (srt.cumsum(0) - srt) >= top_p
        z = z.clone()
        z[order[drop]] = float("-inf")
    return z


def make(**kw):
    return sampling_explorer(LOGITS, lambda i: WORDS[i], process, prompt="The capital of France is", **kw)


def shown_after(html, before):
    """The renormalized probability (3 decimals) on the row that shows `before` -> it."""
    found = re.search(rf"{re.escape(before)} → (\d\.\d{{3}})", html)
    assert found, f"no row shows {before} → a probability"
    return float(found[1])


def test_default_grid_and_controls():
    w = make()
    assert w.names == ["temperature", "top_k", "top_p"]
    assert len(w.states) == 5 * 4 * 4, "every combination of the three controls is drawn ahead of time"
    assert all(isinstance(c, widgets.SelectionSlider) for c in w.controls.values())
    assert w.controls["temperature"].value == 1.0, "opens at temperature 1: the model's own distribution"
    assert w.controls["top_k"].value == 0 and w.controls["top_p"].value == 1.0, "opens with no truncation"
    assert len(w.links) == 1 + 5 + 5 * 4, "one jslink per stack"


def test_untruncated_state_keeps_everything():
    html = make().html_at(temperature=1.0, top_k=0, top_p=1.0)
    assert "6 of 6 tokens survive" in html and "held 100.0% of the probability" in html
    assert "0.400 → 0.400" in html and "→ cut" not in html and "line-through" not in html
    assert "The capital of France is" in html and "␣the" in html and "↵" in html, "whitespace is made visible"


def test_truncation_renormalizes_the_survivors():
    w = make()
    html = w.html_at(temperature=1.0, top_k=3, top_p=1.0)
    assert "3 of 6 tokens survive" in html and "held 80.0%" in html and "multiplies each by 1.25" in html
    # 0.3125 and 0.1875 sit on ties at 3 decimals: float32's last bit (softmax kernels differ by CPU) picks the digit,
    # so compare the numbers to within the display's half-step; no renormalization would show 0.250 and 0.150
    got = [shown_after(html, before) for before in ("0.400", "0.250", "0.150")]
    assert got == pytest.approx([0.5, 0.3125, 0.1875], abs=5e-4 + 1e-6), got
    assert html.count("→ cut") == 3 and html.count("line-through") == 3, "cut tokens are struck out"
    # top-p keeps the crossing token: 0.4 + 0.25 = 0.65 < 0.7, so " a" (0.15) survives as well. (Not top_p=0.8:
    # 0.4 + 0.25 + 0.15 lands on 0.8 give or take float32's last bit, which differs between CPU kernels.)
    assert "3 of 6 tokens survive" in make(top_ps=(1.0, 0.7)).html_at(temperature=1.0, top_k=0, top_p=0.7)
    assert "1 of 6 tokens survive" in w.html_at(temperature=1.0, top_k=0, top_p=0.5) or \
        "2 of 6 tokens survive" in w.html_at(temperature=1.0, top_k=0, top_p=0.5)


def test_temperature_changes_the_light_bars_not_the_ranking():
    w = make(top_ks=(0,), top_ps=(1.0,))
    cold, hot = w.html_at(temperature=0.3, top_k=0, top_p=1.0), w.html_at(temperature=2.0, top_k=0, top_p=1.0)
    assert cold != hot
    top_cold = (0.4 ** (1 / 0.3)) / sum(p ** (1 / 0.3) for p in PROBS)
    assert f"{top_cold:.3f} → {top_cold:.3f}" in cold
    assert cold.index("Paris") < cold.index("␣the") and hot.index("Paris") < hot.index("␣the")


def test_other_tokens_row():
    w = make(rows=3, temperatures=(1.0,), top_ks=(0, 2), top_ps=(1.0,))
    assert len(w.states) == 2
    html = w.html_at(temperature=1.0, top_k=0, top_p=1.0)
    assert "3 others (3 kept)" in html and "0.200 → 0.200" in html, "the last row sums the rest of the vocabulary"
    assert "3 others (0 kept)" in w.html_at(temperature=1.0, top_k=2, top_p=1.0)


def test_survivors_sum_to_one():
    before, after, kept = survivors(process, LOGITS, 0.7, 2, 1.0)
    assert math.isclose(before.sum().item(), 1, abs_tol=1e-6) and math.isclose(after.sum().item(), 1, abs_tol=1e-6)
    assert (after > 0).sum() == 2 and kept.tolist() == [True, True, False, False, False, False]


def test_underflowing_probabilities_are_kept_not_cut():
    # at temperature 0.3 the last token's logit is -400 below the top: its float32 probability is 0,
    # but no truncation is on, so it survives (survival is read from the logits, not the probabilities)
    logits = torch.tensor([0.0, -1.0, -2.0, -120.0])
    before, after, kept = survivors(process, logits, 0.3, 0, 1.0)
    assert after[3].item() == 0.0, "self-check: the probability underflows"
    assert kept.all(), "top-k and top-p off: every token survives"
    w = sampling_explorer(logits, lambda i: f"t{i}", process, temperatures=(0.3,), top_ks=(0, 2), top_ps=(1.0,))
    html = w.html_at(temperature=0.3, top_k=0, top_p=1.0)
    assert "4 of 4 tokens survive" in html and "→ cut" not in html and "line-through" not in html
    assert "2 of 4 tokens survive" in w.html_at(temperature=0.3, top_k=2, top_p=1.0)


@pytest.mark.parametrize("kwargs, message", [
    (dict(logits=torch.zeros(2, 5)), r"shape \(V,\)"),
    (dict(logits=torch.tensor([1.0, float("nan")])), "finite"),
    (dict(logits=[1.0, 2.0]), "float tensor"),
    (dict(temperatures=(0.0, 1.0)), "temperatures must hold numbers positive"),
    (dict(top_ks=(0, -1)), "top_ks must hold numbers integers"),
    (dict(top_ps=(1.0, 1.5)), r"top_ps must hold numbers in \(0, 1\]"),
    (dict(top_ps=(0.9, 0.9)), "duplicates"),
    (dict(rows=0), "rows must be an int"),
    (dict(rows=True), "rows must be an int"),
    (dict(process=lambda z, t, k, p: torch.full_like(z, float("-inf")) if k else z), "removed every token"),
    (dict(process=lambda z, t, k, p: [0.0] * 6), "float tensor of logits"),
])
def test_bad_input_says_what_is_wrong(kwargs, message):
    args = dict(logits=LOGITS, decode=lambda i: WORDS[i], process=process)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        sampling_explorer(**args)
