"""The grading sandbox (autograder/grade/sandbox.py), one property per test; each would fail without
the bubblewrap option or limit it checks.

Most run a small Python probe in the sandbox (a second or two); the kernel tests start a sandboxed
ipykernel on a tiny notebook (a few seconds: the guard imports torch at start).
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
from nbformat.v4 import new_code_cell, new_notebook

from autograder import LABS, REPO, ROOT
from autograder.grade import sandbox as sb
from autograder.grade.execute import RunLimits, run_notebook

pytestmark = pytest.mark.xdist_group("sandbox")


def probe(tmp_path: Path, code: str, limits: sb.Limits = sb.Limits(), **kw) -> subprocess.CompletedProcess:
    box = sb.Sandbox(run_dir=tmp_path / "run", lab="lab", limits=limits, **kw)
    return box.run([sys.executable, "-c", textwrap.dedent(code)], timeout=120)


def probe_json(tmp_path: Path, code: str, **kw) -> dict:
    done = probe(tmp_path, code, **kw)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_no_network_not_even_the_graders_loopback(tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept(), daemon=True).start()
    found = probe_json(tmp_path, f"""
        import json, socket
        out = {{}}
        for name, addr in (("internet", ("1.1.1.1", 53)), ("grader_loopback", ("127.0.0.1", {port}))):
            try:
                socket.create_connection(addr, timeout=3).close()
                out[name] = "connected"
            except OSError as e:
                out[name] = type(e).__name__
        try:
            socket.getaddrinfo("pypi.org", 443)
            out["dns"] = "resolved"
        except OSError as e:
            out["dns"] = type(e).__name__
        print(json.dumps(out))
    """)
    server.close()
    assert found["internet"] != "connected", "the sandbox reached the internet"
    assert found["grader_loopback"] != "connected", "the sandbox reached a port on the grader's 127.0.0.1"
    assert found["dns"] != "resolved"


def test_sources_gradebook_and_other_students_are_not_there(tmp_path):
    canary = tmp_path / "canary.txt"          # the grader's /tmp: a stand-in for other students' work
    canary.write_text("secret")
    secret = [LABS, ROOT, ROOT / "gradebook.db", canary, Path.home() / ".cache", REPO / ".git"]
    found = probe_json(tmp_path, f"""
        import json, os
        hidden = {[str(p) for p in secret]!r}
        writes = {{}}
        for path in ("/usr/lib/x", {sys.prefix!r} + "/x", "/etc/x"):
            try:
                open(path, "w").write("x")
                writes[path] = "written"
            except OSError as e:
                writes[path] = type(e).__name__
        print(json.dumps({{"visible": [p for p in hidden if os.path.exists(p)], "writes": writes,
                           "home": os.listdir(os.environ["HOME"]), "tmp": os.listdir("/tmp")}}))
    """)
    assert found["visible"] == [], f"the sandbox sees {found['visible']}"
    assert "written" not in found["writes"].values(), found["writes"]
    assert "canary.txt" not in found["tmp"]


def test_runs_as_its_own_user_without_capabilities_or_grader_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("GRADER_SECRET_TOKEN", "s3cr3t")
    found = probe_json(tmp_path, """
        import json, os
        status = dict(l.split(":", 1) for l in open("/proc/self/status").read().splitlines())
        print(json.dumps({"uid": os.getuid(), "cap": status["CapEff"].strip(), "nnp": status["NoNewPrivs"].strip(),
                          "env": sorted(os.environ), "pid": os.getpid()}))
    """)
    assert "GRADER_SECRET_TOKEN" not in found["env"], "the grader's environment leaked into the sandbox"
    assert int(found["cap"], 16) == 0 and found["nnp"] == "1"
    assert found["pid"] < 10, "not in a pid namespace of its own"
    if os.geteuid() == 0:
        assert found["uid"] != 0, "as root, the kernel must drop to a uid of its own (RLIMIT_NPROC ignores root)"


def test_memory_limit(tmp_path):
    done = probe(tmp_path, "x = bytearray(3 << 30)", limits=sb.Limits(memory_bytes=1 << 30))
    assert done.returncode != 0 and "MemoryError" in done.stderr


RESERVE_AND_WRITE = """
    import ctypes, json
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    # what CUDA does when it starts: reserve address space it never touches (PROT_NONE, no memory behind it)
    addr = libc.mmap(None, 16 << 30, 0, 0x02 | 0x20 | 0x4000, -1, 0)    # MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE
    found = {"reserve": "ok" if addr not in (None, ctypes.c_void_p(-1).value) else "refused"}
    try:
        x = bytearray(3 << 30)                                            # memory really used
        found["write"] = "ok"
    except MemoryError:
        found["write"] = "MemoryError"
    print(json.dumps(found))
"""


def test_with_gpu_the_memory_cap_counts_memory_used_not_address_space_reserved(tmp_path):
    """CUDA did not start under an 8 GiB address-space cap on an H100. With --gpu the cap moves to
    RLIMIT_DATA: a 16 GiB reservation passes, 3 GiB written under a 1 GiB cap still fails."""
    one_gib = sb.Limits(memory_bytes=1 << 30)
    assert probe_json(tmp_path / "cpu", RESERVE_AND_WRITE, limits=one_gib) == {"reserve": "refused", "write": "MemoryError"}
    assert probe_json(tmp_path / "gpu", RESERVE_AND_WRITE, limits=one_gib, gpu=True) == {"reserve": "ok", "write": "MemoryError"}
    box = sb.Sandbox(run_dir=tmp_path / "plan", lab="lab", limits=one_gib, gpu=True)
    assert "memory_bytes" not in box.rlimits() and box.rlimits()["data_bytes"] == (1 << 30, 1 << 30)


def test_gpu_preflight_fails_closed_and_says_why(tmp_path):
    """--gpu grading stops before any notebook when CUDA cannot start (else the class is graded on the
    CPU without a word): no device nodes, or (SANDBOX=off here) a torch that cannot reach CUDA."""
    if list(Path("/dev").glob("nvidia*")):
        pytest.skip("this machine has NVIDIA devices: the CPU-side failures cannot be shown here")
    with pytest.raises(sb.SandboxUnavailable, match=r"no NVIDIA device nodes \(/dev/nvidia\*\)"):
        sb.preflight_gpu(tmp_path / "a", sb.Limits())
    with pytest.raises(sb.SandboxUnavailable, match="CUDA does not start inside the sandbox") as e:
        sb.preflight_gpu(tmp_path / "b", sb.Limits(), enabled=False)
    assert "--memory" in str(e.value) and "Devices bound: none" in str(e.value)


def test_process_limit_stops_a_fork_bomb(tmp_path):
    found = probe_json(tmp_path, """
        import json, os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                    os._exit(0)
                n += 1
        except OSError as e:
            print(json.dumps({"forked": n, "error": type(e).__name__}))
    """, limits=sb.Limits(processes=32))
    assert found["forked"] < 32 and found["error"] == "BlockingIOError"


def test_cpu_time_limit_kills_a_busy_loop(tmp_path):
    done = probe(tmp_path, "while True: pass", limits=sb.Limits(cpu_seconds=2))
    assert done.returncode in (128 + 24, -24, 128 + 9, -9), f"exit {done.returncode}: not stopped by RLIMIT_CPU"


def test_file_size_and_tmp_are_limited(tmp_path):
    found = probe_json(tmp_path, """
        import json, os, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        out = {}
        for path in ("/tmp/big", os.environ["HOME"] + "/big"):
            try:
                with open(path, "wb") as f:
                    for _ in range(64):
                        f.write(b"x" * (1 << 20))
                out[path] = "written"
            except OSError as e:
                out[path] = type(e).__name__
        print(json.dumps(out))
    """, limits=sb.Limits(file_bytes=8 << 20, tmpfs_bytes=16 << 20))
    assert "written" not in found.values(), found


def _tiny_notebook(*sources: str):
    return new_notebook(cells=[new_code_cell(s) for s in sources])


def test_kernel_talks_over_ipc_and_leaves_nothing_running(tmp_path):
    nb = _tiny_notebook(
        "import os, subprocess\nprint(os.getuid(), os.getpid())",
        "subprocess.Popen(['sleep', '917'], start_new_session=True)\n"
        "if os.fork() == 0:\n    os.setsid()\n    os.execvp('sleep', ['sleep', '918'])",
    )
    box = sb.Sandbox(run_dir=tmp_path / "run", lab="lab")
    run = asyncio.run(run_notebook(nb, ["student", "student"], box, RunLimits(cell_timeout=60, budget=120), {}, {}))
    assert run.stopped is None, run.stopped
    uid = int(nb.cells[0].outputs[0].text.split()[0])
    assert uid != 0 or os.geteuid() != 0
    assert run.transport == "ipc", "with --unshare-net, TCP to the grader cannot work: the kernel must use IPC"
    assert run.leftovers == []
    alive = [p for p in Path("/proc").glob("[0-9]*") if any(t in _cmdline(p) for t in (b"sleep\x00917", b"sleep\x00918"))]
    assert alive == [], "a process started in the sandbox outlived grading"


def test_a_held_namespace_keeps_its_number_from_the_next_sandbox(tmp_path):
    """Leftovers are found by pid-namespace number, and Linux gives a freed number to the next
    namespace at once: a grader still looking for one notebook's leftovers would find (and kill) the
    next notebook's kernel (a blank student died this way, SIGKILLed 9 s into its run). The grader
    holds the namespace open until it is done; then no new sandbox gets its number."""
    import time

    def sandbox_namespace():
        proc = subprocess.Popen(["bwrap", "--unshare-pid", "--dev-bind", "/", "/", "sleep", "0.3"])
        for _ in range(200):
            kids = sb.children(proc.pid)
            if kids:
                return proc, kids[0], sb.pid_namespace(kids[0])
            time.sleep(0.01)
        raise AssertionError("bwrap started no child")

    proc, kid, ns = sandbox_namespace()
    fd = sb.hold_namespace(kid, ns)
    assert fd is not None and os.readlink(f"/proc/self/fd/{fd}") == ns
    try:
        proc.wait()
        later = []
        for _ in range(6):
            nxt, _, other = sandbox_namespace()
            later.append(other)
            nxt.wait()
            time.sleep(0.1)
        assert ns not in later, f"a held namespace's number {ns} was given to a new sandbox: {later}"
    finally:
        os.close(fd)
    assert sb.hold_namespace(kid, "pid:[0]") is None, "a pid that is gone (or in another namespace) holds nothing"


def _cmdline(p: Path) -> bytes:
    try:
        return (p / "cmdline").read_bytes()
    except OSError:
        return b""


def test_a_cell_past_its_timeout_is_interrupted_and_the_rest_runs(tmp_path):
    nb = _tiny_notebook("while True:\n    pass", "print('after')")
    box = sb.Sandbox(run_dir=tmp_path / "run", lab="lab")
    run = asyncio.run(run_notebook(nb, ["test", "test"], box, RunLimits(cell_timeout=5, budget=120), {}, {}))
    assert run.timeouts == [0] and run.stopped is None
    assert nb.cells[0].outputs[-1].ename == "CellTimeoutError" and nb.cells[1].outputs[0].text == "after\n"


def test_a_kernel_death_costs_its_cell_and_a_new_kernel_goes_on(tmp_path):
    """The cell that killed the kernel is lost; a new kernel runs the cells above it again (their
    outputs stay the first run's; a test that binds nothing later cells read is not run again),
    then the cells after it."""
    nb = _tiny_notebook("x = 41\nprint('once')", "assert x == 41", "import ctypes; ctypes.string_at(0)",
                        "print(x + 1)", "import os; os._exit(3)", "print('end')")
    box = sb.Sandbox(run_dir=tmp_path / "run", lab="lab")
    run = asyncio.run(run_notebook(nb, ["student", "test", "student", "test", "student", "test"], box,
                                   RunLimits(cell_timeout=60), {}, {}))
    assert run.stopped is None, run.stopped
    assert [(i, why) for i, why in run.deaths] == [(2, "crashed (segmentation fault)"), (4, "the kernel exited with code 3")]
    assert nb.cells[0].outputs[0].text == "once\n" and len(nb.cells[0].outputs) == 1, "the replay's output is not kept"
    assert nb.cells[3].outputs[0].text == "42\n" and nb.cells[5].outputs[0].text == "end\n"
    assert nb.cells[2].outputs[-1].ename == "KernelDied" and "segmentation fault" in nb.cells[2].outputs[-1].evalue
    assert [c.execution_count for c in nb.cells if c.outputs and c.outputs[0].get("name") == "stdout"][-1] == 2, \
        "execution counts are the new kernel's (tracebacks name them)"


def test_a_notebook_that_kills_its_replay_stops_once(tmp_path):
    """A cell that dies again when run a second time (here: it leaves a mark in the run folder the
    first time) stops the run where the first death was: one kernel-died, the cells it reached."""
    mark = "import os\nfrom ipykernel.kernelapp import IPKernelApp\n" \
           "mark = os.path.join(os.path.dirname(IPKernelApp.instance().connection_file), 'seen')\n" \
           "if os.path.exists(mark):\n    os._exit(5)\nopen(mark, 'w').close()"
    nb = _tiny_notebook(mark, "import os; os._exit(3)", "print('never')")
    box = sb.Sandbox(run_dir=tmp_path / "run", lab="lab")
    run = asyncio.run(run_notebook(nb, ["student", "student", "test"], box, RunLimits(cell_timeout=60), {}, {}))
    assert run.deaths == [(1, "the kernel exited with code 3")]
    assert run.stopped[:2] == (2, "kernel-died") and "code 5" in run.stopped[2] and "again" in run.stopped[2]
    assert not nb.cells[2].get("outputs")


def test_deaths_past_the_restart_limit_stop_the_run(tmp_path):
    nb = _tiny_notebook(*["import os; os._exit(7)"] * 4, "print('never')")
    box = sb.Sandbox(run_dir=tmp_path / "run", lab="lab")
    run = asyncio.run(run_notebook(nb, ["student"] * 5, box, RunLimits(cell_timeout=60, restarts=2), {}, {}))
    assert [i for i, _ in run.deaths] == [0, 1, 2]
    assert run.stopped[:2] == (3, "kernel-died") and "3 times" in run.stopped[2]
    assert not nb.cells[3].get("outputs") and not nb.cells[4].get("outputs")


def test_preflight_passes_here_and_fails_closed(tmp_path, monkeypatch):
    assert "OK" in sb.preflight(tmp_path / "a", [LABS, ROOT])
    with pytest.raises(sb.SandboxUnavailable, match="can see /usr"):
        sb.preflight(tmp_path / "b", [Path("/usr")])            # something visible: not isolated
    monkeypatch.setattr(sb.shutil, "which", lambda name: None)
    with pytest.raises(sb.SandboxUnavailable, match="apt-get install bubblewrap"):
        sb.bwrap_path()


def test_make_grade_stops_when_there_is_no_sandbox(tmp_path):
    sub = tmp_path / "submitted" / "alice" / "01_inference" / "01_inference.ipynb"
    sub.parent.mkdir(parents=True)
    sub.write_text("{}")
    env = {**os.environ, "PATH": "/nonexistent"}          # no bwrap anywhere
    done = subprocess.run([sys.executable, "-m", "autograder.grade", "--submitted", str(tmp_path / "submitted"),
                           "--gradebook", str(tmp_path / "gb.db"), "--out", str(tmp_path / "out")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "STOPPED" in done.stderr and "bubblewrap" in done.stderr
    assert not (tmp_path / "gb.db").exists(), "nothing is graded or recorded without a sandbox"


def test_a_cell_that_runs_out_of_memory_gets_a_new_kernel(tmp_path):
    """A memory bomb that keeps what it took (a global) would starve every later cell: the kernel is
    replaced after it, as after a death, and only the bomb's cell is lost."""
    nb = _tiny_notebook("x = 3", "hog = []\nwhile True:\n    hog.append(bytearray(1 << 28))",
                        "import torch\nprint(torch.ones(1 << 28).sum().item() + x)")
    box = sb.Sandbox(run_dir=tmp_path / "run", lab="lab", limits=sb.Limits(memory_bytes=4 << 30))
    run = asyncio.run(run_notebook(nb, ["student", "student", "test"], box, RunLimits(cell_timeout=120), {}, {}))
    assert run.stopped is None and run.deaths == [(1, "ran out of memory (MemoryError); the kernel was replaced")]
    assert nb.cells[2].outputs[0].text == f"{(1 << 28) + 3}.0\n", nb.cells[2].outputs
