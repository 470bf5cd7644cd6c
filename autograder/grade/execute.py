"""Run one repaired notebook in a sandboxed kernel, cell by cell, with the guard in between.

nbclient executes the cells (as nbgrader's own Execute step does); around each one this module
asks the in-kernel guard (guard.py) to restore and report, out of band: a silent execute request
whose user_expression returns a signed, numbered report. It also:
- interrupts a cell past `cell_timeout` (through the control channel: the kernel runs in a new
  session, so a signal to bwrap would not reach it) and goes on with the next cell;
- when the kernel dies (exit code or signal, e.g. SIGXCPU for the CPU-time limit, SIGSEGV for a
  crash), loses only that cell: a new kernel runs the cells above it again, quietly, and grading
  goes on after it (`RunLimits.restarts` times at most);
- stops when the notebook passes its total `budget`, and says where and why;
- caps each cell's output (`max_output_bytes`): errors are always kept and stderr leaves a
  marker, so capping never turns a failing test into a passing one;
- after each kernel, kills and reports anything still running in the sandbox's pid namespace.
"""
from __future__ import annotations

import ast
import asyncio
import hashlib
import hmac
import json
import os
import secrets
import signal
import time
from dataclasses import dataclass, field

from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import AsyncKernelManager
import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellTimeoutError, DeadKernelError
from nbformat import NotebookNode
from nbformat.v4 import new_output

from autograder.grade import tamper
from autograder.grade.sandbox import Sandbox, children, hold_namespace, kill_leftovers, pid_namespace

SIGNALS = {signal.SIGKILL: "killed (SIGKILL: the CPU-time limit, or the system ran out of memory)", signal.SIGXCPU: "CPU-time limit reached (SIGXCPU)",
           signal.SIGSEGV: "crashed (segmentation fault)", signal.SIGABRT: "aborted (SIGABRT)",
           signal.SIGXFSZ: "file-size limit reached (SIGXFSZ)", signal.SIGBUS: "crashed (bus error)"}


class ReplayFailed(Exception):
    """A cell run again in a new kernel did not do what it did the first time."""


@dataclass(frozen=True)
class RunLimits:
    cell_timeout: int = 600          # seconds per cell (nbgrader's Execute.timeout)
    budget: int = 3600               # seconds for the whole notebook
    guard_timeout: int = 60          # seconds for one guard report
    max_output_bytes: int = 1 << 20  # per cell
    restarts: int = 4                # new kernels after a death; one more death stops the run
    widget_state: bool = False       # keep the widgets' state in the graded notebook (the test suite's site reuses it)


@dataclass
class Run:
    """What happened while running one notebook."""

    nb: NotebookNode
    timeouts: list[int] = field(default_factory=list)           # cell indices interrupted
    capped: list[int] = field(default_factory=list)             # cell indices whose output was cut
    reports: list[dict] = field(default_factory=list)           # {"index", "op", "found", "log", "threads"}
    stopped: tuple[int, str, str] | None = None                 # (first cell not trusted, flag code, why)
    deaths: list[tuple[int, str]] = field(default_factory=list)  # (cell the kernel died in, why), each followed by a new kernel
    replaying: bool = False                                      # the current cell is run again, after a death
    current: int = 0                                            # the cell being run
    cell_seconds: dict[int, float] = field(default_factory=dict)  # wall time per executed cell
    transport: str = ""                                         # how the grader reached the kernel
    leftovers: list[int] = field(default_factory=list)
    kernel_log: str = ""
    seconds: float = 0.0


class GradingClient(NotebookClient):
    """nbclient with a per-cell output cap and nbgrader's rule that an error reply is an error."""

    def __init__(self, *args, max_output_bytes: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_output_bytes = max_output_bytes
        self.output_used: dict[int, int] = {}
        self.capped: set[int] = set()
        self.timed_out: set[int] = set()
        self.on_cell_executed = self._record_error_reply

    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content", {})
        used = self.output_used.get(cell_index, 0) + len(json.dumps(content, default=str))
        self.output_used[cell_index] = used
        if used <= self.max_output_bytes or msg["msg_type"] == "error":
            return super().output(outs, msg, display_id, cell_index)
        stream = content.get("name") if msg["msg_type"] == "stream" else "stdout"
        marker = f"\n... output capped by the grader at {self.max_output_bytes:,} bytes ...\n"
        if (cell_index, stream) not in self.capped:
            self.capped.add((cell_index, stream))
            outs.append(new_output("stream", name=stream, text=marker))
        return None

    def _record_error_reply(self, cell, cell_index, execute_reply):
        content = (execute_reply or {}).get("content", {})
        if content.get("status") != "error":
            return
        if content.get("ename") == "CellTimeoutError":
            self.timed_out.add(cell_index)
        if not any(o.get("output_type") == "error" and o.get("ename") == content.get("ename") for o in cell.outputs):
            cell.outputs.append(new_output("error", ename=content.get("ename", "Error"),
                                           evalue=content.get("evalue", ""),
                                           traceback=content.get("traceback") or ["(no traceback)"]))


class Guard:
    """The grader's end of the guard: sends requests, checks signature and sequence."""

    def __init__(self, client: GradingClient, name: str, key: bytes, timeout: int):
        self.client, self.name, self.key, self.timeout, self.seq = client, name, key, timeout, 0

    async def call(self, op: str, **args) -> dict:
        """The verified report body, or RuntimeError saying what was wrong with the answer."""
        expr = f"__import__('sys').modules[{self.name!r}]._call({op!r}, {json.dumps(args)!r})"
        kc = self.client.kc
        msg_id = kc.execute("", silent=True, store_history=False, user_expressions={"g": expr}, allow_stdin=False)
        deadline = time.monotonic() + self.timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no answer from the guard within {self.timeout} s")
            try:
                msg = await kc.shell_channel.get_msg(timeout=min(left, 1.0))
            except Exception:  # queue.Empty
                if not await self.client.km.is_alive():
                    raise DeadKernelError("Kernel died") from None
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                break
        value = msg["content"].get("user_expressions", {}).get("g", {})
        if value.get("status") != "ok":
            raise RuntimeError(f"guard call failed: {value.get('ename', msg['content'].get('ename', '?'))}")
        try:
            outer = json.loads(ast.literal_eval(value["data"]["text/plain"]))
            body_text, sig = outer["body"], outer["sig"]
        except Exception as e:  # noqa: BLE001 - any malformed answer is a broken guard
            raise RuntimeError(f"malformed guard answer ({type(e).__name__})") from None
        good = hmac.new(self.key, body_text.encode(), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(good, sig):
            raise RuntimeError("guard answer with a wrong signature (forged)")
        body = json.loads(body_text)
        if body.get("seq") != self.seq + 1:
            raise RuntimeError(f"guard answer out of sequence ({body.get('seq')} after {self.seq}): replayed")
        self.seq += 1
        return body


class _NoGuard:
    """Stands in for Guard when a test runs without it: every report is empty."""

    timeout = 0

    async def call(self, op: str, **args) -> dict:
        return {"found": [], "log": [], "threads": []}


def _death(proc, log_tail: str) -> str:
    """Why the kernel died, from bwrap's exit status (128 + signal when the kernel was killed)."""
    code = None
    if proc is not None:
        try:
            code = proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - still running, or not a Popen
            code = proc.poll()
    if code is None:
        return "the kernel stopped responding"
    sig = -code if code < 0 else code - 128 if code > 128 else None
    if sig:
        try:
            return SIGNALS.get(signal.Signals(sig), f"killed by signal {signal.Signals(sig).name}")
        except ValueError:
            pass
    hint = " (out of memory?)" if "MemoryError" in log_tail or "std::bad_alloc" in log_tail else ""
    return f"the kernel exited with code {code}{hint}"


async def run_notebook(nb: NotebookNode, kinds: list[str], sandbox: Sandbox, limits: RunLimits,
                       checkpoints: dict[int, dict], aliases: dict, guarded: bool = True) -> Run:
    """Execute `nb` (already repaired; `kinds` per cell) in `sandbox`. `checkpoints`: cell index ->
    what the guard remembers after that cell (worker.checkpoints); `aliases`: the source's import
    names (tamper.import_aliases). `guarded=False` runs without the guard: only for tests that
    show what an attack achieves without it.

    When the kernel dies in a cell, that cell is lost (`run.deaths`), and the grading goes on in a
    new kernel: the cells before it are run again there (`replay_cells`: outputs discarded), then
    the cells after it. After `limits.restarts` deaths, or when a replay dies too, the rest is not
    run (`run.stopped`)."""
    start = time.monotonic()
    run = Run(nb=nb)
    run_dir = sandbox.run_dir
    sandbox.prepare()
    name = f"_course_grader_{secrets.token_hex(8)}"
    sandbox.env.update({"COURSE_GRADER_GUARD": name, "COURSE_GRADER_KEY": str(run_dir / "guard.key")})
    kernels = run_dir / "kernels"
    kernel_name = sandbox.write_kernelspec(kernels, ["--HistoryManager.hist_file=:memory:"], guard=guarded)
    client = GradingClient(
        nb, km=None, kernel_name=kernel_name, timeout=limits.cell_timeout, allow_errors=True,
        interrupt_on_timeout=True, store_widget_state=limits.widget_state, record_timing=False, iopub_timeout=10,
        raise_on_iopub_timeout=False, shutdown_kernel="immediate", startup_timeout=180,
        error_on_timeout={"ename": "CellTimeoutError", "evalue": f"the cell ran longer than {limits.cell_timeout} s",
                          "traceback": [f"CellTimeoutError: the cell ran longer than {limits.cell_timeout} s "
                                        f"and was interrupted by the grader"]},
        resources={"metadata": {"path": str(sandbox.host_cwd())}},
        max_output_bytes=limits.max_output_bytes,
    )
    client.timeout_func = lambda cell: max(1, min(limits.cell_timeout, int(limits.budget - (time.monotonic() - start))))
    log_path = run_dir / "kernel.log"
    first, replay = 0, []          # where this kernel goes on, and what it runs again first
    with open(log_path, "w+b") as log_file:   # read back through this handle: the kernel can replace the path
        while True:
            proc = await _run_kernel(client, run, kinds, checkpoints, aliases, limits, start, log_file, sandbox,
                                     kernel_name, name, guarded, first, replay)
            if not (run.stopped and (run.stopped[1] == "kernel-died" and not run.stopped[2] or
                                     run.stopped[1] == "out-of-memory")):
                break
            at, replaying = run.stopped[0], run.replaying
            why = run.stopped[2] or _death(proc, _tail(log_file))
            if replaying:      # it died again on cells that ran before: no point in trying again
                run.stopped = (first, "kernel-died", f"{why}, again while the cells before it were run again "
                                                  f"in a new kernel; the rest was not run")
                break
            run.deaths.append((at, why))
            if run.stopped[1] == "kernel-died":       # (out of memory: the cell's own MemoryError says so)
                _mark_death(nb.cells[at], why, last=len(run.deaths) > limits.restarts)
            if len(run.deaths) > limits.restarts or time.monotonic() - start > limits.budget:
                run.stopped = (at + 1, "kernel-died", f"{why}; the kernel died {len(run.deaths)} times, "
                                                      f"so the grader stopped here")
                break
            run.stopped = None
            first = at + 1
            replay = replay_cells(nb.cells, kinds, first, {i for i, _ in run.deaths} | set(client.timed_out))
        run.kernel_log = _tail(log_file)
    run.timeouts = sorted(client.timed_out)
    run.capped = sorted({i for i, _ in client.capped})
    if run.stopped and run.stopped[1] == "kernel-died" and not run.stopped[2]:
        run.stopped = (run.stopped[0], "kernel-died", _death(proc, run.kernel_log))
    run.seconds = time.monotonic() - start
    return run


MEMORY_ERRORS = {"MemoryError", "_ArrayMemoryError", "OutOfMemoryError"}


def out_of_memory(cell: NotebookNode) -> str | None:
    """The error that says `cell` ran out of memory (Python, NumPy, torch on the CPU or a GPU), or None."""
    for out in cell.get("outputs", []):
        if out.get("output_type") == "error" and (out.get("ename") in MEMORY_ERRORS or
                                                  "can't allocate memory" in out.get("evalue", "")):
            return out.get("ename")
    return None


def _tail(log_file, size: int = 4000) -> str:
    log_file.seek(max(0, log_file.seek(0, os.SEEK_END) - size))
    return log_file.read(size).decode(errors="replace")


def _mark_death(cell: NotebookNode, why: str, last: bool) -> None:
    """Say in the cell's own output that the kernel died there, and what the grader did next."""
    then = ("the grader stopped there (too many deaths)" if last else
            "the grader started a new kernel, ran the cells above this one again (not this one) and went on")
    cell.setdefault("outputs", []).append(new_output(
        "error", ename="KernelDied", evalue=f"the kernel died in this cell: {why}; {then}",
        traceback=[f"KernelDied: the kernel died in this cell: {why}; {then}"]))


def replay_cells(cells: list[NotebookNode], kinds: list[str], upto: int, skip: set[int]) -> list[int]:
    """The cells a new kernel runs again before cell `upto`: every code cell above it except those
    in `skip` (cells that killed the kernel or timed out) and test cells that bind nothing a later
    cell reads (a test only checks; running it again would cost its time for nothing)."""
    needed = set()
    for cell in cells[upto:]:
        if cell.cell_type == "code":
            needed |= tamper.reads(cell.source)
    plan = []
    for i in range(min(upto, len(cells)) - 1, -1, -1):
        cell = cells[i]
        if cell.cell_type != "code" or not cell.source.strip() or i in skip:
            continue
        if kinds[i] == "test" and not tamper.bound_names(cell.source) & needed:
            continue
        plan.append(i)
        needed |= tamper.reads(cell.source)
    return plan[::-1]


async def _run_kernel(client, run, kinds, checkpoints, aliases, limits, start, log_file, sandbox, kernel_name,
                      name, guarded, first, replay):
    """One kernel's life: start it, run `replay` (quietly) then the cells from `first` on; returns
    its bwrap process, whose exit status says why it died, if it did. Each kernel gets a key of its
    own (the guard reads the file and deletes it)."""
    run_dir = sandbox.run_dir
    key, key_file = secrets.token_bytes(32), run_dir / "guard.key"
    key_file.write_bytes(key)
    key_file.chmod(0o600)
    if sandbox.uid is not None:
        os.chown(key_file, sandbox.uid, sandbox.uid)
    km = AsyncKernelManager(kernel_name=kernel_name, kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(run_dir / "kernels")]),
                            transport="ipc", connection_file=str(run_dir / "kernel.json"))
    km.ip = str(run_dir / "kernel-ipc")
    client.km = km
    namespace, ns_fd, proc = None, None, None
    try:
        async with client.async_setup_kernel(stdout=log_file, stderr=log_file, cleanup_kc=True):
            proc = km.provisioner.process          # bwrap (launch.py exec'd it): its exit status says why
            run.transport = km.transport
            namespace, ns_fd = await _namespace(proc) if sandbox.enabled else (None, None)   # off: no namespace
            guard = Guard(client, name, key, limits.guard_timeout) if guarded else None
            cells = _execute_cells(client, guard, run, kinds, checkpoints, aliases, limits, start, first, replay)
            try:  # the budget is a hard deadline, whatever a cell or the kernel does
                await asyncio.wait_for(cells, timeout=max(1.0, limits.budget - (time.monotonic() - start)) + 5)
            except asyncio.TimeoutError:
                run.stopped = (run.current, "budget", f"the notebook ran past its budget of {limits.budget} s")
    except DeadKernelError:
        pass
    except Exception as e:  # kernel would not start, or the client failed: say so, never hang
        if run.stopped is None:
            run.stopped = (first, "grader-error", f"{type(e).__name__}: {e}")
    finally:
        client.km = None
        try:
            run.leftovers += kill_leftovers(namespace, sandbox.uid)
        finally:
            if ns_fd is not None:
                os.close(ns_fd)
    return proc


async def _namespace(proc) -> tuple[str | None, int | None]:
    """The sandbox's pid namespace (bwrap's first child lives in it), to find leftovers later, and an
    open descriptor of it. Hold the descriptor until the leftovers are killed: it keeps the namespace,
    and so its number, alive. Linux gives a freed namespace's number to the next one at once, so
    without it the search for this notebook's leftovers finds (and kills) the next sandbox's kernel."""
    if proc is None:
        return None, None
    for _ in range(50):
        kids = children(proc.pid)
        if kids:
            ns = pid_namespace(kids[0])
            if ns is None or ns == pid_namespace(os.getpid()):
                return None, None
            return ns, hold_namespace(kids[0], ns)
        await asyncio.sleep(0.1)
    return None, None


async def _execute_cells(client: GradingClient, guard: Guard | None, run: Run, kinds: list[str], checkpoints: dict,
                         aliases: dict, limits: RunLimits, start: float, first: int = 0, replay: list[int] = ()) -> None:
    msg_id = client.kc.kernel_info()
    await client.async_wait_for_reply(msg_id)
    if guard is None:
        guard = _NoGuard()
    try:
        body = await guard.call("config", aliases=aliases)
        if first == 0:
            run.reports.append({"index": -1, "op": "config", **body})
    except Exception as e:  # noqa: BLE001
        run.stopped = (first, "guard-broken", f"the guard did not start: {e}")
        return
    order = [(i, True) for i in replay] + [(i, False) for i in range(first, len(client.nb.cells))]
    for index, replaying in order:
        cell = client.nb.cells[index]
        if cell.cell_type != "code" or not cell.source.strip():
            continue
        if time.monotonic() - start > limits.budget:
            run.stopped = (first if replaying else index, "budget", f"the notebook ran past its budget of {limits.budget} s")
            return
        kind = kinds[index]
        run.current, run.replaying = index, replaying
        reports = [] if replaying else run.reports      # a replay's outputs and reports are not the grade's
        try:
            if kind in {"test", "locked"}:
                reports.append({"index": index, "op": "pre", **await guard.call("pre")})
            began = time.monotonic()
            try:
                if replaying:
                    await _replay_cell(client, cell, index)
                else:
                    await client.async_execute_cell(cell, index)
            except CellTimeoutError:  # iopub never finished: treat like a timeout
                client.timed_out.add(index)
            finally:
                if not replaying:
                    run.cell_seconds[index] = round(time.monotonic() - began, 2)
            # after an interrupt the kernel answers at once, or it ignored the interrupt
            guard.timeout = min(limits.guard_timeout, 15) if index in client.timed_out else limits.guard_timeout
            reports.append({"index": index, "op": "post", **await guard.call("post", **checkpoints.get(index, {}))})
            oom = None if replaying else out_of_memory(cell)
            if oom:      # what it allocated may still be held (a global, the traceback's frames): a new kernel
                run.stopped = (index, "out-of-memory", f"ran out of memory ({oom}); the kernel was replaced")
                return
        except DeadKernelError:
            run.stopped = (index, "kernel-died", "")
            return
        except ReplayFailed as e:
            run.stopped = (first, "timeout", f"{e}, after the kernel died; the rest was not run")
            return
        except (TimeoutError, RuntimeError) as e:
            if not await client.km.is_alive():
                run.stopped = (index, "kernel-died", "")
            elif index in client.timed_out:
                where = cell.metadata.get("nbgrader", {}).get("grade_id") or f"cell {index + 1}"
                run.stopped = (index + 1, "timeout", f"the kernel did not recover after interrupting {where}")
            else:
                run.stopped = (index, "guard-broken", str(e))
            return
    run.replaying = False
    if limits.widget_state:      # nbclient saves widget state only in execute(); cells run one by one here
        client.set_widgets_metadata()


async def _replay_cell(client: GradingClient, cell: NotebookNode, index: int) -> None:
    """Run a cell again in a new kernel for its effects only: its first run's outputs, output cap and
    timeout stay what the notebook shows."""
    copy = nbformat.from_dict(json.loads(json.dumps(cell)))
    used, capped, timed_out = client.output_used.get(index), set(client.capped), set(client.timed_out)
    try:
        await client.async_execute_cell(copy, index)
    finally:
        client.nb.cells[index] = cell
        client.output_used[index] = used or 0
        client.capped, late = capped, index in client.timed_out and index not in timed_out
        client.timed_out = timed_out
    if late:
        raise ReplayFailed(f"cell {index + 1} ran past its time limit when it was run again")
