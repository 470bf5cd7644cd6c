"""Helpers for the Triton labs that grade nothing: compiling kernels for GPU targets without a GPU
(and reading what the compiler made of them), and running a `triton.testing.perf_report` benchmark
on machines without pandas."""
from course.kernels.compile_check import compile_for_gpu, compile_many, compile_report, kernel_source
from course.kernels.report import run_perf_report

__all__ = ["compile_for_gpu", "compile_many", "compile_report", "kernel_source", "run_perf_report"]
