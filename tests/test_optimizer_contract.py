"""Contract tests in the style of PyTorch's OptimizerInfo suite: a table of configurations
run through generic tests. Every configuration holds Muon and AdamW groups (param_groups)."""

import copy
import math
import re

import pytest
import torch
from toy_models import Mixed, mixed_loss

import muonclip

CONFIGS = {
    "default": dict(),
    "no-nesterov-original": dict(nesterov=False, adjust_lr_fn="original"),
    "polar-fp32": dict(method="polar_express", orth_dtype=torch.float32),
    "svd-unscaled": dict(method="svd", orth_dtype=torch.float64, adjust_lr_fn="unscaled"),
    "torch-kwargs": dict(adjust_lr_fn="match_rms_adamw", ns_steps=4, eps=1e-6),
    "core-workspace": dict(workspace="core"),
    "skip-nonfinite": dict(on_nonfinite="skip", betas=(0.8, 0.99)),
}
configs = pytest.mark.parametrize("cfg", list(CONFIGS), ids=list(CONFIGS))


def build(cfg, seed=0, **over):
    torch.manual_seed(seed)
    model = Mixed()
    opt = muonclip.Muon(muonclip.param_groups(model), **{"lr": 0.01, **CONFIGS[cfg], **over})
    return model, opt


def train(model, opt, steps, start=0):
    for s in range(start, start + steps):
        opt.zero_grad()
        mixed_loss(model, s).backward()
        opt.step()


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@configs
def test_state_dict_round_trip_continues_bit_identically(cfg):
    """Bit for bit on any machine: the state dict holds exact copies, and the continued steps run the same
    ops on the same values with the same kernels."""
    model, opt = build(cfg)
    train(model, opt, 3)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    train(model, opt, 3, start=3)

    model2, opt2 = build(cfg, seed=123)  # other initial weights, fresh state
    model2.load_state_dict(saved_model)
    opt2.load_state_dict(saved_opt)
    train(model2, opt2, 3, start=3)
    assert_same(params_of(model), params_of(model2))
    assert opt2.steps_taken == opt.steps_taken == 6


@configs
def test_parameter_without_grad_is_untouched(cfg):
    """Exact: a parameter without a gradient is never written."""
    model, opt = build(cfg)
    before = params_of(model)
    mixed_loss(model, 0).backward()
    model.lin.weight.grad = None
    model.norm.weight.grad = None
    opt.step()
    after = params_of(model)
    assert torch.equal(before["lin.weight"], after["lin.weight"])
    assert torch.equal(before["norm.weight"], after["norm.weight"])
    assert model.lin.weight not in opt.state
    assert not torch.equal(before["conv.weight"], after["conv.weight"])


@configs
def test_zero_gradients_without_weight_decay_change_nothing(cfg):
    """Exact on any machine: orthogonalize(0) is 0 (0 / eps, and products of zeros), AdamW's 0 / (0 + eps)
    is 0, and W - lr * 0 = W (IEEE)."""
    model, opt = build(cfg, weight_decay=0.0)
    for g in opt.param_groups:
        g["weight_decay"] = 0.0
    before = params_of(model)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
    assert_same(before, params_of(model))
    for p in model.parameters():
        for v in opt.state[p].values():
            if torch.is_tensor(v):
                assert torch.isfinite(v).all()


@configs
def test_lr_zero_changes_nothing(cfg):
    """Exact on any machine: W * (1 - 0 * wd) - 0 * update = W (IEEE)."""
    model, opt = build(cfg, lr=0.0)
    for g in opt.param_groups:
        g["lr"] = 0.0
    before = params_of(model)
    train(model, opt, 2)
    assert_same(before, params_of(model))


@configs
def test_weight_decay_is_decoupled_and_acts(cfg):
    """With zero gradients, one step multiplies every decayed weight by exactly (1 - lr wd).

    Exact on any machine: both sides make one multiplication by the same float scalar (IEEE rounds
    it alike), and the zero gradients give an update of exactly 0."""
    model, opt = build(cfg)
    for g in opt.param_groups:
        g["lr"] = 0.5
        if g["weight_decay"] != 0.0:  # routing gives 0-D/1-D tensors no decay
            g["weight_decay"] = 0.8  # large on purpose
    before = params_of(model)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    after = params_of(model)
    for name in ("lin.weight", "conv.weight", "experts", "emb.weight", "head.weight"):
        torch.testing.assert_close(after[name], before[name] * (1 - 0.5 * 0.8), rtol=0, atol=0)
    assert torch.equal(after["norm.weight"], before["norm.weight"])  # 1-D: no decay by routing


@configs
def test_per_group_options_are_honoured(cfg):
    """A model whose groups have lr a and b equals two optimizers with lr a and b.

    Bit for bit on any machine: no two Muon groups of this model hold matrices of the same shape, so
    one optimizer and two form the same Newton-Schulz batches, and the same kernels run on the same
    values."""
    model, opt = build(cfg)
    opt.param_groups[0]["lr"] = 0.03
    ref_model, ref_opt = build(cfg)
    groups = muonclip.param_groups(ref_model)
    separate = [
        muonclip.Muon([g], lr=0.03 if i == 0 else 0.01, **CONFIGS[cfg]) for i, g in enumerate(groups)
    ]
    for s in range(3):
        opt.zero_grad()
        ref_model.zero_grad()
        mixed_loss(model, s).backward()
        mixed_loss(ref_model, s).backward()
        opt.step()
        for o in separate:
            o.step()
    assert_same(params_of(model), params_of(ref_model))


@configs
def test_deepcopy_is_independent(cfg):
    """Bit for bit on any machine: the loaded state is an exact copy and both run the same ops on the same
    values."""
    model, opt = build(cfg)
    train(model, opt, 1)
    model2 = copy.deepcopy(model)
    opt2 = copy.deepcopy(opt)
    # re-point the copy at the copied model's parameters
    opt2 = type(opt)(muonclip.param_groups(model2), lr=0.01, **CONFIGS[cfg])
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    train(model, opt, 2, start=1)
    train(model2, opt2, 2, start=1)
    assert_same(params_of(model), params_of(model2))
    clone = copy.deepcopy(opt)
    assert (clone.steps_taken, clone.steps_skipped) == (opt.steps_taken, opt.steps_skipped) == (3, 0)
    assert all(g["steps_taken"] == 3 for g in clone.state_dict()["param_groups"])  # optimizer-wide: in every group


@configs
def test_lr_scheduler_drives_the_update(cfg):
    """Exact: with lr 0 the step leaves W as it is (IEEE)."""
    model, opt = build(cfg)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 if step == 0 else 0.0)
    train(model, opt, 1)
    sched.step()
    assert all(g["lr"] == 0.0 for g in opt.param_groups)
    before = params_of(model)
    train(model, opt, 1, start=1)
    assert_same(before, params_of(model))


@configs
def test_nonfinite_gradient_never_reaches_weights_or_state(cfg):
    """Exact: the gradients are checked before anything is written."""
    model, opt = build(cfg)
    train(model, opt, 1)
    before = params_of(model)
    state_before = copy.deepcopy(opt.state_dict()["state"])
    opt.zero_grad()
    mixed_loss(model, 1).backward()
    model.experts.grad[0, 0, 0] = float("nan")
    model.norm.weight.grad[0] = float("inf")
    if CONFIGS[cfg].get("on_nonfinite") == "skip":
        opt.step()
        assert opt.steps_skipped == 1 and opt.steps_taken == 1
    else:
        with pytest.raises(muonclip.NonFiniteGradError, match=r"'experts'.*'norm.weight'.*step 2"):
            opt.step()
    assert_same(before, params_of(model))
    after_state = opt.state_dict()["state"]
    for k, st in state_before.items():
        for key, v in st.items():
            if torch.is_tensor(v):
                assert torch.equal(v, after_state[k][key])
    train(model, opt, 1, start=2)  # recovers with finite gradients
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fp32_buffers_survive_resume_with_bf16_params():
    """Exact: the loaded buffers are copies of the saved bytes."""
    torch.manual_seed(0)
    model = Mixed().to(torch.bfloat16)
    opt = muonclip.Muon(muonclip.param_groups(model), lr=0.01)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    sd = copy.deepcopy(opt.state_dict())
    opt2 = muonclip.Muon(muonclip.param_groups(model), lr=0.01)
    opt2.load_state_dict(sd)
    for p in model.parameters():
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if key in opt2.state[p]:
                assert opt2.state[p][key].dtype == torch.float32
                assert torch.equal(opt2.state[p][key], opt.state[p][key])
    opt2.step()  # bf16 grads meet fp32 buffers


def test_a_state_dict_in_the_keys_before_the_renames_is_refused_by_name():
    """The pre-release keys (``update_scale``, ``steps``, an AdamW group's ``eps``) are not
    translated: such a state dict is refused before anything is loaded, naming the keys it lacks."""
    model, opt = build("default")
    train(model, opt, 1)
    sd = copy.deepcopy(opt.state_dict())
    for g in sd["param_groups"]:
        g["update_scale"], g["steps"] = {"match_rms_adamw": "rms"}[g.pop("adjust_lr_fn")], g.pop("ns_steps")
    model2, opt2 = build("default", seed=1)
    before = copy.deepcopy(opt2.state_dict())
    with pytest.raises(ValueError, match=r"param group 0 of the state dict: keys \['ns_steps', 'adjust_lr_fn'\] "
                                         "are missing"):
        opt2.load_state_dict(sd)
    assert opt2.state_dict() == before


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(lr=-1.0), "lr"),
        (dict(momentum=-0.1), "momentum"),
        (dict(momentum=1.0), "momentum"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(adjust_lr_fn="adamw"), "adjust_lr_fn"),
        (dict(method="newton"), "method"),
        (dict(orth_dtype=torch.int32), "dtype"),
        (dict(ns_steps=0), "steps"),
        (dict(betas=(0.9, 1.0)), "betas"),
        (dict(on_nonfinite="ignore"), "on_nonfinite"),
        (dict(adjust_lr_fn="sqrt"), "adjust_lr_fn"),
        (dict(workspace="gpu"), "workspace"),
        # nan and +-inf: never a setting (each would reach every weight); the error names it
        (dict(lr=math.inf), "lr"),
        (dict(lr=math.nan), "lr"),
        (dict(lr=torch.tensor(math.inf)), "lr"),
        (dict(weight_decay=math.inf), "weight_decay"),
        (dict(weight_decay=math.nan), "weight_decay"),
        (dict(momentum=math.nan), "momentum"),
        (dict(momentum=-math.inf), "momentum"),
        (dict(betas=(math.nan, 0.95)), "betas"),
        (dict(betas=(0.9, math.inf)), "betas"),
        (dict(eps=math.inf), "eps"),
        (dict(eps=math.nan), "eps"),
        (dict(adamw_eps=math.inf), "adamw_eps"),
        (dict(adamw_eps=math.nan), "adamw_eps"),
        (dict(ns_coefficients=(3.4445, math.nan, 2.0315)), "coefficients"),
    ],
)
def test_bad_options_raise_value_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        muonclip.Muon([torch.nn.Parameter(torch.randn(8, 4))], **kwargs)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("key", ["lr", "weight_decay", "eps"])
def test_nonfinite_group_options_are_refused(key, bad):
    """A group's own lr, weight decay or epsilon (``adamw_eps``, in an adamw group), at construction and
    through add_param_group: a ValueError naming it, and the group is not added. A finite 0-D
    tensor lr is accepted (read once, when the group is added)."""
    W, b = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))
    key = "adamw_eps" if key == "eps" else key
    with pytest.raises(ValueError, match=rf"param group's {re.escape(key)} must be a finite number"):
        muonclip.Muon([{"params": [W]}, {"params": [b], "algorithm": "adamw", key: bad}])
    opt = muonclip.Muon([W], lr=torch.tensor(0.01))
    with pytest.raises(ValueError, match=rf"param group's {re.escape(key)} must be a finite number"):
        opt.add_param_group({"params": [b], "algorithm": "adamw", key: bad})
    assert len(opt.param_groups) == 1


def test_vector_in_muon_group_names_parameter_and_fix():
    norm = torch.nn.Parameter(torch.ones(8))
    with pytest.raises(ValueError, match=r"'ln.weight'.*algorithm='adamw'"):
        muonclip.Muon([{"params": [norm], "param_names": ["ln.weight"]}])
    with pytest.raises(ValueError, match="shape"):
        muonclip.Muon([norm])


def test_complex_parameter_rejected():
    with pytest.raises(TypeError, match="complex"):
        muonclip.Muon([torch.nn.Parameter(torch.randn(4, 4, dtype=torch.complex64))])


def test_unknown_algorithm_rejected():
    with pytest.raises(ValueError, match="algorithm"):
        muonclip.Muon([{"params": [torch.nn.Parameter(torch.randn(4, 4))], "algorithm": "sgd"}])


def test_sparse_gradient_rejected():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = muonclip.Muon([{"params": emb.parameters(), "algorithm": "adamw", "param_names": ["emb.weight"]}])
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="'emb.weight'.*sparse"):
        opt.step()


def test_adamw_branch_matches_torch_adamw():
    torch.manual_seed(0)
    a = torch.nn.Parameter(torch.randn(5, 3))
    b = torch.nn.Parameter(a.detach().clone())
    ours = muonclip.Muon([{"params": [a], "algorithm": "adamw"}], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95))
    ref = torch.optim.AdamW([b], lr=0.01, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(5):
        g = torch.randn(5, 3)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_cycle_collector_is_paused_for_the_update_and_left_as_it_was(enabled_before):
    """The collector is off while the update runs (its per-weight records would set off passes
    over the whole heap), back as it was after, after a refused step too, and on during the
    closure (the user's forward and backward)."""
    import gc

    class Seeing(muonclip.optim.workspace.CoreWorkspace):
        seen: list[bool] = []

        def orthogonalize(self, *args, **kwargs):
            Seeing.seen.append(gc.isenabled())
            return super().orthogonalize(*args, **kwargs)

    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(6, 8))
    opt = muonclip.Muon([W], lr=0.01, workspace=Seeing())
    in_closure = []

    def closure():
        in_closure.append(gc.isenabled())
        W.grad = torch.randn_like(W)
        return 0.0

    was = gc.isenabled()
    try:
        gc.enable() if enabled_before else gc.disable()
        opt.step(closure)
        assert Seeing.seen == [False] and in_closure == [enabled_before]
        assert gc.isenabled() == enabled_before
        W.grad = torch.full_like(W, float("nan"))
        with pytest.raises(muonclip.NonFiniteGradError):
            opt.step()
        assert gc.isenabled() == enabled_before
    finally:
        gc.enable() if was else gc.disable()
