#!/usr/bin/env bash
# Every GPU item of the project, for a machine with one CUDA GPU whose python3 already has a
# CUDA build of PyTorch (nothing is installed; the package runs from src/). Parts:
#   tests      the CUDA-only tests (FlexAttention max_scores backend, the LSE gate on SDPA's CUDA
#              kernels and the Triton max-logit kernel, no host sync in step() or in a gated
#              attention call, the Triton symmetric kernel against cuBLAS, torch's varlen kernel
#              recorded per document against a float64 reference);
#   attention  bench_gated_capture.py (bf16 and float32): exact and gated capture vs SDPA;
#              bench_attention.py: capture with the flex backend vs plain FlexAttention and SDPA;
#   step       bench_step.py on the GPT-2-small hidden set (d=768, 12 layers): the default Muon (its
#              row names the dtype orth_dtype="auto" picks and why) vs torch.optim.Muon, Keller
#              Jordan's Muon, fused AdamW and the quintic's bf16/fp32 product floors; and
#              bench_overhead.py on CUDA (the launch-bound fixed cost per step, NS stubbed);
#   ortho      bench_ortho.py --big: 4096 x 4096, 4096 x 14336, 64 x 2048 x 1408 vs the matmul floor
#              and vs the device's dense bf16 peak (bench_ortho.GPU_BF16_PEAK_TFLOPS; ns5_sym there
#              is the Triton kernel: does it beat cuBLAS's ns5?);
#   torchtitan bench_torchtitan.py on one GPU (not in the default list; needs the torchtitan extra):
#              torchtitan's llama3 (width 512, 8 layers), AdamW / DistMuon / Muon / MuonClip, whole
#              step and optimizer step, interleaved (NVIDIA's figure for Muon on Kimi K2: -2.1%).
# Usage: bash benchmarks/gpu_check.sh [PART ...]   (default: all four, in this order; make
# gpu-check runs all). Each part takes a few minutes (FlexAttention compiles once per shape), so
# under a per-command time limit run them one or two at a time. The output is also appended to
# ${OUT:-out}/gpu_check.log. PYTHON overrides the interpreter (default python3).
set -o pipefail
PY=${PYTHON:-python3}
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
log="${OUT:-out}/gpu_check.log"
mkdir -p "$(dirname "$log")"
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests attention step ortho)
status=0
{
  "$PY" -c "
import sys, torch
if not torch.cuda.is_available():
    sys.exit(f'gpu_check needs a CUDA GPU and a CUDA build of PyTorch; {sys.executable} has torch '
             f'{torch.__version__} without one (set PYTHON to the interpreter that has it)')
print('torch', torch.__version__, torch.cuda.get_device_name(0))" || exit 1
  for part in "${parts[@]}"; do
    echo "## gpu_check: $part"
    case "$part" in
      tests) PYTHONPATH="src:tests" "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_attention_capture.py \
               tests/test_attention_gate_device.py tests/test_ortho_fast.py tests/test_triton_syrk.py \
               tests/test_nonfinite.py tests/test_qkclip_check.py tests/test_pair_rule.py \
               tests/test_varlen_recording.py -k cuda ;;
      attention) "$PY" benchmarks/bench_gated_capture.py --device cuda --dtype bfloat16 --queue 10 &&
                 "$PY" benchmarks/bench_gated_capture.py --device cuda --dtype float32 --queue 10 --skip-train &&
                 "$PY" benchmarks/bench_attention.py --device cuda ;;
      step) "$PY" benchmarks/bench_step.py --device cuda --d 768 --layers 12 &&
            "$PY" benchmarks/bench_overhead.py --device cuda --rounds 100 ;;
      ortho) "$PY" benchmarks/bench_ortho.py --device cuda --big ;;
      torchtitan) "$PY" benchmarks/bench_torchtitan.py --device cuda --nproc 1 --width 512 --layers 8 --steps 20 ;;
      *) echo "unknown part '$part': choose from tests attention step ortho torchtitan"; false ;;
    esac || status=1
  done
  exit $status
} 2>&1 | tee -a "$log"
