"""How fast can this machine compute, and how fast can it move bytes? The two numbers of a roofline.

    from course.hardware import GPUS, device_peak, plot_roofline
    peak = device_peak(env)          # a GPU we know: its datasheet; anything else: measured here
    plot_roofline(peak, {"decode": (0.5, None), "prefill": (130.0, 2.1e11)})

A kernel that does F FLOPs while moving B bytes to and from memory has arithmetic intensity I = F / B.
It cannot run faster than the compute peak, nor faster than bandwidth x I: attainable FLOP/s =
min(peak_flops, bandwidth * I). The intensity where the two limits meet is the *ridge point*:
left of it a workload is memory-bound, right of it compute-bound.

GPU figures are the vendors' peak numbers, DENSE (the headline tensor figures of Ampere and later
assume 2:4 structured sparsity and are twice these; we halve them), from the datasheets:
NVIDIA T4, L4, A100 (40GB/80GB), H100 and H200 datasheets, the NVIDIA Ada Lovelace architecture
whitepaper (GeForce RTX 4090: fp16 tensor with fp32 accumulation, the mode PyTorch uses). The
A10G is AWS's variant of the A10 and has no NVIDIA datasheet: its figures are the ones AWS
partners publish (lower tensor throughput than the A10, same 600 GB/s memory).
Peaks are ceilings: real kernels reach 60-90% of them at best.
"""
from __future__ import annotations

import math
import platform
import re
from dataclasses import dataclass

import torch

from course.timing import benchmark

SOURCES = ("measured", "datasheet")


@dataclass(frozen=True)
class Peak:
    """The two ceilings of a roofline: `flops` (FLOP/s) and `bytes_per_s` (memory bandwidth, B/s)."""

    name: str
    flops: float
    bytes_per_s: float
    source: str  # "measured" or "datasheet"

    def __post_init__(self):
        for field_name in ("flops", "bytes_per_s"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"Peak.{field_name} must be a positive finite number, got {value!r}")
        if self.source not in SOURCES:
            raise ValueError(f"Peak.source must be one of {SOURCES}, got {self.source!r}")

    @property
    def ridge(self) -> float:
        """Intensity (FLOP/byte) where memory bandwidth stops being the limit."""
        return self.flops / self.bytes_per_s

    def attainable(self, intensity: float) -> float:
        """The roofline: the most FLOP/s a workload of this intensity can reach here."""
        if not intensity > 0:
            raise ValueError(f"intensity must be > 0 FLOP/byte, got {intensity!r}")
        return min(self.flops, self.bytes_per_s * intensity)

    def __str__(self) -> str:
        return (f"{self.name}: {self.flops / 1e12:.3g} TFLOP/s, {self.bytes_per_s / 1e9:.4g} GB/s, "
                f"ridge at {self.ridge:.3g} FLOP/byte ({self.source})")


@dataclass(frozen=True)
class GPUSpec:
    """Datasheet figures of one GPU. `fp16_tflops`: dense fp16/bf16 tensor-core peak (T4: fp16 only,
    it has no bf16); `fp32_tflops`: plain fp32 (no tensor cores, no TF32); `bandwidth_gbs`: memory
    bandwidth in GB/s (10^9 B/s); `memory_gib`: nominal capacity (a little less is usable)."""

    name: str
    fp16_tflops: float
    fp32_tflops: float
    bandwidth_gbs: float
    memory_gib: float

    def peak(self, dtype: str | torch.dtype = "fp16") -> Peak:
        """This GPU's roofline ceilings for matmuls in `dtype` ('fp16', 'bf16', 'fp32' or a torch dtype)."""
        key = _dtype_key(dtype)
        tflops = self.fp32_tflops if key == "fp32" else self.fp16_tflops
        return Peak(f"{self.name} {key}", tflops * 1e12, self.bandwidth_gbs * 1e9, "datasheet")


def _dtype_key(dtype: str | torch.dtype) -> str:
    table = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
             "fp32": "fp32", "float32": "fp32", "fp16": "fp16", "float16": "fp16", "bf16": "bf16", "bfloat16": "bf16"}
    if dtype not in table:
        raise ValueError(f"dtype must be 'fp16', 'bf16', 'fp32' or the matching torch dtype, got {dtype!r}")
    return table[dtype]


GPUS: dict[str, GPUSpec] = {g.name: g for g in (
    #        name             fp16/bf16 dense  fp32    GB/s    GiB
    GPUSpec("T4",                65.0,          8.1,    320,    16),
    GPUSpec("L4",               121.0,         30.3,    300,    24),
    GPUSpec("A10G",              70.0,         31.2,    600,    24),
    GPUSpec("A100-40GB SXM",    312.0,         19.5,   1555,    40),
    GPUSpec("A100-80GB SXM",    312.0,         19.5,   2039,    80),
    GPUSpec("A100-80GB PCIe",   312.0,         19.5,   1935,    80),
    GPUSpec("H100 SXM",         989.4,         67.0,   3350,    80),
    GPUSpec("H100 PCIe",        756.0,         51.0,   2000,    80),
    GPUSpec("H200",             989.4,         67.0,   4800,   141),
    GPUSpec("RTX 4090",         165.2,         82.6,   1008,    24),
)}


def lookup_gpu(device_name: str) -> GPUSpec | None:
    """The table entry for a name as `torch.cuda.get_device_name()` reports it, or None if unknown.

    'NVIDIA A100-SXM4-80GB' -> A100-80GB SXM, 'NVIDIA H100 80GB HBM3' -> H100 SXM, 'Tesla T4' -> T4.
    Variants with other figures (H100 NVL, A100 40GB PCIe, L40S, ...) give None: measure them.
    """
    if not isinstance(device_name, str):
        raise TypeError(f"device_name must be a str such as 'NVIDIA A100-SXM4-80GB', got {type(device_name).__name__}")
    n = re.sub(r"[\s_\-]+", " ", device_name.lower())
    words = set(n.split())
    if "nvl" in words or "gh200" in n:           # other figures than the cards below (GH200: 4-4.9 TB/s)
        return None
    if "h200" in n:
        return GPUS["H200"]
    if "h100" in n:
        return GPUS["H100 PCIe"] if "pcie" in n else GPUS["H100 SXM"]
    if "a100" in n:
        if "80gb" in n:
            return GPUS["A100-80GB PCIe"] if "pcie" in n else GPUS["A100-80GB SXM"]
        if "pcie" not in n:
            return GPUS["A100-40GB SXM"]
        return None
    if "a10g" in words:
        return GPUS["A10G"]
    if "4090" in n and "rtx" in words and "laptop" not in words:
        return GPUS["RTX 4090"]
    if "t4" in words:
        return GPUS["T4"]
    if "l4" in words:
        return GPUS["L4"]
    return None


def _measure(device: str, quick: bool, dtype: torch.dtype = torch.float32) -> tuple[float, float]:
    """(FLOP/s of a `dtype` matmul, B/s of a large copy) measured on `device`."""
    gpu = device.startswith("cuda")
    # Matmul: 2 n^3 FLOPs. Big enough to keep every core busy, small enough for a few seconds.
    n = (4096 if quick else 8192) if gpu else (1024 if quick else 2048)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.empty(n, n, device=device, dtype=dtype)
    t_mm = benchmark(lambda: torch.mm(a, b, out=c), warmup=2, repeats=3 if quick else 7, device=device)
    flops = 2 * n**3 / t_mm.median
    del a, b, c
    # Copy: read the source once, write the destination once. 256 MiB each, far bigger than any
    # cache. Fill both first: untouched pages from torch.empty are not in memory yet (reading them
    # returns a shared page of zeros), which would flatter the bandwidth enormously.
    numel = (256 if quick else 512) * 2**20 // 4 if not gpu else 1024 * 2**20 // 4
    src = torch.ones(numel, device=device)
    dst = torch.zeros(numel, device=device)
    t_copy = benchmark(lambda: dst.copy_(src), warmup=2, repeats=3 if quick else 7, device=device)
    bandwidth = 2 * src.nbytes / t_copy.median
    return flops, bandwidth


def measure_cpu_peak(quick: bool = False) -> Peak:
    """Measure what this CPU achieves: fp32 matmul FLOP/s and copy bandwidth (read + write bytes / s).

    Medians of several runs after a warm-up. `quick` uses a smaller matmul and fewer runs (about a
    second on 2 cores). These are achievable figures, not the vendor's theoretical peak.
    """
    if not isinstance(quick, bool):
        raise TypeError(f"quick must be True or False, got {quick!r}")
    flops, bandwidth = _measure("cpu", quick)
    name = f"this CPU ({platform.machine()}, {torch.get_num_threads()} threads) fp32"
    return Peak(name, flops, bandwidth, "measured")


def device_peak(env, dtype: str | torch.dtype = torch.float32) -> Peak:
    """The roofline ceilings of the device `env` (from `course.setup()`) runs on, for `dtype` matmuls.

    A GPU found in `GPUS`: its datasheet figures. Any other GPU: measured here in `dtype` (a few
    seconds; quicker in quick mode). A CPU: measured, fp32 only (the labs run fp32 on a CPU). Pass
    the dtype the model runs in (`env.dtype`): a GPU's bf16 tensor-core peak is 2-16x its fp32
    one (about 15x on an A100 or H100).
    """
    if not (hasattr(env, "device") and hasattr(env, "quick")):
        raise TypeError(f"env must be the Environment returned by course.setup(), got {type(env).__name__}")
    key = _dtype_key(dtype)
    if str(env.device).startswith("cuda"):
        name = torch.cuda.get_device_name(torch.device(env.device))
        spec = lookup_gpu(name)
        if spec is not None:
            return spec.peak(key)
        torch_dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[key]
        flops, bandwidth = _measure(str(env.device), bool(env.quick), torch_dtype)
        return Peak(f"{name} {key}", flops, bandwidth, "measured")
    if key != "fp32":
        raise ValueError(f"on a CPU only the fp32 peak is measured, got dtype={dtype!r}")
    return measure_cpu_peak(bool(env.quick))


def _check_points(points) -> dict:
    if points is None:
        return {}
    if not isinstance(points, dict):
        raise TypeError(f"points must be a dict {{name: (intensity, achieved FLOP/s or None)}}, got {type(points).__name__}")
    for name, value in points.items():
        if not isinstance(value, (tuple, list)) or len(value) != 2:
            raise ValueError(f"points[{name!r}] must be a pair (intensity, achieved FLOP/s or None), got {value!r}")
        intensity, achieved = value
        if isinstance(intensity, bool) or not isinstance(intensity, (int, float)) or not math.isfinite(intensity) \
                or intensity <= 0:
            raise ValueError(f"points[{name!r}]: intensity must be a positive number (FLOP/byte), got {intensity!r}")
        if achieved is not None and (isinstance(achieved, bool) or not isinstance(achieved, (int, float))
                                     or not math.isfinite(achieved) or achieved <= 0):
            raise ValueError(f"points[{name!r}]: achieved must be a positive FLOP/s or None, got {achieved!r}")
    return points


def _eng(flops: float) -> str:
    """1.2e11 -> '120 GFLOP/s'."""
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if flops >= scale:
            return f"{flops / scale:.3g} {prefix}FLOP/s"
    return f"{flops:.3g} FLOP/s"


def plot_roofline(peak: Peak, points: dict | None = None, ax=None, *, color: str | None = None,
                  label: str | None = None):
    """Draw `peak`'s roofline (log-log) with its ridge point, and label `points` on it. Returns the Axes.

    `points`: {name: (intensity FLOP/byte, achieved FLOP/s or None)}. A measured point is a filled
    dot at its achieved FLOP/s, labelled with its share of the roof; None puts a hollow dot ON the
    roof: the best that intensity allows. Call again with the same `ax` to overlay another device.
    """
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import EngFormatter

    if not isinstance(peak, Peak):
        raise TypeError(f"peak must be a course.hardware.Peak (from device_peak, measure_cpu_peak or "
                        f"GPUS[name].peak()), got {type(peak).__name__}")
    points = _check_points(points)
    first = ax is None or not ax.lines
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.5), layout="constrained")
    n_roofs = len([ln for ln in ax.lines if ln.get_gid() == "roof"])
    color = color or f"C{n_roofs}"

    intensities = [v[0] for v in points.values()] + [peak.ridge]
    lo, hi = min(intensities) / 10, max(intensities) * 10
    if not first:  # keep what earlier roofs drew in view
        old_lo, old_hi = ax.get_xlim()
        lo, hi = min(lo, old_lo), max(hi, old_hi)
    x = np.logspace(math.log10(lo), math.log10(hi), 256)
    roof = np.minimum(peak.flops, peak.bytes_per_s * x)
    line, = ax.plot(x, roof, color=color, lw=2, label=label or f"{peak.name} ({peak.source})")
    line.set_gid("roof")
    ax.plot([peak.ridge], [peak.flops], "D", color=color, ms=6)
    ax.annotate(f"ridge {peak.ridge:.3g} FLOP/B", (peak.ridge, peak.flops), textcoords="offset points",
                xytext=(6, 6) if n_roofs % 2 == 0 else (6, -12), fontsize=8, color=color)

    compact = len(points) > 4   # many labels: shorter ones, and the legend says what the % means
    if compact and any(v[1] is not None for v in points.values()):
        ax.text(0.02, 0.97, "% = achieved / roof at that intensity", transform=ax.transAxes, fontsize=8,
                va="top", color=color)
    previous_x, shifted = None, False
    for name, (intensity, achieved) in sorted(points.items(), key=lambda item: item[1][0]):
        bound = peak.attainable(intensity)
        # neighbours closer than half a decade: drop every other label one line pair lower
        shifted = previous_x is not None and intensity / previous_x < 10**0.5 and not shifted
        previous_x = intensity
        if achieved is None:
            ax.plot([intensity], [bound], "o", mfc="white", mec=color, mew=2, ms=8)
            text = f"{name}\n(at most {_eng(bound)})"
            y = bound
        else:
            ax.plot([intensity], [achieved], "o", color=color, ms=8)
            ax.plot([intensity, intensity], [achieved, bound], ":", color=color, lw=1)
            text = f"{name}\n{achieved / bound:.0%}" + ("" if compact else " of roof")
            y = achieved
        ax.annotate(text, (intensity, y), textcoords="offset points", xytext=(9, -27 if shifted else -3), va="top",
                    fontsize=8, color=color)

    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_autoscaley_on(True)  # refit y to every roof and point drawn so far, with room for labels
    ax.relim()
    ax.autoscale_view(scalex=False)
    y_lo, y_hi = ax.get_ylim()
    ax.set_ylim(y_lo / 1.5, y_hi * 2.5)
    ax.yaxis.set_major_formatter(EngFormatter(unit="FLOP/s"))
    ax.set_xlabel("arithmetic intensity (FLOP per byte moved)")
    ax.set_ylabel("attainable FLOP/s")
    if first:
        ax.grid(True, which="major", alpha=0.3)
        ax.set_title("Roofline: left of the ridge memory-bound, right of it compute-bound", fontsize=10)
    ax.legend(loc="lower right", fontsize=8)
    return ax
