"""The `muonclip compare` training step under the kernels of another CPU kind, on this machine.

A CPU's instruction set decides which kernels torch runs: ATen's vectorised loops
(``ATEN_CPU_CAPABILITY``), oneDNN's (``ONEDNN_MAX_CPU_ISA``) and MKL's (``MKL_ENABLE_INSTRUCTIONS``),
and which dtype ``orth_dtype="auto"`` picks (``MUONCLIP_CPU_BF16``). This script holds them to a
kind's (``native``: this CPU's own; ``avx2``: an AVX2-only CPU without bfloat16 instructions, such
as an AMD EPYC Zen 3) and times the compare model's step (`muonclip.app.config.make_config`'s
``default`` preset: forward, backward and the optimizer step, each apart) for AdamW, Muon and
MuonClip. Every round starts one fresh process per kind (the variables take effect at start-up),
in a shuffled order, each timing ``--steps`` steps after ``--warmup`` with 1 thread and process CPU
time; reported: each kind's median over rounds, and the ratio of each kind's whole step to the
first kind's, per round (median, min, max).

What it cannot hold to another kind: the cores' speed, the caches' sizes and MKL's choice of code
path by the CPU's vendor. A gap between a kind's real figures and this script's is theirs.

Usage: ``python benchmarks/bench_kinds.py [--kinds native,avx2] [--rounds 5] [--steps 20]
[--warmup 5] [--optimizers adamw,muon,muonclip]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys

KINDS = {
    "native": {},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
             "MUONCLIP_CPU_BF16": "0"},
}
"""The environment of each kind (added to this one's)."""

CHILD = """
import json, statistics, sys, time, torch
torch.set_num_threads(1)
from muonclip.app.config import make_config
from muonclip.app.model import build_model, build_optimizer, orthogonalisation
from muonclip.app.train import forward_loss
cfg = make_config("default")
steps, warmup, names = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(",")
g = torch.Generator().manual_seed(0)
x = torch.randint(0, 256, (cfg.batch_size, cfg.block_size), generator=g)
y = torch.randint(0, 256, (cfg.batch_size, cfg.block_size), generator=g)
out = {"capability": torch.backends.cpu.get_cpu_capability(), "orthogonalisation": orthogonalisation(cfg)}
for name in names:
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = build_optimizer(name, model, cfg)
    times = {"forward": [], "backward": [], "step": []}
    for i in range(warmup + steps):
        t0 = time.process_time(); loss = forward_loss(model, x, y)
        t1 = time.process_time(); loss.backward()
        t2 = time.process_time(); opt.step(); opt.zero_grad()
        t3 = time.process_time()
        if i >= warmup:
            for k, t in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(t)
    out[name] = {k: statistics.median(v) * 1e3 for k, v in times.items()}
print(json.dumps(out))
"""


def run_kind(kind: str, steps: int, warmup: int, optimizers: str) -> dict:
    env = {**os.environ, **KINDS[kind], "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(steps), str(warmup), optimizers], env=env,
                          capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"the {kind} process failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kinds", default="native,avx2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--optimizers", default="adamw,muon,muonclip")
    args = ap.parse_args(argv)
    kinds, names = args.kinds.split(","), args.optimizers.split(",")
    results: dict[str, list[dict]] = {k: [] for k in kinds}
    order = list(kinds)
    for _ in range(args.rounds):
        random.Random(len(results[kinds[0]])).shuffle(order)
        for kind in order:
            results[kind].append(run_kind(kind, args.steps, args.warmup, args.optimizers))
    first = kinds[0]
    from muonclip.common._hardware import cpu_matrix_instructions

    print(f"this CPU: {', '.join(cpu_matrix_instructions()) or 'none known'}; {args.rounds} rounds, "
          f"{args.steps} steps each, 1 thread, process CPU time (ms, median over rounds)")
    for kind in kinds:
        r = results[kind][0]
        print(f"\n{kind}: ATen {r['capability']}; orthogonalisation {r['orthogonalisation']}")
        for name in names:
            parts = {k: statistics.median(x[name][k] for x in results[kind]) for k in ("forward", "backward", "step")}
            whole = [sum(x[name].values()) / sum(y[name].values()) for x, y in zip(results[kind], results[first])]
            print(f"  {name:9s} forward {parts['forward']:6.1f}  backward {parts['backward']:6.1f}  "
                  f"step {parts['step']:6.1f}  whole / {first}'s: {statistics.median(whole):.2f} "
                  f"({min(whole):.2f}-{max(whole):.2f})")


if __name__ == "__main__":
    main()
