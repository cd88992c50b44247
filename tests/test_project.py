"""The project's own files agree with each other: one source of truth for each fact."""

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


def test_ci_runs_the_readme_test_command():
    """CI runs `make test`, the command README gives, and the README gives it."""
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M), ci
    assert "make test" in (ROOT / "README.md").read_text()


def test_readme_usage_example_runs():
    """The README's Python example is executed as written, so it cannot rot."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks, "README has no python example"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
