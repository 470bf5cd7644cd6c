"""What a GPU printed, kept for readers without one.

On a CPU, the cells that do something only a GPU can (CUDA graphs, `do_bench`, programmatic dependent
launch, the engine on compiled kernels) print "skipped: no GPU here", so a student on a laptop would
learn nothing about speed from the labs that are about speed. The GPU proof keeps its executed
notebooks (`gpu_check --keep DIR`); this module takes from them the outputs of those cells and the
lab builders put them back into every notebook, as a markdown cell right after the cell that printed
them, labelled with the device, dtype, mode, versions and commit. The source notebook, the student
release (outputs are stripped there; a markdown cell is not an output) and the site all carry it.

    python -m autograder.gpu_record DIR/06_triton_kernels.full.ipynb DIR/02_prefill_decode.quick.ipynb ...
    python -m autograder.lab_builders.lab06          # then rebuild the labs whose record changed

A GPU-only cell is a code cell that is not graded and whose source reads `env.gpu` (it branches on the
GPU). Its record is keyed by the cell's id, which is a hash of its source: when a builder changes the
cell, the old record no longer matches and is left out (what the old code printed proves nothing
about the new), until a GPU run records it again. Only outputs are kept (stdout, plain text, PNG
figures): no code, nothing a graded cell printed.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import nbformat

from autograder import LABS, REPO, lab_notebook

RECORDS = REPO / "assets" / "gpu"
MAX_LINES = 40            # a longer printout keeps its first lines and says how many it left out
RUN_KEY = "course_gpu_run"   # notebook metadata gpu_check writes into the notebooks it keeps


def is_gpu_only(cell) -> bool:
    """An ungraded code cell that branches on the GPU."""
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return cell.cell_type == "code" and "env.gpu" in cell.source and not (meta.get("grade") or meta.get("solution"))


def commit_label(repo: Path = REPO) -> str:
    """The commit the working tree is at, '+changes' when it differs from it; 'unknown' without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+changes" if dirty else "")


def _kept(outputs: list) -> list[dict]:
    """The outputs worth showing: stdout, and for results a PNG figure or else the plain text. Widgets
    (they need a live kernel), stderr (warnings) and HTML (the same table as the plain text) stay out."""
    kept = []
    for o in outputs:
        kind = o.get("output_type")
        if kind == "stream" and o.get("name") == "stdout":
            text = o.get("text", "")
            if kept and kept[-1]["kind"] == "text":
                kept[-1]["text"] += text
            else:
                kept.append({"kind": "text", "text": text})
        elif kind in ("execute_result", "display_data"):
            data = o.get("data", {})
            if "image/png" in data:
                kept.append({"kind": "png", "data": data["image/png"].replace("\n", "")})
            elif "text/plain" in data and not any(k.startswith("application/vnd.jupyter.widget") for k in data):
                kept.append({"kind": "text", "text": data["text/plain"] + "\n"})
    return [k for k in kept if k["kind"] != "text" or k["text"].strip()]


def _current_ids(lab: str, labs_dir: Path = LABS) -> set[str] | None:
    """The cell ids of the lab's notebook as it is now; None for a lab that is not in `labs_dir`."""
    try:
        return {c.id for c in nbformat.read(lab_notebook(lab, labs_dir), as_version=4).cells}
    except FileNotFoundError:
        return None


def capture(notebooks: list[Path], run: dict | None = None, records: Path = RECORDS,
            labs_dir: Path = LABS) -> dict[str, Path]:
    """Write each lab's record from executed notebooks named `LAB.MODE.ipynb`, earlier notebooks first:
    a cell takes its outputs from the first notebook where it ran without an error and printed
    something. `run` describes the run where a notebook's metadata does not (device, dtype, ...). Cells
    the lab's notebook in `labs_dir` no longer has (changed since the run) are left out, and said.
    Returns {lab: record path}."""
    by_lab: dict[str, list[Path]] = {}
    for path in notebooks:
        by_lab.setdefault(Path(path).name.split(".")[0], []).append(Path(path))
    written = {}
    for lab, paths in by_lab.items():
        record = {"lab": lab, "runs": {}, "cells": {}}
        for path in paths:
            nb = nbformat.read(path, as_version=4)
            mode = path.name.split(".")[1] if path.name.count(".") >= 2 else "full"
            info = {"mode": mode, **(run or {}), **nb.metadata.get(RUN_KEY, {})}
            missing = [k for k in ("device", "dtype", "torch", "triton", "commit", "date") if not info.get(k)]
            if missing:
                raise ValueError(f"{path}: the run's {', '.join(missing)} unknown: pass them (see --help)")
            name = f"{path.name}"
            for cell in nb.cells:
                if not is_gpu_only(cell) or cell.id in record["cells"]:
                    continue
                if any(o.get("output_type") == "error" for o in cell.get("outputs", [])):
                    continue              # cut off or broken there: a later notebook may have it whole
                kept = _kept(cell.get("outputs", []))
                lines = sum(len(k["text"].strip().splitlines()) for k in kept if k["kind"] == "text")
                if any(k["kind"] == "png" for k in kept) or lines > 1:   # one line ("full mode only") teaches nothing
                    record["runs"][name] = info
                    record["cells"][cell.id] = {"run": name, "outputs": kept}
        current = _current_ids(lab, labs_dir)
        changed = [] if current is None else sorted(set(record["cells"]) - current)
        for cell_id in changed:           # the builder changed the cell since that run: what it printed is stale
            del record["cells"][cell_id]
        if changed:
            print(f"{lab}: left out {len(changed)} cells changed since the run: {', '.join(changed)}")
        record["runs"] = {k: v for k, v in record["runs"].items() if any(e["run"] == k for e in record["cells"].values())}
        if not record["cells"]:
            continue                      # nothing GPU-only ran here: an earlier record, if any, stays
        records.mkdir(parents=True, exist_ok=True)
        out = records / f"{lab}.json"
        out.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        written[lab] = out
    return written


def describe(info: dict) -> str:
    """'NVIDIA H200, bfloat16, full mode, alone on the GPU; torch 2.11.0, Triton 3.6.0; commit c498400, 2026-11-28'"""
    share = int(info.get("concurrent", 1))
    where = "alone on the GPU" if share <= 1 else f"beside {share - 1} other labs on the GPU: its times are upper bounds"
    return (f"{info['device']}, {info['dtype']}, {info['mode']} mode, {where}; torch {info['torch']}, "
            f"Triton {info['triton']}; commit {info['commit']}, {info['date']}")


def _text_block(text: str) -> str:
    lines = text.rstrip("\n").split("\n")
    if len(lines) > MAX_LINES:
        lines = lines[:MAX_LINES] + [f"... ({len(lines) - MAX_LINES} more lines)"]
    fence = "````" if "```" in text else "```"
    return f"{fence}text\n" + "\n".join(lines) + f"\n{fence}"


def record_cell(cell_id: str, entry: dict, info: dict) -> nbformat.NotebookNode:
    """The markdown cell that shows one recorded cell's outputs, its figures as attachments."""
    parts = [f"**Recorded on a GPU** ({describe(info)}). The cell above printed this there; on your "
             f"machine it prints what your own run measures:"]
    attachments = {}
    for o in entry["outputs"]:
        if o["kind"] == "text":
            parts.append(_text_block(o["text"]))
        else:
            name = f"gpu-{cell_id}-{len(attachments) + 1}.png"
            attachments[name] = {"image/png": o["data"]}
            parts.append(f"![figure {len(attachments)}, recorded on the GPU](attachment:{name})")
    cell = nbformat.v4.new_markdown_cell("\n\n".join(parts), metadata={"course": {"gpu_record": cell_id}})
    if attachments:
        cell.attachments = attachments
    return cell


def load(lab: str, records: Path = RECORDS) -> dict:
    path = records / f"{lab}.json"
    return json.loads(path.read_text()) if path.exists() else {"lab": lab, "runs": {}, "cells": {}}


def with_records(lab: str, cells: list, records: Path = RECORDS) -> tuple[list, list[str]]:
    """`cells` (ids assigned) with a record cell after each GPU-only cell the lab's record holds; and the
    record's cell ids that match no cell any more (stale: the cell changed since the GPU run)."""
    record = load(lab, records)
    out, used = [], set()
    for cell in cells:
        out.append(cell)
        entry = record["cells"].get(cell.get("id")) if is_gpu_only(cell) else None
        if entry:
            out.append(record_cell(cell.id, entry, record["runs"][entry["run"]]))
            used.add(cell.id)
    return out, sorted(set(record["cells"]) - used)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("notebooks", nargs="+", type=Path,
                        help="executed notebooks named LAB.MODE.ipynb (gpu_check --keep), preferred first")
    for key in ("device", "dtype", "torch", "triton", "commit", "date"):
        parser.add_argument(f"--{key}", help=f"the run's {key}, where the notebook's metadata lacks it")
    parser.add_argument("--concurrent", type=int, help="labs that shared the GPU in that run")
    args = parser.parse_args(argv)
    run = {k: v for k in ("device", "dtype", "torch", "triton", "commit", "date", "concurrent")
           if (v := getattr(args, k)) is not None}
    for lab, path in capture(args.notebooks, run).items():
        print(f"{lab}: {len(load(lab)['cells'])} cells recorded -> {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
