"""The course as students install it: the wheel, in a fresh virtual environment outside the
repository, running a lab from another folder (as on Colab or a JupyterHub, where no checkout
exists). Lab 08 is the one that reads a file at run time (its trained draft): it must come from the
installed package, not from a checkout found by searching parent folders.

The fresh environment gets the course from the wheel alone; torch, transformers and the Jupyter
stack come from this project's environment through a .pth line (as a runtime's own packages would),
whose own .pth files, the editable install of this checkout among them, Python does not read.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import nbformat
import pytest

from autograder import REPO, lab_notebook

LAB = "08_speculative_decoding"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(python of the fresh venv, its site-packages, the wheel)."""
    tmp = tmp_path_factory.mktemp("install")
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(REPO), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp / "dist")], check=True, capture_output=True, text=True, timeout=300)
    wheel = next((tmp / "dist").glob("llm_inference_course-*.whl"))
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, text=True, timeout=300)
    (site / "runtime_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv / "bin" / "python", site, wheel


def test_the_wheel_holds_the_package_and_its_data_and_nothing_else(installed):
    names = zipfile.ZipFile(installed[2]).namelist()
    assert "course/data/draft.safetensors" in names, "the trained draft must ship in the wheel (lab 08 reads it)"
    assert "course/engine/kv_cache.py" in names and "course/expect.py" in names, "the labs' given code ships too"
    leaked = [n for n in names if n.split("/")[0] in {"tests", "autograder", "labs", "assets"}]
    assert not leaked, f"instructor material in the students' wheel: {leaked[:5]}"


def test_course_imports_from_the_install_not_the_checkout(installed, tmp_path):
    python, site, _ = installed
    done = subprocess.run([str(python), "-c", "import course, course.assets; print(course.__file__); "
                           "print(course.assets.asset('draft.safetensors'))"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr
    course_file, draft = done.stdout.split()
    assert course_file.startswith(str(site)) and draft.startswith(str(site)), done.stdout


@pytest.mark.slow
def test_a_lab_runs_from_another_folder_with_the_installed_course(installed, tmp_path):
    python, site, _ = installed
    folder = tmp_path / "my notebooks"
    folder.mkdir()
    nb_path = folder / f"{LAB}.ipynb"
    nb_path.write_text(lab_notebook(LAB).read_text())
    env = {**os.environ, "PYTHONPATH": "", "COURSE_QUICK": "1", "JUPYTER_PATH": "", "JUPYTER_DATA_DIR": str(tmp_path / "jd")}
    done = subprocess.run([str(python), "-m", "nbconvert", "--to", "notebook", "--execute", "--inplace",
                           "--ExecutePreprocessor.timeout=600", str(nb_path)],
                          cwd=folder, capture_output=True, text=True, timeout=1500, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    nb = nbformat.read(nb_path, as_version=4)
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, [f"{o.ename}: {o.evalue}" for o in errors][:3]
    printed = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    ran_from = json.loads(subprocess.run([str(python), "-c", "import course, json; print(json.dumps(course.__file__))"],
                                         cwd=folder, capture_output=True, text=True, env=env).stdout)
    assert ran_from.startswith(str(site)), f"the kernel imported the course from {ran_from}"
    assert "not found" not in printed and "plain early exit" not in printed, \
        "the installed course did not find lab 08's trained draft"
