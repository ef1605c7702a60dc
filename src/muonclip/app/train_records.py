"""What a run of `muonclip train` records besides its checkpoints (`Records`): ``config.json``,
the metrics files (`muonclip.app.metrics`), the TensorBoard scalars, the progress bar; and
the per-layer max logits of a step's row (`read_max_logits`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..distributed._context import SINGLE, GroupContext
from ..qkclip.step_metrics import UpdateRMS
from .config import RunConfig
from .launch import all_max
from .metrics import MetricsWriter
from .model import hidden_matrices
from .probes import ExpertRMS, MLAClipAudit
from .runfolder import remove_leftovers, write_config
from .safe_files import OutputError
from .train_setup import Opened, Place, State


def read_max_logits(model: nn.Module, optimizer: torch.optim.Optimizer,
                    ctx: GroupContext = SINGLE) -> tuple[list[float], list[int]]:
    """Per-layer max logit of the step and per-layer count of clipped heads (0 without QK-Clip).

    Under torchrun, call on every rank: MuonClip's maxima are already reduced over the ranks;
    the model's own recorders (AdamW/Muon runs) saw only this rank's rows and are all-reduced
    with MAX here.
    """
    names = [f"blocks.{i}.attn" for i in range(len(model.attention_modules()))]
    clipped_map = {}
    if hasattr(optimizer, "last_max_logits"):
        logits_map = dict(optimizer.last_max_logits or {})
        clipped_map = dict(getattr(optimizer, "last_clipped", None) or {})
        model.pop_max_logits()  # nothing should be left; keep the recorders clean regardless
        reduce = False
    else:
        logits_map = model.pop_max_logits()
        reduce = True
    keys = names if all(k in logits_map for k in names) else list(logits_map)
    maxes = [float(logits_map[k].max()) for k in keys]
    if reduce:
        maxes = all_max(maxes, ctx)
    clipped = [int(clipped_map[k].sum()) if k in clipped_map else 0 for k in keys]
    return maxes, clipped


class Records:
    """What a run writes besides checkpoints, on rank 0: ``config.json``, the metrics files, the
    TensorBoard scalars, the progress bar (every rank: its meters).

    Args:
        run_dir, cfg, optimizer, place: the run.
        opened: the opened folder (`open_run_folder`).
        state: the built model and optimizer (`build_state`).
        tensorboard: a TensorBoard folder (default None).
        progress: show the progress bar (default True).
        label: its label (default: the optimizer's name).

    Raises:
        OutputError: ``config.json`` or the metrics cannot be written.
        ValueError: TensorBoard is asked for but not installed.
    """

    def __init__(self, run_dir: Path, cfg: RunConfig, optimizer: str, place: Place, opened: Opened, state: State,
                 *, tensorboard: str | Path | None, progress: bool, label: str | None) -> None:
        self.writer: MetricsWriter | None = None
        self.tb: Any = None
        start, resume = state.start, opened.found is not None
        if place.main:
            if tensorboard is not None:
                from ..integrations.tensorboard import TensorBoardWriter

                try:  # a restart drops what the run logged before, as its metrics
                    self.tb = TensorBoardWriter(tensorboard, purge_step=start + 1 if resume or opened.restart else None)
                except ImportError as e:
                    raise ValueError(f"--tensorboard: {e}") from None
            try:
                remove_leftovers(run_dir, keep=opened.found.name if opened.found else None)
                write_config(run_dir, optimizer, cfg.to_dict(), opened.identity.to_dict(), token=opened.token)
                self.writer = MetricsWriter(run_dir, cfg.n_layer, keep_until=start if resume else None,
                                            token=opened.token)
            except OSError as e:
                raise OutputError(f"--out {run_dir}: cannot write {e.filename or 'a file'} ({e.strerror or e}); "
                                  "free space or choose another --out") from None
        model, opt = state.model, state.opt
        self.rms = UpdateRMS(opt, params=hidden_matrices(model))
        # one process: per-expert update RMS (3-D expert stacks) and the factors of each clipped MLA head
        one = not place.active
        self.experts = ExpertRMS(opt, model) if one and any(p.ndim == 3 for p in model.parameters()) else None
        self.audit = MLAClipAudit(opt, model) if one else None
        self.bar = progress_bar(label or optimizer, cfg.steps, start, cfg.batch_size * cfg.block_size,
                                enabled=progress and place.main)

    def write(self, row: dict[str, Any], last_val_loss: float | None) -> None:
        """Record one step's row (metrics files, TensorBoard, the progress bar).

        Raises:
            OutputError: the metrics cannot be written (e.g. a full disk).
        """
        if self.writer is not None:
            try:
                self.writer.write(row)
            except OSError as e:
                raise OutputError(f"--out {self.writer.dir}: cannot write the metrics of step {row['step']} "
                                  f"({e.strerror or e}); the last checkpoint is intact: free space and continue "
                                  "with --resume") from None
        if self.tb is not None:
            self.tb.write(row)
        shown = f"loss {row['loss']:.4f}"
        if last_val_loss is not None:
            shown += f", val {last_val_loss:.4f}"
        self.bar.set_postfix_str(shown, refresh=False)
        self.bar.update(1)

    def sync(self) -> None:
        """The metrics on disk (before a checkpoint)."""
        if self.writer is not None:
            self.writer.sync()

    def close(self) -> None:
        self.bar.close()
        if self.writer is not None:
            self.writer.close()
        if self.tb is not None:
            self.tb.close()


def progress_bar(label: str, total: int, start: int, tokens_per_step: int, *, enabled: bool) -> Any:
    """A tqdm bar of a run on stderr: tokens done of the run's total, the last losses, tokens/s and
    the ETA (``disable`` when not ``enabled``; ``update(1)`` per step). On a terminal it redraws in
    place; in a log file or CI it writes at most every 30 s."""
    from tqdm import tqdm

    tty = sys.stderr.isatty()
    return tqdm(total=total, initial=start, desc=label, unit="tok", unit_scale=tokens_per_step, disable=not enabled,
                file=sys.stderr, dynamic_ncols=tty, mininterval=0.1 if tty else 30.0, leave=True,
                bar_format="{desc}: {n_fmt}/{total_fmt} [{bar:20}] {percentage:3.0f}% | {postfix} | {rate_fmt} "
                           "| ETA {remaining}")
