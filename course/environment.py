"""`course.setup()`: the first cell of every lab.

It makes a notebook reproducible (seeds), quiet (nbgrader scores a test cell 0 if anything is
written to stderr, so library warnings must not reach it), and aware of its hardware (GPU or CPU,
Triton compiled or interpreted). It prints one line so a student can see what they are running on.
"""
from __future__ import annotations

import logging
import os
import platform
import random
import warnings
from dataclasses import dataclass

QUICK_ENV = "COURSE_QUICK"
CUDNN_SDPA_ENV = "TORCH_CUDNN_SDPA_DEPRIORITIZED"


@dataclass(frozen=True)
class Environment:
    """What `setup()` decided. `quick` shrinks demo workloads only, never what is graded."""

    device: str          # "cuda" or "cpu"
    quick: bool          # set by tests and grading through COURSE_QUICK=1
    triton_interpreted: bool
    seed: int
    dtype: "torch.dtype | None" = None  # the model's dtype here: bf16 on a GPU (fp16 without bf16), fp32 on a CPU

    def pick(self, full, quick, cpu=None):
        """A demo size (prompt length, repeats, ...) for this run: `quick` in quick mode (tests and
        grading), else `cpu` on a machine without a GPU when given (to keep a lab within minutes
        there), else `full`. Graded checks never use it."""
        if self.quick:
            return quick
        if cpu is not None and not self.gpu:
            return cpu
        return full

    @property
    def gpu(self) -> bool:
        return self.device.startswith("cuda")


def quick_mode() -> bool:
    """True when tests or the grader run the notebook (COURSE_QUICK=1)."""
    return os.environ.get(QUICK_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (every device) so runs repeat exactly."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device


def silence() -> None:
    """Keep library chatter off stderr: warnings, transformers/HF logging, progress bars of the hub."""
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    for name in ("transformers", "huggingface_hub", "torch", "urllib3", "filelock", "gguf"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    except ImportError:  # transformers is optional for the engine parts
        pass


def prefer_flash_attention() -> None:
    """Ask PyTorch to try FlashAttention and the memory-efficient kernel before cuDNN's attention.

    On an H100 or newer, recent PyTorch releases try cuDNN first for `scaled_dot_product_attention`
    when the cuDNN they load is newer than 9.15. cuDNN builds an execution plan for each new shape
    (batch, heads, query and key lengths) the first time it meets it, and keeps it for later calls of
    that shape. A generate loop meets a new key length at every step. Our eager GPU runs measured
    a cost of that kind: lab 03's cached loop on an H100 took about 56 ms per token the first time
    it met each length, and 18.5 ms per token on lengths it had met before. Engines avoid planning
    per shape (FlashAttention's kernels take any length; CUDA graphs fix the shapes). Whether
    cuDNN's plans are all of that cost, and how much of it this order takes back, has not been
    measured on a GPU yet. PyTorch reads the variable once, at its first attention call on a GPU,
    so this must run before any; set it to 0 beforehand to keep PyTorch's own order. Elsewhere (a
    CPU, an older GPU) it changes nothing."""
    os.environ.setdefault(CUDNN_SDPA_ENV, "1")


def _release(version: str | None) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '3.6.0' or '2.4.0rc1+local'; None when unreadable."""
    import re

    found = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(found[1]), int(found[2])) if found else None


def interpreter_problem(triton_version: str | None = None, numpy_version: str | None = None) -> str | None:
    """Why Triton's interpreter (what lab 06's kernels run on without a GPU) would fail here, or None.

    Triton 3.4 to 3.6 (torch 2.8 to 2.11's CUDA wheels pin them) convert one-element NumPy arrays to
    Python ints inside the interpreter, which NumPy 2.4 refuses: every kernel then stops with
    "only 0-dimensional arrays can be converted to Python scalars". NumPy 2.3 or Triton 3.7 works
    (checked here with 3.4.0, 3.5.1, 3.6.0 and 3.7.0 against NumPy 2.3.5 and 2.4.6). The versions
    default to the installed ones, read without importing either package."""
    from importlib import metadata

    def installed(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    triton_version = triton_version or installed("triton")
    numpy_version = numpy_version or installed("numpy")
    t, n = _release(triton_version), _release(numpy_version)
    if t is None or n is None or t >= (3, 7) or n < (2, 4):
        return None
    return (f"Triton {triton_version} cannot run kernels in its interpreter with NumPy {numpy_version} (lab 06 on a "
            f"CPU fails with \"only 0-dimensional arrays can be converted to Python scalars\"). Install NumPy "
            f"below 2.4 (pip install \"numpy<2.4\") or Triton 3.7 or later, then restart the kernel.")


def choose_device(device: str | None = None) -> str:
    """'cuda' when a GPU is usable, else 'cpu'. An explicit choice is checked, not trusted."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in {"cpu", "cuda"} and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} was asked for, but torch sees no CUDA GPU here; use 'cpu'")
    return device


def choose_dtype(device: str, dtype=None):
    """The dtype labs run the model in: fp32 on a CPU (bf16 matmuls are slow there and fp16 ones
    are not supported everywhere); on a GPU bf16, or fp16 where it has no bf16 (a T4, sm_75)."""
    import torch

    if dtype is not None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32, torch.float16 or torch.bfloat16, got {dtype!r}")
        return dtype
    if not device.startswith("cuda"):
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16


def setup(seed: int = 0, device: str | None = None, quiet: bool = True, verbose: bool = True,
          dtype=None) -> Environment:
    """Prepare a lab: seeds, silence, device, model dtype, Triton mode, and on a GPU the order of the
    attention kernels (`prefer_flash_attention`). Returns an `Environment`.

    Call it before anything imports Triton kernels: without a GPU it sets TRITON_INTERPRET=1,
    which Triton reads when `@triton.jit` runs, so kernels run (slowly) in the interpreter; it then
    warns (on stdout) if the installed Triton and NumPy cannot (`interpreter_problem`).
    """
    if not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if quiet:
        silence()
    dev = choose_device(device)
    interpreted = not dev.startswith("cuda")
    if interpreted:
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        prefer_flash_attention()
    seed_everything(seed)
    env = Environment(device=dev, quick=quick_mode(), triton_interpreted=interpreted, seed=seed,
                      dtype=choose_dtype(dev, dtype))
    if verbose:
        print(summary(env))
    problem = interpreter_problem() if interpreted else None
    if problem:                                   # stdout: a grading kernel scores stderr as a failure
        print("warning:", problem)
    return env


def summary(env: Environment) -> str:
    """One line: what this notebook runs on."""
    import torch

    if env.device.startswith("cuda"):
        hw = f"GPU {torch.cuda.get_device_name(0)}"
    else:
        hw = f"CPU {platform.machine()} ({torch.get_num_threads()} threads), no GPU"
    triton = "Triton interpreter" if env.triton_interpreted else "Triton compiled"
    mode = " | quick mode" if env.quick else ""
    dtype = f" | {str(env.dtype).removeprefix('torch.')}" if env.dtype is not None else ""
    return f"torch {torch.__version__} | {hw}{dtype} | {triton} | seed {env.seed}{mode}"
