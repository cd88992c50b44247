"""Sphinx configuration: the tutorial site, built from the notebooks by executing them.

Build with `make docs` (sphinx-build -W --keep-going -n -T: every warning fails the build).

The chapters are `notebooks/NN_topic.py` (py:percent), reached through the committed symlink
`docs/chapters -> ../notebooks`, so there is no copy to go stale. They are executed afresh on
every read ("force"): the site shows what the code does now, and a failing cell fails the build.
"""

import hashlib
import pathlib

import flash_lib
import jupytext
import nbformat
from docutils import nodes
from sphinx import addnodes
from sphinx.util import logging

logger = logging.getLogger(__name__)

project = "FlashAttention, derived and verified"
author = "the authors of this tutorial"
copyright = "the authors of this tutorial, under the MIT licence"
html_title = project

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    # MathJax 3 copied into _static/mathjax and loaded from there: no CDN, math works offline.
    "sphinx-mathjax-offline",
]

# --- Which files are pages --------------------------------------------------------------------
# Only these: the chapters (not their .ipynb twins, which would collide with the .py of the same
# name, nor helpers, nbval_sanitize.cfg or conf.py itself), the landing page and the API page.
include_patterns = ["index.md", "api.md", "chapters/[0-9][0-9]_*.py"]
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
root_doc = "index"
html_static_path = ["_static"]
html_css_files = ["custom.css"]

# --- MyST-NB: read py:percent through jupytext, execute everything, fail on any error --------
# (read_chapter is jupytext.reads for py:percent; it also reads the JSON that
# _stored_outputs_where_not_run hands on where a cell cannot run on this platform.)
nb_custom_formats = {".py": ["notebooks._platform.read_chapter", {}]}
nb_execution_mode = "force"
nb_execution_raise_on_error = True
nb_execution_show_tb = True  # the failing cell's traceback goes into the build log
nb_execution_timeout = 300  # per cell; each chapter is meant to run in well under a minute
nb_merge_streams = True
# Text on stderr (a warning, a deprecation) becomes a build warning, hence an error.
nb_output_stderr = "warn"
# Widgets would pull require.js and the widget manager from a CDN; the site stays offline and
# shows each widget's static fallback instead.
nb_ipywidgets_js = {}
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_heading_anchors = 3

# --- The API page: generated from flash_lib's NumPy-style docstrings ------------------------
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True  # show block_q=DEFAULT_BLOCK_Q, not a number that may change
napoleon_google_docstring = False
napoleon_numpy_docstring = True
# Types such as "arrays of shape (..., Nq, d)" are prose, not cross-reference targets.
napoleon_use_param = False
napoleon_use_rtype = False
nitpicky = True

# --- Theme: a book layout; no launch (Binder/Colab/Thebe) or repository buttons, no requests --
html_theme = "sphinx_book_theme"
html_theme_options = {
    "home_page_in_toc": True,
    "show_toc_level": 2,
    "show_navbar_depth": 1,
    "use_download_button": True,
    "use_fullscreen_button": True,
    "use_repository_button": False,
    "use_issues_button": False,
    "use_edit_page_button": False,
    "use_source_button": False,
    "launch_buttons": {},
    "show_prev_next": True,
    # The book layout keeps search in the left sidebar; without this, pydata-sphinx-theme >= 0.16
    # adds a second search box in an otherwise empty top bar.
    "navbar_persistent": [],
    "footer_content_items": ["copyright.html"],
}
# Matplotlib figures have white backgrounds: open in light mode (the theme switch still works).
html_context = {"default_mode": "light"}

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Every page runs flash_lib (chapters, landing page) or documents it (API page), so all of them
# are read again when it changes, or when another copy is imported (PYTHONPATH, as the tests of
# the tests do): a config value that changes makes Sphinx re-read every page.
_flash_lib_file = pathlib.Path(flash_lib.__file__).resolve()
_flash_lib_files = [_flash_lib_file, *sorted(_flash_lib_file.parent.glob("_flash_*.py"))]  # its modules
flash_lib_source = f"{_flash_lib_file} " + " ".join(
    hashlib.sha256(path.read_bytes()).hexdigest() for path in _flash_lib_files)


# --- Per-chapter "run it yourself" box ---------------------------------------------------------
def _chapter_box(app, doctree):
    """Put a box under each chapter's title: its .ipynb download and how to run it (`make lab`).

    Done here rather than in the notebooks, whose prose must read well in JupyterLab too. Runs
    before Sphinx's download collector, which then copies the .ipynb into the build.
    """
    docname = app.env.current_document.docname
    if not docname.startswith("chapters/"):
        return
    stem = docname.split("/", 1)[1]
    ipynb = ROOT / "notebooks" / f"{stem}.ipynb"

    para = nodes.paragraph()
    para += nodes.Text("This page is ")
    para += nodes.literal(text=f"notebooks/{stem}.py")
    para += nodes.Text(", executed when the site was built. ")
    if ipynb.is_file():
        para += nodes.Text("Download it as a notebook, with its stored outputs: ")
        para += addnodes.download_reference(
            "", "", nodes.literal(text=f"{stem}.ipynb"),
            refdoc=docname, refdomain="", reftype="download", refexplicit=True,
            refwarn=True, reftarget=f"/chapters/{stem}.ipynb",
        )
        para += nodes.Text(". ")
    else:
        logger.warning(f"no notebooks/{stem}.ipynb to offer for download (run `make notebooks`)",
                       location=docname)
    para += nodes.Text("Or run it yourself: in a clone of the project, ")
    para += nodes.literal(text="make lab")
    para += nodes.Text(f" opens JupyterLab on notebooks/, where {stem}.py opens as a notebook.")
    box = nodes.admonition(classes=["tip", "run-this-chapter"])
    box += nodes.title(text="Run this chapter")
    box += para

    section = next(iter(doctree.findall(nodes.section)), None)
    if section is not None and section.children and isinstance(section[0], nodes.title):
        section.insert(1, box)
    else:
        doctree.insert(0, box)


def _stored_outputs_where_not_run(app, docname, source):
    """Where a chapter has cells this platform cannot run (``notebooks/_platform.py``: Triton off
    Linux), show those cells' outputs stored in the chapter's .ipynb instead of executing them
    (nbclient skips a cell tagged ``skip-execution``), under a note at the top saying which and
    why. On Linux every cell runs and the chapter is read as it is."""
    if not docname.startswith("chapters/"):
        return
    from notebooks import _platform

    nb = jupytext.reads(source[0], fmt="py:percent")
    tags = sorted({tag for cell in nb.cells for tag in _platform.missing(cell.metadata.get("tags", []))})
    if not tags:
        return
    stem = docname.split("/", 1)[1]
    # the pair is in sync cell for cell (tests/test_notebooks.py)
    stored = nbformat.read(ROOT / "notebooks" / f"{stem}.ipynb", as_version=4)
    skipped = 0
    for cell, saved in zip(nb.cells, stored.cells):
        if _platform.missing(cell.metadata.get("tags", [])):
            cell.outputs, cell.execution_count = saved.outputs, saved.execution_count
            cell.metadata["tags"] = cell.metadata["tags"] + ["skip-execution"]
            skipped += 1
    reasons = " ".join(_platform.reason(tag) + "." for tag in tags)
    note = nbformat.v4.new_markdown_cell(
        f":::{{admonition}} Not all of this chapter was executed\n:class: warning\n\n"
        f"{reasons} The {skipped} cells marked "
        f"\"stored output\" show the outputs stored in `notebooks/{stem}.ipynb`, from a run on "
        "Linux; every other cell ran when this site was built.\n:::")
    nb.cells.insert(1, note)
    source[0] = nbformat.writes(nb)


def _prune_mathjax(app, exc):
    """Keep the one MathJax bundle the pages load (tex-chtml.js) and the parts it loads lazily.

    sphinx-mathjax-offline copies all of MathJax 3, including eight other combined bundles that
    nothing here loads (about 14 MB). Runs after its copy (a later priority).
    """
    mathjax = pathlib.Path(app.outdir, "_static", "mathjax")
    if exc is None and mathjax.is_dir():
        for bundle in mathjax.glob("*.js"):
            if bundle.name not in {"tex-chtml.js", "core.js", "loader.js", "startup.js"}:
                bundle.unlink()


def setup(app):
    app.connect("source-read", _stored_outputs_where_not_run)
    app.connect("doctree-read", _chapter_box, priority=100)
    app.add_config_value("flash_lib_source", "", "env")
    app.connect("build-finished", _prune_mathjax, priority=900)
