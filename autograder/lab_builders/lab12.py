"""Builds the lab 12 source notebook (distributed inference). Edit this file or its sections, then run
from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab12

Sections: lab12_tp.py (why split, ranks and messages, tensor parallelism, the ring: problems 1-3),
lab12_pp.py (pipeline parallelism: problem 4), lab12_disagg.py (disaggregation, the measurement,
torchrun, summary: problem 5).
"""
from autograder.authoring import code, locked, md, write_notebook  # noqa: E402
from autograder.lab_builders import lab12_disagg, lab12_pp, lab12_tp  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402

HEADER = [
md(r"""
# Lab 12: Distributed inference

Llama-3-70B holds 70 billion parameters: 141 GB in bf16, and one H100 has 80 GB. Before the first
token of KV cache, the model has to be split over several GPUs, and then the GPUs must talk, inside
every layer or between groups of layers. Serving adds a third split, in time rather than space:
a long prompt's prefill (compute-bound, for a model of that size) stalls every request that is decoding
next to it (memory-bound), unless prefill and decode run on different machines and the KV cache travels
from one to the other. In this lab you build all three with `torch.distributed`, on real processes
started from this notebook, and measure what each one costs and buys.

**You will**
- start ranks as processes, and measure what an all-reduce costs on this machine;
- split the course model the Megatron way (column- and row-parallel layers, whole attention heads per
  rank, GQA's KV heads with them), run it on 3 processes and get the single-process logits back;
- write a ring all-reduce and match the bytes it sends to 2(W - 1)/W of the buffer;
- run the model as a pipeline of stages over micro-batches, draw your timeline, and measure the bubble
  against (p - 1)/(m + p - 1);
- ship a request's KV blocks from a prefill process to a decode process, and measure decode latency while
  long prompts arrive, colocated against disaggregated.

**Time:** about 4 hours 10 minutes: 1 hour of reading, 2.5 hours for the five problems, 25 minutes for
the written questions at the end, and about a minute of running on a laptop CPU (66 s measured on 2
cores).

**Hardware:** everything runs on a laptop CPU. The ranks are processes of this machine, one CPU thread
each, talking through gloo over 127.0.0.1; they run on the CPU, in float32, on a GPU machine too (the
tests use the GPU when there is one). Section 8 runs the same functions on several GPUs with
`torchrun` and NCCL. Two or more cores make the timings meaningful: with fewer cores than ranks, the
ranks take turns.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
code(r'''
import math
import os
import statistics
import subprocess
import sys
import time

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F

from course.dist import CustomAllReduce, launch, run_threads
from course.dist.disagg import Engine, ServeRequest, colocated_worker, disaggregated_worker, merge_logs
from course.dist.pipeline import Stage
from course.dist.plots import plot_pipeline, plot_serving
from course.dist.torchrun_tp import answers_file, import_answers
from course.dist.tp import TPBlock, tp_forward, whole_block
from course.engine import BlockAllocator, PagedKVCache
from course.expect import expect_bool, expect_float, expect_int, expect_tensor, expect_tuple, expect_type
from course.models.decoder import apply_rope, rope_cos_sin
from course.timing import benchmark

DEFAULT = course.DEFAULT_MODEL
tokenizer = course.load_tokenizer()
cpu_model = course.load_model(device="cpu", dtype=torch.float32).eval()   # what the ranks run: CPU, float32
cfg = cpu_model.cfg
LAUNCH_S = env.pick(600, 120)          # seconds a launch may run before its ranks are stopped (a deadlock?)
print(f"{DEFAULT}: {cfg.n_layer} layers, {cfg.n_head} query heads, {cfg.n_kv_head} KV heads of {cfg.head_dim}, "
      f"d_model {cfg.d_model}, d_ff {cfg.d_ff}; {os.cpu_count()} CPU cores here")
'''),
]

cells = HEADER + lab12_tp.CELLS + lab12_pp.CELLS + lab12_disagg.CELLS + [md(CHECK_YOUR_WORK)]

if __name__ == "__main__":
    path = write_notebook("labs/12_distributed/12_distributed.ipynb", cells)
    print(f"wrote {path} ({len(cells)} cells)")
