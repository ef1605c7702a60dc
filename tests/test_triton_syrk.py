"""The Triton symmetric-product kernel (`muonclip.fast._triton_syrk`).

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``): the tiling,
the upper-triangle selection, the mirrored stores, the masks of partial tiles and the fused
epilogue are the code a GPU runs. The ``cuda`` tests compare the compiled kernel with cuBLAS.
"""

from __future__ import annotations

import pytest
import torch
from step_trace_loader import flops
from test_ortho_fast import conditioned, sigma

from muonclip import orthogonalize
from muonclip.fast import _triton_syrk as triton_syrk
from muonclip.fast._symmetric import symmetric_quintic
from muonclip.fast._triton_syrk import syrk, usable
from muonclip.ortho._newton_schulz import NS5_COEFFICIENTS

# imported before any test switches the interpreter on, as a program that compiled something
# first would have it (the kernel must not call Triton's own jit functions then)
triton = pytest.importorskip("triton")

# float32 accumulation, one rounding to the output dtype: relative error of that dtype
RTOL = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.fixture
def interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 40, 72), (1, 130, 30), (3, 64, 64), (1, 200, 9)])
def test_syrk_is_a_at_in_every_tile(interpreter, dtype, shape):
    """A A^T from upper-triangle tiles only: right in every tile (m = 130, 200: 3-4 tiles of 64
    with a partial last one), and exactly symmetric on any hardware: the kernel stores each
    off-diagonal tile and its transpose from one register tile, and copies each diagonal tile's
    upper triangle into its lower one, so the assertion does not rest on the dot's summation
    order (which, under the interpreter, is numpy's BLAS kernel: OpenBLAS's Haswell and Zen
    kernels do not give a bit-symmetric ``a @ a.T``)."""
    torch.manual_seed(0)
    A = torch.randn(shape).to(dtype)
    C = syrk(A)
    assert C.dtype == dtype and C.shape == (shape[0], shape[1], shape[1])
    assert _rel(C, A.double() @ A.double().mT) < RTOL[dtype]
    assert torch.equal(C, C.mT)


def test_syrk_launches_batches_past_the_grid_limit(interpreter, monkeypatch):
    """More matrices than one launch's grid holds: several launches, every matrix right."""
    monkeypatch.setattr(triton_syrk, "MAX_GRID_Z", 2)
    torch.manual_seed(4)
    A = torch.randn(5, 8, 12)
    D = torch.randn(5, 8, 8)
    D = D + D.mT
    got = syrk(A, alpha=2.0, beta=0.5, add=D)
    torch.testing.assert_close(got, 2.0 * A @ A.mT + 0.5 * D, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_syrk_reads_strided_input(interpreter, dtype):
    """A transposed view (the Gram matrix X^T X of a tall X) is read through its strides."""
    torch.manual_seed(1)
    X = torch.randn(2, 150, 70).to(dtype)  # tall
    assert _rel(syrk(X.mT), X.double().mT @ X.double()) < RTOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_syrk_epilogue_is_the_quintic_polynomial(interpreter, dtype):
    """``alpha S S + beta S`` (the quintic's b S + c S S) in one kernel, also written over S's
    own storage: against float64, exactly symmetric (by construction, as above), and the
    in-place result equals the out-of-place one (the same kernel on the same inputs: each
    program reads its tile of ``add`` before it writes the same tile)."""
    torch.manual_seed(2)
    X = torch.randn(2, 100, 160)
    S = (X @ X.mT / 160).to(dtype)
    a, b, c = NS5_COEFFICIENTS
    P = syrk(S, alpha=c, beta=b, add=S)
    want = c * (S.double() @ S.double()) + b * S.double()
    assert _rel(P, want) < 2 * RTOL[dtype]
    assert torch.equal(P, P.mT)
    into = S.clone()
    assert torch.equal(syrk(S, alpha=c, beta=b, add=into, out=into), P)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_syrk_mirrors_the_upper_triangle_of_the_epilogue(interpreter, dtype):
    """The lower triangle is the mirror of the upper one, diagonal tiles included: with an
    ``add`` whose triangles differ, the result is ``alpha A A^T + beta add`` with add's upper
    triangle reflected, exactly symmetric. (A kernel that wrote a diagonal tile's own lower
    triangle would fail here on any hardware, whatever its dot's summation order.)"""
    torch.manual_seed(5)
    A = torch.randn(2, 130, 24).to(dtype)
    D = torch.randn(2, 130, 130).to(dtype)
    C = syrk(A, alpha=0.5, beta=2.0, add=D)
    upper = D.double().triu()
    want = 0.5 * (A.double() @ A.double().mT) + 2.0 * (upper + upper.mT - upper.diagonal(dim1=-2, dim2=-1).diag_embed())
    assert torch.equal(C, C.mT)
    assert _rel(C, want) < 2 * RTOL[dtype]


def test_ns5_sym_through_the_kernel_equals_ns5(interpreter):
    """ns5_sym with the kernel (on while the interpreter is) is ns5 up to float32 round-off,
    wide, tall and square; in bf16 it stays in ns5's band."""
    for shape in [(2, 48, 96), (96, 48), (64, 64)]:
        V = conditioned(shape).float()
        assert usable(V)
        got = orthogonalize(V, "ns5_sym", dtype=torch.float32)
        torch.testing.assert_close(got, orthogonalize(V, "ns5", dtype=torch.float32), atol=2e-5, rtol=0)
    V = conditioned((96, 192)).float()
    s = sigma(orthogonalize(V, "ns5_sym"))
    assert s.min() > 0.6 and s.max() < 1.2


def test_iteration_uses_the_kernel_only_where_usable(monkeypatch):
    """Off the interpreter a CPU tensor takes the row strips; with it, the kernel."""
    calls = []
    real = triton_syrk.syrk

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("muonclip.fast._symmetric.syrk", counting)
    X = conditioned((2, 16, 40)).float()
    X = X / torch.linalg.matrix_norm(X, keepdim=True)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    strips = symmetric_quintic(X.clone(), [NS5_COEFFICIENTS] * 2)
    assert calls == []
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = symmetric_quintic(X.clone(), [NS5_COEFFICIENTS] * 2)
    assert len(calls) == 4  # S and P, each of 2 steps
    torch.testing.assert_close(kernel, strips, atol=1e-5, rtol=0)


def test_syrk_refuses_bad_input(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="CUDA device"):
        syrk(torch.zeros(1, 4, 4))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="batch"):
        syrk(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="out and add"):
        syrk(torch.zeros(1, 4, 6), out=torch.zeros(1, 6, 6))
    assert syrk(torch.zeros(0, 4, 6)).shape == (0, 4, 4)
    with pytest.raises(ValueError, match="computes in one of"):
        syrk(torch.zeros(1, 4, 6, dtype=torch.float64))
    assert not usable(torch.zeros(1, 4, 6, dtype=torch.float64))  # float64 keeps the row strips


def test_float32_tiles_follow_torchs_matmul_precision():
    """Full float32 products under torch's default ("highest"), TF32 only where torch allows it."""
    before = torch.get_float32_matmul_precision()
    try:
        assert triton_syrk._precision(torch.float32) == "ieee"
        torch.set_float32_matmul_precision("high")
        assert triton_syrk._precision(torch.float32) == ("ieee" if torch.version.hip else "tf32")
        assert triton_syrk._precision(torch.bfloat16) == "ieee"  # exact products; every backend takes it
    finally:
        torch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [9, 130, 1023, 1024, 4096, 14336])
def test_launch_config_fits_shared_memory(dtype, m):
    """The pipelined operand tiles plus the transposed output tile of the epilogue within 96 KiB
    (a consumer GPU allows 99 KiB a block), 16-bit operands within the 48 KiB every CUDA GPU
    allows by default; tile sides that tl.dot takes (powers of two, >= 16); 8 warps for the
    128-wide accumulator; at least 2 stages (the loads of one step overlap the other's products)."""
    block, block_k, warps, stages = triton_syrk.launch_config(m, dtype)
    operands = stages * 2 * block * block_k * dtype.itemsize
    assert operands + block * block * dtype.itemsize <= 96 * 2**10
    assert dtype == torch.float32 or operands <= 48 * 2**10
    assert block_k >= 16 and block_k & (block_k - 1) == 0 and block == triton_syrk.block_for(m)
    assert warps == (8 if block == 128 else 4) and 2 <= stages <= triton_syrk.STAGES
    if dtype != torch.float32 and block == 64:
        assert (block_k, stages) == (64, 3)  # 16-bit operands at the small tile: the widest step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", [(1, 2048, 2048), (2, 1024, 4096), (8, 384, 1536)])
def test_syrk_matches_cublas_on_cuda(monkeypatch, shape):
    """The compiled kernel (bf16, tensor cores) against cuBLAS's product, and ns5_sym's singular values
    those of ns5 on the same matrix (bf16 round-off apart). A fixed band was wrong here: on these
    matrices (singular values down to 0.02) five quintic steps leave ns5 itself at 0.57-1.203 on an
    H100, and ns5_sym matched it to four decimals."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    torch.manual_seed(3)
    A = (torch.randn(shape, device="cuda") / shape[-1] ** 0.5).bfloat16()
    assert _rel(syrk(A), A.double() @ A.double().mT) < RTOL[torch.bfloat16]
    V = conditioned(shape[1:]).cuda()
    s = sigma(orthogonalize(V, "ns5_sym").cpu())
    ref = sigma(orthogonalize(V, "ns5").cpu())
    assert (s - ref).abs().max() < 1e-2


def test_flops_count_the_tiles_computed():
    """m = 130 in tiles of 64: 3 x 3 tiles, 6 computed; m = 4096 in tiles of 128: 528 of 1024."""
    assert flops.triangle_fraction(130) == 6 / 9 and triton_syrk.block_for(130) == 64
    assert flops.triangle_fraction(4096) == 528 / 1024
    m, n = 4096, 14336
    f = 528 / 1024
    assert flops.symmetric_flops(m, n, 5, kernel=True) == int(5 * (f * 2 * m * m * n + f * 2 * m**3 + 2 * m * m * n))


@pytest.mark.parametrize(("dtype", "m"), [(torch.bfloat16, 130), (torch.float32, 4096)])
def test_kernel_compiles_for_cuda_gpus(monkeypatch, tmp_path, dtype, m):
    """The kernel is valid Triton for a GPU, not only for the interpreter: Triton compiles it,
    with the epilogue and the diagonal tiles' mirror, down to a cubin for an A100 (sm_80) and an
    H100 (sm_90), at the tile sizes `launch_config` picks (64-wide bf16 tiles, 128-wide float32 ones). No GPU is needed to compile (Triton
    ships its own ptxas); running it is `test_syrk_matches_cublas_on_cuda`'s job."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    block, block_k, warps, stages = triton_syrk.launch_config(m, dtype)
    ptr = {torch.float32: "*fp32", torch.bfloat16: "*bf16"}[dtype]
    signature = {"a_ptr": ptr, "d_ptr": ptr, "c_ptr": ptr, "M": "i32", "K": "i32",
                 **{name: "i32" for name in "s_ab s_am s_ak s_db s_dm s_dn s_cb s_cm s_cn".split()},
                 "alpha": "fp32", "beta": "fp32", **dict.fromkeys(("HAS_D", "WIDEN", "PRECISION", "BLOCK", "BLOCK_K"),
                                                                  "constexpr")}
    source = ASTSource(fn=triton_syrk._kernel(False), signature=signature,
                       constexprs={"HAS_D": True, "WIDEN": False, "PRECISION": "ieee", "BLOCK": block, "BLOCK_K": block_k})
    for capability in (80, 90):
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": warps, "num_stages": stages})
        assert compiled.asm["cubin"] and f".target sm_{capability}" in compiled.asm["ptx"]
