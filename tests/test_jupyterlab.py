"""`make lab` as a reader meets it: JupyterLab serves each chapter's .py as a notebook.

The `jupyter lab` command of `make lab` (read with `make -n lab`) is started headless on a free
localhost port, and asked through its REST API for each `notebooks/NN_topic.py`. Jupytext's
contents manager must hand it over as a notebook, with the cells of the paired `.ipynb` and its
stored outputs (so pairing works as `make lab` starts Lab); then the server is shut down and
must exit.
"""

import json
import os
import pathlib
import re
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
CHAPTERS = [p.stem for p in sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))]
START_TIMEOUT = 90  # seconds for the server to answer; it starts in a few on an idle machine
REQUEST_TIMEOUT = 30


def _lab_command():
    """The `jupyter lab ...` line that `make lab` runs, as a list, without running it."""
    if shutil.which("make"):
        dry = subprocess.run(["make", "-s", "-n", "lab"], cwd=ROOT, capture_output=True, text=True,
                             timeout=60)
        commands = dry.stdout.replace("\\\n", " ").splitlines()  # join continued lines
        lines = [ln for ln in commands if re.search(r"jupyter[ -]lab\b", ln)]
        assert dry.returncode == 0 and lines, f"no `jupyter lab` in `make -n lab`:\n{dry.stdout}"
        return shlex.split(lines[-1])
    return [str(pathlib.Path(sys.executable).with_name("jupyter")), "lab", "notebooks"]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A running `make lab` server: yields (base URL, token, path of notebooks/ in Lab's root).

    Its config and runtime folders are fresh ones, so no user configuration changes what it does.
    """
    tmp = tmp_path_factory.mktemp("jupyterlab")
    port, token = _free_port(), secrets.token_hex(16)
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(tmp / "config"),
               JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
    command = _lab_command() + [
        "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}"]
    if hasattr(os, "geteuid") and os.geteuid() == 0 and "--allow-root" not in command:
        command.append("--allow-root")  # CI containers run as root; Jupyter refuses by default
    log = open(tmp / "server.log", "w+")
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}/"

    def server_log():
        log.seek(0)
        return log.read()[-4000:]

    try:
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if server.poll() is not None:
                pytest.fail(f"jupyter lab exited with {server.returncode}:\n{server_log()}")
            try:
                _api(base, token, "api/status")
                break
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    pytest.fail(f"jupyter lab did not answer in {START_TIMEOUT} s:\n{server_log()}")
                time.sleep(0.5)
        # `make lab` may root Lab at notebooks/ or at the project (where jupytext.toml lives).
        listing = _api(base, token, "api/contents")["content"]
        at_project = any(i["name"] == "notebooks" and i["type"] == "directory" for i in listing)
        prefix = "notebooks/" if at_project else ""
        yield base, token, prefix
        # A clean shutdown, through the API, as the File > Shut Down menu does.
        _api(base, token, "api/shutdown", method="POST")
        assert server.wait(timeout=30) == 0, server_log()
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=10)
        log.close()


def _api(base, token, path, method="GET"):
    """One call to the server's REST API; its JSON answer, or None for an empty one."""
    req = urllib.request.Request(base + path, method=method,
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT) as r:
        body = r.read()
    return json.loads(body) if body else None


def _cells(nb):
    """(cell type, source) of every cell; nbformat allows a source stored as a list of lines."""
    return [(c["cell_type"], "".join(c["source"]) if isinstance(c["source"], list) else c["source"])
            for c in nb["cells"]]


def test_jupytext_server_extension_is_enabled():
    """Without jupytext's server extension Lab would open NN_topic.py as a plain text file."""
    listing = subprocess.run([sys.executable, "-m", "jupyter", "server", "extension", "list"],
                             capture_output=True, text=True, timeout=120)
    out = re.sub(r"\x1b\[[0-9;]*m", "", listing.stdout + listing.stderr)  # colours
    assert re.search(r"jupyterlab_jupytext\s+enabled", out), out


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_lab_opens_the_py_as_the_paired_notebook(lab, chapter):
    base, token, prefix = lab
    model = _api(base, token, f"api/contents/{prefix}{chapter}.py?type=notebook&content=1")
    assert model["type"] == "notebook" and model["format"] == "json", model["type"]
    served = model["content"]
    stored = json.loads((NOTEBOOKS / f"{chapter}.ipynb").read_text())
    assert _cells(served) == _cells(stored), f"{chapter}.py opens with other cells than its .ipynb"
    # The outputs come from the paired .ipynb: the reader sees the plots without running anything.
    n_outputs = sum(len(c.get("outputs", [])) for c in served["cells"] if c["cell_type"] == "code")
    assert n_outputs > 0, (
        "Lab did not pair the .py with its .ipynb: no stored outputs (is jupytext.toml within"
        " Lab's root, or `formats: ipynb,py:percent` in the .py header?)")
    assert n_outputs == sum(len(c["outputs"]) for c in stored["cells"] if c["cell_type"] == "code")
    assert served["metadata"]["kernelspec"]["name"] == "python3"
