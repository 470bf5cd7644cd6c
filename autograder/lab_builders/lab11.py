"""Builds the lab 11 source notebook (serving, the capstone). Edit the section modules, then run
from the repo root:

    .venv/bin/python -m autograder.lab_builders.lab11

The lab is long, so its cells live in one module per part:
    lab11_engine.py    title, the given engine and a stalled decode, Problem 1 (the async engine)
    lab11_text.py      Problem 2 (incremental detokenization, stop strings), Problem 3 (SSE)
    lab11_api.py       Problem 4 (request checks, OpenAI errors), the server: curl, openai, /metrics
    lab11_load.py      Problem 5 (arrivals, concurrent clients), Problem 6 (metrics), Poisson load
    lab11_chunked.py   Problem 7 (chunked prefill), timeline, mixed-load measurement, summary
"""
from autograder.authoring import md, write_notebook  # noqa: E402
from autograder.lab_builders import lab11_api, lab11_chunked, lab11_engine, lab11_load, lab11_text  # noqa: E402
from autograder.lab_builders.common_cells import CHECK_YOUR_WORK  # noqa: E402

cells = lab11_engine.cells + lab11_text.cells + lab11_api.cells + lab11_load.cells + lab11_chunked.cells

if __name__ == "__main__":
    write_notebook("labs/11_serving/11_serving.ipynb", cells + [md(CHECK_YOUR_WORK)])
    print("wrote labs/11_serving/11_serving.ipynb")
