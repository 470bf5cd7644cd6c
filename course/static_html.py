"""Export an executed notebook to a standalone HTML page whose widgets work offline.

nbconvert's HTML loads require.js, the widget manager and MathJax from CDNs, so with no network
the widgets stay blank. Here the same exporter points those URLs at copies installed from npm
(`make vendor` -> assets/vendor/node_modules) that are copied next to the page, into `_vendor/`.
The page then requests nothing but files under its own folder; it works from file:// and from
any static web server.

MathJax is version 3 (one file plus its fonts), so the MathJax 2 block of the nbconvert
template is replaced by a v3 configuration with the same delimiters ($...$, $$...$$).
Mermaid diagrams are not vendored: a notebook with one would try to load it and fail.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import nbformat
from nbconvert import HTMLExporter

VENDOR_ENV = "COURSE_VENDOR_DIR"  # override where node_modules is (a folder like node_modules)
VENDOR_SUBDIR = "_vendor"

# What a page needs, as (source under node_modules, destination under _vendor/). Directories
# are copied whole; the widget manager's dist/ holds embed-amd.js and the icon fonts it uses.
_FILES = [
    ("requirejs/require.js", "require.js"),
    ("requirejs/package.json", "requirejs.package.json"),  # name, version, licence
    ("@jupyter-widgets/html-manager/dist/embed-amd.js", "html-manager/embed-amd.js"),
    ("@jupyter-widgets/html-manager/package.json", "html-manager/package.json"),
    ("mathjax/es5/tex-chtml-full.js", "mathjax/tex-chtml-full.js"),
    ("mathjax/es5/output/chtml/fonts/woff-v2", "mathjax/output/chtml/fonts/woff-v2"),
    ("mathjax/LICENSE", "mathjax/LICENSE"),
]
_FONT_SUFFIXES = (".woff2", ".woff", ".ttf", ".eot", ".svg")

_TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{%- block extra_css -%}
<style>/* widgets inherit JupyterLab's UI font; a static page has none, so labels would be serif */
.jupyter-widgets { font-family: var(--jp-ui-font-family); font-size: var(--jp-ui-font-size1); }
</style>
{%- endblock extra_css -%}
{%- block html_head_js_mathjax -%}
<script>
// The widget manager typesets labels with the MathJax 2 call MathJax.Hub.Queue(["Typeset", Hub, el]);
// this Hub forwards it to MathJax 3 (before MathJax is ready, the first page typeset covers it).
(function () {
  var hub = {Queue: function (cmd) {
    if (window.MathJax && MathJax.typesetPromise) MathJax.typesetPromise(cmd && cmd[2] ? [cmd[2]] : undefined);
  }};
  window.MathJax = {
    tex: {inlineMath: [['$', '$'], ['\\(', '\\)']], displayMath: [['$$', '$$'], ['\\[', '\\]']],
          processEscapes: true, processEnvironments: true, tags: 'ams'},
    chtml: {fontURL: '""" + VENDOR_SUBDIR + r"""/mathjax/output/chtml/fonts/woff-v2'},
    startup: {ready: function () { MathJax.startup.defaultReady(); MathJax.Hub = hub; }},
    Hub: hub
  };
}());
</script>
<script src="{{ resources.mathjax_url }}" defer></script>
{%- endblock html_head_js_mathjax -%}
"""


def vendor_dir() -> Path:
    """The node_modules folder with the vendored front-end files, or a clear error."""
    default = Path(__file__).resolve().parent.parent / "assets" / "vendor" / "node_modules"
    root = Path(os.environ.get(VENDOR_ENV) or default)
    missing = [src for src, _ in _FILES if not (root / src).exists()]
    if missing:
        raise FileNotFoundError(
            f"front-end files for offline widgets are missing under {root} ({missing[0]} and "
            f"{len(missing) - 1} more): run `make vendor` (npm ci in assets/vendor)"
        )
    return root


def copy_vendor(out_dir: Path) -> Path:
    """Copy the vendored files into `out_dir/_vendor/` (skipping ones already there)."""
    src_root, dest_root = vendor_dir(), Path(out_dir) / VENDOR_SUBDIR
    pairs = [(src_root / s, dest_root / d) for s, d in _FILES]
    widget_dist = src_root / "@jupyter-widgets/html-manager/dist"
    pairs += [(f, dest_root / "html-manager" / f.name) for f in widget_dist.iterdir() if f.suffix in _FONT_SUFFIXES]
    for src, dest in pairs:
        if src.is_dir():
            shutil.copytree(src, dest, dirs_exist_ok=True)
        elif not dest.exists() or dest.stat().st_size != src.stat().st_size:
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest)
    return dest_root


def exporter() -> HTMLExporter:
    """nbconvert's lab HTML exporter with every script URL pointing into `_vendor/`."""
    v = VENDOR_SUBDIR
    return HTMLExporter(
        template_name="lab",
        raw_template=_TEMPLATE,
        require_js_url=f"{v}/require.js",
        widget_renderer_url=f"{v}/html-manager/embed-amd.js",
        mathjax_url=f"{v}/mathjax/tex-chtml-full.js",
        jupyter_widgets_base_url=f"{v}/",  # unused once widget_renderer_url is set
        mermaid_js_url=f"{v}/mermaid-not-vendored.mjs",  # only loaded if a mermaid diagram exists
        mermaid_layout_elk_js_url="",
    )


def export_html(notebook: nbformat.NotebookNode | str | os.PathLike, out_path: str | os.PathLike) -> Path:
    """Write `notebook` (a NotebookNode or a .ipynb path) as a standalone page at `out_path`.

    The notebook should already be executed with widget state saved (nbclient does so by
    default; in JupyterLab: Settings > Save Widget State Automatically). Returns the path.
    """
    nb = notebook if isinstance(notebook, nbformat.NotebookNode) else nbformat.read(notebook, as_version=4)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    copy_vendor(out.parent)
    body, _ = exporter().from_notebook_node(nb, resources={"metadata": {"name": out.stem}})
    out.write_text(body, encoding="utf-8")
    return out
