# The two commands a newcomer runs: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: run test install install-test lint format clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q -e '.[voice]'

# Reference implementations for parity tests, without their dependencies: chattts and vocos
# would pull torchaudio (no build for our torch); the tests stub the parts they do not use.
REFERENCE_PKGS := chattts==0.2.5 vocos==0.1.0 vector-quantize-pytorch==1.32.0 \
	torch-einops-utils==0.2.0

install-test: $(BIN)/python
	$(BIN)/pip install -q -e '.[voice,chattts,test,dev]'
	$(BIN)/pip install -q --no-deps $(REFERENCE_PKGS)

run: install
	$(BIN)/omnistep serve --host $(HOST) --port $(PORT)

test: install-test
	$(BIN)/python -m pytest -q

lint: install-test
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: install-test
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
