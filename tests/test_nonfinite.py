"""Non-finite gradients: detection, and ``on_nonfinite="mask"`` (the step undone on the device,
with no host sync) against ``"skip"`` and the default mode."""

import copy

import pytest
import torch

import muonclip
from muonclip.optim._nonfinite_mask import MaskedStep
from muonclip.optim._validation import finite_per_tensor, nonfinite_indices


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nonfinite_detection(bad, dtype):
    grads = [torch.randn(4, 5, dtype=dtype), torch.zeros(0, 3, dtype=dtype), torch.randn(7, dtype=dtype)]
    assert nonfinite_indices(finite_per_tensor(grads)) == []
    grads[2][3] = bad
    finite = finite_per_tensor(grads)
    assert nonfinite_indices(finite) == [2] and torch.equal(finite, torch.tensor([True, True, False]))
    assert nonfinite_indices(finite_per_tensor([])) == []


def test_nonfinite_detection_stacked_and_alone():
    """Small gradients are checked in stacks of one shape (`STACKED_CHECK_ELEMENTS`), larger ones
    alone: the answer is each gradient's own, whatever its neighbours in the stack hold."""
    from muonclip.optim._validation import GRAD_LIMIT, STACKED_CHECK_ELEMENTS

    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (3, 4), (STACKED_CHECK_ELEMENTS + 1,), (3, 4), (5,), (2, 2, 2), (0,)]
    grads = [torch.randn(s, generator=g) for s in shapes] + [torch.randn(3, 4, dtype=torch.bfloat16)]
    assert finite_per_tensor(grads).all()
    grads[2][1, 1] = float("nan")  # amid finite stack-mates
    grads[3][-1] = -float("inf")  # checked alone
    grads[5][0] = -2 * GRAD_LIMIT  # finite, beyond the limit
    grads[8][0, 0] = float("inf")  # bfloat16, its own stack
    expected = [True, True, False, False, True, False, True, True, False]
    assert finite_per_tensor(grads).tolist() == expected
    assert finite_per_tensor(grads[::-1]).tolist() == expected[::-1]


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
    """Exact on any machine: a masked step is undone by restoring copies; a state tensor created
    during it is computed from zeroed gradients (0 * mu + 0 = 0, IEEE)."""
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
                        ref = before_state[k][key] if key in before_state.get(k, {}) else torch.zeros_like(v)
                        assert torch.equal(v, ref), (k, key)
        else:
            assert not torch.equal(before_w[0], params[0])
        assert all(torch.isfinite(p).all() for p in params)
    assert opt.steps_skipped == 1
    assert all(g["steps_skipped"] == 1 for g in opt.state_dict()["param_groups"])


def test_mask_matches_skip_on_muon_parameters():
    """Masking a step gives bit-identical Muon weights to skipping it on the host.

    Bit for bit: the masked step is undone by copies, and a finite step is the default step
    itself (the same batches and kernels in both)."""
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
    """Exact: zeroing and restoring are copies; a clear flag keeps the step's values."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.tensor([1.0, float("inf"), 2.0])
    state = {"buf": torch.full((3,), 5.0), "step": 3}
    guard = MaskedStep([p], [state], ~finite_per_tensor([p.grad]).all())
    assert torch.equal(p.grad, torch.zeros(3))
    with torch.no_grad():
        p.add_(1.0)
        state["buf"].mul_(2.0)
    guard.restore()
    assert torch.equal(p, torch.ones(3)) and torch.equal(state["buf"], torch.full((3,), 5.0))
    p.grad = torch.tensor([1.0, 3.0, 2.0])
    cache = []
    guard = MaskedStep([p], [state], torch.tensor(False), cache=cache)
    assert torch.equal(p.grad, torch.tensor([1.0, 3.0, 2.0])) and len(cache) == 2
    with torch.no_grad():
        p.add_(1.0)
    guard.restore()
    assert torch.equal(p, torch.full((3,), 2.0))
    guard = MaskedStep([p], [state], torch.tensor(False), cache=cache)
    assert guard._copies is cache  # the copies are reused while the layout is the same


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_mode_equals_the_default_on_finite_steps(dtype):
    """Finite steps in mask mode are the default mode's steps bit for bit, for float32 and bf16
    weights alike (Muon and AdamW branches); a masked step then leaves every weight and state
    tensor bit-identical.

    Bit for bit on any machine: mask mode runs the default step itself on the same values (its
    zeroing multiplies nothing, its restore selects the new values); a masked step is undone by
    copies."""
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _model()]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, ref = _opt(params, "mask"), _opt(twin, "raise")
    for step in range(3):
        grads = [g.to(dtype) for g in _grads(params, step)]
        _set(params, grads)
        _set(twin, grads)
        opt.step()
        ref.step()
        for p, q in zip(params, twin):
            assert p.dtype == dtype and torch.equal(p, q)
    before = [(p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)})
              for p in params]
    _set(params, [g.to(dtype) for g in _grads(params, 3, bad=True)])
    opt.step()
    for p, (w, st) in zip(params, before):
        assert torch.equal(p, w)
        assert all(torch.equal(opt.state[p][k], v) for k, v in st.items())


@pytest.mark.parametrize("mode", ["raise", "skip", "mask"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_finite_gradients_never_give_nonfinite_weights(mode, dtype):
    """Gradients of 3e38 in one step, then a steady 2e37 for 40 steps (Muon's float32 momentum
    input G + mu M would pass float32's range at step 36): every weight and momentum stays finite in
    every mode; such a gradient counts as non-finite (beyond GRAD_LIMIT): raised, skipped or masked.
    On the old code the weights turned NaN in every mode."""
    from muonclip.optim import NonFiniteGradError

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(12, 20, dtype=dtype)), torch.nn.Parameter(torch.randn(20, dtype=dtype))]
    opt = muonclip.Muon([{"params": params[:1]}, {"params": params[1:], "algorithm": "adamw"}], lr=0.05,
                        on_nonfinite=mode)
    before = [p.detach().clone() for p in params]
    sign = torch.randn(12, 20).sign()
    for step, scale in enumerate([3e38] + [2e37] * 40):
        params[0].grad = (sign * scale).to(dtype)
        params[1].grad = torch.ones(20, dtype=dtype)
        if mode == "raise":
            with pytest.raises(NonFiniteGradError, match="beyond 2"):
                opt.step()
        else:
            opt.step()
        assert all(torch.isfinite(p).all() for p in params), step
        assert all(torch.isfinite(t).all() for s in opt.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor)), step
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # nothing applied
    if mode == "skip":
        assert opt.steps_skipped == 41


def test_a_large_gradient_below_the_limit_gives_the_same_update_as_a_small_one():
    """1e29 (inside GRAD_LIMIT, the momentum input far past where the Frobenius norm's squares overflow
    float32): the update is the one of the same gradient scaled down by 2^-90, as the polar factor
    does not depend on the scale (fp32 orthogonalisation; 1e-6 relative: eps against the norm).
    On the old code the norm overflowed to inf and the update was zero."""
    torch.manual_seed(0)
    w = torch.randn(12, 20)
    g = torch.randn(12, 20)
    moved = []
    for scale in (1e29, 1e29 * 2.0**-90):
        p = torch.nn.Parameter(w.clone())
        opt = muonclip.Muon([p], lr=0.05, weight_decay=0.0, orth_dtype=torch.float32)
        p.grad = g * scale
        opt.step()
        moved.append(w - p.detach())
    assert moved[0].abs().max() > 1e-3
    assert (moved[0] - moved[1]).abs().max() <= 1e-6 * moved[1].abs().max()
