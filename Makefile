# Two commands from a fresh clone: `make demo` and `make test`. Each creates .venv on first use
# and re-installs only when pyproject.toml or constraints.txt changed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast install clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/ddplab run bbbp -n 2 trainer.max_epochs=8

test: $(STAMP)
	$(BIN)/python -m pytest

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

clean:
	rm -rf $(VENV) runs .pytest_cache
