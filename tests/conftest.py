"""Session-wide settings, read before any test module imports anything.

TRITON_INTERPRET=1 from the start, as `course.setup()` does in a lab on a CPU: Triton reads it
when it is first imported (its own library functions, `tl.zeros` among them, are @triton.jit
too), and loading a transformers model imports Triton. Set later, a test's kernels would be
interpreted but `tl.zeros` not ("Cannot call @triton.jit'd outside of the scope of a kernel").
The GPU compile check runs in a subprocess without it (course.kernels.compile_check).
"""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
