"""One Muon step of two source trees, alternated in one run: does a change keep the step's speed?

Each tree is a ``src`` folder holding a ``muonclip`` package (e.g. main's checkout and a
branch's). Every round, each tree's step is timed in a fresh process that imports that tree
(``PYTHONPATH``), the trees in a shuffled order each round, so that load from other processes
on a shared machine hits both alike. For each parameter set of `bench_step.py` (the GPT set and
the 64-expert set) a process builds ``muonclip.Muon`` with the given workspace (default:
``Muon``'s own default; the keyword ``backend`` in a tree from before it was named so) over the
set's weights and fixed gradients, takes ``--warmup`` steps, then times ``--steps`` steps and
reports their median. ``--clock process`` (the default, with
``--threads 1``) counts the CPU time of the process, which other processes on a shared machine
barely change; ``wall`` counts wall time.

Reported per set: each tree's median over rounds (and the range of its round medians), and
the ratio of the second tree to the first, per round (paired: the two processes of a round ran
back to back), as median, 25th and 75th percentile, min and max; and each tree's minor page
faults a timed step (``getrusage``: pages the kernel mapped in, e.g. for buffers allocated
afresh), median over rounds.

Usage: ``python benchmarks/bench_trees.py --tree main=/path/to/main/src --tree mine=src
[--rounds 10] [--steps 3] [--warmup 1] [--threads 1] [--clock process|wall] [--workspace auto|core]
[--orth-dtype default|float32|bfloat16]``.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SETS = ("gpt", "experts")


def worker(args: argparse.Namespace) -> None:
    """In a fresh process importing one tree: the median step time of each set (seconds), and its
    minor page faults a timed step."""
    import resource

    import torch
    from bench_ortho import conditioned
    from step_sets import LR, WD, gpt_shapes, make_params
    from timing import CLOCKS, setup_threads

    import muonclip

    setup_threads(args.threads)
    tick = CLOCKS[args.clock]
    experts = conditioned((64, 256, 176), seed=99)
    sets = {"gpt": (gpt_shapes(), [conditioned(s, seed=i) for i, s in enumerate(gpt_shapes())]),
            "experts": ([tuple(experts.shape)], [experts])}
    key = "workspace" if "workspace" in inspect.signature(muonclip.Muon).parameters else "backend"  # its older name
    kw = {} if args.workspace == "auto" else {key: args.workspace}
    if args.orth_dtype != "default":
        kw["orth_dtype"] = getattr(torch, args.orth_dtype)
    out = {"file": muonclip.__file__}
    for name, (shapes, grads) in sets.items():
        opt = muonclip.Muon(make_params(shapes, grads, "cpu"), lr=LR, weight_decay=WD, **kw)
        for _ in range(args.warmup):
            opt.step()
        times = []
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(args.steps):
            t0 = tick()
            opt.step()
            times.append(tick() - t0)
        out[name] = statistics.median(times)
        out[name + ".faults"] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / args.steps
    print(json.dumps(out))


def quantiles(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return f"{q[1]:.3f} (IQR {q[0]:.3f}-{q[2]:.3f}, range {min(xs):.3f}-{max(xs):.3f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", default=[], help="NAME=PATH of a src folder (two of them)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("process", "wall"), default="process")
    parser.add_argument("--workspace", default="auto", help="Muon's workspace ('backend' in a tree before the name)")
    parser.add_argument("--orth-dtype", default="default", choices=("default", "float32", "bfloat16"),
                        help="Muon's orth_dtype (default: the tree's own default)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    trees = dict(t.split("=", 1) for t in args.tree)
    if len(trees) != 2:
        parser.error("give two trees: --tree NAME=PATH --tree NAME=PATH")
    from timing import machine, setup_threads

    setup_threads(args.threads)
    print(f"# bench_trees: {machine()}; clock={args.clock}, workspace={args.workspace!r}, "
          f"orth_dtype={args.orth_dtype}, {args.rounds} rounds, median of {args.steps} steps after {args.warmup} "
          f"per process; trees {trees}")
    names = list(trees)
    got: dict[str, dict[str, list[float]]] = {s: {n: [] for n in names} for s in SETS}
    faults: dict[str, dict[str, list[float]]] = {s: {n: [] for n in names} for s in SETS}
    order = random.Random(0)
    for r in range(args.rounds):
        for name in order.sample(names, len(names)):
            env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(trees[name]).resolve()), str(HERE)])}
            cmd = [sys.executable, __file__, "--worker", "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--threads", str(args.threads), "--clock", args.clock, "--workspace", args.workspace,
                   "--orth-dtype", args.orth_dtype]
            out = json.loads(subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
                             .stdout.splitlines()[-1])
            if not out["file"].startswith(str(Path(trees[name]).resolve())):
                raise RuntimeError(f"tree {name} imported muonclip from {out['file']}")
            for s in SETS:
                got[s][name].append(out[s])
                faults[s][name].append(out[s + ".faults"])
        print(f"round {r + 1}: " + "; ".join(f"{s} " + ", ".join(f"{n} {got[s][n][-1] * 1e3:.1f} ms" for n in names)
                                            for s in SETS), flush=True)
    a, b = names
    print(f"\n| set | {a} ms | {b} ms | {b} / {a} per round: median (IQR, range) |")
    print("|---|---|---|---|")
    for s in SETS:
        ratios = [y / x for x, y in zip(got[s][a], got[s][b])]
        print(f"| {s} | {statistics.median(got[s][a]) * 1e3:.1f} ({min(got[s][a]) * 1e3:.1f}-"
              f"{max(got[s][a]) * 1e3:.1f}) | {statistics.median(got[s][b]) * 1e3:.1f} "
              f"({min(got[s][b]) * 1e3:.1f}-{max(got[s][b]) * 1e3:.1f}) | {quantiles(ratios)} |")
    print(f"\n| set | {a}: minor page faults a step (median) | {b} |")
    print("|---|---|---|")
    for s in SETS:
        print(f"| {s} | {statistics.median(faults[s][a]):.0f} | {statistics.median(faults[s][b]):.0f} |")


if __name__ == "__main__":
    main()
