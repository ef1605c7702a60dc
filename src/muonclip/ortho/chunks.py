"""How many matrices of a batch one Newton–Schulz run takes at a time on CPU.

A GPU takes the whole batch at once. On a CPU the fastest chunk depends on the machine, and
the two CPUs this project has been measured on want opposite things (bf16, ns5, 5 steps,
24 x 384 x 384; benchmarks/RESULTS.md):

* 2-core AMD EPYC (Zen 5, avx512_bf16, 1 MiB L2 a core): chunks of 4 took 0.68x the time of
  the whole batch (the working set of the whole batch is far past L2);
* 2-core Intel Xeon with AMX (2 MiB L2 a core): with 2 threads the whole batch is fastest
  (20.6 ms; 23.1 ms in chunks of 4, 30.2 in chunks of 3, 50.9 one matrix at a time: an odd
  chunk leaves one thread idle, one matrix is split badly between them); with 1 thread
  chunks of 8 are (39.1 ms against 44.0 whole).

So the chunk is chosen by timing, once per process for each (batch, m, n, dtype, steps,
iteration, thread count): the first call runs the batch with each candidate (`candidates`:
the whole batch, the cache-sized chunk of `CPU_CHUNK_BYTES`, and multiples of the thread
count) `TUNE_ROUNDS` times and keeps the fastest, the whole batch unless a chunking takes
less than `TUNE_MARGIN` of its time (timings on a busy machine wobble by several percent, and
the chunkings that lose here lose by more); later calls reuse the choice. A whole-batch run
slower than `TUNE_SECONDS` is not tuned (large matrices keep the matrix units busy in any
chunking), nor is a batch whose working set fits in `CPU_CHUNK_BYTES` (nothing to gain, and
small matrices pay no per-call lookup). The first call thus costs up to
``len(candidates) * TUNE_ROUNDS`` runs (1.3 s once for the benchmark GPT set's three buckets
on the AMX Xeon). Set `CPU_CHUNK` to fix the chunk instead.

Chunking never changes the result: a candidate is eligible only if its result equals the
whole batch's bit for bit, so the choice, which depends on timings, cannot make a run differ
from another run (or a resumed run from an uninterrupted one).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

# Fixed matrices per CPU chunk (None: chosen by timing, see the module docstring).
CPU_CHUNK: int | None = None
# Working-set budget of the cache-sized candidate (the L2 caches of the AMD test machine).
CPU_CHUNK_BYTES = 4 * 2**20
# A whole-batch run slower than this (seconds) is taken as the choice without timing others.
TUNE_SECONDS = 0.25
TUNE_ROUNDS = 3  # timings of each candidate (the least counts)
TUNE_MARGIN = 0.9  # a chunking is chosen over the whole batch only below this share of its time
_CHOSEN: dict[tuple, int] = {}
_clock = time.perf_counter  # what the choice is timed with


def working_set(m: int, n: int, dtype: torch.dtype) -> int:
    """Bytes one m x n matrix (m <= n) occupies in a quintic step: X, the new X, S and P."""
    return (2 * m * n + 2 * m * m) * dtype.itemsize


def candidates(batch: int, m: int, n: int, dtype: torch.dtype, threads: int) -> list[int]:
    """Matrices per chunk worth timing for a batch of m x n matrices (m <= n), the whole batch first.

    The whole batch; the most matrices whose working set (X, the new X, S and P) fits in
    `CPU_CHUNK_BYTES`; and ``threads * 2**j`` below ``batch``.
    """
    found = {max(1, min(batch, CPU_CHUNK_BYTES // working_set(m, n, dtype)))}
    c = max(1, threads)
    while c < batch:
        found.add(c)
        c *= 2
    return [batch] + sorted(found - {batch})


def choose_chunk(X: Tensor, iteration: Callable[..., Tensor], steps: int,
                 attempt: Callable[[int], Tensor]) -> int:
    """Matrices per chunk for running ``iteration`` on the batch ``X``.

    Args:
        X: the normalised batch ``(batch, p, q)``, wide or tall (only its shape, dtype and
            device are read).
        iteration: the iteration that will run (part of the key of the choice).
        steps: its number of steps (part of the key).
        attempt: ``attempt(k)`` runs the whole batch in chunks of ``k`` and returns the result
            (a new tensor); called only while a choice is being made.

    Returns:
        ``X.shape[0]`` off the CPU, for one matrix and while compiling; `CPU_CHUNK` if set;
        ``X.shape[0]`` for a batch whose working set fits in `CPU_CHUNK_BYTES` (nothing for
        chunks to gain, and no per-call cost for small matrices); otherwise the timed choice,
        kept for the process.
    """
    N, p, q = X.shape
    if X.device.type != "cpu" or N == 1 or torch.compiler.is_compiling():
        return N
    if CPU_CHUNK is not None:
        return max(1, min(N, CPU_CHUNK))
    if N * working_set(min(p, q), max(p, q), X.dtype) <= CPU_CHUNK_BYTES:
        return N
    threads = torch.get_num_threads()
    key = (N, p, q, X.dtype, steps, _iteration_key(iteration), threads)
    if key not in _CHOSEN:
        _CHOSEN[key] = _fastest(candidates(N, min(p, q), max(p, q), X.dtype, threads), attempt)
    return _CHOSEN[key]


def _fastest(cands: list[int], attempt: Callable[[int], Tensor]) -> int:
    """The candidate with the least time over `TUNE_ROUNDS` rounds among those whose result
    equals the first (whole-batch) candidate's bit for bit; the whole batch unless that time is
    below `TUNE_MARGIN` of the whole batch's."""
    whole = cands[0]
    best: dict[int, float] = {}
    reference: Tensor | None = None
    for _ in range(TUNE_ROUNDS):
        for k in cands:
            t0 = _clock()
            result = attempt(k)
            seconds = _clock() - t0
            if reference is None:
                reference = result
                if seconds > TUNE_SECONDS:
                    return whole
            elif k not in best and not torch.equal(result, reference):
                continue  # a different result: never chosen
            best[k] = min(seconds, best.get(k, seconds))
        cands = list(best)
    fastest = min(best, key=best.__getitem__)
    return fastest if best[fastest] < TUNE_MARGIN * best[whole] else whole


def _iteration_key(iteration: Callable[..., Tensor]) -> tuple:
    """What identifies an iteration across calls: a `functools.partial` by its function and
    keywords, a function by its code (a lambda made anew at each call is still one key)."""
    keywords: tuple = ()
    if isinstance(iteration, partial):
        keywords = tuple(sorted((k, repr(v)) for k, v in iteration.keywords.items()))
        iteration = iteration.func
    return getattr(iteration, "__code__", None) or repr(type(iteration)), keywords
