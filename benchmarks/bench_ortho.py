"""Orthogonalisation speed against the matmul flop floor, with accuracy beside every time.

For each shape (a batch of E matrices A x B) and method this prints, from one run:

* time per call (median of interleaved rounds, see timing.py);
* GFLOP/s: the method's own flops (docs/design.md, "Orthogonalisation"; Gram and symmetric forms count the
  products they actually make) / time, and "equiv": the plain quintic's flops / time (so a
  method that saves flops can beat the floor);
* the flop floor: the rate of the plain matrix products one quintic step makes (X X^T, S S,
  P X as bare ``bmm`` in the same dtype, same shapes), and the ratio GFLOP/s / floor;
* orthogonality error max |sigma_i - 1| of the result (singular values in float64), on
  inputs with singular values log-spaced in [0.01, 1] (condition number 100).

Batched vs looped: the same E matrices as one batched call and as E calls, and
torch.optim.Muon's per-matrix Newton–Schulz looped.

On a CUDA device the bfloat16 rows also give "equiv" against the device's dense bfloat16 peak
(`GPU_BF16_PEAK_TFLOPS`, the vendor's datasheet figure without sparsity, looked up by the device's
name; ``--peak-tflops`` gives it for another device).

Usage: ``python benchmarks/bench_ortho.py [--threads 2] [--rounds 7] [--clock wall|process]
[--big] [--compiled] [--device cpu|cuda] [--peak-tflops T]``. ``--big`` adds 4096 x 4096, 4096 x 14336 and 64
experts of 2048 x 1408 (the GPU goals; slow on CPU).
"""

from __future__ import annotations

import argparse

import torch
from flops import gram_flops, symmetric_flops
from timing import machine, round_robin, setup_threads

from muonclip.common._triton_support import triton_available
from muonclip.ortho import METHODS, orthogonalize
from muonclip.ortho._gram import GRAM_MIN_ASPECT

try:  # private in torch; only used as the comparison point
    from torch.optim._muon import _zeropower_via_newtonschulz as torch_ns
except ImportError:  # pragma: no cover
    torch_ns = None

NS5 = (3.4445, -4.7750, 2.0315)
GPU_BF16_PEAK_TFLOPS = (  # (name contains, dense bfloat16 tensor-core TFLOP/s), first match wins
    ("H200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0), ("A100", 312.0),
    ("L40S", 362.0), ("L4", 121.0), ("A10", 125.0),
)


def bf16_peak(device: str, given: float | None) -> float | None:
    """The device's dense bfloat16 peak in GFLOP/s: ``given`` (TFLOP/s), else the table's for its
    name; None on a CPU or an unknown GPU."""
    if given is not None:
        return given * 1e3
    if not device.startswith("cuda"):
        return None
    name = torch.cuda.get_device_name(torch.device(device))
    return next((t * 1e3 for key, t in GPU_BF16_PEAK_TFLOPS if key in name), None)
# (label, batch E, A, B)
SHAPES = [
    ("gpt attn", 1, 384, 384),
    ("gpt mlp proj", 1, 384, 1536),
    ("gpt mlp fc", 1, 1536, 384),
    ("gpt 24 attn batched", 24, 384, 384),
    ("gpt 6 mlp batched", 6, 384, 1536),
    ("64 experts (2048x1408 / 8)", 64, 256, 176),
]
BIG = [("4096 sq", 1, 4096, 4096), ("4096 x 14336", 1, 4096, 14336), ("64 experts 2048x1408", 64, 2048, 1408)]
# (method, dtype) pairs benchmarked
CONTENDERS = [
    ("ns5", torch.bfloat16),
    ("ns5", torch.float32),
    ("gram", torch.bfloat16),
    ("ns5_sym", torch.bfloat16),
    ("polar_express", torch.bfloat16),
]
COMPILED = [("ns5_compiled", torch.bfloat16)]  # --compiled: 7–20 s of compiling per shape on CPU


def conditioned(shape: tuple[int, ...], cond: float = 100.0, seed: int = 0) -> torch.Tensor:
    """Random matrices (batch over leading dims) with singular values log-spaced in [1/cond, 1]."""
    g = torch.Generator().manual_seed(seed)
    *batch, A, B = shape
    k = min(A, B)
    U, _ = torch.linalg.qr(torch.randn(*batch, A, k, generator=g, dtype=torch.float64))
    W, _ = torch.linalg.qr(torch.randn(*batch, B, k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, -torch.log10(torch.tensor(cond)).item(), k, dtype=torch.float64)
    return ((U * s) @ W.mT).float()


def quintic_flops(m: int, n: int, steps: int = 5) -> int:
    """Plain quintic Newton–Schulz on one m x n matrix, m <= n (docs/design.md, "Orthogonalisation")."""
    return steps * (4 * m * m * n + 2 * m**3)


def method_flops(method: str, A: int, B: int, steps: int = 5, device: str = "cpu") -> int:
    """Flops one matrix costs under ``method`` (the products it actually makes) on ``device``."""
    m, n = min(A, B), max(A, B)
    if method.startswith("gram") and n >= GRAM_MIN_ASPECT * m:
        return gram_flops(m, n, steps)
    if method == "ns5_sym":  # on CUDA with Triton: the kernel's upper-triangle tiles
        return symmetric_flops(m, n, steps, kernel=device.startswith("cuda") and triton_available())
    return quintic_flops(m, n, steps)


def ortho_error(O: torch.Tensor) -> float:  # O: (..., A, B)
    """max |sigma_i - 1| over every matrix of O, singular values in float64."""
    return (torch.linalg.svdvals(O.double()) - 1).abs().max().item()


def matmul_floor(E: int, A: int, B: int, dtype: torch.dtype, device: str, rounds: int, clock: str) -> float:
    """GFLOP/s of the bare products of one quintic step (X X^T, S S, P X) on these shapes."""
    m, n = min(A, B), max(A, B)
    X = torch.randn(E, m, n, dtype=dtype, device=device)
    S = torch.randn(E, m, m, dtype=dtype, device=device)
    t = round_robin(
        {"xxt": lambda: torch.bmm(X, X.mT), "ss": lambda: torch.bmm(S, S), "px": lambda: torch.bmm(S, X)},
        rounds=rounds, clock=clock, device=device,
    )
    return E * (4 * m * m * n + 2 * m**3) / sum(t.values()) / 1e9


def bench_shape(label: str, E: int, A: int, B: int, args: argparse.Namespace) -> list[str]:
    """Markdown rows for one shape."""
    V = conditioned((E, A, B)).to(args.device)
    fns, errs, flops = {}, {}, {}
    for method, dtype in CONTENDERS + (COMPILED if args.compiled else []):
        name = f"{method} {str(dtype).removeprefix('torch.')}"
        fns[name] = lambda method=method, dtype=dtype: orthogonalize(V, method, dtype=dtype)
        errs[name] = ortho_error(fns[name]())
        flops[name] = E * method_flops(method, A, B, device=args.device)
    if torch_ns is not None:
        name = "torch.optim.Muon NS (looped)"
        fns[name] = lambda: [torch_ns(v, NS5, 5, 1e-7) for v in V]
        errs[name] = ortho_error(torch.stack(fns[name]()))
        flops[name] = E * quintic_flops(min(A, B), max(A, B))
    if E > 1:
        name = "ns5 bfloat16 (looped)"
        fns[name] = lambda: [orthogonalize(v, "ns5") for v in V]
        errs[name] = errs["ns5 bfloat16"]
        flops[name] = flops["ns5 bfloat16"]
    times = round_robin(fns, rounds=args.rounds, clock=args.clock, device=args.device)
    floors = {
        dt: matmul_floor(E, A, B, dt, args.device, args.rounds, args.clock) for dt in (torch.bfloat16, torch.float32)
    }
    equiv = E * quintic_flops(min(A, B), max(A, B))
    peak = bf16_peak(args.device, args.peak_tflops)
    rows = []
    for name, t in times.items():
        floor = floors[torch.float32] if "float32" in name else floors[torch.bfloat16]
        rate = flops[name] / t / 1e9
        of_peak = f"{equiv / t / 1e9 / peak:.2f}" if peak and "float32" not in name and "float64" not in name else ""
        rows.append(
            f"| {label} | {E}x{A}x{B} | {name} | {t * 1e3:.2f} | {rate:.0f} | {equiv / t / 1e9:.0f} "
            f"| {floor:.0f} | {rate / floor:.2f} | {of_peak} | {errs[name]:.3f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--clock", choices=("wall", "process"), default="wall")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--big", action="store_true", help="add 4096 x 4096, 4096 x 14336, 64 x 2048 x 1408")
    parser.add_argument("--compiled", action="store_true", help="add ns5_compiled (torch.compile)")
    parser.add_argument("--only", default=None, help="run only shapes whose label contains this")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="the device's dense bfloat16 peak (default: GPU_BF16_PEAK_TFLOPS by the device's name)")
    args = parser.parse_args()
    setup_threads(args.threads)
    unknown = {m for m, _ in CONTENDERS + COMPILED} - set(METHODS)
    if unknown:
        raise SystemExit(f"methods {unknown} are not registered")
    print(f"# bench_ortho: {machine()}; clock={args.clock}, median of {args.rounds} interleaved rounds\n")
    peak = bf16_peak(args.device, args.peak_tflops)
    if peak:
        print(f"device's dense bfloat16 peak: {peak / 1e3:.0f} TFLOP/s\n")
    print("| shape | E x A x B | method | ms | GFLOP/s | equiv GFLOP/s | matmul floor GFLOP/s "
          "| GFLOP/s / floor | equiv / bf16 peak | max abs(sigma-1) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, E, A, B in SHAPES + (BIG if args.big else []):
        if args.only and args.only not in label:
            continue
        for row in bench_shape(label, E, A, B, args):
            print(row, flush=True)


if __name__ == "__main__":
    main()
