# The README's two commands. Both set up first (a no-op when everything is installed).
PYTHON ?= python3
# A directory of wheels built by scripts/wheelhouse.py: `make setup WHEELHOUSE=DIR` installs from it alone.
WHEELHOUSE ?=

.PHONY: setup quickstart test test-fast lint docs gpu-check

setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh $(if $(WHEELHOUSE),--wheelhouse $(WHEELHOUSE))

quickstart: setup
	rm -rf runs/quickstart  # a demonstration: each one starts afresh
	./launch.sh configs/quickstart.json

test: setup
	ruff check .
	$(PYTHON) -m pytest -q

# The in-process tests only (tests/unit): no launcher, no subprocess runs; a few minutes at most.
test-fast: setup
	ruff check .
	$(PYTHON) -m pytest -q tests/unit

lint:
	ruff check . && ruff format --check .

docs:
	$(PYTHON) -m engine docs

# Proves a GPU node in one command (bench/gpu_check.py): the GPU tests, benchmark 5's rows and an
# offload run, within 10 minutes on one H100; on a machine without a GPU it says so and exits 0.
gpu-check: setup
	$(PYTHON) -m bench.gpu_check
