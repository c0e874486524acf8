# Set-up and everyday commands. A fresh machine needs only python3 (3.11+) with pip and venv.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench-startup bench-generate

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[server,tune,dev]'
	touch $(STAMP)

install: $(STAMP)

# The main job on the embedded default model: a file of chat prompts, batched.
demo: install
	$(VENV)/bin/qwenbatch generate --chat --input examples/prompts.txt --max-tokens 64

test: install
	$(PY) -m pytest -q
	$(VENV)/bin/ruff check src tests benchmarks

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
