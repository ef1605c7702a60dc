"""`muonclip.Muon`'s state dicts: what is loaded, and the conversions to and from torch.optim's.

**What `Muon.load_state_dict` takes** (`prepare`). A state dict is recognised by its param groups:

* ``muonclip.Muon``'s: some group has an ``algorithm`` key, or the dict has a top-level
  ``"muonclip"`` entry. Every group must hold every key of
  `muonclip.optim._validation.GROUP_KEYS` (a missing one is an error that names it); a group's
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
(`muonclip.optim._validation.check_group`), before anything is loaded.

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
that loads it (`muonclip.ortho._precision`); everything else is a tensor, a number, a string, None or a list,
tuple or dict of those, which ``torch.distributed.checkpoint`` (full or sharded, with or without
``cpu_offload``), accelerate and Lightning save.

**Out to torch, and in from torch's Muon + AdamW pair**: `muonclip.optim._torch_state_dicts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ._scale import scale_name
from ._validation import check_group

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
    if groups and all(is_torch_muon_group(g) for g in groups) and all(
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


def is_torch_muon_group(g: Mapping[str, Any]) -> bool:
    coefficients = g.get("ns_coefficients")
    return (set(g) - {"params", "param_names"} == TORCH_MUON_KEYS and isinstance(g["ns_steps"], int)
            and not isinstance(g["ns_steps"], bool) and isinstance(coefficients, Sequence) and len(coefficients) == 3)


def is_torch_adamw_group(g: Mapping[str, Any]) -> bool:
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
    per-parameter state (an entry that held nothing else is dropped); a torch.optim.Muon state
    dict has none."""
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
                    state[pid]["momentum_buffer"] = sum_momentum(state[pid]["momentum_buffer"], g["momentum"])
    else:
        new_groups = [{**g, "name": own["name"]} if "name" in own and "name" not in g else g
                      for g, own in zip(saved, groups)]
    wide = wide_values(state_dict, wide_keys) if source == "muonclip" else {}
    for g in new_groups:
        for key in wide_keys:
            g.pop(key, None)
        g.update(wide)
    for pid, entry in list(state.items()):
        if isinstance(entry, dict) and any(key in entry for key in wide_keys):
            for key in wide_keys:
                entry.pop(key, None)
            if not entry:  # an earlier version's entry that held only the counters is no state
                del state[pid]
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


def sum_momentum(buf: Tensor, momentum: float) -> Tensor:
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
