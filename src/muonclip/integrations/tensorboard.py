"""`TensorBoardWriter`: a run's per-step metrics as TensorBoard scalars (``muonclip train --tensorboard DIR``).

Each row written by the CLI (see `muonclip.app.metrics`) becomes scalars at ``global_step =
row["step"]``: every finite number under its key (``loss``, ``val_loss``, ``lr``,
``max_logit``, ``clipped_heads``, ``update_rms``, ``step_time``, ...), and list values per
element, ``max_logits`` as ``max_logits/<i>`` and ``clipped`` as ``clipped/<i>`` (layer i).
Missing values (``None``, NaN, inf) are left out rather than plotted as zeros. Keys can be
grouped under a prefix (``tag_prefix="muonclip/"``), handy when several runs share one log dir.

On resume, ``purge_step`` (the checkpoint's step + 1) tells TensorBoard to drop events the
interrupted run wrote after the checkpoint, so the curves describe one clean run — like the
CLI's JSONL/CSV files.

Needs the ``tensorboard`` package (``pip install 'muonclip[tensorboard]'``); writing goes
through ``torch.utils.tensorboard.SummaryWriter``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _summary_writer_class() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError(
            "TensorBoard logging needs the tensorboard package: pip install 'muonclip[tensorboard]'"
        ) from e
    return SummaryWriter


def scalars(row: Mapping[str, Any], *, step_key: str = "step") -> dict[str, float]:
    """The TensorBoard scalars of one metrics row (see module docstring); the step key is left out."""
    out: dict[str, float] = {}
    for key, value in row.items():
        if key == step_key:
            continue
        if isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                if _is_number(v):
                    out[f"{key}/{i}"] = float(v)
        elif _is_number(value):
            out[key] = float(value)
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class TensorBoardWriter:
    """Writes metrics rows as TensorBoard scalars.

    Args:
        log_dir: folder for the event files (created).
        purge_step: on resume, the first step written again (default None: a fresh run).
        tag_prefix: prepended to every tag (default ``""``).
        flush_secs: how often the event file is flushed to disk (default 10 s; `close` flushes).
    """

    def __init__(
        self, log_dir: str | Path, *, purge_step: int | None = None, tag_prefix: str = "", flush_secs: int = 10
    ) -> None:
        SummaryWriter = _summary_writer_class()
        self.log_dir = Path(log_dir)
        self.tag_prefix = tag_prefix
        self._writer = SummaryWriter(log_dir=str(self.log_dir), purge_step=purge_step, flush_secs=flush_secs)

    def write(self, row: Mapping[str, Any], step: int | None = None) -> None:
        """Add one row's scalars at ``step`` (default: ``row["step"]``)."""
        if step is None:
            if "step" not in row:
                raise ValueError("a metrics row needs a 'step' entry, or pass step=...")
            step = int(row["step"])
        for tag, value in scalars(row).items():
            self._writer.add_scalar(self.tag_prefix + tag, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Read back every scalar under ``log_dir``: tag -> [(step, value), ...] sorted by step (for tests, reports)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as e:
        raise ImportError("reading TensorBoard files needs the tensorboard package") from e
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}


__all__ = ["TensorBoardWriter", "read_scalars", "scalars"]
