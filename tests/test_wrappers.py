"""MuonClip under wrappers, in one process: parameter swaps, checkpointers, flat parameters, logging.

The multi-process cases (accelerate's FSDP2, Lightning's ModelParallelStrategy, FSDP1, local
process groups) are in tests/test_wrappers_distributed.py. Here:

* the parameters a wrapper replaces are followed: a swap as accelerate's FSDP2 ``prepare`` does
  it (new tensors in the model and, by position, in the param groups), and a model-only
  replacement (``load_state_dict(assign=True)``) after steps (the state moves along), each
  against MuonClip built on the new tensors; what cannot be followed is refused by name;
* state dicts: torch's ``get_optimizer_state_dict`` (full, sharded, ``cpu_offload``, flattened)
  takes MuonClip's and ``set_optimizer_state_dict`` continues bit for bit; a state dict made
  before the first step survives accelerate's swap; state dicts and DCP checkpoints of the
  previous format (counters in the first parameter's state, dtypes as objects) still load;
* flattened matrices (FSDP1's ``FlatParameter``, DeepSpeed's partitions, a linear weight that
  is 1-D) are refused naming the wrapper, never routed as vectors;
* logging through wrappers: accelerate's and Lightning's optimizer wrappers, named param groups,
  ``clip_stats()`` before the first step; the docs' one-process accelerate recipe.
"""

from __future__ import annotations

import copy
import math
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from muonclip import Muon, MuonClip, param_groups
from muonclip.integrations import unwrap_optimizer
from muonclip.optim.flat import FlatParameterError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from wrappers_worker import OPT, TAU, batch, clipped_heads, gpt, params, train  # noqa: E402

TOL = 1e-6


@pytest.fixture
def accelerator():
    """A one-process Accelerator on CPU; accelerate's process-wide state cleared before and after."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()

    reset()
    yield Accelerator(cpu=True)
    reset()


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def swap_like_accelerate(model: nn.Module, opt: torch.optim.Optimizer | None) -> dict[int, nn.Parameter]:
    """What accelerate's FSDP2 prepare does to a model and its optimizer: every parameter of the
    model replaced by a new tensor (a tied one once), and the optimizer's param groups pointed at
    the new tensors by the old ones' data pointers (accelerate's fsdp2_switch_optimizer_parameters)."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for attr, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[attr] = new.setdefault(p.data_ptr(), nn.Parameter(p.detach().clone()))
    if opt is not None:
        for g in opt.param_groups:
            g["params"] = [new[p.data_ptr()] for p in g["params"]]
    return new


# ----------------------------------------------------------------------------------------------
# the parameters the optimizer holds
# ----------------------------------------------------------------------------------------------


def test_a_swap_as_accelerate_does_it_is_followed():
    """MuonClip built before the swap trains and clips as MuonClip built after it. (Before: the
    clip scaled the old tensors: 0.12 off after 6 steps, 46 heads clipped against 18, and the
    "QK-Clip had no effect" warning blamed a q/k normalisation.)"""
    ref = gpt()
    swap_like_accelerate(ref, None)
    ref_log = train(ref, MuonClip(ref, tau=TAU, **OPT), [batch(s) for s in range(4)])
    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    swap_like_accelerate(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "QK-Clip had no effect" warning either
        log = train(model, opt, [batch(s) for s in range(4)])
    assert clipped_heads(ref_log) > 0 and clipped_heads(log) == clipped_heads(ref_log)
    assert max_diff(params(model), params(ref)) <= TOL
    assert all(layer.layout.q_weight is model.get_submodule(layer.name).q_proj.weight for layer in opt.layers)


def test_a_step_tests_the_parameters_identity_once_and_a_clip_alone_follows(monkeypatch):
    """A step looks for replaced parameters once (before its update: nothing replaces one between
    that and its clip); `clip` called alone looks itself, so a swap since the step is followed."""
    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    calls = []
    replaced = MuonClip._replaced
    monkeypatch.setattr(MuonClip, "_replaced", lambda self: calls.append(1) or replaced(self))
    train(model, opt, [batch(0)])
    assert len(calls) == 1
    swap_like_accelerate(model, opt)
    x, y = batch(1)
    model(x, y)[1].backward()
    opt.clip()
    assert len(calls) == 2
    assert all(layer.layout.q_weight is model.get_submodule(layer.name).q_proj.weight for layer in opt.layers)


def _gpt2() -> nn.Module:
    """Tiny HF GPT-2: q and k are Rows of the fused c_attn, stored (in, out); large q/k columns."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=24, n_layer=1, n_head=3, n_positions=16, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[:, :48].mul_(8.0)
    return model


def test_a_swap_is_followed_into_fused_rows_of_a_hugging_face_model():
    """GPT-2's q and k are Rows of one fused (in, out) weight: the Rows are re-pointed too."""
    def run(model, opt):
        for s in range(3):
            x, y = batch(s)
            logits = model(input_ids=x).logits
            nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
            yield sum(int(c.sum()) for c in opt.last_clipped.values())

    ref = _gpt2()
    swap_like_accelerate(ref, None)
    ref_clipped = list(run(ref, MuonClip(ref, tau=2.0, **OPT)))
    model = _gpt2()
    opt = MuonClip(model, tau=2.0, **OPT)
    swap_like_accelerate(model, opt)
    assert list(run(model, opt)) == ref_clipped and sum(ref_clipped) > 0
    assert max_diff(params(model), params(ref)) <= TOL
    assert opt.layers[0].layout.q_weight.tensor is model.transformer.h[0].attn.c_attn.weight


def test_a_model_side_replacement_after_steps_moves_the_state_along():
    """load_state_dict(assign=True) puts new tensors in the model only, after 2 steps: the
    optimizer takes them with their momentum and Adam moments, and continues as if nothing happened."""
    ref = gpt()
    train(ref, MuonClip(ref, tau=TAU, **OPT), [batch(s) for s in range(5)])
    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    train(model, opt, [batch(s) for s in range(2)])
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    model.lm_head.weight = model.wte.weight  # assign=True unties them; tie again, as transformers' tie_weights does
    train(model, opt, [batch(s) for s in range(2, 5)])
    assert max_diff(params(model), params(ref)) <= TOL
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()} and len(opt.state) == len(held)


def test_what_cannot_be_followed_is_refused_by_name():
    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    q = model.blocks[0].attn.q_proj
    q.weight = nn.Parameter(q.weight.detach().flatten().clone())  # as FSDP1 leaves it: a 1-D piece
    with pytest.raises(RuntimeError, match=r"blocks\.0\.attn\.q_proj\.weight of shape \(32, 32\).*FSDP1.*fully_shard"):
        opt.step()

    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    swap_like_accelerate(model, opt)
    model.blocks[1].attn.k_proj.weight = nn.Parameter(model.blocks[1].attn.k_proj.weight.detach().clone())
    with pytest.raises(RuntimeError, match=r"k_proj\.weight: the model holds one new tensor and MuonClip's"):
        opt.step()

    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    del model.blocks[0].attn.k_proj.weight
    with pytest.raises(RuntimeError, match=r"k_proj\.weight is no longer a parameter of its module \(Linear"):
        opt.step()


# ----------------------------------------------------------------------------------------------
# state dicts any checkpointer saves
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [dict(cpu_offload=True), dict(full_state_dict=True, cpu_offload=True),
                                     dict(flatten_optimizer_state_dict=True)])
def test_torch_get_and_set_optimizer_state_dict_continue_bit_for_bit(options):
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    train(model, opt, [batch(s) for s in range(2)])
    sd = get_optimizer_state_dict(model, opt, options=StateDictOptions(**options))  # before: dtype ValueError
    groups = sd["param_groups"] if "param_groups" in sd else None
    if groups is not None:
        assert all(g["orth_dtype"] == "torch.float32" and g["steps_taken"] == 2 and g["tau"] == TAU for g in groups)
    model2 = gpt(seed=3)
    model2.load_state_dict(model.state_dict())
    opt2 = MuonClip(model2, tau=1.0, lr=0.5)
    set_optimizer_state_dict(model2, opt2, copy.deepcopy(sd), options=StateDictOptions(**options))
    assert (opt2.tau, opt2.steps_taken, opt2.param_groups[0]["orth_dtype"]) == (TAU, 2, torch.float32)
    train(model, opt, [batch(s) for s in range(2, 4)])
    train(model2, opt2, [batch(s) for s in range(2, 4)])
    assert max_diff(params(model), params(model2)) == 0.0


def test_a_state_dict_made_before_the_first_step_survives_the_swap(accelerator):
    """accelerate's AcceleratedOptimizer loads the optimizer's own state dict when it wraps it,
    before the FSDP2 swap; the counters then lived in the first parameter's state, keyed by a
    tensor the swap removed, and Optimizer.state_dict() raised KeyError. They live in the groups now."""
    from accelerate.optimizer import AcceleratedOptimizer

    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    wrapped = AcceleratedOptimizer(opt, device_placement=True)  # state_dict() -> load_state_dict()
    assert len(opt.state) == 0
    swap_like_accelerate(model, opt)
    sd = wrapped.state_dict()
    assert sd["state"] == {} and all(g["steps_taken"] == 0 and g["tau"] == TAU for g in sd["param_groups"])
    train(model, wrapped, [batch(0)])
    assert all(g["steps_taken"] == 1 for g in wrapped.state_dict()["param_groups"])


def _as_saved_before(sd: dict) -> dict:
    """``sd`` as the previous format kept it: the optimizer-wide values in the first parameter's
    state, none in the groups, dtypes as torch dtypes."""
    wide = ("steps_taken", "steps_skipped", "tau")
    groups = [{k: getattr(torch, v[6:]) if isinstance(v, str) and v.startswith("torch.") else v
               for k, v in g.items() if k not in wide} for g in sd["param_groups"]]
    first = groups[0]["params"][0]
    state = {k: dict(v) for k, v in sd["state"].items()}
    state[first].update({k: sd["param_groups"][0][k] for k in wide})
    return {"state": state, "param_groups": groups}


def test_a_state_dict_of_the_previous_format_loads_and_continues_alike():
    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    train(model, opt, [batch(s) for s in range(2)])
    sd = copy.deepcopy(opt.state_dict())
    finals = []
    for saved in (sd, _as_saved_before(sd)):
        model2 = gpt(seed=3)
        model2.load_state_dict(model.state_dict())
        opt2 = MuonClip(model2, tau=1.0, **OPT)
        opt2.load_state_dict(copy.deepcopy(saved))
        assert (opt2.tau, opt2.steps_taken) == (TAU, 2)
        assert all("steps_taken" not in s and "tau" not in s for s in opt2.state.values())  # never back in the state
        train(model2, opt2, [batch(s) for s in range(2, 4)])
        finals.append(params(model2))
    assert max_diff(*finals) == 0.0


def test_a_dcp_checkpoint_of_the_previous_format_loads(tmp_path):
    """muonclip.distributed.checkpoint (what `muonclip train` writes): a checkpoint whose
    optimizer-wide values sit in the first parameter's state loads with them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from muonclip.distributed import checkpoint

    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    train(model, opt, [batch(s) for s in range(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        msd, osd = get_state_dict(model, opt)
        old = _as_saved_before(osd)
        dcp.save({"model": msd, "optim": old, "muonclip": {"steps_taken": 2, "steps_skipped": 0}, "extra": "{}"},
                 checkpoint_id=str(tmp_path))
    model2 = gpt(seed=3)
    opt2 = MuonClip(model2, tau=1.0, **OPT)
    checkpoint.load(tmp_path, model2, opt2)
    assert (opt2.tau, opt2.steps_taken) == (TAU, 2)
    assert max_diff(params(model2), params(model)) == 0.0


# ----------------------------------------------------------------------------------------------
# flattened matrices
# ----------------------------------------------------------------------------------------------


def _flattened(how: str) -> nn.Module:
    """The GPT with one attention weight as a wrapper leaves it: 1-D."""
    model = gpt()
    q = model.blocks[0].attn.q_proj
    flat = nn.Parameter(q.weight.detach().flatten().clone())
    if how == "FlatParameter":
        flat._is_flat_param = True
    elif how == "DeepSpeed":
        flat.ds_id, flat.ds_shape = 7, q.weight.shape
    q.weight = flat
    return model


@pytest.mark.parametrize("how,names,fix", [("FlatParameter", "FSDP1 \\(use_orig_params=False\\)", "fully_shard"),
                                           ("DeepSpeed", "DeepSpeed ZeRO", "deepspeed\\.initialize"),
                                           ("1-D weight", "FSDP1 with use_orig_params", "fully_shard")])
def test_a_flattened_matrix_is_refused_naming_the_wrapper_never_routed_as_a_vector(how, names, fix):
    """Each wrapper named with its fix: FSDP1's is FSDP2; DeepSpeed's, the unpartitioned model's
    optimizer handed to deepspeed.initialize (muonclip.integrations.deepspeed steps its partitions)."""
    model = _flattened(how)
    message = rf"parameter 'blocks\.0\.attn\.q_proj\.weight' of shape \(1024,\).*{names}.*{fix}"
    with pytest.raises(FlatParameterError, match=message):
        param_groups(model)  # before: routed to AdamW as a "vector", silently
    with pytest.raises(FlatParameterError, match=message):
        MuonClip(model)  # before: "q_weight must be a weight matrix"
    if how != "1-D weight":  # a bare list: the marks the wrappers leave are all there is
        with pytest.raises(FlatParameterError, match=names):
            Muon([{"params": [model.blocks[0].attn.q_proj.weight], "algorithm": "adamw"}])


def test_vectors_are_still_routed_as_vectors():
    routes = {r.name: r.reason for r in param_groups(gpt()).routes}
    assert routes["blocks.0.ln_1.weight"] == "vector"


# ----------------------------------------------------------------------------------------------
# logging through wrappers
# ----------------------------------------------------------------------------------------------


def test_clip_stats_and_tau_through_accelerate_and_lightning_wrappers(accelerator):
    from accelerate.optimizer import AcceleratedOptimizer
    from lightning.pytorch.core.optimizer import LightningOptimizer

    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    accelerated, lightning = AcceleratedOptimizer(opt, device_placement=False), LightningOptimizer(opt)
    assert unwrap_optimizer(accelerated) is opt and unwrap_optimizer(lightning) is opt
    assert unwrap_optimizer(AcceleratedOptimizer(lightning, device_placement=False)) is opt
    before = lightning.clip_stats()  # before: AttributeError (the wrapper is a MuonClip without its attributes)
    assert math.isnan(before["max_logit"]) and before["clipped_heads"] == 0.0
    train(model, accelerated, [batch(0)])
    stats = opt.clip_stats()
    assert stats["clipped_heads"] > 0 and lightning.clip_stats() == stats
    assert lightning.last_max_logits is opt.last_max_logits and lightning.steps_taken == 1
    lightning.tau = 2.5  # sets the optimizer's
    assert opt.tau == 2.5 and lightning.tau == 2.5 and "_tau" not in lightning.__dict__
    assert all(layer.recorder.threshold == 2.5 for layer in opt.layers)
    assert all(g["tau"] == 2.5 for g in opt.param_groups)
    model(*batch(1))  # records the max logits (training mode, grad enabled)
    lightning.clip()  # the optimizer's clip, its record written on the optimizer, not on the wrapper
    assert opt.last_clipped and lightning.last_clipped is opt.last_clipped
    assert not {"last_clipped", "last_max_logits", "last_bounded"} & lightning.__dict__.keys()
    assert all(layer.recorder.value is None for layer in opt.layers)
    plain = Muon(param_groups(gpt()), **OPT)
    assert LightningOptimizer(plain).steps_taken == 0  # before: AttributeError (only MuonClip passed them on)


def test_accelerate_prepare_returns_a_wrapper_that_passes_the_attributes_on(accelerator):
    """What ``Accelerator.prepare`` returns: on the old code ``clip_stats()``, ``tau`` and
    ``steps_taken`` were AttributeErrors on it (only `unwrap_optimizer` reached them). Now it is a
    MuonClip that reads them from the optimizer and sets tau and the counters on it, with
    accelerate's own step; a wrapper of any other optimizer is as accelerate makes it."""
    from accelerate.optimizer import AcceleratedOptimizer

    model = gpt()
    model, opt = accelerator.prepare(model, MuonClip(model, tau=TAU, **OPT))
    inner = unwrap_optimizer(opt)
    assert isinstance(opt, AcceleratedOptimizer) and isinstance(opt, MuonClip) and inner is not opt
    assert math.isnan(opt.clip_stats()["max_logit"]) and opt.steps_taken == 0
    ref = gpt()
    ref_log = train(ref, MuonClip(ref, tau=TAU, **OPT), [batch(s) for s in range(2)])
    log = train(model, opt, [batch(s) for s in range(2)])  # accelerate's step
    assert clipped_heads(log) == clipped_heads(ref_log) > 0 and max_diff(params(model), params(ref)) == 0.0
    stats = opt.clip_stats()
    assert stats == inner.clip_stats() and stats["clipped_heads"] > 0
    assert opt.steps_taken == 2 and opt.steps_skipped == 0 and opt.last_max_logits is inner.last_max_logits
    assert [layer.name for layer in opt.layers] == [layer.name for layer in inner.layers]
    opt.tau = 2.5  # sets the optimizer's (and its recorders')
    assert inner.tau == opt.tau == 2.5 and "_tau" not in opt.__dict__
    assert all(layer.recorder.threshold == 2.5 for layer in inner.layers)
    with pytest.raises(ValueError, match="tau must be a finite number > 0"):
        opt.tau = -1.0
    opt.steps_taken = 5
    assert inner.steps_taken == 5 and "_taken" not in opt.__dict__
    other = accelerator.prepare(torch.optim.SGD(gpt().parameters(), lr=0.1))
    assert type(other) is AcceleratedOptimizer and not hasattr(other, "clip_stats")


def test_clip_stats_is_defined_before_the_first_step():
    opt = MuonClip(gpt(), tau=TAU, **OPT)
    stats = opt.clip_stats()
    names = [layer.name for layer in opt.layers]
    assert set(stats) == {"max_logit", "max_logit_is_bound", "clipped_heads", "clipped_fraction"} | {
        f"{key}/{n}" for n in names for key in ("max_logit", "max_logit_is_bound", "clipped_heads")}
    assert math.isnan(stats["max_logit"]) and stats["clipped_fraction"] == 0.0


def test_param_groups_are_named_uniquely():
    from muonclip.models import GPT, GPTConfig

    groups = param_groups(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16, bias=True)))
    assert [g["name"] for g in groups] == ["adamw", "adamw_no_decay", "muon"]
    assert [g["name"] for g in param_groups(gpt(), split={"*.q_proj.weight": [16, 16]})] == [
        "adamw", "adamw_no_decay", "muon_split", "muon"]
    assert MuonClip(gpt()).state_dict()["param_groups"][0]["name"] == "adamw"


def test_the_docs_one_process_accelerate_recipe_is_a_plain_loop(accelerator):
    """The recipe of docs/integrations.md in one process, against the same steps without accelerate."""
    from doc_recipes import recipe

    model, opt = recipe("accelerate")["train"](gpt(), [batch(s) for s in range(3)], tau=TAU, **OPT)
    ref = gpt()
    log = train(ref, MuonClip(ref, tau=TAU, **OPT), [batch(s) for s in range(3)])
    assert clipped_heads(log) > 0
    assert max_diff(params(model), params(ref)) == 0.0


def test_a_zero_lr_step_as_checkpointers_make_it_does_not_warn():
    """torch.distributed.checkpoint (under Lightning's and accelerate's loaders) creates missing
    optimizer state with a zero-gradient step at lr 0, with no forward before it: no "nothing
    recorded" warning for a step that cannot change a weight; a step that can still warns."""
    model = gpt()
    opt = MuonClip(model, tau=TAU, **OPT)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    with pytest.warns(UserWarning, match="no attention max logit was recorded"):
        opt.step()
