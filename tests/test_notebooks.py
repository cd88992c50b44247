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
