"""Per-step metrics of a run, written as JSON lines (``metrics.jsonl``) and CSV (``metrics.csv``).

One row per optimizer step, flushed as it is written::

    step          steps done (1-based)          tokens      tokens seen so far
    loss          training loss of the step     val_loss    validation loss (only on eval steps)
    lr            learning rate of the step (the optimizer's own: Muon's for muon/muonclip)
    max_logit     largest per-head max logit over all layers in the step's forward pass
    max_logit_<i> per layer i                   clipped_heads / clipped_<i>: heads QK-Clip scaled
    max_logit_is_bound  1 when max_logit is an upper bound from the attention kernel's LSE, not the
                  exact max: MuonClip's gated capture records heads that stay at or below tau that
                  way (at most log(T) above the exact value); 0 when exact
    update_rms    RMS over all hidden-matrix elements of U = (W_before (1 - lr wd) - W_after) / lr,
                  before QK-Clip (`muonclip.integrations.UpdateRMS`; ~0.2 for Muon's rms scale)
    step_time     seconds of forward + backward + step   elapsed: wall seconds since start

In the JSONL file the per-layer values are lists (``max_logits``, ``clipped``). On resume the
rows after the checkpoint's step are dropped, so the files again describe one clean run.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

JSONL = "metrics.jsonl"
CSV = "metrics.csv"


def csv_columns(n_layer: int) -> list[str]:
    return (["step", "tokens", "loss", "val_loss", "lr", "max_logit"]
            + [f"max_logit_{i}" for i in range(n_layer)]
            + ["clipped_heads"] + [f"clipped_{i}" for i in range(n_layer)]
            + ["max_logit_is_bound", "update_rms", "step_time", "elapsed"])


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, list):
        return [_clean(x) for x in v]
    return v


def read_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` (empty if there is none)."""
    path = Path(run_dir) / JSONL
    if not path.is_file():
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class MetricsWriter:
    """Appends rows to ``metrics.jsonl`` and ``metrics.csv`` in ``run_dir``.

    Args:
        run_dir: the run's folder (must exist).
        n_layer: number of attention layers (fixes the CSV columns).
        keep_until: None for a fresh run (files are started empty); on resume, the step of the
            checkpoint: rows with a larger step are dropped and writing continues after them.
    """

    def __init__(self, run_dir: str | Path, n_layer: int, keep_until: int | None = None) -> None:
        self.dir = Path(run_dir)
        self.columns = csv_columns(n_layer)
        rows = [r for r in read_rows(self.dir) if r["step"] <= keep_until] if keep_until is not None else []
        self._jsonl = open(self.dir / JSONL, "w", encoding="utf-8")
        self._csv_file = open(self.dir / CSV, "w", encoding="utf-8", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self.columns, extrasaction="ignore")
        self._csv.writeheader()
        for r in rows:
            self._write(r)
        self.flush()

    def _write(self, row: dict[str, Any]) -> None:
        row = {k: _clean(v) for k, v in row.items()}
        self._jsonl.write(json.dumps(row) + "\n")
        flat = dict(row)
        for i, v in enumerate(row.get("max_logits") or []):
            flat[f"max_logit_{i}"] = v
        for i, v in enumerate(row.get("clipped") or []):
            flat[f"clipped_{i}"] = v
        self._csv.writerow({k: ("" if flat.get(k) is None else flat.get(k)) for k in self.columns})

    def write(self, row: dict[str, Any]) -> None:
        """Append one step's row (keys as in the module docstring) and flush."""
        self._write(row)
        self.flush()

    def flush(self) -> None:
        self._jsonl.flush()
        self._csv_file.flush()

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()


__all__ = ["CSV", "JSONL", "MetricsWriter", "csv_columns", "read_rows"]
