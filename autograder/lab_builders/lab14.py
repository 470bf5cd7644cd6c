"""Builds the lab 14 source notebook (mixture of experts). Edit this file or its sections, then run
from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab14

Sections: lab14_split.py (why MoE, MoEfication, the router, perplexity vs k: problems 1-2),
lab14_dispatch.py (dispatch and the grouped-GEMM Triton kernel: problems 3-4), lab14_ep.py (expert
parallelism, load, capacity, experts touched, the flow plot, summary: problems 5-6).
"""
from autograder.authoring import code, locked, md, write_notebook  # noqa: E402
from autograder.lab_builders import lab14_dispatch, lab14_ep, lab14_split  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK, COLAB_INSTALL, SETUP  # noqa: E402

HEADER = [
md(r"""
# Lab 14: Mixture of experts

Mixtral 8x7B holds 47 billion parameters but computes each token with 13 billion of them.
DeepSeek-V3 holds 671 billion and uses 37 billion per token. The trick is the **mixture of experts**
(MoE): the MLP of each layer is cut into many smaller MLPs, the **experts**, and a small **router**
sends every token to only k of them. A token pays the FLOPs of k experts, while the model keeps the
knowledge of all of them. The engine pays elsewhere. It must regroup the tokens by expert, run many
small matrix products at once, spread experts over GPUs and ship tokens to them, and live with a
router that loads some experts far more than others. In this lab you build every one of those
pieces on the course model, made sparse.

**You will**
- cut SmolLM2's MLPs into 8 experts each (MoEfication) and check that all 8 together are the dense MLP;
- write top-k routing with renormalized softmax weights, and measure what running only k of 8
  experts costs in perplexity (a lot, without training: you will see why real MoEs are trained as MoEs);
- write the dispatch: sort tokens by expert, counts and offsets, pad each group to the kernel's block
  size, and put the results back with their weights;
- write a grouped-GEMM Triton kernel that runs every expert's tokens in one launch;
- spread the experts over processes (expert parallelism) with an all-to-all there and one back, and
  count the bytes against a formula;
- measure what sets an MoE's speed: load per expert and per rank, what a capacity limit drops, and
  how many experts a decode batch wakes up.

**Time:** about 3 hours 45 minutes: 50 minutes of reading, 2.5 hours for the six problems (the
dispatch and the kernel take about 40 minutes each), 20 minutes for the written questions, and about
3.5 minutes of running on a laptop CPU (208 s measured on 2 busy cores): the real model is slow there
(a forward of 256 tokens takes seconds), so the demos score a 512-token slice of the held-out text.

**Hardware:** everything runs on a laptop CPU. The Triton kernel runs in Triton's interpreter on a
CPU (slow, so the tests use small shapes) and is compiled for A100 (sm_80) and H100 (sm_90) targets
without one; a GPU times it against a loop over experts and the dense MLP. The expert-parallel ranks
are processes of this machine talking through gloo, as in lab 12.
"""),
locked("colab_install", COLAB_INSTALL),
locked("setup", SETUP),
code(r'''
import math
import os
import time

import matplotlib.pyplot as plt
import torch
import torch.nn as nn
import torch.nn.functional as F
import triton
import triton.language as tl

from course.dist import launch, run_threads
from course.expect import expect_float, expect_int, expect_tensor, expect_tuple, expect_type, substituted
from course.moe import (align_block_size, bytes_formula, capacity, expert_mass, load_moe, max_padded, moe_layers,
                        perplexity_vs_capacity, perplexity_vs_k, record_routing, set_top_k, sort_by_expert, swiglu,
                        touched_uniform)
from course.quant import heldout_ids
from course.timing import benchmark

tokenizer = course.load_tokenizer()
model = course.load_model()                                  # dense, on env.device, in env.dtype
cfg = model.cfg
moe = load_moe(course.load_model())                          # a second copy, split into 8 experts per layer (section 2)
E = moe_layers(moe)[0].n_experts
HELDOUT = heldout_ids(tokenizer)
PPL_TOKENS = env.pick(2048, 48, cpu=512)                      # held-out tokens scored per setting (a forward each)
LAUNCH_S = env.pick(600, 120)                                 # seconds a launch may run before its ranks are stopped
print(f"{course.DEFAULT_MODEL}: {cfg.n_layer} layers, d_model {cfg.d_model}, d_ff {cfg.d_ff}; {E} experts of "
      f"{cfg.d_ff // E} neurons per layer; perplexity on {PPL_TOKENS} of the {len(HELDOUT)} held-out tokens")
'''),
]

cells = HEADER + lab14_split.CELLS + lab14_dispatch.CELLS + lab14_ep.CELLS + [md(CHECK_YOUR_WORK)]

if __name__ == "__main__":
    path = write_notebook("labs/14_mixture_of_experts/14_mixture_of_experts.ipynb", cells)
    print(f"wrote {path} ({len(cells)} cells)")
