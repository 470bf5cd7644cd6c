"""Feedback for one student and lab: an HTML page with no hidden test and no solution in it.

nbgrader's own `generate_feedback` shows hidden tests and their tracebacks. Here the graded
notebook is rewritten before it is rendered:
- a summary on top: score, each test's result, and the flags with what they mean;
- each test cell shows the RELEASE's version of its source (visible asserts only) and its result
  instead of its outputs. A failure in the visible part shows its error message and line; a
  failure in the hidden part (told apart by the traceback's line number in that cell) shows its
  assert's message, never its code (`hidden_messages=False`, `--no-hidden-messages`: only the
  exception's type); a partial-credit cell lists the cases it lost;
- other cells keep what the student's own code printed, except any line that repeats a hidden
  test or a solution line the student did not write (tracebacks can quote other cells). A cell
  of the lab (a demo, given code) that failed after an answer had shows one line saying so,
  not its traceback.
"""
from __future__ import annotations

import copy
import html
import re
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter
from nbconvert.filters import Highlight2HTML, clean_html
from nbformat import NotebookNode
from nbformat.v4 import new_markdown_cell, new_output

from autograder.checks import HIDDEN_MARKERS, secret_lines
from autograder.grade.outcome import FLAGS, Outcome
from autograder.grade.repair import cell_kind, grade_id

ANSI = re.compile(r"\x1b\[[0-9;]*m")
CASE_MARK = "  \u2717 "      # how course.expect.Cases prints a failed case (not imported: it would load torch here)
_exporter: "_Exporter | None" = None
_highlight: Highlight2HTML | None = None


def _hidden_start(source: str) -> int | None:
    """1-based line number of the hidden-tests marker in a test cell, or None."""
    for n, line in enumerate(source.splitlines(), 1):
        if HIDDEN_MARKERS[0] in line:
            return n
    return None


def failing_line(cell: NotebookNode) -> int | None:
    """The line of THIS cell where its error was raised (IPython's 'Cell In[N], line L'), or None."""
    count = cell.get("execution_count")
    for out in cell.get("outputs", []):
        if out.get("output_type") != "error":
            continue
        for entry in out.get("traceback", []):
            m = re.search(rf"In\s*\[{count}\],\s*line\s*(\d+)", ANSI.sub("", entry))
            if count is not None and m:
                return int(m.group(1))
    return None


def result_line(cell: NotebookNode, result, hidden_messages: bool = True) -> str:
    """What a test cell shows the student: its result and, when it failed, why: a visible assert's
    message with its line, a hidden test's message (its assert's text, never its code; unless the
    instructor turned that off), or the cases a partial-credit cell lost."""
    mark = f"{result.score:g}/{result.points:g}"
    if result.status == "passed":
        return f"PASSED ({mark})"
    if result.status in {"not-run", "timeout", "zeroed", "kernel-died"}:
        return f"NOT COUNTED ({mark}): {result.status}: {result.why}"
    errors = [o for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    if not errors:
        if any(o.get("output_type") == "stream" and o.get("name") == "stderr" for o in cell.get("outputs", [])):
            return f"FAILED ({mark}): the cell wrote to stderr (a warning?): nbgrader scores such a cell 0"
        lost = [line for o in cell.get("outputs", []) if o.get("output_type") == "stream" and o.get("name") == "stdout"
                for line in o.get("text", "").splitlines() if line.startswith(CASE_MARK) or line.startswith("  ... and ")]
        if not lost:
            return f"PARTIAL ({mark})"
        if not hidden_messages:
            return f"PARTIAL ({mark}): {sum(line.startswith(CASE_MARK) for line in lost)} or more cases failed"
        return f"PARTIAL ({mark}): these cases failed:\n" + "\n".join(lost)
    err = errors[0]
    hidden, line = _hidden_start(cell.source), failing_line(cell)
    if line is not None and (hidden is None or line < hidden):
        return f"FAILED ({mark}): a visible test, line {line}: {err.ename}: {err.evalue}"
    message = ANSI.sub("", err.get("evalue", "")).strip()
    if not hidden_messages or not message:
        return f"FAILED ({mark}): a hidden test failed ({err.ename}). Check edge cases and the problem statement."
    said = message if err.ename == "AssertionError" else f"{err.ename}: {message}"
    return f"FAILED ({mark}): a hidden test failed: {said[:600]}"


MARKDOWN = re.compile(r"([\\`*_\[\]|~#])")


def _md(text: str) -> str:
    """Plain text inside Markdown: HTML escaped, and `__init__` keeps its underscores."""
    return MARKDOWN.sub(r"\\\1", html.escape(text))


def _summary(outcome: Outcome) -> str:
    rows = "\n".join(f"| `{c.grade_id}` | {c.score:g} / {c.points:g} | {c.status} |" for c in outcome.cells)
    text = [f"# Feedback: {outcome.lab}", f"**Student:** {_md(outcome.student)}  ",
            f"**Score:** {outcome.score:g} / {outcome.max_score:g}", "",
            "| test | points | result |", "|---|---|---|", rows]
    tests = {c.grade_id for c in outcome.cells}      # a kernel that died in a demo cost no points itself...
    stopped = any(c.status == "not-run" for c in outcome.cells)   # ...unless the grader stopped there
    lost = [f for f in outcome.flags if f.severity == "zero"
            and not (f.code == "kernel-died" and f.cell not in tests and not stopped)]
    notes = [f for f in outcome.flags if f not in lost]
    for title, flags in (("**Why points were lost**", lost), ("**Notes from the grader** (no points lost for these)", notes)):
        if flags:
            text += ["", title, ""]
            for f in flags:
                where = f" (`{f.cell}`)" if f.cell else ""
                text.append(f"- **{f.code}**{where}: {_md(FLAGS[f.code][1])}. {_md(f.detail)}")
    return "\n".join(text)


def _knock_on(cell: NotebookNode, cause: str) -> None:
    """A lab's own cell (a demo, given code) that failed after an answer had: one line instead of a traceback."""
    errors = [o for o in cell.outputs if o.get("output_type") == "error"]
    first = ANSI.sub("", f"{errors[0].ename}: {errors[0].evalue}").strip().splitlines()
    cell.outputs = [o for o in cell.outputs if o.get("output_type") != "error"] + [new_output(
        "stream", name="stdout", text=f"(this cell of the lab failed, {first[0][:200] if first else 'an error'}: most likely "
                                      f"because of `{cause}`, which failed above; fix that first)\n")]


def _scrub(text: str, secret: set[str]) -> str:
    """Drop output lines that quote a secret line (long enough to be specific)."""
    keep = [line for line in text.split("\n")
            if not any(s in ANSI.sub("", line) for s in secret if len(s) >= 12)]
    return "\n".join(keep)


def feedback_notebook(graded: NotebookNode, outcome: Outcome, source: NotebookNode, release: NotebookNode,
                      hidden_messages: bool = True) -> NotebookNode:
    """The notebook the feedback page renders (see the module docstring)."""
    nb = copy.deepcopy(graded)
    released = {grade_id(c): c.source for c in release.cells if grade_id(c)}
    results = {c.grade_id: c for c in outcome.cells}
    own = {line.strip() for c in graded.cells if cell_kind(c) in {"solution", "plain", "manual"}
           for line in c.source.splitlines()}
    secret = secret_lines(source) - own
    lab_cells = {_norm(c.source) for c in source.cells if c.cell_type == "code" and cell_kind(c) in {"plain", "locked"}}
    failed = None          # the first answer or test that failed so far: what a later demo's error comes from
    for cell in nb.cells:
        gid = grade_id(cell)
        errored = cell.cell_type == "code" and any(o.get("output_type") == "error" for o in cell.get("outputs", []))
        if cell.cell_type == "code" and cell_kind(cell) == "test":
            line = result_line(cell, results[gid], hidden_messages) if gid in results else "not graded"
            cell.source = released.get(gid, "# (hidden)")
            cell.outputs = [new_output("stream", name="stdout", text=_scrub(line, secret) + "\n")]
            if gid in results and results[gid].status != "passed":
                failed = failed or gid
        elif cell.cell_type == "code":
            for out in cell.get("outputs", []):
                if out.get("output_type") == "stream":
                    out.text = _scrub(out.text, secret)
                elif out.get("output_type") == "error":
                    out.traceback = [_scrub(t, secret) for t in out.traceback]
                    out.evalue = _scrub(out.evalue, secret)
                elif "data" in out and "text/plain" in out.data:
                    out.data["text/plain"] = _scrub(out.data["text/plain"], secret)
            if errored and cell_kind(cell) == "solution":
                failed = failed or gid
            elif errored and failed and _norm(cell.source) in lab_cells:
                _knock_on(cell, failed)
    nb.cells.insert(0, new_markdown_cell(_summary(outcome)))
    nb.metadata.pop("widgets", None)
    return nb


def _norm(source: str) -> str:
    return "\n".join(line.rstrip() for line in source.strip().splitlines())


class _Highlighted(str):
    """Pygments' HTML of a code cell: every character of the source is escaped already, so nbconvert's
    `clean_html` (bleach: half the time of a page) has nothing to remove from it."""


_RAW = re.compile(r"(<script\b.*?</script>|<style\b.*?</style>)", re.S | re.I)   # not markup: left as they are
_IMG_NO_ALT = re.compile(r"<img\b(?![^>]*\salt=)", re.I)
_FOCUSABLE = re.compile(r'<div\b(?![^>]*\stabindex=)([^>]*\sclass="(?:[^"]*\s)?(?:jp-Cell-inputWrapper|jp-OutputArea-output)(?:\s[^"]*)?")')


class _Exporter(HTMLExporter):
    """nbconvert's HTMLExporter without its last pass, which parses the whole page with BeautifulSoup
    (Python's html.parser) to add an `alt` to images that lack one and `tabindex="0"` to the cells'
    input and output boxes: two thirds of the time of a page with plots. The same attributes are
    added here to the template's output directly."""

    def from_notebook_node(self, nb, resources=None, **kw):
        from nbconvert.exporters.html import WidgetsDataTypeFilter
        from nbconvert.exporters.templateexporter import TemplateExporter

        resources = self._init_resources(resources)
        self.register_filter("highlight_code", self.filters["highlight_code"])
        self.register_filter("filter_data_type", WidgetsDataTypeFilter(notebook_metadata=self._nb_metadata, parent=self,
                                                                       resources=resources))
        page, resources = TemplateExporter.from_notebook_node(self, nb, resources, **kw)
        parts = _RAW.split(page)
        for i in range(0, len(parts), 2):      # the markup between scripts and styles
            parts[i] = _FOCUSABLE.sub(r'<div\1 tabindex="0"',
                                      _IMG_NO_ALT.sub('<img alt="No description has been provided for this image"', parts[i]))
        return "".join(parts), resources


def _render(nb: NotebookNode) -> str:
    """nbconvert's lab-template HTML of `nb`, the highlighted code kept out of bleach."""
    global _exporter, _highlight
    if _exporter is None:
        _highlight = Highlight2HTML()
        _exporter = _Exporter(template_name="lab", filters={
            "highlight_code": lambda source, language=None, metadata=None: _Highlighted(_highlight(source, language, metadata)),
            "clean_html": lambda html: html if isinstance(html, _Highlighted) else clean_html(html),
        })
    info = nb.metadata.get("language_info", {})
    _highlight.pygments_lexer = info.get("pygments_lexer", info.get("name")) or "ipython3"   # as nbconvert picks it
    return _exporter.from_notebook_node(nb)[0]


def write_feedback(graded: NotebookNode, outcome: Outcome, source: NotebookNode, release: NotebookNode,
                   out_html: Path, hidden_messages: bool = True) -> Path:
    """Render the feedback page for one graded notebook to `out_html`."""
    body = _render(feedback_notebook(graded, outcome, source, release, hidden_messages))
    out_html.parent.mkdir(parents=True, exist_ok=True)
    out_html.write_text(body, encoding="utf-8")
    return out_html


def write_missing(outcome: Outcome, out_html: Path) -> Path:
    """A one-line page for a student with no graded notebook (missing, unreadable, grader error)."""
    nb = nbformat.v4.new_notebook(cells=[new_markdown_cell(_summary(outcome) + f"\n\n{outcome.reason}")])
    body = _render(nb)
    out_html.parent.mkdir(parents=True, exist_ok=True)
    out_html.write_text(body, encoding="utf-8")
    return out_html
