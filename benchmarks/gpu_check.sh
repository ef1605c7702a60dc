#!/usr/bin/env bash
# Every GPU item of the project in one command, for a machine with one CUDA GPU whose python3
# already has a CUDA build of PyTorch (nothing is installed; the package runs from src/):
#   1. the CUDA-only tests (FlexAttention max_scores backend, no host sync in step());
#   2. bench_attention.py: capture with the flex backend vs plain FlexAttention and SDPA;
#   3. bench_step.py on the GPT-2-small hidden set (d=768, 12 layers) vs fused AdamW;
#   4. bench_ortho.py --big: 4096 x 4096, 4096 x 14336, 64 x 2048 x 1408 vs the matmul floor.
# Usage: bash benchmarks/gpu_check.sh   (or make gpu-check). The log is also written to
# ${OUT:-out}/gpu_check.log. PYTHON overrides the interpreter (default python3).
set -o pipefail
PY=${PYTHON:-python3}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="${OUT:-out}/gpu_check.log"
mkdir -p "$(dirname "$log")"
{
  "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
  "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_attention_capture.py tests/test_ortho_fast.py -k cuda
  "$PY" benchmarks/bench_attention.py --device cuda
  "$PY" benchmarks/bench_step.py --device cuda --d 768 --layers 12
  "$PY" benchmarks/bench_ortho.py --device cuda --big
} 2>&1 | tee "$log"
