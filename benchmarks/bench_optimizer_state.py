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

Usage: ``python benchmarks/bench_optimizer_state.py [--sets n_layer=4,n_embd=256] [--optimizers adamw,muon]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

OPTIMIZERS = ("adamw", "muon", "muon_8bit", "normuon")

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
opt = build_optimizer(optimizer, model, cfg)
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


def measure(optimizer: str, sets: str) -> dict:
    run = subprocess.run([sys.executable, "-c", STEP, optimizer, sets], capture_output=True, text=True, check=True,
                         timeout=1800)
    return json.loads(run.stdout.strip().splitlines()[-1])


def main() -> None:
    from timing import machine

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default="n_layer=4,n_embd=256,batch_size=8")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    args = ap.parse_args()
    mib = 2**20
    print(f"# {machine()}; settings over the default preset: {args.sets}")
    print("| optimizer | state bytes / parameter (whole model) | state bytes / element (hidden matrices) "
          "| optimizer state (MiB) | peak RSS of 3 steps over the resident set before (MiB) "
          "| of which the optimizer step's own rise, largest of 3 (MiB) |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for o in args.optimizers.split(","):
        r = rows[o] = measure(o, args.sets)
        print(f"| {o} | {r['state'] / r['params']:.3f} | {r['hidden_state'] / r['hidden_params']:.3f} "
              f"| {r['state'] / mib:.2f} | {r['peak'] / mib:.1f} | {r['step_rise'] / mib:.1f} |", flush=True)
    r = next(iter(rows.values()))
    print(f"\n{r['params'] / 1e6:.2f}M parameters, {r['hidden_params'] / 1e6:.2f}M in hidden matrices")


if __name__ == "__main__":
    main()
