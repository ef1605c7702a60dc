"""The quintic's other forms: Gram Newton–Schulz (core), ``ns5_sym`` and ``ns5_compiled`` (muonclip.fast).

Each is checked against the float64 SVD polar factor within its documented band, against the
plain quintic it reorganises (equal in exact arithmetic: float64), and batched == looped.
"""

import pytest
import torch
from step_trace_loader import flops

import muonclip
from muonclip import orthogonalize
from muonclip.fast._symmetric import sym_gram
from muonclip.ortho import svd_polar
from muonclip.ortho._gram import default_restarts, gram_newton_schulz
from muonclip.ortho._newton_schulz import NS5_COEFFICIENTS, newton_schulz, polar_express_coefficients

NS5 = [NS5_COEFFICIENTS] * 5
# wide, tall (run from the right), batched, square (Gram falls back to the quintic), aspect 1.5
SHAPES = [(24, 96), (96, 24), (3, 16, 64), (2, 2, 40, 24), (32, 32), (20, 30)]


def conditioned(shape, lo=0.02, seed=0):
    """Random U diag(s) V^T (float64) with singular values log-spaced in [lo, 1]."""
    g = torch.Generator().manual_seed(seed)
    *batch, A, B = shape
    k = min(A, B)
    U, _ = torch.linalg.qr(torch.randn(*batch, A, k, generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(*batch, B, k, generator=g, dtype=torch.float64))
    s = torch.logspace(0, torch.log10(torch.tensor(lo)).item(), k, dtype=torch.float64)
    return (U * s) @ V.mT


def sigma(X):
    return torch.linalg.svdvals(X.double())


# ------------------------------------------------------------------------------------------
# exact-arithmetic equivalence with the plain quintic
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("restarts", [None, (), (2,), (1, 3)])
def test_gram_equals_quintic_in_float64(shape, restarts):
    V = conditioned(shape)
    ref = newton_schulz(V, NS5, dtype=torch.float64)
    out = gram_newton_schulz(V, NS5, dtype=torch.float64, restarts=restarts)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("steps", [5, 6, 8])
def test_gram_with_polar_express_coefficients_equals_polar_express_in_float64(steps):
    V = conditioned((2, 24, 80))
    ref = orthogonalize(V, "polar_express", steps=steps, dtype=torch.float64)
    out = gram_newton_schulz(V, polar_express_coefficients(steps), dtype=torch.float64, norm_scale=1.01)
    torch.testing.assert_close(out, ref, atol=1e-10, rtol=0)


@pytest.mark.parametrize("shape", SHAPES)
def test_symmetric_equals_quintic_in_float64(shape):
    V = conditioned(shape)
    torch.testing.assert_close(
        orthogonalize(V, "ns5_sym", dtype=torch.float64), orthogonalize(V, "ns5", dtype=torch.float64),
        atol=1e-10, rtol=0,
    )


@pytest.mark.parametrize("blocks", [1, 2, 3, 4, 7])
def test_sym_gram_is_x_xt(blocks):
    X = torch.randn(3, 29, 41, dtype=torch.float64)  # 29 rows: strips of unequal height
    torch.testing.assert_close(sym_gram(X, blocks), X @ X.mT, atol=1e-12, rtol=0)


@pytest.mark.parametrize("restarts", [None, (), (2,), (1, 2, 3, 4)])
def test_gram_flops_counts_the_products_made(monkeypatch, restarts):
    """gram_flops equals the flops of the bmm/baddbmm calls the iteration actually makes."""
    m, n, counted = 8, 40, []
    real_bmm, real_baddbmm = torch.bmm, torch.baddbmm

    def bmm(a, b, **kw):
        counted.append(2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2])
        return real_bmm(a, b, **kw)

    def baddbmm(c, a, b, **kw):
        counted.append(2 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2])
        return real_baddbmm(c, a, b, **kw)

    monkeypatch.setattr(torch, "bmm", bmm)
    monkeypatch.setattr(torch, "baddbmm", baddbmm)
    gram_newton_schulz(torch.randn(1, m, n), NS5, dtype=torch.float32, restarts=restarts)
    assert sum(counted) == flops.gram_flops(m, n, 5, restarts)
    assert flops.gram_flops(384, 1536, 5) < 0.7 * 5 * (4 * 384**2 * 1536 + 2 * 384**3)


def test_default_restarts():
    assert default_restarts(5) == (3,)
    assert default_restarts(8) == (2, 4, 6)


# ------------------------------------------------------------------------------------------
# documented bands against the SVD reference, in the default bf16
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["gram", "ns5_sym"])
@pytest.mark.parametrize("shape", [(48, 192), (192, 48), (4, 32, 96), (64, 64)])
def test_ns5_variants_bf16_in_ns5_band(method, shape):
    """Singular values in the quintic's plateau (about [0.68, 1.13]); singular vectors of V kept."""
    V = conditioned(shape).float()
    O = orthogonalize(V, method)
    assert O.dtype == V.dtype and O.shape == V.shape
    s = sigma(O)
    assert s.min() > 0.6 and s.max() < 1.2
    ref = (sigma(orthogonalize(V, "ns5")) - 1).abs().max()
    assert (s - 1).abs().max() < ref + 0.03  # as accurate as bf16 ns5, to bf16 noise
    # the polar factor of O is that of V: only the singular values were changed
    P = svd_polar(O.double())
    assert (P - svd_polar(V.double())).norm() / P.norm() < 0.05


@pytest.mark.parametrize("shape", [(48, 192), (192, 48), (3, 24, 72)])
def test_gram_polar_express_float32_within_one_percent(shape):
    V = conditioned(shape, lo=0.05).float()
    O = gram_newton_schulz(V, polar_express_coefficients(6), dtype=torch.float32, norm_scale=1.01)
    assert (sigma(O) - 1).abs().max() < 0.01


@pytest.mark.parametrize("lo", [0.05, 1e-3])
@pytest.mark.parametrize("shape", [(48, 192), (4, 96, 384)])
def test_gram_bf16_no_worse_than_ns5_bf16(shape, lo):
    """The documented bf16 band: at most 0.03 above plain bf16 ns5 (worst measured 0.017)."""
    for seed in (0, 1):
        V = conditioned(shape, lo=lo, seed=seed).float()
        ref = (sigma(orthogonalize(V, "ns5")) - 1).abs().max()
        assert (sigma(orthogonalize(V, "gram")) - 1).abs().max() < ref + 0.03


@pytest.mark.parametrize("method", ["gram", "ns5_sym"])
def test_zero_and_rank_one_stay_finite(method):
    """The zero matrix gives exact zeros on any machine: 0 / eps and every product of zeros are 0."""
    Z = torch.zeros(2, 16, 48)
    assert torch.equal(orthogonalize(Z, method), Z)
    r1 = torch.randn(16, 1, generator=torch.Generator().manual_seed(0)) @ torch.ones(1, 48)
    O = orthogonalize(r1, method)
    assert torch.isfinite(O).all() and 0.6 < sigma(O)[0] < 1.2
    # in float32 the null space stays empty (bf16 round-off is amplified there, as in plain ns5)
    s = sigma(orthogonalize(r1, method, dtype=torch.float32))
    assert 0.6 < s[0] < 1.2 and s[1:].max() < 1e-3


@pytest.mark.parametrize("method", ["gram", "ns5_sym"])
def test_batched_equals_looped(method):
    V = conditioned((5, 24, 72)).float()
    batched = orthogonalize(V, method, dtype=torch.float32)
    looped = torch.stack([orthogonalize(v, method, dtype=torch.float32) for v in V])
    torch.testing.assert_close(batched, looped, atol=1e-5, rtol=0)


def test_compiled_equals_eager():
    """ns5_compiled vs ns5: same maths, different fusion and rounding points.

    float32: equal to 1e-4. bf16: the two round at different places, so each is compared with
    the float32 result, within the bf16 tolerance of test_orthogonalize (0.03 relative).
    """
    V = conditioned((2, 16, 40)).float()
    hi = orthogonalize(V, "ns5", dtype=torch.float32)
    torch.testing.assert_close(orthogonalize(V, "ns5_compiled", dtype=torch.float32), hi, atol=1e-4, rtol=0)
    for method in ("ns5_compiled", "ns5"):
        assert (orthogonalize(V, method) - hi).norm() / hi.norm() < 0.03, method


def test_muon_runs_each_new_method():
    torch.manual_seed(0)
    for method in ["gram", "ns5_sym", "ns5_compiled"]:
        W = torch.nn.Parameter(torch.randn(16, 48))
        W0 = W.detach().clone()
        opt = muonclip.Muon([W], lr=0.1, method=method, weight_decay=0.0, adjust_lr_fn="unscaled")
        W.grad = conditioned((16, 48)).float()
        opt.step()
        s = sigma((W0 - W.detach()) / 0.1)
        assert s.min() > 0.6 and s.max() < 1.2, method


def test_compiled_method_does_not_recompile_when_hyperparameters_change():
    """method="ns5_compiled" compiles the orthogonalisation only: lr, weight decay and momentum
    are not graph inputs, so changing them between steps never recompiles (dynamo is told to
    raise on any recompile)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 40))
    opt = muonclip.Muon([p], lr=0.02, method="ns5_compiled", orth_dtype=torch.bfloat16)
    p.grad = torch.randn_like(p)
    opt.step()  # compiles once for (1, 16, 40) bf16
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lr, wd, mu in [(0.01, 0.1, 0.9), (0.003, 0.0, 0.5), (0.05, 0.01, 0.95)]:
            opt.param_groups[0].update(lr=lr, weight_decay=wd, momentum=mu)
            before = p.detach().clone()
            p.grad = torch.randn_like(p)
            opt.step()
            assert not torch.equal(p.detach(), before)
