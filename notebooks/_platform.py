"""The chapter cells that need a package some platforms cannot install, and what is done there.

A code cell tagged ``needs-triton`` runs flash_triton, hence Triton. pyproject.toml installs
Triton where it publishes wheels, Linux on x86_64 and aarch64; on every other platform (macOS,
Windows) such a cell cannot run. There, ``make test`` skips it with :func:`reason` in pytest's
summary (``notebooks/conftest.py``), and the site shows its stored output under a note that says
so (``docs/conf.py``). On Linux nothing is skipped. No chapter imports this module.
"""

import importlib.util
import platform

#: cell tag -> the module the tagged cells import
NEEDS = {"needs-triton": "triton"}


def missing(tags):
    """The tags among ``tags`` whose module cannot be imported here."""
    return [tag for tag in tags if tag in NEEDS and not _importable(NEEDS[tag])]


def _importable(module):
    # find_spec, not import: triton must be imported after flash_triton sets TRITON_INTERPRET
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # a finder that refuses the module (tests/test_notebooks.py plants one)
        return False


def reason(tag):
    """Why a cell tagged ``tag`` is not run on this platform: one line, for pytest and the site."""
    module = NEEDS[tag]
    return (f"{module} is not installed on this platform ({platform.system()} "
            f"{platform.machine()}): {module} publishes wheels for Linux x86_64 and aarch64 only, "
            f"so the cells that need it were not executed here")


def read_chapter(text):
    """MyST-NB's reader for a chapter (``docs/conf.py``): its py:percent source, or the notebook
    JSON that ``docs/conf.py`` makes of it where some of its cells show stored outputs."""
    import jupytext

    return jupytext.reads(text, fmt="ipynb" if text.lstrip().startswith("{") else "py:percent")
