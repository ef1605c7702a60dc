"""Fast orthogonalisation (Gram, symmetric, compiled) and the sync-free non-finite guard.

Each new method is checked against the float64 SVD polar factor within its documented band,
against the plain quintic it reorganises (equal in exact arithmetic: float64), batched ==
looped, and `Muon.step()` with ``on_nonfinite="mask"`` is checked to read no tensor value on
the host while keeping non-finite gradients away from weights and state.
"""

import copy

import pytest
import torch

import muonclip
from muonclip import orthogonalize
from muonclip.optim.nonfinite import MaskedStep, StepGate, nonfinite_flag, nonfinite_indices
from muonclip.ortho import chunks, svd_polar
from muonclip.ortho import scratch as scratch_buffers
from muonclip.ortho.gram import default_restarts, gram_flops, gram_newton_schulz
from muonclip.ortho.newton_schulz import (
    NS5_COEFFICIENTS,
    newton_schulz,
    polar_express_coefficients,
    quintic_iteration,
)
from muonclip.ortho.scratch import kept
from muonclip.ortho.symmetric import sym_gram

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
    assert sum(counted) == gram_flops(m, n, 5, restarts)
    assert gram_flops(384, 1536, 5) < 0.7 * 5 * (4 * 384**2 * 1536 + 2 * 384**3)


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


@pytest.mark.parametrize("method", ["ns5", "gram", "ns5_sym", "polar_express"])
@pytest.mark.parametrize("shape", [(7, 24, 72), (7, 72, 24), (24, 24)])
@pytest.mark.parametrize("chunk", [None, 1])
def test_result_buffer_holds_the_same_result(monkeypatch, method, shape, chunk):
    """``buffer=``: the result is a view of the caller's buffer with the very same values
    (bit for bit), in one call and in CPU chunks, wide and tall; the input is untouched.

    Bit for bit on any machine: both calls make the same products on the same values, chunked alike;
    only where the result is written differs."""
    monkeypatch.setattr(chunks, "CPU_CHUNK", chunk)
    V = conditioned(shape).to(torch.bfloat16)
    V0 = V.clone()
    want = orthogonalize(V, method)
    buffer = torch.full((V.numel() + 5,), float("nan"), dtype=torch.bfloat16)
    got = orthogonalize(V, method, buffer=buffer)
    assert torch.equal(got, want) and torch.equal(V, V0)
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    assert start <= got.data_ptr() < end and torch.isnan(buffer[V.numel():]).all()


@pytest.mark.parametrize("method", ["ns5", "gram", "polar_express"])
@pytest.mark.parametrize("shape", [(7, 24, 72), (7, 72, 24), (7, 24, 24)])
@pytest.mark.parametrize("chunk", [None, 3])
def test_scratch_keeps_temporaries_and_changes_nothing(monkeypatch, method, shape, chunk):
    """``scratch=``: the same result bit for bit; its buffers hold the temporaries and are
    reused (not reallocated) by the next call of the same shape; a smaller call reuses them.

    Bit for bit on any machine: the same products on the same values; only where the temporaries
    live differs."""
    monkeypatch.setattr(chunks, "CPU_CHUNK", chunk)
    monkeypatch.setattr(scratch_buffers, "KEEP_BYTES", 0)  # keep even these small temporaries
    V = conditioned(shape).to(torch.bfloat16)
    want = orthogonalize(V, method)
    scratch = {}
    assert torch.equal(orthogonalize(V, method, scratch=scratch), want)
    roles = {role for role, _ in scratch}
    assert {"ns.in", "ns.S" if method != "gram" or shape[-1] == shape[-2] else "ns.R"} <= roles
    ptrs = {k: v.data_ptr() for k, v in scratch.items()}
    assert torch.equal(orthogonalize(V, method, scratch=scratch), want)
    assert torch.equal(orthogonalize(V[:2], method, scratch=scratch), orthogonalize(V[:2], method))
    assert {k: v.data_ptr() for k, v in scratch.items()} == ptrs


@pytest.mark.parametrize("steps", [1, 2, 5, 6])
@pytest.mark.parametrize("shape", [(3, 16, 40), (3, 40, 16), (3, 16, 16)])
@pytest.mark.parametrize("given", ["none", "out", "out+scratch"])
def test_quintic_ping_pong_equals_the_plain_loop(monkeypatch, steps, shape, given):
    """The quintic's steps alternate between the input and the result (odd and even step
    counts, wide, tall and square, with and without ``out``/``scratch``): bit for bit the plain
    loop of fresh ``baddbmm`` results, and the result lands in ``out``.

    Bit for bit on any machine: gram and small_side are these very bmm/baddbmm calls, on the same
    operands in the same layouts; the iteration only writes them into other storage."""
    monkeypatch.setattr(scratch_buffers, "KEEP_BYTES", 0)
    torch.manual_seed(steps)
    X0 = torch.randn(shape)
    X0 = (X0 / torch.linalg.matrix_norm(X0, keepdim=True)).to(torch.bfloat16)
    coeffs = polar_express_coefficients(steps)
    want = X0.clone()
    for a, b, c in coeffs:
        tall = want.shape[-2] > want.shape[-1]
        S = want.mT @ want if tall else want @ want.mT
        P = torch.baddbmm(S, S, S, beta=b, alpha=c)
        want = torch.baddbmm(want, want, P, beta=a) if tall else torch.baddbmm(want, P, want, beta=a)
    out = None if given == "none" else torch.full(shape, float("nan"), dtype=torch.bfloat16)
    scratch = {} if given == "out+scratch" else None
    got = quintic_iteration(X0.clone(), coeffs, out=out, scratch=scratch)
    assert torch.isfinite(want).all() and torch.equal(got, want)
    assert out is None or got.data_ptr() == out.data_ptr()
    if scratch is not None:  # a third X-sized buffer only for step 0 of an even count
        assert (("ns.X", torch.bfloat16) in scratch) == (steps % 2 == 0)


@pytest.mark.parametrize("method", ["ns5", "gram", "polar_express"])
@pytest.mark.parametrize("chunk", [None, 3])
def test_overwrite_changes_only_the_input(monkeypatch, method, chunk):
    """``overwrite=True``: the same result bit for bit, with V's storage used as a working
    buffer; without it a bf16 V is left as it was, and so is a float32 V (its bf16 copy is the
    one normalised in place).

    Bit for bit on any machine: the same products on the same values (the float32 V's bf16 copy is
    the bf16 V); only the storage differs."""
    monkeypatch.setattr(chunks, "CPU_CHUNK", chunk)
    V32 = conditioned((7, 24, 72)).float()
    V = V32.to(torch.bfloat16)
    keep, keep32 = V.clone(), V32.clone()
    want = orthogonalize(V, method, scratch={})
    assert torch.equal(V, keep)
    assert torch.equal(orthogonalize(V32, method, scratch={}, out_dtype=torch.bfloat16), want)
    assert torch.equal(V32, keep32)
    got = orthogonalize(V, method, scratch={}, overwrite=True)
    assert torch.equal(got, want) and not torch.equal(V, keep)


def test_overwrite_survives_the_timed_chunk_choice(monkeypatch):
    """The chunk choice runs the batch several times: with ``overwrite=True`` those runs still
    leave V intact (only the final run normalises it in place), so the result is unchanged.

    Bit for bit by construction: the chunk choice only takes chunkings whose result equals the whole
    batch's bit for bit."""
    V = conditioned((6, 24, 72)).to(torch.bfloat16)
    monkeypatch.setattr(chunks, "CPU_CHUNK", 6)
    want = orthogonalize(V, "ns5")
    monkeypatch.setattr(chunks, "CPU_CHUNK", None)
    monkeypatch.setattr(chunks, "CPU_CHUNK_BYTES", 1)  # time even this small batch
    monkeypatch.setattr(chunks, "_CHOSEN", {})
    got = orthogonalize(V.clone(), "ns5", overwrite=True)
    assert len(chunks._CHOSEN) == 1  # a choice was timed
    assert torch.equal(got, want)


@pytest.mark.parametrize("method", ["ns5", "gram", "polar_express", "ns5_sym"])
def test_orthogonalize_stays_differentiable(method):
    """A V that requires grad (outside no_grad): no out= or in-place step, so backward works,
    and the result is the no-grad result bit for bit.

    Bit for bit on any machine: the differentiable path makes the same products on the same values,
    into new tensors instead of out= buffers."""
    V = conditioned((2, 16, 40)).float().requires_grad_()
    O = orthogonalize(V, method)
    O.square().sum().backward()
    assert V.grad is not None and torch.isfinite(V.grad).all() and V.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(O.detach(), orthogonalize(V, method))


def test_kept_buffers(monkeypatch):
    monkeypatch.setattr(scratch_buffers, "KEEP_BYTES", 0)
    scratch = {}
    a = kept(scratch, "x", (2, 3), torch.float32, torch.device("cpu"))
    assert a.shape == (2, 3) and scratch[("x", torch.float32)].numel() == 6
    b = kept(scratch, "x", (2, 3), torch.float32, torch.device("cpu"), avoid=a)  # the role's second buffer
    assert b.data_ptr() != a.data_ptr() and ("x'", torch.float32) in scratch
    assert kept(scratch, "x", (2, 3), torch.float32, torch.device("cpu"), avoid=b).data_ptr() == a.data_ptr()
    assert kept(scratch, "x", (4, 3), torch.float32, torch.device("cpu")).numel() == 12  # grown
    assert kept(scratch, "x", (2,), torch.bfloat16, torch.device("cpu")).dtype == torch.bfloat16  # per dtype
    assert kept(None, "x", (2,), torch.float32, torch.device("cpu")) is None
    assert kept(scratch, "y", (2,), torch.float32, torch.device("meta")) is None  # off the CPU: allocate as usual
    monkeypatch.setattr(scratch_buffers, "KEEP_BYTES", 1024)
    assert kept(scratch, "z", (255,), torch.float32, torch.device("cpu")) is None  # small: allocate as usual
    assert kept(scratch, "z", (256,), torch.float32, torch.device("cpu")).numel() == 256


def test_result_buffer_ignored_or_refused():
    """An ignored buffer leaves the very same computation: equal bit for bit."""
    V = conditioned((24, 40)).float()
    buffer = torch.zeros(V.numel(), dtype=torch.float32)
    # svd cannot write there, and a float32 result from a bf16 computation is a cast: ignored
    for method, kw in [("svd", {"dtype": torch.float32}), ("ns5", {})]:
        got = orthogonalize(V, method, buffer=buffer, **kw)
        assert torch.equal(got, orthogonalize(V, method, **kw)) and not buffer.any()
    for bad in (torch.zeros(V.numel() - 1, dtype=torch.bfloat16), torch.zeros(V.numel(), dtype=torch.float16),
                torch.zeros(2 * V.numel(), dtype=torch.bfloat16)[::2]):
        with pytest.raises(ValueError, match="buffer must be a contiguous"):
            orthogonalize(V, "ns5", out_dtype=torch.bfloat16, buffer=bad)


def test_muon_reuses_its_cpu_buffers_across_steps_and_buckets(monkeypatch):
    """One process on CPU: every bucket's input and result come from the same two buffers, and
    Newton–Schulz's temporaries from buffers of their own, step after step (no multi-MB
    allocation per step); they are scratch, not state: a deepcopy starts without them, and
    results equal a step without them.

    Bit for bit on any machine: both optimizers form the same batches and make the same products on
    the same values; only the storage differs."""
    monkeypatch.setattr(scratch_buffers, "KEEP_BYTES", 0)  # small matrices: keep them all the same
    torch.manual_seed(0)
    shapes = [(32, 32)] * 3 + [(64, 32), (32, 64), (48, 32)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    split = [{"params": params[:5]}, {"params": params[5:], "split_sizes": [16, 8, 24]}]
    opt = muonclip.Muon(split, lr=0.02, weight_decay=0.1)
    ref = muonclip.Muon([{"params": twin[:5]}, {"params": twin[5:], "split_sizes": [16, 8, 24]}],
                        lr=0.02, weight_decay=0.1)
    ref._workspace = None  # no reuse: fresh buffers every bucket
    ptrs = None
    for _ in range(3):
        for p, q in zip(params, twin):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        now = {k: v.data_ptr() for k, v in opt._workspace.items() if k != "structure"}
        # ns5's 5 steps ping-pong between the normalised input and the result: no third X
        # buffer; "v": Nesterov's V in float32, cast into the bf16 input
        # and the bucket is normalised in place (overwrite=True): no "ns.in" either
        assert set(k[0] for k in now) == {"input", "result", "v", "ns.S", "ns.P"}
        assert ptrs is None or now == ptrs
        ptrs = now
    for p, q in zip(params, twin):
        assert torch.equal(p, q)
    assert copy.deepcopy(opt)._workspace == {}


def test_step_structure_is_cached_and_rebuilt_when_an_option_changes():
    """The plan, buckets and update scales are built once and reused while shapes and options
    stay; lr, weight decay and momentum are read every step; changing a structural option
    (method, update_scale, split_sizes) rebuilds them. Every step equals, bit for bit, an
    optimizer that rebuilds everything each step.

    Bit for bit on any machine: a cached structure describes the same batches and scales, so the
    same ops run on the same values."""
    torch.manual_seed(0)
    shapes = [(32, 32), (32, 32), (64, 32), (48, 32)]
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = muonclip.Muon([{"params": params[:3]}, {"params": params[3:]}], lr=0.02, weight_decay=0.1)
    ref = muonclip.Muon([{"params": twin[:3]}, {"params": twin[3:]}], lr=0.02, weight_decay=0.1)
    ref._workspace = None  # nothing cached
    changes = [
        None, None,
        lambda o: o.param_groups[0].update(lr=0.05, weight_decay=0.3, momentum=0.8),
        lambda o: o.param_groups[0].update(method="gram"),
        lambda o: o.param_groups[1].update(update_scale="shape"),
        lambda o: o.param_groups[1].update(split_sizes=[16, 32]),
    ]
    seen = []
    for change in changes:
        if change is not None:
            change(opt)
            change(ref)
        for p, q in zip(params, twin):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        seen.append(opt._workspace["structure"][1])
        for p, q in zip(params, twin):
            assert torch.equal(p, q)
    assert seen[1] is seen[0] and seen[2] is seen[0]  # same structure; lr/wd/momentum still applied
    assert len({id(s) for s in seen[2:]}) == 4  # each structural change rebuilt it
    assert [len(b.entries) for b in seen[-1].buckets] == [2, 1, 1, 1]  # 32x32 x2, 64x32, 16x32, 32x32 block
    assert seen[-1].scaled[2] == (0, [(0, 64, pytest.approx(0.2 * 64**0.5))])  # "rms": 0.2 sqrt(max(A, B))
    # "shape": sqrt(max(1, A / B)) per block, 1 for both, so their row ranges merge into one add
    assert seen[-1].scaled[3] == (0, [(0, 48, 1.0)])


@pytest.mark.parametrize("method", ["gram", "ns5_sym"])
def test_batched_equals_looped(method):
    V = conditioned((5, 24, 72)).float()
    batched = orthogonalize(V, method, dtype=torch.float32)
    looped = torch.stack([orthogonalize(v, method, dtype=torch.float32) for v in V])
    torch.testing.assert_close(batched, looped, atol=1e-5, rtol=0)


@pytest.mark.parametrize("method", ["ns5", "gram", "ns5_sym", "polar_express"])
@pytest.mark.parametrize("shape", [(7, 24, 72), (7, 72, 24), (7, 24, 24)])
def test_cpu_chunks_equal_one_call(monkeypatch, method, shape):
    """CPU batches run in chunks written into one result: same values as one call.

    Forced chunks agree to float32 round-off only (a batched product over 1 or 3 matrices need not
    round as one over 7 does); the timed choice is bit-identical by construction (a chunking is
    eligible only if its result equals the whole batch's)."""
    V = conditioned(shape).float()
    monkeypatch.setattr(chunks, "CPU_CHUNK", 7)  # the whole batch
    whole = orthogonalize(V, method, dtype=torch.float32)
    results = []
    for k in (1, 3, None):  # one matrix per chunk; 3, 3, 1; the timed choice
        monkeypatch.setattr(chunks, "CPU_CHUNK", k)
        results.append(orthogonalize(V, method, dtype=torch.float32))
    for got in results:
        assert got.shape == V.shape
        torch.testing.assert_close(got, whole, atol=1e-6, rtol=0)
    # the timed choice, made for real (a budget of 3 matrices, so that this batch is timed),
    # only takes chunkings that are bit-identical to the whole batch
    m, n = sorted(shape[1:])
    monkeypatch.setattr(chunks, "CPU_CHUNK_BYTES", 3 * chunks.working_set(m, n, torch.float32))
    monkeypatch.setattr(chunks, "_CHOSEN", {})
    assert torch.equal(orthogonalize(V, method, dtype=torch.float32), whole)
    assert len(chunks._CHOSEN) == 1


def test_chunk_candidates():
    """The whole batch first, then the cache-sized chunk and multiples of the thread count."""
    # (2 * 24 * 72 + 2 * 24 * 24) * 4 bytes = 18432 a matrix: 227 fit in 4 MiB
    assert chunks.candidates(7, 24, 72, torch.float32, threads=2) == [7, 2, 4]
    assert chunks.candidates(24, 384, 384, torch.bfloat16, threads=2) == [24, 2, 3, 4, 8, 16]
    assert chunks.candidates(24, 384, 384, torch.bfloat16, threads=1) == [24, 1, 2, 3, 4, 8, 16]
    assert chunks.candidates(6, 384, 1536, torch.bfloat16, threads=2) == [6, 1, 2, 4]
    assert chunks.candidates(2, 384, 1536, torch.bfloat16, threads=4) == [2, 1]


class _FakeRuns:
    """``attempt`` for `chunks.choose_chunk` with a fake clock: candidate k costs ``cost[k]``
    seconds (default 0.01) and returns ``result[k]`` (default: the whole batch's value)."""

    def __init__(self, monkeypatch, cost, result=None):
        self.now, self.calls, self.cost, self.result = 0.0, [], cost, result or {}
        monkeypatch.setattr(chunks, "_clock", lambda: self.now)
        monkeypatch.setattr(chunks, "_CHOSEN", {})

    def __call__(self, k):
        self.calls.append(k)
        self.now += self.cost.get(k, 0.01)
        return self.result.get(k, torch.zeros(3))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_chunk_choice_is_the_fastest_equal_result_and_is_kept(monkeypatch, two_threads):
    X = torch.zeros(24, 384, 384, dtype=torch.bfloat16)
    cands = chunks.candidates(24, 384, 384, torch.bfloat16, threads=2)  # [24, 2, 3, 4, 8, 16]
    cost = {k: 0.01 for k in cands}
    fastest, different, close = cands[-1], cands[-2], cands[-3]
    cost[fastest], cost[different] = 0.004, 0.001  # `different` is faster still, but its result differs
    runs = _FakeRuns(monkeypatch, cost, {different: torch.ones(3)})
    assert chunks.choose_chunk(X, quintic_iteration, 5, runs) == fastest
    eligible = [k for k in cands if k != different]
    assert runs.calls == cands + eligible * (chunks.TUNE_ROUNDS - 1)  # the odd one timed once, then dropped
    n = len(runs.calls)
    assert chunks.choose_chunk(X, quintic_iteration, 5, runs) == fastest and len(runs.calls) == n  # kept
    # another step count, thread count or iteration is another choice
    assert chunks.choose_chunk(X, quintic_iteration, 6, runs) == fastest and len(runs.calls) == 2 * n
    torch.set_num_threads(1)
    chunks.choose_chunk(X, quintic_iteration, 6, runs)
    assert len(runs.calls) > 2 * n
    # a chunking is taken over the whole batch only when clearly faster
    cost = {k: 0.01 for k in cands} | {close: 0.01 * chunks.TUNE_MARGIN * 1.01}
    assert chunks.choose_chunk(X, quintic_iteration, 5, _FakeRuns(monkeypatch, cost)) == 24
    cost[close] = 0.01 * chunks.TUNE_MARGIN * 0.99
    assert chunks.choose_chunk(X, quintic_iteration, 5, _FakeRuns(monkeypatch, cost)) == close


def test_chunk_choice_skips_timing_where_it_cannot_matter(monkeypatch):
    runs = _FakeRuns(monkeypatch, {k: 1.0 for k in range(1, 25)})
    # a whole-batch run slower than TUNE_SECONDS: the whole batch, nothing else timed
    assert chunks.choose_chunk(torch.zeros(24, 384, 384), quintic_iteration, 5, runs) == 24
    assert runs.calls == [24]
    # one matrix, a fixed CPU_CHUNK, and a GPU batch (meta stands in for it) are never timed
    assert chunks.choose_chunk(torch.zeros(1, 8, 8), quintic_iteration, 5, runs) == 1
    monkeypatch.setattr(chunks, "CPU_CHUNK", 5)
    assert chunks.choose_chunk(torch.zeros(24, 8, 8), quintic_iteration, 5, runs) == 5
    monkeypatch.setattr(chunks, "CPU_CHUNK", None)
    assert chunks.choose_chunk(torch.zeros(24, 8, 8, device="meta"), quintic_iteration, 5, runs) == 24
    # a batch whose working set fits in CPU_CHUNK_BYTES: the whole batch, untimed
    assert chunks.choose_chunk(torch.zeros(24, 64, 64), quintic_iteration, 5, runs) == 24
    assert runs.calls == [24]


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
        opt = muonclip.Muon([W], lr=0.1, method=method, weight_decay=0.0, update_scale="none")
        W.grad = conditioned((16, 48)).float()
        opt.step()
        s = sigma((W0 - W.detach()) / 0.1)
        assert s.min() > 0.6 and s.max() < 1.2, method


# ------------------------------------------------------------------------------------------
# non-finite gradients without a host sync
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_detection(bad, dtype):
    grads = [torch.randn(4, 5, dtype=dtype), torch.zeros(0, 3, dtype=dtype), torch.randn(7, dtype=dtype)]
    assert nonfinite_indices(grads) == [] and not nonfinite_flag(grads)
    grads[2][3] = bad
    assert nonfinite_indices(grads) == [2] and nonfinite_flag(grads)
    assert torch.equal(nonfinite_flag(grads), torch.tensor(True))


def _model():
    torch.manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(12, 20)),  # muon
        torch.nn.Parameter(torch.randn(3, 8, 6)),  # muon, stacked experts
        torch.nn.Parameter(torch.randn(20)),  # adamw
    ]


def _opt(params, mode):
    return muonclip.Muon(
        [{"params": params[:2]}, {"params": params[2:], "algorithm": "adamw"}], lr=0.05, on_nonfinite=mode
    )


def _grads(params, step, bad=False):
    g = torch.Generator().manual_seed(step)
    out = [torch.randn(p.shape, generator=g) for p in params]
    if bad:
        out[1][1, 2, 3] = float("nan")
    return out


def _set(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.clone()


@pytest.mark.parametrize("bad_step", [0, 2])
def test_mask_leaves_weights_and_state_untouched(bad_step):
    """Exact on any machine: a masked step multiplies by exactly 1 and adds exactly 0 (the gradients are
    zeroed), IEEE."""
    params = _model()
    opt = _opt(params, "mask")
    for step in range(4):
        before_w = [p.detach().clone() for p in params]
        before_state = copy.deepcopy(opt.state_dict()["state"])
        _set(params, _grads(params, step, bad=step == bad_step))
        opt.step()
        if step == bad_step:
            assert all(torch.equal(a, p) for a, p in zip(before_w, params))
            after = opt.state_dict()["state"]
            for k, st in after.items():
                for key, v in st.items():
                    if key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
                        ref = before_state[k][key] if k in before_state else torch.zeros_like(v)
                        assert torch.equal(v, ref), (k, key)
        else:
            assert not torch.equal(before_w[0], params[0])
        assert all(torch.isfinite(p).all() for p in params)
    assert opt.steps_skipped == 1
    assert opt.state_dict()["muonclip"]["steps_skipped"] == 1


def test_mask_matches_skip_on_muon_parameters():
    """Masking a step gives bit-identical Muon weights to skipping it on the host.

    Bit for bit: the masked step is an exact no-op, and on finite steps the gated coefficients round
    as the plain scalars do (test_step_gate_rounds_like_the_plain_scalars), with the same batches
    and kernels in both."""
    a, b = _model(), _model()
    oa, ob = _opt(a, "mask"), _opt(b, "skip")
    for step in range(4):
        grads = _grads(a, step, bad=step == 1)
        _set(a, grads)
        _set(b, grads)
        oa.step()
        ob.step()
    for pa, pb in zip(a[:2], b[:2]):
        assert torch.equal(pa, pb)
    assert oa.steps_skipped == ob.steps_skipped == 1


class _HostReads:
    """Count the Tensor methods that copy a value to the host (a sync on GPU)."""

    NAMES = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")

    def __init__(self, monkeypatch):
        self.calls: list[str] = []
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)

            def wrapper(t, *a, _real=real, _name=name, **k):
                self.calls.append(_name)
                return _real(t, *a, **k)

            monkeypatch.setattr(torch.Tensor, name, wrapper)


@pytest.mark.parametrize("method", ["ns5", "gram"])
def test_mask_mode_step_reads_nothing_on_the_host(monkeypatch, method):
    params = _model()
    opt = muonclip.Muon(
        [{"params": params[:2], "method": method}, {"params": params[2:], "algorithm": "adamw"}],
        lr=0.05, on_nonfinite="mask",
    )
    _set(params, _grads(params, 0))
    opt.step()  # first step creates state
    reads = _HostReads(monkeypatch)
    for step in (1, 2):
        _set(params, _grads(params, step, bad=step == 2))
        opt.step()
    assert reads.calls == []
    raise_opt = _opt(_model(), "raise")
    _set(raise_opt.param_groups[0]["params"] + raise_opt.param_groups[1]["params"], _grads(params, 3))
    raise_opt.step()
    assert reads.calls, "the counter must see the host sync of on_nonfinite='raise'"


def test_masked_step_guard_alone():
    """Exact: zeroing and restoring are copies."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 2.0])
    state = {"buf": torch.full((3,), 5.0), "step": 3}
    guard = MaskedStep([p], [state])
    assert torch.equal(p.grad, torch.zeros(3))
    with torch.no_grad():
        p.add_(1.0)
        state["buf"].mul_(2.0)
    guard.restore()
    assert torch.equal(p, torch.ones(3)) and torch.equal(state["buf"], torch.full((3,), 5.0))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lr", ["float", "cpu tensor"])
def test_mask_mode_no_cuda_sync(lr):
    """A masked step on CUDA, with lr a float or a 0-D CPU tensor (as for compiled steps), makes
    no host sync."""
    params = [torch.nn.Parameter(t.cuda()) for t in _model()]
    opt = _opt(params, "mask")
    if lr == "cpu tensor":
        for g in opt.param_groups:
            g["lr"] = torch.tensor(g["lr"])
    _set(params, [g.cuda() for g in _grads(params, 0)])
    opt.step()
    _set(params, [g.cuda() for g in _grads(params, 1, bad=True)])
    torch.cuda.set_sync_debug_mode("error")
    try:
        opt.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert opt.steps_skipped == 1


def test_compiled_method_does_not_recompile_when_hyperparameters_change():
    """method="ns5_compiled" compiles the orthogonalisation only: lr, weight decay and momentum
    are not graph inputs, so changing them between steps never recompiles (dynamo is told to
    raise on any recompile)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(16, 40))
    opt = muonclip.Muon([p], lr=0.02, method="ns5_compiled")
    p.grad = torch.randn_like(p)
    opt.step()  # compiles once for (1, 16, 40) bf16
    with torch._dynamo.config.patch(error_on_recompile=True):
        for lr, wd, mu in [(0.01, 0.1, 0.9), (0.003, 0.0, 0.5), (0.05, 0.01, 0.95)]:
            opt.param_groups[0].update(lr=lr, weight_decay=wd, momentum=mu)
            before = p.detach().clone()
            p.grad = torch.randn_like(p)
            opt.step()
            assert not torch.equal(p.detach(), before)


def test_mask_mode_copies_nothing_and_equals_the_default_on_finite_steps(monkeypatch):
    """Mask mode gates every update on the device instead of copying: the guard keeps no
    copies, a masked step leaves every weight and state tensor bit-identical, and on finite
    steps every parameter (Muon and AdamW branches, float32) is bit-identical to the default
    mode's.

    Why bit for bit: test_step_gate_rounds_like_the_plain_scalars; the two optimizers form the same
    batches and run the same kernels."""
    guards = []

    class Spy(MaskedStep):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            guards.append(self)

    monkeypatch.setattr(muonclip.optim.muon, "MaskedStep", Spy)
    params, twin = _model(), _model()
    opt, ref = _opt(params, "mask"), _opt(twin, "raise")
    for step in range(3):
        grads = _grads(params, step)
        _set(params, grads)
        _set(twin, grads)
        opt.step()
        ref.step()
        for p, q in zip(params, twin):
            assert torch.equal(p, q)
    assert len(guards) == 3 and all(g._tensors == [] for g in guards)  # nothing copied
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)})
              for p in params]
    _set(params, _grads(params, 3, bad=True))
    opt.step()
    for p, (w, st) in zip(params, before):
        assert torch.equal(p, w)
        assert all(torch.equal(opt.state[p][k], v) for k, v in st.items())


def test_step_gate_rounds_like_the_plain_scalars():
    """StepGate's 0-D coefficients give bit-identical results to Python scalars when the flag is
    clear (addcmul vs add with alpha, mul by a 0-D tensor vs a float), and exact no-ops when set.

    Why on any CPU: ATen computes add(alpha=) and addcmul with the same rounding in each of its CPU
    kernel builds, one fused multiply-add in the AVX2 and AVX512 ones and a multiply then an add in
    the DEFAULT one (checked under ATEN_CPU_CAPABILITY=default, avx2 and avx512), and a 0-D float32
    tensor multiplies as the float32 scalar does; x * 1 = x and x + 0 * y = x in IEEE. (On a GPU
    this is not checked: the CUDA test only asks for no sync.)"""
    g = torch.Generator().manual_seed(0)
    G, M, W = (torch.randn(64, 48, generator=g) for _ in range(3))
    O = torch.randn(64, 48, generator=g).bfloat16()
    mu, decay, alpha = 0.95, 1 - 0.02 * 0.1, -0.02 * 0.2 * 48**0.5
    clear, set_ = StepGate(torch.tensor(False)), StepGate(torch.tensor(True))
    assert torch.equal(torch.addcmul(G, M, clear.where(mu, 1.0, M)), torch.add(G, M, alpha=mu))
    assert torch.equal(W * clear.where(decay, 1.0, W), W * decay)
    assert torch.equal(W.clone().addcmul_(O, clear.where(alpha, 0.0, W)), W.clone().add_(O, alpha=alpha))
    assert torch.equal(torch.addcmul(torch.zeros_like(M), M, set_.where(mu, 1.0, M)), M)
    assert torch.equal(W * set_.where(decay, 1.0, W), W)
    assert torch.equal(W.clone().addcmul_(O, set_.where(alpha, 0.0, W)), W)
    assert set_.where(mu, 1.0, W) is set_.where(mu, 1.0, W)  # cached per value, dtype, device
    assert clear.where(torch.tensor(0.5), 0.0, W.double()).dtype == torch.float64
    Wb = W.bfloat16()  # a bf16 weight: the coefficient stays float32, as a Python scalar would
    assert clear.where(decay, 1.0, Wb).dtype == torch.float32
    assert torch.equal(Wb * clear.where(decay, 1.0, Wb), Wb * decay)
    assert torch.equal(Wb.clone().addcmul_(O, set_.where(alpha, 0.0, Wb)), Wb)


def test_mask_mode_with_bf16_weights():
    """bf16 weights (AdamW's per-parameter path): a masked step leaves every weight and state
    tensor bit-identical; finite steps agree with the default mode exactly on the AdamW
    parameter and up to the last bit of a bf16 Muon weight (the gated add may round the other
    way: relative 2^-6 covers a step across a power of two).

    Why the exact parts hold on any CPU: test_step_gate_rounds_like_the_plain_scalars."""
    params = [torch.nn.Parameter(p.detach().bfloat16()) for p in _model()]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = _opt(params, "mask"), _opt(twin, "raise")
    for step in range(2):
        grads = [g.bfloat16() for g in _grads(params, step)]
        _set(params, grads)
        _set(twin, grads)
        opt.step()
        ref.step()
    for p, q in zip(params, twin):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p.float(), q.float(), rtol=2**-6, atol=0)  # last-bit rounding (bf16 eps 2^-7)
    assert torch.equal(params[2], twin[2])  # the AdamW branch's gated forms round exactly like the plain ones
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)})
              for p in params]
    _set(params, [g.bfloat16() for g in _grads(params, 2, bad=True)])
    opt.step()
    for p, (w, st) in zip(params, before):
        assert torch.equal(p, w)
        assert all(torch.equal(opt.state[p][k], v) for k, v in st.items())
