"""Where the submissions are graded: here, `JOBS` at a time, or on a Dask cluster (`SCHEDULER=`).

    make grade JOBS=2                              # this machine: a pool of grading processes
    make grade SCHEDULER=tcp://10.0.0.5:8786       # a running Dask cluster, any size

The pipeline (pipeline.py) is the same for both: it hands each job to a backend, takes the outcomes
as they complete, and records them itself, one at a time (the gradebook has one writer, the client).

On a cluster nothing is shared but the scheduler's address. A job travels as bytes (the submission,
the lab's source and release, its data files) and comes back as bytes (the outcome and the graded
notebook); the client writes the feedback. A worker needs the course installed at the same commit
(`make setup`, or the hub's image) and is started with one thread per grading process:

    dask scheduler --host 0.0.0.0 --port 8786
    dask worker tcp://HOST:8786 --nworkers 4 --nthreads 1                      # a CPU machine
    dask worker tcp://HOST:8786 --nworkers 1 --nthreads 1 --resources GPU=1    # a GPU machine

Fails closed, worker by worker. When the run starts, and again whenever a worker joins or restarts,
`SandboxCheck` (a Dask worker plugin) checks that worker: the same course code as the client, and
its sandbox (bubblewrap, no network, the sources hidden; CUDA inside it for `--gpu`). Only then does
the worker get the resource every grading job asks for (`RESOURCE`), so a worker that fails the check
is never given a job, and the run says which worker and why.

Faults: a worker that dies mid-job (killed, out of memory) loses only that attempt; the scheduler runs
the job elsewhere. A submission that kills every worker it lands on is given up after Dask's
`allowed-failures` (3 by default) and becomes that student's `grader-error`, with the reason. A
scheduler that goes away stops the run with a clear error; every outcome recorded until then is kept,
and `RESUME=1` grades only what is missing.
"""
from __future__ import annotations

import asyncio
import atexit
import hashlib
import os
import shutil
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path

try:
    from distributed import WorkerPlugin
except ImportError:               # grading on this machine only: Dask is not needed
    WorkerPlugin = object

from autograder import LABS, REPO, ROOT
from autograder.grade.outcome import Outcome
from autograder.grade import scratch
from autograder.grade.sandbox import Limits, SandboxUnavailable

RESOURCE = "course-grader"          # granted by SandboxCheck to a worker that passed; every job asks for 1
CODE_DIRS = ("course", "autograder")  # what a worker must hold the same of (plus the labs' notebooks)


POLL_S = 5           # how often a wait for the next outcome checks that the client is still connected


class ClusterLost(RuntimeError):
    """The scheduler went away during the run (what is recorded stays recorded)."""


def code_version(repo: Path = REPO) -> dict:
    """{"commit": the git commit ('+changes' when the tree differs; 'unknown' without git), "code": a hash
    of the course's Python files and the labs' notebooks}. Two machines grade alike when the codes match."""
    from autograder.gpu_record import commit_label

    digest = hashlib.sha256()
    files = sorted(p for d in CODE_DIRS for p in (repo / d).rglob("*.py") if "__pycache__" not in p.parts)
    files += sorted((repo / "labs").glob("*/*.ipynb"))
    for path in files:
        digest.update(str(path.relative_to(repo)).encode() + b"\0" + path.read_bytes() + b"\0")
    return {"commit": commit_label(repo), "code": digest.hexdigest()[:12]}


def describe_version(v: dict) -> str:
    return f"commit {v['commit']} (code {v['code']})"


# --- both: jobs handed out as workers free up --------------------------------------------------------

class _Backend:
    """What both backends share: `run` hands out jobs a few at a time (as many as can run, and one more,
    so that no worker waits for the next) and yields (future, job) as each finishes. Handing out all at
    once would tie each job to a worker up front: on a cluster, a worker that dies then passes its whole
    queue to one other worker, and the worker that restarts in its place gets none of it."""

    def capacity(self) -> int:
        return self.workers

    def run(self, jobs: list, timeout: int):
        waiting, pending = list(reversed(jobs)), {}
        while waiting or pending:
            while waiting and len(pending) < self.capacity() + 1:
                job = waiting.pop()
                pending[self.submit(job, timeout)] = job
            for fut in self.wait_first(list(pending)):
                yield fut, pending.pop(fut)


# --- this machine --------------------------------------------------------------------------------

class LocalPool(_Backend):
    """`jobs` grading processes on this machine, each started by a thread of this process."""

    def __init__(self, jobs: int):
        self.pool = ThreadPoolExecutor(max_workers=jobs)
        self.workers = jobs
        self.where = f"{jobs} local process{'es' if jobs != 1 else ''}"

    def submit(self, job, timeout: int):
        from autograder.grade.pipeline import _run_worker

        return self.pool.submit(_run_worker, job, timeout)

    def wait_first(self, futures) -> set:
        return wait(futures, return_when=FIRST_COMPLETED).done

    def outcome(self, future, job) -> Outcome:
        return future.result()

    def close(self) -> None:
        self.pool.shutdown(wait=True)


# --- a Dask cluster -------------------------------------------------------------------------------

_check: dict | None = None        # this worker process's own check (SandboxCheck sets it)
_jobs_taken = 0                   # grading jobs this worker process has started


_model_copies: dict = {}           # sandboxed -> the model's folder this worker process gives its kernels


def worker_model_cache(sandboxed: bool) -> Path | None:
    """pipeline.model_cache, once per worker process: where a root worker must copy the model for the
    kernels' own uid to read (about 0.5 GB), the copy is made for its first job and reused after."""
    from autograder.grade.pipeline import model_cache

    if sandboxed not in _model_copies:
        keep = scratch.make("course-worker-model-")   # a killed worker's copy: the next worker removes it
        atexit.register(shutil.rmtree, keep, True)
        _model_copies[sandboxed] = model_cache(keep, sandboxed)
    return _model_copies[sandboxed]


def check_this_worker(expected: dict, sandbox: bool, gpu: bool, limits: dict) -> dict:
    """What SandboxCheck runs on a worker: same code as the client, then the sandbox (and CUDA in it).
    Returns {"version", "ok", "why", "said"}."""
    from autograder.grade import sandbox as sb

    scratch.sweep()                      # the folders of workers killed before their clean-up ran
    mine = code_version()
    result = {"version": mine, "ok": False, "why": "", "said": ""}
    if mine["code"] != expected["code"]:
        result["why"] = (f"this worker runs {describe_version(mine)}, the client {describe_version(expected)}: "
                         f"install the client's commit on this machine (`git checkout {expected['commit']}`, "
                         f"`make setup`) and restart the worker")
        return result
    with tempfile.TemporaryDirectory(prefix="course-worker-check-") as tmp:
        tmp = Path(tmp)
        try:
            cache = worker_model_cache(sandbox)
            said = []
            if sandbox:
                canary = tmp / "canary"
                canary.write_text("not for students")
                said.append(sb.preflight(tmp / "preflight", [LABS.resolve(), ROOT, Path.home() / ".cache", canary], cache))
            if gpu:
                said.append(sb.preflight_gpu(tmp / "preflight-gpu", Limits(**limits), cache, enabled=sandbox))
            result.update(ok=True, said="; ".join(said) or "no sandbox (SANDBOX=off)")
        except SandboxUnavailable as e:
            result["why"] = str(e)
    return result


class SandboxCheck(WorkerPlugin):
    """A Dask worker plugin: checks each worker as it starts (or when registered), and grants it
    RESOURCE only if it passed. Registered by the client with what it expects."""

    name = "course-sandbox-check"

    def __init__(self, expected: dict, sandbox: bool, gpu: bool, limits: dict):
        self.expected, self.sandbox, self.gpu, self.limits = expected, sandbox, gpu, limits

    async def setup(self, worker) -> None:
        global _check
        _check = await asyncio.to_thread(check_this_worker, self.expected, self.sandbox, self.gpu, self.limits)
        if _check["ok"]:
            await worker.set_resources(**{RESOURCE: worker.state.nthreads})


def worker_check_result() -> dict | None:
    """Run on every worker by the client: the worker's check, or None while it has not finished."""
    return _check


def jobs_taken() -> int:
    """Run on a worker: how many grading jobs it has started."""
    return _jobs_taken


def grade_remote(payload: dict) -> dict:
    """A grading job on a worker: write what the job carries into a private folder, grade it as this
    machine would (pipeline._run_worker: its own process, in this worker's sandbox), send back the bytes."""
    from autograder.grade.pipeline import _run_worker
    from autograder.grade.worker import Job

    if _check is None or not _check["ok"]:
        raise SandboxUnavailable(f"this worker has not passed its check: {(_check or {}).get('why', 'not run')}")
    start = time.monotonic()
    tmp = scratch.make("course-grade-remote-")
    try:
        files = {}
        for name, data in payload["files"].items():            # submission, source, release, data/<name>
            path = tmp / "in" / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            files[name] = str(path)
        work = tmp / "work"
        work.mkdir()
        cache = worker_model_cache(payload["sandbox"])
        threads = os.environ.get("OMP_NUM_THREADS", "1")     # this worker's share of its machine (Dask's nanny sets 1)
        env = payload["env"] | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        job = Job(payload["student"], payload["lab"], files["submission.ipynb"], files["source.ipynb"],
                  files["release.ipynb"], str(work), [files[n] for n in sorted(files) if n.startswith("data/")],
                  str(cache) if cache else None, payload["sandbox"], payload["gpu"], env,
                  payload["limits"], payload["run_limits"])
        global _jobs_taken
        _jobs_taken += 1
        outcome = _run_worker(job, payload["timeout"])
        graded = work / "autograded.ipynb"
        return {"outcome": outcome.to_json(), "autograded": graded.read_bytes() if graded.is_file() else None,
                "host": os.uname().nodename, "seconds": round(time.monotonic() - start, 1)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class DaskCluster(_Backend):
    """Jobs on a running Dask cluster at `address`; only workers that passed SandboxCheck take them."""

    def __init__(self, address: str, log, sandbox: bool, gpu: bool, limits: dict, wait_s: float = 60):
        try:
            from distributed import Client
        except ImportError:
            raise ValueError("SCHEDULER needs Dask's `distributed` package: `make setup` installs it "
                             "(pip install distributed)") from None
        self.log = log
        self.version = code_version()
        try:
            self.client = Client(address)     # connect and reconnect timeout: distributed.comm.timeouts.connect (30 s)
        except (OSError, TimeoutError) as e:
            raise ValueError(f"SCHEDULER={address}: no Dask scheduler answers there ({e}); start one with "
                             f"`dask scheduler --port 8786` and workers with `dask worker {address} --nthreads 1`") from None
        self.address = address
        self.client.register_plugin(SandboxCheck(self.version, sandbox, gpu, limits), name=SandboxCheck.name)
        checks = self._checks(wait_s)
        good = [a for a, c in checks.items() if c and c["ok"]]
        for addr, c in sorted(checks.items()):
            if c is None:
                log(f"worker {addr}: its check did not finish in {wait_s:g} s: it takes no job until it does")
            elif not c["ok"]:
                log(f"worker {addr}: takes no job: {c['why']}")
        if not good:
            raise SandboxUnavailable(f"no worker of {address} passed its check ({len(checks)} connected), "
                                     f"so nothing is graded; see the lines above")
        self.workers = len(good)
        self.where = f"{len(good)} Dask worker{'s' if len(good) != 1 else ''} at {address}"
        log(f"{self.where} ready, {describe_version(self.version)}: {checks[good[0]]['said']}")

    def _checks(self, wait_s: float) -> dict:
        deadline = time.monotonic() + wait_s
        while True:
            checks = self.client.run(worker_check_result)
            if not checks:
                raise SandboxUnavailable(f"SCHEDULER={self.address}: the scheduler has no workers; start some "
                                         f"with `dask worker {self.address} --nthreads 1`")
            if all(c is not None for c in checks.values()) or time.monotonic() > deadline:
                return checks
            time.sleep(0.5)

    def submit(self, job, timeout: int):
        files = {"submission.ipynb": Path(job.submission).read_bytes(), "source.ipynb": Path(job.source).read_bytes(),
                 "release.ipynb": Path(job.release).read_bytes()}
        files |= {f"data/{Path(p).name}": Path(p).read_bytes() for p in job.data}
        payload = {"student": job.student, "lab": job.lab, "files": files, "sandbox": job.sandbox, "gpu": job.gpu,
                   "env": job.env, "limits": job.limits, "run_limits": job.run_limits, "timeout": timeout}
        resources = {RESOURCE: 1} | ({"GPU": 1} if job.gpu else {})
        if self.client.status in ("closing", "closed"):
            raise self._lost(RuntimeError("client closed"))
        return self.client.submit(grade_remote, payload, key=f"grade-{job.lab}-{job.student}-{os.urandom(4).hex()}",
                                  pure=False, resources=resources, retries=0)

    def capacity(self) -> int:
        """Grading slots now: workers join, restart and leave during a run."""
        try:
            info = self.client.scheduler_info(n_workers=-1)["workers"].values()
        except Exception:  # noqa: BLE001 - the scheduler is going; outcome() says so
            return self.workers
        return max(1, int(sum(w.get("resources", {}).get(RESOURCE, 0) for w in info)))

    def wait_first(self, futures) -> set:
        from concurrent.futures import CancelledError

        from distributed import wait as dask_wait
        from distributed.client import FuturesCancelledError

        # In slices, checking the client between them: one that failed to reconnect closes itself and may
        # leave its futures pending, and once it is closed dask's wait finds no client (a ValueError).
        while True:
            if self.client.status in ("closing", "closed"):
                raise self._lost(RuntimeError("client closed"))
            try:
                return dask_wait(futures, timeout=POLL_S, return_when="FIRST_COMPLETED").done
            except (TimeoutError, ValueError) as e:
                if self.client.status in ("closing", "closed"):
                    raise self._lost(e) from None
                if isinstance(e, ValueError):
                    raise
            except (FuturesCancelledError, CancelledError, OSError) as e:
                raise self._lost(e) from None

    def _lost(self, e: Exception) -> ClusterLost:
        return ClusterLost(f"the Dask scheduler at {self.address} went away ({type(e).__name__}); every outcome "
                           f"recorded so far is kept: rerun with RESUME=1 to grade only what is missing")

    def outcome(self, future, job) -> Outcome:
        from distributed.client import FutureCancelledError
        from distributed.scheduler import KilledWorker

        from autograder.grade.pipeline import _not_graded

        try:
            result = future.result()
        except KilledWorker as e:
            tries = getattr(e, "allowed_failures", 3)
            return _not_graded(job.student, job.lab, Path(job.source), "grader-error",
                               f"grading it killed the Dask worker each of the {tries} times it was tried (Dask's "
                               f"allowed-failures): a memory or fork bomb, or a crash outside the sandbox's limits")
        except (FutureCancelledError, OSError, TimeoutError) as e:
            raise self._lost(e) from None
        except SandboxUnavailable as e:
            return _not_graded(job.student, job.lab, Path(job.source), "grader-error", f"a worker refused it: {e}")
        if result["autograded"] is not None:
            (Path(job.work) / "autograded.ipynb").write_bytes(result["autograded"])
        return Outcome.from_json(result["outcome"])

    def close(self) -> None:
        try:
            self.client.unregister_worker_plugin(SandboxCheck.name)
        except Exception:  # noqa: BLE001 - the scheduler may be gone; nothing to undo then
            pass
        self.client.close()
