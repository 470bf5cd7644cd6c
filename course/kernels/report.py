"""Run a `triton.testing.perf_report` benchmark, with or without pandas.

Triton's benchmark decorator sweeps the x values of each `triton.testing.Benchmark`, calls the
decorated function once per (x, line), and plots one line per provider; its `run` method needs
pandas for the table behind the plot. `run_perf_report` calls `run` where pandas is installed and
otherwise does the same sweep itself (a printed table and a matplotlib plot), so a lab's benchmark
cell works on any machine that has a GPU:

    @triton.testing.perf_report([triton.testing.Benchmark(x_names=["ctx"], x_vals=[1024, 4096], line_arg="provider",
                                                          line_vals=["mine", "torch"], line_names=["mine", "torch"],
                                                          ylabel="GB/s", plot_name="decode", args={"batch": 8})])
    def bench(ctx, batch, provider): ...        # returns y, or (y, y_min, y_max)
    rows = run_perf_report(bench)               # [[{"ctx": 1024, "mine": 512.0, "torch": 480.0}, ...], ...]
"""
from __future__ import annotations

import importlib.util


def _triple(value) -> tuple[float, float | None, float | None]:
    if isinstance(value, (tuple, list)):
        if len(value) != 3:
            raise ValueError(f"a perf_report function returns y or (y, y_min, y_max), got {value!r}")
        return float(value[0]), float(value[1]), float(value[2])
    return float(value), None, None


def _sweep(mark, bench, show_plots: bool, print_data: bool) -> list[dict]:
    """What Mark.run does for one Benchmark, without pandas."""
    import matplotlib.pyplot as plt

    rows, spans = [], []
    for x in bench.x_vals:
        xs = list(x) if isinstance(x, (list, tuple)) else [x] * len(bench.x_names)
        row, span = dict(zip(bench.x_names, xs)), {}
        for value, name in zip(bench.line_vals, bench.line_names):
            y, lo, hi = _triple(mark.fn(**dict(zip(bench.x_names, xs)), **{bench.line_arg: value}, **bench.args))
            row[name], span[name] = y, (lo, hi)
        rows.append(row)
        spans.append(span)
    first = bench.x_names[0]
    if bench.plot_name and show_plots:
        _, ax = plt.subplots(figsize=(7, 4), layout="constrained")
        for i, name in enumerate(bench.line_names):
            color, style = bench.styles[i] if bench.styles else (None, None)
            xs = [r[first] for r in rows]
            ax.plot(xs, [r[name] for r in rows], label=f"{name} ({bench.ylabel})", color=color, ls=style)
            if all(s[name][0] is not None for s in spans):
                ax.fill_between(xs, [s[name][0] for s in spans], [s[name][1] for s in spans], alpha=0.15, color=color)
        ax.set_xlabel(bench.xlabel or first)
        ax.set_ylabel(bench.ylabel)
        ax.set_xscale("log" if bench.x_log else "linear")
        ax.set_yscale("log" if bench.y_log else "linear")
        ax.set_title(bench.plot_name, fontsize=10)
        ax.legend(fontsize=8)
        plt.show()
    if print_data:
        print(bench.plot_name + ":")
        print("  ".join(f"{c:>14}" for c in [*bench.x_names, *bench.line_names]))
        for r in rows:
            print("  ".join(f"{r[c]:>14.4g}" if isinstance(r[c], float) else f"{r[c]!s:>14}"
                            for c in [*bench.x_names, *bench.line_names]))
    return rows


def run_perf_report(mark, show_plots: bool = True, print_data: bool = True) -> list[list[dict]]:
    """Run `mark` (what `@triton.testing.perf_report` returns): plots and tables as Triton's `run`
    makes them. Returns, per Benchmark, its rows: {x name: x, line name: y}."""
    benchmarks = getattr(mark, "benchmarks", None)
    if benchmarks is None or not callable(getattr(mark, "fn", None)):
        raise TypeError(f"mark must be what @triton.testing.perf_report(...) returns, got {type(mark).__name__}")
    benchmarks = benchmarks if isinstance(benchmarks, (list, tuple)) else [benchmarks]
    if importlib.util.find_spec("pandas") is None:
        return [_sweep(mark, bench, show_plots, print_data) for bench in benchmarks]
    frames = mark.run(show_plots=show_plots, print_data=print_data, return_df=True)
    frames = frames if isinstance(frames, list) else [frames]
    out = []
    for bench, df in zip(benchmarks, frames):
        rename = {f"{name} ({bench.ylabel})": name for name in bench.line_names}
        out.append([{rename.get(k, k): v for k, v in row.items()} for row in df.to_dict("records")])
    return out
