"""Tune the learning rates of Muon's variants (NorMuon, cautious weight decay, 8-bit momentum) with
`muonclip compare --sweep`'s protocol (`muonclip.app.sweep.tune`: a 5-point log grid sqrt 2 apart
centred on the preset's rate, extended while the best is at an edge, 2 tuning seeds per point, the
config's warm-up), on the ``default`` preset, and print the values as ``--set`` arguments.

The variants' defaults in `muonclip.app.config` are this script's output (docs/compare.md names the
machine and date). Usage::

    python benchmarks/tune_muon_variants.py --out out/tune-variants [--jobs 2] [--optimizers normuon,...]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from muonclip.app.config import make_config
from muonclip.app.data import load_corpus
from muonclip.app.sweep import tune


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--optimizers", default="normuon,muon_cautious,muon_8bit")
    args = ap.parse_args()
    cfg = make_config("default", {"threads": 1})
    corpus = load_corpus(cfg.data, cfg.val_fraction)
    tuned = tune(cfg, Path(args.out), corpus, optimizers=args.optimizers.split(","), seeds=args.seeds,
                 jobs=args.jobs, progress=False)
    for o, lr in tuned.lr.items():
        print(f"--set lr_{o}={lr:.4g} --set warmup_{o}={tuned.warmup[o]}")
    for note in tuned.notes:
        print("note:", note)


if __name__ == "__main__":
    main()
