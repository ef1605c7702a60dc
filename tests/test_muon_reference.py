"""muonclip.Muon against torch.optim.Muon and against the slow reference in reference_muon.py."""

import math

import pytest
import torch
from probes import latest_structure
from reference_muon import ReferenceMuon

import muonclip


def make_params(shapes, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g, dtype=dtype)) for s in shapes]


def set_grads(params_list, seed):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g, dtype=torch.float64) for p in params_list[0]]
    for params in params_list:
        for p, gr in zip(params, grads):
            p.grad = gr.to(p.dtype).clone()


@pytest.mark.parametrize("adjust_lr_fn", [None, "original", "match_rms_adamw"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_matches_torch_optim_muon(adjust_lr_fn, nesterov):
    shapes = [(32, 64), (96, 32), (48, 48)]
    ours, theirs = make_params(shapes), make_params(shapes)
    w0 = [p.detach().clone() for p in theirs]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.9, nesterov=nesterov, adjust_lr_fn=adjust_lr_fn)
    a = muonclip.Muon(ours, orth_dtype=torch.bfloat16, **kw)  # torch's dtype, on any machine
    b = torch.optim.Muon(theirs, **kw)
    for step in range(6):
        set_grads([ours, theirs], step)
        a.step()
        b.step()
    for p, q, w in zip(ours, theirs, w0):
        # both compute Newton–Schulz in bf16: compare the difference to how far the weights moved
        rel = ((p - q).norm() / (q - w).norm()).item()
        assert rel < 0.02, rel


def test_torch_defaults_mean_torch_scale():
    """adjust_lr_fn=None is torch's 'original' scale, not our default 'match_rms_adamw'; an AdamW
    group's epsilon is 'adamw_eps'; keywords that are not Muon's are Python's TypeError."""
    p = make_params([(64, 16)])
    opt = muonclip.Muon(p, lr=0.1, adjust_lr_fn=None)
    assert opt.param_groups[0]["adjust_lr_fn"] == "original"
    assert muonclip.Muon(make_params([(4, 4)])).param_groups[0]["adjust_lr_fn"] == "match_rms_adamw"
    opt.add_param_group({"params": make_params([(8, 8)]), "adjust_lr_fn": None})
    assert opt.param_groups[1]["adjust_lr_fn"] == "original"
    with pytest.raises(ValueError, match="'adamw_eps'"):
        muonclip.Muon([{"params": make_params([(4,)]), "algorithm": "adamw", "eps": 1e-10}])
    for removed in ("update_scale", "steps", "split_sizes", "flatten", "transposed", "split_groups"):
        with pytest.raises(TypeError, match=removed):
            muonclip.Muon(p, **{removed: None})


def test_ns_coefficients_and_steps_are_used():
    """torch's ns_coefficients/ns_steps change the update exactly as orthogonalize would."""
    (p,) = make_params([(16, 24)])
    w = p.detach().clone()
    p.grad = torch.randn_like(p)
    coeffs = (2.0, -1.5, 0.5)
    opt = muonclip.Muon([p], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, adjust_lr_fn="unscaled",
                        ns_coefficients=coeffs, ns_steps=3, orth_dtype=torch.float32)
    opt.step()
    expected = w - 0.1 * muonclip.orthogonalize(p.grad, "ns5", 3, torch.float32, coefficients=coeffs)
    torch.testing.assert_close(p.detach(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("adjust_lr_fn", ["original", "match_rms_adamw"])
@pytest.mark.parametrize("split_sizes", [None, [4, 12, 8]])
@pytest.mark.parametrize("experts", [None, 3])
def test_transposed_weight_steps_exactly_as_its_transpose(adjust_lr_fn, split_sizes, experts):
    """A weight stored (in, out) with transposed=True (transformers' Conv1D; stacked (E, in, out)
    for experts declared is_transposed) gets, bit for bit, the transpose of what the (out, in)
    weight gets: same scale (asymmetric "shape" included), same row blocks of the (out, in)
    matrix, the same matrices handed to Newton–Schulz. Each weight has its own optimizer, so each
    block is orthogonalised in a batch of its own: the same kernels on the same values, hence the
    same bits on any machine (in one shared batch a BLAS need not round two equal matrices
    alike). In one optimizer they share a batch."""
    shape = (24, 10) if experts is None else (experts, 24, 10)
    (w,) = make_params([shape])  # (out, in)
    plain = torch.nn.Parameter(w.detach().clone())
    stored = torch.nn.Parameter(w.detach().mT.contiguous())  # (in, out)
    kw = dict(lr=0.05, weight_decay=0.1, adjust_lr_fn=adjust_lr_fn)
    opt_plain = muonclip.Muon([{"params": [plain], "split_sizes": split_sizes}], **kw)
    opt_stored = muonclip.Muon([{"params": [stored], "split_sizes": split_sizes, "transposed": True}], **kw)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        grad = torch.randn(shape, generator=g)
        plain.grad, stored.grad = grad.clone(), grad.mT.contiguous()
        opt_plain.step()
        opt_stored.step()
        assert opt_stored.last_step_stats.matrices == opt_plain.last_step_stats.matrices
        assert torch.equal(stored.detach(), plain.detach().mT)
        assert torch.equal(opt_stored.state[stored]["momentum_buffer"], opt_plain.state[plain]["momentum_buffer"].mT)
    shared = muonclip.Muon([{"params": [plain], "split_sizes": split_sizes},
                            {"params": [stored], "split_sizes": split_sizes, "transposed": True}], **kw)
    plain.grad, stored.grad = grad.clone(), grad.mT.contiguous()
    shared.step()
    assert shared.last_step_stats.matrices == 2 * (experts or 1) * (1 if split_sizes is None else 3)
    assert len(latest_structure(shared).buckets) == (1 if split_sizes is None else 3)  # one batch a block
    # the (out, in) path itself is checked against the slow reference in CASES; the weights moved
    assert not torch.equal(plain.detach(), w.detach())


def test_transposed_needs_a_2d_or_stacked_weight():
    (p,) = make_params([(3, 4, 5, 2)])
    with pytest.raises(ValueError, match="transposed=True is for 2-D weights"):
        muonclip.Muon([{"params": [p], "transposed": True}])
    (q,) = make_params([(10, 24)])
    with pytest.raises(ValueError, match=r"add up to the 24 rows"):
        muonclip.Muon([{"params": [q], "transposed": True, "split_sizes": [10]}])


@pytest.mark.parametrize("method", ["gram", "ns5_sym"])
def test_ns_coefficients_reach_every_quintic_method(method):
    """The quintic's coefficients apply to the methods that run it (float64: equal to ns5 with them)."""
    (p,) = make_params([(16, 48)])
    w = p.detach().clone()
    p.grad = torch.randn_like(p)
    coeffs = (2.0, -1.5, 0.5)
    opt = muonclip.Muon([p], lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, adjust_lr_fn="unscaled",
                        method=method, ns_coefficients=coeffs, orth_dtype=torch.float64)
    opt.step()
    expected = w - 0.1 * muonclip.orthogonalize(p.grad.double(), "ns5", 5, torch.float64, coefficients=coeffs)
    torch.testing.assert_close(p.detach(), expected.float(), atol=1e-6, rtol=0)
    for other in ("polar_express", "svd"):
        with pytest.raises(ValueError, match="no quintic coefficients"):
            muonclip.Muon([p], method=other, ns_coefficients=coeffs, orth_dtype=torch.float32)


CASES = [
    dict(shapes=[(24, 40), (40, 24), (24, 40)], opts={}),
    dict(shapes=[(24, 40)], opts=dict(nesterov=False, adjust_lr_fn="original")),
    dict(shapes=[(16, 8, 3, 3)], opts=dict(adjust_lr_fn="original")),  # conv, flattened to (16, 72)
    dict(shapes=[(8, 4, 5)], opts=dict(adjust_lr_fn="original"), group=dict(flatten=True)),  # conv1d
    dict(shapes=[(4, 12, 20), (3, 12, 20)], opts=dict(adjust_lr_fn="match_rms_adamw")),  # stacked experts
    dict(shapes=[(48, 16)], opts=dict(adjust_lr_fn="original"), group=dict(split_sizes=[16, 8, 24])),  # fused qkv
    dict(shapes=[(24, 40)], opts=dict(method="polar_express", ns_steps=6)),
    dict(shapes=[(24, 40), (12, 12)], opts=dict(method="svd", adjust_lr_fn="unscaled")),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c["opts"]) + str(c.get("group", "")) + str(c["shapes"][0]))
def test_matches_slow_reference_in_float64(case):
    shapes, opts, group = case["shapes"], dict(case["opts"]), case.get("group", {})
    ours, ref_params = make_params(shapes, torch.float64), make_params(shapes, torch.float64)
    steps = opts.pop("ns_steps", 5)
    a = muonclip.Muon([{"params": ours, **group}], lr=0.05, weight_decay=0.1, orth_dtype=torch.float64,
                      ns_steps=None if opts.get("method") == "svd" else steps, **opts)
    ref = ReferenceMuon(ref_params, lr=0.05, weight_decay=0.1, orth_dtype=torch.float64, ns_steps=steps, **opts,
                        **group)
    for step in range(4):
        set_grads([ours, ref_params], step)
        a.step()
        ref.step()
    for p, q in zip(ours, ref_params):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=0)


def test_fp32_compute_matches_reference():
    ours = make_params([(32, 48)])
    ref_params = [torch.nn.Parameter(p.detach().double()) for p in ours]
    a = muonclip.Muon(ours, lr=0.05, orth_dtype=torch.float32)
    ref = ReferenceMuon(ref_params, lr=0.05)
    for step in range(3):
        set_grads([ours, ref_params], step)
        a.step()
        ref.step()
    torch.testing.assert_close(ours[0].double(), ref_params[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("shape", [(32, 128), (128, 32), (64, 64)])
def test_rms_scale_gives_update_rms_point_two(shape):
    """scale 'rms' = 0.2 sqrt(max(A, B)) makes a full-rank orthogonal update's RMS exactly 0.2."""
    (p,) = make_params([shape], torch.float64)
    w = p.detach().clone()
    p.grad = torch.randn_like(p)
    muonclip.Muon([p], lr=1.0, weight_decay=0.0, method="svd", orth_dtype=torch.float64).step()
    rms = (p - w).pow(2).mean().sqrt().item()
    assert math.isclose(rms, 0.2, rel_tol=1e-9)


def test_same_shape_matrices_orthogonalised_in_one_batch():
    from muonclip.optim.workspace import CoreWorkspace

    calls = []

    class Spy(CoreWorkspace):
        def orthogonalize(self, V, *args, **kwargs):
            calls.append(tuple(V.shape))
            return super().orthogonalize(V, *args, **kwargs)

    params = make_params([(16, 32)] * 5 + [(4, 16, 32)] + [(32, 16)])
    for p in params:
        p.grad = torch.randn_like(p)
    muonclip.Muon(params, workspace=Spy()).step()
    assert sorted(calls) == sorted([(9, 16, 32), (1, 32, 16)])
