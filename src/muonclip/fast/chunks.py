"""How many matrices of a batch one Newton–Schulz run takes at a time on CPU (opt-in).

A GPU takes the whole batch at once. On a CPU without matrix units a batch whose working set
is far past the L2 caches can run faster in cache-sized chunks; on a CPU with matrix units
(AMX), or when the batch fits in cache, the whole batch is as fast or faster. Which is the
case depends on the machine, so chunking is off by default and chosen by a rule, never by
timing trials (the first optimizer step costs what a later one does):

* ``None`` (default): the whole batch.
* an int ``k``: ``k`` matrices at a time.
* ``"cache"``: the most matrices whose working set (X, the new X, S and P: `working_set`) fits
  in `CPU_CHUNK_BYTES`, rounded down to a multiple of the thread count (an odd chunk leaves a
  thread idle), and the whole batch when it fits anyway.

A chunked run makes the same products on each chunk as one call makes on the batch, but a
batched matrix product over k matrices need not round as one over N does, so the result can
differ from the whole batch's in the last bits (the tests compare at round-off tolerance).
"""

from __future__ import annotations

import torch

# Working-set budget of the "cache" rule: the L2 caches of a 2-core AMD EPYC test machine.
CPU_CHUNK_BYTES = 4 * 2**20
RULES = ("cache",)


def working_set(m: int, n: int, dtype: torch.dtype) -> int:
    """Bytes one m x n matrix (m <= n) occupies in a quintic step: X, the new X, S and P."""
    return (2 * m * n + 2 * m * m) * dtype.itemsize


def check_chunk(chunk: int | str | None) -> None:
    """Raise ValueError unless ``chunk`` is None, an int >= 1 or a rule name."""
    if chunk is None or chunk in RULES:
        return
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be None (the whole batch), an int >= 1 or one of {RULES}, got {chunk!r}")


def chunk_size(chunk: int | str | None, batch: int, p: int, q: int, dtype: torch.dtype, device: torch.device,
               threads: int | None = None) -> int:
    """Matrices per Newton–Schulz run for a batch of ``batch`` p x q matrices (see module docstring).

    The whole batch off the CPU, for one matrix and while compiling, whatever ``chunk`` says.
    ``threads`` defaults to ``torch.get_num_threads()``.
    """
    if chunk is None or device.type != "cpu" or batch == 1 or torch.compiler.is_compiling():
        return batch
    if chunk != "cache":
        return max(1, min(batch, int(chunk)))
    per = working_set(min(p, q), max(p, q), dtype)
    if batch * per <= CPU_CHUNK_BYTES:
        return batch
    threads = max(1, threads or torch.get_num_threads())
    fit = CPU_CHUNK_BYTES // per
    return min(batch, max(threads, fit - fit % threads))


__all__ = ["CPU_CHUNK_BYTES", "RULES", "check_chunk", "chunk_size", "working_set"]
