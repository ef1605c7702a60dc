"""The memory check's estimate (`muonclip.app.memory.step_memory`) against what a real step takes
on this machine: the peak RSS, and the peak of the tensors torch allocates.

For each config (the reference GPT of ``muonclip train``, one thread), two fresh processes run
what a run does before and during its first steps: read the built-in corpus, build the model,
the optimizer and the validation set, two training steps, a validation pass.

* the first measures the **peak RSS** this adds to the process (Linux: ``VmHWM`` reset with
  ``/proc/self/clear_refs`` after importing torch and one tiny matmul; elsewhere the peak
  ``ru_maxrss``). It depends on the machine: its BLAS and attention kernels, the libraries' code
  they touch, glibc's heap. The script prints the estimate over it, with and without the
  safety margin, and what the estimate's fixed part (`muonclip.app.memory.LIBRARY_BYTES`) would
  need to be for the estimate without margin to reach the peak;
* the second measures the **peak of live tensor bytes** torch allocates during the same work
  (the profiler's allocation events, summed in time order; the corpus is read before) and
  prints the tensors the estimate counts (parameters and state, activations, attention scores,
  the validation set) over it. That ratio does not depend on the machine's kernels; ``tests/test_memory.py``
  checks it.

Usage: ``python benchmarks/bench_memory.py`` (a few minutes: twelve fresh processes).
"""

from __future__ import annotations

import json
import subprocess
import sys

from muonclip.app import memory
from muonclip.app.config import make_config
from muonclip.app.data import corpus_size

# (optimizer, settings over the "default" preset): fused attention, MLA's T x T scores, experts,
# and steps from 8k to 32k tokens
CONFIGS = [
    ("muonclip", "block_size=512,batch_size=16,n_layer=2"),
    ("adamw", "block_size=512,batch_size=8,n_layer=2,attention=mla"),
    ("muon", "block_size=256,batch_size=16,attention=mla,n_head=4,n_expert=8,expert_hidden=64"),
    ("muonclip", "block_size=1024,batch_size=16,n_layer=2,n_embd=128"),
    ("adamw", "block_size=2048,batch_size=16,n_layer=4,n_embd=128"),
    ("muon", "block_size=1024,batch_size=8,n_layer=4,n_embd=128,attention=mla"),
]

STEPS = """
import json, sys
import torch
from muonclip.app.config import make_config
from muonclip.app.data import load_corpus, train_batch, val_batches
from muonclip.app.model import build_model, build_optimizer
from muonclip.app.train import evaluate, forward_loss


def status(key):
    try:
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))
    except OSError:
        return None


def reset_peak():  # the high-water mark set to the resident set now: only what follows counts
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak():
    import resource
    hwm = status("VmHWM") if reset else None
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def work(cfg, optimizer, corpus):
    model = build_model(cfg)
    opt = build_optimizer(optimizer, model, cfg)
    val = val_batches(corpus, n_batches=cfg.eval_batches, batch_size=cfg.batch_size, block_size=cfg.block_size)
    for step in range(2):
        x, y = train_batch(corpus, step, batch_size=cfg.batch_size, block_size=cfg.block_size, seed=0)
        opt.zero_grad(set_to_none=True)
        forward_loss(model, x, y).backward()
        opt.step()
    evaluate(model, val)


torch.set_num_threads(1)
what, optimizer, sets = sys.argv[1:4]
cfg = make_config("default", sets=sets.split(","))
torch.zeros(2, 2) @ torch.zeros(2, 2)
if what == "rss":
    reset = reset_peak()
    before = status("VmRSS") if reset else peak()
    work(cfg, optimizer, load_corpus(None))
    print(json.dumps(peak() - before))
else:
    from torch.profiler import ProfilerActivity, profile
    corpus = load_corpus(None)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work(cfg, optimizer, corpus)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = top = 0
    for _, nbytes in events:
        live += nbytes
        top = max(top, live)
    print(json.dumps(top))
"""


def measure(what: str, optimizer: str, sets: str) -> int:
    """Bytes measured by a fresh process (``what``: "rss" or "tensors")."""
    run = subprocess.run([sys.executable, "-c", STEPS, what, optimizer, sets], capture_output=True, text=True,
                         check=True, timeout=1200)
    return int(json.loads(run.stdout.strip().splitlines()[-1]))


def main() -> None:
    import torch
    from timing import machine

    torch.set_num_threads(1)
    mib = 2**20
    print(f"# {machine()}")
    print("| optimizer | settings | estimate (MiB) | peak RSS (MiB) | estimate / RSS | without margin / RSS "
          "| fixed part needed (MiB) | counted tensors (MiB) | peak tensors (MiB) | counted / peak tensors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for optimizer, sets in CONFIGS:
        cfg = make_config("default", sets=sets.split(","))
        est = memory.step_memory(cfg, optimizer, corpus=corpus_size(None))
        rss, tensors = measure("rss", optimizer, sets), measure("tensors", optimizer, sets)
        bare = est.total - est.margin
        counted = est.parameters + est.activations + est.attention_scores + est.validation
        needed = memory.LIBRARY_BYTES + rss - bare  # the fixed part with which bare = rss
        print(f"| {optimizer} | {sets} | {est.total / mib:.0f} | {rss / mib:.0f} | {est.total / rss:.2f} "
              f"| {bare / rss:.2f} | {needed / mib:.0f} | {counted / mib:.0f} | {tensors / mib:.0f} "
              f"| {counted / tensors:.2f} |", flush=True)


if __name__ == "__main__":
    main()
