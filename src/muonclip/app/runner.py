"""Many training runs for `muonclip compare`: one after another, or in parallel worker processes.

Small models train faster as several one-thread processes than as one process with several
threads (each step is too small to keep more than one core busy), so `run_all` with ``jobs > 1``
trains the runs in ``jobs`` worker processes (``spawn``ed; each loads the corpus once and runs
`muonclip.app.train.train_run` with the threads its config names). With ``jobs=1`` the runs go
one after another in this process, with a progress bar each.

A run whose loss turns non-finite is reported as diverged (`Outcome.diverged_at`) when
``allow_divergence`` is set (a learning-rate sweep goes on past it), else its
`NonFiniteLossError` is raised. Ctrl-C: every running run finishes its step and writes its
checkpoint (the workers get the SIGINT too), the runs not started are cancelled, and
`Interrupted` is raised. A worker ignores Ctrl-C while it waits for a run, and holds it while it
starts (it is started with SIGINT blocked, until `_worker_start` has put its handler in place), so
that no worker prints a KeyboardInterrupt traceback; a second Ctrl-C ends the command, its workers
with it (`muonclip.app.train.abort`).
"""

from __future__ import annotations

import multiprocessing
import signal
import sys
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import RunConfig
from .data import Corpus, load_corpus
from .train import Interrupted, NonFiniteLossError, RunResult, train_run


@dataclass(frozen=True)
class RunSpec:
    """One run: its config (steps, seed, learning rates...), optimizer, folder and progress label."""

    cfg: RunConfig
    optimizer: str
    run_dir: Path
    label: str


@dataclass(frozen=True)
class Outcome:
    """How a run ended: ``result`` when it finished, ``diverged_at`` (1-based step) when its loss
    turned non-finite."""

    spec: RunSpec
    result: RunResult | None = None
    diverged_at: int | None = None

    @property
    def final_val_loss(self) -> float | None:
        """The final validation loss, or None for a diverged run."""
        return None if self.result is None else self.result.final_val_loss


_CORPUS: dict[tuple[Any, float], Corpus] = {}  # a worker's corpus, loaded once


def _load(data: str | None, val_fraction: float) -> Corpus:
    key = (data, val_fraction)
    if key not in _CORPUS:
        _CORPUS[key] = load_corpus(data, val_fraction)
    return _CORPUS[key]


_WORKER = {"busy": False, "stopped": False}  # a worker process: running a run; Ctrl-C seen


def _worker_sigint(signum: int, frame: Any) -> None:
    """A worker's Ctrl-C outside a run's training loop (which has its own handler): stops a run
    that is starting (KeyboardInterrupt, sent back to the parent like any error); while the worker
    waits, it refuses the next run instead (the comparison is stopping)."""
    _WORKER["stopped"] = True
    if _WORKER["busy"]:
        raise KeyboardInterrupt


def _worker_start() -> None:
    """Initializer of a worker process: `_worker_sigint`, then SIGINT unblocked (a Ctrl-C held
    while the worker started is handled now)."""
    signal.signal(signal.SIGINT, _worker_sigint)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _run_in_worker(spec: RunSpec, progress: bool, allow_divergence: bool) -> Outcome:
    if _WORKER["stopped"]:
        raise KeyboardInterrupt
    _WORKER["busy"] = True
    try:
        return _run_one(spec, None, progress, allow_divergence)
    finally:
        _WORKER["busy"] = False


def _run_one(spec: RunSpec, corpus: Corpus | None, progress: bool, allow_divergence: bool) -> Outcome:
    if corpus is None:
        corpus = _load(spec.cfg.data, spec.cfg.val_fraction)
    try:
        result = train_run(spec.cfg, spec.optimizer, spec.run_dir, corpus=corpus, progress=progress,
                           label=spec.label, warn=False)
    except NonFiniteLossError as e:
        if not allow_divergence:
            raise
        return Outcome(spec, diverged_at=e.step)
    return Outcome(spec, result=result)


def run_all(specs: Sequence[RunSpec], corpus: Corpus, *, jobs: int = 1, progress: bool = True,
            allow_divergence: bool = False) -> list[Outcome]:
    """Train every run of ``specs``; return their outcomes in the same order.

    Args:
        specs: the runs (their folders must not hold a run yet).
        corpus: the loaded corpus of their configs (the workers load their own copy).
        jobs: runs at a time (default 1: one after another in this process).
        progress: one bar per run (``jobs=1``), or one bar over the runs (default True).
        allow_divergence: report a non-finite loss as `Outcome.diverged_at` instead of raising
            (default False).

    Raises:
        NonFiniteLossError: a run diverged and ``allow_divergence`` is False.
        Interrupted: Ctrl-C (the running runs wrote their checkpoints).
    """
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs}")
    if jobs == 1 or len(specs) <= 1:
        return [_run_one(s, corpus, progress, allow_divergence) for s in specs]
    from tqdm import tqdm

    outcomes: dict[int, Outcome] = {}
    bar = tqdm(total=len(specs), unit="run", desc=f"{len(specs)} runs, {jobs} at a time", disable=not progress,
               file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 30.0)
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"),
                               initializer=_worker_start)
    futures: dict[Future[Outcome], int] = {}
    try:
        # the workers start as the runs are submitted: with SIGINT blocked, which they inherit (one
        # sent meanwhile reaches this process when it is unblocked, and each worker once it has its handler)
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            futures = {pool.submit(_run_in_worker, s, False, allow_divergence): i for i, s in enumerate(specs)}
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        pending = set(futures)
        while pending:
            done, pending = wait(pending, return_when=FIRST_COMPLETED)
            for f in done:
                out = f.result()
                outcomes[futures[f]] = out
                loss = out.final_val_loss
                bar.set_postfix_str(f"{out.spec.label}: " + (f"val {loss:.4f}" if loss is not None
                                                             else f"diverged at step {out.diverged_at}"))
                bar.update(1)
    except KeyboardInterrupt:
        for f in futures:
            f.cancel()
        interrupted = None
        for f in futures:  # the running runs save a checkpoint and stop (SIGINT reached the workers too)
            if f.cancelled():
                continue
            try:
                f.result()
            except Interrupted as e:
                interrupted = interrupted or e
            except BaseException:  # noqa: BLE001 - the Ctrl-C is what is reported
                pass
        if interrupted is not None:
            raise interrupted from None
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
    return [outcomes[i] for i in range(len(specs))]
