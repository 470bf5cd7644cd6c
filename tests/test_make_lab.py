"""`make lab` serves JupyterLab on 127.0.0.1 and stops cleanly on Ctrl-C.

Runs the real Makefile target on a free port with a known token, waits for the server to answer,
opens a kernel (a student's notebook), then sends SIGINT twice to the process group (Ctrl-C Ctrl-C
in a terminal) and checks that make, JupyterLab and the kernel all exit, and that JupyterLab
removed its server info and kernel connection files (its clean shutdown ran, kernels included).
"""
from __future__ import annotations

import json
import os
import pty
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from autograder import REPO, lab_names

TOKEN = "course-test-token"
START_LIMIT_S = 60
STOP_LIMIT_S = 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int | None:
    """HTTP status of `url`, or None while nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc), whatever its process group or session."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_make_lab_serves_jupyterlab_and_stops_on_ctrl_c(tmp_path):
    port = _free_port()
    # -o STAMP: the package set-up ran before the tests (`make test` depends on it); a test must
    # never reinstall packages. The rest of `setup` (the model cache check) is quick and runs.
    cmd = ["make", "--no-print-directory", "-o", ".venv/.installed", "lab", f"PORT={port}",
           f"LAB_ARGS=--no-browser --IdentityProvider.token={TOKEN}"]
    runtime = tmp_path / "runtime"  # server info and kernel connection files: must be gone at the end
    env = {**os.environ, "JUPYTER_RUNTIME_DIR": str(runtime)}
    log = open(tmp_path / "make_lab.log", "w+")
    # stdin a terminal: JupyterLab treats Ctrl-C as in a shell (without one, SIGINT skips its clean-up)
    terminal, tty = pty.openpty()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=tty,
                            start_new_session=True)  # its own process group, like a terminal job
    os.close(tty)
    pgid, started = os.getpgid(proc.pid), []
    try:
        url = f"http://127.0.0.1:{port}/lab?token={TOKEN}"
        deadline = time.monotonic() + START_LIMIT_S
        status = None
        while time.monotonic() < deadline and proc.poll() is None:
            status = _status(url)
            if status == 200:
                break
            time.sleep(0.5)
        log.seek(0)
        assert status == 200, f"no JupyterLab at {url} within {START_LIMIT_S} s (last status {status}):\n{log.read()[-3000:]}"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={TOKEN}", timeout=5) as r:
            served = {item["name"] for item in json.load(r)["content"]}
        assert set(lab_names()) <= served, f"the server's root is not labs/: it shows {sorted(served)}"

        # A student's open notebook: a kernel, which runs in a session of its own (not in the group).
        request = urllib.request.Request(f"http://127.0.0.1:{port}/api/kernels", data=b'{"name": "python3"}',
                                         headers={"Authorization": f"token {TOKEN}"}, method="POST")
        with urllib.request.urlopen(request, timeout=30) as r:
            assert r.status == 201
        started = _descendants(proc.pid)
        commands = [Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode() for pid in started]
        assert any("ipykernel" in c for c in commands), f"no kernel under make; found {commands}"

        # Ctrl-C twice, as JupyterLab's banner says ("twice to skip confirmation"), to the whole job.
        os.killpg(pgid, signal.SIGINT)
        time.sleep(1)
        os.killpg(pgid, signal.SIGINT)
        try:
            proc.wait(timeout=STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`make lab` still running {STOP_LIMIT_S} s after Ctrl-C")
        deadline = time.monotonic() + 5
        while (_group_alive(pgid) or _alive(started)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not _group_alive(pgid), "processes of `make lab` outlived it"
        assert not _alive(started), f"left behind after Ctrl-C: {_alive(started)}"
        assert _status(url) is None, "the port still answers after Ctrl-C"
        leftovers = sorted(p.name for p in runtime.glob("*") if p.name != "jupyter_cookie_secret")
        assert not leftovers, f"JupyterLab did not clean up after itself: {leftovers}"
    finally:
        for pid in _alive(started):  # only ours: what make had started
            os.kill(pid, signal.SIGKILL)
        if _group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        log.close()
        os.close(terminal)
