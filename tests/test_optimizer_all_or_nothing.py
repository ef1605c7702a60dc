"""A `muonclip.Muon` step runs whole or not at all, and what it is given is checked first: every
hyperparameter for its kind, range and the overflow of what the step computes from it (at
construction, in a group, between steps, in a loaded state dict), every loaded state tensor and
counter against its parameter (muonclip.optim._validation, muonclip.optim._state_validation).
Each refusal is a ValueError (TypeError for a complex parameter) naming what is wrong, and the
optimizer, its parameters and its counters are exactly as they were."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from toy_models import Mixed, mixed_loss

import muonclip


def build(seed=0, **kw):
    torch.manual_seed(seed)
    model = Mixed()
    return model, muonclip.Muon(muonclip.param_groups(model), **{"lr": 0.02, **kw})


def trained(steps=2, **kw):
    model, opt = build(**kw)
    for s in range(steps):
        opt.zero_grad()
        mixed_loss(model, s).backward()
        opt.step()
    return model, opt


def weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def same_tree(a, b):
    """Exact equality of two state dicts (tensors by value and dtype)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_tree(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return a == b


# ------------------------------------------------------------------------------------------------
# arguments: kind, range, overflow


@pytest.mark.parametrize(("kwargs", "match"), [
    # before: accepted, then step() updated the first matrix and died with "value cannot be converted to
    # type float without overflow", steps_taken already 1
    (dict(lr=1e39), r"lr=1e\+39 is too large: the step multiplies it by its largest update scale .* use lr <= "),
    (dict(lr=1e308, weight_decay=0.0), r"lr=1e\+308 is too large"),
    (dict(lr=1e38, weight_decay=10.0), r"lr=1e\+38 is too large: the step multiplies it by weight_decay"),
    (dict(lr="0.1"), r"lr must be a number \(an int or a float\), got '0.1' \(str\)"),  # before: accepted
    (dict(betas=0.9), r"betas must be two numbers in \[0, 1\), got 0.9"),  # before: TypeError "not iterable"
    (dict(betas=(0.9,)), r"betas must be two numbers"),
    (dict(betas=("a", 0.9)), r"betas must be a number"),
    (dict(momentum=True), r"momentum must be a number"),
    (dict(nesterov="no"), r"nesterov must be True or False"),
    (dict(weight_decay=None), r"weight_decay must be a number"),
    (dict(lr=10**400), r"lr must be a finite number, got an int of"),
    (dict(lr=torch.zeros(2)), r"lr must be a number or a one-element real tensor"),
    (dict(lr=torch.tensor(0.02, device="meta")), r"lr is a tensor on the meta device"),
    (dict(ns_coefficients="abc"), r"ns_coefficients must be None or three numbers"),
    (dict(eps=1e39, orth_dtype=torch.float32), r"eps=1e\+39 does not fit orth_dtype torch.float32"),
])
def test_bad_arguments_are_value_errors_that_name_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        build(**kwargs)


def test_the_overflow_limit_is_the_parameters_dtype_and_exact():
    """The limit is the largest value of the parameters' own dtype over the factor the step
    applies: float16 weights take far smaller rates than float32 ones; a rate just under the limit
    is accepted and its step is finite, just over it refused."""
    W = torch.nn.Parameter(torch.zeros(8, 8))
    scale = 0.2 * math.sqrt(8)  # match_rms_adamw of an 8 x 8 matrix
    limit = torch.finfo(torch.float32).max / scale
    muonclip.Muon([W], lr=limit * 0.999, weight_decay=0.0)
    with pytest.raises(ValueError, match=r"use lr <= 6\.01\d*e\+38"):
        muonclip.Muon([W], lr=limit * 1.001, weight_decay=0.0)
    half = torch.nn.Parameter(torch.zeros(8, 8, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"beyond the largest value of the parameters' dtype \(6\.55\d*e\+04\)"):
        muonclip.Muon([half], lr=2e5, weight_decay=0.0)
    b = torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"lr / \(1 - beta1\)|1 / \(1 - beta1\)"):  # AdamW: lr / (1 - 0.9) at step 1
        muonclip.Muon([{"params": [b], "algorithm": "adamw"}], lr=1e38, weight_decay=0.0)
    opt = muonclip.Muon([{"params": [b], "algorithm": "adamw"}], lr=3e37, weight_decay=0.0)
    b.grad = torch.ones(4)
    opt.step()
    assert torch.isfinite(b).all()


def test_a_group_refused_by_add_param_group_is_not_added():
    model, opt = build()
    with pytest.raises(ValueError, match=r"param group's lr=1e\+39 is too large"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(5, 5))], "param_names": ["extra"], "lr": 1e39})
    assert len(opt.param_groups) == len(muonclip.param_groups(model))


# ------------------------------------------------------------------------------------------------
# the step: all or nothing


@pytest.mark.parametrize(("algorithm", "key", "value", "match"), [
    ("muon", "lr", 1e39, r"param group \d's lr=1e\+39 is too large"),
    ("adamw", "lr", 1e39, r"lr=1e\+39 is too large: the step multiplies it by 1 / \(1 - beta1\)"),
    ("adamw", "lr", "0.1", r"param group \d's lr must be a number"),
    ("muon", "lr", math.nan, r"param group \d's lr must be a finite number"),
    ("muon", "weight_decay", -1.0, r"weight_decay must be a finite number >= 0"),
    ("muon", "momentum", 1.5, r"momentum must be in \[0, 1\)"),
    ("adamw", "betas", 0.9, r"betas must be two numbers"),
    ("muon", "nesterov", "yes", r"nesterov must be True or False"),
    ("muon", "normuon_beta2", 2.0, r"normuon_beta2 must be in \[0, 1\)"),
    ("muon", "method", "newton", r"param group \d: unknown orthogonalisation method"),
])
def test_a_value_set_between_steps_is_refused_before_anything_changes(algorithm, key, value, match):
    """What a scheduler or a user sets in a group between steps: on the old code lr=1e39 in an AdamW
    group updated every Muon matrix first, then raised with steps_taken already advanced."""
    model, opt = trained()
    group = max(i for i, g in enumerate(opt.param_groups) if g["algorithm"] == algorithm)  # the last of its kind
    before_w, before_state, taken = weights(model), copy.deepcopy(opt.state_dict()), opt.steps_taken
    opt.param_groups[group][key] = value
    opt.zero_grad()
    mixed_loss(model, 5).backward()
    with pytest.raises(ValueError, match=match):
        opt.step()
    assert same_tree(weights(model), before_w) and opt.steps_taken == taken
    after = opt.state_dict()
    after["param_groups"][group][key] = before_state["param_groups"][group][key]
    assert same_tree(after, before_state)


def test_a_valid_schedule_after_a_refused_value_steps_as_if_nothing_happened():
    """The check keeps no stale verdict: putting the value back, the step equals an untouched twin's."""
    model, opt = trained()
    twin_model, twin = copy.deepcopy((model, opt))
    opt.param_groups[0]["lr"] = 1e39
    for m in (model, twin_model):
        m.zero_grad()
        mixed_loss(m, 5).backward()
    with pytest.raises(ValueError):
        opt.step()
    opt.param_groups[0]["lr"] = twin.param_groups[0]["lr"]
    opt.step()
    twin.step()
    assert same_tree(weights(model), weights(twin_model)) and opt.steps_taken == twin.steps_taken


def test_a_meta_parameter_is_named_at_the_step():
    """On the old code: "Tensor.item() cannot be called on meta tensors" from inside the step."""
    with torch.device("meta"):
        W = torch.nn.Parameter(torch.randn(4, 4))
    opt = muonclip.Muon([{"params": [W], "param_names": ["w"]}], lr=0.02)
    W.grad = torch.zeros_like(W)
    with pytest.raises(ValueError, match=r"parameter 'w' is on the meta device: it has no data.*to_empty"):
        opt.step()
    assert opt.steps_taken == 0


# ------------------------------------------------------------------------------------------------
# load_state_dict: every state tensor and counter


def _first(sd, algorithm, opt):
    """Saved id of the first parameter of the first group of ``algorithm`` (with state)."""
    for saved, own in zip(sd["param_groups"], opt.param_groups):
        if own["algorithm"] == algorithm:
            return saved["params"][0], saved["params"][1] if len(saved["params"]) > 1 else None
    raise AssertionError(algorithm)


def _set(sd, pid, key, value):
    sd["state"][pid][key] = value


MUTATIONS = {
    # muon momentum: shape (of the second parameter: on the old code parameter 0 was updated, then the step raised),
    # NaN, inf, dtype, not a tensor
    "momentum_buffer wrong shape": (("muon", 1), "momentum_buffer", lambda t: torch.zeros(3, 3),
                                    r"momentum_buffer has shape \(3, 3\), the parameter needs"),
    "momentum_buffer NaN": (("muon", 0), "momentum_buffer", lambda t: torch.full_like(t, math.nan),
                            r"momentum_buffer holds NaN or inf"),
    "momentum_buffer inf": (("muon", 0), "momentum_buffer", lambda t: t.clone().fill_(math.inf), "NaN or inf"),
    "momentum_buffer int": (("muon", 0), "momentum_buffer", lambda t: t.to(torch.int64),
                            r"must be a real floating-point tensor, got dtype torch.int64"),
    "momentum_buffer list": (("muon", 0), "momentum_buffer", lambda t: t.tolist(), r"must be a tensor"),
    # adamw moments and step
    "exp_avg_sq negative": (("adamw", 0), "exp_avg_sq", lambda t: -torch.ones_like(t),
                            r"exp_avg_sq holds a negative value \(-1\)"),
    "exp_avg NaN": (("adamw", 0), "exp_avg", lambda t: torch.full_like(t, math.nan), "exp_avg holds NaN"),
    "exp_avg wrong shape": (("adamw", 0), "exp_avg", lambda t: torch.zeros(t.numel() + 1), "exp_avg has shape"),
    "step negative": (("adamw", 0), "step", lambda v: -1, r"step must be a whole number >= 0, got -1"),
    "step string": (("adamw", 0), "step", lambda v: "abc", r"step must be a whole number >= 0, got 'abc'"),
    "step float": (("adamw", 0), "step", lambda v: 2.5, r"step must be a whole number"),
    "step bool": (("adamw", 0), "step", lambda v: True, r"step must be a whole number"),
}


def counters(sd):
    """The dict of a state dict that holds the optimizer-wide counters: a param group, or (the format
    before they moved to the groups) the first parameter's state entry."""
    if "steps_taken" in sd["param_groups"][0]:
        return sd["param_groups"][0]
    return sd["state"][sd["param_groups"][0]["params"][0]]


@pytest.mark.parametrize("case", list(MUTATIONS))
def test_load_state_dict_checks_every_state_tensor_and_counter(case):
    (algorithm, which), key, mutate, match = MUTATIONS[case]
    _, src = trained()
    sd = copy.deepcopy(src.state_dict())
    first, second = _first(sd, algorithm, src)
    pid = first if which == 0 else second
    _set(sd, pid, key, mutate(sd["state"][pid][key]))
    model, opt = trained(seed=1)
    before_w, before = weights(model), copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert same_tree(opt.state_dict(), before) and same_tree(weights(model), before_w)
    opt.zero_grad()
    mixed_loss(model, 3).backward()
    opt.step()  # still usable, and never NaN
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize(("key", "value", "match"), [
    # on the old code "abc" gave a ValueError whose message was a generator's repr
    ("steps_taken", "abc", r"steps_taken must be a whole number >= 0, got 'abc'"),
    ("steps_taken", -3, r"steps_taken must be a whole number"),
    ("steps_skipped", 0.5, r"steps_skipped must be a whole number"),
])
def test_load_state_dict_checks_the_counters(key, value, match):
    _, src = trained()
    sd = copy.deepcopy(src.state_dict())
    counters(sd)[key] = value
    model, opt = trained(seed=1)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(sd)
    assert same_tree(opt.state_dict(), before) and opt.steps_taken == 2


def test_load_state_dict_checks_8bit_and_normuon_state():
    _, src = trained(momentum_8bit=True, normuon=True)
    good = src.state_dict()
    first, _ = _first(good, "muon", src)
    for key, value, match in [
        ("momentum_int8", lambda t: t.float(), r"momentum_int8 must be int8 codes"),
        ("momentum_scale", lambda t: -torch.ones_like(t), r"momentum_scale holds a negative value"),
        ("momentum_scale", lambda t: torch.ones(1), r"momentum_scale has shape \(1,\)"),
        ("neuron_second_moment", lambda t: t[:, :1].clone(), r"neuron_second_moment has shape"),
    ]:
        sd = copy.deepcopy(good)
        _set(sd, first, key, value(sd["state"][first][key]))
        _, opt = trained(seed=1, momentum_8bit=True, normuon=True)
        before = copy.deepcopy(opt.state_dict())
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(sd)
        assert same_tree(opt.state_dict(), before)
    sd = copy.deepcopy(good)
    del sd["state"][first]["momentum_scale"]
    _, opt = trained(seed=1, momentum_8bit=True, normuon=True)
    with pytest.raises(ValueError, match=r"needs both momentum_int8 and momentum_scale"):
        opt.load_state_dict(sd)


def clip_opt(steps):
    """A MuonClip (tau 100) on a one-layer GPT after ``steps`` steps."""
    from muonclip.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16))
    opt = muonclip.MuonClip(model, lr=0.02)
    for s in range(steps):
        x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(s))
        model(x, x)[1].backward()
        opt.step()
        opt.zero_grad()
    return opt


def test_muonclip_tau_in_a_loaded_state_is_checked_before_the_load():
    """On the old code a bad tau raised only in the post-hook, after torch had loaded every tensor
    of the (other) state: the optimizer was left with that state."""
    sd = copy.deepcopy(clip_opt(2).state_dict())
    opt = clip_opt(1)
    before = copy.deepcopy(opt.state_dict())
    for bad in ("big", -1.0, math.inf):
        counters(sd)["tau"] = bad
        with pytest.raises(ValueError, match=r"tau must be a finite number > 0"):
            opt.load_state_dict(sd)
        assert same_tree(opt.state_dict(), before) and opt.tau == 100.0


def test_a_valid_state_dict_still_loads_and_continues_bit_identically():
    """The checks refuse nothing that is a real state: a resumed optimizer continues exactly."""
    model, opt = trained()
    twin_model = copy.deepcopy(model)
    twin = muonclip.Muon(muonclip.param_groups(twin_model), lr=0.02)
    twin.load_state_dict(opt.state_dict())
    for m, o in ((model, opt), (twin_model, twin)):
        o.zero_grad()
        mixed_loss(m, 7).backward()
        o.step()
    assert same_tree(weights(model), weights(twin_model)) and same_tree(opt.state_dict(), twin.state_dict())


# ------------------------------------------------------------------------------------------------
# load_state_dict: every tensor holds values, a state that has taken steps is whole, and a load
# that fails late puts everything back


META = {  # (algorithm, key): a known buffer of each algorithm, and a key this version does not know
    "muon momentum_buffer": ("muon", "momentum_buffer"),
    "adamw exp_avg": ("adamw", "exp_avg"),
    "unknown key": ("muon", "extra_buffer"),
}


@pytest.mark.parametrize("case", list(META))
def test_a_state_tensor_on_the_meta_device_is_refused_before_anything_changes(case):
    """On the old code torch's loader replaced the optimizer's state, then failed copying the meta
    tensor (NotImplementedError "Cannot copy out of meta tensor"): the optimizer was left with the
    new state stripped of every momentum and moment."""
    algorithm, key = META[case]
    _, src = trained()
    sd = copy.deepcopy(src.state_dict())
    pid, _ = _first(sd, algorithm, src)
    _set(sd, pid, key, torch.empty_like(sd["state"][pid].get(key, torch.zeros(3)), device="meta"))
    model, opt = trained(seed=1)
    before_w, before = weights(model), copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=rf"the state of parameter '\w+': {key} is on the meta device: it holds no "
                                         r"values to load"):
        opt.load_state_dict(sd)
    assert same_tree(opt.state_dict(), before) and same_tree(weights(model), before_w)
    opt.zero_grad()
    mixed_loss(model, 3).backward()
    opt.step()  # still usable
    assert opt.steps_taken == 3


def test_muonclip_refuses_a_meta_momentum_and_keeps_its_state_and_tau():
    sd = copy.deepcopy(clip_opt(3).state_dict())
    counters(sd)["tau"] = 7.0
    pid = next(p for p, entry in sd["state"].items() if "momentum_buffer" in entry)
    sd["state"][pid]["momentum_buffer"] = sd["state"][pid]["momentum_buffer"].to("meta")
    opt = clip_opt(1)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"momentum_buffer is on the meta device"):
        opt.load_state_dict(sd)
    assert same_tree(opt.state_dict(), before) and opt.steps_taken == 1 and opt.tau == 100.0


def test_a_load_that_fails_after_torch_replaced_the_state_puts_everything_back():
    """A failure after torch's loader has replaced the state (here a load post-hook that raises; a
    copy to a device that runs out of memory is another): the state, the param groups, the counters
    and tau (the recorders' threshold too) are back as they were. On the old code the optimizer kept
    the new state, steps_taken 3 and tau 7."""
    sd = copy.deepcopy(clip_opt(3).state_dict())
    counters(sd)["tau"] = 7.0
    opt = clip_opt(1)
    before = copy.deepcopy(opt.state_dict())

    def fails(o):
        raise RuntimeError("a post-hook failed")

    opt.register_load_state_dict_post_hook(fails)
    with pytest.raises(RuntimeError, match="a post-hook failed"):
        opt.load_state_dict(sd)
    assert same_tree(opt.state_dict(), before) and opt.steps_taken == 1 and opt.tau == 100.0
    assert all(layer.recorder.threshold == 100.0 for layer in opt.layers)


WHOLE = {  # (optimizer options, algorithm, keys removed from one entry, what the message says is missing)
    "muon momentum": ({}, "muon", ["momentum_buffer"], r"its Muon momentum \(momentum_buffer, or momentum_int8 "
                                                         r"and momentum_scale with momentum_8bit\) is missing"),
    "8-bit codes and scales": ({"momentum_8bit": True}, "muon", ["momentum_int8", "momentum_scale"],
                               r"its Muon momentum .* is missing"),
    "normuon second moment": ({"normuon": True}, "muon", ["neuron_second_moment"],
                              r"neuron_second_moment \(NorMuon's second moment; the group has normuon=True\) is "
                              r"missing"),
    "adamw moments": ({}, "adamw", ["step", "exp_avg", "exp_avg_sq"],
                      r"its AdamW state \(step, exp_avg and exp_avg_sq\) is missing"),
}


@pytest.mark.parametrize("case", list(WHOLE))
def test_a_state_that_has_taken_steps_must_hold_every_entrys_state(case):
    """On the old code an entry without its momentum (or moments) loaded and the step made it anew,
    zeros: the resumed run silently no longer continued the saved one. A weight that has had no
    gradient has no entry at all, and that still loads."""
    kw, algorithm, keys, match = WHOLE[case]
    _, src = trained(**kw)
    sd = copy.deepcopy(src.state_dict())
    pid, _ = _first(sd, algorithm, src)
    for key in keys:
        del sd["state"][pid][key]
    model, opt = trained(seed=1, **kw)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match=r"the state of parameter '\w+': " + match + r", though the state dict "
                                         r"has taken 2 steps: loading it would restart that state from zero"):
        opt.load_state_dict(sd)
    assert same_tree(opt.state_dict(), before)
    del sd["state"][pid]  # no entry: the weight had no gradient yet
    opt.load_state_dict(sd)
    assert opt.steps_taken == 2


def test_every_real_state_still_loads_and_continues_bit_identically():
    """Nothing a real optimizer saves is refused by the rule above: a fresh optimizer's state dict
    (no step, nothing required); after steps, a weight that never had a gradient (no entry), one
    only looked up in ``opt.state`` (an empty entry, not saved), NorMuon switched on since the last
    step (the zero second moment the next step would make, saved)."""
    model, fresh = build()
    _, opt = trained(seed=1)
    opt.load_state_dict(fresh.state_dict())
    assert opt.steps_taken == 0 and not opt.state

    model, opt = build()
    for s in range(2):
        opt.zero_grad()
        mixed_loss(model, s).backward()
        model.lin.weight.grad = None  # a Muon weight without a gradient (a frozen or unused layer)
        opt.step()
    assert model.lin.weight not in opt.state
    opt.state[model.lin.weight]  # noqa: B018  (a lookup: torch's state is a defaultdict)
    for g in opt.param_groups:
        if g["algorithm"] == "muon":
            g["normuon"] = True
    sd = opt.state_dict()
    assert all(entry for entry in sd["state"].values())
    twin_model = copy.deepcopy(model)
    twin = muonclip.Muon(muonclip.param_groups(twin_model), lr=0.02)
    twin.load_state_dict(sd)
    for m, o in ((model, opt), (twin_model, twin)):
        o.zero_grad()
        mixed_loss(m, 7).backward()
        o.step()
    assert same_tree(weights(model), weights(twin_model)) and same_tree(opt.state_dict(), twin.state_dict())


# ------------------------------------------------------------------------------------------------
# the counters between steps


@pytest.mark.parametrize("value", [-1, 2.5, math.nan, math.inf, "3", True, None, 2**63])
def test_a_counter_set_out_of_range_is_refused_and_the_old_value_kept(value):
    """On the old code ``opt.steps_taken = -1`` was kept and the next step ran (steps_taken 0 after
    it), 2.5 became 2 and "3" 3; nan, inf and None raised int()'s errors."""
    model, opt = trained()
    for key in ("steps_taken", "steps_skipped"):
        with pytest.raises(ValueError, match=rf"Muon\.{key} must be a whole number >= 0, got "):
            setattr(opt, key, value)
    assert opt.steps_taken == 2 and opt.steps_skipped == 0
    assert all(g["steps_taken"] == 2 and g["steps_skipped"] == 0 for g in opt.param_groups)
    opt.steps_taken = torch.tensor(5)  # a whole number in any form is taken
    assert opt.steps_taken == 5 and isinstance(opt.steps_taken, int)


def test_the_step_refuses_counters_that_bypassed_the_setters_before_anything_changes():
    """An optimizer restored from a pickle (``torch.save(opt)``) gets its counters through
    ``__setstate__``, not the setters: the step checks them (and MuonClip's tau) again first."""
    model, opt = trained()
    opt.zero_grad()
    mixed_loss(model, 5).backward()
    before_w, before = weights(model), copy.deepcopy(opt.state_dict())
    for attr, value, match in (("_taken", -1, r"Muon\.steps_taken must be a whole number >= 0, got -1"),
                               ("_skipped_host", 1.5, r"Muon\.steps_skipped must be a whole number >= 0, got 1.5")):
        kept = opt.__dict__[attr]
        opt.__dict__[attr] = value  # as an edited pickle restores it
        with pytest.raises(ValueError, match=match):
            opt.step()
        opt.__dict__[attr] = kept
        assert same_tree(weights(model), before_w) and same_tree(opt.state_dict(), before)
    clip = clip_opt(1)
    clip.__dict__["_tau"] = math.nan
    with pytest.raises(ValueError, match=r"MuonClip\.tau must be a finite number > 0, got nan"):
        clip.step()
    assert clip.steps_taken == 1
