"""What ``muonclip train --resume`` continues, and what it may change on the way.

A resume continues the run in ``--out`` with the config its checkpoint was trained with. Each
config field may be overridden on the command line (``--steps``, ``--lr``, ``--tau``,
``--set key=value``...) or not, by one rule per field:

* **fixed** (`FIXED_FIELDS`, `why_fixed`): the fields that make the run what it is — the
  model's shape (`muonclip.app.config.SHAPE_FIELDS`), the seed (initial weights, batch order),
  the data (``data``, ``val_fraction``, and the text itself, by its SHA-256) and the batch size.
  Changing one would train another run from this one's state; it is refused (exit code 2) with
  the field, the checkpoint's value and the value asked for. So is another ``--optimizer``.
* **applied** (every other field): the new value is used from the first resumed step on,
  everywhere it acts: the schedule (``steps``, the peak rates, warm-ups, ``min_lr_ratio``),
  ``grad_clip``, and the optimizer's own hyperparameters (``weight_decay``, ``orth_dtype``,
  MuonClip's ``tau``), which the loaded optimizer state would otherwise bring back from the
  checkpoint (`apply_hyperparameters` sets them again after the load); the bookkeeping
  (``eval_every``, ``checkpoint_every``, ``threads``, ...) too.

Every applied change is recorded: ``config.json`` and the checkpoint pointer hold the config in
force and, in ``run.history``, each resume that changed something (its step, each field's old
and new value). ``config.json`` is written only once the checkpoint has been verified and
loaded, so it never describes a run that did not happen.

A checkpoint that is not this folder's run (copied in from another run) is refused with what
differs (`check_same_run`): the run id, the optimizer, the fixed fields.

**A run that never checkpointed** (killed, pre-empted or stopped by a bad step before its first
checkpoint: ``config.json`` and perhaps some metrics, no ``checkpoint.json``) restarts from step 0
on ``--resume``, with its own config (``config.json``, under the same rules: fixed fields stay,
the others may change) and its own identity; nothing of it was saved, so nothing is kept: its
metrics start again. A run whose metrics go past its first checkpoint's step did checkpoint:
its checkpoint is missing, and it stays refused (`check_restart`). So is a folder whose
``checkpoint.json`` names a checkpoint that is gone (`muonclip.app.checkpoints.verify`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .config import SHAPE_FIELDS, RunConfig
from .metrics import read_rows
from .runfolder import POINTER
from .safe_files import OutputError

FIXED_FIELDS: tuple[str, ...] = (*SHAPE_FIELDS, "seed", "data", "val_fraction", "batch_size")
"""Config fields a resume may not change."""


def why_fixed(name: str) -> str:
    """Why field ``name`` of `FIXED_FIELDS` cannot change on resume (for the message)."""
    if name in SHAPE_FIELDS:
        return "it fixes the model's shape"
    return {"seed": "it fixes the initial weights and the order of the batches",
            "data": "it is the training text", "val_fraction": "it fixes the training and validation text",
            "batch_size": "it fixes the batches"}[name]


def changes(saved: dict[str, Any], cfg: RunConfig) -> dict[str, list[Any]]:
    """``{field: [checkpoint value, new value]}`` for every field of ``cfg`` that differs from the
    checkpoint's config ``saved`` (JSON: tuples as lists; ``preset`` is not a setting)."""
    new = cfg.to_dict()
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    return {k: [saved.get(k), norm(v)] for k, v in new.items()
            if k != "preset" and norm(saved.get(k)) != norm(v)}


def check_changes(changed: dict[str, list[Any]], saved_optimizer: str, optimizer: str, where: str) -> None:
    """Raise ValueError, naming each, if ``changed`` (`changes`) touches a fixed field or the
    optimizer differs from the checkpoint's."""
    if optimizer != saved_optimizer:
        raise ValueError(f"{where} was written by a '{saved_optimizer}' run, this run uses '{optimizer}'; a resume "
                         f"continues the run's own optimizer (use --optimizer {saved_optimizer}, or another --out)")
    fixed = [k for k in FIXED_FIELDS if k in changed]
    if fixed:
        said = "; ".join(f"{k}: checkpoint {changed[k][0]!r}, asked {changed[k][1]!r} ({why_fixed(k)})"
                         for k in fixed)
        raise ValueError(f"--resume cannot change {', '.join(fixed)} ({said}); it would train another run from "
                         "this one's state: start a new run in another --out instead")


def check_same_run(config_json: dict[str, Any] | None, saved_optimizer: str, saved: dict[str, Any],
                   run_id: str, where: str) -> None:
    """Raise ValueError unless the checkpoint (``saved_optimizer``, its config ``saved``, its run
    id) belongs to the run that ``config.json`` (``config_json``; None: absent, nothing to
    compare) describes; the message lists what differs."""
    if config_json is None:
        return
    diffs = []
    own = config_json.get("run") if isinstance(config_json.get("run"), dict) else {}
    if own.get("id") != run_id:
        diffs.append(f"run id {run_id} vs {own.get('id')}")
    if config_json.get("optimizer") != saved_optimizer:
        diffs.append(f"optimizer {saved_optimizer!r} vs {config_json.get('optimizer')!r}")
    norm = lambda v: list(v) if isinstance(v, tuple) else v  # noqa: E731
    diffs += [f"{k} {saved.get(k)!r} vs {config_json.get(k)!r}" for k in FIXED_FIELDS
              if norm(saved.get(k)) != norm(config_json.get(k))]
    if diffs:
        raise ValueError(f"{where} is not this folder's run: checkpoint vs config.json: {'; '.join(diffs)}. It "
                         "was copied from another run; put back this run's checkpoint, or resume the other run "
                         "in its own folder")


def first_checkpoint(cfg: RunConfig) -> int:
    """The step of a run's first checkpoint: ``checkpoint_every``, or the last step if sooner."""
    return min(cfg.checkpoint_every, cfg.steps)


def check_restart(run_dir: str | Path, cfg: RunConfig) -> int:
    """Raise `muonclip.app.safe_files.OutputError` unless the run of ``run_dir`` (no
    ``checkpoint.json``; ``cfg``: its ``config.json``'s config) never reached its first checkpoint:
    its metrics (``metrics.jsonl``, which is on disk before every checkpoint is written) hold no
    step past `first_checkpoint`. Returns how many steps it logged (its restart drops them)."""
    steps = [r["step"] for r in read_rows(run_dir)]
    first = first_checkpoint(cfg)
    if any(s > first for s in steps):
        raise OutputError(f"--out {run_dir} holds a run whose checkpoint ({POINTER}) is missing: its metrics go to "
                          f"step {max(steps)}, past its first checkpoint (step {first}); it cannot be continued: "
                          "start a new run in another --out")
    return len(steps)


def group_hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Every param group's hyperparameters (everything but ``params``), as built from the config."""
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def apply_hyperparameters(optimizer: torch.optim.Optimizer, built: list[dict[str, Any]], cfg: RunConfig) -> None:
    """After ``optimizer.load_state_dict``: set every group's hyperparameters back to ``built``
    (`group_hyperparameters` of the optimizer as the config made it, before the load), and
    MuonClip's ``tau`` to ``cfg.tau``, so that the config in force is the one that acts. With an
    unchanged config this sets the values the checkpoint held."""
    if len(built) != len(optimizer.param_groups):
        raise ValueError(f"the optimizer has {len(optimizer.param_groups)} param groups, built {len(built)}")
    for group, values in zip(optimizer.param_groups, built):
        group.update(values)
    if hasattr(optimizer, "tau"):
        optimizer.tau = cfg.tau
