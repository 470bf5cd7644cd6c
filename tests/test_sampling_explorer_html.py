"""The distribution explorer replays in static HTML: execute, export, open offline, move the sliders.

A notebook draws a six-token distribution with `sampling_explorer` and a small temperature/top-k/
top-p function written in the cell; exported with `course.static_html.export_html` and opened from
file:// in headless chromium (network aborted), the top-k and top-p sliders must change which
tokens survive with no kernel behind it.
"""
from __future__ import annotations

import textwrap

import pytest

from browser import is_blank, open_page, widget_page

pytestmark = [pytest.mark.browser, pytest.mark.slow]

CELL = textwrap.dedent("""\
    import torch
    from course.widgets import sampling_explorer
    words = ["Paris", " the", " a", " London", "\\n", " Rome"]
    logits = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04]).log()
    def process(z, temperature, top_k, top_p):
        z = z / temperature
        if 0 < top_k < z.shape[0]:
            z = z.masked_fill(z < z.sort(descending=True).values[top_k - 1], float("-inf"))
        if top_p < 1:
            p = z.softmax(-1)
            srt, order = p.sort(descending=True)
            z[order[(srt.cumsum(0) - srt) >= top_p]] = float("-inf")
        return z
    sampling_explorer(logits, lambda i: words[i], process, temperatures=(0.5, 1.0, 2.0), top_ks=(0, 3, 1),
                      top_ps=(1.0, 0.5), prompt="The capital of France is")
""")


@pytest.fixture(scope="module")
def page_file(tmp_path_factory):
    return widget_page(tmp_path_factory.mktemp("sampling_explorer_html"), CELL)


def test_sliders_reshape_the_distribution_offline(page_file, tmp_path):
    with open_page(page_file) as view:
        out = view.page.locator(".jp-OutputArea-output").first
        out.locator("text=6 of 6 tokens survive").first.wait_for(timeout=30_000)
        assert "0.400 → 0.400" in out.inner_text(), "opens at temperature 1 with nothing cut"

        handles = out.locator(".noUi-handle")
        assert handles.count() == 3, "three sliders: temperature, top-k, top-p"
        handles.nth(1).press("ArrowRight")                     # top-k 3
        out.locator("text=3 of 6 tokens survive").first.wait_for(timeout=5_000)
        assert "0.400 → 0.500" in out.inner_text(), "the survivors are renormalized"
        handles.nth(1).press("Home")                           # top-k off
        handles.nth(2).press("End")                            # top-p 0.5: 0.4 alone is short, so ' the' crosses it
        out.locator("text=2 of 6 tokens survive").first.wait_for(timeout=5_000)
        handles.nth(0).press("End")                            # temperature 2: flatter, more tokens to reach 0.5
        out.locator("text=temperature 2,").first.wait_for(timeout=5_000)
        assert "3 of 6 tokens survive" in out.inner_text()

        shot = tmp_path / "explorer.png"
        out.screenshot(path=str(shot))
    assert not is_blank(shot), "the screenshot is blank"
    view.assert_offline()
    view.assert_no_errors()
