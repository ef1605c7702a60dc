"""One default in one place: every public function and class reads `muonclip.common.defaults`.

The functional API (`muonclip.muon_update`, `muonclip.orthogonalize` and the orthogonalisers
under it), the classes (`muonclip.Muon`, `muonclip.MuonClip`, the workspaces), the torchtitan
container's config and the app's run config must agree on every default they share, and the
same call with the defaults must be the same update on every machine: each test that depends on
what the CPU multiplies runs under both of ``orth_dtype="auto"``'s answers (``bf16_answer``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest
import torch
from probes import latest_structure

import muonclip
from muonclip.common import _hardware as hardware
from muonclip.common import defaults as D
from muonclip.fast import BufferedWorkspace
from muonclip.fast._compiled import compiled_newton_schulz
from muonclip.fast._symmetric import symmetric_newton_schulz
from muonclip.optim.workspace import CoreWorkspace
from muonclip.ortho import newton_schulz, ns5_schedule, orthogonalize, resolve_orth_dtype, svd_polar
from muonclip.ortho._gram import gram_newton_schulz

CONCEPTS = {
    "weight_decay": D.WEIGHT_DECAY, "momentum": D.MOMENTUM, "nesterov": D.NESTEROV, "method": D.METHOD,
    "steps": D.NS_STEPS, "ns_steps": D.NS_STEPS, "dtype": D.ORTH_DTYPE, "orth_dtype": D.ORTH_DTYPE, "eps": D.EPS,
    "coefficients": D.NS_COEFFICIENTS, "ns_coefficients": D.NS_COEFFICIENTS, "adjust_lr_fn": D.ADJUST_LR_FN,
    "betas": D.BETAS, "adamw_eps": D.ADAMW_EPS, "normuon_beta2": D.NORMUON_BETA2, "tau": D.TAU,
}
"""Each argument name that means one of the defaults, with its value (the functional API names
the orthogonaliser's arguments ``steps``, ``dtype``, ``coefficients``; the classes ``ns_steps``,
``orth_dtype``, ``ns_coefficients``)."""

SCANNED = ("muonclip.ortho", "muonclip.optim", "muonclip.fast", "muonclip.qkclip", "muonclip.integrations")
"""The packages whose public names are scanned (the attention layer's ``scale`` and the like are
other concepts and have none of these names)."""

OTHER = {("svd_polar", "dtype"), ("param_groups", "weight_decay")}
"""(callable, argument) pairs that are another default on purpose: svd computes in float64,
which is what ``"auto"`` resolves to for it (checked below); `muonclip.param_groups`'
``weight_decay=None`` leaves the groups to the optimizer's."""


def _public_callables():
    """Every public function and class (its ``__init__``) of `SCANNED`, plus the workspaces'
    ``orthogonalize`` and the registered methods' functions, as (name, callable)."""
    found = {}
    for package in SCANNED:
        pkg = importlib.import_module(package)
        modules = [pkg] + [importlib.import_module(m.name) for m in pkgutil.iter_modules(pkg.__path__, package + ".")
                           if not m.name.rsplit(".", 1)[1].startswith("_") and "torchtitan" not in m.name]
        for mod in modules:
            for name in getattr(mod, "__all__", []):
                obj = getattr(mod, name)
                if inspect.isclass(obj) or inspect.isfunction(obj):
                    found[name] = obj.__init__ if inspect.isclass(obj) else obj
    found.update({"CoreWorkspace.orthogonalize": CoreWorkspace.orthogonalize,
                  "BufferedWorkspace.orthogonalize": BufferedWorkspace.orthogonalize,
                  "gram_newton_schulz": gram_newton_schulz, "symmetric_newton_schulz": symmetric_newton_schulz,
                  "compiled_newton_schulz": compiled_newton_schulz})
    return found


def test_every_public_default_is_the_one_in_defaults():
    checked, wrong = set(), []
    for name, fn in _public_callables().items():
        for arg, p in inspect.signature(fn).parameters.items():
            if arg in CONCEPTS and p.default is not inspect.Parameter.empty and (name, arg) not in OTHER:
                checked.add((name, arg))
                if p.default != CONCEPTS[arg] or type(p.default) is not type(CONCEPTS[arg]):
                    wrong.append(f"{name}({arg}={p.default!r}), where muonclip.common.defaults has {CONCEPTS[arg]!r}")
    assert not wrong, wrong
    # the scan reached the functions and classes the defaults are for (it cannot pass by finding none)
    for name, arg in [("Muon", "orth_dtype"), ("Muon", "eps"), ("Muon", "adjust_lr_fn"), ("Muon", "ns_coefficients"),
                      ("muon_update", "dtype"), ("muon_update", "eps"), ("muon_update", "adjust_lr_fn"),
                      ("muon_update", "coefficients"), ("orthogonalize", "dtype"), ("run_method", "eps"),
                      ("newton_schulz", "dtype"), ("MuonClip", "tau"), ("CoreWorkspace.orthogonalize", "dtype"),
                      ("BufferedWorkspace.orthogonalize", "dtype"), ("symmetric_newton_schulz", "dtype")]:
        assert (name, arg) in checked, (name, arg)
    assert inspect.signature(muonclip.Muon).parameters["lr"].default == D.LR
    assert inspect.signature(muonclip.MuonClip).parameters["lr"].default == D.LR
    assert inspect.signature(svd_polar).parameters["dtype"].default is resolve_orth_dtype(D.AUTO, "svd", "cpu")


def test_the_torchtitan_config_and_the_run_config_read_the_same_defaults():
    pytest.importorskip("torchtitan")
    from muonclip.app.config import RunConfig
    from muonclip.integrations.torchtitan import ADAMW_DEFAULTS, MuonClipOptimizers

    fields = {f.name: f.default for f in dataclasses.fields(MuonClipOptimizers.Config)}
    for arg in ("weight_decay", "momentum", "nesterov", "adjust_lr_fn", "method", "orth_dtype", "tau"):
        assert fields[arg] == CONCEPTS[arg], arg
    assert ADAMW_DEFAULTS == {"betas": D.BETAS, "eps": D.ADAMW_EPS}
    run = {f.name: f.default for f in dataclasses.fields(RunConfig)}
    assert (run["orth_dtype"], run["tau"], run["weight_decay"]) == (D.ORTH_DTYPE, D.TAU, D.WEIGHT_DECAY)


@pytest.mark.parametrize("shape", [(24, 40), (3, 16, 24)], ids=["matrix", "experts"])
def test_muon_update_with_its_defaults_is_muons_step(shape, bf16_answer):
    """The same call with nothing but the learning rate set: `Muon`'s step and `muon_update` are
    one update, bit for bit, on either answer of the CPU probe (the update scale of
    ``adjust_lr_fn``'s default, the compute dtype ``"auto"`` resolves to, the eps, the steps)."""
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(shape))
    W2, M = W.detach().clone(), torch.zeros(shape)
    opt = muonclip.Muon([W], lr=0.02)
    for _ in range(2):
        G = torch.randn(shape)
        W.grad = G.clone()
        opt.step()
        muonclip.muon_update(W2, G, M, lr=0.02)
        assert torch.equal(W.detach(), W2) and torch.equal(opt.state[W]["momentum_buffer"], M)
    assert {b.compute_dtype for b in latest_structure(opt).buckets} == {bf16_answer}
    # the defaults are not inert: another scale rule or dtype is another update
    W3 = W2.clone()
    muonclip.muon_update(W3, G, M.clone(), lr=0.02, adjust_lr_fn="original")
    muonclip.muon_update(W2, G, M, lr=0.02)
    assert not torch.equal(W2, W3)


def test_orthogonalize_default_is_the_dtype_auto_resolves_to(bf16_answer):
    V = torch.randn(2, 24, 40)
    other = torch.float32 if bf16_answer is torch.bfloat16 else torch.bfloat16
    O = orthogonalize(V)
    assert torch.equal(O, orthogonalize(V, dtype=bf16_answer))
    assert not torch.equal(O, orthogonalize(V, dtype=other))
    assert torch.equal(newton_schulz(V, ns5_schedule(5, None)), newton_schulz(V, ns5_schedule(5, None),
                                                                              dtype=bf16_answer))
    assert torch.equal(orthogonalize(V, dtype=None), orthogonalize(V, dtype=torch.bfloat16))  # the method's own


@pytest.mark.parametrize("value, native", [("1", True), ("0", False)])
def test_the_cpu_probe_can_be_told_its_answer(monkeypatch, value, native):
    monkeypatch.setenv(hardware.CPU_BF16_ENV, value)
    assert hardware.native_bf16("cpu") == (native, f"MUONCLIP_CPU_BF16={value} says the CPU "
                                                   f"{'has' if native else 'has no'} bfloat16 matrix instructions")
    assert resolve_orth_dtype(D.AUTO, "ns5", "cpu") is (torch.bfloat16 if native else torch.float32)
    assert resolve_orth_dtype(D.AUTO, "ns5", "meta") is torch.float32  # CPU devices only
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=r"MUONCLIP_CPU_BF16='yes': set it to 1 .*, 0 .* or leave it unset"):
        hardware.native_bf16("cpu")
    monkeypatch.setenv(hardware.CPU_BF16_ENV, "")
    assert hardware.native_bf16("cpu")[0] == bool(hardware.cpu_bf16_instructions())
