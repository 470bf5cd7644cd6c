"""A real Dask cluster on loopback for the grading tests: `dask scheduler` and `dask worker` processes,
as an instructor starts them. Everything stops by itself: the scheduler after 10 idle minutes, the
workers 60 s after their scheduler is gone; the context manager stops them at once."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from autograder import REPO


def _start(args: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           **(env or {})}
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.contextmanager
def dask_cluster(root: Path, workers: int = 2, broken: bool = True):
    """Yields the scheduler's address. `workers` grading processes (`--nworkers N --nthreads 1`), and with
    `broken` one more whose PATH has no bubblewrap: it must never be given a job."""
    root.mkdir(parents=True, exist_ok=True)
    spec = root / "scheduler.json"
    procs = [_start(["distributed.cli.dask_scheduler", "--host", "127.0.0.1", "--port", "0", "--no-dashboard",
                     "--scheduler-file", str(spec), "--idle-timeout", "600"], root / "scheduler.log")]
    (root / "scheduler.pid").write_text(str(procs[0].pid))
    try:
        deadline = time.monotonic() + 60
        while not spec.exists():
            if time.monotonic() > deadline or procs[0].poll() is not None:
                raise RuntimeError(f"the Dask scheduler did not start: {(root / 'scheduler.log').read_text()[-2000:]}")
            time.sleep(0.2)
        address = json.loads(spec.read_text())["address"]
        common = ["--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard", "--death-timeout", "60"]
        procs.append(_start(["distributed.cli.dask_worker", address, "--nworkers", str(workers), *common],
                            root / "workers.log"))
        if broken:
            procs.append(_start(["distributed.cli.dask_worker", address, "--name", "no-bubblewrap", *common],
                                root / "broken-worker.log", env={"PATH": str(Path(sys.executable).parent)}))
        from distributed import Client

        with Client(address, timeout="30s") as client:
            client.wait_for_workers(workers + broken, timeout=120)
        yield address
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


class kill_a_worker_mid_job:
    """A thread that waits until `after` outcomes are stored in `outcomes`, then SIGKILLs a grading
    worker while it runs a job (Dask's nanny starts a new one; the job must run again elsewhere).
    `report()` joins it: {"killed": the job's key or None, "workers": {address: name}, "taken": {address: jobs}}."""

    def __init__(self, address: str, outcomes: Path, after: int, timeout: float = 1800):
        import threading

        self.address, self.outcomes, self.after, self.timeout = address, outcomes, after, timeout
        self.killed = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from distributed import Client

        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline and len(list(self.outcomes.glob("*/*.json"))) < self.after:
            time.sleep(0.5)
        with Client(self.address, timeout="30s") as client:
            while time.monotonic() < deadline and self.killed is None:
                running = client.run(lambda dask_worker: [str(t.key) for t in dask_worker.state.executing])
                busy = [(w, keys[0]) for w, keys in sorted(running.items()) if keys]
                if busy:
                    worker, key = busy[0]
                    time.sleep(1)                      # well inside the job: its kernel is running
                    pid = client.run(os.getpid, workers=[worker])[worker]
                    os.kill(pid, signal.SIGKILL)
                    self.killed = key
                time.sleep(0.5)

    def report(self) -> dict:
        from distributed import Client

        from autograder.grade import cluster

        self.thread.join(timeout=60)
        with Client(self.address, timeout="30s") as client:
            workers = {a: w["name"] for a, w in client.scheduler_info()["workers"].items()}
            taken = client.run(cluster.jobs_taken)
        return {"killed": self.killed, "workers": workers, "taken": taken}
