"""A Triton kernel for the symmetric products of Newton–Schulz (``X X^T`` and ``S S``), on GPU.

Both products of a quintic step are symmetric: ``S = X X^T`` and ``S S = S S^T``. A general
matrix product (cuBLAS) computes every tile of the result; `syrk` computes only the tiles on
and above the diagonal and writes each off-diagonal tile twice (as itself and, transposed,
into the mirror position). For an m x m result that is ``T (T + 1) / 2`` of the ``T^2``
tiles (T = m / BLOCK): close to half the flops of the product for m >> BLOCK. With the
quintic's ``P = b S + c S S`` fused into the kernel's epilogue (``alpha = c``, ``beta = b``,
``add = S``: one rounding of the float32 accumulator, as cuBLAS's ``baddbmm``), a step costs
``m^2 n + m^3`` symmetric flops plus the ``2 m^2 n`` of ``P X`` (cuBLAS), against
``4 m^2 n + 2 m^3`` for the plain step: 0.67x at m = n, 0.72x at n = 4 m (docs/design.md,
"Faster variants of the quintic").

Every result is exactly symmetric (both triangles hold the same rounded values), by
construction and on any hardware: an off-diagonal tile is stored once as itself and once
transposed, and a diagonal tile keeps the upper triangle of its float32 accumulator (after the
epilogue) and mirrors it into the lower one before the one rounding to the output dtype. (The
two triangles of a diagonal tile's ``dot(A_i, A_i^T)`` need not agree bit for bit: whether
they do depends on the order in which the dot sums, which differs between GPUs, and on the CPU
interpreter, between BLAS kernels.)

Tiling (`launch_config`): one program per (tile row i, tile column j, matrix); programs with
``j < i`` do nothing. ``BLOCK`` x ``BLOCK`` tiles (64 for m < 1024, else 128, with 8 warps so
the float32 accumulator stays in registers), float32 accumulation, and along the shared
dimension the widest ``BLOCK_K`` (64, 32 or 16) whose two operand tiles fit `STAGE_BYTES`,
with up to `STAGES` pipeline stages, as many as fit `SHARED_BYTES` beside the epilogue's
transposed output tile: 48 KiB of operands for 16-bit tiles, 32 KiB + a 64 KiB output tile
for float32 at BLOCK 128 (2 stages), within a consumer GPU's 99 KiB a block. (That budget is
our count of the tiles; Triton's own allocation is seen only on a GPU.) BLOCK_K = 64
throughout, the first choice, would have asked 192 KiB for float32 at BLOCK 128: more than an
A100 (164 KiB) has. Float32 tiles multiply in full float32 unless torch's float32 matmul
precision allows TF32 (as cuBLAS does for torch; never on ROCm). bfloat16, float16 and
float32 only (float64 matrices keep `muonclip.fast._symmetric`'s row strips). The sizes are
untuned first choices: whether the kernel beats cuBLAS at the shapes users have (m >= 2048)
is measured by ``benchmarks/bench_ortho.py --device cuda --big`` (``ns5_sym`` against
``ns5``), which needs a GPU.

On CPU the kernel runs only under Triton's interpreter (``TRITON_INTERPRET=1``, set before
the first call), which is how the tests check it without a GPU. The interpreter's ``tl.dot``
returns garbage for bfloat16 operands (Triton 3.9), so there, and only there, bfloat16 tiles are
widened to float32 before the product (the rounding of the result is the same single
rounding of a float32 accumulator).

Reference: the symmetric-kernel idea follows Dao-AILab's quack ``gemm_symmetric`` and the
Gram Newton–Schulz write-up (J. Zhang, N. Amsel, B. Chen, T. Dao, 2026); no code is shared.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from ..common._triton_support import interpreting, triton_available

SMALL_BLOCK, LARGE_BLOCK, LARGE_FROM = 64, 128, 1024
STAGE_BYTES = 16 * 2**10  # the two operand tiles of one pipeline stage, at most
STAGES = 3  # pipeline stages of the k loop, at most
SHARED_BYTES = 96 * 2**10  # shared memory a program may use (consumer GPUs allow 99 KiB a block)
MAX_GRID_Z = 65535  # CUDA's limit on a grid's third dimension (the matrices of one launch)


DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def usable(X: Tensor) -> bool:
    """True when `syrk` can run on ``X``: Triton importable, ``X`` on a CUDA device (or the
    interpreter on) and in one of `DTYPES` (float64 keeps the row strips)."""
    return triton_available() and (X.is_cuda or interpreting()) and X.dtype in DTYPES


@functools.cache
def _kernel(interpret: bool) -> Any:  # a triton JITFunction (or InterpretedFunction)
    """The kernel, built on first use (and again if the interpreter is switched on or off:
    ``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps the function)."""
    del interpret  # part of the cache key only
    import triton
    import triton.language as tl

    @triton.jit
    def syrk_kernel(a_ptr, d_ptr, c_ptr, M, K,
                    s_ab, s_am, s_ak, s_db, s_dm, s_dn, s_cb, s_cm, s_cn,
                    alpha, beta,
                    HAS_D: tl.constexpr, WIDEN: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
        i = tl.program_id(0)
        j = tl.program_id(1)
        if j >= i:  # the upper triangle of tiles only
            b = tl.program_id(2).to(tl.int64)
            ri = i * BLOCK + tl.arange(0, BLOCK)
            rj = j * BLOCK + tl.arange(0, BLOCK)
            rk = tl.arange(0, BLOCK_K)
            a = a_ptr + b * s_ab
            acc = tl.full((BLOCK, BLOCK), 0.0, dtype=tl.float32)  # not tl.zeros: a jit function,
            # which the interpreter cannot call if triton was imported before TRITON_INTERPRET was set
            for k0 in range(0, K, BLOCK_K):
                kk = k0 + rk
                ok_k = kk[None, :] < K
                ti = tl.load(a + ri[:, None] * s_am + kk[None, :] * s_ak, mask=(ri[:, None] < M) & ok_k, other=0.0)
                tj = tl.load(a + rj[:, None] * s_am + kk[None, :] * s_ak, mask=(rj[:, None] < M) & ok_k, other=0.0)
                if WIDEN:
                    ti = ti.to(tl.float32)
                    tj = tj.to(tl.float32)
                acc += tl.dot(ti, tl.trans(tj), input_precision=PRECISION)
            acc = acc * alpha
            inside = (ri[:, None] < M) & (rj[None, :] < M)
            if HAS_D:
                d = tl.load(d_ptr + b * s_db + ri[:, None] * s_dm + rj[None, :] * s_dn, mask=inside, other=0.0)
                acc += beta * d.to(tl.float32)
            if j == i:  # a diagonal tile: its upper triangle, mirrored (the products of the two
                # triangles round differently wherever the dot's summation order is not symmetric)
                acc = tl.where(ri[:, None] <= rj[None, :], acc, tl.trans(acc))
            tile = acc.to(c_ptr.dtype.element_ty)
            c = c_ptr + b * s_cb
            tl.store(c + ri[:, None] * s_cm + rj[None, :] * s_cn, tile, mask=inside)
            if j > i:  # the mirror tile, C[j, i] = C[i, j]^T
                tl.store(c + rj[:, None] * s_cm + ri[None, :] * s_cn, tl.trans(tile), mask=tl.trans(inside))

    return syrk_kernel


def block_for(m: int) -> int:
    """The tile side `syrk` uses for an m x m result."""
    return LARGE_BLOCK if m >= LARGE_FROM else SMALL_BLOCK


def launch_config(m: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """``(BLOCK, BLOCK_K, num_warps, num_stages)`` of `syrk` for an m x m result of ``dtype``
    operands: the tile side (`block_for`); the widest of 64, 32, 16 along the shared dimension
    whose two ``BLOCK x BLOCK_K`` operand tiles fit `STAGE_BYTES`; 8 warps for 128-wide tiles
    (4 below); and up to `STAGES` stages, as many as fit `SHARED_BYTES` beside the transposed
    ``BLOCK x BLOCK`` output tile of the epilogue."""
    block = block_for(m)
    block_k = max(16, min(64, STAGE_BYTES // (2 * block * dtype.itemsize)))
    stage = 2 * block * block_k * dtype.itemsize
    stages = max(1, min(STAGES, (SHARED_BYTES - block * block * dtype.itemsize) // stage))
    return block, block_k, 8 if block >= LARGE_BLOCK else 4, stages


def _precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision, as torch's own float32 products on CUDA: for float32 tiles
    full float32 ("ieee") under ``torch.get_float32_matmul_precision() == "highest"`` (torch's
    default), TF32 otherwise, except on ROCm (not every AMD GPU has TF32); "ieee" for bf16
    and fp16 tiles, whose products are exact in float32 (the one value every backend takes)."""
    if dtype != torch.float32 or torch.get_float32_matmul_precision() == "highest" or torch.version.hip:
        return "ieee"
    return "tf32"


def syrk(A: Tensor, *, alpha: float = 1.0, beta: float = 0.0, add: Tensor | None = None,
         out: Tensor | None = None) -> Tensor:
    """``alpha A A^T + beta add`` for a batch ``A`` of shape ``(batch, m, k)`` (any strides, e.g.
    ``X.mT`` for the Gram matrix of a tall X), computing only the upper triangle of tiles.

    Args:
        A: ``(batch, m, k)``, on a CUDA device (or on the CPU under ``TRITON_INTERPRET=1``).
        alpha: scale of the product (default 1.0).
        beta: scale of ``add`` (default 0.0; ignored without ``add``).
        add: a symmetric ``(batch, m, m)`` tensor added after the product (default None), e.g.
            ``S`` for ``P = b S + c S S`` (``A = S``, ``alpha = c``, ``beta = b``). Only its
            upper triangle (diagonal included) counts: the result's lower triangle is the
            mirror of its upper one.
        out: where to write the ``(batch, m, m)`` result (default None: a new tensor of A's
            dtype). It must not overlap ``A``; it may be ``add`` itself.

    Returns:
        The ``(batch, m, m)`` result in ``out``'s (or A's) dtype, exactly symmetric on any
        hardware (the lower triangle is a copy of the upper one).

    Raises:
        RuntimeError: Triton is missing, or ``A`` is on the CPU without the interpreter.
        ValueError: a shape does not fit.
    """
    if not triton_available():
        raise RuntimeError("syrk needs the triton package (it comes with CUDA builds of PyTorch)")
    if not (A.is_cuda or interpreting()):
        raise RuntimeError(f"syrk runs on a CUDA device (or on the CPU under TRITON_INTERPRET=1); A is on {A.device}")
    if A.ndim != 3:
        raise ValueError(f"syrk takes a batch (batch, m, k); got shape {tuple(A.shape)}")
    if A.dtype not in DTYPES:
        raise ValueError(f"syrk computes in one of {DTYPES}; got {A.dtype}")
    batch, m, k = A.shape
    if out is None:
        out = torch.empty(batch, m, m, dtype=A.dtype, device=A.device)
    if out.shape != (batch, m, m) or (add is not None and add.shape != (batch, m, m)):
        raise ValueError(f"out and add must have shape {(batch, m, m)}; got "
                         f"{tuple(out.shape)} and {None if add is None else tuple(add.shape)}")
    if batch == 0 or m == 0:
        return out
    block, block_k, warps, stages = launch_config(m, A.dtype)
    tiles = -(-m // block)
    d = add if add is not None else out  # an unused pointer when there is nothing to add
    interpret = interpreting()
    kernel = _kernel(interpret)
    for b0 in range(0, batch, MAX_GRID_Z):  # one launch unless there are more matrices than that
        b1 = min(batch, b0 + MAX_GRID_Z)
        kernel[(tiles, tiles, b1 - b0)](
            A[b0:b1], d[b0:b1], out[b0:b1], m, k, *A.stride(), *d.stride(), *out.stride(), float(alpha), float(beta),
            HAS_D=add is not None, WIDEN=interpret and A.dtype == torch.bfloat16, PRECISION=_precision(A.dtype),
            BLOCK=block, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
        )
    return out
