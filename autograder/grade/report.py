"""The grades CSV and the class report (one self-contained HTML file, no scripts, opens offline).

CSV: one row per student and lab: student, lab, score, max, flags ('code(cell)' joined by '; ').
Report, per lab: the score distribution (histogram), the pass rate of each test cell (what the
class got wrong), and every student with errors or flags and why; then the whole grade table.
"""
from __future__ import annotations

import base64
import csv
import html
import io
import statistics
from collections import defaultdict
from datetime import datetime
from pathlib import Path

from autograder.grade.outcome import FLAGS, Outcome

CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;margin:.6em 0 1.4em}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.bar{background:#4c78a8;height:10px;display:inline-block}.zero{color:#b00020;font-weight:600}
.review{color:#9a6700;font-weight:600}.info{color:#555}.num{text-align:right}small{color:#666}
"""


def write_csv(outcomes: list[Outcome], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["student", "lab", "score", "max", "flags"])
        for o in sorted(outcomes, key=lambda o: (o.lab, o.student)):
            w.writerow([o.student, o.lab, f"{o.score:g}", f"{o.max_score:g}", o.flag_summary()])
    return path


def write_canvas_csv(outcomes: list[Outcome], path: Path, students: list | None = None) -> Path:
    """The grades in Canvas's gradebook-import layout (Grades > Import): Student, ID, SIS User ID, SIS
    Login ID, Section, then one column per lab, with a "Points Possible" row first. Canvas matches a row
    by SIS User ID (the student's id here) or SIS Login ID (the class list's email, where given); a lab
    column whose name no assignment has becomes a new assignment."""
    roster = {s.id: s for s in students or []}
    labs = sorted({o.lab for o in outcomes})
    table = {(o.student, o.lab): o for o in outcomes}
    possible = {lab: max(o.max_score for o in outcomes if o.lab == lab) for lab in labs}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Student", "ID", "SIS User ID", "SIS Login ID", "Section", *labs])
        w.writerow(["    Points Possible", "", "", "", "", *(f"{possible[lab]:g}" for lab in labs)])
        for student in sorted({o.student for o in outcomes}):
            who = roster.get(student)
            w.writerow([(who.name if who and who.name else student), "", student, (who.email if who else ""), "",
                        *(f"{table[(student, lab)].score:g}" if (student, lab) in table else "" for lab in labs)])
    return path


def _histogram(scores: list[float], max_score: float) -> str:
    """A small PNG histogram of scores, as a data URL (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 2.4), layout="constrained")
    bins = max(1, min(20, int(max_score * 2) or 1))
    ax.hist(scores, bins=bins, range=(0, max_score or 1), color="#4c78a8", edgecolor="white")
    ax.set_xlabel("score"), ax.set_ylabel("students")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _flags_html(o: Outcome) -> str:
    items = []
    for f in o.flags:
        where = f" <code>{html.escape(f.cell)}</code>" if f.cell else ""
        items.append(f'<span class="{f.severity}">{html.escape(f.code)}</span>{where}: '
                     f'{html.escape(f.detail or FLAGS[f.code][1])}')
    items += [f"error in <code>{html.escape(k)}</code>: {html.escape(v)}" for k, v in o.errors.items()]
    return "<br>".join(items)


def _lab_section(lab: str, outcomes: list[Outcome]) -> str:
    graded = [o for o in outcomes if o.status == "graded"]
    max_score = max((o.max_score for o in outcomes), default=0)
    scores = [o.score for o in graded]
    parts = [f"<h2>{html.escape(lab)}</h2>"]
    if scores:
        parts.append(f"<p>{len(graded)} graded, {len(outcomes) - len(graded)} without a score; "
                     f"mean {statistics.mean(scores):.2f}, median {statistics.median(scores):g}, "
                     f"min {min(scores):g}, max {max(scores):g} (of {max_score:g})</p>")
        parts.append(f'<img alt="score distribution of {html.escape(lab)}" src="{_histogram(scores, max_score)}">')
    else:
        parts.append("<p>No graded submission.</p>")
    passes: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    points: dict[str, float] = {}
    for o in graded:
        for c in o.cells:
            passes[c.grade_id][0] += c.status == "passed"
            passes[c.grade_id][1] += 1
            points[c.grade_id] = c.points
    if passes:
        parts.append("<h3>Pass rate per test cell</h3><table><tr><th>test cell</th><th>points</th><th>passed</th><th></th></tr>")
        for gid, (ok, n) in passes.items():
            rate = ok / n if n else 0
            parts.append(f'<tr><td><code>{html.escape(gid)}</code></td><td class="num">{points[gid]:g}</td>'
                         f'<td class="num">{ok}/{n} ({rate:.0%})</td><td><span class="bar" style="width:{rate * 200:.0f}px">'
                         f"</span></td></tr>")
        parts.append("</table>")
    written = [o for o in graded if o.manual]
    if written:
        todo = sum(any(m.answered for m in o.manual) for o in written)
        parts.append(f"<p><b>Needs manual grading:</b> {todo} of {len(written)} submissions have written answers "
                     f"({sum(m.points for m in written[0].manual):g} points, not in these scores). Grade them in "
                     f"formgrader: <code>make formgrade</code>, then Manual Grading.</p>")
    noted = [o for o in outcomes if o.flags or o.errors or o.status != "graded"]
    if noted:
        parts.append("<h3>Students with errors or flags</h3><table><tr><th>student</th><th>score</th><th>why</th></tr>")
        for o in sorted(noted, key=lambda o: o.student):
            parts.append(f"<tr><td>{html.escape(o.student)}</td><td class='num'>{o.score:g}/{o.max_score:g}</td>"
                         f"<td>{_flags_html(o)}</td></tr>")
        parts.append("</table>")
    return "\n".join(parts)


def write_report(outcomes: list[Outcome], path: Path, title: str = "Class report", run: str = "") -> Path:
    """The class report; `run` says how this run went (how long, on how many workers)."""
    by_lab: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_lab[o.lab].append(o)
    labs = sorted(by_lab)
    students = sorted({o.student for o in outcomes})
    table = {(o.student, o.lab): o for o in outcomes}
    rows = "".join(
        f"<tr><td>{html.escape(s)}</td>" + "".join(
            f"<td class='num'>{table[(s, lab)].score:g}" + (" *" if table[(s, lab)].flags else "") + "</td>"
            if (s, lab) in table else "<td></td>" for lab in labs) + "</tr>"
        for s in students)
    legend = "".join(f'<tr><td class="{sev}">{code}</td><td>{sev}</td><td>{html.escape(text)}</td></tr>'
                     for code, (sev, text) in FLAGS.items())
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{CSS}</style></head><body>
<h1>{html.escape(title)}</h1><p><small>made {datetime.now():%Y-%m-%d %H:%M} by <code>make grade</code>;
{len(students)} students, {len(labs)} labs{"; " + html.escape(run) if run else ""}</small></p>
{"".join(_lab_section(lab, by_lab[lab]) for lab in labs)}
<h2>All grades</h2><table><tr><th>student</th>{"".join(f"<th>{html.escape(lab)}</th>" for lab in labs)}</tr>{rows}</table>
<p><small>* flagged: see the lab's table above.</small></p>
<h2>What the flags mean</h2><table><tr><th>flag</th><th>severity</th><th>meaning</th></tr>{legend}</table>
</body></html>"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
