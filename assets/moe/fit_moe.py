"""Make lab 14's mixture of experts out of the course model: the split of every MLP into experts and
a fitted router per layer, saved to course/data/moe_experts.safetensors (read by course.moe.load_moe).

    .venv/bin/python assets/moe/fit_moe.py              # remake the file (2.5 minutes on 2 cores)
    .venv/bin/python assets/moe/fit_moe.py --measure    # and print perplexity, load and experts touched

Steps, deterministic (seeded; no sampling anywhere):
1. The dense model runs over the calibration text (course/data/calibration.txt, 3,588 tokens, not
   the held-out text); every MLP's input is kept (course.moe.router.mlp_inputs).
2. Each layer's 1,536 neurons are grouped into E = 8 experts of 192 by balanced k-means on their
   activations |silu(g) * u| over those tokens (co-activation; seed = the layer's index).
3. Each layer's router (a linear layer with bias) is fit by ridge least squares to predict each
   expert's activation mass on the same tokens.
The file holds only the grouping (int32) and the routers (float32): the experts' weights are the
dense model's, cut at load time. The grouping is stored, not recomputed, because k-means on another
machine (other float summation orders) could group a few neurons differently, and the routers fit
this grouping only.
"""
from __future__ import annotations

import argparse
import hashlib
import time
from pathlib import Path

import torch

import course
from course.moe import (activation_features, balanced_kmeans, calibration_ids, fit_routers, group_neurons,
                        mlp_inputs, moefy, save_moe)
from course.moe.router import CALIBRATION

OUT = Path(__file__).resolve().parents[2] / "course" / "data" / "moe_experts.safetensors"   # ships in the package
N_EXPERTS, RIDGE = 8, 1e-3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=N_EXPERTS)
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--measure", action="store_true", help="print perplexity vs k and routing statistics after")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model, tok = course.load_model(), course.load_tokenizer()
    calib = calibration_ids(tok)
    with torch.no_grad():
        xs = mlp_inputs(model, calib)
        neurons = [group_neurons(balanced_kmeans(activation_features(b.mlp, x), args.experts, seed=i), args.experts)
                   for i, (b, x) in enumerate(zip(model.blocks, xs))]
    t1 = time.perf_counter()
    moefy(model, args.experts, neurons)
    recalls = fit_routers(model, calib, ridge=RIDGE)
    t2 = time.perf_counter()
    meta = {"model": course.DEFAULT_MODEL, "n_experts": str(args.experts), "grouping": "balanced k-means on |silu(g)*u|",
            "router": f"ridge least squares on expert activation mass, ridge {RIDGE}",
            "calibration_sha256": hashlib.sha256(CALIBRATION.read_bytes()).hexdigest(),
            "calibration_tokens": str(len(calib)), "top2_recall_mean": f"{sum(recalls) / len(recalls):.3f}"}
    save_moe(model, args.out, meta)
    print(f"grouping {t1 - t0:.0f} s, routers {t2 - t1:.0f} s; top-2 recall on the calibration text: "
          f"mean {sum(recalls) / len(recalls):.3f}, min {min(recalls):.3f}; wrote {args.out} "
          f"({args.out.stat().st_size / 1e3:.0f} kB)")
    if args.measure:
        measure(model, tok, args.experts)


def measure(model, tok, E: int) -> None:
    """The numbers lab 14 shows, on the first 2,048 tokens of the held-out text."""
    from course.moe import (experts_touched, load_report, perplexity_vs_capacity, perplexity_vs_k, record_routing,
                            set_top_k, touched_uniform)
    from course.quant import heldout_ids

    ids = heldout_ids(tok)[:2048]
    ks = [k for k in (1, 2, 4, 8, 16) if k <= E]
    t = time.perf_counter()
    print("perplexity vs k (all layers sparse):", _fmt(perplexity_vs_k(model, ids, ks)))
    print("perplexity vs k (layer 0 dense):    ", _fmt(perplexity_vs_k(model, ids, ks, dense_layers=(0,))))
    print("perplexity vs k, softmax weights:   ", _fmt(perplexity_vs_k(model, ids, [2, 4], weighting="softmax")))
    print("capacity factor at k=2 (layer 0 dense): {factor: (perplexity, share dropped)}",
          {f: (round(p, 1), round(d, 4)) for f, (p, d) in
           perplexity_vs_capacity(model, ids, 2, (None, 2.0, 1.25, 1.0), dense_layers=(0,)).items()})
    set_top_k(model, 2)
    routes = record_routing(model, ids)
    rep = load_report(routes, E, world_size=2)
    print(f"k=2 load: expert imbalance (max/mean) mean {rep['mean_imbalance']:.2f} max {rep['max_imbalance']:.2f}; "
          f"rank imbalance (W=2) mean {rep['mean_rank_imbalance']:.2f}")
    touched = experts_touched(routes, [1, 2, 4, 8, 16, 32, 64], E)
    print("share of experts touched vs decode batch (k=2):",
          {B: (round(v, 3), round(touched_uniform(B, 2, E), 3)) for B, v in touched.items()}, "(measured, uniform)")
    set_top_k(model, E)
    print(f"measured in {time.perf_counter() - t:.0f} s")


def _fmt(table: dict) -> dict:
    return {k: round(v, 1) for k, v in table.items()}


if __name__ == "__main__":
    main()
