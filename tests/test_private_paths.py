"""Many students on one machine (a JupyterHub on one server shares /tmp): no lab and nothing in the
course package writes to a fixed path in a shared temporary folder, where one student's file would
meet another's (lab 12 once wrote every student's answers to /tmp/lab12/my_tp.py, and torchrun could
run another student's code). A fresh `tempfile.mkdtemp()` or the notebook's own folder is private;
`tempfile.gettempdir()` joined with a name, or a literal '/tmp/...', is not."""
from __future__ import annotations

import ast
from pathlib import Path

import nbformat
import pytest

from autograder import REPO, lab_names, lab_notebook
from autograder.grade.tamper import parse

SHARED = ("/tmp", "/var/tmp", "/dev/shm")


def fixed_temp_paths(source: str) -> list[str]:
    """Where `source` names a place every user shares: gettempdir() (its only use is a name joined to
    it: mkdtemp and TemporaryDirectory choose the folder themselves) or a literal path in /tmp."""
    tree = parse(source)
    if tree is None:
        return []
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name == "gettempdir":
                found.append(f"line {node.lineno}: gettempdir()")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if any(node.value == d or node.value.startswith(d + "/") for d in SHARED):
                found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_the_check_finds_fixed_paths_and_allows_private_ones():
    assert fixed_temp_paths("import os, tempfile\nd = os.path.join(tempfile.gettempdir(), 'lab12')")
    assert fixed_temp_paths("open('/tmp/lab12/my_tp.py', 'w')")
    assert fixed_temp_paths("from tempfile import gettempdir\np = gettempdir()")
    assert not fixed_temp_paths("import tempfile\nd = tempfile.mkdtemp(prefix='lab12-')\n# not /tmp/x")
    assert not fixed_temp_paths("with tempfile.TemporaryDirectory() as d:\n    pass")


@pytest.mark.parametrize("lab", lab_names())
def test_no_lab_writes_to_a_fixed_shared_path(lab):
    nb = nbformat.read(lab_notebook(lab), as_version=4)
    found = [f"cell {i + 1}, {where}" for i, c in enumerate(nb.cells) if c.cell_type == "code"
             for where in fixed_temp_paths(c.source)]
    assert not found, f"{lab} names a shared temporary path (use tempfile.mkdtemp()):\n" + "\n".join(found)


def test_the_course_package_writes_to_no_fixed_shared_path():
    found = [f"{p.relative_to(REPO)}, {where}" for p in sorted((REPO / "course").rglob("*.py"))
             for where in fixed_temp_paths(p.read_text())]
    assert not found, "the course package names a shared temporary path (use tempfile.mkdtemp()):\n" + "\n".join(found)
