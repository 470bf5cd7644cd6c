"""Lab 06's kernels and launchers as one importable module, taken from the lab's SOURCE notebook
(solutions included, markers removed): what tests/test_paged_kernels.py checks and compiles, and
what dev/split_kv.py times beside its other versions.

    mod = load_lab_module(gpu=False, directory=tmp)       # TRITON_INTERPRET=1 set first, on a CPU
    q, k_cache, v_cache, tables, lens = mod.paged_case([5, 300], H=9, Hkv=3, D=64, block_size=16)
    mod.paged_attention_split(q, k_cache, v_cache, tables, lens, scale)   # beside mod.paged_attention, the reference

`env` stands in for course.setup()'s: on a GPU the launchers autotune, in the interpreter they do not.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from autograder import SOLUTION_MARKERS, lab_notebook
from course.kernels.compile_check import HEADER

LAB = "06_triton_kernels"
# the lab's cells that the kernels and their launchers need, in notebook order
CELLS = ("store_kv_kernel", "kernel_launch", "paged_attention_v1", "paged_case", "paged_attention_v2",
         "paged_decode_split", "split_launch", "split_reduce", "split_merge_launch", "paged_prefill", "prefill_launch")


def lab_cells() -> dict[str, str]:
    """The lab's cells by nbgrader grade_id, as the instructor wrote them."""
    import nbformat

    nb = nbformat.read(lab_notebook(LAB), as_version=4)
    return {c.metadata.get("nbgrader", {}).get("grade_id"): c.source for c in nb.cells}


def lab_source(gpu: bool) -> str:
    """The kernels (solutions, markers removed) and the lab's launchers, as the text of one module."""
    cells = lab_cells()
    missing = [gid for gid in CELLS if gid not in cells]
    if missing:
        raise KeyError(f"lab {LAB} has no cells {missing}: update CELLS in {Path(__file__).name}")
    body = []
    for gid in CELLS:
        lines = [line for line in cells[gid].splitlines() if not any(m in line for m in SOLUTION_MARKERS)]
        body.append("\n".join(lines))
    env = f"env = types.SimpleNamespace(gpu={gpu}, device={'cuda' if gpu else 'cpu'!r})\ndev = env.device\n"
    imports = ("import types\nfrom collections import deque\n\nimport torch\nimport torch.nn.functional as F\n\n"
               "from course.engine import BlockAllocator, block_table_tensor, paged_attention, write_kv\n")
    return imports + HEADER + env + "\n\n" + "\n\n\n".join(body) + "\n"


def load_lab_module(gpu: bool, directory: Path):
    """Import lab_source(gpu) as a module (with TRITON_INTERPRET as the caller has set it). Triton
    reads a kernel's source from its file, so the module is written to `directory` first."""
    path = Path(directory) / f"lab06_kernels_{'gpu' if gpu else 'cpu'}.py"
    path.write_text(lab_source(gpu))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    return mod
