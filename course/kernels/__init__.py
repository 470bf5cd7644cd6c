"""Helpers for the Triton labs that grade nothing: compiling kernels for GPU targets without a GPU
(and reading what the compiler made of them), running a `triton.testing.perf_report` benchmark
on machines without pandas, and timing a kernel's GPU work without its Python launch or a warm L2."""
from course.kernels.compile_check import (compile_error_summary, compile_for_gpu, compile_many, compile_report,
                                          kernel_source, start_compile_report)
from course.kernels.report import run_perf_report
from course.kernels.timing import bench_replayed, copies_to_outrun_l2

__all__ = ["compile_error_summary", "compile_for_gpu", "compile_many", "compile_report", "kernel_source",
           "start_compile_report", "run_perf_report", "bench_replayed", "copies_to_outrun_l2"]
