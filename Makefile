# One-command set-up: every target below creates .venv first if needed.
#   make compare   — the main job: AdamW vs Muon vs MuonClip on the built-in Shakespeare corpus
#   make test      — the test suite (what CI runs)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup compare test lint bench gpu-check docs clean deepspeed-ops

setup: $(STAMP)

# torch==2.13.0 first (the CPU wheel on local disk; an unpinned torch would pull a CUDA build),
# then the package with the app's extra (cli) and every optional extra the tests exercise.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[cli,dev,hf,lightning,tensorboard,torchtitan,peft,trl,docs,deepspeed]"
	$(MAKE) deepspeed-ops
	touch $(STAMP)

# DeepSpeed's CPU communication extension, built once into build/torch_extensions (where the tests
# look for it) under a kernel lock that a killed build cannot leave behind (tests/deepspeed_harness.py)
deepspeed-ops:
	DS_ACCELERATOR=cpu $(BIN)/python -c "import sys; sys.path.insert(0, 'tests'); import deepspeed_harness as h; h.extensions_ready()"

compare: $(STAMP)
	$(BIN)/muonclip compare

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --durations=15

lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_step.py

# On a CUDA machine with its own PyTorch (no .venv, nothing installed): CUDA tests + GPU benchmarks.
gpu-check:
	bash benchmarks/gpu_check.sh

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) out build dist site
