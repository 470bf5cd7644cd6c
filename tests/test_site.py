"""The course site (`make html`), built and read in headless chromium as a self-learner would.

Per lab, after the session's class grading (conftest.py), whose honest student's graded copy in
build/executed/ it reuses (alone, it executes the lab itself, quick mode): the page is built with the code `make html`
runs, then opened from file:// with the network cut: no console error, no request outside the
site folder, not blank, no hidden-test text anywhere, solutions folded until clicked, every
widget control changes the drawing, maths typeset, plots inline, the printed numbers on the
page. The landing page: the course map links every lab, and says how to get the student version
and how instructors grade.
"""
from __future__ import annotations

import html
import importlib.util
import re
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_output

from autograder import LABS, REPO, authoring
from browser import chromium_path, is_blank, open_page
from autograder import site

_spec = importlib.util.spec_from_file_location("site_build", REPO / "assets" / "site" / "build.py")
build = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build)

SOURCES = site.find_labs(LABS)
LOCAL = ("data:", "blob:", "about:")
TEXT_SUFFIXES = {".html", ".css", ".js", ".ipynb", ".md", ".txt", ".json", ".py"}


def _per_lab() -> list:
    """One parameter per lab, in the xdist group of the session's class grading (conftest.py), which
    comes first in that group and writes each lab's executed copy: the site reuses it."""
    return [pytest.param(s, marks=pytest.mark.xdist_group("grade:class"), id=s.stem) for s in SOURCES]


def executed_lab(source: Path) -> nbformat.NotebookNode:
    """The lab executed with its solutions: the copy in build/executed/ when it is the lab as it is
    now (the honest student's graded notebook, written earlier in this session's worker), else
    executed here (quick mode)."""
    return nbformat.read(build.ensure_executed([source], quick=True, log=print)[source.stem], as_version=4)


def hidden_lines(source_nb: nbformat.NotebookNode) -> tuple[set[str], set[str], set[str]]:
    """(lines only hidden tests hold, long ones among them, the lines shown outside hidden
    regions): stripped; a line the source also shows publicly is no secret (`else:`)."""
    hidden, public = set(), set()
    for cell in source_nb.cells:
        inside = False
        for line in cell.source.splitlines():
            if site.HIDDEN_MARKERS[0] in line:
                inside = True
            elif site.HIDDEN_MARKERS[1] in line:
                inside = False
            else:
                (hidden if inside else public).add(line.strip())
    secret = {s for s in hidden - public if s}
    return secret, {s for s in secret if len(s) >= 30}, public


def hidden_leaks(out_dir: Path, source_nb: nbformat.NotebookNode, lab: str | None = None) -> list[str]:
    """Every place a built file shows a hidden-test marker, or (in the landing page and `lab`'s
    own files; other labs' code may share a plain line like `for _ in range(n):`) a hidden line
    of `source_nb`, as text with the tags removed."""
    secret, long_ones, public = hidden_lines(source_nb)
    leaks = []
    for path in sorted(p for p in out_dir.rglob("*") if p.suffix in TEXT_SUFFIXES and p.is_file()):
        if "_vendor" in path.parts:
            continue
        mine = lab is None or path.name == "index.html" or path.name.startswith(lab)
        raw = path.read_text(encoding="utf-8", errors="replace")
        if path.suffix == ".ipynb":
            text = "\n".join(c.source for c in nbformat.reads(raw, as_version=4).cells)
        else:
            text = html.unescape(re.sub(r"<[^>]+>", "", raw))
        where = path.relative_to(out_dir)
        leaks += [f"{where}: marker {m!r}" for m in ("BEGIN HIDDEN TESTS", "END HIDDEN TESTS") if m in raw]
        if not mine:
            continue
        lines = {line.strip() for line in text.splitlines()}
        leaks += [f"{where}: {s}" for s in sorted(secret & lines)]
        # a long hidden line inside another line (reformatted, wrapped in an output), unless that
        # line is one the source shows: `assert f(x)[0] == 2` contains a hidden `f(x)`
        unshown = "\n".join(line for line in text.splitlines() if line.strip() not in public)
        leaks += [f"{where}: {s}" for s in sorted(long_ones - lines) if s in unshown]
    return leaks


def assert_in_site(view, out_dir: Path) -> None:
    """No request left the site folder (nothing from the network, nothing else on disk)."""
    root = out_dir.resolve().as_uri() + "/"
    outside = [u for u in view.requests if not (u.startswith(root) or u.startswith(LOCAL))]
    assert not outside, f"the page requested {len(outside)} URLs outside {root}: {outside[:5]}"


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory) -> Path:
    """This worker's site folder: landing page and student versions of every lab."""
    chromium_path()  # fail fast, before any lab runs, if chromium is missing
    out = tmp_path_factory.mktemp("site")
    student = build.student_versions(SOURCES, out)
    site.build_site({}, [site.lab_info(s) for s in SOURCES], out, student)
    return out


# --- without a browser ---------------------------------------------------------------------------

def test_prepare_removes_hidden_tests_and_folds_solutions(tmp_path):
    path = authoring.write_notebook(tmp_path / "00_fixture" / "00_fixture.ipynb", [
        authoring.md("# Lab 00: Fixture\n\nWhy.\n\n**Time:** 5 minutes. **Hardware:** any CPU.\n\n"
                     "## Problem 1: Square (2 points)"),
        authoring.solution("square", "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION"),
        authoring.tests("square_tests", 2, "assert square(3) == 9\n### BEGIN HIDDEN TESTS\n"
                                           "assert square(-2) == 4, 'negative numbers too'\n### END HIDDEN TESTS"),
    ])
    nb = nbformat.read(path, as_version=4)
    nb.cells[2].outputs = [  # a failed hidden test would show its line in the traceback
        new_output("error", ename="AssertionError", evalue="negative numbers too",
                   traceback=["assert square(-2) == 4, 'negative numbers too'"]),
        new_output("stream", name="stdout", text="checked\n"),
    ]
    page = site.prepare(nb)
    assert page.cells[1].source == "def square(x):\n    return x * x", "a reader sees the solution without its markers"
    assert page.cells[2].source == "assert square(3) == 9"
    assert [o.output_type for o in page.cells[2].outputs] == ["stream"]
    assert page.cells[1].metadata["course_site"] == {"fold": "solution"}
    assert "course_site" not in page.cells[2].metadata
    assert "HIDDEN" in nb.cells[2].source, "prepare must not change the notebook it is given"
    info = site.lab_info(path)
    assert (info.number, info.title, info.time, info.hardware) == ("00", "Fixture", "5 minutes", "any CPU.")
    assert info.problems == [("1", "Square", "2")] and info.points == "2"

    # the leak check itself finds a hidden line in a built page
    built = tmp_path / "html"
    built.mkdir()
    (built / "page.html").write_text("<pre><span>assert</span> square(-2) == 4, &#39;negative numbers too&#39;</pre>")
    assert hidden_leaks(built, nb) == ["page.html: assert square(-2) == 4, 'negative numbers too'"]


@pytest.mark.parametrize("source", SOURCES, ids=[s.stem for s in SOURCES])
def test_lab_title_cell_feeds_the_course_map(source):
    info = site.lab_info(source)
    assert info.title and info.title != source.stem, f"{source.name}: the first cell needs '# Lab NN: title'"
    assert info.why, f"{source.name}: the title cell needs a paragraph saying why the lab matters"
    assert info.goals, f"{source.name}: the title cell needs a '**You will**' list"
    assert info.time and info.hardware, f"{source.name}: the title cell needs '**Time:** ... **Hardware:** ...'"
    assert info.problems, f"{source.name}: no '## Problem N: title (P points)' heading found"


# --- in the browser ------------------------------------------------------------------------------

@pytest.mark.browser
def test_landing_page(site_dir, tmp_path):
    labs = [site.lab_info(s) for s in SOURCES]
    with open_page(site_dir / "index.html") as view:
        page = view.page
        text = page.locator("main").inner_text()
        for lab in labs:
            link = page.locator(f'main a[href="{lab.href}"]')
            assert link.count() >= 1, f"the course map has no link to {lab.href}"
            assert f"Lab {lab.number}: {lab.title}" in text
            student = page.locator(f'main a[download][href^="student/{lab.name}"]')
            assert student.count() == 1, f"no student-version link for {lab.name}"
            assert (site_dir / student.get_attribute("href")).is_file()
        for words in ("The course map", "Prerequisites", "CPU or GPU", "student version", "Colab", "instructors",
                      "You build", "Builds on", "make grade", "self_check"):
            assert words.lower() in text.lower(), f"the landing page does not say {words!r}"
        assert page.locator("nav.site-nav a.site-home").count() == 2
        shot = tmp_path / "index.png"
        page.screenshot(path=str(shot), full_page=True)
    assert not is_blank(shot), "the landing page screenshot is blank"
    view.assert_no_errors()
    assert_in_site(view, site_dir)


def _shown(area) -> str:
    """What a widget draws now: the HTML of its visible output parts (not its controls)."""
    return area.evaluate("""el => [...el.querySelectorAll('.widget-html, .widget-htmlmath, .widget-image, .widget-output')]
        .filter(e => e.offsetParent !== null && !e.querySelector('.widget-html, .widget-htmlmath'))
        .map(e => e.innerHTML).join('\\n')""")


def _changed(area, before: str, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _shown(area) != before:
            return True
        time.sleep(0.05)
    return False


def drive_widget(area, label: str) -> int:
    """Move every visible control of one rendered widget; each must change the drawing.
    Returns how many controls were moved."""
    moved = 0
    for handle in area.locator(".noUi-handle").all():
        if not handle.is_visible():
            continue
        before = _shown(area)
        handle.press("End")
        if not _changed(area, before, 1.0):  # already at the end: go to the start instead
            handle.press("Home")
        assert _changed(area, before), f"{label}: moving a slider did not change the drawing"
        moved += 1
    for group in area.locator(".widget-toggle-buttons").all():
        if not group.is_visible():
            continue
        idle = group.locator("button:not(.mod-active)")
        if idle.count():
            before = _shown(area)
            idle.first.click()
            assert _changed(area, before), f"{label}: pressing toggle button {idle.first.inner_text()!r} changed nothing"
            moved += 1
    for select in area.locator(".widget-dropdown select").all():
        if not select.is_visible():
            continue
        values = select.locator("option").evaluate_all("os => os.map(o => o.value)")
        other = [v for v in values if v != select.input_value()]
        if other:
            before = _shown(area)
            select.select_option(other[0])
            assert _changed(area, before), f"{label}: choosing {other[0]!r} in a dropdown changed nothing"
            moved += 1
    for box in area.locator(".widget-checkbox input, button.widget-toggle-button").all():
        if box.is_visible():
            before = _shown(area)
            box.click()
            assert _changed(area, before), f"{label}: clicking a checkbox or toggle changed nothing"
            moved += 1
    return moved


def _outputs(nb, kind: str) -> list:
    return [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if kind in o.get("data", {})]


_CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def _without_code(markdown: str) -> str:
    """Markdown without its code blocks and code spans: a `$` left is maths for MathJax."""
    return _CODE.sub("", markdown)


@pytest.mark.slow
@pytest.mark.browser
@pytest.mark.parametrize("source", _per_lab())
def test_lab_page(source, site_dir, tmp_path):
    lab = source.stem
    start = time.perf_counter()
    ran = executed_lab(source)
    built = time.perf_counter()
    labs = [site.lab_info(s) for s in SOURCES]
    student = build.student_versions([source], site_dir)
    site.build_site({lab: ran}, labs, site_dir, student)
    page_path = site_dir / f"{lab}.html"
    source_nb = nbformat.read(source, as_version=4)

    leaks = hidden_leaks(site_dir, source_nb, lab)
    assert not leaks, f"{lab}: hidden-test text in the built site:\n" + "\n".join(leaks[:10])

    n_widgets = len(_outputs(ran, "application/vnd.jupyter.widget-view+json"))
    n_images = len(_outputs(ran, "image/png")) + len(_outputs(ran, "image/svg+xml"))
    n_solutions = sum(1 for c in source_nb.cells if c.get("metadata", {}).get("nbgrader", {}).get("solution"))
    with open_page(page_path, width=1200, height=900) as view:
        page = view.page
        # every widget rendered from its saved state, and each control changes what it draws
        areas = page.locator('.jp-OutputArea-output:has(> script[type="application/vnd.jupyter.widget-view+json"])')
        assert areas.count() == n_widgets, f"{lab}: {areas.count()} widget outputs on the page, {n_widgets} in the notebook"
        moved = 0
        for i in range(n_widgets):
            area = areas.nth(i)
            area.locator(".widget-subarea .jupyter-widgets").first.wait_for(timeout=30_000)
            area.scroll_into_view_if_needed()
            moved += drive_widget(area, f"{lab} widget {i + 1}")
        assert not n_widgets or moved, f"{lab}: its widgets have no control to move"

        # solutions folded until asked for
        folds = page.locator("details.site-solution")
        assert folds.count() == n_solutions, f"{lab}: {folds.count()} folded solutions, {n_solutions} solution cells"
        for i in range(folds.count()):
            body = folds.nth(i).locator(".jp-Cell").first
            assert not body.is_visible(), f"{lab}: solution {i + 1} is visible before its toggle is clicked"
            folds.nth(i).locator("summary").click()
            body.wait_for(state="visible", timeout=2_000)
            shown = body.inner_text()
            assert "BEGIN SOLUTION" not in shown and "END SOLUTION" not in shown, \
                f"{lab}: solution {i + 1} shows nbgrader's marker lines to readers"

        # nbgrader's problem headings, the measured numbers, maths and plots are on the page
        text = page.locator("main").inner_text()
        for number, title, points in site.lab_info(source).problems:
            shown = title.replace("`", "")    # markdown's code spans render without their backticks
            assert f"Problem {number}: {shown} ({points} point" in text, f"{lab}: heading of problem {number} missing"
        assert site.measured_on(ran) in text, f"{lab}: the banner does not say where the numbers were measured"
        printed = [o.text.strip().splitlines()[0] for c in ran.cells if c.cell_type == "code" for o in c.outputs
                   if o.output_type == "stream" and o.name == "stdout" and o.text.strip()]
        missing = [p for p in printed if p.strip() not in text]
        assert not missing, f"{lab}: printed results not on the page: {missing[:3]}"
        images = page.locator(".jp-OutputArea-output img")
        assert images.count() >= n_images, f"{lab}: {images.count()} images on the page, {n_images} plots in the notebook"
        assert all(img.evaluate("i => i.complete && i.naturalWidth > 0") for img in images.all()), f"{lab}: an image did not load"
        if any("$" in _without_code(c.source) for c in source_nb.cells if c.cell_type == "markdown"):   # maths, not `$ref`
            page.locator("mjx-container").first.wait_for(timeout=30_000)
        assert page.locator("nav.site-nav a.current").first.get_attribute("href") == f"{lab}.html"

        shot = tmp_path / f"{lab}.png"
        page.evaluate("window.scrollTo(0, 0)")          # the top of the page: title, goals, first section
        page.screenshot(path=str(shot))                  # (a full-page shot of a long lab costs 2 s more)
    assert not is_blank(shot), f"{lab}: the page screenshot is blank"
    view.assert_no_errors()
    assert_in_site(view, site_dir)
    print(f"{lab}: executed or reused in {built - start:.0f} s, page built and checked in "
          f"{time.perf_counter() - built:.0f} s ({n_widgets} widgets, {moved} controls moved, {n_solutions} solutions)")
