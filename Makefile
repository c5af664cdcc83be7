# The README's two commands. Both set up first (a no-op when everything is installed).
PYTHON ?= python3

.PHONY: setup quickstart test lint docs

setup:
	PYTHON=$(PYTHON) bash scripts/setup.sh

quickstart: setup
	rm -rf runs/quickstart  # a demonstration: each one starts afresh
	./launch.sh configs/quickstart.json

test: setup
	ruff check .
	$(PYTHON) -m pytest -q

lint:
	ruff check . && ruff format --check .

docs:
	$(PYTHON) -m engine docs
