# Quick start: `make test` creates .venv, installs the pinned dev environment, runs pytest.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS := 1

.PHONY: test demo bench install upstream docs

$(VENV)/.installed: pyproject.toml requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

# torch's own tests for the seeds, run against puredist.classic (slow; not in `make test`)
upstream: install
	$(PY) -m pip install --quiet -e .[upstream]
	$(PY) upstream/run.py

# the API reference from the docstrings, offline; a type annotation pdoc cannot resolve is an error
DOCS_MODULES := puredist puredist.classic puredist.tree puredist.testing
docs: install
	$(PY) -W "error::UserWarning:pdoc.doc_types" -m pdoc -o out/docs $(DOCS_MODULES)

demo: install
	$(PY) -m puredist demo $(ARGS)

bench: install
	cd benchmarks && ../$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 bench_averaging.py
	cd benchmarks && ../$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 bench_zero.py
	cd benchmarks && ../$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 bench_outer.py
	cd benchmarks && ../$(PY) -m torch.distributed.run --standalone --nproc-per-node 4 bench_sharded.py
	$(PY) benchmarks/plan_balance.py
	$(PY) benchmarks/bench_vmap_compile.py
