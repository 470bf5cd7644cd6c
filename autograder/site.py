"""The course site (`make html`): executed labs as static pages that work offline, and a landing page.

Each lab page is the lab executed with its solutions, exported with `course.static_html` (widget
manager, require.js and MathJax vendored from npm, nothing from a CDN), with three changes:
hidden tests are removed (and any output that would quote them), solution cells are folded behind
a "Show solution" toggle, and a bar on top links home and the previous and next labs and says on
what machine (and in which mode) the numbers were measured. The landing page is
`assets/site/index.md` with the course map, generated from the labs' title cells, put in.

This module only reads notebooks; executing them (and making the student versions to download)
is the caller's job: `assets/site/build.py`, which `make html` runs.
"""
from __future__ import annotations

import copy
import html
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat import NotebookNode

from autograder import lab_names
from autograder.checks import HIDDEN_MARKERS, SOLUTION_MARKERS
from course import static_html

SITE_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "site"  # index.md, site.css
SITE_NAME = "How LLM inference engines work"


def without_solution_markers(source: str) -> str:
    """`source` without its `### BEGIN SOLUTION` / `### END SOLUTION` lines: what a reader should see."""
    return "\n".join(line for line in source.splitlines() if not any(m in line for m in SOLUTION_MARKERS))


def fingerprint(nb: NotebookNode) -> list[tuple[str, str]]:
    """Each cell's type and source, solution markers aside: an execution of the lab (the source run
    by `make html`, or the honest student's graded copy that `make test` keeps) is the lab as it is
    now exactly when the fingerprints agree."""
    return [(c.cell_type, without_solution_markers(c.source)) for c in nb.cells]
COURSE_MAP = "<!-- course map -->"  # where index.md gets the generated list of labs
LAB_FOLDER = re.compile(r"^(\d+)_\w+$")
_PROBLEM = re.compile(r"^##\s+Problem\s+(\d+):\s*(.+?)\s*\((\d+(?:\.\d+)?)\s+points?\)\s*$", re.M)

# Blocks added to static_html's template (which already points every script at _vendor/).
_SITE_BLOCKS = r"""
{%- block html_head_css -%}
<link rel="stylesheet" href="site.css">
{%- endblock html_head_css -%}

{%- macro site_nav(site) -%}
<nav class="site-nav">
  <a class="site-home" href="index.html">{{ site.name | e }}</a>
  <span class="site-labs">
  {%- for lab in site.labs %}
    <a href="{{ lab.href }}" title="{{ lab.title | e }}"{% if lab.current %} class="current" aria-current="page"{% endif %}>{{ lab.number }}</a>
  {%- endfor %}
  </span>
  <span class="site-steps">
  {%- if site.prev %}<a href="{{ site.prev.href }}" title="{{ site.prev.title | e }}">&larr; previous</a>{% endif -%}
  {%- if site.next %}<a href="{{ site.next.href }}" title="{{ site.next.title | e }}">next &rarr;</a>{% endif -%}
  </span>
</nav>
{%- endmacro -%}

{%- block body_header -%}
<body class="jp-Notebook site-page site-{{ resources.site.kind }}" data-jp-theme-light="true" data-jp-theme-name="JupyterLab Light">
{{ site_nav(resources.site) }}
<main>
{%- if resources.site.banner %}
<aside class="site-banner">{{ resources.site.banner }}</aside>
{%- endif %}
{%- endblock body_header -%}

{% block body_footer %}
</main>
{{ site_nav(resources.site) }}
</body>
{% endblock body_footer %}

{% block codecell %}
{%- if cell.metadata.get('course_site', {}).get('fold') -%}
<details class="site-solution"><summary>Show solution</summary>
{{ super() }}
</details>
{%- else -%}
{{ super() }}
{%- endif -%}
{% endblock codecell %}

{% block markdowncell %}
{%- if cell.metadata.get('course_site', {}).get('fold') -%}
<details class="site-solution"><summary>Show answer</summary>
{{ super() }}
</details>
{%- else -%}
{{ super() }}
{%- endif -%}
{% endblock markdowncell %}
"""


@dataclass
class LabInfo:
    """What the course map says about a lab, read from its notebook (title cell and headings)."""

    name: str                      # folder name, e.g. "01_inference"
    number: str                    # "01"
    title: str                     # "Inference, one token at a time"
    why: str = ""                  # the first paragraph of the title cell (markdown)
    goals: list[str] = field(default_factory=list)     # the "You will" bullets (markdown)
    time: str = ""                 # "about 45 minutes"
    hardware: str = ""             # the "Hardware:" sentence(s)
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # (number, title, points)
    builds_on: list[str] = field(default_factory=list)  # earlier labs the title cell refers to

    @property
    def href(self) -> str:
        return f"{self.name}.html"

    @property
    def points(self) -> str:
        return f"{sum(float(p) for _, _, p in self.problems):g}"


def find_labs(labs_dir: str | Path) -> list[Path]:
    """The source notebook of every lab under `labs_dir` (the labs `autograder.lab_names` finds, the
    ones make grade and make release know) that is numbered `NN_name`, ordered by NN."""
    found = [Path(labs_dir) / lab / f"{lab}.ipynb" for lab in lab_names(labs_dir) if LAB_FOLDER.match(lab)]
    return sorted((p for p in found if p.is_file()), key=lambda p: (int(LAB_FOLDER.match(p.stem)[1]), p.stem))


def _read(nb: NotebookNode | str | Path) -> NotebookNode:
    return nb if isinstance(nb, NotebookNode) else nbformat.read(nb, as_version=4)


def lab_info(nb: NotebookNode | str | Path, name: str | None = None) -> LabInfo:
    """Parse a lab's title cell (course anatomy: '# Lab NN: title', a paragraph, '**You will**'
    bullets, '**Time:** ... **Hardware:** ...') and its '## Problem N: title (P points)' headings."""
    if name is None:
        if isinstance(nb, NotebookNode):
            raise ValueError("name is needed when nb is a NotebookNode (the lab folder's name, e.g. '01_inference')")
        name = Path(nb).stem
    nb = _read(nb)
    number = LAB_FOLDER.match(name)[1] if LAB_FOLDER.match(name) else name
    first = next((c.source for c in nb.cells if c.cell_type == "markdown"), "")
    heading = re.search(r"^#\s+(.+)$", first, re.M)
    title = heading[1].strip() if heading else name
    title = re.sub(r"^Lab\s+\d+\s*:\s*", "", title)
    info = LabInfo(name=name, number=number, title=title)
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", first) if p.strip()]
    info.why = next((p for p in paragraphs if not p.startswith(("#", "**", "-", "*"))), "")
    for para in paragraphs:
        if para.startswith("**You will**"):
            info.goals = []
            for line in para.splitlines()[1:]:
                if line.lstrip().startswith(("- ", "* ")) or not info.goals:
                    info.goals.append(line.strip().lstrip("-* ").strip())
                elif line.strip():                  # a bullet wrapped onto the next line
                    info.goals[-1] += " " + line.strip()
        time = re.search(r"\*\*Time:\*\*\s*(.+?)(?=\s*\*\*\w|\Z)", para, re.S)
        if time:
            info.time = " ".join(time[1].split()).rstrip(".")
        hardware = re.search(r"\*\*Hardware:\*\*\s*(.+)", para, re.S)
        if hardware:
            info.hardware = " ".join(hardware[1].split())
    text = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    info.problems = _PROBLEM.findall(text)
    mentioned = re.findall(r"\blabs?\s+((?:\d\d(?:,\s*|\s+and\s+)?)+)", first)
    earlier = {n for group in mentioned for n in re.findall(r"\d\d", group) if number.isdigit() and int(n) < int(number)}
    info.builds_on = sorted(earlier)
    return info


def _hidden_regions(source: str) -> tuple[str, list[str]]:
    """`source` without its hidden-test regions (markers included), and the lines removed."""
    kept, removed, inside = [], [], False
    for line in source.splitlines():
        if HIDDEN_MARKERS[0] in line:
            inside = True
            removed.append(line)
        elif HIDDEN_MARKERS[1] in line:
            inside = False
            removed.append(line)
        elif inside:
            removed.append(line)
        else:
            kept.append(line)
    return "\n".join(kept).rstrip(), removed


def _output_text(output: NotebookNode) -> str:
    if output.output_type == "stream":
        return output.get("text", "")
    if output.output_type == "error":
        return "\n".join([output.get("ename", ""), output.get("evalue", ""), *output.get("traceback", [])])
    return "\n".join(v if isinstance(v, str) else "\n".join(v) if isinstance(v, list) else ""
                     for v in output.get("data", {}).values())


def prepare(nb: NotebookNode) -> NotebookNode:
    """A copy of an executed lab fit to publish: hidden tests gone, solution cells marked to fold
    and shown without their marker lines.

    In a cell with hidden tests, the lines between the markers go, and so does every output
    that could quote them (errors, whose tracebacks show the failing line, and any output that
    contains a hidden line): executed with their solutions, test cells normally have no output.
    """
    nb = copy.deepcopy(nb)
    for cell in nb.cells:
        source, removed = _hidden_regions(cell.source)
        if removed:
            cell.source = source
            secret = [s.strip() for s in removed if len(s.strip()) > 6]  # not `else:`
            if cell.cell_type == "code":
                cell.outputs = [o for o in cell.outputs if o.output_type != "error"
                                and not any(s in _output_text(o) for s in secret)]
        if cell.get("metadata", {}).get("nbgrader", {}).get("solution"):
            cell.metadata["course_site"] = {"fold": "solution"}
            cell.source = without_solution_markers(cell.source)
    return nb


def measured_on(nb: NotebookNode) -> str:
    """The line `course.setup()` printed in the executed lab (device, threads, mode), or ''."""
    for cell in nb.cells:
        if cell.cell_type == "code" and "course.setup(" in cell.source:
            for out in cell.get("outputs", []):
                if out.output_type == "stream" and out.name == "stdout" and out.text.strip():
                    return out.text.strip().splitlines()[-1]
    return ""


def _banner(nb: NotebookNode, student_href: str | None) -> str:
    parts = []
    line = measured_on(nb)
    if line:
        parts.append(f"Executed with the solutions on <code>{html.escape(line)}</code>.")
        if "quick mode" in line:
            parts.append("Quick mode shrinks the demo workloads, so some measurements are small; run the lab "
                         "yourself for full-size numbers on your machine.")
        else:
            parts.append("Your machine's numbers will differ: run the lab to measure your own.")
    if student_href:
        parts.append(f'<a href="{html.escape(student_href)}" download>Download the student version</a> '
                     "(stubs to fill in, visible tests) to work through it yourself.")
    return " ".join(parts)


def _exporter():
    exporter = static_html.exporter()
    exporter.raw_template = static_html._TEMPLATE + _SITE_BLOCKS
    return exporter


def _nav(labs: Sequence[LabInfo], current: int | None) -> dict:
    entries = [{"href": lab.href, "title": f"Lab {lab.number}: {lab.title}", "number": lab.number,
                "current": i == current} for i, lab in enumerate(labs)]
    prev = entries[current - 1] if current is not None and current > 0 else None
    nxt = entries[current + 1] if current is not None and current + 1 < len(entries) else None
    if current is None and entries:
        nxt = entries[0]
    return {"name": SITE_NAME, "labs": entries, "prev": prev, "next": nxt}


def _write(exporter, nb: NotebookNode, out: Path, site: dict) -> Path:
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": out.stem}, "site": site})
    out.write_text(body, encoding="utf-8")
    return out


def write_lab_page(executed: NotebookNode | str | Path, labs: Sequence[LabInfo], index: int,
                   out_dir: str | Path, student_href: str | None = None, exporter=None) -> Path:
    """Write `labs[index]`'s page, `<out_dir>/<name>.html`, from its executed notebook."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    static_html.copy_vendor(out_dir)
    lab = labs[index]
    nb = prepare(_read(executed))
    nb.metadata["title"] = f"Lab {lab.number}: {lab.title} | {SITE_NAME}"
    site = {**_nav(labs, index), "kind": "lab", "banner": _banner(nb, student_href)}
    return _write(exporter or _exporter(), nb, out_dir / lab.href, site)


def course_map(labs: Sequence[LabInfo], student: dict[str, str] | None = None) -> str:
    """The labs as markdown: title (linked), why, what you build, time, hardware, prerequisites."""
    student = student or {}
    blocks = []
    for lab in labs:
        lines = [f"### [Lab {lab.number}: {lab.title}]({lab.href})", ""]
        if lab.why:
            lines += [lab.why, ""]
        if lab.problems:
            graded = "; ".join(f"{t} ({p} points)" for _, t, p in lab.problems)
            lines += [f"**You build** (graded, {lab.points} points): {graded}.", ""]
        if lab.goals:
            lines += ["**You will**", *[f"- {g}" for g in lab.goals], ""]
        facts = []
        if lab.time:
            facts.append(f"**Time:** {lab.time}.")
        facts.append("**Builds on:** " + (", ".join(f"[lab {n}]({_href(labs, n)})" for n in lab.builds_on)
                                          if lab.builds_on else "Python and a little PyTorch") + ".")
        if lab.hardware:
            facts.append(f"**CPU or GPU:** {lab.hardware}")
        if lab.name in student:
            facts.append(f'**Student version:** <a href="{html.escape(student[lab.name])}" download>{lab.name}.ipynb</a>')
        lines += [" ".join(facts), ""]
        blocks.append("\n".join(lines))
    if not blocks:
        return "*No labs yet.*"
    table = ["| lab | you build (graded problems) | points | time |", "|---|---|---|---|"]
    cell = lambda text: text.replace("|", "\\|")  # noqa: E731 (a pipe would end the table cell)
    table += [f"| [{lab.number} {cell(lab.title)}]({lab.href}) | {cell('; '.join(t for _, t, _ in lab.problems))} "
              f"| {lab.points} | {cell(lab.time)} |" for lab in labs]
    return "\n".join(table) + "\n\n" + "\n".join(blocks)


def _href(labs: Sequence[LabInfo], number: str) -> str:
    return next((lab.href for lab in labs if lab.number == number), "#")


def write_landing_page(labs: Sequence[LabInfo], out_dir: str | Path, student: dict[str, str] | None = None,
                       text: str | None = None, exporter=None) -> Path:
    """Write `<out_dir>/index.html`: `assets/site/index.md` (or `text`) with the course map put in
    place of its `<!-- course map -->` line; also copies site.css and the vendored files."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    static_html.copy_vendor(out_dir)
    (out_dir / "site.css").write_text((SITE_ASSETS / "site.css").read_text(encoding="utf-8"), encoding="utf-8")
    text = (SITE_ASSETS / "index.md").read_text(encoding="utf-8") if text is None else text
    if COURSE_MAP not in text:
        raise ValueError(f"the landing page text needs a line {COURSE_MAP!r} where the course map goes")
    text = text.replace(COURSE_MAP, course_map(labs, student))
    # One markdown cell per top-level section, as in a notebook.
    sections = [s for s in re.split(r"(?m)^(?=## )", text) if s.strip()]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell(s.strip()) for s in sections])
    nb.metadata["title"] = SITE_NAME
    site = {**_nav(labs, None), "kind": "landing", "banner": ""}
    return _write(exporter or _exporter(), nb, out_dir / "index.html", site)


def build_site(executed: dict[str, str | Path], labs: Sequence[LabInfo], out_dir: str | Path,
               student: dict[str, str] | None = None) -> list[Path]:
    """The whole site into `out_dir`: landing page plus one page per lab in `executed`
    ({lab name: executed notebook}); `labs` (all of them, in order) drives the map and the nav.
    `student` maps a lab name to its downloadable student version (a path relative to out_dir)."""
    student = student or {}
    exporter = _exporter()
    pages = [write_landing_page(labs, out_dir, student, exporter=exporter)]
    for i, lab in enumerate(labs):
        if lab.name in executed:
            pages.append(write_lab_page(executed[lab.name], labs, i, out_dir, student.get(lab.name), exporter))
    for page in pages:
        text = page.read_text(encoding="utf-8")
        for marker in HIDDEN_MARKERS:
            if marker in text:
                raise RuntimeError(f"{page} shows {marker!r}: hidden tests must never reach the site")
    return pages
