# The two quick-start commands (see README): `make demo` and `make test` (mypy, then pytest).
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test bench clean

setup:
	@scripts/setup.sh

demo: setup
	@$(VENV)/bin/hetplan plan gpt2 --cluster mixed-generations --batch-size 256

test: setup
	@$(PY) -m mypy
	@$(PY) -m pytest -q $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
