# One-command set-up: every target below creates .venv first if needed.
#   make compare   — the main job: AdamW vs Muon vs MuonClip on the built-in Shakespeare corpus
#   make test      — the test suite (what CI runs)
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup compare test test-avx2 lint bench gpu-check docs clean deepspeed-ops

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

# --dist loadfile: a test file's tests share one worker, so a module's multi-process fixture (torchtitan's,
# the distributed suites') is launched once, not once per worker that runs one of its tests
test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15

# The suite as a CPU without AVX-512 and without bfloat16 instructions runs it (AMD EPYC Zen 3 and
# earlier): ATen, oneDNN and MKL held to AVX2, and orth_dtype="auto"'s probe answering "no bfloat16".
test-avx2: $(STAMP)
	ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 MUONCLIP_CPU_BF16=0 \
		$(BIN)/python -m pytest -n 2 --dist loadfile --durations=15

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
