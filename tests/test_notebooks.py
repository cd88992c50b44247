"""The committed notebooks: paired, in sync, executed. nbval (run by `make test`) re-executes them."""

import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))


def test_chapters_are_numbered_once_and_paired():
    """Every chapter is a .py source with its executed .ipynb, and nothing is unpaired."""
    pys = {p.stem for p in SOURCES}
    ipynbs = {p.stem for p in NOTEBOOKS.glob("[0-9][0-9]_*.ipynb")}
    assert pys == ipynbs, f"unpaired: {sorted(pys ^ ipynbs)}"
    numbers = [int(p.stem[:2]) for p in SOURCES]
    assert numbers[:9] == list(range(1, 10)), numbers
    assert len(set(numbers)) == len(numbers), f"two chapters share a number: {numbers}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_pair_in_sync(source):
    """The .ipynb converted to py:percent (in memory, with jupytext.toml) equals the committed .py.

    Read-only on purpose: `jupytext --sync` picks a direction by file times, which a fresh clone
    scrambles. In-process, with the config the CLI would find: the same text as
    `jupytext --to py:percent --output -`, without a 4 s interpreter start per chapter.
    """
    import jupytext
    from jupytext.config import load_jupytext_config

    config = load_jupytext_config(str(source.parent))
    assert config is not None, "jupytext.toml not found: the pair's format would be jupytext's default"
    converted = jupytext.writes(jupytext.read(source.with_suffix(".ipynb")), fmt="py:percent",
                                config=config)
    assert converted == source.read_text(), (
        f"{source.name} and its .ipynb differ: edit the .py, then `make notebooks`"
    )


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_notebook_is_executed_and_clean(source):
    """Stored outputs exist (nbval checks only cells that have them) and came from one clean run."""
    nb = json.loads(source.with_suffix(".ipynb").read_text())
    assert nb["metadata"]["kernelspec"]["name"] == "python3"
    representation = nb["metadata"].get("jupytext", {}).get("text_representation", {})
    assert "jupytext_version" not in representation, "jupytext version leaked into metadata"
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    counts = [c["execution_count"] for c in code]
    assert counts == list(range(1, len(code) + 1)), f"not executed top to bottom once: {counts}"
    assert any(c["outputs"] for c in code), "no stored outputs: nbval would check nothing"
    errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"
              or o.get("name") == "stderr"]
    assert not errors, f"stored errors or warnings: {errors}"


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_markdown_holds_no_control_character(source):
    """No markdown cell holds a control character other than a newline.

    A "\\tau" or "\\text" written in a non-raw Python string becomes a TAB followed by "au" or
    "ext": MathJax then shows "auL" and "ext{lse}" where the formula meant tau and text.
    """
    nb = json.loads(source.with_suffix(".ipynb").read_text())
    found = [(i, line) for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "markdown"
             for line in "".join(cell["source"]).split("\n")
             if any(ord(ch) < 32 or 127 <= ord(ch) < 160 for ch in line)]
    assert not found, f"control characters in markdown (cell, line): {found}"


# --- Cells that need a package some platforms cannot install (notebooks/_platform.py) ---------

def _code_cells(source):
    import jupytext

    return [c for c in jupytext.read(source).cells if c.cell_type == "code"]


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.stem)
def test_every_cell_that_runs_triton_is_tagged(source):
    """A cell that imports or calls Triton or flash_triton carries ``needs-triton``, so that
    where Triton has no wheel it is skipped (and shown stored) instead of failing the chapter."""
    import re

    untagged = [c.source.splitlines()[0] for c in _code_cells(source)
                if re.search(r"\bflash_triton\b|\bimport triton\b|\btriton\.", c.source)
                and "needs-triton" not in c.metadata.get("tags", [])]
    assert not untagged, f"cells without the needs-triton tag: {untagged}"


# Planted before anything imports: Triton cannot be found or imported, as on macOS or Windows.
_NO_TRITON = '''import sys


class _NoTriton:
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


sys.meta_path.insert(0, _NoTriton())
'''


def test_without_triton_make_test_skips_only_the_triton_cells_and_says_why(tmp_path):
    """Chapter 16 under nbval, as `make test` runs it, where Triton cannot be imported (in pytest
    and in the chapter's kernel alike): the tagged cells are skipped with the platform's reason in
    pytest's summary, and every other cell runs and matches its stored output."""
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(_NO_TRITON)
    chapter = next(s for s in SOURCES if s.stem.startswith("16_"))
    env = dict(__import__("os").environ, PYTHONPATH=str(tmp_path))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", str(chapter.with_suffix(".ipynb")), "--nbval",
         "--nbval-current-env", "--nbval-sanitize-with", str(NOTEBOOKS / "nbval_sanitize.cfg"),
         "-p", "no:cacheprovider", "-p", "no:xdist", "-ra", "-q"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    tagged = sum("needs-triton" in c.metadata.get("tags", []) for c in _code_cells(chapter))
    code = len(_code_cells(chapter))
    assert run.returncode == 0, run.stdout[-3000:]
    assert f"{code - tagged} passed, {tagged} skipped" in run.stdout, run.stdout[-3000:]
    assert f"SKIPPED [{tagged}] notebooks/{chapter.stem}.ipynb: triton" in run.stdout
    assert "triton is not installed on this platform" in run.stdout
    assert "publishes wheels for Linux x86_64 and aarch64 only" in run.stdout


def test_without_triton_the_site_shows_stored_outputs_under_a_note(monkeypatch):
    """docs/conf.py's reading of chapter 16 where Triton is missing: each tagged cell is marked
    ``skip-execution`` (nbclient does not run it) and carries the output stored in the .ipynb;
    a note at the top says what was not executed and why. With Triton, the page is untouched."""
    import importlib.util

    import jupytext
    import nbformat

    from notebooks import _platform

    spec = importlib.util.spec_from_file_location("docs_conf", ROOT / "docs" / "conf.py")
    conf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conf)
    chapter = next(s for s in SOURCES if s.stem.startswith("16_"))
    text = chapter.read_text()

    source = [text]
    conf._stored_outputs_where_not_run(None, f"chapters/{chapter.stem}", source)
    assert source == [text]  # Triton is installed here: nothing changes

    monkeypatch.setattr(_platform, "_importable", lambda module: module != "triton")
    conf._stored_outputs_where_not_run(None, f"chapters/{chapter.stem}", source)
    shown = _platform.read_chapter(source[0])
    stored = nbformat.read(chapter.with_suffix(".ipynb"), as_version=4)
    note = shown.cells[1]
    assert note.cell_type == "markdown" and note.source.startswith(
        ":::{admonition} Not all of this chapter was executed\n:class: warning")
    assert "triton is not installed on this platform" in note.source
    rest = shown.cells[:1] + shown.cells[2:]
    assert len(rest) == len(stored.cells) == len(jupytext.reads(text, fmt="py:percent").cells)
    skipped = shown_outputs = 0
    for cell, saved in zip(rest, stored.cells):
        tags = cell.metadata.get("tags", [])
        if "needs-triton" in tags:  # a cell may print nothing (the exercise's stub)
            skipped += 1
            shown_outputs += bool(saved.outputs)
            assert "skip-execution" in tags and cell.outputs == saved.outputs
        else:
            assert "skip-execution" not in tags and not cell.get("outputs")
    assert f"The {skipped} cells" in note.source and skipped > 0
    assert shown_outputs >= skipped - 1, (shown_outputs, skipped)  # the stored outputs are shown
