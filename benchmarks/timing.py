"""Timing helpers shared by bench_ortho.py and bench_step.py.

Contenders are timed round-robin (one call of each per round, `rounds` rounds after `warmup`
calls each), so a burst of load from other processes hits every contender alike; the
median of each one's rounds is reported. Each round runs the contenders in a new order (a
seeded shuffle): with a fixed order the contender right after AdamW paid extra every round
(the cause was not pinned down). Three copies of the default Muon in one fixed-order run (GPT
set, Intel Xeon with AMX, 2 threads) read 115.2 ms right after AdamW and 96.0 / 93.3 ms
elsewhere; shuffled, 98.9 / 93.8 / 104.4 ms, with no copy favoured.
``clock="process"`` measures CPU time of this process (all its threads) instead of wall
time: with ``--threads 1`` it is insensitive to other processes on a shared machine.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

CLOCKS = {"wall": time.perf_counter, "process": time.process_time}


def sync(device: str) -> None:
    """Wait for queued GPU work (no-op on CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def round_robin(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int = 7,
    warmup: int = 2,
    clock: str = "wall",
    device: str = "cpu",
    samples: dict[str, list[float]] | None = None,
) -> dict[str, float]:
    """Median seconds per call of each function, timed interleaved; ``samples``, when given, is
    filled with every round's time of each (round i at index i, for per-round ratios)."""
    tick = CLOCKS[clock]
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync(device)
    samples = {} if samples is None else samples
    samples.update({name: [] for name in fns})
    order = list(fns.items())
    shuffle = random.Random(0).shuffle
    for _ in range(rounds):
        shuffle(order)
        for name, fn in order:
            sync(device)
            t0 = tick()
            fn()
            sync(device)
            samples[name].append(tick() - t0)
    return {name: statistics.median(ts) for name, ts in samples.items()}


def setup_threads(threads: int) -> None:
    """Pin torch's intra-op thread count (the figures depend on it)."""
    torch.set_num_threads(threads)


def machine() -> str:
    """CPU model (from /proc/cpuinfo) and its matrix instructions, torch version and thread count,
    for the report."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    from muonclip.common._hardware import cpu_matrix_instructions

    model += f" ({', '.join(cpu_matrix_instructions()) or 'no AVX2'})"
    gpu = f", {torch.cuda.get_device_name()}" if torch.cuda.is_available() else ""
    return f"{model}{gpu}; torch {torch.__version__}; {torch.get_num_threads()} threads"
