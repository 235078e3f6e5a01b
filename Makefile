# Two commands do all set-up on a fresh clone:
#   make demo   creates .venv, installs attnlab, runs the worked example
#   make test   creates .venv if missing, runs the whole suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.attnlab-installed

.PHONY: demo test test-large clean help

help:
	@echo "make demo        set up .venv and print the lesson's worked example"
	@echo "make test        set up .venv if needed and run the whole test suite"
	@echo "make test-large  also run the very large case matrices (marker 'large')"
	@echo "make clean       remove .venv and caches"

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attnlab example

test: $(STAMP)
	$(BIN)/python -m pytest

test-large: $(STAMP)
	$(BIN)/python -m pytest -m large

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis src/*.egg-info
