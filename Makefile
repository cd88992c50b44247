# `make` sets up .venv, executes every notebook into the rendered site and prints where it is.
# `make test` sets up .venv, then runs the unit tests and nbval over every committed notebook.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9][0-9]_*.py))

.PHONY: all setup test test-notebooks bench bench-dask bench-gpu notebooks lab docs serve clean

all: docs

# Idempotent: re-installs only when pyproject.toml changes. editable_mode=compat puts the repo
# root on sys.path through a plain .pth, so PYTHONPATH can still override flash_lib (tests of tests).
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --editable . --config-settings editable_mode=compat
	touch $(STAMP)

setup: $(STAMP)

test: setup
	$(BIN)/python -m pytest tests notebooks --nbval --nbval-current-env \
		--nbval-sanitize-with notebooks/nbval_sanitize.cfg -n auto --dist loadfile

# nbval alone, for the portability runs (CONTRIBUTING.md): e.g. with NPY_DISABLE_CPU_FEATURES set.
test-notebooks: setup
	$(BIN)/python -m pytest notebooks --nbval --nbval-current-env \
		--nbval-sanitize-with notebooks/nbval_sanitize.cfg -n auto --dist loadfile

bench: setup
	$(BIN)/python bench/bench_flash.py

# flash_dask on a LocalCluster of 1 and of 2 worker processes against flash_attention in one.
bench-dask: setup
	$(BIN)/python bench/bench_dask.py

# flash_triton compiled on a CUDA GPU: flash_check on it, then forward and forward+backward timed
# against PyTorch's SDPA (flash backend), results in bench/bench_gpu.json. Without CUDA it says so
# and exits 0; `bench/bench_gpu.py --interpret --quick` runs it on the CPU (tests/test_triton.py).
bench-gpu: setup
	$(BIN)/python bench/bench_gpu.py

# Re-execute every notebook from its .py source into the paired .ipynb (after changing flash_lib.py).
notebooks: setup
	@for nb in $(NOTEBOOKS); do \
		echo "executing $$nb"; \
		(cd notebooks && ../$(BIN)/jupytext --to ipynb --execute $$(basename $$nb)) || exit 1; \
	done
	@# Drop per-cell execution timestamps: they would change every .ipynb on every run.
	$(BIN)/python -c "import nbformat, sys; \
	[(nb := nbformat.read(p, as_version=4), [c.metadata.pop('execution', None) for c in nb.cells], \
	  nbformat.write(nb, p)) for p in sys.argv[1:]]" $(NOTEBOOKS:.py=.ipynb)

# Lab's root is the repo, so jupytext finds jupytext.toml and opens each chapter paired with its
# .ipynb; it starts in notebooks/. Jupyter refuses to run as root without --allow-root.
lab: setup
	$(BIN)/jupyter lab --ServerApp.root_dir=. --LabApp.default_url=/lab/tree/notebooks \
		$(if $(filter 0,$(shell id -u)),--allow-root)

# Executes every chapter into the site; any warning or failing cell fails the build. A failed
# build's saved state is dropped: Sphinx would otherwise skip, and not re-warn about, those pages.
# Run from docs/: `python -m sphinx` puts the cwd first on sys.path, and the API page must document
# the flash_lib the chapters run (PYTHONPATH can swap in another, for tests of the tests).
# tests/test_site.py builds the site with this very recipe (`make -o setup docs BIN=...`).
docs: setup
	cd docs && $(abspath $(BIN))/python -m sphinx -W --keep-going -n -T -b html \
		-d _build/doctrees . _build/html || { rm -rf _build/doctrees; exit 1; }
	@echo
	@echo "The site is built: $(CURDIR)/docs/_build/html/index.html"
	@echo "Open that file in a browser, or run 'make serve' and visit http://127.0.0.1:8000/"

serve: docs
	@echo "Serving docs/_build/html at http://127.0.0.1:8000/ (Ctrl-C stops it)"
	$(BIN)/python -m http.server --bind 127.0.0.1 --directory docs/_build/html 8000

clean:
	rm -rf $(VENV) docs/_build .pytest_cache .hypothesis build *.egg-info
	find . -name __pycache__ -prune -exec rm -rf {} +
