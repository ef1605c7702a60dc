"""`muonclip.Muon`'s state dicts: what is loaded, and the conversions to and from torch.optim's.

**What `Muon.load_state_dict` takes** (`prepare`). A state dict is recognised by its param groups:

* ``muonclip.Muon``'s: some group has an ``algorithm`` key, or the dict has a top-level
  ``"muonclip"`` entry. Every group must hold every key of
  `muonclip.optim.validation.GROUP_KEYS` (a missing one is an error that names it); a group's
  ``name``, when the receiving group has one and the saved one not, is kept.
* ``torch.optim.Muon``'s: no group has ``algorithm``, every group has exactly torch's keys
  (`TORCH_MUON_KEYS`, plus ``params`` and optionally ``param_names``) with an int
  ``ns_steps`` and three ``ns_coefficients``, and the per-parameter state holds only
  ``momentum_buffer``. Its momentum is converted: torch keeps an average,
  ``buf = mu buf + (1 - mu) G`` (``buf.lerp_(G, 1 - mu)``), ours a sum, ``M = mu M + G``, so
  ``M = buf / (1 - mu)``; its hyperparameters replace the group's (torch's loader does the
  same), ``method``, ``orth_dtype`` and the AdamW keys stay the group's.
* Anything else is refused with a ValueError that says what it looks like.

Every group is then validated as the constructor validates it
(`muonclip.optim.validation.check_group`), before anything is loaded.

**Optimizer-wide values** (``steps_taken``, ``steps_skipped``; `muonclip.MuonClip` adds
``tau``) are kept in every param group (the optimizer's attributes are the truth; the groups
hold a copy, refreshed after every step and by ``state_dict()``). A param group survives what
replaces parameters (accelerate's FSDP2 ``prepare`` swaps new tensors into ``params``), and a
state dict flattened per parameter (``torch.distributed.checkpoint.state_dict`` with
``flatten_optimizer_state_dict=True``, as torchtitan saves it) carries each group's values with
every parameter; no per-parameter state exists before the first step. State dicts of earlier
versions kept them in the first parameter's state (or a top-level ``"muonclip"`` entry): they
are read from there and never put back into the state.

**The saved form** holds nothing a checkpointer cannot store (`saved_form`): torch dtypes in
param groups (``orth_dtype``) are strings such as ``"torch.bfloat16"``, turned back into dtypes
on load (`from_saved_form`); ``orth_dtype="auto"`` stays ``"auto"``, never the dtype it resolved
to, so a state saved on one kind of machine and loaded on another resolves it for the machine
that loads it (`muonclip.optim.precision`); everything else is a tensor, a number, a string, None or a list,
tuple or dict of those, which ``torch.distributed.checkpoint`` (full or sharded, with or without
``cpu_offload``), accelerate and Lightning save.

**Out to torch**: `torch_state_dict` gives torch.optim.Muon's state dict of the Muon groups
(momentum ``buf = (1 - mu) M``, concrete ``ns_steps`` and ``ns_coefficients``), or
torch.optim.AdamW's of the AdamW groups; settings torch cannot express are refused, named.
**In from torch's pair**: `from_torch` makes one muonclip state dict from a torch.optim.Muon
and a torch.optim.AdamW state dict (docs/migrating.md).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..ortho import METHODS
from ..ortho.newton_schulz import NS5_COEFFICIENTS
from .precision import AUTO
from .scale import scale_name
from .validation import check_group

FP32_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq", "momentum_scale", "neuron_second_moment")
"""State kept in float32 (float64 for float64 parameters) whatever the parameter dtype."""

INT8_STATE = ("momentum_int8",)
"""State kept in int8 (8-bit momentum codes; torch's loader would cast them to the parameter dtype)."""

WIDE_KEYS = ("steps_taken", "steps_skipped")
"""`muonclip.Muon`'s optimizer-wide values, kept in every param group (`muonclip.MuonClip` adds ``tau``)."""

DTYPE_PREFIX = "torch."
"""A torch dtype in the saved form: ``str(dtype)``, e.g. ``"torch.bfloat16"``."""

TORCH_MUON_KEYS = frozenset({"lr", "weight_decay", "momentum", "nesterov", "ns_coefficients", "eps", "ns_steps",
                             "adjust_lr_fn"})
"""torch.optim.Muon's param-group keys besides ``params`` (and ``param_names``)."""

TORCH_ADAMW_KEYS = frozenset({"lr", "betas", "eps", "weight_decay", "amsgrad"})
"""Keys every torch.optim.AdamW param group has (it has more: ``maximize``, ``foreach``...)."""

TORCH_ADAMW_GROUP = {"amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                     "differentiable": False, "fused": None, "decoupled_weight_decay": True}
"""The AdamW group keys `torch_state_dict` writes besides the hyperparameters."""

_TORCH_MUON_METHODS = ("ns5", "ns5_sym", "ns5_compiled")  # the quintic torch.optim.Muon runs


def state_dtype(p: Tensor) -> torch.dtype:
    """Buffers are float32, or the parameter's dtype when that is wider (float64)."""
    return torch.promote_types(p.dtype, torch.float32)


def first_param(groups: Sequence[Mapping[str, Any]]) -> Any:
    """The first parameter (or saved id) of the first group that has one; None if none."""
    return next((p for g in groups for p in g["params"]), None)


# ------------------------------------------------------------------------------------------
# the saved form, and the optimizer-wide values
# ------------------------------------------------------------------------------------------


def saved_form(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every torch dtype in its param groups written as a string
    (``torch.bfloat16`` -> ``"torch.bfloat16"``); a new dict and new groups, the state shared."""
    groups = [{k: str(v) if isinstance(v, torch.dtype) else v for k, v in g.items()}
              for g in state_dict["param_groups"]]
    return {**state_dict, "param_groups": groups}


def from_saved_form(group: Mapping[str, Any]) -> dict[str, Any]:
    """A saved param group with its dtype strings (`saved_form`) back as torch dtypes; a new dict.
    A group that holds dtypes (``torch.optim.Optimizer.state_dict``'s own form) is taken as it is."""
    return {k: _dtype(v) if isinstance(v, str) and v.startswith(DTYPE_PREFIX) else v for k, v in group.items()}


def _dtype(text: str) -> Any:
    value = getattr(torch, text[len(DTYPE_PREFIX):], None)
    return value if isinstance(value, torch.dtype) else text


def wide_values(state_dict: Mapping[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The optimizer-wide values ``keys`` a muonclip state dict holds: from its first param group
    that has them, else (earlier versions) from the first parameter's state entry, else from a
    top-level ``"muonclip"`` entry. Absent ones are left out."""
    groups, state = state_dict["param_groups"], state_dict["state"]
    found: dict[str, Any] = {}
    for key in keys:
        for g in groups:
            if key in g:
                found[key] = g[key]
                break
    first = first_param(groups)
    entry = state.get(first) if first is not None else None
    older = [entry if isinstance(entry, Mapping) else {}, state_dict.get("muonclip") or {}]
    for source in older:
        for key in keys:
            if key not in found and key in source:
                found[key] = source[key]
    return {k: v.item() if isinstance(v, Tensor) else v for k, v in found.items()}


# ------------------------------------------------------------------------------------------
# recognising a state dict
# ------------------------------------------------------------------------------------------


def kind(state_dict: Mapping[str, Any]) -> str:
    """``"muonclip"`` or ``"torch.optim.Muon"`` (see the module docstring); ValueError otherwise."""
    if not isinstance(state_dict, Mapping) or not isinstance(state_dict.get("param_groups"), Sequence) \
            or not isinstance(state_dict.get("state"), Mapping) \
            or not all(isinstance(g, Mapping) and "params" in g for g in state_dict["param_groups"]):
        raise ValueError("not an optimizer state dict: expected a dict with 'state' (a dict) and 'param_groups' "
                         "(a list of dicts with 'params'), as optimizer.state_dict() returns")
    groups = state_dict["param_groups"]
    if "muonclip" in state_dict or any("algorithm" in g for g in groups):
        return "muonclip"
    if groups and all(_is_torch_muon_group(g) for g in groups) and all(
            isinstance(s, Mapping) and set(s) <= {"momentum_buffer"} for s in state_dict["state"].values()):
        return "torch.optim.Muon"
    keys = sorted({k for g in groups for k in g} - {"params", "param_names"})
    like = ""
    if groups and all(TORCH_ADAMW_KEYS <= set(g) for g in groups):
        like = (" It looks like torch.optim.AdamW's: load torch's Muon + AdamW pair with "
                "Muon.load_torch_state_dicts(muon_state_dict, adamw_state_dict).")
    raise ValueError(
        f"this state dict is neither muonclip.Muon's (no group has an 'algorithm' key) nor torch.optim.Muon's "
        f"(whose groups have exactly {sorted(TORCH_MUON_KEYS)}, an int ns_steps and only 'momentum_buffer' "
        f"state); its param groups have {keys}.{like}"
    )


def _is_torch_muon_group(g: Mapping[str, Any]) -> bool:
    coefficients = g.get("ns_coefficients")
    return (set(g) - {"params", "param_names"} == TORCH_MUON_KEYS and isinstance(g["ns_steps"], int)
            and not isinstance(g["ns_steps"], bool) and isinstance(coefficients, Sequence) and len(coefficients) == 3)


def _is_torch_adamw_group(g: Mapping[str, Any]) -> bool:
    return TORCH_ADAMW_KEYS <= set(g) and "algorithm" not in g and "momentum" not in g


# ------------------------------------------------------------------------------------------
# loading (Muon.load_state_dict)
# ------------------------------------------------------------------------------------------


def prepare(state_dict: Mapping[str, Any], groups: Sequence[dict[str, Any]],
            wide_keys: Sequence[str] = WIDE_KEYS) -> dict[str, Any]:
    """The state dict to hand torch's loader: recognised (a torch.optim.Muon one converted), every
    group validated against the optimizer's ``groups``; a new dict (the one passed in, and its
    tensors, are not modified). The optimizer-wide values ``wide_keys`` it holds (`wide_values`,
    wherever this or an earlier version kept them) are put in every group, and taken out of the
    per-parameter state; a torch.optim.Muon state dict has none."""
    source = kind(state_dict)
    saved = [from_saved_form(g) for g in state_dict["param_groups"]]
    if len(saved) != len(groups):
        hint = (" (torch's Muon + AdamW pair goes in with Muon.load_torch_state_dicts)"
                if source == "torch.optim.Muon" else "")
        raise ValueError(
            f"the {source} state dict has {len(saved)} param groups, this optimizer {len(groups)}: build the "
            f"optimizer with the same param groups as the one that saved it{hint}")
    state = {k: dict(v) if isinstance(v, Mapping) else v for k, v in state_dict["state"].items()}
    if source == "torch.optim.Muon":
        new_groups = []
        for i, (g, own) in enumerate(zip(saved, groups)):
            if own["algorithm"] != "muon":
                raise ValueError(f"param group {i} of this optimizer is algorithm={own['algorithm']!r}; a "
                                 "torch.optim.Muon state dict holds Muon groups only")
            new_groups.append(_from_torch_muon_group(g, own))
            for pid in g["params"]:
                if "momentum_buffer" in state.get(pid, {}):
                    state[pid]["momentum_buffer"] = _sum_momentum(state[pid]["momentum_buffer"], g["momentum"])
    else:
        new_groups = [{**g, "name": own["name"]} if "name" in own and "name" not in g else g
                      for g, own in zip(saved, groups)]
    wide = wide_values(state_dict, wide_keys) if source == "muonclip" else {}
    for g in new_groups:
        for key in wide_keys:
            g.pop(key, None)
        g.update(wide)
    for entry in state.values():
        if isinstance(entry, dict):
            for key in wide_keys:
                entry.pop(key, None)
    for i, (g, own) in enumerate(zip(new_groups, groups)):
        if len(g["params"]) != len(own["params"]):
            raise ValueError(f"param group {i} of the state dict has {len(g['params'])} parameters, this "
                             f"optimizer's {len(own['params'])}: build the optimizer as the one that saved it")
        check_group({**g, "params": own["params"], "param_names": own.get("param_names")},
                    f"param group {i} of the state dict: ", f"param group {i} of the state dict: ")
    return {"state": state, "param_groups": new_groups}


def _from_torch_muon_group(g: Mapping[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    """torch.optim.Muon's group ``g`` as one of ours: its hyperparameters, ``own``'s other keys."""
    out = {k: v for k, v in own.items() if k not in ("params", "param_names")}
    out.update({k: g[k] for k in TORCH_MUON_KEYS})
    out["ns_coefficients"] = tuple(g["ns_coefficients"])
    out["adjust_lr_fn"] = scale_name(g["adjust_lr_fn"])  # torch's None is "original"
    out["algorithm"] = "muon"
    out["params"] = list(g["params"])
    if "param_names" in g:
        out["param_names"] = list(g["param_names"])
    return out


def _sum_momentum(buf: Tensor, momentum: float) -> Tensor:
    """torch.optim.Muon's averaged momentum as our sum: ``buf / (1 - mu)`` (in float64, rounded once)."""
    if not isinstance(buf, Tensor) or not buf.is_floating_point():
        raise ValueError(f"torch.optim.Muon's momentum_buffer must be a floating-point tensor, got {buf!r:.100}")
    return (buf.detach().to(torch.float64) / (1.0 - float(momentum))).to(torch.promote_types(buf.dtype, torch.float32))


def split_fp32_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[Any, dict[str, Tensor]]]:
    """``state_dict`` without the `FP32_STATE` and `INT8_STATE` tensors, and those tensors by saved
    parameter id.

    torch's loader casts state to the parameter's dtype (a float32 momentum would become
    bfloat16 for bfloat16 parameters, int8 codes float32); the tensors set aside are put back by
    `restore_fp32_state` in their own precision."""
    kept: dict[Any, dict[str, Tensor]] = {}
    state = {}
    for pid, entry in state_dict["state"].items():
        if isinstance(entry, Mapping):
            kept[pid] = {k: v for k, v in entry.items() if k in FP32_STATE + INT8_STATE and isinstance(v, Tensor)}
            entry = {k: v for k, v in entry.items() if k not in kept[pid]}
        state[pid] = entry
    return {**state_dict, "state": state}, kept


def restore_fp32_state(opt_state: Mapping[Tensor, dict[str, Any]], groups: Sequence[Mapping[str, Any]],
                       saved_groups: Sequence[Mapping[str, Any]], kept: Mapping[Any, Mapping[str, Tensor]]) -> None:
    """Put the tensors `split_fp32_state` set aside into the optimizer's state: copies on each
    parameter's device, in `state_dtype` (`INT8_STATE`: int8)."""
    ids = [pid for g in saved_groups for pid in g["params"]]
    params = [p for g in groups for p in g["params"]]
    for pid, p in zip(ids, params):
        for key, value in kept.get(pid, {}).items():
            dtype = torch.int8 if key in INT8_STATE else state_dtype(p)
            opt_state[p][key] = value.detach().to(device=p.device, dtype=dtype).clone()


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
        if not adamw.get("param_groups") or not all(_is_torch_adamw_group(g) for g in adamw["param_groups"]):
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
            state[index_of[p]] = {"momentum_buffer": _sum_momentum(entry["momentum_buffer"], tg["momentum"])}
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


__all__ = ["DTYPE_PREFIX", "FP32_STATE", "INT8_STATE", "TORCH_MUON_KEYS", "WIDE_KEYS",
           "first_param", "from_saved_form", "from_torch", "kind", "prepare", "restore_fp32_state", "saved_form",
           "split_fp32_state", "state_dtype", "torch_state_dict", "wide_values"]
