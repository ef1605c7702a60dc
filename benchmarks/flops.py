"""The flops each orthogonaliser runs on one matrix, counted from the products it makes, for the
benchmarks' TFLOP/s (`bench_ortho.py`) and the tests that check the counts against the code
(`tests/test_ortho_fast.py`, `tests/test_triton_syrk.py`): 2 flops per multiply-add."""

from __future__ import annotations

from collections.abc import Collection

from muonclip.fast._symmetric import SYM_BLOCKS
from muonclip.fast._triton_syrk import block_for
from muonclip.ortho._gram import default_restarts


def gram_flops(m: int, n: int, steps: int, restarts: Collection[int] | None = None) -> int:
    """Flops of `muonclip.ortho._gram.gram_iteration` on one m x n matrix (m <= n)."""
    if restarts is None:
        restarts = default_restarts(steps)
    mm_small, mm_rect = 0, 1  # the first R = X X^T
    q_exists = False
    for i in range(steps):
        if i != 0 and i in restarts and q_exists:
            mm_rect += 2  # X = Q X, R = X X^T
            q_exists = False
        mm_small += 1  # Z
        if q_exists:
            mm_small += 1  # Q Z
        q_exists = True
        if i < steps - 1 and (i + 1) not in restarts:
            mm_small += 2  # R Z, Z RZ
    mm_rect += 1  # Q X
    return 2 * m * m * n * mm_rect + 2 * m**3 * mm_small


def triangle_fraction(m: int) -> float:
    """The share of a full m x m product's tiles that `muonclip.fast._triton_syrk.syrk` computes: ``(T + 1) / (2 T)``,
    T = ceil(m / block)."""
    tiles = -(-m // block_for(m))
    return (tiles + 1) / (2 * tiles)


def symmetric_flops(m: int, n: int, steps: int, blocks: int = SYM_BLOCKS, kernel: bool = False) -> int:
    """Flops of `muonclip.fast._symmetric.symmetric_quintic` on one m x n matrix (m <= n), 2 per multiply-add:
    with ``blocks`` row strips, or with the Triton kernel's tiles when ``kernel``."""
    if kernel:
        f = triangle_fraction(m)
    else:
        f = (blocks + 1) / (2 * blocks) if blocks > 1 and m >= 2 * blocks else 1.0
    return int(steps * (f * 2 * m * m * n + f * 2 * m**3 + 2 * m * m * n))
