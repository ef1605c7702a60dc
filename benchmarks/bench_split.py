"""One Muon step on a GPT-like set stored five ways: what splitting fused weights costs.

Per layer (``--layers`` of width ``d`` with ``d / 64`` heads): attention q, k, v, o (d x d)
and a gated MLP gate, up (4d x d) and down (d x 4d), stored as

* **separate**: every map its own parameter (the reference: what the fused forms must match);
* **fused, split**: ``qkv`` (3d x d, ``[q | k | v]``) and ``gate_up`` (8d x d) with
  ``split_sizes`` — what `muonclip.param_groups` sets for Phi-3-style weights;
* **fused, interleaved**: ``qkv`` stored per head ``[q k v]`` (GPT-NeoX) with
  ``split_sizes=[64, 64, 64], split_groups=heads``;
* **fused, whole**: the fused weights as one matrix each (``split_fused=False``; a different
  optimizer, shown for its cost only);
* **per-head**: separate storage, q/k/v cut into one block per head (``per_head=True``).

Printed: the median step time of each (interleaved rounds, `timing.round_robin`), its ratio to
**separate**, and the Newton–Schulz flops of one step (`muonclip.distributed._plan.ns_flops`,
exact). Fixed random gradients, float32 weights, default Muon (ns5, bf16).

Usage: ``python benchmarks/bench_split.py [--threads 2] [--rounds 9] [--clock wall|process]
[--d 256] [--layers 4]`` (a quiet machine, or ``--threads 1 --clock process``, for figures)
"""

from __future__ import annotations

import argparse

import torch
from timing import machine, round_robin, setup_threads

import muonclip

HEAD = 64


def layer_sets(d: int, layers: int) -> dict[str, list[dict]]:
    """name -> param-group specs ``{"shapes": [...], **options}`` for one step."""
    heads = d // HEAD
    plain = [(d, d)] * 4 + [(4 * d, d)] * 2 + [(d, 4 * d)]
    rest = [(d, d), (d, 4 * d)]  # o, down
    fused = [{"shapes": [(3 * d, d)], "split_sizes": [d] * 3}, {"shapes": [(8 * d, d)], "split_sizes": [4 * d] * 2},
             {"shapes": rest}]
    return {
        "separate": [{"shapes": plain * layers}],
        "fused, split": [{**g, "shapes": g["shapes"] * layers} for g in fused],
        "fused, interleaved": [{"shapes": [(3 * d, d)] * layers, "split_sizes": [HEAD] * 3, "split_groups": heads},
                               {"shapes": [(8 * d, d)] * layers, "split_sizes": [4 * d] * 2},
                               {"shapes": rest * layers}],
        "fused, whole": [{"shapes": [(3 * d, d), (8 * d, d)] * layers}, {"shapes": rest * layers}],
        "per-head": [{"shapes": [(d, d)] * 3 * layers, "split_sizes": [HEAD] * heads},
                     {"shapes": [(d, d), (4 * d, d), (4 * d, d), (d, 4 * d)] * layers}],
    }


def make_optimizer(groups: list[dict], seed: int = 0) -> muonclip.Muon:
    g = torch.Generator().manual_seed(seed)
    built = []
    for spec in groups:
        params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in spec["shapes"]]
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        built.append({"params": params, **{k: v for k, v in spec.items() if k != "shapes"}})
    return muonclip.Muon(built, lr=0.02, weight_decay=0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--clock", choices=["wall", "process"], default="wall")
    parser.add_argument("--d", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()
    setup_threads(args.threads)
    opts = {name: make_optimizer(groups) for name, groups in layer_sets(args.d, args.layers).items()}
    times = round_robin({name: opt.step for name, opt in opts.items()}, rounds=args.rounds, clock=args.clock)
    print(f"# One Muon step, d={args.d}, {args.layers} layers, heads of {HEAD} ({machine()}, {args.clock} clock)\n")
    print("| storage | step (ms) | vs separate | NS GFLOP / step |")
    print("|---|---|---|---|")
    base = times["separate"]
    for name, opt in opts.items():
        flops = opt.last_step_stats.total_ns_flops / 1e9
        print(f"| {name} | {1e3 * times[name]:.1f} | {times[name] / base:.2f}x | {flops:.2f} |")


if __name__ == "__main__":
    main()
