"""The project's own files agree with each other: one source of truth for each fact."""

import ast
import pathlib
import re
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _pyproject():
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_environment_yml_installs_the_project_from_pyproject():
    """environment.yml provides Python and pip, then installs this project: no second list of deps."""
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    conda_deps = [d for d in env["dependencies"] if isinstance(d, str)]
    pip_sections = [d["pip"] for d in env["dependencies"] if isinstance(d, dict)]
    names = sorted(re.split(r"[<>=! ]", d, maxsplit=1)[0] for d in conda_deps)
    assert names == ["pip", "python"], f"conda-level dependencies must be python and pip only: {conda_deps}"
    assert pip_sections == [["--editable ."]], f"pip section must install the project: {pip_sections}"


def test_environment_yml_python_agrees_with_requires_python():
    """The conda Python pin is the same lower bound as pyproject's requires-python."""
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert python.removeprefix("python") == _pyproject()["project"]["requires-python"]


def test_the_root_modules_are_the_ones_installed():
    """Flat layout: every flash_*.py and _flash_*.py (flash_lib's private modules) beside
    flash_lib.py is declared in py-modules, and every flash_*/ package directory in packages, or
    discovery may fail."""
    config = _pyproject()["tool"]["setuptools"]
    declared = config["py-modules"]
    assert "flash_lib" in declared
    modules = [p.stem for pattern in ("flash_*.py", "_flash_*.py") for p in ROOT.glob(pattern)]
    assert sorted(declared) == sorted(modules)
    packages = sorted(p.parent.name for p in ROOT.glob("flash_*/__init__.py"))
    assert sorted(config.get("packages", [])) == packages, packages


# What would make CI test another installation than the README's: a package installed, an
# environment made or set up, by any route, before the README's commands run.
_INSTALLS = re.compile(r"\bpip3?\b.*\binstall\b|\bmake\b.*\bsetup\b|\buv\b|\bconda\b|\bpoetry\b"
                       r"|\bpipx\b|\bvenv\b|\beasy_install\b|\bsetup\.py\b")


def _installs_before_readme_commands(script):
    """The lines of a CI script that install something before both of the README's commands,
    ``make test`` and ``make``, have run; raises if either command is not in it, alone on a line."""
    lines = [line.split("#", 1)[0].strip() for line in script.splitlines()]
    assert "make test" in lines and "make" in lines, "CI must run `make test` and `make` as written"
    last = max(lines.index("make test"), lines.index("make"))
    return [line for line in lines[:last] if _INSTALLS.search(line)]


def test_ci_runs_the_readme_commands_before_installing_anything():
    """CI is the README: `.ci/run` runs `make test` and `make` exactly as the README gives them
    (each alone on a line), and installs no Python package (nor sets up .venv) before both have
    run; the only thing before them is the system package the README names, Chromium."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert _installs_before_readme_commands(ci) == []
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^make +#", readme, re.M) and re.search(r"^make test +#", readme, re.M)
    assert re.search(r"apt-get install\b.*\bchromium\b", ci) and "chromium" in readme


def test_the_ci_check_catches_an_install_moved_before_the_readme_commands():
    """The check above on CI scripts that would test another installation than the README's."""
    readme_only = "apt-get install -y chromium\nmake test\nmake\npip install '.[jax]'\n"
    assert _installs_before_readme_commands(readme_only) == []
    for early in (".venv/bin/python -m pip install --editable '.[jax]'", "make setup",
                  "uv pip install torch", "python3 -m venv .venv", "pip3 install triton"):
        moved = f"apt-get install -y chromium\n{early}\nmake test\nmake\n"
        assert _installs_before_readme_commands(moved) == [early], early
        between = f"make test\n{early}\nmake\n"
        assert _installs_before_readme_commands(between) == [early], early


def test_readme_usage_example_runs():
    """The README's Python example is executed as written, so it cannot rot."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def _imports(path):
    """The top-level modules a Python file imports anywhere in it (``import a.b`` and
    ``from a.b import c`` both count as ``a``; relative imports are left out)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_chapters_import_no_bench_module_and_bench_imports_nothing_private():
    """A chapter imports what a reader can import (flash_bench for its timings), never a script
    of bench/; and the benchmarks use flash_lib's public API, never its private modules."""
    bench = {"bench"} | {p.stem for p in (ROOT / "bench").glob("*.py")}
    for chapter in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py")):
        assert not _imports(chapter) & bench, chapter.name
    for script in sorted((ROOT / "bench").glob("*.py")):
        assert not {m for m in _imports(script) if m.startswith("_flash")}, script.name


def test_no_test_module_imports_another():
    """What test modules share is in tests/helpers.py; none imports another test module (or
    conftest.py), so that changing one test cannot change another unseen."""
    others = {p.stem for p in (ROOT / "tests").glob("*.py")} - {"helpers"}
    for module in sorted((ROOT / "tests").glob("*.py")):
        assert not _imports(module) & others, module.name
