"""The tuning sweep behind the ``default`` preset's learning rates and warm-ups.

    python benchmarks/sweep_default.py --out out/sweep-default     # hours on 2 shared cores

Runs `muonclip.app.sweep.tune` on the ``default`` preset from the rates it had before tuning
(AdamW 6e-3, Muon 2e-2, warm-up 20), 2 runs at a time with one thread each:

* AdamW at warm-ups 20, 50, 100 (then 200, the warm-up being bracketed too), Muon at 20 and 50,
  2 tuning seeds per point (1000, 1001), 5-point grids sqrt(2) apart, extended while the best
  is at an edge;
* AdamW again at 1.5x, 2x and 3x the tokens at its best warm-up, 1 tuning seed per point (the
  compute these longer runs take on a shared 2-core machine did not fit 2).

Finished runs in ``--out`` are reused, so a stopped sweep goes on where it stopped. It writes
``sweep.md`` and ``sweep.json`` (every point) and prints the ``--set`` arguments of the tuned
values, which are the preset's defaults (`muonclip.app.config`); docs/compare.md lists every point.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from muonclip.app.config import make_config
from muonclip.app.data import load_corpus
from muonclip.app.sweep import tune

START = ["lr_adamw=6e-3", "lr_muon=2e-2", "lr_muonclip=2e-2", "warmup_steps=20", "warmup_adamw=none",
         "warmup_muon=none", "warmup_muonclip=none"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="out/sweep-default", help="folder of the runs (reused if it holds some)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2)")
    args = parser.parse_args()
    cfg = make_config("default", {"threads": 1, "eval_every": 100000, "checkpoint_every": 100000}, START)
    corpus = load_corpus(cfg.data, cfg.val_fraction)
    tuned = tune(cfg, Path(args.out), corpus, warmups={"adamw": [20, 50, 100], "muon": [20, 50]}, seeds=2,
                 budget_seeds=1, budgets=(1.0, 1.5, 2.0, 3.0), jobs=args.jobs, progress=True)
    print("tuned: " + " ".join(f"--set {s}" for s in tuned.sets()))


if __name__ == "__main__":
    main()
