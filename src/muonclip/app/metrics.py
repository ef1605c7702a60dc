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

In the JSONL file the per-layer values are lists (``max_logits``, ``clipped``); it is the history,
the CSV a copy for spreadsheets. On resume the rows after the checkpoint's step are dropped, so
the files again describe one clean run: both files are rewritten to a temporary file and renamed
(`muonclip.app.safe_files.write_atomically`), so a kill at any moment of the rewrite leaves the
old history or the new one, never a part. A last line without its newline is a row whose write
a kill cut short (always after the checkpoint's step, so nothing to keep): reading skips it. Any
other line that is not a JSON row is an error naming the file and the line. Both files are
opened without following a link and only when they are regular files
(`muonclip.app.safe_files.open_file`).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path
from typing import Any

from .runfolder import METRICS
from .safe_files import open_file, read_bytes, write_atomically

JSONL, CSV = METRICS


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


class MetricsError(ValueError):
    """A metrics file holds a line that is not a row; the message names the file and the line."""


def read_rows(run_dir: str | Path) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` (empty if there is none); a last line without its
    newline (a write cut short by a kill) is skipped.

    Raises:
        MetricsError: another line is not a JSON object with an integer ``step``.
        muonclip.app.safe_files.OutputError: the file is a link or not a regular file.
    """
    path = Path(run_dir) / JSONL
    try:
        data = read_bytes(run_dir, JSONL)
    except FileNotFoundError:
        return []
    lines = data.decode("utf-8", errors="replace").split("\n")
    lines.pop()  # "" when the file ends with a newline, else an unfinished row
    rows = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise MetricsError(f"{path}, line {i}, is not a metrics row ({e}); the run folder is damaged") from None
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise MetricsError(f"{path}, line {i}, is not a metrics row (no step); the run folder is damaged")
        rows.append(row)
    return rows


class MetricsWriter:
    """Appends rows to ``metrics.jsonl`` and ``metrics.csv`` in ``run_dir``.

    Args:
        run_dir: the run's folder (must exist).
        n_layer: number of attention layers (fixes the CSV columns).
        keep_until: None for a fresh run (files are started empty); on resume, the step of the
            checkpoint: rows with a larger step are dropped (both files rewritten atomically,
            module docstring) and writing continues after them.
        token: the writer's token, named in the rewrite's temporaries
            (`muonclip.app.safe_files.write_atomically`; default None: a fresh one).

    Raises:
        MetricsError: on resume, ``metrics.jsonl`` holds a line that is not a row.
    """

    def __init__(self, run_dir: str | Path, n_layer: int, keep_until: int | None = None,
                 token: str | None = None) -> None:
        self.dir = Path(run_dir)
        self.columns = csv_columns(n_layer)
        rows = [r for r in read_rows(self.dir) if r["step"] <= keep_until] if keep_until is not None else []
        # the CSV first: a kill between the two renames leaves the old history in metrics.jsonl
        write_atomically(self.dir / CSV, lambda f: f.write(self._csv_text(rows)), text=True, token=token)
        write_atomically(self.dir / JSONL, lambda f: f.writelines(self._line(r) for r in rows), text=True, token=token)
        append = os.O_WRONLY | os.O_APPEND
        self._jsonl = os.fdopen(open_file(self.dir, JSONL, append), "a", encoding="utf-8")
        self._csv_file = os.fdopen(open_file(self.dir, CSV, append), "a", encoding="utf-8", newline="")
        self._csv = csv.DictWriter(self._csv_file, fieldnames=self.columns, extrasaction="ignore")

    @staticmethod
    def _line(row: dict[str, Any]) -> str:
        return json.dumps({k: _clean(v) for k, v in row.items()}) + "\n"

    def _flat(self, row: dict[str, Any]) -> dict[str, Any]:
        flat = {k: _clean(v) for k, v in row.items()}
        for i, v in enumerate(flat.get("max_logits") or []):
            flat[f"max_logit_{i}"] = v
        for i, v in enumerate(flat.get("clipped") or []):
            flat[f"clipped_{i}"] = v
        return {k: ("" if flat.get(k) is None else flat.get(k)) for k in self.columns}

    def _csv_text(self, rows: list[dict[str, Any]]) -> str:
        buf = io.StringIO(newline="")
        w = csv.DictWriter(buf, fieldnames=self.columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(self._flat(r))
        return buf.getvalue()

    def write(self, row: dict[str, Any]) -> None:
        """Append one step's row (keys as in the module docstring) and flush."""
        self._jsonl.write(self._line(row))
        self._csv.writerow(self._flat(row))
        self.flush()

    def flush(self) -> None:
        self._jsonl.flush()
        self._csv_file.flush()

    def sync(self) -> None:
        """Flush both files to disk (before a checkpoint, so that its rows outlive a crash)."""
        self.flush()
        os.fsync(self._jsonl.fileno())
        os.fsync(self._csv_file.fileno())

    def close(self) -> None:
        self._jsonl.close()
        self._csv_file.close()
