# The README's two commands. Both set up first (a no-op when everything is installed).
PYTHON ?= python3

.PHONY: setup quickstart test test-fast lint docs

setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

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
