# Two commands for a fresh machine: `make serve` and `make test` (see README.md).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
CONFIG ?= config/models.yaml
# Pinned: an open torch range pulls several GB of CUDA wheels on Linux.
TORCH ?= torch==2.13.0
DEMO_DIR ?= demo-models

.PHONY: install serve test lint demo-models bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

demo-models: install
	@test -f $(DEMO_DIR)/demo-small/model.safetensors || $(BIN)/gateway make-demo-model $(DEMO_DIR)/demo-small --preset small --seed 0
	@test -f $(DEMO_DIR)/demo-medium/model.safetensors || $(BIN)/gateway make-demo-model $(DEMO_DIR)/demo-medium --preset medium --seed 1
	@test -f $(DEMO_DIR)/demo-embed/modules.json || $(BIN)/gateway make-demo-model $(DEMO_DIR)/demo-embed --embedding --seed 2

# exec: make forwards SIGTERM to this child, and Ctrl-C reaches it directly; the gateway then
# drains and stops every worker before it exits.
serve: install demo-models
	exec $(BIN)/gateway serve --config $(CONFIG) --host $(HOST) --port $(PORT)

test: install
	$(BIN)/python -m pytest -q -p no:cacheprovider

lint: install
	$(BIN)/ruff check gateway model_worker wire tests bench
	$(BIN)/ruff format --check gateway model_worker wire tests bench
	$(BIN)/mypy gateway model_worker wire

bench: install demo-models
	$(BIN)/python bench/bench_gateway_cpu.py

clean:
	rm -rf $(VENV) $(DEMO_DIR) *.egg-info
