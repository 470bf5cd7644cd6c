"""A class on a real JupyterHub, on loopback: link, lab, widget, submit, collect, `make grade`, feedback.

JupyterHub (from PyPI) runs with its real proxy (configurable-http-proxy, from npm: assets/vendor),
a dummy authenticator and local spawning, with the students' nbgrader settings an instructor installs
(deploy/hub/nbgrader_config.py). Headless chromium is the student, alice:

1. logs in and follows the nbgitpuller link `make links` writes for lab 01, which clones the
   student versions (a local git repository, as the instructor pushed them) into ~/llm-inference;
2. in JupyterLab, answers Problems 1 and 2 (typed into their cells), runs every cell in the hub's
   kernel (install, setup, model, the tests) and sees the next-token explorer widget render;
3. saves, opens nbgrader's Assignments tab (its JupyterLab extension, with the pinned JupyterLab)
   and clicks Submit.

The instructor then runs the route of autograder/GUIDE.md section 5: `nbgrader collect`, `make grade`
(the sandbox included), `nbgrader release_feedback`. Alice clicks "Fetch Feedback" and reads her
feedback page from her own server: 5 of 10 points, the two problems she answered passed.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from autograder import REPO, lab_notebook
from autograder.links import lab_link
from autograder.release import generate_release
from browser import ARGS, chromium_path

LAB = "01_inference"
COURSE = "llm-inference"
STUDENT, PASSWORD = "alice", "course-test-password"
ANSWERED = ("next_token_probs", "top_k_table")      # Problems 1 and 2: 2 + 3 of the lab's 10 points
PROXY = REPO / "assets" / "vendor" / "node_modules" / ".bin" / "configurable-http-proxy"
BIN = Path(sys.executable).parent
START_LIMIT_S = 60

HUB_CONFIG = """\
import os
c = get_config()
c.JupyterHub.bind_url = "http://127.0.0.1:{port}"
c.JupyterHub.hub_ip = "127.0.0.1"
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.ConfigurableHTTPProxy.command = [{proxy!r}]
c.ConfigurableHTTPProxy.pid_file = {state!r} + "/proxy.pid"
c.JupyterHub.db_url = "sqlite:///" + {state!r} + "/hub.sqlite"
c.JupyterHub.cookie_secret_file = {state!r} + "/cookie_secret"
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = {password!r}
c.Authenticator.allow_all = True
c.JupyterHub.spawner_class = "simple"          # every user a folder of this machine's account
c.SimpleLocalProcessSpawner.home_dir_template = {homes!r} + "/{{username}}"
c.Spawner.cmd = [{singleuser!r}]
c.Spawner.args = {args!r}
c.Spawner.default_url = "/lab"
c.Spawner.environment = {environment!r}
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_working_in(folder: Path) -> None:
    """SIGKILL every process whose working directory is inside `folder` (Linux /proc)."""
    for cwd in Path("/proc").glob("[0-9]*/cwd"):
        try:
            if Path(os.readlink(cwd)).is_relative_to(folder):
                os.kill(int(cwd.parent.name), signal.SIGKILL)
        except (OSError, ValueError):
            continue


def _answers() -> dict[str, str]:
    """Problems 1 and 2 as a student would type them: the source's solutions without the markers."""
    cells = json.loads(lab_notebook(LAB).read_text())["cells"]
    found = {c["metadata"]["nbgrader"]["grade_id"]: "".join(c["source"]) for c in cells
             if c["metadata"].get("nbgrader", {}).get("grade_id") in ANSWERED}
    return {gid: re.sub(r"\n\s*### (BEGIN|END) SOLUTION", "", code) for gid, code in found.items()}


def _nbgrader(*args: str, tmp: Path) -> str:
    """The instructor's nbgrader, from autograder/ as the guide says, on this test's exchange and folders."""
    rel = lambda p: os.path.relpath(p, REPO / "autograder")  # nbgrader's step folders are relative to the root
    cmd = [str(BIN / "nbgrader"), *args, f"--Exchange.root={tmp / 'exchange'}", f"--CourseDirectory.course_id={COURSE}",
           f"--CourseDirectory.db_url=sqlite:///{tmp / 'gradebook.db'}",
           f"--CourseDirectory.release_directory={rel(tmp / 'release')}",
           f"--CourseDirectory.submitted_directory={rel(tmp / 'submitted')}",
           f"--CourseDirectory.feedback_directory={rel(tmp / 'feedback')}"]
    done = subprocess.run(cmd, cwd=REPO / "autograder", capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"{' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    return done.stdout + done.stderr


def _student_repo(tmp: Path) -> Path:
    """The student versions in a git repository, as an instructor pushes autograder/release/."""
    generate_release(LAB, release_dir=tmp / "release", gradebook=tmp / "gradebook.db")
    repo = tmp / "students-repo"
    shutil.copytree(tmp / "release" / LAB, repo / LAB)
    git = ["git", "-c", "user.name=instructor", "-c", "user.email=instructor@localhost"]
    for cmd in (["init", "-q", "-b", "main"], ["add", "."], ["commit", "-q", "-m", "lab 01"]):
        subprocess.run(git + cmd, cwd=repo, check=True, timeout=60)
    return repo


@pytest.fixture
def hub(tmp_path):
    """A running JupyterHub on loopback: yields (its URL, the homes folder); stops it and its servers."""
    if not PROXY.exists():
        pytest.fail(f"configurable-http-proxy missing ({PROXY}): run `make vendor`", pytrace=False)
    state, homes = tmp_path / "hub", tmp_path / "homes"
    state.mkdir()
    homes.mkdir()
    port = _free_port()
    environment = {"JUPYTER_CONFIG_PATH": str(REPO / "deploy" / "hub"), "COURSE_EXCHANGE": str(tmp_path / "exchange"),
                   "COURSE_QUICK": "1", "OMP_NUM_THREADS": "1", "PATH": f"{BIN}:{os.environ['PATH']}",
                   # the model converted outside the students' homes, as the hub images do (docs/deploy.md)
                   "COURSE_CACHE": os.environ.get("COURSE_CACHE", str(Path.home() / ".cache" / "llm-inference-course"))}
    (state / "jupyterhub_config.py").write_text(HUB_CONFIG.format(
        port=port, hub_port=_free_port(), api_port=_free_port(), proxy=str(PROXY), state=str(state),
        password=PASSWORD, homes=str(homes), singleuser=str(BIN / "jupyterhub-singleuser"),
        args=["--allow-root"] if os.getuid() == 0 else [], environment=environment))
    log = open(tmp_path / "hub.log", "w+")
    proc = subprocess.Popen([str(BIN / "jupyterhub"), "-f", str(state / "jupyterhub_config.py")], cwd=state,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_LIMIT_S
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/hub/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        else:
            log.seek(0)
            pytest.fail(f"no JupyterHub at {url} within {START_LIMIT_S} s:\n{log.read()[-3000:]}")
        yield url, homes
    finally:
        proc.send_signal(signal.SIGTERM)  # the hub stops the servers it spawned and its proxy
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        _kill_working_in(tmp_path)  # a server or kernel the hub left behind
        log.seek(0)
        print(log.read()[-4000:])
        log.close()


def _command(page, label: str) -> None:
    """Run a JupyterLab command by its label from the command palette, as a user would."""
    page.keyboard.press("Control+Shift+C")
    page.fill(".lm-CommandPalette-input", label)
    page.keyboard.press("Enter")


@pytest.mark.slow
@pytest.mark.browser
def test_a_student_on_a_hub_opens_a_lab_by_link_submits_and_reads_feedback(hub, tmp_path):
    from playwright.sync_api import sync_playwright

    url, homes = hub
    repo = _student_repo(tmp_path)
    assert "Released as" in _nbgrader("release_assignment", LAB, tmp=tmp_path)
    link = lab_link(url, repo.as_uri(), LAB, branch="main", folder=COURSE)
    answers = _answers()
    lab_file = homes / STUDENT / COURSE / LAB / f"{LAB}.ipynb"

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=ARGS, headless=True)
        try:
            page = browser.new_context(viewport={"width": 1300, "height": 900}).new_page()
            page.goto(f"{url}/hub/login")
            page.fill("input[name=username]", STUDENT)
            page.fill("input[name=password]", PASSWORD)
            page.click("[type=submit]")
            page.wait_for_url(f"**/user/{STUDENT}/**", timeout=START_LIMIT_S * 1000)

            # 1. The link: nbgitpuller clones the student versions and JupyterLab opens the lab.
            page.goto(link)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=90_000)
            assert page.url.endswith(f"/user/{STUDENT}/lab/tree/{COURSE}/{LAB}/{LAB}.ipynb"), page.url
            assert lab_file.exists(), f"nbgitpuller did not clone into ~/{COURSE}/{LAB}/"
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status=idle]", timeout=60_000)

            # 2. Answer Problems 1 and 2, run every cell in the hub's kernel.
            for gid, code in answers.items():
                name = code.split("(")[0]  # "def next_token_probs"
                cell = page.locator(".jp-CodeCell").filter(has_text=name).filter(has_text="NotImplementedError").first
                cell.scroll_into_view_if_needed()
                cell.locator(".cm-content").click()
                page.keyboard.press("Control+A")
                page.keyboard.insert_text(code)
                page.keyboard.press("Escape")
            _command(page, "Run All Cells")
            explorer = page.locator(".jp-OutputArea-output .widget-slider").first
            explorer.wait_for(timeout=180_000)   # the next-token explorer, drawn by the student's top_k_table
            page.wait_for_selector(".jp-Notebook-ExecutionIndicator[data-status=idle]", timeout=120_000)
            _command(page, "Save Notebook")
            page.wait_for_selector(".lm-TabBar-tab.jp-mod-current:not(.jp-mod-dirty)", timeout=30_000)

            saved = json.loads(lab_file.read_text())
            by_id = {c["metadata"].get("nbgrader", {}).get("grade_id"): c for c in saved["cells"]}
            for gid in ("colab_install", "setup"):
                assert by_id[gid]["execution_count"], f"the {gid} cell did not run in the hub's kernel"
            errors = [(gid, o["ename"]) for gid, c in by_id.items() if gid and c["cell_type"] == "code"
                      for o in c["outputs"] if o["output_type"] == "error"]
            assert all(e == "NotImplementedError" for _, e in errors), errors   # only the problems not answered
            widgets = [o for c in saved["cells"] if c["cell_type"] == "code" for o in c["outputs"]
                       if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
            assert widgets, "the saved notebook holds no widget output"

            # 3. Hand in from nbgrader's Assignments tab.
            _command(page, "Assignment List")
            page.wait_for_selector("text=Downloaded assignments", timeout=30_000)
            page.get_by_role("button", name="Submit").click()
            page.wait_for_selector("text=There are no submitted assignments.", state="hidden", timeout=30_000)

            # The instructor: collect, grade in the sandbox, release the feedback.
            assert "Collecting submission: alice" in _nbgrader("collect", LAB, tmp=tmp_path)
            graded = subprocess.run(
                ["make", "--no-print-directory", "-o", ".venv/.installed", "grade", f"LABS={LAB}",
                 f"GRADE_ARGS=--submitted {tmp_path / 'submitted'} --autograded {tmp_path / 'autograded'} "
                 f"--feedback {tmp_path / 'feedback'} --out {tmp_path / 'out'} --gradebook {tmp_path / 'gradebook.db'}"],
                cwd=REPO, capture_output=True, text=True, timeout=600)
            assert graded.returncode == 0, graded.stdout[-3000:] + graded.stderr[-3000:]
            assert f"{STUDENT} {LAB}: 5/10" in graded.stdout, graded.stdout[-2000:]
            _nbgrader("release_feedback", LAB, tmp=tmp_path)

            # Alice fetches her feedback and reads it from her own server.
            page.reload()
            page.get_by_role("button", name="Fetch Feedback").click(timeout=60_000)
            deadline = time.monotonic() + 30
            while not (pages := list((lab_file.parent / "feedback").glob("*/*.html"))) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert pages, "no feedback arrived in the student's lab folder"
            relative = pages[0].relative_to(homes / STUDENT).as_posix()
            feedback = page.context.new_page()
            feedback.goto(f"{url}/user/{STUDENT}/files/{relative}")
            text = feedback.locator("body").inner_text()
            assert re.search(r"Score:\s*5\s*/\s*10", text), text[:500]
            for gid in ANSWERED:
                assert re.search(rf"{gid}_tests\s+\d+\s*/\s*\d+\s+passed", text), text[:800]
        finally:
            browser.close()
