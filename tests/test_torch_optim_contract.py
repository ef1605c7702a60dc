"""torch.optim's generic optimizer contract, run on muonclip.Muon and torch.optim.Muon side by side.

The behaviours of PyTorch's own generic optimizer tests (``OptimizerInfo`` for Muon in
``torch/testing/_internal/common_optimizers.py``): state-dict round trips with the four
state-dict hooks, deepcopy and pickle, closures, ``zero_grad``, groups added later, tensor
learning rates, step hooks and bad arguments. Every test runs for both classes in float32 and
float64 (2-D weights: torch.optim.Muon takes nothing else); torch.optim.Muon is the control
that the test asks what torch asks.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

import muonclip

CLASSES = {"muonclip": muonclip.Muon, "torch": torch.optim.Muon}
both = pytest.mark.parametrize("cls", list(CLASSES))
dtypes = pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
SHAPES = [(8, 6), (6, 10)]


def make(cls, dtype, lr=0.02, seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g, dtype=dtype)) for s in SHAPES]
    return params, CLASSES[cls](params, lr=lr, **kw)


def grads(params, step):
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def run(params, opt, steps, start=0):
    for s in range(start, start + steps):
        grads(params, s)
        opt.step()


def momentum(opt, p):
    return opt.state[p]["momentum_buffer"]


@both
@dtypes
def test_state_dict_round_trip_continues_bit_identically(cls, dtype):
    params, opt = make(cls, dtype)
    run(params, opt, 2)
    saved = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    run(params, opt, 2, start=2)
    params2, opt2 = make(cls, dtype, seed=1)
    with torch.no_grad():
        for p, w in zip(params2, weights):
            p.copy_(w)
    opt2.load_state_dict(saved)
    run(params2, opt2, 2, start=2)
    for p, q in zip(params, params2):
        assert torch.equal(p, q)


@both
@dtypes
def test_load_state_dict_hooks_are_respected(cls, dtype):
    """A load pre-hook that returns a changed dict changes what is loaded; a post-hook that edits
    the loaded state keeps its edit; state_dict's pre- and post-hooks run."""
    params, opt = make(cls, dtype)
    run(params, opt, 2)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("pre"))
    opt.register_state_dict_post_hook(lambda o, sd: {**sd, "seen": True})
    saved = opt.state_dict()
    assert calls == ["pre"] and saved["seen"]
    saved.pop("seen")

    def doubled(o, sd):  # a new dict: every momentum buffer times 2, lr 0.5
        state = {k: {**v, "momentum_buffer": 2 * v["momentum_buffer"]} for k, v in sd["state"].items()}
        return {**sd, "state": state, "param_groups": [{**g, "lr": 0.5} for g in sd["param_groups"]]}

    _, fresh = make(cls, dtype)
    fresh_params = [p for g in fresh.param_groups for p in g["params"]]
    fresh.register_load_state_dict_pre_hook(doubled)
    fresh.load_state_dict(copy.deepcopy(saved))
    for p, q in zip(params, fresh_params):
        torch.testing.assert_close(momentum(fresh, q), 2 * momentum(opt, p), rtol=0, atol=0)
    assert fresh.param_groups[0]["lr"] == 0.5

    _, other = make(cls, dtype)
    other_params = [p for g in other.param_groups for p in g["params"]]
    other.register_load_state_dict_post_hook(lambda o: [momentum(o, p).zero_() for p in other_params])
    other.load_state_dict(copy.deepcopy(saved))
    assert all(torch.count_nonzero(momentum(other, p)) == 0 for p in other_params)


@both
@dtypes
def test_deepcopy_and_pickle_give_independent_equal_optimizers(cls, dtype):
    params, opt = make(cls, dtype)
    run(params, opt, 1)
    opt.register_step_post_hook(lambda o, args, kwargs: None)  # a lambda: hooks are not copied (torch's rule)
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        cparams = [p for g in clone.param_groups for p in g["params"]]
        assert all(c is not p for c, p in zip(cparams, params))
        ref_params = [p.detach().clone().requires_grad_() for p in params]
        ref = CLASSES[cls](ref_params, lr=0.02)
        ref.load_state_dict(copy.deepcopy(opt.state_dict()))
        run(cparams, clone, 2, start=1)
        run(ref_params, ref, 2, start=1)
        for c, r in zip(cparams, ref_params):
            assert torch.equal(c, r)


@both
@dtypes
def test_closure_is_evaluated_with_grad_and_its_loss_returned(cls, dtype):
    params, opt = make(cls, dtype)
    before = [p.detach().clone() for p in params]

    def closure():
        opt.zero_grad()
        loss = sum((p**2).sum() for p in params)
        loss.backward()
        return loss

    with torch.no_grad():
        loss = opt.step(closure)
    assert loss.item() == pytest.approx(sum(float((b**2).sum()) for b in before))
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


@both
@dtypes
def test_zero_grad(cls, dtype):
    params, opt = make(cls, dtype)
    grads(params, 0)
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    opt.zero_grad()
    assert all(p.grad is None for p in params)
    opt.step()  # no gradients: nothing happens
    assert not opt.state


@both
@dtypes
def test_param_group_added_later_is_stepped_with_its_options(cls, dtype):
    params, opt = make(cls, dtype)
    run(params, opt, 1)
    extra = torch.nn.Parameter(torch.randn(5, 7, dtype=dtype))
    opt.add_param_group({"params": [extra], "lr": 0.0, "weight_decay": 0.0})
    w = extra.detach().clone()
    grads(params, 1)
    extra.grad = torch.ones_like(extra)
    opt.step()
    assert torch.equal(extra, w)  # lr 0: the group's own options apply
    assert "momentum_buffer" in opt.state[extra]
    opt.param_groups[-1]["lr"] = 0.1
    opt.step()
    assert not torch.equal(extra, w)


@both
@dtypes
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0d", "1", "1x1"])
def test_tensor_lr_of_any_one_element_shape(cls, dtype, shape):
    """0.015625 = 2**-6: a float32 tensor holds it exactly, so the tensor and the float describe the same
    lr."""
    params, opt = make(cls, dtype, lr=torch.full(shape, 0.015625))
    ref_params, ref = make(cls, dtype, lr=0.015625)
    run(params, opt, 2)
    run(ref_params, ref, 2)
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@both
@dtypes
def test_step_hooks_run_around_each_step(cls, dtype):
    params, opt = make(cls, dtype)
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(("pre", len(o.state))))
    handle = opt.register_step_post_hook(lambda o, args, kwargs: seen.append(("post", len(o.state))))
    run(params, opt, 2)
    assert seen == [("pre", 0), ("post", 2), ("pre", 2), ("post", 2)]
    handle.remove()
    run(params, opt, 1, start=2)
    assert seen[-1] == ("pre", 2)


@pytest.mark.parametrize("first", ["Muon", "MuonClip"])
def test_every_step_hook_runs_once_per_step_in_either_construction_order(monkeypatch, first):
    """torch wraps the ``step`` of each optimizer class the first time one is built (the code that
    runs the step hooks). On the old code MuonClip.step called Muon's wrapped step, so once a plain
    Muon had been built in the process (before or after MuonClip) every global and per-instance
    hook ran twice per MuonClip step. Each class's step is unwrapped here first, so the order of
    construction is this test's."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from muonclip.models import GPT, GPTConfig

    for cls in (muonclip.Muon, muonclip.MuonClip):
        if getattr(cls.__dict__.get("step"), "hooked", False):
            monkeypatch.setattr(cls, "step", cls.__dict__["step"].__wrapped__)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    params, _ = make("muonclip", torch.float32)

    def build(name):
        return muonclip.Muon(params, lr=0.02) if name == "Muon" else muonclip.MuonClip(model, lr=0.02)

    built = {first: build(first)}
    second = "MuonClip" if first == "Muon" else "Muon"
    built[second] = build(second)
    counts: dict[tuple[str, str], int] = {}

    def counter(where):
        def hook(opt, args, kwargs):
            key = (type(opt).__name__, where)
            counts[key] = counts.get(key, 0) + 1
        return hook

    handles = [register_optimizer_step_pre_hook(counter("global pre")),
               register_optimizer_step_post_hook(counter("global post"))]
    for opt in built.values():
        handles += [opt.register_step_pre_hook(counter("pre")), opt.register_step_post_hook(counter("post"))]
    try:
        for s in range(2):
            x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(s))
            model(x, x)[1].backward()
            built["MuonClip"].step()
            grads(params, s)
            built["Muon"].step()
    finally:
        for h in handles:
            h.remove()
    assert counts == {(name, where): 2 for name in built for where in ("global pre", "global post", "pre", "post")}


@both
@pytest.mark.parametrize("kwargs", [dict(lr=-1.0), dict(momentum=-0.5), dict(weight_decay=-1.0),
                                    dict(adjust_lr_fn="arbitrary"), dict(lr=torch.tensor([0.1, 0.2]))],
                         ids=["lr", "momentum", "weight_decay", "adjust_lr_fn", "lr-2-elements"])
def test_bad_arguments_are_refused(cls, kwargs):
    with pytest.raises(ValueError):
        CLASSES[cls]([torch.nn.Parameter(torch.randn(4, 3))], **kwargs)
    with pytest.raises(TypeError, match="params argument given to the optimizer should be an iterable"):
        CLASSES[cls](torch.nn.Parameter(torch.randn(4, 3)))
    p = torch.nn.Parameter(torch.randn(4, 3))
    with pytest.raises(ValueError, match="some parameters appear in more than one parameter group"):
        CLASSES[cls]([{"params": [p]}, {"params": [p]}])


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)], ids=["0d", "1", "1x1"])
def test_tensor_lr_in_the_adamw_branch_matches_torch_adamw(shape):
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 3))
    b = torch.nn.Parameter(a.detach().clone())
    ours = muonclip.Muon([{"params": [a], "algorithm": "adamw"}], lr=torch.full(shape, 0.015625), weight_decay=0.1)
    ref = torch.optim.AdamW([b], lr=0.015625, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(3):
        g = torch.randn(5, 3)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_complex_parameters_are_refused_when_added():
    """Our choice (torch.optim.Muon raises at the first step): refused at construction and by
    add_param_group, saying why and what to do."""
    z = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))
    with pytest.raises(TypeError, match="complex.*real parameters only.*view_as_real"):
        muonclip.Muon([z])
    opt = muonclip.Muon([torch.nn.Parameter(torch.randn(4, 4))])
    with pytest.raises(TypeError, match="complex"):
        opt.add_param_group({"params": [z]})
    assert len(opt.param_groups) == 1
    z.grad = torch.randn_like(z)
    with pytest.raises(RuntimeError, match="complex"):
        torch.optim.Muon([z]).step()
