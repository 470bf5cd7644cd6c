"""The grading sandbox: each student's kernel runs inside bubblewrap (`bwrap`), no Docker needed.

What the kernel sees (everything else does not exist for it):
- read-only: the system (/usr, /etc and the /bin, /lib links), this Python (the venv and its base
  interpreter), the `course` package, the converted model (mounted at /opt/course-cache), and the
  grader's in-kernel guard (/opt/course-grader/guard.py);
- private, size-limited tmpfs: /tmp and HOME (/home/student); the lab's data files are mounted
  read-only into the working directory /home/student/<lab>;
- read-write: one run folder that holds this kernel's connection file and IPC sockets.
Not there: labs/ (sources with solutions and hidden tests), autograder/ (gradebook, other
students' submissions), the grader's HOME, /run, /var, any other socket.

Isolation: new pid, network, IPC, UTS and (where available) cgroup namespaces; `--unshare-net`
leaves only a loopback device, so the kernel talks to the grader over ZeroMQ IPC sockets (unix
socket files in the run folder; `transport="ipc"`), not TCP. `--die-with-parent`: the kernel
dies with its grader; `--new-session`: no terminal to inject into; `--clearenv`: no grader
secrets in the environment. Resource limits (RLIMIT_AS, _CPU, _NPROC, _FSIZE, _NOFILE, core 0)
are set by launch.py and inherited by the kernel. As root, the kernel drops to a uid of its own
(setpriv, no capabilities, no new privileges): RLIMIT_NPROC does not apply to root, and a uid of
its own keeps two kernels graded in parallel from sharing one process budget. As an ordinary
user, bwrap makes a user namespace and the kernel keeps that user's uid.

Fails closed: `preflight()` starts a sandbox and checks that it works and is isolated; grading
stops with the reason when it does not (`make grade SANDBOX=off` is the explicit opt-out).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

HOME = "/home/student"
CACHE_MOUNT = "/opt/course-cache"
GRADER_MOUNT = "/opt/course-grader"
KERNEL_NAME = "course-grading-sandbox"
GUARD_FILE = Path(__file__).with_name("guard.py")
LAUNCHER = Path(__file__).with_name("launch.py")
SYSTEM_DIRS = ("/usr", "/etc")                        # read-only, as they are
SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")  # links or dirs, as they are
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; `make sandbox-tools` does it)"


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot start here; grading must not go on without it (unless explicitly opted out)."""


@dataclass(frozen=True)
class Limits:
    """Per-kernel limits. `processes` counts threads too (torch starts some); memory is address space."""

    memory_bytes: int = 8 << 30
    cpu_seconds: int = 3600
    processes: int = 256
    file_bytes: int = 1 << 30
    open_files: int = 1024
    core_bytes: int = 0
    tmpfs_bytes: int = 1 << 30        # each of /tmp and HOME


def bwrap_path() -> str:
    """The bwrap executable, or SandboxUnavailable saying how to install it."""
    found = shutil.which("bwrap")
    if not found:
        raise SandboxUnavailable(f"bubblewrap (`bwrap`) is not installed: {INSTALL_HINT}, "
                                 f"or grade without a sandbox with SANDBOX=off (only inside your own container)")
    return found


def sandbox_uid() -> int | None:
    """The uid a kernel runs as when the grader is root: one per grading process (never 0); None otherwise."""
    return 2_000_000 + os.getpid() if os.geteuid() == 0 else None


def _python_mounts() -> list[str]:
    """This interpreter: the venv (sys.prefix) and its base installation, unless already under /usr."""
    roots = {Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve()}
    return sorted(str(r) for r in roots if not str(r).startswith("/usr/"))


def course_package_dir() -> Path:
    """Where `import course` comes from (an editable install points outside the venv)."""
    import importlib.util

    spec = importlib.util.find_spec("course")
    if spec is None or not spec.origin:
        raise SandboxUnavailable("the `course` package is not importable by the grader; run `make setup`")
    return Path(spec.origin).resolve().parent


def readable_by_others(path: Path) -> bool:
    """True when every file under `path` is world-readable and every folder world-searchable."""
    for p in [path, *path.rglob("*")]:
        mode = p.stat().st_mode
        need = stat.S_IROTH | (stat.S_IXOTH if p.is_dir() else 0)
        if mode & need != need:
            return False
    return True


def readable_copy(src: Path, dst: Path) -> Path:
    """A world-readable copy of `src` at `dst` (for a sandbox uid that may not read the grader's files)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for p in [dst, *dst.rglob("*")]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    return dst


@dataclass
class Sandbox:
    """One kernel's jail. `run_dir`: read-write, same path inside (connection file, IPC sockets).
    `data`: files mounted read-only into the working directory HOME/<lab>. `cache`: the model cache."""

    run_dir: Path
    lab: str
    cache: Path | None = None
    data: list[Path] = field(default_factory=list)
    limits: Limits = field(default_factory=Limits)
    env: dict[str, str] = field(default_factory=dict)
    uid: int | None = field(default_factory=sandbox_uid)
    gpu: bool = False
    enabled: bool = True     # False: SANDBOX=off, the kernel runs as the grader (limits still apply)

    def __post_init__(self) -> None:
        if not self.enabled:
            self.uid = None

    def host_cwd(self) -> Path:
        """The kernel's working directory as the grader sees it (off: a copy of the data files)."""
        if self.enabled:
            return self.run_dir
        work = self.run_dir / "work" / self.lab
        if not work.exists():
            work.mkdir(parents=True)
            for p in self.data:
                (shutil.copytree if p.is_dir() else shutil.copy2)(p, work / p.name)
        return work

    @property
    def cwd(self) -> str:
        return f"{HOME}/{self.lab}"

    def _mounts(self) -> list[str]:
        """bwrap arguments for the file system, in order (a parent before what is mounted inside it)."""
        args: list[str] = []
        made: set[str] = {"/"}

        def parents(path: str) -> None:
            # bwrap creates missing parents as 0700 root: the sandbox uid could not pass them
            parts = Path(path).parts
            for i in range(2, len(parts)):
                p = str(Path(*parts[:i]))
                if p not in made:
                    args.extend(["--perms", "0755", "--dir", p])
                    made.add(p)

        def ro(src: str | Path, dst: str | Path | None = None) -> None:
            dst = str(dst or src)
            parents(dst)
            args.extend(["--ro-bind", str(src), dst])
            made.add(dst)

        for d in SYSTEM_DIRS:
            ro(d)
        for link in SYSTEM_LINKS:
            if os.path.islink(link):
                args.extend(["--symlink", os.readlink(link), link])
            elif os.path.isdir(link):
                ro(link)
        # The private /tmp goes in before Python and the course: mounted after them, it would hide
        # them when they live under /tmp (a checkout in /tmp, as CI may make).
        size = str(self.limits.tmpfs_bytes)
        args.extend(["--perms", "1777", "--size", size, "--tmpfs", "/tmp"])
        made.add("/tmp")
        for d in _python_mounts():
            ro(d)
        ro(course_package_dir())
        args.extend(["--proc", "/proc", "--dev", "/dev"])
        if os.path.isdir("/sys/devices/system/cpu"):
            ro("/sys/devices/system/cpu")               # torch and OpenMP count cores here
        parents(HOME)
        args.extend(["--perms", "0777", "--size", size, "--tmpfs", HOME])
        args.extend(["--perms", "0777", "--dir", self.cwd])
        for p in self.data:
            ro(p, f"{self.cwd}/{p.name}")
        if self.cache is not None:
            ro(self.cache, CACHE_MOUNT)
        ro(GUARD_FILE, f"{GRADER_MOUNT}/guard.py")
        parents(str(self.run_dir))
        args.extend(["--bind", str(self.run_dir), str(self.run_dir)])
        if self.gpu:  # NVIDIA: device nodes and the driver's /sys and /proc entries (see GUIDE.md)
            for dev in sorted(Path("/dev").glob("nvidia*")):
                args.extend(["--dev-bind", str(dev), str(dev)])
            ro("/sys")
        return args

    def environment(self) -> dict[str, str]:
        """The kernel's whole environment (bwrap starts from an empty one)."""
        env = {
            "HOME": HOME, "USER": "student", "LOGNAME": "student", "LANG": "C.UTF-8", "TMPDIR": "/tmp",
            "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin",
            "PYTHONNOUSERSITE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "PYDEVD_DISABLE_FILE_VALIDATION": "1",
        }
        if self.cache is not None:
            env["COURSE_CACHE"] = CACHE_MOUNT
        env.update(self.env)
        return env

    def command(self, argv: list[str]) -> list[str]:
        """The full command that runs `argv` in this sandbox (limits come from launch.py / `run`)."""
        if not self.enabled:
            return list(argv)
        cmd = [bwrap_path(), "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
               "--unshare-cgroup-try", "--hostname", "sandbox", "--die-with-parent", "--new-session",
               "--clearenv"]
        if self.uid is None:  # unprivileged: bwrap needs a user namespace; no nested ones inside
            cmd += ["--unshare-user", "--disable-userns", "--cap-drop", "ALL"]
        cmd += self._mounts()
        for key, value in self.environment().items():
            cmd += ["--setenv", key, value]
        cmd += ["--chdir", self.cwd, "--"]
        if self.uid is not None:  # root: become a uid of our own, without capabilities
            cmd += [shutil.which("setpriv") or "/usr/bin/setpriv", f"--reuid={self.uid}", f"--regid={self.uid}",
                    "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        return cmd + argv

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """(soft, hard) per launch.LIMITS key. The CPU limit's soft one sends SIGXCPU (a clear reason),
        the hard one, 5 s later, SIGKILL (for code that catches SIGXCPU).

        Memory is capped as address space (RLIMIT_AS), except with `gpu`: CUDA reserves far more
        address space than it uses (on an H100 it did not start under 8 GiB of it, and did under 64),
        so there the cap is on private writable memory (RLIMIT_DATA: heap and anonymous memory, what
        tensors on the CPU take), and address space is not limited."""
        limits = asdict(self.limits)
        limits.pop("tmpfs_bytes")
        if self.gpu:
            limits["data_bytes"] = limits.pop("memory_bytes")
        if self.uid is None:  # RLIMIT_NPROC counts every process of this user: leave room for theirs
            limits["processes"] += user_task_count(os.getuid())
        pairs = {k: (v, v) for k, v in limits.items()}
        pairs["cpu_seconds"] = (limits["cpu_seconds"], limits["cpu_seconds"] + 5)
        return pairs

    def prepare(self) -> None:
        """Create the run folder, owned by the sandbox uid (the kernel creates its sockets there)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.uid is not None:
            os.chown(self.run_dir, self.uid, self.uid)

    def write_kernelspec(self, kernels_dir: Path, extra_args: list[str] = (), guard: bool = True) -> str:
        """A kernelspec named KERNEL_NAME under `kernels_dir` whose kernel is ipykernel in this sandbox.

        `interrupt_mode: message`: a SIGINT sent to bwrap would not reach the kernel (it runs in a
        new session), so cell timeouts interrupt through the control channel instead. `guard`:
        load guard.py at start (only tests turn it off, to show what the attacks do without it).
        """
        self.prepare()
        plan = self.run_dir / "plan.json"
        guard_path = f"{GRADER_MOUNT}/guard.py" if self.enabled else str(GUARD_FILE)
        kernel = [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}",
                  *([f"--IPKernelApp.exec_files={guard_path}"] if guard else []), *extra_args]
        plan.write_text(json.dumps({"uid": self.uid, "rlimits": self.rlimits(), "command": self.command(kernel)}))
        spec_dir = kernels_dir / KERNEL_NAME
        spec_dir.mkdir(parents=True, exist_ok=True)
        (spec_dir / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-I", str(LAUNCHER), str(plan), "{connection_file}"],
            "display_name": "Python 3 (grading sandbox)", "language": "python",
            "interrupt_mode": "message", "metadata": {"debugger": False},
            "env": {} if self.enabled else dict(self.env),   # bwrap sets the whole environment itself
        }, indent=1))
        return KERNEL_NAME

    def run(self, argv: list[str], timeout: float = 120, **kw) -> subprocess.CompletedProcess:
        """Run a plain command in this sandbox (preflight and tests); output captured as text."""
        self.prepare()
        rl = self.rlimits()

        def limit() -> None:
            import resource

            from autograder.grade.launch import LIMITS
            for key, pair in rl.items():
                resource.setrlimit(LIMITS[key], pair)

        return subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout,
                              preexec_fn=limit, **kw)


def user_task_count(uid: int) -> int:
    """How many tasks (threads included, as RLIMIT_NPROC counts them) `uid` runs now."""
    count = 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if proc.stat().st_uid == uid:
                count += sum(1 for _ in (proc / "task").iterdir())
        except OSError:
            continue
    return count


def pid_namespace(pid: int) -> str | None:
    """The pid namespace of a process ('pid:[4026532...]'), or None when it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def hold_namespace(pid: int, ns: str) -> int | None:
    """An open descriptor of `pid`'s pid namespace `ns` (None if it is gone or not that one): while it is
    open, the namespace's number cannot be given to another one."""
    try:
        fd = os.open(f"/proc/{pid}/ns/pid", os.O_RDONLY)
    except OSError:
        return None
    if os.readlink(f"/proc/self/fd/{fd}") != ns:      # the process left and its pid was reused
        os.close(fd)
        return None
    return fd


def children(pid: int) -> list[int]:
    """Direct children of a process."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def processes_in(namespace: str | None, uid: int | None = None) -> list[int]:
    """Pids still running in a pid namespace, or (with `uid`) as that uid."""
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if (namespace and os.readlink(proc / "ns" / "pid") == namespace) or (uid is not None and proc.stat().st_uid == uid):
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return [p for p in found if p != os.getpid()]


def _dying(pid: int) -> bool:
    """Already on its way out: a zombie, or SIGKILL pending (the namespace's teardown sent it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return True
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    pending = int(fields.get("ShdPnd", "0").strip(), 16) | int(fields.get("SigPnd", "0").strip(), 16)
    return fields.get("State", "").strip()[:1] in {"Z", "X"} or bool(pending & (1 << (signal.SIGKILL - 1)))


def kill_leftovers(namespace: str | None, uid: int | None, grace: float = 10.0) -> list[int]:
    """Processes that outlived the kernel in the sandbox's pid namespace (or as its uid): they are
    SIGKILLed; returns those that were not already being torn down when `grace` seconds had passed
    (normally none: the namespace's init died with the kernel, and the kernel kills the rest).
    Zombies are not waited for: the namespace's init is reparented to the host's init, which may
    take a second or more to reap it."""
    import time

    deadline = time.monotonic() + grace
    while (left := processes_in(namespace, uid)) and not all(map(_dying, left)) and time.monotonic() < deadline:
        time.sleep(0.1)
    survivors = [pid for pid in left if not _dying(pid)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return survivors


PROBE = """
import json, os, socket
found = {"uid": os.getuid()}
try:
    socket.create_connection(("1.1.1.1", 53), timeout=3).close()
    found["network"] = "open"
except OSError as e:
    found["network"] = str(e)
found["visible"] = [p for p in %r if os.path.exists(p)]
import course
print(json.dumps(found))
"""


def preflight(run_dir: Path, hidden: list[Path], cache: Path | None = None) -> str:
    """Start a sandbox and check it: it runs this Python and imports `course`, has no network, and
    sees none of `hidden` (labs/, autograder/, the gradebook, a file in the grader's /tmp). Returns
    a one-line description; raises SandboxUnavailable saying what failed (grading stops: fail closed)."""
    box = Sandbox(run_dir=run_dir, lab="preflight", cache=cache)
    try:
        done = box.run([sys.executable, "-c", PROBE % [str(p) for p in hidden]], timeout=180)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"the sandbox did not start: {e}") from None
    if done.returncode != 0:
        hint = (" (user namespaces disabled? In Docker, bwrap needs --security-opt seccomp=unconfined "
                "or --privileged; otherwise grade inside your own container with SANDBOX=off)"
                if "namespace" in done.stderr.lower() or "permission" in done.stderr.lower() else "")
        raise SandboxUnavailable(f"the sandbox did not start: {done.stderr.strip()[-600:]}{hint}")
    try:
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SandboxUnavailable(f"the sandbox probe printed nothing readable: {done.stdout[-300:]}") from None
    problems = []
    if found["network"] == "open":
        problems.append("it can reach the network")
    if found["visible"]:
        problems.append(f"it can see {', '.join(found['visible'])}")
    if os.geteuid() == 0 and found["uid"] == 0:
        problems.append("its kernel runs as root")
    if problems:
        raise SandboxUnavailable("the sandbox is not isolated: " + "; ".join(problems))
    mode = f"uid {found['uid']}" if box.uid is not None else "user namespace"
    return f"bubblewrap sandbox OK ({mode}, no network, sources and gradebook not visible)"


CUDA_PROBE = """
import json, torch
torch.zeros(1, device="cuda")           # starts CUDA (raises with the driver's reason)
print(json.dumps({"devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}))
"""


def preflight_gpu(run_dir: Path, limits: Limits, cache: Path | None = None, enabled: bool = True) -> str:
    """For `--gpu`: start a kernel's sandbox with the NVIDIA devices and the kernels' own limits, and
    check that CUDA starts in it. Without this check a kernel whose CUDA failed to start would see no
    GPU and grade the whole class on the CPU. Returns a one-line description; raises
    SandboxUnavailable saying what failed."""
    devices = sorted(str(p) for p in Path("/dev").glob("nvidia*"))
    if enabled and not devices:
        raise SandboxUnavailable("--gpu: this machine has no NVIDIA device nodes (/dev/nvidia*); "
                                 "grade without --gpu (the labs then run on the CPU)")
    box = Sandbox(run_dir=run_dir, lab="preflight-gpu", cache=cache, limits=limits, gpu=True, enabled=enabled)
    try:
        done = box.run([sys.executable, "-c", CUDA_PROBE], timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SandboxUnavailable(f"--gpu: the GPU check did not finish: {e}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise SandboxUnavailable(f"--gpu: CUDA does not start inside the sandbox ({last[-400:]}). "
                                 f"Devices bound: {', '.join(devices) or 'none'}; memory cap "
                                 f"{limits.memory_bytes / (1 << 30):g} GiB of private memory (--memory).")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return f"GPU check OK: CUDA starts inside the sandbox ({', '.join(found['devices'])})"
