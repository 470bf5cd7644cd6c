"""What a GPU printed reaches readers without one: autograder/gpu_record.py takes the outputs of a lab's
GPU-only cells from the GPU proof's kept notebooks, and the lab builders put them back, labelled, after
the cells that printed them (source notebook, student release and site alike)."""
import base64
import json
import re

import nbformat
import pytest

from autograder import authoring, gpu_record, lab_names, lab_notebook

RUN = {"device": "NVIDIA H100 80GB HBM3", "dtype": "bfloat16", "torch": "2.11.0+cu130", "triton": "3.6.0",
       "commit": "abc1234", "date": "2026-11-28"}
PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake").decode()


def _lab(tmp_path, name="00_tiny"):
    """A lab with a graded cell, a GPU-only demo, a one-line GPU cell and a CPU demo; its ids as written."""
    cells = [authoring.locked("setup", "import course\nenv = course.setup()"),
             authoring.tests("t", 1, "assert env.gpu or True"),                          # graded: never recorded
             authoring.code("if env.gpu:\n    bench()\nelse:\n    print('skipped: no GPU here')"),
             authoring.code("if env.gpu:\n    print('full mode only')"),
             authoring.code("print(2 + 2)")]
    path = authoring.write_notebook(tmp_path / "labs" / name / f"{name}.ipynb", cells)
    return path, nbformat.read(path, 4)


def _executed(nb, out_dir, mode, outputs_of_bench, one_line=("full mode only\n",), meta=None):
    nb = nbformat.from_dict(json.loads(json.dumps(nb)))
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="graded output\n")]
    nb.cells[2].outputs = outputs_of_bench
    nb.cells[3].outputs = [nbformat.v4.new_output("stream", name="stdout", text=t) for t in one_line]
    nb.cells[4].outputs = [nbformat.v4.new_output("stream", name="stdout", text="4\n")]
    if meta:
        nb.metadata[gpu_record.RUN_KEY] = meta
    path = out_dir / f"00_tiny.{mode}.ipynb"
    nbformat.write(nb, path)
    return path


def test_capture_keeps_the_outputs_of_gpu_only_cells_and_nothing_else(tmp_path):
    _, nb = _lab(tmp_path)
    bench = [nbformat.v4.new_output("stream", name="stdout", text="yours 13.5 us\n"),
             nbformat.v4.new_output("stream", name="stderr", text="UserWarning: ...\n"),
             nbformat.v4.new_output("stream", name="stdout", text="SDPA 16.8 us\n"),
             nbformat.v4.new_output("display_data", data={"image/png": PNG, "text/plain": "<Figure>"}),
             nbformat.v4.new_output("display_data", data={"application/vnd.jupyter.widget-view+json": {}, "text/plain": "HBox()"})]
    cut = [nbformat.v4.new_output("stream", name="stdout", text="yours 99 us\n"),
           nbformat.v4.new_output("error", ename="KeyboardInterrupt", evalue="", traceback=[])]
    full = _executed(nb, tmp_path, "full", cut, meta={**RUN, "mode": "full", "concurrent": 1})
    quick = _executed(nb, tmp_path, "quick", bench, meta={**RUN, "mode": "quick", "concurrent": 6})
    records = tmp_path / "records"
    gpu_record.capture([full, quick], records=records, labs_dir=tmp_path / "labs")
    record = json.loads((records / "00_tiny.json").read_text())
    assert list(record["cells"]) == [nb.cells[2].id], "only the GPU-only cell that printed more than a line"
    entry = record["cells"][nb.cells[2].id]
    assert entry["run"] == "00_tiny.quick.ipynb", "the full run was cut off in that cell (an error): the quick run's outputs"
    assert entry["outputs"] == [{"kind": "text", "text": "yours 13.5 us\nSDPA 16.8 us\n"}, {"kind": "png", "data": PNG}]
    assert list(record["runs"]) == ["00_tiny.quick.ipynb"] and record["runs"]["00_tiny.quick.ipynb"]["concurrent"] == 6


def test_capture_asks_for_the_run_facts_a_notebook_lacks_and_drops_changed_cells(tmp_path):
    path, nb = _lab(tmp_path)
    bench = [nbformat.v4.new_output("stream", name="stdout", text="a\nb\n")]
    bare = _executed(nb, tmp_path, "full", bench)
    with pytest.raises(ValueError, match="device, dtype, torch, triton, commit, date unknown"):
        gpu_record.capture([bare], records=tmp_path / "r", labs_dir=tmp_path / "labs")
    gpu_record.capture([bare], run=RUN, records=tmp_path / "r", labs_dir=tmp_path / "labs")
    assert json.loads((tmp_path / "r" / "00_tiny.json").read_text())["runs"]["00_tiny.full.ipynb"]["mode"] == "full"
    nb.cells[2].source += "\nprint('changed since')"                  # the builder changed the cell: a new id
    authoring.write_notebook(path, [nbformat.v4.new_code_cell(c.source, metadata=c.metadata) for c in nb.cells])
    (tmp_path / "r" / "00_tiny.json").unlink()
    gpu_record.capture([bare], run=RUN, records=tmp_path / "r", labs_dir=tmp_path / "labs")
    assert not (tmp_path / "r" / "00_tiny.json").exists(), "what the old cell printed proves nothing about the new one"


def test_a_record_comes_back_after_its_cell_labelled_and_only_while_the_cell_is_unchanged(tmp_path):
    _, nb = _lab(tmp_path)
    gpu_id = nb.cells[2].id
    long = "".join(f"line {i}\n" for i in range(gpu_record.MAX_LINES + 5))
    record = {"lab": "00_tiny", "runs": {"r": {**RUN, "mode": "full", "concurrent": 1}},
              "cells": {gpu_id: {"run": "r", "outputs": [{"kind": "text", "text": long}, {"kind": "png", "data": PNG}]},
                        "0123456789": {"run": "r", "outputs": [{"kind": "text", "text": "x\ny\n"}]}}}
    (tmp_path / "records").mkdir()
    (tmp_path / "records" / "00_tiny.json").write_text(json.dumps(record))
    cells, stale = gpu_record.with_records("00_tiny", nb.cells, tmp_path / "records")
    assert stale == ["0123456789"]
    assert len(cells) == len(nb.cells) + 1
    shown = cells[3]
    assert shown.cell_type == "markdown" and shown.metadata["course"]["gpu_record"] == gpu_id
    assert shown.source.startswith("**Recorded on a GPU** (NVIDIA H100 80GB HBM3, bfloat16, full mode, alone on the GPU; "
                                   "torch 2.11.0+cu130, Triton 3.6.0; commit abc1234, 2026-11-28)")
    assert f"line {gpu_record.MAX_LINES - 1}\n... (5 more lines)\n```" in shown.source, "a long printout is cut, and says so"
    name = f"gpu-{gpu_id}-1.png"
    assert f"(attachment:{name})" in shown.source and shown.attachments[name]["image/png"] == PNG
    nbformat.validate(nbformat.v4.new_notebook(cells=cells))
    quick = gpu_record.describe({**RUN, "mode": "quick", "concurrent": 6})
    assert "quick mode, beside 5 other labs on the GPU: its times are upper bounds" in quick


def _solution_lines(nb) -> set[str]:
    lines = set()
    for cell in nb.cells:
        if cell.metadata.get("nbgrader", {}).get("solution") and cell.cell_type == "code":
            region = re.findall(r"### BEGIN SOLUTION\n(.*?)### END SOLUTION", cell.source, re.S)
            lines |= {ln.strip() for r in region for ln in r.splitlines() if len(ln.strip()) > 20}
    return lines


@pytest.mark.parametrize("lab", lab_names())
def test_each_lab_shows_its_gpu_record_after_the_cells_that_printed_it(lab):
    """Committed records are current (every recorded cell still exists, GPU-only and unchanged), each
    shows right after its cell, and none quotes a line of a solution."""
    record = gpu_record.load(lab)
    nb = nbformat.read(lab_notebook(lab), 4)
    ids = [c.id for c in nb.cells]
    shown = [i for i, c in enumerate(nb.cells) if c.get("metadata", {}).get("course", {}).get("gpu_record")]
    assert sorted(nb.cells[i].metadata["course"]["gpu_record"] for i in shown) == sorted(record["cells"]), \
        f"{lab}: assets/gpu/{lab}.json and the notebook disagree: rebuild the lab, or capture again (see gpu_record.py)"
    for i in shown:
        cell_id = nb.cells[i].metadata["course"]["gpu_record"]
        assert ids.index(cell_id) == i - 1 and gpu_record.is_gpu_only(nb.cells[i - 1])
        assert "Recorded on a GPU" in nb.cells[i].source
        leaked = [ln for ln in _solution_lines(nb) if ln in nb.cells[i].source]
        assert not leaked, f"{lab}: a recorded output quotes solution code: {leaked[:2]}"


def test_labs_that_skip_gpu_work_on_a_cpu_show_what_a_gpu_measured():
    """The labs about speed whose GPU cells print 'skipped' or shrink on a CPU carry a record."""
    for lab in ("02_prefill_decode", "04_batching", "06_triton_kernels"):
        assert len(gpu_record.load(lab)["cells"]) >= 3, lab
