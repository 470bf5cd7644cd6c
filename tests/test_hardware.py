"""course.hardware: the GPU table, name matching, the CPU measurement, the roofline plot."""
import time
from types import SimpleNamespace

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from course.hardware import GPUS, GPUSpec, Peak, device_peak, lookup_gpu, measure_cpu_peak, plot_roofline  # noqa: E402


def test_gpu_table_is_sane():
    assert {"T4", "L4", "A10G", "A100-40GB SXM", "A100-80GB SXM", "H100 SXM", "H200", "RTX 4090"} <= set(GPUS)
    for name, g in GPUS.items():
        assert isinstance(g, GPUSpec) and g.name == name
        assert 1 < g.fp32_tflops < g.fp16_tflops < 1000, f"{name}: tensor fp16 beats plain fp32, dense < 1 PFLOP/s"
        assert 200 < g.bandwidth_gbs < 5000 and 15 <= g.memory_gib <= 141, name
        ridge = g.peak("fp16").ridge
        assert 50 < ridge < 450, f"{name}: fp16 ridge {ridge:.0f} FLOP/byte is implausible"
    # dense, not the 2:4-sparsity headline figures
    assert GPUS["H100 SXM"].fp16_tflops == pytest.approx(989.4)
    assert GPUS["A100-80GB SXM"].fp16_tflops == 312 and GPUS["A100-80GB SXM"].bandwidth_gbs == 2039
    assert GPUS["H200"].bandwidth_gbs > GPUS["H100 SXM"].bandwidth_gbs


def test_gpu_peak_units_and_dtypes():
    h100 = GPUS["H100 SXM"]
    assert h100.peak("fp16").flops == pytest.approx(989.4e12)
    assert h100.peak(torch.bfloat16).flops == h100.peak("fp16").flops
    assert h100.peak(torch.float32).flops == pytest.approx(67e12)
    assert h100.peak().bytes_per_s == pytest.approx(3.35e12)
    assert h100.peak().source == "datasheet"
    assert h100.peak().attainable(1.0) == pytest.approx(3.35e12)
    assert h100.peak().attainable(1e4) == pytest.approx(989.4e12)
    with pytest.raises(ValueError, match="dtype"):
        h100.peak("int8")


@pytest.mark.parametrize("device_name, expected", [
    ("NVIDIA A100-SXM4-80GB", "A100-80GB SXM"), ("NVIDIA A100-SXM4-40GB", "A100-40GB SXM"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB PCIe"), ("NVIDIA H100 80GB HBM3", "H100 SXM"),
    ("NVIDIA H100 PCIe", "H100 PCIe"), ("NVIDIA H200", "H200"), ("Tesla T4", "T4"), ("NVIDIA L4", "L4"),
    ("NVIDIA A10G", "A10G"), ("NVIDIA GeForce RTX 4090", "RTX 4090"),
    ("NVIDIA H100 NVL", None), ("NVIDIA GH200 480GB", None), ("NVIDIA L40S", None), ("NVIDIA A10", None), ("NVIDIA A100-PCIE-40GB", None),
    ("NVIDIA GeForce RTX 4090 Laptop GPU", None), ("AMD Instinct MI300X", None),
])
def test_lookup_gpu(device_name, expected):
    found = lookup_gpu(device_name)
    assert (found.name if found else None) == expected


def test_bad_input_errors():
    with pytest.raises(ValueError, match="flops"):
        Peak("x", 0, 1e9, "measured")
    with pytest.raises(ValueError, match="bytes_per_s"):
        Peak("x", 1e9, float("nan"), "measured")
    with pytest.raises(ValueError, match="source"):
        Peak("x", 1e9, 1e9, "guessed")
    with pytest.raises(ValueError, match="intensity"):
        Peak("x", 1e9, 1e9, "measured").attainable(0)
    with pytest.raises(TypeError):
        lookup_gpu(None)
    with pytest.raises(TypeError, match="quick"):
        measure_cpu_peak("yes")
    with pytest.raises(TypeError, match="Environment"):
        device_peak("cpu")
    with pytest.raises(ValueError, match="fp32"):
        device_peak(SimpleNamespace(device="cpu", quick=True), dtype="fp16")


def test_measure_cpu_peak_quick_is_fast_and_positive():
    start = time.perf_counter()
    peak = measure_cpu_peak(quick=True)
    seconds = time.perf_counter() - start
    assert seconds < 10, f"quick measurement took {seconds:.1f} s"
    assert isinstance(peak, Peak) and peak.source == "measured"
    assert 1e8 < peak.flops < 1e14, peak      # between a slow laptop core and far beyond any CPU
    assert 1e8 < peak.bytes_per_s < 1e13, peak
    assert peak.ridge == pytest.approx(peak.flops / peak.bytes_per_s)


def test_device_peak_on_cpu_is_measured():
    peak = device_peak(SimpleNamespace(device="cpu", quick=True))
    assert peak.source == "measured" and "CPU" in peak.name


def test_plot_roofline_returns_axes_and_overlays():
    peak = Peak("toy", 1e12, 1e11, "measured")     # ridge at 10 FLOP/byte
    ax = plot_roofline(peak, {"decode": (0.5, 2e10), "prefill": (100.0, None)})
    assert isinstance(ax, plt.Axes)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    texts = " ".join(t.get_text() for t in ax.texts)
    assert "decode" in texts and "prefill" in texts and "ridge 10" in texts
    assert "40% of roof" in texts            # 2e10 achieved of 0.5 * 1e11 allowed
    ax2 = plot_roofline(GPUS["H100 SXM"].peak(), None, ax=ax)
    assert ax2 is ax and len(ax.get_legend().get_texts()) == 2
    assert ax.get_ylim()[1] > 989.4e12       # the taller roof stays in view
    plt.close("all")


@pytest.mark.parametrize("points, error", [
    ({"a": (0, None)}, ValueError), ({"a": (-1.0, 1e9)}, ValueError), ({"a": (1.0, 0)}, ValueError),
    ({"a": 3.0}, ValueError), ({"a": (1.0, 2.0, 3.0)}, ValueError), ([(1.0, None)], TypeError),
])
def test_plot_roofline_bad_points(points, error):
    with pytest.raises(error):
        plot_roofline(Peak("toy", 1e12, 1e11, "measured"), points)
    plt.close("all")


def test_plot_roofline_bad_peak():
    with pytest.raises(TypeError, match="Peak"):
        plot_roofline((1e12, 1e11), {})
