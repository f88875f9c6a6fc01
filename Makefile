# Quick start: `make demo` creates .venv with what the demo needs and runs it; `make test` installs the
# pinned dev environment there and runs pytest.
# the first Python 3.11 or newer found: python3.11, python3.12, python3.13, then python3
PYTHON ?= $(shell for p in python3.11 python3.12 python3.13 python3; do \
	command -v $$p >/dev/null 2>&1 && $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null && { echo $$p; break; }; done)
VENV := .venv
PY := $(VENV)/bin/python
export OMP_NUM_THREADS := 1

.PHONY: test test-gpu gpu-check demo bench bench-links bench-islands bench-lm bench-gpu install upstream docs

define NEW_VENV
	@test -n "$(PYTHON)" || { echo "make: no Python 3.11 or newer found (set PYTHON=...)" >&2; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
endef

# Everything (tests, docs, the demo): the pinned dev environment. It holds the demo's too.
$(VENV)/.installed: pyproject.toml requirements-dev.txt constraints.txt
	$(NEW_VENV)
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@ $(VENV)/.demo-installed

# What the demo needs only: puredist with its [demo] extra and [ft] (the diloco_ft row), the tested torch.
$(VENV)/.demo-installed: pyproject.toml constraints.txt
	$(NEW_VENV)
	$(PY) -m pip install --quiet -e ".[demo,ft]" -c constraints.txt
	touch $@

install: $(VENV)/.installed

test: install
	$(PY) -m pytest -q

# The CUDA tests, on a machine with a GPU (skipped without one). `make test-gpu PY=python3`
# uses that machine's own torch instead of the venv (puredist then comes from src/).
NEEDS_VENV = $(if $(filter $(PY),$(VENV)/bin/python),install)
test-gpu: $(NEEDS_VENV)
	PYTHONPATH=src$(if $(PYTHONPATH),:$(PYTHONPATH)) $(PY) -m pytest -q -m cuda tests/test_cuda.py

# torch's own tests for the seeds, run against puredist.classic (slow; not in `make test`)
upstream: install
	$(PY) -m pip install --quiet -e .[upstream]
	$(PY) upstream/run.py

# the guides (docs/*.md) and the API reference (from the docstrings) as HTML in out/docs,
# offline; nitpicky and with warnings as errors, so a broken cross-reference fails it
docs: install
	$(PY) -m sphinx -b html -n -W --keep-going -E -q docs out/docs

demo: $(VENV)/.demo-installed
	$(PY) -m puredist demo $(ARGS)

# The main job over real links (as root): each worker in its own network namespace, its egress shaped by tbf to
# 20 and 100 Mbit/s (the language model: 20), measured beside the network model (docs/links.md), into out/links
# and out/links-lm (about 5 min on 2 cores). Installs iproute2 where tc is missing.
bench-links: install
	command -v tc >/dev/null || apt-get install -y iproute2
	$(PY) -m puredist demo --world-size 2 --link 20mbit,100mbit --output out/links $(ARGS)
	$(PY) -m puredist demo --task lm --steps 96 --world-size 2 --algorithms ddp,periodic,diloco,streaming \
		--link 20mbit --output out/links-lm $(ARGS)

# The islands study (docs/links.md, as root): 2 islands of 2 workers training the language model, one torchrun per
# island, the links between the islands shaped by tbf to 10 Mbit/s (a compute-to-communication ratio near 10, as
# INTELLECT-1's), each algorithm's wall time, compute utilization and time to DDP's loss beside the network model,
# into out/islands (about 17 min on 2 cores). Installs iproute2 where tc is missing.
bench-islands: install
	command -v tc >/dev/null || apt-get install -y iproute2
	$(PY) -m puredist demo --islands 2 --output out/islands $(ARGS)

# The language-model study (docs/lm-study.md): DiLoCo against DDP, loss against bytes, into out/bench-lm (about 26 min alone on 2 cores)
bench-lm: install
	$(PY) benchmarks/bench_lm.py $(ARGS)

bench: install
	cd benchmarks && ../$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 bench_averaging.py
	cd benchmarks && ../$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 bench_zero.py
	cd benchmarks && ../$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 bench_outer.py
	cd benchmarks && ../$(PY) -m torch.distributed.run --standalone --nproc-per-node 4 bench_sharded.py
	cd benchmarks && ../$(PY) -m torch.distributed.run --standalone --nproc-per-node 2 bench_host.py
	cd benchmarks && ../$(PY) bench_optim.py
	$(PY) benchmarks/bench_ft.py
	$(PY) benchmarks/plan_balance.py
	$(PY) benchmarks/bench_vmap_compile.py

# What a GPU machine checks: the CUDA tests, then the benchmarks on the GPU.
gpu-check: test-gpu bench-gpu

# The benchmarks on GPU 0: two ranks over Gloo (both on the one GPU), then one NCCL rank.
# `make bench-gpu PY=python3` uses that machine's own torch (puredist from src/).
GPU_PY = cd benchmarks && PYTHONPATH=../src$(if $(PYTHONPATH),:$(PYTHONPATH)) $(if $(findstring /,$(PY)),$(abspath $(PY)),$(PY))
RUN_GPU = $(GPU_PY) -m torch.distributed.run --standalone
bench-gpu: $(NEEDS_VENV)
	$(RUN_GPU) --nproc-per-node 2 bench_averaging.py --device cuda
	$(RUN_GPU) --nproc-per-node 1 bench_averaging.py --device cuda --backend nccl
	$(RUN_GPU) --nproc-per-node 2 bench_zero.py --device cuda
	$(RUN_GPU) --nproc-per-node 1 bench_zero.py --device cuda --backend nccl
	$(RUN_GPU) --nproc-per-node 2 bench_outer.py --device cuda
	$(RUN_GPU) --nproc-per-node 1 bench_outer.py --device cuda --backend nccl
	$(RUN_GPU) --nproc-per-node 1 bench_host.py --device cuda --backend nccl
	$(GPU_PY) bench_optim.py --device cuda
