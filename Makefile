# `make demo` and `make test` work on a fresh machine: each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test check bench protos clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# constraints.txt pins torch to the local CPU build; anything else downloads gigabytes.
	$(BIN)/python -m pip install --quiet --disable-pip-version-check -c constraints.txt -e '.[torch,dev]'
	touch $@

demo: $(STAMP)
	$(BIN)/python examples/demo.py

check: $(STAMP)
	$(BIN)/python scripts/gen_protos.py --check
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: check
	$(BIN)/pytest

bench: $(STAMP)
	$(BIN)/python bench/bench_planning.py
	$(BIN)/python bench/bench_daemon.py

protos: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache src/*.egg-info
