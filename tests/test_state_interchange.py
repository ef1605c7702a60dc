"""Optimizer state moves between torch.optim's Muon (+ AdamW) and muonclip.Muon, and loads are checked.

Momentum depends only on the gradients, so with one fixed gradient sequence, a state converted
from the other optimizer must continue, from the same weights, like the receiver's own state
(both orthogonalising in float32, so that only the conversion can differ: within 1e-5 of the
weights' movement). Each test also has its control: the state without the conversion lands
far away (torch keeps an average, buf.lerp_(G, 1 - mu); we keep a sum, M = mu M + G).
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import muonclip

SHAPES = [(16, 24), (24, 16)]
KW = dict(lr=0.02, weight_decay=0.1, momentum=0.9, adjust_lr_fn="original")
TOL = 1e-5


def weights(seed=0, shapes=SHAPES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g) for s in shapes]


def params_from(ws):
    return [torch.nn.Parameter(w.clone()) for w in ws]


def run(params, opt, steps, start=0):
    for s in range(start, start + steps):
        g = torch.Generator().manual_seed(100 + s)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()


def rel(a, b, start):
    return max(((x - y).norm() / (x - w).norm()).item() for x, y, w in zip(a, b, start))


def _torch_ns_fp32(grad, ns_coefficients, ns_steps, eps):
    """torch.optim.Muon's Newton–Schulz in float32 (its own runs in bfloat16)."""
    return muonclip.orthogonalize(grad, "ns5", ns_steps, torch.float32, eps=eps, coefficients=ns_coefficients)


def test_torch_muon_state_continues_in_ours():
    """load_state_dict recognises torch.optim.Muon's state dict and converts its momentum."""
    w0, w1 = weights(0), weights(1)
    tp = params_from(w0)
    theirs = torch.optim.Muon(tp, **KW)
    run(tp, theirs, 3)
    op = params_from(w0)
    own = muonclip.Muon(op, orth_dtype=torch.float32, **KW)
    run(op, own, 3)

    a = params_from(w1)
    opt_a = muonclip.Muon(a, orth_dtype=torch.float32, **KW)
    opt_a.load_state_dict(own.state_dict())
    b = params_from(w1)
    opt_b = muonclip.Muon(b, orth_dtype=torch.float32, lr=1.0)  # every setting comes from torch's dict
    opt_b.load_state_dict(theirs.state_dict())
    assert {k: opt_b.param_groups[0][k] for k in ("lr", "momentum", "ns_steps", "adjust_lr_fn")} == \
        {"lr": 0.02, "momentum": 0.9, "ns_steps": 5, "adjust_lr_fn": "original"}
    raw = params_from(w1)  # control: torch's average taken as our sum
    opt_raw = muonclip.Muon(raw, orth_dtype=torch.float32, **KW)
    opt_raw.load_state_dict(own.state_dict())
    for p, q in zip(raw, tp):
        opt_raw.state[p]["momentum_buffer"].copy_(theirs.state[q]["momentum_buffer"])
    for ps, opt in ((a, opt_a), (b, opt_b), (raw, opt_raw)):
        run(ps, opt, 4, start=3)
    assert rel(b, a, w1) <= TOL
    assert rel(raw, a, w1) > 100 * TOL


def test_our_state_continues_in_torch_muon(monkeypatch):
    """Muon.torch_state_dict: torch's momentum convention, concrete ns_steps and coefficients."""
    monkeypatch.setattr(torch.optim._muon, "_zeropower_via_newtonschulz", _torch_ns_fp32)
    w0, w1 = weights(0), weights(1)
    op = params_from(w0)
    ours = muonclip.Muon(op, **KW)  # bf16 orthogonalisation: the state depends on the gradients only
    run(op, ours, 3)
    tp = params_from(w0)
    theirs = torch.optim.Muon(tp, **KW)
    run(tp, theirs, 3)

    exported = ours.torch_state_dict()
    assert exported["param_groups"][0]["ns_steps"] == 5
    assert exported["param_groups"][0]["ns_coefficients"] == (3.4445, -4.7750, 2.0315)
    a = params_from(w1)
    opt_a = torch.optim.Muon(a, **KW)
    opt_a.load_state_dict(theirs.state_dict())
    b = params_from(w1)
    opt_b = torch.optim.Muon(b)
    opt_b.load_state_dict(copy.deepcopy(exported))  # torch's loader keeps the dict's tensors
    raw = params_from(w1)  # control: our sum handed over as torch's average
    opt_raw = torch.optim.Muon(raw)
    opt_raw.load_state_dict(copy.deepcopy(exported))
    for p, q in zip(raw, op):
        opt_raw.state[p]["momentum_buffer"].copy_(ours.state[q]["momentum_buffer"])
    for ps, opt in ((a, opt_a), (b, opt_b), (raw, opt_raw)):
        run(ps, opt, 4, start=3)
    assert rel(b, a, w1) <= TOL
    assert rel(raw, a, w1) > 100 * TOL


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 16)
        self.hidden = torch.nn.Linear(16, 24, bias=False)
        self.out = torch.nn.Linear(24, 16, bias=False)
        self.norm = torch.nn.LayerNorm(16)
        self.lm_head = torch.nn.Linear(16, 20, bias=False)


def _torch_pair(model, by_name):
    """torch's usual split: Muon for the hidden matrices, AdamW (decay / no decay) for the rest."""
    named = dict(model.named_parameters())
    hidden = [(n, named[n]) for n in ("hidden.weight", "out.weight")]
    decay = [(n, named[n]) for n in ("emb.weight", "lm_head.weight")]
    vectors = [(n, named[n]) for n in ("norm.weight", "norm.bias")]
    strip = (lambda xs: xs) if by_name else (lambda xs: [p for _, p in xs])
    muon = torch.optim.Muon(strip(hidden), **KW)
    adamw = torch.optim.AdamW([{"params": strip(decay)}, {"params": strip(vectors), "weight_decay": 0.0}],
                              lr=0.01, betas=(0.9, 0.95), weight_decay=0.1)
    order = [p for _, p in hidden], [p for _, p in decay + vectors]
    return muon, adamw, order


def _ours(model):
    groups = muonclip.param_groups(model, adamw_lr=0.01)
    return muonclip.Muon(groups, orth_dtype=torch.float32, betas=(0.9, 0.95), **KW)


def _set(model, ws):
    with torch.no_grad():
        for p, w in zip(model.parameters(), ws):
            p.copy_(w)


@pytest.mark.parametrize("by_name", [True, False], ids=["by-name", "by-order"])
def test_torch_muon_and_adamw_pair_into_one_muon(by_name, monkeypatch):
    torch.manual_seed(0)
    model = Tiny()
    w0 = [p.detach().clone() for p in model.parameters()]
    w1 = [w + 0.1 * torch.randn_like(w) for w in w0]
    muon, adamw, (muon_params, adamw_params) = _torch_pair(model, by_name)

    def step_both():
        muon.step()
        adamw.step()

    both = type("Pair", (), {"step": staticmethod(step_both)})
    run(list(model.parameters()), both, 3)
    own_model = Tiny()
    _set(own_model, w0)
    own = _ours(own_model)
    run(list(own_model.parameters()), own, 3)

    a_model, b_model = Tiny(), Tiny()
    _set(a_model, w1)
    _set(b_model, w1)
    opt_a = _ours(a_model)
    opt_a.load_state_dict(own.state_dict())
    opt_b = _ours(b_model)
    # by name: torch's groups carry the names of model.named_parameters(), ours param_groups' names
    kw = {} if by_name else dict(muon_params=_mapped(muon_params, model, b_model),
                                 adamw_params=_mapped(adamw_params, model, b_model))
    opt_b.load_torch_state_dicts(muon.state_dict(), adamw.state_dict(), **kw)
    assert opt_b.steps_taken == 3
    run(list(a_model.parameters()), opt_a, 3, start=3)
    run(list(b_model.parameters()), opt_b, 3, start=3)
    start = dict(zip([n for n, _ in a_model.named_parameters()], w1))
    for (n, p), (_, q) in zip(a_model.named_parameters(), b_model.named_parameters()):
        assert ((p - q).norm() / (p - start[n]).norm()).item() <= TOL, n


def test_torch_pair_into_a_normuon_muon_starts_its_second_moment_as_a_first_step_would():
    """torch.optim.Muon has no NorMuon: taken into a NorMuon group, its momentum continues and the
    second moment starts from zeros, as a group switched to NorMuon between steps starts it (the
    state holds it, so the load is whole: `muonclip.optim._state_validation`)."""
    torch.manual_seed(0)
    model = Tiny()
    muon, adamw, _ = _torch_pair(model, True)

    def step_both():
        muon.step()
        adamw.step()

    run(list(model.parameters()), type("Pair", (), {"step": staticmethod(step_both)}), 2)
    a_model, b_model = copy.deepcopy(model), copy.deepcopy(model)
    opt_a, opt_b = _ours(a_model), _ours(b_model)
    opt_a.load_torch_state_dicts(muon.state_dict(), adamw.state_dict())
    for g in opt_b.param_groups:
        g["normuon"] = g["algorithm"] == "muon"
    opt_b.load_torch_state_dicts(muon.state_dict(), adamw.state_dict())
    for g in opt_a.param_groups:  # switched on after the load: its next step makes the zeros
        g["normuon"] = g["algorithm"] == "muon"
    run(list(a_model.parameters()), opt_a, 2, start=2)
    run(list(b_model.parameters()), opt_b, 2, start=2)
    assert all(torch.equal(p, q) for p, q in zip(a_model.parameters(), b_model.parameters()))
    assert any(g["normuon"] for g in opt_b.param_groups)


def _mapped(params, src_model, dst_model):
    """``params`` of ``src_model`` as the same-named parameters of ``dst_model``."""
    names = {id(p): n for n, p in src_model.named_parameters()}
    dst = dict(dst_model.named_parameters())
    return [dst[names[id(p)]] for p in params]


def test_a_state_dict_that_is_neither_is_refused():
    p = torch.nn.Parameter(torch.randn(4, 3))
    opt = muonclip.Muon([p])
    adamw = torch.optim.AdamW([p])
    p.grad = torch.randn_like(p)
    adamw.step()
    with pytest.raises(ValueError, match="neither muonclip.Muon's.*nor torch.optim.Muon's.*torch.optim.AdamW's"):
        opt.load_state_dict(adamw.state_dict())
    with pytest.raises(ValueError, match="neither"):
        opt.load_state_dict(torch.optim.SGD([p], lr=0.1, momentum=0.9).state_dict())
    with pytest.raises(ValueError, match="not an optimizer state dict"):
        opt.load_state_dict({"momentum_buffer": torch.zeros(4, 3)})
    torch_two = torch.optim.Muon([{"params": [torch.nn.Parameter(torch.randn(4, 3))]},
                                  {"params": [torch.nn.Parameter(torch.randn(4, 3))]}]).state_dict()
    with pytest.raises(ValueError, match="2 param groups, this optimizer 1.*load_torch_state_dicts"):
        opt.load_state_dict(torch_two)
    assert not opt.state


def test_torch_state_dict_names_what_torch_cannot_express():
    mats = params_from(weights(0))
    experts = torch.nn.Parameter(torch.randn(2, 8, 4))
    opt = muonclip.Muon([{"params": mats, "method": "polar_express", "orth_dtype": torch.float32},
                         {"params": [experts], "split_sizes": [4, 4], "adjust_lr_fn": "unscaled"}])
    with pytest.raises(ValueError, match=r"param group 0 .*method='polar_express'.*orth_dtype=torch.float32"):
        opt.torch_state_dict()
    opt.param_groups[0].update(method="ns5", orth_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"param group 1 .*adjust_lr_fn='unscaled'.*split_sizes.*shape \(2, 8, 4\)"):
        opt.torch_state_dict()
    with pytest.raises(ValueError, match="no algorithm='adamw' param group"):
        opt.torch_state_dict("adamw")


def test_adamw_groups_go_to_torch_adamw():
    """torch_state_dict("adamw"): torch.optim.AdamW continues the AdamW branch (which computes
    torch's AdamW: equal to round-off)."""
    torch.manual_seed(0)
    vec, emb = torch.nn.Parameter(torch.randn(12)), torch.nn.Parameter(torch.randn(10, 6))
    ours = muonclip.Muon([{"params": [vec], "algorithm": "adamw", "weight_decay": 0.0},
                          {"params": [emb], "algorithm": "adamw"}], lr=0.01, adamw_eps=1e-7)
    run([vec, emb], ours, 3)
    a, b = vec.detach().clone().requires_grad_(), emb.detach().clone().requires_grad_()
    theirs = torch.optim.AdamW([{"params": [a]}, {"params": [b]}])
    theirs.load_state_dict(ours.torch_state_dict("adamw"))
    assert theirs.param_groups[0]["eps"] == 1e-7 and theirs.param_groups[0]["weight_decay"] == 0.0
    run([vec, emb], ours, 3, start=3)
    run([a, b], theirs, 3, start=3)
    torch.testing.assert_close(a, vec, rtol=0, atol=1e-6)
    torch.testing.assert_close(b, emb, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# loaded groups are validated like the constructor's arguments
# ----------------------------------------------------------------------------------------------

BAD = [("lr", math.nan), ("momentum", 1.5), ("weight_decay", -50.0), ("eps", 0.0), ("method", "bogus"),
       ("betas", (0.9, 1.0)), ("adamw_eps", math.inf)]


@pytest.mark.parametrize(("key", "value"), BAD, ids=[k for k, _ in BAD])
def test_load_state_dict_validates_every_group_like_the_constructor(key, value):
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = muonclip.Muon([p], lr=0.01)
    run([p], opt, 1)
    saved = opt.state_dict()
    with pytest.raises(ValueError) as at_construction:
        muonclip.Muon([torch.nn.Parameter(torch.randn(6, 4))], **{key: value})
    bad = copy.deepcopy(saved)
    bad["param_groups"][0][key] = value
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError) as at_load:
        opt.load_state_dict(bad)
    assert str(at_load.value) == f"param group 0 of the state dict: {at_construction.value}"
    assert opt.param_groups[0][key] == before["param_groups"][0][key]  # nothing loaded
    assert torch.equal(opt.state[p]["momentum_buffer"], before["state"][0]["momentum_buffer"])


def test_load_state_dict_refuses_a_group_with_a_missing_key():
    p = torch.nn.Parameter(torch.randn(6, 4))
    opt = muonclip.Muon([p], lr=0.01)
    bad = opt.state_dict()
    del bad["param_groups"][0]["lr"]
    with pytest.raises(ValueError, match=r"param group 0 of the state dict: keys \['lr'\] are missing"):
        opt.load_state_dict(bad)


# ----------------------------------------------------------------------------------------------
# optimizer-wide values survive a state dict flattened per parameter
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["skip", "mask"])
def test_counters_survive_a_state_dict_flattened_per_parameter(mode):
    """torch.distributed.checkpoint.state_dict with flatten_optimizer_state_dict=True (torchtitan's
    checkpoints) keeps per-parameter state and param-group keys only: the counters ride in the first
    parameter's state."""
    flat = StateDictOptions(flatten_optimizer_state_dict=True)
    torch.manual_seed(0)

    def build():
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
        return model, muonclip.Muon(muonclip.param_groups(model), lr=0.02, on_nonfinite=mode)

    model, opt = build()
    for s in range(4):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        if s == 1:
            model[0].weight.grad[0, 0] = math.nan
        opt.step()
    assert (opt.steps_taken, opt.steps_skipped) == ((4, 1) if mode == "mask" else (3, 1))
    sd = get_optimizer_state_dict(model, opt, options=flat)
    assert all(k.startswith(("state.", "param_groups.")) for k in sd)
    model2, opt2 = build()
    model2.load_state_dict(model.state_dict())
    set_optimizer_state_dict(model2, opt2, sd, options=flat)
    assert (opt2.steps_taken, opt2.steps_skipped) == (opt.steps_taken, opt.steps_skipped)
    for p, q in zip(model.parameters(), model2.parameters()):
        for key, v in opt.state[p].items():
            assert torch.equal(v, opt2.state[q][key]) if torch.is_tensor(v) else v == opt2.state[q][key]
