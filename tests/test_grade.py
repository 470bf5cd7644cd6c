"""`make grade` (autograder/grade/) on a simulated class, and each of its defenses on its own.

Fast (no kernel): repair, the static scan, zip and class-list collection, feedback lines, self_check,
the fixture specs' wrong answers still finding their lines.
Defenses (tiny notebooks, a few seconds each): every tamper defense is run with and without the
guard, so each test shows the attack working without it and failing with it.
Slow (the fixture class of autograder/fixtures/, graded once per session with JOBS=2 as `make grade`
does: tests/conftest.py):
- every lab: an honest, a blank, a yes-man and a patcher student (planted mistakes + patched
  comparisons), plus an absent one: exact scores and flags;
- lab 01: the hostile students (tampering, escapes, bombs, crashes, damaged notebooks) with a
  short cell timeout: exact scores and flags, no escape succeeded, nothing left running;
- no feedback page holds a hidden test or a solution line the student did not write; the
  gradebook, grades.csv and the class report agree with the outcomes.
Labs are found at run time: a new lab is graded here with its spec, or with generic fixtures.
"""
from __future__ import annotations

import asyncio
import copy
import csv
import hashlib
import io
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest
import torch
from nbconvert import HTMLExporter
from nbgrader.api import Gradebook

from autograder import REPO, authoring, lab_names, lab_notebook
from autograder.fixtures import HOSTILE_LAB, build_class, full_solution, reads, without_demos
from autograder.grade import collect, tamper
from autograder.grade.execute import RunLimits, run_notebook
from autograder.grade.feedback import result_line
from autograder.grade.outcome import CellResult, Outcome
from autograder.grade.repair import cell_kind, grade_id, repair
from autograder.grade.sandbox import Sandbox
from autograder.grade.worker import checkpoints, score
from autograder.release import generate_release
from classroom import check_expectations, feedback_leaks, grade_class
from course.selfcheck import check_cells, find_notebook

LAB_NAMES = lab_names()


@pytest.fixture(scope="module")
def lab01(tmp_path_factory):
    """(source, release) of lab 01, the release generated without a gradebook."""
    rel = generate_release(HOSTILE_LAB, release_dir=tmp_path_factory.mktemp("rel"), gradebook=None)
    return nbformat.read(lab_notebook(HOSTILE_LAB), as_version=4), nbformat.read(rel, as_version=4)


# --- repair ----------------------------------------------------------------------------------------

def test_repair_restores_readds_and_deduplicates(lab01):
    source, release = lab01
    from autograder.fixtures.hostile import _damaged

    fixed = repair(_damaged(full_solution(release, source)), source, release)
    assert {f.short() for f in fixed.flags} == {"readded-cell(greedy_generate_loop)", "dropped-duplicate(next_token_probs)",
                                               "restored-locked(top_k_table_tests)",
                                               "repaired-metadata(greedy_generate_matches_hf)"}
    ids = [grade_id(c) for c in fixed.nb.cells if grade_id(c)]
    assert ids == [grade_id(c) for c in source.cells if grade_id(c)], "graded cells back, once each, in order"
    tests = {grade_id(c): c for c in fixed.nb.cells if cell_kind(c) == "test"}
    src_tests = {grade_id(c): c for c in source.cells if cell_kind(c) == "test"}
    assert all(tests[g].source == src_tests[g].source for g in tests), "tests run as in the source (hidden part too)"
    assert tests["greedy_generate_matches_hf"].metadata.nbgrader["points"] == 3
    assert not any(c.get("outputs") for c in fixed.nb.cells if c.cell_type == "code")


def test_repair_keeps_the_first_copy_that_is_still_an_answer_and_never_adds_solutions(lab01):
    source, release = lab01
    nb = full_solution(release, source)
    at = next(i for i, c in enumerate(nb.cells) if grade_id(c) == "top_k_table")
    copy_ = nbformat.from_dict(nb.cells[at])
    nb.cells[at].metadata.nbgrader["solution"] = False        # the first copy lost its answer flag
    nb.cells.insert(at + 1, copy_)
    nb.cells = [c for c in nb.cells if grade_id(c) != "greedy_generate"]     # an answer deleted
    fixed = repair(nb, source, release)
    kept = [i for i, c in enumerate(fixed.nb.cells) if grade_id(c) == "top_k_table"]
    assert kept == [at + 1] and fixed.kinds[at] == "student", "the copy still marked as an answer keeps the id"
    readded = next(c for c in fixed.nb.cells if grade_id(c) == "greedy_generate")
    assert "raise NotImplementedError()" in readded.source and "### BEGIN SOLUTION" not in readded.source


def test_written_answers_count_as_answered_only_with_the_students_own_words(lab01):
    from autograder.grade.worker import written

    source, release = lab01
    nb = copy.deepcopy(release)
    answers = [c for c in nb.cells if cell_kind(c) == "manual"]
    assert len(answers) >= 2, "lab 01 has written answers"
    answers[0].source = answers[0].source.partition("\n")[2].strip()      # heading deleted, stub kept: blank
    heading = answers[1].source.partition("\n")[0]
    answers[1].source = heading                                             # stub deleted, heading kept: blank
    out = Outcome("s", HOSTILE_LAB)
    written(out, nb, release)
    assert [m.answered for m in out.manual] == [False] * len(answers)
    assert out.flags[0].code == "needs-manual-grading" and out.flags[0].detail.startswith("0 of ")
    answers[1].source = heading + "\n\nThe model reads every earlier token again at each step."
    out = Outcome("s", HOSTILE_LAB)
    written(out, nb, release)
    assert [m.answered for m in out.manual][:2] == [False, True]


def test_repair_of_another_labs_notebook_says_so(lab01, tmp_path):
    source, release = lab01
    other = LAB_NAMES[1] if len(LAB_NAMES) > 1 and LAB_NAMES[0] == HOSTILE_LAB else LAB_NAMES[0]
    wrong = nbformat.read(generate_release(other, release_dir=tmp_path, gradebook=None), as_version=4)
    assert repair(wrong, source, release).known_ids == 0


def test_a_lab_without_a_fixture_spec_gets_generic_fixtures():
    from autograder.fixtures import lab_spec, with_bug

    source = nbformat.v4.new_notebook(cells=[
        authoring.locked("setup", "import course"),
        authoring.solution("double", "def double(x):\n    ### BEGIN SOLUTION\n    return 2 * x\n    ### END SOLUTION"),
        authoring.tests("double_tests", 1, "assert double(2) == 4"),
        authoring.solution("quad", "def quad(x):\n    ### BEGIN SOLUTION\n    return double(double(x))\n    ### END SOLUTION"),
        authoring.tests("quad_tests", 2, "assert quad(1) == 4"),
    ])
    bugs = lab_spec("99_no_spec", source)
    assert bugs[0].cell == "double" and set(bugs[0].fails) == {"double_tests", "quad_tests"}, "quad is built on double"
    full = nbformat.v4.new_notebook(cells=[nbformat.from_dict(c) for c in source.cells])
    assert "return None" in with_bug(full, "99_no_spec", bugs[0]).cells[1].source


def test_every_documented_wrong_answer_still_finds_its_line():
    """Each spec's planted mistakes (BUGS, graded in the simulated class below) and documented ones
    (MORE_BUGS, run by hand with `python -m autograder.fixtures.more_bugs LAB`) still find the line they
    change in the lab's source, change it, and name test cells the lab has: a lab edit that leaves one
    stale fails here, not at the next hand run."""
    import importlib

    from autograder.fixtures import StaleSpec, grade_id, with_bug

    problems = []
    for lab in LAB_NAMES:
        try:
            spec = importlib.import_module(f"autograder.fixtures.specs.l{lab}")
        except ModuleNotFoundError:
            continue
        source = nbformat.read(lab_notebook(lab), as_version=4)
        ids = {grade_id(c) for c in source.cells}
        crash = getattr(spec, "CRASH", None)
        for bug in [*spec.BUGS, *getattr(spec, "MORE_BUGS", []), *([crash.bug] if crash else [])]:
            try:
                planted = with_bug(source, lab, bug)
            except StaleSpec as e:
                problems.append(str(e))
                continue
            if [c.source for c in planted.cells] == [c.source for c in source.cells]:
                problems.append(f"{lab}: bug {bug.name!r} changes nothing")
            missing = sorted(set(bug.fails) - ids)
            if not bug.fails or missing:
                problems.append(f"{lab}: bug {bug.name!r} must name test cells of the lab that fail; "
                                f"names {list(bug.fails)}" + (f", of which the lab lacks {missing}" if missing else ""))
    assert not problems, "\n".join(problems)


def test_every_documented_wrong_answer_has_a_hint():
    """Each planted mistake names the words its failing test's message must hold (checked when the
    class is graded, and by `python -m autograder.fixtures.more_bugs LAB`)."""
    import importlib

    missing = []
    for lab in LAB_NAMES:
        try:
            spec = importlib.import_module(f"autograder.fixtures.specs.l{lab}")
        except ModuleNotFoundError:
            continue
        missing += [f"{lab}: {b.name}" for b in [*spec.BUGS, *getattr(spec, "MORE_BUGS", [])] if len(b.hint) < 4]
    assert not missing, "give these bugs a hint (words their test's message must say):\n" + "\n".join(missing)


def test_the_yes_man_replaces_every_kind_of_solution_region():
    from autograder.fixtures.impostors import YES_CLASS, yes_answer

    cell = ("import torch\n\ndef f(x):\n    y = x\n    ### BEGIN SOLUTION\n    if y:\n        return y + 1\n"
            "    return 0\n    ### END SOLUTION\n\n\nclass A:\n    def __init__(self):\n        self.n = 0\n\n"
            "    def g(self):\n        for i in range(3):\n            ### BEGIN SOLUTION\n            self.n += i\n"
            "            ### END SOLUTION\n        return self.n\n\n### BEGIN SOLUTION\nLIMIT = 3\ndef h(a, b=2):\n"
            "    return a * b\nclass B:\n    pass\n### END SOLUTION\n")
    ns = {}
    exec(YES_CLASS + "\n" + yes_answer(cell), ns)
    Yes = ns["Yes"]
    assert type(ns["f"](1)) is Yes and type(ns["A"]().g()) is Yes, "answers inside functions return the look-alike"
    assert type(ns["LIMIT"]) is Yes and type(ns["h"](1)) is Yes and issubclass(ns["B"], Yes), "module-level answers rebound"
    assert ns["f"](1) == 42 and torch.equal(ns["f"](1), torch.zeros(3)), "the look-alike agrees with everything"


# --- static scan -----------------------------------------------------------------------------------

@pytest.mark.parametrize("code, what", [
    ("torch.allclose = lambda *a, **k: True", "assigns into torch.allclose"),
    ("import builtins\nbuiltins.abs = abs", "imports builtins"),
    ("setattr(torch, 'equal', f)", "setattr() on torch"),
    ("hf_model.generate = my_loop", "replaces hf_model.generate"),
    ("get_ipython().run_cell = f", "get_ipython"),
    ("import sys\ndel sys.modules['x']", "sys.modules"),
    ("class Always:\n    def __eq__(self, other):\n        return True", "can fake comparisons"),
    ("exec('x = 1')", "exec"),
])
def test_scan_flags_tampering_tools(code, what):
    found = tamper.scan(code, {"torch", "np"}, {"hf_model"})
    assert any(what in f.what for f in found), found


@pytest.mark.parametrize("lab", LAB_NAMES)
def test_scan_is_quiet_on_every_labs_own_solution(lab):
    source = nbformat.read(lab_notebook(lab), as_version=4)
    aliases = tamper.import_aliases([c.source for c in source.cells if c.cell_type == "code"])
    mods = {a for a, (m, _) in aliases.items() if m.split(".")[0] in tamper.GUARDED_ROOTS}
    for cell in source.cells:
        if cell_kind(cell) == "solution":
            from autograder.fixtures import answer_source

            assert tamper.scan(answer_source(cell), mods, tamper.given_objects(source) - mods) == [], grade_id(cell)
            assert tamper.package_answers(answer_source(cell), tamper.graded_answers(source), aliases) == [], grade_id(cell)


# --- collection ------------------------------------------------------------------------------------

def test_zip_layouts_and_class_list(tmp_path):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("class/alice/01_inference.ipynb", "{}")
        zf.writestr("bob/01_inference/01_inference.ipynb", "{}")
        zf.writestr("hw_carol_attempt_2026-03-09-09-36-17_01_inference.ipynb", "old")
        zf.writestr("hw_carol_attempt_2026-03-10-09-00-00_01_inference.ipynb", "new")
        zf.writestr("__MACOSX/alice/._01_inference.ipynb", "junk")
        zf.writestr("readme.txt", "hello")
        zf.writestr("../evil/01_inference.ipynb", "{}")
    (tmp_path / "in.zip").write_bytes(buf.getvalue())
    got, skipped = collect.extract_zip(tmp_path / "in.zip", tmp_path / "sub", ["01_inference"])
    assert got == [("alice", "01_inference"), ("bob", "01_inference"), ("carol", "01_inference")]
    assert (tmp_path / "sub/carol/01_inference/01_inference.ipynb").read_text() == "new", "the latest attempt wins"
    assert (tmp_path / "sub/carol/01_inference/timestamp.txt").read_text() == "2026-03-10 09:00:00"
    assert {"readme.txt", "../evil/01_inference.ipynb"} <= set(skipped) and not (tmp_path / "evil").exists()
    (tmp_path / "c.csv").write_text("id,name,email\nalice,Alice A,a@x\nbob,,\n")
    assert [s.id for s in collect.read_students(tmp_path / "c.csv")] == ["alice", "bob"]
    (tmp_path / "bad.csv").write_text("who,email\nalice,a@x\n")
    with pytest.raises(ValueError, match="STUDENTS.*id"):
        collect.read_students(tmp_path / "bad.csv")


# --- feedback lines and self-check ----------------------------------------------------------------

def test_feedback_line_shows_a_hidden_tests_message_but_never_its_code():
    cell = nbformat.v4.new_code_cell("assert f(1) == 1, 'visible'\n### BEGIN HIDDEN TESTS\n"
                                     "assert f(2) == 4, 'softmax over the last dim?'\n### END HIDDEN TESTS", execution_count=7)
    res = CellResult("t", 2, 0, "failed")
    cell.outputs = [nbformat.v4.new_output("error", ename="AssertionError", evalue="softmax over the last dim?",
                                           traceback=["\x1b[36mCell In[7], line 3\x1b[39m", "AssertionError: softmax..."])]
    line = result_line(cell, res)
    assert line == "FAILED (0/2): a hidden test failed: softmax over the last dim?" and "f(2) == 4" not in line
    off = result_line(cell, res, hidden_messages=False)
    assert "hidden test failed (AssertionError)" in off and "softmax" not in off, "the instructor can turn messages off"
    cell.outputs[0].update(ename="TypeError", evalue="f() takes 0 positional arguments but 1 was given")
    assert result_line(cell, res).endswith("a hidden test failed: TypeError: f() takes 0 positional arguments but 1 was given")
    cell.outputs[0].update(ename="AssertionError", evalue="visible", traceback=["Cell In[7], line 1", "AssertionError: visible"])
    assert "line 1: AssertionError: visible" in result_line(cell, res)


def test_feedback_lists_the_cases_a_partial_credit_cell_lost():
    from course.expect import Cases

    from autograder.grade.feedback import CASE_MARK

    assert CASE_MARK == Cases.MARK, "the feedback page finds the failed cases by the mark Cases prints"
    cell = nbformat.v4.new_code_cell("cases.score()", execution_count=3)
    cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text=f"1 of 4 cases failed (3 of 4 points):\n"
                                           f"{Cases.MARK}temperature=-1: a 400 naming temperature\n"),
                    nbformat.v4.new_output("execute_result", data={"text/plain": "3.0"}, execution_count=3)]
    line = result_line(cell, CellResult("t", 4, 3.0, "partial"))
    assert line.startswith("PARTIAL (3/4): these cases failed:") and "temperature=-1: a 400 naming temperature" in line


def test_feedback_summarizes_a_demo_that_failed_after_an_answer_did(lab01):
    """A demo of the lab that fails because an earlier answer failed shows one line, not a traceback;
    flag details keep their underscores (Markdown would make __init__ bold)."""
    from autograder.grade.feedback import feedback_notebook
    from autograder.grade.outcome import Flag

    source, release = lab01
    graded = full_solution(release, source)
    demo = next(i for i, c in enumerate(graded.cells) if cell_kind(c) == "plain" and c.cell_type == "code"
                and i > next(j for j, c in enumerate(graded.cells) if grade_id(c) == "next_token_probs_tests"))
    tb = ["\x1b[31mNameError\x1b[39m Traceback (most recent call last)", "Cell In[9], line 1", "NameError: name 'probs' is not defined"]
    graded.cells[demo].outputs = [nbformat.v4.new_output("error", ename="NameError", evalue="name 'probs' is not defined",
                                                         traceback=tb)]
    cells = [CellResult(grade_id(c), float(c.metadata.nbgrader.points), 0.0 if grade_id(c) == "next_token_probs_tests"
                        else float(c.metadata.nbgrader.points), "failed" if grade_id(c) == "next_token_probs_tests" else "passed")
             for c in source.cells if cell_kind(c) == "test"]
    outcome = Outcome("s", HOSTILE_LAB, cells=cells, flags=[Flag("suspicious", "line 2: replaces x.__init__")])
    nb = feedback_notebook(graded, outcome, source, release)
    shown = nb.cells[demo + 1].outputs
    assert [o.output_type for o in shown] == ["stream"] and "next_token_probs_tests" in shown[0].text
    assert "NameError: name 'probs' is not defined" in shown[0].text and "Traceback" not in shown[0].text
    assert "x.\\_\\_init\\_\\_" in nb.cells[0].source


def test_self_check_runs_visible_tests_in_this_namespace(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        authoring.solution("sq", "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION"),
        authoring.tests("sq_ok", 1, "assert square(3) == 9"),
        authoring.tests("sq_bad", 2, "assert square(2) == 5, 'square(2) is 4'"),
        authoring.tests("sq_warn", 1, "import sys\nprint('careful', file=sys.stderr)"),
    ])
    path = tmp_path / "lab.ipynb"
    nbformat.write(nb, path)
    ns = {"square": lambda x: x * x}
    checks = check_cells(find_notebook(namespace={"__session__": str(path)}), ns)
    assert [(c.grade_id, c.passed) for c in checks] == [("sq_ok", True), ("sq_bad", False), ("sq_warn", False)]
    assert "square(2) is 4" in checks[1].message and "stderr" in checks[2].message


def test_self_check_reads_partial_credit_and_finds_the_notebook_headless(tmp_path, monkeypatch):
    """A Cases cell's numeric last value is partial credit, to self_check as to nbgrader; run headless
    (nbconvert, papermill: no session path), self_check takes the one lab in the working directory."""
    cases = ("from course.expect import Cases\ncases = Cases(points=2)\nfor x in range(4):\n"
             "    with cases(f'square({x})'):\n        assert square(x) == x * x, 'x times x'\ncases.score()")
    nb = nbformat.v4.new_notebook(cells=[authoring.tests("sq_cases", 2, cases)])
    nbformat.write(nb, tmp_path / "lab.ipynb")
    (tmp_path / "notes.ipynb").write_text(nbformat.writes(nbformat.v4.new_notebook()))   # not a lab: ignored
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    found = find_notebook(namespace={})
    assert check_cells(found, {"square": lambda x: x * x})[0].passed
    half = check_cells(found, {"square": lambda x: x * x if x < 2 else 0})[0]
    assert not half.passed and "partial credit 1 of 2" in half.message and "square(2): x times x" in half.message


@pytest.mark.slow
def test_self_check_runs_in_a_headless_kernel(tmp_path):
    """self_check() as the last cell of a notebook that nbconvert/papermill execute (no session path
    in the kernel): it finds the notebook in its folder and reports its tests."""
    from autograder.checks import execute_notebook

    nb = nbformat.v4.new_notebook(cells=[
        authoring.solution("sq", "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION"),
        authoring.tests("sq_ok", 1, "assert square(3) == 9, 'square(3) is 9'"),
        nbformat.v4.new_code_cell("from course.selfcheck import self_check\nchecks = self_check()"),
    ])
    nbformat.write(nb, tmp_path / "lab.ipynb")
    done = execute_notebook(tmp_path / "lab.ipynb", timeout=120)
    shown = "".join(o.get("text", "") for o in done.cells[-1].outputs)
    assert not any(o.output_type == "error" for o in done.cells[-1].outputs), done.cells[-1].outputs
    assert "pass  sq_ok" in shown and "1 of 1 points pass" in shown, shown


# --- each tamper defense, with and without the guard ----------------------------------------------

PATCHES = [
    ("locked", "setup", "import builtins, threading, time, torch\n\nclass Ref:\n    def value(self):\n        return 1\n\n"
                        "ref = Ref()\n\ndef helper(x):\n    return x + 1"),
    ("solution", "f", "def f(x):\n    return -x\nbuiltins.abs = lambda x: 0"),
    ("test", "f_tests", "assert abs(f(2) - 2) < 1e-9"),
    ("solution", "g", "def g():\n    return torch.zeros(2)\ntorch.equal = lambda *a, **k: True"),
    ("test", "g_tests", "assert torch.equal(g(), torch.ones(2))"),
    ("solution", "h", "def h():\n    return 5\nhelper = lambda x: 7"),
    ("test", "h_tests", "assert helper(h()) == 7"),
    ("solution", "m", "def m():\n    return 2\nref.value = lambda: 2"),
    ("test", "m_tests", "assert ref.value() == m()"),
    ("solution", "k", "_real = torch.allclose\ndef k():\n    torch.allclose = lambda *a, **kw: True\n"
                      "    threading.Timer(0.2, lambda: setattr(torch, 'allclose', _real)).start()\n    return torch.zeros(2)"),
    ("test", "k_tests", "x = k()\nassert torch.allclose(x, torch.ones(2))\ntime.sleep(1)"),
]
SKIP_ASSERTS = [
    ("locked", "setup", "import torch"),
    ("solution", "f", "def f():\n    raise NotImplementedError()\nip = get_ipython()\n_run = ip.run_cell\n"
                      "ip.run_cell = lambda cell, *a, **k: _run('pass' if 'assert' in cell else cell, *a, **k)"),
    ("test", "f_tests", "assert f() == 1"),
]


def _grade_tiny(tmp_path: Path, cells: list[tuple[str, str, str]], guarded: bool = True, aliases=None) -> Outcome:
    makers = {"locked": authoring.locked, "solution": lambda g, s: authoring.solution(g, "### BEGIN SOLUTION\n" + s),
              "test": lambda g, s: authoring.tests(g, 1, s)}
    nb = nbformat.v4.new_notebook(cells=[makers[k](g, s) for k, g, s in cells])
    source = nbformat.v4.new_notebook(cells=[makers[k](g, "pass" if k == "solution" else s) for k, g, s in cells])
    kinds = [cell_kind(c) for c in nb.cells]
    run = asyncio.run(run_notebook(nb, kinds, Sandbox(run_dir=tmp_path / f"run{guarded}", lab="tiny"),
                                   RunLimits(cell_timeout=60, budget=300), checkpoints(nb, kinds, source),
                                   aliases or {"torch": ["torch", None]}, guarded=guarded))
    out = Outcome("s", "tiny", max_score=sum(k == "test" for k in kinds))
    score(out, run, kinds, {})
    return out


@pytest.mark.slow
def test_guard_restores_patches_and_zeroes_tests_patched_while_they_run(tmp_path):
    unguarded = _grade_tiny(tmp_path, PATCHES, guarded=False)
    assert unguarded.score == 5, f"each attack must work without the guard: {unguarded.cells}"
    out = _grade_tiny(tmp_path, PATCHES)
    assert out.score == 0, out.cells
    details = " ".join(f.detail for f in out.flags if f.code == "patched")
    for what in ("builtins.abs", "torch.equal", "helper", "ref.value"):
        assert what in details, f"{what} not reported: {details}"
    assert {f.short() for f in out.flags if f.code == "tampered"} == {"tampered(k_tests)"}, \
        "a patch undone right after the test (module write log) zeroes that test"


@pytest.mark.slow
def test_guard_restores_ipython_so_asserts_run(tmp_path):
    assert _grade_tiny(tmp_path, SKIP_ASSERTS, guarded=False).score == 1, "without the guard the assert is skipped"
    out = _grade_tiny(tmp_path, SKIP_ASSERTS)
    assert out.score == 0 and any("run_cell" in f.detail for f in out.flags if f.code == "patched")


@pytest.mark.slow
def test_an_import_of_a_name_the_package_rebinds_is_not_a_patch(tmp_path):
    # course.widgets binds `cache_blocks` to the function although a submodule of that name exists:
    # `from course.widgets import cache_blocks` gives the function, and that is no tampering
    cells = [("locked", "setup", "import torch\nfrom course.widgets import cache_blocks"),
             ("solution", "f", "from course.widgets import cache_blocks"),
             ("test", "f_tests", "import types\nassert not isinstance(cache_blocks, types.ModuleType)")]
    out = _grade_tiny(tmp_path, cells, aliases={"torch": ["torch", None], "cache_blocks": ["course.widgets", "cache_blocks"]})
    assert out.score == 1 and not out.flags, out.flags


FIND_GUARD = "import sys, types, json\nname = [n for n in sys.modules if n.startswith('_course_grader')][0]\n"


@pytest.mark.slow
@pytest.mark.parametrize("attack, why", [
    (FIND_GUARD + "fake = types.ModuleType(name)\nfake._call = lambda op, args='{}': json.dumps({'body': json.dumps("
                   "{'found': [], 'log': [], 'threads': [], 'seq': 1}), 'sig': '0' * 64})\nsys.modules[name] = fake",
     "signature"),
    (FIND_GUARD + "saved = sys.modules[name]._call('post')\nfake = types.ModuleType(name)\n"
                  "fake._call = lambda op, args='{}': saved\nsys.modules[name] = fake", "sequence"),
])
def test_a_forged_or_replayed_guard_is_caught(tmp_path, attack, why):
    cells = [("locked", "setup", "import torch"), ("solution", "f", attack), ("test", "f_tests", "assert True")]
    out = _grade_tiny(tmp_path, cells)
    broken = [f for f in out.flags if f.code == "guard-broken"]
    assert broken and why in broken[0].detail and out.score == 0, out.flags


# --- the simulated class ---------------------------------------------------------------------------

@pytest.mark.parametrize("code, names", [
    ("x = y + 1\nprint(x)", {"y", "print"}),                           # bound here, then read: not needed
    ("for name, p in items:\n    print(name, p)", {"items", "print"}),
    ("def f(a, b=c):\n    z = a + g\n    return z\nf(1)", {"c", "g"}),  # a body reads what it does not bind
    ("x += 1", {"x"}),
    ("[t for t in ts if t > k]\nt", {"ts", "k", "t"}),                 # a comprehension's names stay inside
    ("import torch\ntorch.ones(1)", set()),
    ("try:\n    pass\nexcept E as e:\n    print(e)", {"E", "print"}),
    ("obj.attr = v", {"obj", "v"}),
    ("class A(B):\n    n = 1\n    def m(self):\n        return n2", {"B", "n2"}),
])
def test_reads_finds_what_a_cell_needs_from_earlier_cells(code, names):
    assert reads(code) == names


def test_without_demos_keeps_what_the_tests_read(lab01):
    source, release = lab01
    full = full_solution(release, source)
    slim = without_demos(full, source)
    kept = [c.source for c in slim.cells]
    for cell in full.cells:
        if cell_kind(cell) != "plain" or cell.cell_type == "markdown":
            assert cell.source in kept, f"a {cell_kind(cell)} cell was left out"
    plain = [c for c in full.cells if c.cell_type == "code" and cell_kind(c) == "plain"]
    assert any("hf_model = " in c.source for c in slim.cells), "the hidden tests read hf_model: its cell stays"
    dropped = [c.source for c in plain if c.source not in kept]
    assert any("register_forward_hook" in s for s in dropped), "the generate demo feeds no test: left out"
    assert 0 < len(dropped) < len(plain)


@pytest.fixture(scope="module")
def graded_hostile(tmp_path_factory):
    """Lab 01's hostile students, with a 90 s cell timeout and 64 processes. The infinite loop waits out
    the timeout. Lab 01's slowest test cell takes 15-19 s here on 2 cores with 2 other busy processes,
    and once took over 45 s on a CI runner (a wrong loop that never stops early): 90 s leaves it room."""
    root = tmp_path_factory.mktemp("hostile")
    targets = (str(root / "gradebook.db"), str(lab_notebook(HOSTILE_LAB)),
               str(root / "submitted" / "patch-builtins" / HOSTILE_LAB / f"{HOSTILE_LAB}.ipynb"))
    subs = [s for s in build_class(labs=[HOSTILE_LAB], release_dir=root / "fixture-release", targets=targets)
            if s.student not in {"full", "blank", "yesman", "patcher"}]
    source_hash = hashlib.sha256(lab_notebook(HOSTILE_LAB).read_bytes()).hexdigest()
    result = _grade_class(root, subs, labs=[HOSTILE_LAB], cell_timeout=90, budget=900, processes=64)
    result["source_hash"] = source_hash
    return result


_grade_class, _check_expectations, _feedback_leaks = grade_class, check_expectations, feedback_leaks


@pytest.mark.slow
@pytest.mark.xdist_group("grade:class")
def test_class_scores(graded_class):
    _check_expectations(graded_class)
    absent = [o for (s, _), o in graded_class["outcomes"].items() if s == "absent"]
    assert len(absent) == len(LAB_NAMES) and all(o.status == "missing" and o.score == 0 for o in absent)


@pytest.mark.slow
@pytest.mark.xdist_group("grade:class")
def test_class_gradebook_csv_and_report_agree(graded_class):
    outcomes, root = graded_class["outcomes"], graded_class["root"]
    with open(root / "out" / "grades.csv") as f:
        rows = {(r["student"], r["lab"]): r for r in csv.DictReader(f)}
    assert set(rows) == set(outcomes)
    for key, o in outcomes.items():
        assert float(rows[key]["score"]) == o.score and float(rows[key]["max"]) == o.max_score
    with Gradebook(f"sqlite:///{root / 'gradebook.db'}") as gb:
        for (student, lab), o in outcomes.items():
            if o.status == "graded":
                assert gb.find_submission(lab, student).score == pytest.approx(o.score), (student, lab)
            for m in o.manual:      # written answers: formgrader lists the answered ones; a blank one scores 0
                grade = gb.find_grade(m.grade_id, lab, lab, student)
                assert (grade.needs_manual_grade, grade.auto_score) == ((True, None) if m.answered else (False, 0)), \
                    (student, lab, m)
        assert any(m.answered for o in outcomes.values() for m in o.manual), "the honest students answered in words"
        assert {s.id for s in gb.students} == {s for s, _ in outcomes}
    page = (root / "out" / "report.html").read_text()
    for lab in LAB_NAMES:
        assert f"<h2>{lab}</h2>" in page and "Pass rate per test cell" in page
    assert all((root / "autograded" / s / lab / f"{lab}.ipynb").is_file()
               for (s, lab), o in outcomes.items() if o.status == "graded")


@pytest.mark.slow
@pytest.mark.xdist_group("grade:class")
def test_class_feedback_names_each_planted_mistake(graded_class):
    """The patcher's planted mistakes (each lab spec's BUGS): the feedback line of the first test cell
    each one fails holds the bug's hint, i.e. the message names the mistake, not just a failure."""
    from autograder.fixtures import lab_spec

    root, problems = graded_class["root"], []
    for lab in sorted({lab for _, lab in graded_class["outcomes"]}):
        source = nbformat.read(lab_notebook(lab), as_version=4)
        graded = nbformat.read(root / "autograded" / "patcher" / lab / f"{lab}.ipynb", as_version=4)
        results = {c.grade_id: c for c in graded_class["outcomes"][("patcher", lab)].cells}
        cells = {grade_id(c): c for c in graded.cells if grade_id(c)}
        for bug in lab_spec(lab, source):
            line = result_line(cells[bug.fails[0]], results[bug.fails[0]])
            if bug.hint.lower() not in line.lower():
                problems.append(f"{lab} {bug.name}: {bug.fails[0]} says {line[:300]!r}; hint {bug.hint!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.slow
@pytest.mark.xdist_group("grade:class")
def test_class_feedback_leaks_nothing(graded_class):
    pages = list((graded_class["root"] / "feedback").rglob("*.html"))
    assert len(pages) == sum(o.status == "graded" for o in graded_class["outcomes"].values())
    leaks = _feedback_leaks(graded_class)
    assert not leaks, "feedback shows hidden tests or solutions:\n" + "\n".join(leaks[:20])
    # the check is not vacuous: the instructor's graded notebook, rendered as nbgrader would, leaks
    root = graded_class["root"]
    lab = LAB_NAMES[0]
    page = root / "naive" / "feedback" / "blank" / lab / f"{lab}.html"
    page.parent.mkdir(parents=True)
    page.write_text(HTMLExporter().from_filename(str(root / "autograded" / "blank" / lab / f"{lab}.ipynb"))[0])
    shutil.copytree(root / "submitted", root / "naive" / "submitted")
    assert _feedback_leaks({"root": root / "naive"}), "the leak check must see hidden tests in a naive rendering"


@pytest.mark.slow
@pytest.mark.xdist_group("grade:hostile")
def test_hostile_scores_and_flags(graded_hostile):
    _check_expectations(graded_hostile)


@pytest.mark.slow
@pytest.mark.xdist_group("grade:hostile")
def test_hostile_escapes_failed_and_nothing_is_left_running(graded_hostile):
    root = graded_hostile["root"]
    nb = nbformat.read(root / "autograded" / "escape" / HOSTILE_LAB / f"{HOSTILE_LAB}.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "no read" in printed and "no write" in printed and "no network" in printed
    assert not re.search(r"^(READ|WROTE|NETWORK OPEN)", printed, re.M), printed
    assert re.search(r"found \[[^\]]*\]", printed) and "01_inference.ipynb" not in re.search(r"found \[[^\]]*\]", printed).group()
    assert b"tampered" not in (root / "gradebook.db").read_bytes()
    assert hashlib.sha256(lab_notebook(HOSTILE_LAB).read_bytes()).hexdigest() == graded_hostile["source_hash"]
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert "sleep 913" not in ps, "the detached process outlived grading"
    leaks = _feedback_leaks(graded_hostile)
    assert not leaks, "feedback shows hidden tests or solutions:\n" + "\n".join(leaks[:20])


@pytest.mark.slow
def test_cli_zip_class_list_and_loud_sandbox_off(tmp_path):
    """`make grade ZIP=... STUDENTS=... SANDBOX=off` on a tiny lab: unpacked, graded, flagged, missing listed."""
    labs = tmp_path / "labs"
    authoring.write_notebook(labs / "00_tiny" / "00_tiny.ipynb", [
        authoring.locked("setup", "import course\nenv = course.setup()"),
        authoring.solution("square", "def square(x):\n    ### BEGIN SOLUTION\n    return x * x\n    ### END SOLUTION"),
        authoring.tests("square_tests", 1, "assert square(3) == 9"),
    ])
    release = nbformat.read(generate_release("00_tiny", labs, tmp_path / "rel", gradebook=None), as_version=4)
    source = nbformat.read(labs / "00_tiny" / "00_tiny.ipynb", as_version=4)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("ann/00_tiny.ipynb", nbformat.writes(full_solution(release, source)))
        zf.writestr("ben/00_tiny.ipynb", nbformat.writes(release))
    (tmp_path / "dl.zip").write_bytes(buf.getvalue())
    (tmp_path / "class.csv").write_text("id,name,email\nann,Ann,a@x\ncid,Cid,c@x\n")
    folders = ["--sandbox", "off", "--labs-dir", str(labs), "--submitted", str(tmp_path / "sub"),
               "--autograded", str(tmp_path / "ag"), "--feedback", str(tmp_path / "fb"), "--out", str(tmp_path / "out"),
               "--gradebook", str(tmp_path / "gb.db"), "--timeout", "120"]

    def grade(*args):
        return subprocess.run([sys.executable, "-m", "autograder.grade", *args, *folders],
                              cwd=REPO, capture_output=True, text=True, timeout=600)

    done = grade("--zip", str(tmp_path / "dl.zip"), "--students", str(tmp_path / "class.csv"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SANDBOX=off" in done.stdout and "!!!" in done.stdout
    rows = {r["student"]: r for r in csv.DictReader(open(tmp_path / "out" / "grades.csv"))}
    assert rows["ann"]["score"] == "1" and "sandbox-off" in rows["ann"]["flags"]
    assert rows["ben"]["score"] == "0" and "unlisted" in rows["ben"]["flags"]
    assert rows["cid"]["score"] == "0" and rows["cid"]["flags"] == "missing"

    # re-grading one student replaces that student's row and keeps the others
    again = grade("--student", "ben")
    assert again.returncode == 0, again.stdout + again.stderr
    rows = {r["student"]: r for r in csv.DictReader(open(tmp_path / "out" / "grades.csv"))}
    assert set(rows) == {"ann", "ben", "cid"} and rows["ann"]["score"] == "1", "a re-grade must keep the other rows"
    # a misspelled student, and limits that would kill every kernel, stop before grading
    for args, word in ((("--student", "bne"), "bne"), (("--memory", "0"), "--memory"), (("--budget", "0"), "--budget")):
        bad = grade(*args)
        assert bad.returncode == 2 and word in bad.stderr, (args, bad.stdout[-500:], bad.stderr[-500:])


@pytest.mark.slow
def test_an_answer_that_calls_the_packages_copy_is_flagged_for_review(tmp_path):
    """The package holds labs' answers for later labs' given code (lab 07's apply_temperature is in
    course.engine.logits). A student who imports it, or wraps it, instead of writing the answer passes
    the tests; a real grading run flags each such line for the instructor (`package-answer`)."""
    labs = tmp_path / "labs"
    authoring.write_notebook(labs / "00_tiny" / "00_tiny.ipynb", [
        authoring.locked("setup", "import course\nimport torch\nenv = course.setup()"),
        authoring.solution("temperature", "def apply_temperature(logits, temperature):\n    ### BEGIN SOLUTION\n"
                           "    return logits / torch.as_tensor(temperature, dtype=logits.dtype)[:, None]\n    ### END SOLUTION"),
        authoring.tests("temperature_tests", 1, "assert torch.equal(apply_temperature(torch.ones(2, 3), [2.0, 4.0]), "
                        "torch.tensor([[0.5] * 3, [0.25] * 3]))"),
    ])
    release = nbformat.read(generate_release("00_tiny", labs, tmp_path / "rel", gradebook=None), as_version=4)
    source = nbformat.read(labs / "00_tiny" / "00_tiny.ipynb", as_version=4)
    honest = full_solution(release, source)
    copiers = {"imports": "from course.engine.logits import apply_temperature",
               "wraps": "from course.engine import logits as L\n\ndef apply_temperature(logits, temperature):\n"
                        "    return L.apply_temperature(logits, temperature)"}
    sub = tmp_path / "sub"
    for student, nb in [("honest", honest)] + [(name, copy.deepcopy(honest)) for name in copiers]:
        for cell in nb.cells:
            if student in copiers and cell_kind(cell) == "solution":
                cell.source = copiers[student]
        (sub / student / "00_tiny").mkdir(parents=True)
        nbformat.write(nb, sub / student / "00_tiny" / "00_tiny.ipynb")
    done = subprocess.run([sys.executable, "-m", "autograder.grade", "--sandbox", "off", "--labs-dir", str(labs),
                           "--submitted", str(sub), "--autograded", str(tmp_path / "ag"), "--feedback", str(tmp_path / "fb"),
                           "--out", str(tmp_path / "out"), "--gradebook", str(tmp_path / "gb.db"), "--timeout", "120"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {r["student"]: r for r in csv.DictReader(open(tmp_path / "out" / "grades.csv"))}
    assert all(rows[s]["score"] == "1" for s in rows), "the package's copy passes the tests: only a person can tell"
    assert "package-answer" not in rows["honest"]["flags"]
    assert all("package-answer" in rows[s]["flags"] for s in copiers), rows


def test_nbgrader_timestamps_are_read():
    from autograder.grade.gradebook import _parse_time
    assert _parse_time("2026-03-09 09:36:17.123456 UTC\n").isoformat() == "2026-03-09T09:36:17.123456", \
        "nbgrader collect writes timestamp.txt in this format"
    assert _parse_time("2026-03-09T09:36:17").day == 9 and _parse_time("not a time") is None


def test_feedback_pages_can_be_released_with_nbgrader(tmp_path):
    """`nbgrader release_feedback` reads the submission's timestamp and secret beside each page that
    `make grade` writes; without them it stops with FileNotFoundError."""
    from autograder.grade.pipeline import Config, _not_graded, _record
    from autograder.grade.worker import Job
    lab = "01_inference"
    sub = tmp_path / "submitted" / "alice" / lab
    sub.mkdir(parents=True)
    (sub / f"{lab}.ipynb").write_text("{}")
    (sub / "timestamp.txt").write_text("2026-03-10 09:00:00.000000 UTC")
    (sub / "submission_secret.txt").write_text("a1b2c3")
    source = lab_notebook(lab)
    job = Job("alice", lab, str(sub / f"{lab}.ipynb"), str(source), str(source), str(tmp_path / "work"))
    cfg = Config(submitted=tmp_path / "submitted", autograded=tmp_path / "autograded", feedback=tmp_path / "feedback",
                 gradebook=None, out=tmp_path / "autograded")
    _record(cfg, _not_graded("alice", lab, source, "missing", "no notebook"), job, None)
    page_dir = tmp_path / "feedback" / "alice" / lab
    assert (page_dir / "timestamp.txt").read_text().startswith("2026-03-10") and (page_dir / "submission_secret.txt").is_file()
    (tmp_path / "exchange").mkdir()
    run = subprocess.run([sys.executable, "-m", "nbgrader", "release_feedback", lab, "--course", "c",
                          f"--Exchange.root={tmp_path / 'exchange'}", f"--CourseDirectory.root={tmp_path}"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-1500:]
    assert list((tmp_path / "exchange" / "c" / "feedback").glob("*.html")), run.stderr[-1500:]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def formgrader_submissions(root: Path, lab: str, timeout: float = 90) -> list[dict]:
    """What nbgrader's formgrader (a real Jupyter server with its extension, in a course root made of
    `root`'s graded class) lists for `lab`: one dict per submitted notebook, as its Manual Grading page
    gets them from /formgrader/api/submitted_notebooks/LAB/LAB."""
    import json
    import os
    import time
    import urllib.request

    from autograder import LABS

    (root / "nbgrader_config.py").write_text(
        f"c = get_config()\nc.CourseDirectory.root = {str(root)!r}\n"
        f"c.CourseDirectory.source_directory = {os.path.relpath(LABS, root)!r}\n"
        f"c.CourseDirectory.db_url = {'sqlite:///' + str(root / 'gradebook.db')!r}\n")
    port, token = _free_port(), "formgrader-test"
    cmd = [sys.executable, "-m", "jupyter", "server", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
           f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}"] + (["--allow-root"] if os.geteuid() == 0 else [])
    server = subprocess.Popen(cmd, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/formgrader/api/submitted_notebooks/{lab}/{lab}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                request = urllib.request.Request(url, headers={"Authorization": f"token {token}"})
                with urllib.request.urlopen(request, timeout=10) as response:
                    return json.loads(response.read())
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise
                time.sleep(1)
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.xdist_group("grade:class")
def test_class_written_answers_wait_in_formgrader(graded_class):
    """`make formgrade`'s route, for real: formgrader's Manual Grading lists the honest student's
    written answers as needing a person, and not the blank student's (their stubs score 0)."""
    root, outcomes = graded_class["root"], graded_class["outcomes"]
    lab = next((lab for (s, lab), o in sorted(outcomes.items()) if s == "full" and o.manual), None)
    if lab is None:
        pytest.skip("no lab has written answers")
    listed = {n["student"]: n for n in formgrader_submissions(root, lab)}
    assert listed["full"]["needs_manual_grade"] and not listed["blank"]["needs_manual_grade"], listed
