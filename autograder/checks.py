"""Instructor-side checks of lab notebooks, used by the tests and by grading.

Each function takes paths or notebooks, so it works on the real labs and on small fixtures alike.
What they guard against: a source that does not pass its own tests, a release that leaks
solutions or hidden tests, a stub that accidentally earns points, and notebook shapes that
nbgrader scores wrongly (stderr in a test cell scores 0, a numeric last value is partial credit).
"""
from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

import nbformat
from IPython.core.inputtransformer2 import TransformerManager
from jupyter_client.kernelspec import KernelSpecManager
from nbclient import NotebookClient
from nbformat import NotebookNode
from nbgrader.utils import determine_grade, is_grade, is_solution

from autograder import HIDDEN_MARKERS, SOLUTION_MARKERS, load_config

KERNEL = "python3"


# --- running notebooks ---------------------------------------------------------------------------

def _check_kernel_is_this_python() -> None:
    """The python3 kernel must run this interpreter (the venv's), not some other Python."""
    argv0 = KernelSpecManager().get_kernel_spec(KERNEL).argv[0]
    if argv0 not in {"python", "python3", sys.executable}:  # jupyter_client maps "python" to sys.executable
        raise RuntimeError(f"the {KERNEL!r} kernelspec runs {argv0}, not this interpreter {sys.executable}; "
                           f"remove that kernelspec or run with the venv's python")


def execute_notebook(path: Path | str, out_path: Path | str | None = None, timeout: int | None = None,
                     quick: bool = True) -> NotebookNode:
    """Run the notebook at `path` top to bottom in a fresh kernel of this interpreter; return it.

    Cells that raise do not stop the run (use `error_cells`/`cell_failures` on the result), as in
    grading; a cell running past `timeout` does (nbclient raises CellTimeoutError). The kernel's working directory is the notebook's folder (labs read their data files),
    COURSE_QUICK is 1 when `quick` (tests and grading) else 0, widget state is stored in
    `metadata.widgets` (the rendered site shows it). `timeout` is per cell, in seconds: default
    the course's `c.Execute.timeout`. With `out_path` the executed notebook is written there too.
    """
    path = Path(path)
    if path.suffix != ".ipynb" or not path.is_file():
        raise FileNotFoundError(f"path must be an existing .ipynb file, got {path}")
    _check_kernel_is_this_python()
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb,
        timeout=timeout if timeout is not None else load_config().Execute.timeout,
        kernel_name=KERNEL,
        allow_errors=True,
        store_widget_state=True,
        resources={"metadata": {"path": str(path.parent.resolve())}},
    )
    client.execute(env={**os.environ, "COURSE_QUICK": "1" if quick else "0"})
    if out_path is not None:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out_path)
    return nb


# --- reading results -----------------------------------------------------------------------------

def graded_cells(nb: NotebookNode) -> list[NotebookNode]:
    """The autograded test cells: code cells with nbgrader `grade: true` and `solution: false`.

    nbgrader scores these from their outputs. (Autograded answer cells and manually graded
    answers also carry `grade: true` but are solution cells: they are not tests.)
    """
    return [c for c in nb.cells if c.cell_type == "code" and is_grade(c) and not is_solution(c)]


def _label(nb: NotebookNode, cell: NotebookNode) -> str:
    """How a message names a cell: its grade_id, or its index and first line."""
    grade_id = cell.get("metadata", {}).get("nbgrader", {}).get("grade_id")
    if grade_id:
        return grade_id
    first = cell.source.strip().splitlines()[0][:60] if cell.source.strip() else ""
    index = next(i for i, c in enumerate(nb.cells) if c is cell)
    return f"cell {index} ({first})"


def _errors(cell: NotebookNode) -> list[str]:
    """Error outputs and stderr text of an executed code cell."""
    found = []
    for out in cell.get("outputs", []):
        if out.output_type == "error":
            found.append(f"{out.ename}: {out.evalue}")
        elif out.output_type == "stream" and out.name == "stderr":
            found.append(f"stderr: {out.text.strip()[:500]}")
    return found


def error_cells(nb: NotebookNode) -> dict[str, str]:
    """Every code cell of an executed notebook that raised: {cell label: 'Name: message'}."""
    return {_label(nb, c): "; ".join(f"{o.ename}: {o.evalue}" for o in c.outputs if o.output_type == "error")
            for c in nb.cells if c.cell_type == "code" and any(o.output_type == "error" for o in c.outputs)}


def cell_failures(nb: NotebookNode) -> dict[str, str]:
    """Test cells of an executed notebook that nbgrader would not give full points: {grade_id: why}.

    Why: an error, ANY stderr output (nbgrader scores the cell 0 even when the asserts pass), or
    partial credit (a numeric last value).
    """
    failures = {}
    for cell in graded_cells(nb):
        score, max_score = determine_grade(cell)
        problems = _errors(cell)
        if score < max_score and not problems:
            lost = [line.strip() for o in cell.get("outputs", []) if o.output_type == "stream" and o.name == "stdout"
                    for line in o.text.splitlines() if line.startswith("  \u2717 ")]   # course.expect.Cases.MARK
            problems = [f"partial credit {score}/{max_score} from its last value" + (": " + "; ".join(lost) if lost else "")]
        if problems:
            failures[_label(nb, cell)] = "; ".join(problems)
    return failures


# --- releases -----------------------------------------------------------------------------------

def _regions(source: str, markers: tuple[str, str]) -> list[str]:
    """Lines strictly between each begin/end marker pair of `source`."""
    inside, lines = False, []
    for line in source.splitlines():
        if markers[0] in line:
            inside = True
        elif markers[1] in line:
            inside = False
        elif inside:
            lines.append(line)
    return lines


def secret_lines(source_nb: NotebookNode) -> set[str]:
    """Stripped lines the release must not show: solution regions (a solution cell without
    markers is all solution) and hidden-test regions."""
    secret: list[str] = []
    for cell in source_nb.cells:
        if is_solution(cell):
            has_markers = SOLUTION_MARKERS[0] in cell.source
            secret += _regions(cell.source, SOLUTION_MARKERS) if has_markers else cell.source.splitlines()
        secret += _regions(cell.source, HIDDEN_MARKERS)
    return {s.strip() for s in secret if s.strip()}


def _public_lines(source_nb: NotebookNode) -> set[str]:
    """Stripped lines of the source outside every secret region (the release may show these)."""
    public = []
    for cell in source_nb.cells:
        inside = False
        if is_solution(cell) and SOLUTION_MARKERS[0] not in cell.source:
            continue
        for line in cell.source.splitlines():
            if SOLUTION_MARKERS[0] in line or HIDDEN_MARKERS[0] in line:
                inside = True
            elif SOLUTION_MARKERS[1] in line or HIDDEN_MARKERS[1] in line:
                inside = False
            elif not inside:
                public.append(line.strip())
    return set(public)


def release_leaks(release_nb: NotebookNode, source_nb: NotebookNode) -> list[str]:
    """What the release shows that only the source should: solution or hidden-test lines, and any
    solution or hidden-test marker. Lines that the source also shows in public are not counted."""
    secret = secret_lines(source_nb) - _public_lines(source_nb)
    leaks = []
    for cell in release_nb.cells:
        for line in cell.source.splitlines():
            marker = any(m.replace("### ", "") in line for m in SOLUTION_MARKERS + HIDDEN_MARKERS)
            if marker or line.strip() in secret:
                leaks.append(f"{_label(release_nb, cell)}: {line.strip()}")
    return leaks


def stored_state(nb: NotebookNode) -> list[str]:
    """Outputs, execution counts and widget state a notebook carries (sources and releases must not)."""
    found = ["metadata.widgets (saved widget state)"] if "widgets" in nb.metadata else []
    for cell in nb.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            found.append(f"{_label(nb, cell)}: stored outputs or execution count")
    return found


def release_as_released(release_path: Path | str, out_path: Path | str | None = None) -> dict[str, str]:
    """Execute a release copy as a student receives it; return what is wrong: {cell: why}.

    Wrong: a test cell that does not score 0 with the stubs (it would reward doing nothing), or
    an error in a cell before the first solution cell (setup and model loading must work
    without any solution). `{}` means every test cell fails and the start of the lab runs.
    """
    nb = execute_notebook(release_path, out_path)
    problems = {}
    for cell in graded_cells(nb):
        score, max_score = determine_grade(cell)
        if score != 0:
            problems[_label(nb, cell)] = f"scores {score}/{max_score} with the stubs; it must fail"
    errors = error_cells(nb)
    for cell in nb.cells:
        if is_solution(cell):
            break
        if _label(nb, cell) in errors:
            problems[_label(nb, cell)] = f"fails before any solution: {errors[_label(nb, cell)]}"
    return problems


# --- static checks of a source notebook ----------------------------------------------------------

def _ends_in_value(source: str) -> bool:
    """True when the cell's last statement is an expression (its value becomes the cell's result,
    and a number there is partial credit). `print(...)` returns None and is allowed, and so is
    `cases.score()`, partial credit on purpose (course.expect.Cases)."""
    try:
        tree = ast.parse(TransformerManager().transform_cell(source))
    except SyntaxError:
        return False  # reported by execution, not here
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return False
    value = tree.body[-1].value
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "print":
        return False
    return not (isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr == "score"
                and "Cases(" in source)


def _bare_asserts(source: str) -> list[int]:
    """Line numbers of `assert` statements without a message in a cell."""
    try:
        tree = ast.parse(TransformerManager().transform_cell(source))
    except SyntaxError:
        return []
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Assert) and node.msg is None]


def static_problems(nb: NotebookNode) -> list[str]:
    """nbgrader-shape problems of a source notebook, without running it: stored outputs or widget
    state, duplicate grade ids, test cells without points, ending in a value or holding an assert
    without a message, code solution cells without both markers, and no locked `course.setup()`
    cell before the first solution."""
    problems = stored_state(nb)
    ids = [c.metadata.nbgrader["grade_id"] for c in nb.cells if "grade_id" in c.metadata.get("nbgrader", {})]
    problems += [f"grade_id {g!r} is used {ids.count(g)} times" for g in sorted(set(ids)) if ids.count(g) > 1]
    for cell in graded_cells(nb):
        if not float(cell.metadata.nbgrader.get("points", 0)) > 0:
            problems.append(f"{_label(nb, cell)}: a test cell needs points > 0")
        if _ends_in_value(cell.source):
            problems.append(f"{_label(nb, cell)}: ends in a value (a number there is partial credit); end in a "
                            f"statement, or in `cases.score()` for partial credit on purpose (course.expect.Cases)")
        problems += [f"{_label(nb, cell)}, line {n}: an assert without a message (feedback would show a bare "
                     f"AssertionError): say what the likely mistake is" for n in _bare_asserts(cell.source)]
    for cell in nb.cells:
        if cell.cell_type == "code" and is_solution(cell) and not all(m in cell.source for m in SOLUTION_MARKERS):
            problems.append(f"{_label(nb, cell)}: a solution cell needs {SOLUTION_MARKERS[0]!r} and {SOLUTION_MARKERS[1]!r}")
    before_work = []
    for cell in nb.cells:
        if is_solution(cell):
            break
        before_work.append(cell)
    if not any(c.cell_type == "code" and "course.setup(" in c.source and c.metadata.get("nbgrader", {}).get("locked")
               for c in before_work):
        problems.append("a locked setup cell calling course.setup() must come before the first solution cell")
    return problems


# --- tensors on the lab's device -----------------------------------------------------------------

TENSOR_FACTORIES = {"tensor", "as_tensor", "zeros", "ones", "full", "empty", "randn", "rand", "randint", "arange",
                    "randperm", "linspace", "logspace", "eye", "normal", "tril", "triu"}
CPU_MARK = "# cpu:"


def _moved_to_a_device(call: ast.Call, parent: ast.AST | None) -> bool:
    """The factory call's result is moved at once (`.to(dev...)`, `.cuda()`), read out (`.tolist()`,
    `.item()`, `.numpy()`), or kept on the CPU on purpose (`.cpu()`)."""
    if not isinstance(parent, ast.Attribute) or parent.value is not call:
        return False
    if parent.attr in {"cuda", "tolist", "item", "numpy", "cpu"}:
        return True
    if parent.attr != "to":
        return False
    grand = getattr(parent, "_parent", None)
    if not isinstance(grand, ast.Call):
        return False
    args = [ast.unparse(a) for a in grand.args] + [ast.unparse(k.value) for k in grand.keywords]
    return any(w in a for a in args for w in ("dev", "cuda", "device"))


def device_problems(nb: NotebookNode) -> list[str]:
    """Tensor constructors in a notebook's code cells (given, test and solution cells alike) that put
    a tensor on the CPU without saying so: `torch.zeros(...)` and friends without `device=`, not moved
    at once with `.to(<device>)`, and not marked `# cpu: <why>` on their line. On a GPU such a tensor
    handed to lab code (a Triton kernel, a cache on the GPU) fails; on a CPU nothing shows it.
    `*_like` constructors inherit their argument's device and are fine."""
    problems = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(TransformerManager().transform_cell(cell.source))
        except SyntaxError:
            continue
        for node in ast.walk(tree):
            for child in ast.iter_child_nodes(node):
                child._parent = node
        lines = cell.source.splitlines()
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in TENSOR_FACTORIES and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "torch"):
                continue
            if any(k.arg == "device" for k in node.keywords) or _moved_to_a_device(node, getattr(node, "_parent", None)):
                continue
            line = lines[node.lineno - 1] if node.lineno - 1 < len(lines) else ""
            if CPU_MARK in line:
                continue
            problems.append(f"{_label(nb, cell)}, line {node.lineno}: torch.{node.func.attr}(...) makes a CPU tensor "
                            f"({line.strip()[:90]}); give it device=env.device, move it with .to(env.device), "
                            f"or end the line with '{CPU_MARK} <why it stays on the CPU>'")
    return problems
