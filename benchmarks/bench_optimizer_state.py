"""Optimizer-state memory of AdamW, Muon, Muon with 8-bit momentum and NorMuon: bytes per parameter
counted exactly from the state dict, and the peak RSS of a training step.

For the reference GPT of ``muonclip train`` with the settings below (``--set`` syntax over the
``default`` preset), each optimizer as `muonclip.app.model.build_optimizer` builds it:

* **state bytes per parameter**: after two steps, the sum of ``nbytes`` of every tensor in
  ``optimizer.state_dict()["state"]`` (step counters included), over the model's parameter
  count; and the same over the hidden matrices only (the parameters Muon updates), where the
  momentum format shows alone (4 bytes per element float32; 1 + 4/256 for 8-bit);
* **peak RSS of a step**: a fresh process builds the model, the optimizer and the batches, then
  runs three steps (the state is created in the first) and reports the peak resident set over the
  resident set before them, read from the high-water mark (Linux ``/proc/self/clear_refs`` resets
  it before each forward/backward and each optimizer step; the peak is the highest of those
  marks). It counts the gradients, activations and the state; it depends on the machine's
  allocator and kernels, and on what else runs (the figures in docs/compare.md name the machine);
* **the optimizer step's own rise**: the largest, over the three steps, of the high-water mark
  during ``optimizer.step()`` over the resident set just before it: the step's new state and
  temporaries beyond the memory the allocator already holds (freed activations are reused).

Each run is measured under two allocator settings, each in its own process:

* **glibc's defaults**, what a training process gets. Freed activations stay in glibc's heap
  (its mmap threshold rises to the largest block freed), so the resident set is about twice the
  memory in use, and where the state and the next pass's activations land in that heap varies
  from run to run (tens of MiB on the machine of docs/benchmarks.md, for every optimizer alike);
* **live**: ``MALLOC_MMAP_THRESHOLD_=131072`` (glibc's initial threshold, fixed): every block of
  128 KiB or more is a mapping of its own, returned to the system when freed, so the resident
  set follows the memory in use, the same in every run to 0.1 MiB. This is what the optimizer
  itself costs, free of where the allocator placed it.

Besides the app's optimizers, ``torch_muon``: torch.optim.Muon on the hidden matrices (each 2-D
weight one matrix, bfloat16) with torch.optim.AdamW on the rest, as a torch user pairs them.

Each optimizer is measured ``--runs`` times (default 3), the runs interleaved (run 1 of every
optimizer, then run 2...), each in a fresh process; the table shows every run, then the range of
each optimizer's peak and step rise, whether Muon's peak is below AdamW's by at least half
their state difference in every run and in the median, and whether 8-bit Muon's is below both
(the goals of docs/benchmarks.md's memory rows), under each allocator setting.

Usage: ``python benchmarks/bench_optimizer_state.py [--sets n_layer=4,n_embd=256] [--optimizers adamw,muon]
[--runs 3]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

OPTIMIZERS = ("adamw", "muon", "muon_8bit", "normuon", "torch_muon")

STEP = """
import json, sys
import torch
from muonclip.app.config import make_config
from muonclip.app.data import load_corpus, train_batch
from muonclip.app.model import build_model, build_optimizer
from muonclip.app.train import forward_loss


def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))


torch.set_num_threads(1)
optimizer, sets = sys.argv[1:3]
cfg = make_config("default", sets=[s for s in sets.split(",") if s])
corpus = load_corpus(None)
model = build_model(cfg)


class TorchPair:  # torch.optim.Muon on the hidden matrices, torch.optim.AdamW on the rest, stepped together

    def __init__(self, model):
        from muonclip.app.model import hidden_matrices
        hidden = {id(p) for p in hidden_matrices(model)}
        self.muon = torch.optim.Muon([p for p in model.parameters() if id(p) in hidden], lr=cfg.lr_muon,
                                     weight_decay=cfg.weight_decay)
        self.adamw = torch.optim.AdamW([p for p in model.parameters() if id(p) not in hidden], lr=cfg.lr_adamw,
                                       betas=(0.9, 0.95))
        self.param_groups = self.muon.param_groups + self.adamw.param_groups

    def zero_grad(self, set_to_none=True):
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def step(self):
        self.muon.step()
        self.adamw.step()

    def state_dict(self):
        a, b = self.muon.state_dict()["state"], self.adamw.state_dict()["state"]
        n = len(self.muon.param_groups[0]["params"])
        return {"state": {**a, **{n + k: v for k, v in b.items()}}}


opt = TorchPair(model) if optimizer == "torch_muon" else build_optimizer(optimizer, model, cfg)
batches = [train_batch(corpus, s, batch_size=cfg.batch_size, block_size=cfg.block_size, seed=0) for s in range(3)]
def reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")


before = reset_peak()
highest, step_rise = 0, 0
for x, y in batches:
    opt.zero_grad(set_to_none=True)
    reset_peak()
    forward_loss(model, x, y).backward()
    highest = max(highest, status("VmHWM"))
    start = reset_peak()
    opt.step()
    highest = max(highest, status("VmHWM"))
    step_rise = max(step_rise, status("VmHWM") - start)
peak = highest - before
sd = opt.state_dict()["state"]
state = sum(v.nbytes for entry in sd.values() for v in entry.values() if torch.is_tensor(v))
params = sum(p.numel() for p in model.parameters())
from muonclip.app.model import hidden_matrices
hidden = {id(p) for p in hidden_matrices(model)}
ids = {i: p for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}
hidden_state = sum(v.nbytes for i, entry in sd.items() if id(ids[i]) in hidden for v in entry.values()
                   if torch.is_tensor(v))
hidden_params = sum(p.numel() for p in hidden_matrices(model))
print(json.dumps({"params": params, "state": state, "hidden_params": hidden_params, "hidden_state": hidden_state,
                  "peak": peak, "step_rise": step_rise}))
"""


ALLOCATORS = {"default": {}, "live": {"MALLOC_MMAP_THRESHOLD_": "131072"}}
"""Allocator setting -> environment of the measuring process (module docstring)."""


def measure(optimizer: str, sets: str, allocator: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")} | ALLOCATORS[allocator]
    run = subprocess.run([sys.executable, "-c", STEP, optimizer, sets], capture_output=True, text=True, check=True,
                         timeout=1800, env=env)
    return json.loads(run.stdout.strip().splitlines()[-1])


def verdicts(rows: dict[str, list[dict]], label: str) -> None:
    """The goals of the memory rows, on the peaks of ``rows`` (one allocator setting)."""
    mib = 2**20
    if "adamw" in rows and "muon" in rows:
        half = (rows["adamw"][0]["state"] - rows["muon"][0]["state"]) / 2 / mib
        gaps = [(a["peak"] - m["peak"]) / mib for a, m in zip(rows["adamw"], rows["muon"])]
        median = statistics.median(r["peak"] for r in rows["adamw"]) - statistics.median(r["peak"]
                                                                                      for r in rows["muon"])
        print(f"{label}: AdamW's peak minus Muon's, per run: {', '.join(f'{g:.0f}' for g in gaps)} MiB, of the "
              f"medians {median / mib:.0f} MiB; half the state difference: {half:.0f} MiB; Muon below AdamW by at "
              f"least that in every run: {'yes' if min(gaps) >= half else 'no'}, in the medians: "
              f"{'yes' if median / mib >= half else 'no'}")
    if {"adamw", "muon", "muon_8bit"} <= set(rows):
        lower = all(e["peak"] < min(a["peak"], m["peak"]) for a, m, e in zip(rows["adamw"], rows["muon"],
                                                                             rows["muon_8bit"]))
        print(f"{label}: Muon 8-bit's peak below both AdamW's and Muon's in every run: {'yes' if lower else 'no'}")


def main() -> None:
    from timing import machine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="n_layer=4,n_embd=256,batch_size=8")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    mib = 2**20
    names = args.optimizers.split(",")
    print(f"# {machine()}; settings over the default preset: {args.sets}; {args.runs} runs each, interleaved; "
          f"peaks under glibc's defaults and live (MALLOC_MMAP_THRESHOLD_=131072), each in its own process")
    print("| optimizer | run | state bytes / parameter (whole model) | state bytes / element (hidden matrices) "
          "| optimizer state (MiB) | peak RSS of 3 steps over the resident set before (MiB), glibc defaults "
          "| the same, live | the optimizer step's own rise, largest of 3 (MiB), glibc defaults / live |")
    print("|---|---|---|---|---|---|---|---|")
    rows: dict[str, dict[str, list[dict]]] = {a: {o: [] for o in names} for a in ALLOCATORS}
    for run in range(1, args.runs + 1):
        for o in names:
            r = {a: measure(o, args.sets, a) for a in ALLOCATORS}
            for a in ALLOCATORS:
                rows[a][o].append(r[a])
            d, live = r["default"], r["live"]
            print(f"| {o} | {run} | {d['state'] / d['params']:.3f} | {d['hidden_state'] / d['hidden_params']:.3f} "
                  f"| {d['state'] / mib:.2f} | {d['peak'] / mib:.1f} | {live['peak'] / mib:.1f} "
                  f"| {d['step_rise'] / mib:.1f} / {live['step_rise'] / mib:.1f} |", flush=True)
    print("\n| optimizer | state (MiB) | peak (MiB), glibc defaults: min–max (median) | peak, live: min–max "
          "| step rise (MiB), glibc defaults / live: min–max |")
    print("|---|---|---|---|---|")
    def span(rs: list[dict], key: str, fmt: str = ".0f") -> str:
        xs = [r[key] / mib for r in rs]
        return f"{min(xs):{fmt}}–{max(xs):{fmt}}"

    for o in names:
        d, live = rows["default"][o], rows["live"][o]
        median = statistics.median(r["peak"] for r in d) / mib
        print(f"| {o} | {d[0]['state'] / mib:.1f} | {span(d, 'peak')} ({median:.0f}) | {span(live, 'peak', '.1f')} "
              f"| {span(d, 'step_rise', '.1f')} / {span(live, 'step_rise', '.1f')} |")
    print()
    for a, label in (("default", "glibc defaults"), ("live", "live")):
        verdicts(rows[a], label)
    rows = rows["default"]
    r = rows[names[0]][0]
    print(f"\n{r['params'] / 1e6:.2f}M parameters, {r['hidden_params'] / 1e6:.2f}M in hidden matrices")


if __name__ == "__main__":
    main()
