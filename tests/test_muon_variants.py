"""NorMuon, cautious weight decay and 8-bit momentum (``Muon(normuon=..., cautious_weight_decay=...,
momentum_8bit=...)``), in one process.

* NorMuon against an independent reimplementation of microsoft/dion's ``normuon.py`` formulas
  (per matrix: EMA of the rows' mean square, divide, rescale to the Frobenius norm before),
  written here one matrix at a time, on every layout: a plain matrix, stacked experts, a fused
  split (contiguous and interleaved) and a weight stored ``(in, out)``.
* Cautious weight decay on a hand-built case whose mask is known (modded-nanogpt's rule:
  decay where ``update * weight >= 0``).
* 8-bit momentum: the quantiser's bound and blocks, the trajectory against float32 momentum
  within a stated bound, and the state dict round trip with a bit-identical resume (all three
  options on).
"""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch

import muonclip
from muonclip.optim._quantized import BLOCK, blocks_of, dequantize, quantize_
from muonclip.ortho import orthogonalize

OPT = dict(lr=0.05, weight_decay=0.1, orth_dtype=torch.float32, adjust_lr_fn="match_rms_adamw")


def _grad(step: int, W: torch.Tensor) -> torch.Tensor:
    """A gradient that depends on the weight and the step (deterministic)."""
    g = torch.Generator().manual_seed(1000 + step)
    return 0.5 * W + torch.randn(W.shape, generator=g)


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "plain": torch.randn(12, 20, generator=g),
        "experts": torch.randn(3, 8, 10, generator=g),
        "fused": torch.randn(16, 10, generator=g),  # [q 8 | k 4 | v 4]
        "neox": torch.randn(12, 10, generator=g),  # 2 groups of [2 | 2 | 2]
        "conv1d": torch.randn(10, 12, generator=g),  # stored (in, out): out = [6 | 6]
    }


KEYS = {
    "plain": {}, "experts": {}, "fused": {"split_sizes": [8, 4, 4]},
    "neox": {"split_sizes": [2, 2, 2], "split_groups": 2}, "conv1d": {"transposed": True, "split_sizes": [6, 6]},
}


def _groups(params):
    return [{"params": [p], "param_names": [n], **KEYS[n]} for n, p in params.items()]


def _run(steps, start=0, opt=None, params=None, **kw):
    params = params if params is not None else {n: torch.nn.Parameter(t.clone()) for n, t in _params().items()}
    opt = opt or muonclip.Muon(_groups(params), **{**OPT, **kw})
    for s in range(start, start + steps):
        for p in params.values():
            p.grad = _grad(s, p.detach())
        opt.step()
    return params, opt


# ------------------------------------------------------------------------------------------
# NorMuon: dion's formulas, one matrix at a time
# ------------------------------------------------------------------------------------------


def _blocks(name, t):
    """Each matrix of a weight as (a view-free index function): a list of (rows index, matrix)."""
    keys = KEYS[name]
    m = t.mT if keys.get("transposed") else t
    mats = list(m) if m.ndim == 3 else [m]
    out = []
    for e, mat in enumerate(mats):
        sizes = keys.get("split_sizes")
        if sizes is None:
            out.append(((e, list(range(mat.shape[0]))), mat))
            continue
        groups = keys.get("split_groups", 1)
        period = mat.shape[0] // groups
        a = 0
        for s in sizes:
            rows = [g * period + a + i for g in range(groups) for i in range(s)]
            out.append(((e, rows), mat[rows]))
            a += s
    return out


def _dion_normalize(U, V, beta2):
    """dion's ``_normuon_normalization_core`` for one matrix U (rows x cols) and its (rows, 1) V."""
    norm_U = U.norm(p=2, dim=(-2, -1), keepdim=True)
    neuron_norms = (U * U).mean(dim=-1, keepdim=True)
    V = torch.lerp(V, neuron_norms, 1 - beta2)
    normalized = U / (V.sqrt() + 1e-8)
    normalized = normalized * (norm_U / normalized.norm(p=2, dim=(-2, -1), keepdim=True).clamp(min=1e-8))
    return normalized, V


def _reference_normuon(steps, lr, wd, mu=0.95, beta2=0.95):
    params = {n: t.clone() for n, t in _params().items()}
    M = {n: torch.zeros_like(t) for n, t in params.items()}
    V = {}
    for s in range(steps):
        for n, W in params.items():
            G = _grad(s, W)
            M[n] = mu * M[n] + G
            Vin = G + mu * M[n]
            W.mul_(1 - lr * wd)
            m = W.mT if KEYS[n].get("transposed") else W
            for j, ((e, rows), block) in enumerate(_blocks(n, Vin)):
                O = orthogonalize(block, "ns5", None, torch.float32)
                U, V[n, j] = _dion_normalize(O, V.get((n, j), torch.zeros(O.shape[0], 1)), beta2)
                scale = 0.2 * math.sqrt(max(U.shape))
                target = m[e] if m.ndim == 3 else m
                target[rows] -= lr * scale * U
    return params


def test_normuon_matches_dions_formulas_on_every_layout():
    steps = 5
    ref = _reference_normuon(steps, OPT["lr"], OPT["weight_decay"])
    got, _ = _run(steps, normuon=True)
    plain, _ = _run(steps)
    for n in ref:
        diff = (got[n].detach() - ref[n]).abs().max().item()
        assert diff < 2e-5, (n, diff)
        assert (plain[n].detach() - ref[n]).abs().max().item() > 100 * 2e-5, n  # the test can tell


def test_normuon_state_is_one_value_per_row_of_each_matrix():
    params, opt = _run(1, normuon=True)
    shapes = {n: tuple(opt.state[p]["neuron_second_moment"].shape) for n, p in params.items()}
    assert shapes == {"plain": (1, 12), "experts": (3, 8), "fused": (1, 16), "neox": (1, 12), "conv1d": (1, 12)}
    v = opt.state[params["plain"]]["neuron_second_moment"]
    assert v.dtype == torch.float32 and bool((v > 0).all())


# ------------------------------------------------------------------------------------------
# cautious weight decay: a hand-built case
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cautious", [True, False])
def test_cautious_weight_decay_decays_only_where_update_and_weight_agree_in_sign(cautious):
    # G = diag(1, -1): V = 1.95 G, whose polar factor is O = diag(1, -1) exactly (svd).
    W = torch.nn.Parameter(torch.tensor([[-1.0, 2.0], [3.0, -4.0]], dtype=torch.float64))
    opt = muonclip.Muon([W], lr=0.1, weight_decay=5.0, method="svd", orth_dtype=torch.float64,
                        adjust_lr_fn="unscaled", cautious_weight_decay=cautious)
    W.grad = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
    opt.step()
    # mask = (O * W >= 0): O*W = [[-1, 0], [0, 4]] -> decay everywhere but W[0, 0]
    lr_wd = 0.5
    mask = torch.tensor([[0.0, 1.0], [1.0, 1.0]], dtype=torch.float64) if cautious else torch.ones(2, 2)
    W0 = torch.tensor([[-1.0, 2.0], [3.0, -4.0]], dtype=torch.float64)
    O = torch.tensor([[1.0, 0.0], [0.0, -1.0]], dtype=torch.float64)
    expected = W0 - lr_wd * mask * W0 - 0.1 * O
    torch.testing.assert_close(W.detach(), expected, rtol=0, atol=1e-12)
    if cautious:
        assert W[0, 0].item() == pytest.approx(-1.1)  # not decayed: it would be -0.6


# ------------------------------------------------------------------------------------------
# 8-bit momentum
# ------------------------------------------------------------------------------------------


def test_quantiser_error_bound_and_blocks_never_cross_a_row_or_a_split():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 600, generator=g)  # experts (3, 4, 600): rows of 600 = blocks 256, 256, 88
    x[0, 0, 5] = 1e4  # one huge value: only its own block's resolution may suffer
    lay = blocks_of(x.shape, False)
    assert lay.edges == (0, 256, 512, 600)
    q = torch.empty(x.shape, dtype=torch.int8)
    s = torch.empty(lay.scale_shape(x.shape))
    quantize_(x, q, s, lay)
    assert s.shape == (3, 4, 3)
    err = (dequantize(q, s, lay) - x).abs()
    step = s.repeat_interleave(torch.tensor([256, 256, 88]), dim=-1)  # each element's block scale
    assert bool((err <= step / 254 * (1 + 1e-6)).all())
    assert err[0, 1].max() < 0.05 and err[1, 0].max() < 0.05  # the next row, the next expert: untouched
    # a weight stored (in, out) with out = [q 6 | k 6]: blocks are also cut at column 6
    cut = blocks_of((10, 12), False, cuts=[0, 6])
    assert cut.edges == (0, 6, 12)
    # a flattened conv weight: rows of in*kh*kw
    assert blocks_of((4, 3, 3, 3), False).edges == (0, 27)


def test_momentum_8bit_state_is_int8_plus_one_float32_scale_per_block():
    params, opt = _run(1, momentum_8bit=True)
    for p in params.values():
        st = opt.state[p]
        assert "momentum_buffer" not in st
        assert st["momentum_int8"].dtype == torch.int8 and st["momentum_int8"].shape == p.shape
        assert st["momentum_scale"].dtype == torch.float32
    assert opt.state[params["conv1d"]]["momentum_scale"].shape == (10, 2)  # cut at the split, out = [6 | 6]
    assert opt.state[params["experts"]]["momentum_scale"].shape == (3, 8, 1)


BOUND_8BIT = 0.02
"""Stated bound: after 20 steps, max |W(8-bit) - W(float32)| <= 2% of max |W(float32) - W0|."""


def test_momentum_8bit_trajectory_stays_within_the_stated_bound_of_float32_momentum():
    steps = 20
    w0 = _params()
    fp32, _ = _run(steps)
    int8, _ = _run(steps, momentum_8bit=True)
    for n in w0:
        moved = (fp32[n].detach() - w0[n]).abs().max().item()
        diff = (int8[n].detach() - fp32[n].detach()).abs().max().item()
        print(f"{n}: max |W8 - W32| / max |W32 - W0| = {diff / moved:.4f}")
        assert 0 < diff <= BOUND_8BIT * moved, (n, diff, moved)


def test_state_dict_round_trip_and_resume_are_bit_identical_with_every_option():
    kw = dict(normuon=True, cautious_weight_decay=True, momentum_8bit=True)
    straight, _ = _run(6, **kw)
    params, opt = _run(3, **kw)
    buf = io.BytesIO()
    torch.save(opt.state_dict(), buf)
    saved_params = {n: p.detach().clone() for n, p in params.items()}
    # a new optimizer on new parameters, loaded from the saved bytes
    fresh = {n: torch.nn.Parameter(t.clone()) for n, t in saved_params.items()}
    opt2 = muonclip.Muon(_groups(fresh), **OPT)  # the saved groups carry the options
    buf.seek(0)
    opt2.load_state_dict(torch.load(buf))
    assert opt2.param_groups[0]["normuon"] and opt2.param_groups[0]["momentum_8bit"]
    for n, p in fresh.items():
        for key, value in opt.state[params[n]].items():
            got = opt2.state[p][key]
            if isinstance(value, torch.Tensor):
                assert got.dtype == value.dtype and torch.equal(got, value), (n, key)
    resumed, _ = _run(3, start=3, opt=opt2, params=fresh)
    for n in straight:
        assert torch.equal(resumed[n].detach(), straight[n].detach()), n


def test_switching_momentum_8bit_on_keeps_the_momentum():
    params, opt = _run(2)
    M = {n: opt.state[p]["momentum_buffer"].clone() for n, p in params.items()}
    G = {n: _grad(2, p.detach()) for n, p in params.items()}
    for g in opt.param_groups:
        g["momentum_8bit"] = True
    _run(1, start=2, opt=opt, params=params)
    for n, p in params.items():
        st = opt.state[p]
        assert "momentum_buffer" not in st
        lay = blocks_of(p.shape, False, cuts=[0, 6] if n == "conv1d" else ())
        expected = 0.95 * M[n] + G[n]  # the float32 momentum carried on, up to two roundings
        got = dequantize(st["momentum_int8"], st["momentum_scale"], lay)
        assert (got - expected).abs().max() <= 2 * expected.abs().max() / 254 + 1e-6, n


@pytest.mark.parametrize("bad", [dict(normuon_beta2=1.0), dict(normuon_beta2=float("nan")), dict(normuon="yes"),
                                 dict(cautious_weight_decay=1), dict(momentum_8bit=None)])
def test_bad_options_are_refused_in_the_constructor_a_group_and_a_loaded_state_dict(bad):
    key = next(iter(bad))
    W = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match=key):
        muonclip.Muon([W], **bad)
    opt = muonclip.Muon([W])
    with pytest.raises(ValueError, match=key):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(4, 3))], **bad})
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0].update(bad)
    with pytest.raises(ValueError, match=key):
        opt.load_state_dict(sd)


def test_a_state_dict_without_the_option_keys_is_refused_naming_them():
    """A group saved before these options existed is not completed from the receiving group's
    values (a pre-release form): the load is refused, naming the keys, and nothing changes."""
    W = torch.nn.Parameter(torch.randn(4, 3))
    opt = muonclip.Muon([W], normuon=True)
    sd = opt.state_dict()
    for k in ("normuon", "normuon_beta2", "cautious_weight_decay", "momentum_8bit"):
        del sd["param_groups"][0][k]
    with pytest.raises(ValueError, match=r"keys \['normuon', 'normuon_beta2', 'cautious_weight_decay', "
                                         r"'momentum_8bit'\] are missing"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["normuon"] is True


def test_torch_state_dict_refuses_the_options_torch_does_not_have():
    W = torch.nn.Parameter(torch.randn(4, 3))
    for key in ("normuon", "cautious_weight_decay", "momentum_8bit"):
        opt = muonclip.Muon([W], **{key: True})
        with pytest.raises(ValueError, match=key):
            opt.torch_state_dict()


def test_blocks_of_the_quantiser_are_at_most_block_long():
    assert BLOCK == 256
    lay = blocks_of((2, 1000), False)
    sizes = [b - a for a, b in zip(lay.edges, lay.edges[1:])]
    assert max(sizes) == BLOCK and sum(sizes) == 1000
