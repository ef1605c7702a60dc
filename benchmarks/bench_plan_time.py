"""``muonclip plan``'s time model against measured CPU optimizer steps, at three sizes.

For the reference GPT at three widths, in one process on this CPU: the Muon step's time that
``muonclip plan preset:... --device cpu`` predicts (a roofline over this machine's measured matmul
rates by size and copy rate, `muonclip.app.plan_time`), against measured steps
(random gradients, after two warm-up steps; the step's ``orth_dtype="auto"``): the fastest of
``--steps``, as the calibration takes the fastest of its runs (both the least disturbed by other
processes; on a quiet machine the median is within a few percent of it). Prints each ratio;
the goal is within 25%. The predicted side never times anything but the calibration.

    python benchmarks/bench_plan_time.py [--widths 256,512,1024] [--layers 4] [--steps 7] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from muonclip import Muon, param_groups
from muonclip.app.plan import make_plan
from muonclip.app.plan_cost import compute_dtype
from muonclip.app.plan_layout import Mesh
from muonclip.app.plan_model import route
from muonclip.app.plan_time import calibrate
from muonclip.models import GPT, GPTConfig


def measured(cfg: GPTConfig, steps: int) -> float:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = Muon(param_groups(model), lr=0.01)
    g = torch.Generator().manual_seed(1)
    times = []
    for s in range(steps + 2):
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=g)
        start = time.perf_counter()
        opt.step()
        if s >= 2:
            times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--widths", default="256,512,1024")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    device = None
    for width in [int(w) for w in args.widths.split(",")]:
        cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=args.layers, n_head=max(1, width // 64), n_embd=width)
        with torch.device("meta"):
            pm = route(GPT(cfg))
        if device is None:
            device = calibrate(compute_dtype(next(w.group for w in pm.weights if w.muon), "cpu"))
        plan = make_plan(pm, Mesh(), device, device_kind="cpu")
        predicted = plan["step"]["muon_seconds"]
        got = measured(cfg, args.steps)
        rows.append((width, plan["summary"]["ns_flops"]["max"], predicted, got))
    print(f"{device.name}: matmul " + ", ".join(f"{m}: {r / 1e9:.0f} GFLOP/s" for m, r in device.measured)
          + f"; copy {device.mem_bw / 1e9:.1f} GB/s; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| GPT width | layers | NS flops per step | predicted (model) | measured (fastest) | predicted / measured |")
    print("|---:|---:|---:|---:|---:|---:|")
    for width, flops, predicted, got in rows:
        print(f"| {width} | {args.layers} | {flops / 1e9:.1f} G | {predicted * 1e3:.1f} ms | {got * 1e3:.1f} ms | "
              f"{predicted / got:.2f} |")


if __name__ == "__main__":
    main()
