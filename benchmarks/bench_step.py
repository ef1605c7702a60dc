"""One optimizer step: muonclip.Muon vs torch.optim.Muon vs torch.optim.AdamW, in one run.

Two parameter sets (float32 weights, fixed gradients):

* **GPT** (6 layers, d = 384): per layer four d x d attention matrices (q, k, v, o), the MLP's
  4d x d ``c_fc`` and d x 4d ``c_proj`` (36 matrices, 10.6M weights).
* **experts**: one stacked-expert weight (64, 256, 176) (64 experts of 2048 x 1408 scaled by
  1/8). torch.optim.Muon takes 2-D weights only, so it gets the 64 experts as 64 parameters
  (looped); muonclip.Muon takes the 3-D weight and orthogonalises the 64 as one batch.

Contenders: ``muonclip.Muon`` with its defaults (ns5, ``orth_dtype="auto"``: bfloat16 where the
device multiplies it natively, else float32, the row names which and why; ``workspace="auto"``: the
buffered workspace on CPU), with ``orth_dtype`` fixed to float32 and to bfloat16 (both dtypes on
every machine), with ``workspace="core"`` (the pure functions, fresh tensors every step), with the
CPU chunking rule (``BufferedWorkspace(chunk="cache")``), with ``method="gram"`` (Gram
Newton–Schulz for the rectangular matrices), with ``method="polar_express"`` (the same flops as
ns5, a tighter band), with ``on_nonfinite="mask"`` (no host sync: the step is snapshot and
undone on the device), torch.optim.Muon (same lr, weight decay, ns5 coefficients, 5 steps),
Keller Jordan's Muon (`KellerMuon`: his single-device update, re-written here from his published
``muon.py``; bfloat16 on every machine, one matrix or one 3-D stack at a time) and
``torch.optim.AdamW(foreach=True)``; and two floors, the bare batched products of the step's five
quintic steps (X X^T, S S, S X per same-shape bucket, into kept outputs) in bfloat16 and in
float32, each row naming the machine's instructions for that dtype (AMX-BF16, AVX512-BF16:
native bfloat16; AVX512F, AVX2: float32, and emulated bfloat16). Times are medians of
interleaved rounds (timing.py) after warm-up steps, with the spread (min–max of the rounds), and
the ratio to torch.optim.Muon with the spread of its per-round values (each round times both, so
a burst of load from other processes moves both alike). Beside each Muon time: the
orthogonality error max |sigma_i - 1| of that optimizer's orthogonaliser on the set's matrices,
built with singular values log-spaced in [0.01, 1] (condition number 100), singular values of
the result in float64.

Then, on the GPT set, the first step's time over the median of the next ones, for the default
``muonclip.Muon`` and for torch.optim.Muon, each in a fresh process (so one-time costs such as
the matmul library's kernel set-up count for both), and Newton–Schulz's achieved GFLOP/s
against the plain matmul rate on the GPT shapes (see bench_ortho.py for the full table).

Usage: ``python benchmarks/bench_step.py [--threads 2] [--rounds 9] [--clock wall|process]
[--device cpu|cuda] [--d 384] [--layers 6]`` (``make bench`` runs it with the defaults; the
GPU goal's GPT-2-small hidden set is ``--device cuda --d 768 --layers 12``, where the AdamW
baseline is ``fused=True``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from functools import partial

import torch
from bench_ortho import conditioned, matmul_floor, ortho_error, quintic_flops, torch_ns
from step_sets import LR, WD, gpt_shapes, make_params
from timing import machine, round_robin, setup_threads

import muonclip
from muonclip.common._hardware import cpu_bf16_instructions, cpu_matrix_instructions, native_bf16
from muonclip.fast import BufferedWorkspace
from muonclip.optim._precision import orth_dtype_choice
from muonclip.ortho import orthogonalize, resolve_orth_dtype

NS5 = (3.4445, -4.7750, 2.0315)


class KellerMuon(torch.optim.Optimizer):
    """Keller Jordan's single-device Muon (github.com/KellerJordan/Muon, ``muon.py``,
    ``SingleDeviceMuon``), re-written for this benchmark from his published update.

    Per parameter, one at a time (a 3-D stack as one batch, as his Newton–Schulz takes any
    leading dimensions): the momentum buffer is an average, ``buf <- buf + (1 - mu)(G - buf)``; the
    Nesterov update overwrites the gradient, ``G <- G + mu (buf - G)``; it is cast to bfloat16,
    transposed when taller than wide, divided by its Frobenius norm + 1e-7, and run through five
    quintic steps ``S = X X^T; X <- a X + (b S + c S S) X`` with (a, b, c) = (3.4445, -4.7750,
    2.0315); scaled by ``sqrt(max(1, A / B))``; then ``W <- W (1 - lr wd) - lr U``.
    """

    def __init__(self, params, lr: float = 0.02, weight_decay: float = 0.0, momentum: float = 0.95) -> None:
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))

    @staticmethod
    def orthogonalize(G: torch.Tensor, steps: int = 5) -> torch.Tensor:
        a, b, c = NS5
        tall = G.size(-2) > G.size(-1)
        X = G.to(torch.bfloat16)
        if tall:
            X = X.mT
        X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
        for _ in range(steps):
            S = X @ X.mT
            X = a * X + (b * S + c * S @ S) @ X
        return X.mT if tall else X

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf, g = state["momentum_buffer"], p.grad
                buf.lerp_(g, 1 - mu)
                u = self.orthogonalize(g.lerp_(buf, mu))
                u = u * max(1.0, g.size(-2) / g.size(-1)) ** 0.5
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(u.reshape(p.shape), alpha=-group["lr"])


def buckets(shapes) -> list[tuple[int, int, int]]:
    """The step's same-shape batches ``(E, m, n)``, m <= n, as `muonclip.Muon` forms them."""
    count: dict[tuple[int, int], int] = {}
    for s in shapes:
        *batch, A, B = s
        key = (min(A, B), max(A, B))
        count[key] = count.get(key, 0) + (batch[0] if batch else 1)
    return [(E, m, n) for (m, n), E in count.items()]


def matmul_floor_step(shapes, dtype: torch.dtype, device: str, steps: int = 5):
    """A callable that makes the bare products of ``steps`` quintic steps on every bucket of
    ``shapes`` in ``dtype`` (X X^T, S S, S X as batched products into kept outputs): the least
    time any Newton–Schulz step in that dtype can take here; and its flop count."""
    work = []
    for E, m, n in buckets(shapes):
        X = torch.randn(E, m, n, dtype=dtype, device=device)
        S, P, Y = (torch.empty(E, m, m, dtype=dtype, device=device), torch.empty(E, m, m, dtype=dtype, device=device),
                   torch.empty(E, m, n, dtype=dtype, device=device))
        work.append((X, S, P, Y))

    def run() -> None:
        for _ in range(steps):
            for X, S, P, Y in work:
                torch.bmm(X, X.mT, out=S)
                torch.bmm(S, S, out=P)
                torch.bmm(P, X, out=Y)

    return run, sum(E * quintic_flops(m, n, steps) for E, m, n in buckets(shapes))


def instructions(dtype: torch.dtype, device: str) -> str:
    """How ``device`` multiplies ``dtype``, in words (the instructions named)."""
    if torch.device(device).type != "cpu":
        native, why = native_bf16(device)
        return why if dtype == torch.bfloat16 else "float32"
    found = cpu_matrix_instructions()
    if dtype == torch.bfloat16:
        bf16 = cpu_bf16_instructions()
        return f"native: {', '.join(bf16)}" if bf16 else \
            f"emulated: no AMX-BF16 or AVX512-BF16; {', '.join(found) or 'no AVX'}"
    return ", ".join(n for n in found if n in ("AVX512F", "AVX2")) or "no AVX"


def default_name(device: str) -> str:
    dtype, why = orth_dtype_choice("auto", "ns5", device)
    return f"muonclip.Muon default (auto -> {str(dtype).removeprefix('torch.')}: {why})"


def contenders(shapes, grads, device, torch_shapes=None, torch_grads=None):
    """name -> (optimizer or floor, orthogonaliser for the accuracy column or None)."""
    ts, tg = torch_shapes or shapes, torch_grads or grads
    auto = resolve_orth_dtype("auto", "ns5", device)
    out = {
        default_name(device): (
            muonclip.Muon(make_params(shapes, grads, device), lr=LR, weight_decay=WD),
            lambda V: orthogonalize(V, "ns5", dtype=auto),
        ),
        "muonclip.Muon orth_dtype=float32": (
            muonclip.Muon(make_params(shapes, grads, device), lr=LR, weight_decay=WD, orth_dtype=torch.float32),
            lambda V: orthogonalize(V, "ns5", dtype=torch.float32),
        ),
        "muonclip.Muon orth_dtype=bfloat16": (
            muonclip.Muon(make_params(shapes, grads, device), lr=LR, weight_decay=WD, orth_dtype=torch.bfloat16),
            lambda V: orthogonalize(V, "ns5", dtype=torch.bfloat16),
        ),
        'muonclip.Muon workspace="core"': (
            muonclip.Muon(make_params(shapes, grads, device), lr=LR, weight_decay=WD, workspace="core"),
            lambda V: orthogonalize(V, "ns5"),
        ),
        'muonclip.Muon BufferedWorkspace(chunk="cache")': (
            muonclip.Muon(make_params(shapes, grads, device), lr=LR, weight_decay=WD,
                          workspace=BufferedWorkspace(chunk="cache")),
            lambda V: orthogonalize(V, "ns5"),
        ),
        "muonclip.Muon method=gram": (
            muonclip.Muon(make_params(shapes, grads, device), lr=LR, weight_decay=WD, method="gram"),
            lambda V: orthogonalize(V, "gram"),
        ),
        "muonclip.Muon method=polar_express": (
            muonclip.Muon(make_params(shapes, grads, device), lr=LR, weight_decay=WD, method="polar_express"),
            lambda V: orthogonalize(V, "polar_express"),
        ),
        "muonclip.Muon on_nonfinite=mask": (
            muonclip.Muon(make_params(shapes, grads, device), lr=LR, weight_decay=WD, on_nonfinite="mask"),
            lambda V: orthogonalize(V, "ns5"),
        ),
    }
    if hasattr(torch.optim, "Muon"):
        out["torch.optim.Muon"] = (
            torch.optim.Muon(make_params(ts, tg, device), lr=LR, weight_decay=WD, ns_coefficients=NS5),
            None if torch_ns is None else lambda V: torch.stack([torch_ns(v, NS5, 5, 1e-7) for v in V]),
        )
    out["Keller Jordan's Muon (bf16)"] = (
        KellerMuon(make_params(shapes, grads, device), lr=LR, weight_decay=WD),
        KellerMuon.orthogonalize,
    )
    out[adamw_name(device)] = (
        torch.optim.AdamW(make_params(shapes, grads, device), lr=LR, weight_decay=WD, **adamw_kwargs(device)),
        None,
    )
    for dtype in (torch.bfloat16, torch.float32):
        floor, flops = matmul_floor_step(shapes, dtype, device)
        out[floor_name(dtype, device)] = (Floor(floor, flops), None)
    return out


class Floor:
    """A floor row: ``step`` makes the products, ``flops`` counts them."""

    def __init__(self, step, flops: int) -> None:
        self.step, self.flops = step, flops


def floor_name(dtype: torch.dtype, device: str) -> str:
    name = str(dtype).removeprefix("torch.")
    return f"floor: the quintic's products alone, {name} ({instructions(dtype, device)})"


def adamw_kwargs(device: str) -> dict[str, bool]:
    """The AdamW baseline: fused on CUDA (what GPU users run), foreach elsewhere."""
    return {"fused": True} if torch.device(device).type == "cuda" else {"foreach": True}


def adamw_name(device: str) -> str:
    (kind,) = adamw_kwargs(device)
    return f"torch.optim.AdamW({kind}=True)"


def accuracy(orth, mats: list[torch.Tensor]) -> float:
    """Largest orthogonality error of ``orth`` over every matrix in ``mats`` (batched by shape)."""
    by_shape: dict[tuple[int, ...], list[torch.Tensor]] = {}
    for m in mats:
        by_shape.setdefault(tuple(m.shape), []).append(m)
    return max(ortho_error(orth(torch.cat(ms) if ms[0].ndim == 3 else torch.stack(ms))) for ms in by_shape.values())


def run_set(title, shapes, grads, args, torch_shapes=None, torch_grads=None) -> None:
    opts = contenders(shapes, grads, args.device, torch_shapes, torch_grads)
    samples: dict[str, list[float]] = {}
    times = round_robin(
        {name: opt.step for name, (opt, _) in opts.items()},
        rounds=args.rounds, warmup=2, clock=args.clock, device=args.device, samples=samples,
    )
    ref = times.get("torch.optim.Muon")
    adamw = times[adamw_name(args.device)]
    default = times[default_name(args.device)]
    print(f"\n## {title}\n")
    print("| optimizer | step ms (min–max) | / torch.optim.Muon (min–max) | / default | / AdamW | GFLOP/s | "
          "max abs(sigma-1), cond 100 |")
    print("|---|---|---|---|---|---|---|")
    for name, t in times.items():
        opt, orth = opts[name]
        err = f"{accuracy(orth, grads):.3f}" if orth is not None else "n/a"
        # the per-round ratio to torch.optim.Muon timed in the same round: load hits both alike
        per_round = [a / b for a, b in zip(samples[name], samples["torch.optim.Muon"])] if ref else []
        vs_ref = f"{t / ref:.2f} ({min(per_round):.2f}–{max(per_round):.2f})" if ref else "n/a"
        rate = f"{opt.flops / t / 1e9:.0f}" if isinstance(opt, Floor) else ""
        spread = f"{min(samples[name]) * 1e3:.1f}–{max(samples[name]) * 1e3:.1f}"
        print(f"| {name} | {t * 1e3:.1f} ({spread}) | {vs_ref} | {t / default:.2f} | {t / adamw:.1f} | {rate} "
              f"| {err} |", flush=True)


def ns_rate(args) -> None:
    """Newton–Schulz GFLOP/s (ns5 and gram) in bfloat16 and float32 vs the bare matmul rate of the
    same dtype on the GPT buckets.

    The input is a bucket in the compute dtype, as `muonclip.Muon` hands it over (V written in
    the compute dtype), orthogonalised by the default CPU workspace (`muonclip.fast.BufferedWorkspace`:
    temporaries and result kept between calls, the bucket normalised in place); the time
    includes the normalisation, not a cast.
    """
    print("\n## Newton–Schulz rate on the GPT buckets\n")
    print("| bucket | dtype (instructions) | method | ms | equiv GFLOP/s | matmul floor GFLOP/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    L, d = args.layers, args.d
    for dtype in (torch.bfloat16, torch.float32):
        for E, A, B in [(4 * L, d, d), (L, 4 * d, d), (L, d, 4 * d)]:
            V = conditioned((E, A, B)).to(args.device, dtype)
            t = round_robin(
                {m: partial(BufferedWorkspace().orthogonalize, V, m, None, dtype, reuse_result=True)
                 for m in ("ns5", "gram")},
                rounds=args.rounds, clock=args.clock, device=args.device,
            )
            floor = matmul_floor(E, A, B, dtype, args.device, args.rounds, args.clock)
            flops = E * quintic_flops(min(A, B), max(A, B))
            name = f"{str(dtype).removeprefix('torch.')} ({instructions(dtype, args.device)})"
            for m, sec in t.items():
                rate = flops / sec / 1e9
                print(f"| {E}x{A}x{B} | {name} | {m} | {sec * 1e3:.1f} | {rate:.0f} | {floor:.0f} | "
                      f"{rate / floor:.2f} |", flush=True)


FIRST_STEP = {
    "muonclip.Muon (default)": lambda params: muonclip.Muon(params, lr=LR, weight_decay=WD),
    "torch.optim.Muon": lambda params: torch.optim.Muon(params, lr=LR, weight_decay=WD, ns_coefficients=NS5),
}


def first_step_times(name: str, args) -> tuple[float, float]:
    """In this (fresh) process: the first step of ``FIRST_STEP[name]`` on the GPT set, and the
    median of the next ``args.rounds`` steps (seconds, wall clock)."""
    shapes = gpt_shapes(args.d, args.layers)
    grads = [conditioned(s, seed=i) for i, s in enumerate(shapes)]
    opt = FIRST_STEP[name](make_params(shapes, grads, args.device))
    times = []
    for _ in range(1 + args.rounds):
        t0 = time.perf_counter()
        opt.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times[0], statistics.median(times[1:])


def first_step(args) -> None:
    """First step / median later step, each optimizer in fresh processes, alternating."""
    print("\n## First step on the GPT set (fresh process each)\n")
    print("| optimizer | first step ms | later step ms (median) | first / later |")
    print("|---|---|---|---|")
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in FIRST_STEP}
    for _ in range(2):
        for name in FIRST_STEP:
            cmd = [sys.executable, __file__, "--first-step-of", name, "--threads", str(args.threads),
                   "--rounds", str(args.rounds), "--device", args.device, "--d", str(args.d),
                   "--layers", str(args.layers)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            runs[name].append(tuple(json.loads(out.splitlines()[-1])))
    for name, pairs in runs.items():
        for first, later in pairs:
            print(f"| {name} | {first * 1e3:.1f} | {later * 1e3:.1f} | {first / later:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--clock", choices=("wall", "process"), default="wall")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--d", type=int, default=384, help="GPT width (default 384; GPT-2 small: 768)")
    parser.add_argument("--layers", type=int, default=6, help="GPT layers (default 6; GPT-2 small: 12)")
    parser.add_argument("--first-step-of", choices=list(FIRST_STEP), help=argparse.SUPPRESS)  # a subprocess's job
    args = parser.parse_args()
    setup_threads(args.threads)
    if args.first_step_of:
        print(json.dumps(first_step_times(args.first_step_of, args)))
        return
    print(f"# bench_step: {machine()}; clock={args.clock}, median of {args.rounds} interleaved rounds")
    shapes = gpt_shapes(args.d, args.layers)
    grads = [conditioned(s, seed=i) for i, s in enumerate(shapes)]
    run_set(f"GPT set: {args.layers} layers, d={args.d} ({len(shapes)} matrices)", shapes, grads, args)
    experts = conditioned((64, 256, 176), seed=99)
    run_set(
        "64 experts, one (64, 256, 176) weight (torch.optim.Muon: 64 2-D params, looped)",
        [tuple(experts.shape)], [experts], args,
        torch_shapes=[tuple(experts.shape[1:])] * 64, torch_grads=list(experts),
    )
    first_step(args)
    ns_rate(args)


if __name__ == "__main__":
    main()
