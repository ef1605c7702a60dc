"""`muonclip.Muon`'s state dicts to and from torch.optim's Muon + AdamW pair.

**Out to torch**: `torch_state_dict` gives torch.optim.Muon's state dict of the Muon groups
(momentum ``buf = (1 - mu) M``, concrete ``ns_steps`` and ``ns_coefficients``), or
torch.optim.AdamW's of the AdamW groups; settings torch cannot express are refused, named.
**In from torch's pair**: `from_torch` makes one muonclip state dict from a torch.optim.Muon
and a torch.optim.AdamW state dict (docs/migrating.md). Loading torch.optim.Muon's state dict
alone, and recognising whose a state dict is: `muonclip.optim._state_dicts`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..common.defaults import AUTO
from ..ortho import METHODS
from ..ortho._newton_schulz import NS5_COEFFICIENTS
from ._matrices import matrix_spec
from ._scale import scale_name
from ._state_dicts import TORCH_ADAMW_KEYS, TORCH_MUON_KEYS, is_torch_adamw_group, kind, state_dtype, sum_momentum

TORCH_ADAMW_GROUP = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                     "differentiable": False, "fused": None, "decoupled_weight_decay": True}
"""The AdamW group keys `torch_state_dict` writes besides the hyperparameters."""

_TORCH_MUON_METHODS = ("ns5", "ns5_sym", "ns5_compiled")  # the quintic torch.optim.Muon runs


# ------------------------------------------------------------------------------------------
# out to torch.optim.Muon / torch.optim.AdamW
# ------------------------------------------------------------------------------------------


def torch_state_dict(state_dict: Mapping[str, Any], groups: Sequence[Mapping[str, Any]],
                     algorithm: str = "muon") -> dict[str, Any]:
    """torch.optim.Muon's (``algorithm="muon"``) or torch.optim.AdamW's (``"adamw"``) state dict of
    the groups of that algorithm, from our ``state_dict`` of ``groups`` (see `Muon.torch_state_dict`)."""
    if algorithm not in ("muon", "adamw"):
        raise ValueError(f"algorithm must be 'muon' (torch.optim.Muon) or 'adamw' (torch.optim.AdamW), "
                         f"got {algorithm!r}")
    chosen = [(i, g, own) for i, (g, own) in enumerate(zip(state_dict["param_groups"], groups))
              if own["algorithm"] == algorithm]
    if not chosen:
        raise ValueError(f"this optimizer has no algorithm={algorithm!r} param group")
    out_groups: list[dict[str, Any]] = []
    out_state: dict[int, dict[str, Any]] = {}
    n = 0
    for i, g, own in chosen:
        if algorithm == "muon":
            _check_torch_muon(i, g, own)
            tg = {"lr": g["lr"], "weight_decay": g["weight_decay"], "momentum": g["momentum"],
                  "nesterov": g["nesterov"],
                  "ns_coefficients": tuple(g["ns_coefficients"] or NS5_COEFFICIENTS),
                  "eps": g["eps"],
                  "ns_steps": METHODS[g["method"]].default_steps if g["ns_steps"] is None else g["ns_steps"],
                  "adjust_lr_fn": g["adjust_lr_fn"]}
        else:
            tg = {"lr": g["lr"], "betas": tuple(g["betas"]), "eps": g["adamw_eps"], "weight_decay": g["weight_decay"],
                  **TORCH_ADAMW_GROUP}
        ids = []
        for pid in g["params"]:
            entry = state_dict["state"].get(pid, {})
            if algorithm == "muon" and "momentum_buffer" in entry:
                M = entry["momentum_buffer"]
                out_state[n] = {"momentum_buffer": (M.detach().to(torch.float64) * (1.0 - float(g["momentum"])))
                                .to(M.dtype)}
            elif algorithm == "adamw" and "step" in entry:
                out_state[n] = {"step": torch.tensor(float(entry["step"]), dtype=torch.float32),
                                "exp_avg": entry["exp_avg"].detach().clone(),
                                "exp_avg_sq": entry["exp_avg_sq"].detach().clone()}
            ids.append(n)
            n += 1
        out_groups.append({**tg, "params": ids})
    return {"state": out_state, "param_groups": out_groups}


def _check_torch_muon(i: int, g: Mapping[str, Any], own: Mapping[str, Any]) -> None:
    """Refuse a Muon group whose settings torch.optim.Muon cannot express, naming each."""
    problems = []
    if g["method"] not in _TORCH_MUON_METHODS:
        problems.append(f"method={g['method']!r} (torch.optim.Muon runs the quintic 'ns5')")
    if own["orth_dtype"] not in (None, AUTO, torch.bfloat16):  # "auto": the same update up to rounding
        problems.append(f"orth_dtype={own['orth_dtype']} (torch.optim.Muon orthogonalises in bfloat16)")
    if g["adjust_lr_fn"] not in ("original", "match_rms_adamw"):
        problems.append(f"adjust_lr_fn={g['adjust_lr_fn']!r} (torch: 'original' or 'match_rms_adamw')")
    for key in ("split_sizes", "flatten", "transposed"):
        if g[key]:
            problems.append(f"{key}={g[key]!r} (torch.optim.Muon orthogonalises each 2-D weight whole, as stored)")
    for key in ("normuon", "cautious_weight_decay", "momentum_8bit"):
        if g.get(key):
            problems.append(f"{key}=True (torch.optim.Muon has no such option)")
    names = own.get("param_names") or [None] * len(own["params"])
    for k, (p, name) in enumerate(zip(own["params"], names)):
        if p.ndim != 2:
            label = f"'{name}'" if name else f"{k}"
            problems.append(f"parameter {label} has shape {tuple(p.shape)} (torch.optim.Muon takes 2-D weights only)")
    if problems:
        raise ValueError(f"param group {i} cannot be continued by torch.optim.Muon: " + "; ".join(problems))


# ------------------------------------------------------------------------------------------
# in from torch's Muon + AdamW pair
# ------------------------------------------------------------------------------------------


def from_torch(own_state_dict: Mapping[str, Any], groups: Sequence[Mapping[str, Any]], muon: Mapping[str, Any],
               adamw: Mapping[str, Any] | None = None, *, muon_params: Sequence[Tensor] | None = None,
               adamw_params: Sequence[Tensor] | None = None) -> dict[str, Any]:
    """One muonclip state dict (for ``Muon.load_state_dict``) from torch.optim.Muon's ``muon``
    and torch.optim.AdamW's ``adamw`` state dicts (see `Muon.load_torch_state_dicts`).

    ``own_state_dict`` and ``groups`` are the receiving optimizer's ``state_dict()`` and
    ``param_groups``. Parameters are matched by ``muon_params``/``adamw_params`` (the tensors
    in the order torch's optimizers were given them) or, without them, by the ``param_names``
    of torch's groups against ours.
    """
    if kind(muon) != "torch.optim.Muon":  # kind() raises for anything else
        raise ValueError("the first state dict must be torch.optim.Muon's; this one is muonclip.Muon's "
                         "(load it with load_state_dict)")
    sources = [("torch.optim.Muon", "muon", muon, muon_params)]
    if adamw is not None:
        if not adamw.get("param_groups") or not all(is_torch_adamw_group(g) for g in adamw["param_groups"]):
            raise ValueError("the second state dict is not torch.optim.AdamW's (its groups need "
                             f"{sorted(TORCH_ADAMW_KEYS)} and no 'algorithm')")
        for g in adamw["param_groups"]:
            for key in ("amsgrad", "maximize"):
                if g.get(key):
                    raise ValueError(f"torch.optim.AdamW's group has {key}=True, which muonclip.Muon's AdamW "
                                     "branch does not do")
        sources.append(("torch.optim.AdamW", "adamw", adamw, adamw_params))

    ours = [p for g in groups for p in g["params"]]
    our_names = {n: p for g in groups for n, p in zip(g.get("param_names") or (), g["params"])}
    index_of = {p: i for i, p in enumerate(ours)}  # our saved ids are the positions (torch numbers them so)
    group_of = {p: gi for gi, g in enumerate(groups) for p in g["params"]}
    found: dict[Tensor, tuple[str, Mapping[str, Any], Any]] = {}  # param -> (algorithm, torch group, torch id)
    for label, algorithm, sd, given in sources:
        tgroups = sd["param_groups"]
        tids = [pid for g in tgroups for pid in g["params"]]
        tgroup = {pid: g for g in tgroups for pid in g["params"]}
        if given is not None:
            if len(given) != len(tids):
                raise ValueError(f"{label}'s state dict has {len(tids)} parameters, {len(given)} were given")
            params = list(given)
        else:
            names = [n for g in tgroups for n in (g.get("param_names") or [])]
            if len(names) != len(tids) or not our_names:
                raise ValueError(
                    f"cannot match {label}'s parameters to this optimizer's: give muon_params=/adamw_params= (the "
                    "parameters in the order torch's optimizers got them), or build both with parameter names "
                    "(torch: optimizer(model.named_parameters()); ours: muonclip.param_groups(model))")
            missing = [n for n in names if n not in our_names]
            if missing:
                raise ValueError(f"{label}'s parameters {missing[:5]} are not in this optimizer")
            params = [our_names[n] for n in names]
        for p, pid in zip(params, tids):
            if p not in index_of:
                raise ValueError(f"a parameter of {label}'s state dict (shape {tuple(p.shape)}) is not in this "
                                 "optimizer")
            if p in found:
                raise ValueError(f"a parameter (shape {tuple(p.shape)}) is in both of torch's state dicts")
            if groups[group_of[p]]["algorithm"] != algorithm:
                raise ValueError(f"{_label(groups, p)} is in {label}'s state dict but in an "
                                 f"algorithm={groups[group_of[p]]['algorithm']!r} group here")
            found[p] = (algorithm, tgroup[pid], pid)
    absent = [_label(groups, p) for p in ours if p not in found]
    if absent:
        raise ValueError(f"torch's state dicts hold no state and settings for {', '.join(absent[:5])}"
                         f"{' ...' if len(absent) > 5 else ''}: give both of torch's optimizers' state dicts")

    new_groups = []
    for gi, (g, own) in enumerate(zip(own_state_dict["param_groups"], groups)):
        settings: dict[str, Any] = {}
        for p in own["params"]:
            algorithm, tg, _ = found[p]
            these = _torch_settings(algorithm, tg)
            for key, value in these.items():
                if key in settings and settings[key] != value:
                    raise ValueError(f"param group {gi} gets {key}={settings[key]!r} and {key}={value!r} from "
                                     "torch's groups: split it so that each of our groups takes one torch group's "
                                     "settings")
                settings[key] = value
        new_groups.append({**copy.deepcopy({k: v for k, v in g.items() if k != "params"}), **settings,
                           "params": list(g["params"])})
    state: dict[Any, dict[str, Any]] = {}
    steps = 0
    for p in ours:
        algorithm, tg, pid = found[p]
        sd = muon if algorithm == "muon" else adamw
        entry = sd["state"].get(pid, {})
        if algorithm == "muon" and "momentum_buffer" in entry:
            state[index_of[p]] = {"momentum_buffer": sum_momentum(entry["momentum_buffer"], tg["momentum"])}
            group = groups[group_of[p]]
            if group["normuon"]:  # torch has no NorMuon: its second moment starts here, as at a first step
                spec = matrix_spec(tuple(p.shape), group)
                state[index_of[p]]["neuron_second_moment"] = torch.zeros(spec.batch, spec.rows, dtype=state_dtype(p))
        elif algorithm == "adamw" and "step" in entry:
            step = int(entry["step"])
            steps = max(steps, step)
            state[index_of[p]] = {"step": step, "exp_avg": entry["exp_avg"], "exp_avg_sq": entry["exp_avg_sq"]}
    for g in new_groups:
        g.update(steps_taken=steps, steps_skipped=0)
    return {"state": state, "param_groups": new_groups}


def _torch_settings(algorithm: str, tg: Mapping[str, Any]) -> dict[str, Any]:
    if algorithm == "muon":
        out = {k: tg[k] for k in TORCH_MUON_KEYS}
        out["ns_coefficients"] = tuple(out["ns_coefficients"])
        out["adjust_lr_fn"] = scale_name(out["adjust_lr_fn"])
        return out
    return {"lr": tg["lr"], "betas": tuple(tg["betas"]), "adamw_eps": tg["eps"], "weight_decay": tg["weight_decay"]}


def _label(groups: Sequence[Mapping[str, Any]], p: Tensor) -> str:
    for gi, g in enumerate(groups):
        for i, q in enumerate(g["params"]):
            if q is p:
                names = g.get("param_names")
                return f"parameter '{names[i]}'" if names else f"parameter {i} of param group {gi}"
    return "a parameter"
