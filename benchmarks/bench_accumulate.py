"""How fast the quintic's accumulating products can run, against the bare matmul rate.

One Newton–Schulz step makes three products: ``S = X X^T``, ``P = b S + c S S`` and
``X' = a X + P X``. The last two add a matrix into the product with one rounding, which
``torch.baddbmm`` does (the form `muonclip.ortho._newton_schulz.quintic_iteration` uses). This
script prints, from one run, the time of one step written each way, and its rate against
the bare ``bmm`` step (the flop floor of `bench_ortho.py` and `bench_step.py`):

* ``bare``: three ``bmm`` into kept buffers, nothing added (the floor, ratio 1 by definition);
* ``baddbmm in place``: the accumulator already in the output buffer (``out.baddbmm_``), so
  only the accumulating product is paid. No Newton–Schulz step can run this way: its
  accumulators (S, X) are also operands of their own products;
* ``baddbmm out=``: the out-of-place form the library runs (torch copies the accumulator into
  ``out`` first);
* ``--inductor``: ``a X + P X`` and ``b S + c S S`` compiled by inductor with its C++ GEMM
  template (``max_autotune``, backend "CPP"), the addition fused into the product's epilogue;
  compile failures are printed, not raised.

The ratio of ``baddbmm out=`` (or of the inductor form, when faster) is the most an eager
single-rounding quintic step can reach on this machine, whatever else is done around the
products; ``baddbmm in place`` bounds any kernel that still reads and writes one accumulator.

Usage: ``python benchmarks/bench_accumulate.py [--threads 2] [--rounds 15] [--dtype
bfloat16|float32] [--inductor]``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from bench_ortho import quintic_flops
from timing import machine, round_robin, setup_threads

from muonclip.ortho._newton_schulz import NS5_COEFFICIENTS as NS5

# (label, E, m, n), m <= n: the GPT set's buckets (6 layers, d=384; the tall c_fc runs from the
# right with the same products) and the 64 experts
SHAPES = [
    ("gpt 24 attn", 24, 384, 384),
    ("gpt 6 mlp", 6, 384, 1536),
    ("64 experts", 64, 176, 256),
]


def step_forms(E: int, m: int, n: int, dtype: torch.dtype, inductor: bool) -> dict[str, Callable[[], object]]:
    """One quintic step on a normalised (E, m, n) batch, in each form (see the module docstring)."""
    a, b, c = NS5
    g = torch.Generator().manual_seed(0)
    X = torch.randn(E, m, n, generator=g).div_(n**0.5 * m**0.5).to(dtype)
    S, P, Y = torch.empty(E, m, m, dtype=dtype), torch.empty(E, m, m, dtype=dtype), torch.empty_like(X)

    def bare() -> None:
        torch.bmm(X, X.mT, out=S)
        torch.bmm(S, S, out=P)
        torch.bmm(P, X, out=Y)

    def in_place() -> None:  # accumulators already in P and Y (stale values: the time is the same)
        torch.bmm(X, X.mT, out=S)
        P.baddbmm_(S, S, beta=b, alpha=c)
        Y.baddbmm_(P, X, beta=a)

    def out_of_place() -> None:
        torch.bmm(X, X.mT, out=S)
        torch.baddbmm(S, S, S, beta=b, alpha=c, out=P)
        torch.baddbmm(X, P, X, beta=a, out=Y)

    forms: dict[str, Callable[[], object]] = {"bare": bare, "baddbmm in place": in_place, "baddbmm out=": out_of_place}
    if inductor:
        compiled = inductor_step(X, S, P)
        if compiled is not None:
            forms["inductor CPP GEMM, fused add"] = compiled
    return forms


def inductor_step(X: torch.Tensor, S: torch.Tensor, P: torch.Tensor) -> Callable[[], object] | None:
    """The two accumulating products compiled with inductor's C++ GEMM template; None if that fails."""
    import torch._inductor.config as inductor_config

    a, b, c = NS5

    def poly(S: torch.Tensor) -> torch.Tensor:
        return b * S + c * (S @ S)

    def update(P: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
        return a * X + P @ X

    options = {"max_autotune": True, "max_autotune_gemm_backends": "CPP"}
    try:
        with inductor_config.patch(options):  # the first call compiles, under these options
            f_poly = torch.compile(poly, fullgraph=True, dynamic=False)
            f_update = torch.compile(update, fullgraph=True, dynamic=False)
            f_poly(S)
            f_update(P, X)
    except Exception as err:  # inductor raises many kinds; reported, the eager forms still run
        print(f"inductor CPP GEMM failed to compile: {type(err).__name__}: {str(err).strip()[:200]}")
        return None

    def step() -> None:
        torch.bmm(X, X.mT, out=S)
        f_poly(S)
        f_update(P, X)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clock", choices=("wall", "process"), default="wall")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--inductor", action="store_true", help="add the inductor C++ GEMM template (compiles)")
    args = parser.parse_args()
    setup_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    print(f"# bench_accumulate: {machine()}; {args.dtype}; clock={args.clock}, median of {args.rounds} rounds\n")
    print("| bucket | form | ms per step | GFLOP/s | / bare |")
    print("|---|---|---|---|---|")
    for label, E, m, n in SHAPES:
        t = round_robin(step_forms(E, m, n, dtype, args.inductor), rounds=args.rounds, clock=args.clock)
        flops = E * quintic_flops(m, n, steps=1)
        for name, s in t.items():
            print(f"| {label} {E}x{m}x{n} | {name} | {s * 1e3:.2f} | {flops / s / 1e9:.0f} | {t['bare'] / s:.2f} |")


if __name__ == "__main__":
    main()
