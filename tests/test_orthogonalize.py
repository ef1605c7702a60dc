"""orthogonalize: each method against the float64 SVD polar factor, and its known bands."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from muonclip import orthogonalize
from muonclip.ortho import svd_polar

SHAPES = [(16, 16), (32, 96), (96, 32), (3, 24, 40), (2, 2, 40, 24)]


def well_conditioned(shape, lo=0.1, hi=1.0, seed=0):
    """Random matrices U diag(s) V^T with singular values s uniform in [lo, hi]."""
    g = torch.Generator().manual_seed(seed)
    *batch, A, B = shape
    k = min(A, B)
    U, _ = torch.linalg.qr(torch.randn(*batch, A, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(*batch, B, k, generator=g, dtype=torch.float64))
    s = lo + (hi - lo) * torch.rand(*batch, k, generator=g, dtype=torch.float64)
    return (U * s.unsqueeze(-2)) @ V.mT


def sigma(X):
    return torch.linalg.svdvals(X.double())


@pytest.mark.parametrize("shape", SHAPES)
def test_svd_equals_u_vt_of_float64_svd(shape):
    V = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    U, _, Vh = torch.linalg.svd(V, full_matrices=False)
    torch.testing.assert_close(orthogonalize(V, "svd"), U @ Vh, atol=1e-12, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_polar_express_six_steps_within_one_percent(shape):
    V = well_conditioned(shape).float()
    O = orthogonalize(V, "polar_express", steps=6, dtype=torch.float32)
    assert (sigma(O) - 1).abs().max() < 0.01


@pytest.mark.parametrize("shape", SHAPES)
def test_ns5_singular_values_in_known_band(shape):
    V = well_conditioned(shape, lo=0.02).float()
    s = sigma(orthogonalize(V, "ns5", dtype=torch.float32))
    # the quintic's designed plateau: about [0.68, 1.13], never converging to 1
    assert s.min() > 0.6 and s.max() < 1.2
    assert (s - 1).abs().max() > 0.05


@pytest.mark.parametrize("method", ["ns5", "polar_express"])
def test_default_bf16_close_to_fp32(method):
    V = well_conditioned((64, 128)).float()
    lo = orthogonalize(V, method)  # bf16 compute
    hi = orthogonalize(V, method, dtype=torch.float32)
    assert lo.dtype == V.dtype
    assert (lo - hi).norm() / hi.norm() < 0.03


@pytest.mark.parametrize("method", ["ns5", "polar_express", "svd"])
def test_batched_equals_looped(method):
    V = torch.randn(5, 24, 40, generator=torch.Generator().manual_seed(2))
    dtype = torch.float64 if method == "svd" else torch.float32
    batched = orthogonalize(V, method, dtype=dtype)
    looped = torch.stack([orthogonalize(v, method, dtype=dtype) for v in V])
    torch.testing.assert_close(batched, looped, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["ns5", "polar_express", "svd"])
def test_tall_is_transpose_of_wide(method):
    V = torch.randn(24, 40, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    dtype = torch.float64
    torch.testing.assert_close(orthogonalize(V.T, method, dtype=dtype), orthogonalize(V, method, dtype=dtype).T)


@pytest.mark.parametrize("method", ["ns5", "polar_express", "svd"])
def test_zero_matrix_gives_zeros(method):
    """Exact on any machine: 0 / eps and every product of zeros are 0."""
    Z = torch.zeros(3, 8, 5)
    out = orthogonalize(Z, method)
    assert torch.equal(out, torch.zeros_like(Z))


def test_rank_deficient_svd_zero_on_null_space():
    u = torch.randn(6, 1, dtype=torch.float64)
    v = torch.randn(1, 4, dtype=torch.float64)
    O = orthogonalize(u @ v, "svd")
    torch.testing.assert_close(O, (u / u.norm()) @ (v / v.norm()))


@settings(max_examples=40, deadline=None)
@given(
    A=st.integers(1, 12),
    B=st.integers(1, 12),
    log_scale=st.floats(-30, 30),
    method=st.sampled_from(["ns5", "polar_express", "svd"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_finite_input_never_gives_nan(A, B, log_scale, method, dtype):
    V = (torch.randn(A, B) * 10.0**log_scale).to(dtype)
    out = orthogonalize(V, method)
    assert out.shape == V.shape and out.dtype == V.dtype
    assert torch.isfinite(out).all()
    # orthogonalisation is scale-free: the spectral norm is about 1 (or 0 for a vanishing input)
    assert sigma(out).max() < 1.25


def test_svd_polar_is_unitary_on_full_rank():
    V = torch.randn(10, 7, dtype=torch.float64)
    O = svd_polar(V)
    torch.testing.assert_close(O.T @ O, torch.eye(7, dtype=torch.float64))


@pytest.mark.parametrize(
    "kwargs, error",
    [
        (dict(method="newton"), ValueError),
        (dict(method="svd", dtype=torch.bfloat16), ValueError),
        (dict(steps=0), ValueError),
        (dict(steps=2.5), ValueError),
        (dict(method="polar_express", coefficients=(1.0, 2.0, 3.0)), ValueError),
        (dict(method="svd", coefficients=(1.0, 2.0, 3.0)), ValueError),
        (dict(method="gram", coefficients=(1.0, 2.0)), ValueError),
    ],
)
def test_bad_arguments(kwargs, error):
    with pytest.raises(error):
        orthogonalize(torch.randn(4, 4), **kwargs)


def test_vector_and_complex_rejected():
    with pytest.raises(ValueError, match="matrix"):
        orthogonalize(torch.randn(4))
    with pytest.raises(TypeError, match="complex"):
        orthogonalize(torch.randn(4, 4, dtype=torch.complex64))


@pytest.mark.parametrize("method", ["ns5", "polar_express", "gram", "svd", "ns5_sym"])
@pytest.mark.parametrize(("dtype", "big"), [(torch.float32, 3e38), (torch.bfloat16, 3e38), (torch.float64, 1e300)])
def test_huge_finite_matrices_give_the_polar_factor_of_the_scaled_down_ones(method, dtype, big):
    """Entries near the dtype's largest value: the Frobenius norm's squares would overflow (inf norm,
    then 0 or NaN), so each matrix is first scaled by an exact power of two. The result is finite and
    equals that of the same matrices scaled down by 2^-100 (or 2^-900), which need no scaling (float32
    compute; a difference only from eps against the norm: 1e-6)."""
    import muonclip.fast  # noqa: F401  (registers ns5_sym)

    V = well_conditioned((3, 24, 40), seed=1)
    V = (V / V.abs().amax() * big).to(dtype)
    assert torch.isfinite(V).all()
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    O = orthogonalize(V, method, dtype=compute)
    small = V.double() * (2.0**-900 if dtype == torch.float64 else 2.0**-100)
    ref = orthogonalize(small.to(dtype), method, dtype=compute)
    assert torch.isfinite(O).all()
    assert (O.double() - ref.double()).abs().max() <= (1e-6 if dtype != torch.bfloat16 else 1e-2)


def test_the_overflow_scale_is_one_on_ordinary_inputs():
    """Exact on any hardware: multiplying by 1.0 changes no bit, so ordinary inputs are normalised as
    ``X / (||X||_F * norm_scale + eps)`` bit for bit; a huge matrix gets a power of two."""
    from muonclip.ortho._newton_schulz import normalized, overflow_scale

    V = torch.randn(4, 24, 40) * 1e6
    assert torch.equal(overflow_scale(V), torch.ones(4, 1, 1))
    plain = V / (torch.linalg.vector_norm(V, dim=(-2, -1), keepdim=True) * 1.01 + 1e-7)
    assert torch.equal(normalized(V, torch.float32, 1e-7, 1.01), plain)
    huge = torch.full((1, 24, 40), 3e38)
    s = overflow_scale(huge)  # 3e38 < 2^128, brought below 2^E, E = (127 - ceil(log2 960)) // 2 = 58
    assert float(s) == 2.0**-70
    assert torch.isfinite(torch.linalg.vector_norm(huge * s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_the_overflow_scale_reads_the_largest_magnitude_exactly(dtype):
    """The scale comes from max |x| of each matrix, read as the larger of max x and -min x: the
    power of two of the formula in `overflow_scale`'s docstring, computed here from the exact
    ``vector_norm(ord=inf)``, for every matrix of a batch whose largest magnitude is positive,
    negative, huge, tiny, zero, or of a matrix holding inf or NaN (as the reference reads them)."""
    import math

    from muonclip.ortho._newton_schulz import overflow_scale

    big = torch.finfo(dtype).max
    X = torch.randn(8, 6, 10, generator=torch.Generator().manual_seed(0)).to(dtype)
    X[1, 2, 3] = -big  # the largest magnitude is a negative entry
    X[2, 4, 1] = big
    X[3] *= 1e-30 if dtype != torch.float16 else 1e-4
    X[4] = 0
    X[5, 0, 0] = -float("inf")
    X[6, 5, 9] = float("nan")
    X[7, 3, 3] = -0.5 * big
    A, B = X.shape[-2:]
    E = (math.frexp(big)[1] - 1 - math.ceil(math.log2(A * B))) // 2
    _, exponent = torch.frexp(torch.linalg.vector_norm(X, ord=math.inf, dim=(-2, -1), keepdim=True))
    want = torch.ldexp(torch.ones(8, 1, 1, dtype=dtype), (E - exponent).clamp(max=0))
    got = overflow_scale(X)
    assert torch.equal(got, want)
    assert float(got[0]) == float(got[4]) == 1.0 and float(got[1]) < 1.0 and float(got[7]) < 1.0


def test_orthogonalize_refuses_nonfinite_input_bad_eps_and_integer_matrices():
    V = torch.randn(8, 12)
    for bad in (float("nan"), float("inf"), -float("inf")):
        W = V.clone()
        W[3, 4] = bad
        with pytest.raises(ValueError, match="needs finite matrices: V holds NaN or inf"):
            orthogonalize(W)
        with pytest.raises(ValueError, match="needs finite matrices"):
            orthogonalize(W.bfloat16(), "svd", dtype=torch.float32)
    for eps in (0.0, -1e-7, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="eps must be a finite number > 0"):
            orthogonalize(V, eps=eps)
    for dtype in (torch.int64, torch.int32, torch.uint8, torch.bool):
        with pytest.raises(TypeError, match="works on floating-point matrices"):
            orthogonalize(V.to(dtype))
