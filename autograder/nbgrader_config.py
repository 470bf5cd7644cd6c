"""nbgrader configuration of the course. nbgrader reads it when run from `autograder/`;
`autograder.load_config()` reads it for the Python tools (`make release`, tests, grading).

- Course root: this folder; the gradebook is `autograder/gradebook.db`.
- Source notebooks: `labs/<lab>/<lab>.ipynb`, not nbgrader's default `source/<lab>/`. nbgrader builds
  every path as `<root>/<step dir>/<student>/<assignment>` and, to parse paths back, turns that
  into a regular expression in which only the root is escaped. A RELATIVE step directory "../labs"
  is therefore both a valid path and a safe pattern, wherever the repository is checked out.
- Assignments are the lab folder names (`autograder.lab_names()`: folders not starting with '_').
- Kernels inherit this process's environment: COURSE_QUICK=1 (demo workloads shrink, graded
  checks do not) is set here unless the caller chose otherwise (COURSE_QUICK=0 grades full size).
"""
import os
import sys

from nbgrader.converters import GenerateAssignment
from nbgrader.preprocessors import NbGraderPreprocessor

c = get_config()  # noqa: F821 (injected by traitlets when it executes this file)

HERE = os.path.dirname(os.path.abspath(__file__))
LABS = os.path.join(os.path.dirname(HERE), "labs")

c.CourseDirectory.root = HERE
c.CourseDirectory.source_directory = os.path.relpath(LABS, HERE)  # "../labs"
c.CourseDirectory.release_directory = "release"
c.CourseDirectory.db_url = "sqlite:///" + os.path.join(HERE, "gradebook.db")

os.environ.setdefault("COURSE_QUICK", "1")

# nbgrader opens the gradebook by running the `alembic` command found on PATH. Run as
# `.venv/bin/python` or `.venv/bin/nbgrader` without activating the venv (as make does), the
# venv's bin folder is not on PATH: put it there, or every gradebook access fails.
_bin = os.path.dirname(sys.executable)
if _bin not in os.environ.get("PATH", "").split(os.pathsep):
    os.environ["PATH"] = _bin + os.pathsep + os.environ.get("PATH", "")

# Execution when validating and autograding: loading the model takes seconds, a cold disk cache
# or a first-time conversion much longer; the default 30 s per cell would fail correct work.
# A cell past the limit is interrupted (the rest of the notebook still runs) and scored 0.
c.Execute.timeout = 600
c.Execute.startup_timeout = 120
c.Execute.interrupt_on_timeout = True

# Student versions: nbgrader's default stubs and markers, spelled out so they are greppable here.
c.ClearSolutions.code_stub = {"python": "# YOUR CODE HERE\nraise NotImplementedError()"}
c.ClearSolutions.text_stub = "YOUR ANSWER HERE"
c.ClearSolutions.begin_solution_delimeter = "BEGIN SOLUTION"  # sic: nbgrader's spelling
c.ClearSolutions.end_solution_delimeter = "END SOLUTION"
c.ClearSolutions.enforce_metadata = True
c.ClearHiddenTests.begin_test_delimeter = "BEGIN HIDDEN TESTS"
c.ClearHiddenTests.end_test_delimeter = "END HIDDEN TESTS"


class StripWidgetState(NbGraderPreprocessor):
    """Drop `metadata.widgets` (saved widget state): nbgrader keeps it in releases otherwise."""

    def preprocess(self, nb, resources):
        nb.metadata.pop("widgets", None)
        return nb, resources


# Outputs are cleared by nbgrader's own ClearOutput step; widget state needs the extra step.
c.GenerateAssignment.preprocessors = [
    *GenerateAssignment.class_traits()["preprocessors"].default(), StripWidgetState,
]
