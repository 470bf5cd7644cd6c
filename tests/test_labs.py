"""Every lab in labs/, end to end, as nbgrader will treat it.

Static (fast): sources carry no outputs or widget state, have the shape nbgrader scores right, and
build every tensor on the lab's device. Per lab (slow, quick mode), from the session's one grading
of the simulated class (conftest.py: each lab runs there, and nowhere else): (a) the honest student,
i.e. the source with every answer, passes all its tests, hidden ones included, with no error and no
flag, within TIME_LIMIT_S; (b) the release leaks no solution or hidden test and stores no outputs;
(c) the blank student, i.e. the release as a student receives it, fails every test cell, while
setup and model loading still work. Labs are found at collection time, so a new lab folder is
covered without editing this file.
"""
from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_output
from nbgrader.api import Gradebook
from nbgrader.utils import is_solution

from autograder import LABS, REPO, authoring, checks, lab_names, lab_notebook
from autograder.release import generate_release

LAB_NAMES = lab_names()
SOURCES = sorted(p for p in LABS.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
EXECUTED = REPO / "build" / "executed"
# A guard against a runaway lab, not a speed claim: a lab runs in 15-90 s in quick mode on 2 quiet
# cores (see --durations), but a loaded machine can triple that, and a timed test must not flake.
TIME_LIMIT_S = 600


def _per_lab(group: str) -> list:
    """One parameter per lab, each in xdist group '<lab>:<group>'."""
    return [pytest.param(lab, marks=pytest.mark.xdist_group(f"{lab}:{group}"), id=lab) for lab in LAB_NAMES]


@pytest.fixture(scope="session")
def released(tmp_path_factory):
    """`released(lab)` -> the lab's release notebook, generated once per worker into a temp folder
    without a gradebook, so tests never touch autograder/release/ or autograder/gradebook.db."""
    root = tmp_path_factory.mktemp("release")
    made: dict[str, Path] = {}

    def get(lab: str) -> Path:
        if lab not in made:
            made[lab] = generate_release(lab, release_dir=root, gradebook=None)
        return made[lab]

    return get


# --- static checks -------------------------------------------------------------------------------

def test_there_are_labs():
    assert LAB_NAMES, f"no labs in {LABS}: each lab is a folder NN_name/ holding NN_name.ipynb"


@pytest.mark.parametrize("path", SOURCES, ids=[str(p.relative_to(LABS)) for p in SOURCES])
def test_source_in_git_stores_no_outputs(path):
    stored = checks.stored_state(nbformat.read(path, as_version=4))
    assert not stored, f"{path} stores outputs or widget state (they leak into releases); " \
                       f"run `python -m autograder.release` to strip them:\n" + "\n".join(stored)


@pytest.mark.parametrize("lab", LAB_NAMES)
def test_source_has_nbgrader_shape(lab):
    problems = checks.static_problems(nbformat.read(lab_notebook(lab), as_version=4))
    assert not problems, f"{lab}:\n" + "\n".join(problems)


@pytest.mark.parametrize("lab", LAB_NAMES)
def test_source_builds_tensors_on_the_labs_device(lab):
    """On a GPU a CPU tensor handed to lab code fails (a Triton kernel: "Pointer argument cannot be
    accessed from Triton"); a CPU never shows it. So every tensor a cell builds says where it lives."""
    problems = checks.device_problems(nbformat.read(lab_notebook(lab), as_version=4))
    assert not problems, f"{lab}: tensors made on the CPU without saying so:\n" + "\n".join(problems)


def test_device_check_catches_a_cpu_tensor_handed_to_a_kernel():
    # lab 05's kernel test before the GPU fix: the inputs of store_kv were made on the CPU
    old = ("kc, vc = torch.zeros(4, 4, 3, 8), torch.zeros(4, 4, 3, 8)\nk = torch.randn(5, 3, 8)\n"
           "slots = torch.tensor([3, 4, 15, -1, 0])\nstore_kv(kc, vc, k, k, slots)")
    fixed = ("kc = torch.zeros(4, 4, 3, 8, device=env.device)\nk = torch.randn(5, 3, 8).to(env.device)\n"
             "ids = torch.tensor([3, 4]).tolist()\nlens = torch.tensor([1, 2])  # cpu: read by the reference only\n"
             "x = torch.zeros_like(kc)")
    nb = nbformat.v4.new_notebook(cells=[new_code_cell(old), new_code_cell(fixed),
                                         new_code_cell("y = torch.ones(3).to(torch.float16)")])
    found = checks.device_problems(nb)
    assert len(found) == 5 and sum("cell 0" in f for f in found) == 4 and "cell 2" in found[-1], found


# --- each lab, executed --------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.xdist_group("grade:class")
@pytest.mark.parametrize("lab", LAB_NAMES)
def test_source_runs_and_passes_its_tests(lab, graded_class):
    """The lab with every answer filled in (the class's honest student, graded once per session in
    conftest.py) ran top to bottom in the grading sandbox, hidden tests included: full marks, no
    cell raised, no flag. Its graded notebook is the site's executed copy."""
    o = graded_class["outcomes"][("full", lab)]
    assert o.status == "graded" and o.cells, f"{lab}: not graded ({o.status}: {o.reason}), or no test cells"
    lost = {c.grade_id: f"{c.status}: {c.why[:300]}" for c in o.cells if c.status != "passed"}
    assert not lost, f"{lab}: the lab's own solutions lose points: {lost}"
    assert not o.errors, f"{lab}: cells raised: {o.errors}"
    flagged = [f for f in o.flags if f.code != "needs-manual-grading"]     # written answers: a person grades them
    assert not flagged, f"{lab}: honest work was flagged: {o.flag_summary()}"
    assert all(m.answered for m in o.manual), f"{lab}: the honest student's written answers count as blank"
    print(f"{lab}: source ran in {o.seconds:.1f} s (quick mode, graded)")
    assert o.seconds < TIME_LIMIT_S, f"{lab} took {o.seconds:.0f} s in quick mode; the budget is {TIME_LIMIT_S} s"


@pytest.mark.parametrize("lab", _per_lab("release"))
def test_release_leaks_nothing(lab, released):
    release_nb = nbformat.read(released(lab), as_version=4)
    leaks = checks.release_leaks(release_nb, nbformat.read(lab_notebook(lab), as_version=4))
    assert not leaks, f"{lab}: the release shows solution or hidden-test text:\n" + "\n".join(leaks)
    assert not checks.stored_state(release_nb), checks.stored_state(release_nb)
    data = {p.relative_to(LABS / lab) for p in (LABS / lab).rglob("*") if p.is_file() and p.suffix != ".ipynb"
            and ".ipynb_checkpoints" not in p.parts and "__pycache__" not in p.parts}
    missing = [str(p) for p in data if not (released(lab).parent / p).is_file()]
    assert not missing, f"{lab}: data files not copied into the release: {missing}"


@pytest.mark.slow
@pytest.mark.xdist_group("grade:class")
@pytest.mark.parametrize("lab", LAB_NAMES)
def test_release_fails_every_test_as_released(lab, graded_class):
    """The release as a student receives it (the class's blank student): every test cell scores 0,
    while the cells before the first answer (setup, model loading) run without an error."""
    o = graded_class["outcomes"][("blank", lab)]
    earning = {c.grade_id: c.score for c in o.cells if c.score}
    assert not earning, f"{lab}: the stubs earn points (a test that cannot fail?): {earning}"
    release = nbformat.read(graded_class["root"] / "fixture-release" / lab / f"{lab}.ipynb", as_version=4)
    before = []
    for i, cell in enumerate(release.cells):
        if is_solution(cell):
            break
        before.append(cell.metadata.get("nbgrader", {}).get("grade_id") or f"cell {i + 1}")
    early = {label: err for label, err in o.errors.items() if label in before}
    assert not early, f"{lab}: cells before the first answer fail without a solution: {early}"


# --- the checks themselves, on a small fixture lab ------------------------------------------------

def _fixture_lab(labs: Path, always_passing_test: bool = False) -> Path:
    """labs/00_fixture: setup, one solution, its test (visible + hidden), a data file."""
    cells = [
        authoring.md("# Fixture lab"),
        authoring.locked("setup", "import course\nenv = course.setup()"),
        authoring.solution("square", "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION"),
        authoring.tests("square_tests", 2, "assert square(3) == 9, 'square(3) is 9'\n"
                                 "### BEGIN HIDDEN TESTS\nassert square(-2) == 4, 'square(-2) is 4'\n### END HIDDEN TESTS"),
    ]
    if always_passing_test:  # passes with the stub too; also proves COURSE_QUICK reaches the kernel
        cells.append(authoring.tests("quick_mode", 1, "assert env.quick, 'COURSE_QUICK=1 did not reach the kernel'"))
    path = authoring.write_notebook(labs / "00_fixture" / "00_fixture.ipynb", cells)
    (path.parent / "data.txt").write_text("1 2 3\n")
    return path


def _release_fixture(tmp_path: Path, gradebook: Path | None = None, **kw) -> tuple[Path, Path]:
    source = _fixture_lab(tmp_path / "labs", **kw)
    return source, generate_release("00_fixture", tmp_path / "labs", tmp_path / "release", gradebook)


def test_release_of_fixture_is_clean_and_leak_check_catches_leaks(tmp_path):
    source_path, release_path = _release_fixture(tmp_path, gradebook=tmp_path / "gradebook.db")
    source, release = (nbformat.read(p, as_version=4) for p in (source_path, release_path))
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gb:  # what autograde will need
        assert [c.name for c in gb.find_notebook("00_fixture", "00_fixture").grade_cells] == ["square_tests"]
    assert (release_path.parent / "data.txt").is_file()
    assert "raise NotImplementedError()" in release.cells[2].source
    assert checks.release_leaks(release, source) == []
    leaked = checks.release_leaks(source, source)  # the source itself is the worst possible release
    assert any("return x * x" in s for s in leaked) and any("square(-2)" in s for s in leaked)
    assert any("BEGIN SOLUTION" in s for s in leaked) and any("HIDDEN TESTS" in s for s in leaked)


def test_release_strips_widget_state_and_outputs(tmp_path):
    source_path = _fixture_lab(tmp_path / "labs")
    nb = nbformat.read(source_path, as_version=4)
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    nb.cells[1].outputs = [new_output("stream", name="stdout", text="torch ...")]
    nbformat.write(nb, source_path)
    release_path = generate_release("00_fixture", tmp_path / "labs", tmp_path / "release", gradebook=None)
    assert checks.stored_state(nbformat.read(release_path, as_version=4)) == []


def test_static_problems_catch_bad_shapes(tmp_path):
    nb = nbformat.read(_fixture_lab(tmp_path / "labs"), as_version=4)
    assert checks.static_problems(nb) == []
    nb.cells[3].source += "\nsquare(2) == 4"            # a value as last line: partial credit
    nb.cells[3].metadata.nbgrader["points"] = 0
    nb.cells[2].source = "def square(x):\n    return x * x"  # markers gone
    nb.cells.append(new_code_cell("print(1)", metadata={"nbgrader": dict(nb.cells[2].metadata.nbgrader)}))
    nb.cells[1].metadata.nbgrader["locked"] = False
    nb.metadata["widgets"] = {}
    problems = "\n".join(checks.static_problems(nb))
    for expected in ("ends in a value", "points > 0", "needs '### BEGIN SOLUTION'", "used 2 times",
                     "locked setup cell", "metadata.widgets"):
        assert expected in problems, f"{expected!r} not reported in:\n{problems}"


def test_cell_failures_report_errors_stderr_and_partial_credit(tmp_path):
    nb = nbformat.read(_fixture_lab(tmp_path / "labs"), as_version=4)
    test_cell = nb.cells[3]
    assert checks.cell_failures(nb) == {}  # no outputs: nbgrader gives full points
    test_cell.outputs = [new_output("stream", name="stderr", text="UserWarning: something")]
    assert "stderr" in checks.cell_failures(nb)["square_tests"]
    test_cell.outputs = [new_output("error", ename="AssertionError", evalue="square(3) is 9", traceback=[])]
    assert "AssertionError" in checks.cell_failures(nb)["square_tests"]
    test_cell.outputs = [new_output("execute_result", data={"text/plain": "0.5"}, execution_count=1)]
    assert "partial credit" in checks.cell_failures(nb)["square_tests"]


@pytest.mark.slow
def test_release_as_released_flags_a_test_the_stubs_pass(tmp_path):
    _, release_path = _release_fixture(tmp_path, always_passing_test=True)
    problems = checks.release_as_released(release_path)
    assert list(problems) == ["quick_mode"], problems  # square_tests fails with the stub, as it must


def test_release_writes_the_install_location_into_the_first_cell(tmp_path, monkeypatch):
    from autograder.release import install_source

    monkeypatch.setenv("COURSE_INSTALL", "git+https://example.org/course@v1")
    nb = nbformat.read(generate_release("01_inference", release_dir=tmp_path, gradebook=None), as_version=4)
    cell = next(c for c in nb.cells if c.metadata.get("nbgrader", {}).get("grade_id") == "colab_install")
    assert 'COURSE_INSTALL = "git+https://example.org/course@v1"' in cell.source
    monkeypatch.delenv("COURSE_INSTALL")
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\n\n[tool.course]\ninstall = "llm-inference-course==0.1.0"\n')
    assert install_source(pyproject) == "llm-inference-course==0.1.0"
    pyproject.write_text('[tool.course]\ninstall = ""\n')
    assert install_source(pyproject) == ""
    # as released with no location, the cell stops with a message on a machine without the course
    source = cell.source.replace('COURSE_INSTALL = "git+https://example.org/course@v1"', 'COURSE_INSTALL = ""')
    source = source.replace('importlib.util.find_spec("course") is None', "True")
    with pytest.raises(RuntimeError, match="install location"):
        exec(source, {})


def test_make_release_passes_its_labs_on():
    """`make release LABS=...` releases those labs only (it used to release all twelve)."""
    import subprocess

    dry = subprocess.run(["make", "--no-print-directory", "-n", "release", "LABS=01_inference 03_kv_cache"], cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    assert "-m autograder.release 01_inference 03_kv_cache" in dry, dry


# --- written answers (manually graded markdown cells) ----------------------------------------------

def _answer_cells(nb) -> dict:
    return {c.metadata.nbgrader["grade_id"]: c for c in nb.cells
            if c.metadata.get("nbgrader", {}).get("grade") and is_solution(c)}


def _model_lines(cell) -> list[str]:
    """The stripped lines of an answer cell's model answer and rubric (between the solution markers)."""
    region = cell.source.partition(checks.SOLUTION_MARKERS[0])[2].partition(checks.SOLUTION_MARKERS[1])[0]
    return [line.strip() for line in region.splitlines() if line.strip()]


@pytest.mark.parametrize("lab", _per_lab("release"))
def test_release_keeps_written_answer_cells_as_stubs(lab, released):
    """Each written answer reaches the student as an editable markdown cell with its grading metadata,
    its heading (which questions, how many points) and nbgrader's stub, without the model answer or
    the rubric."""
    source = _answer_cells(nbformat.read(lab_notebook(lab), as_version=4))
    release = _answer_cells(nbformat.read(released(lab), as_version=4))
    assert source and set(release) == set(source), f"{lab}: answer cells lost in the release: {set(source) - set(release)}"
    for gid, cell in source.items():
        got = release[gid]
        assert got.cell_type == "markdown", f"{lab}: {gid} is released as a {got.cell_type} cell"
        for key in ("grade", "solution", "locked", "points"):
            assert got.metadata.nbgrader.get(key) == cell.metadata.nbgrader.get(key), f"{lab}: {gid}: {key} changed"
        head = cell.source.partition(checks.SOLUTION_MARKERS[0])[0].strip()
        assert got.source.strip() == f"{head}\n\nYOUR ANSWER HERE", f"{lab}: {gid} released as {got.source!r}"
        assert not [line for line in _model_lines(cell) if line in got.source], f"{lab}: {gid} shows its model answer"


def test_written_answer_of_fixture_lab_release_full_solution_and_repair(tmp_path):
    """A lab with a written answer: the release stubs it (the gradebook learns it as a graded cell),
    the leak check catches its model answer, the fixture's honest student gets the model answer, and
    repair keeps what a student wrote there, and re-adds a deleted answer as the stub, never the model."""
    from autograder.fixtures import full_solution
    from autograder.grade.repair import repair

    cells = [
        authoring.md("# Fixture lab"),
        authoring.locked("setup", "import course\nenv = course.setup()"),
        authoring.solution("square", "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION"),
        authoring.tests("square_tests", 2, "assert square(3) == 9, 'square(3) is 9'"),
        authoring.md("**Questions** (1 point in all)\n1. Why is a square never negative?"),
        authoring.answer("why_answer", 1, "question 1", model="A negative number times itself is positive.",
                         rubric="- 1 point: the product of two numbers of the same sign."),
    ]
    source_path = authoring.write_notebook(tmp_path / "labs" / "00_written" / "00_written.ipynb", cells)
    release_path = generate_release("00_written", tmp_path / "labs", tmp_path / "release", tmp_path / "gradebook.db")
    source, release = (nbformat.read(p, as_version=4) for p in (source_path, release_path))
    with Gradebook(f"sqlite:///{tmp_path / 'gradebook.db'}") as gb:
        cell = gb.find_grade_cell("why_answer", "00_written", "00_written")
        assert (cell.cell_type, cell.max_score) == ("markdown", 1.0)
    stub = _answer_cells(release)["why_answer"]
    assert stub.source == "**Your answer to question 1** (1 point, graded by hand):\n\nYOUR ANSWER HERE"
    assert checks.release_leaks(release, source) == []
    leaked = checks.release_leaks(source, source)
    assert any("A negative number times itself" in s for s in leaked) and any("1 point: the product" in s for s in leaked)

    full = _answer_cells(full_solution(release, source))["why_answer"]
    assert "A negative number times itself is positive." in full.source and "SOLUTION" not in full.source

    mine = nbformat.from_dict(release)
    _answer_cells(mine)["why_answer"].source = "Because minus times minus is plus."
    _answer_cells(mine)["why_answer"].metadata.nbgrader["points"] = 5                   # a student's edit
    fixed = repair(mine, source, release)
    kept = _answer_cells(fixed.nb)["why_answer"]
    assert kept.source == "Because minus times minus is plus." and kept.metadata.nbgrader["points"] == 1
    assert fixed.kinds[fixed.nb.cells.index(kept)] == "manual"

    gone = nbformat.from_dict(release)
    gone.cells = [c for c in gone.cells if c.metadata.get("nbgrader", {}).get("grade_id") != "why_answer"]
    fixed = repair(gone, source, release)
    readded = _answer_cells(fixed.nb)["why_answer"]
    assert readded.source == stub.source and "readded-cell" in {f.code for f in fixed.flags}
