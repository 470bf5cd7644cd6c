"""Course widgets: live in JupyterLab, and still working in static HTML with no kernel.

Every widget is built with `explorer()` (see explorer.py for why: precomputed states that
front-end links switch between). Drawing helpers live in `course.widgets.html`.
"""
from .batch_timeline import batch_timeline
from .cache_blocks import cache_blocks
from .explorer import MAX_STATES, Explorer, explorer
from .grammar_trace import grammar_trace  # noqa: F401 - lab 13
from .html import bar_table, cell_grid, legend, show_token
from .prefix_blocks import prefix_blocks
from .sampling_explorer import sampling_explorer
from .spec_trace import spec_trace
from .token_distribution import next_token_explorer
from .window_blocks import window_blocks

__all__ = [
    "MAX_STATES",
    "Explorer",
    "bar_table",
    "batch_timeline",
    "cache_blocks",
    "cell_grid",
    "explorer",
    "legend",
    "next_token_explorer",
    "prefix_blocks",
    "sampling_explorer",
    "show_token",
    "spec_trace",
    "window_blocks",
]
