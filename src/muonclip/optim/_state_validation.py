"""What a loaded optimizer state must hold: every state tensor and counter, checked before anything is loaded.

`muonclip.Muon.load_state_dict` runs `check_loaded_state` on the state dict it is about to load
(after `muonclip.optim._state_dicts.prepare` has recognised and converted it, and validated its
groups), so a state that a step could not run on, or that would write NaN into a weight, is
refused with a ValueError naming the parameter and the entry, and the optimizer is left as it
was. Per parameter, by its group's ``algorithm``:

* Muon: ``momentum_buffer`` (a real floating tensor of the parameter's shape); with 8-bit momentum
  ``momentum_int8`` (int8, the parameter's shape) and ``momentum_scale`` (floating, >= 0, the
  shape of its blocks' scales, `muonclip.optim._quantized.quant_blocks`); with NorMuon
  ``neuron_second_moment`` (floating, >= 0, ``(matrices, rows)``);
* AdamW: ``step`` (a whole number >= 0: an int, or a one-element tensor holding one, as
  torch.optim.AdamW keeps it), ``exp_avg`` and ``exp_avg_sq`` (floating, the parameter's shape,
  ``exp_avg_sq >= 0``), all three or none (`check_adamw_entry`, which also serves for
  torch.optim.AdamW's state).

**A state that has taken steps is whole.** A parameter's entry is created, whole, at its first
step with a gradient (a weight that never had one has no entry; `muonclip.Muon.state_dict`
writes no empty one). So when the state dict's ``steps_taken`` is above 0, every entry present
must hold its algorithm's state: a Muon weight's momentum (``momentum_buffer``, or
``momentum_int8`` with ``momentum_scale``: the group's ``momentum_8bit`` may have changed since),
its ``neuron_second_moment`` when the group has ``normuon``; an AdamW weight's ``step``,
``exp_avg`` and ``exp_avg_sq``. Loading an entry without them would restart that state from
zero without a word (a resumed run no longer continues the saved one). With ``steps_taken`` 0
(a fresh optimizer's state dict, torch.optim.Muon's) nothing is required.

Every floating tensor must be finite. Every tensor of the state, under any key (also one this
version does not know, which is otherwise left alone), must hold values: a tensor on the meta
device has none (torch's loader would fail copying it, after replacing the optimizer's state).
The optimizer-wide counters (`check_counters`: ``steps_taken``, ``steps_skipped``, whole numbers
>= 0; `muonclip.MuonClip`'s ``tau``, a finite number > 0) are checked wherever the state dict
keeps them: in an entry or in a param group; `muonclip.Muon`'s step checks its own the same way
(`check_counters`), and its setters (`counter`).

Values are read from the tensors held here: for a sharded (DTensor) state, the local shard's
(each rank checks its own).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import Any

import torch
from torch import Tensor

from ..common._dtensor import is_dtensor
from ._matrices import matrix_spec
from ._quantized import quant_blocks

COUNTER_LIMIT = 2**62
"""The largest step count accepted (a 64-bit counter with room to grow)."""


def _label(group: Mapping[str, Any], gi: int, i: int, p: Tensor) -> str:
    names = group.get("param_names")
    if names and i < len(names) and names[i]:
        return f"parameter '{names[i]}'"
    return f"parameter {i} of param group {gi} (shape {tuple(p.shape)})"


def _whole(value: Any) -> int | None:
    """``value`` as an int when it is a whole number (an integer, not a bool, numpy's too, or a
    one-element real tensor holding a whole value), else None."""
    if isinstance(value, Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool or value.device.type == "meta":
            return None
        v = value.item()
        return int(v) if float(v).is_integer() else None
    if isinstance(value, bool) or not isinstance(value, Integral):
        return None
    return int(value)


def counter(value: Any, key: str, where: str = "") -> int:
    """``value`` as the optimizer-wide step count ``key`` (``steps_taken``, ``steps_skipped``): a
    whole number in [0, 2^62]; else a ValueError (``where`` + ``key`` + what was given)."""
    v = _whole(value)
    if v is None or not 0 <= v <= COUNTER_LIMIT:
        raise ValueError(f"{where}{key} must be a whole number >= 0, got {value!r:.100}")
    return v


def check_counters(values: Mapping[str, Any], where: str = "") -> None:
    """Raise a ValueError naming the first optimizer-wide value of ``values`` that is present and
    out of range: ``steps_taken``, ``steps_skipped`` (whole numbers in [0, 2^62], `counter`), ``tau``
    (None, or a finite number > 0)."""
    for key in ("steps_taken", "steps_skipped"):
        if key in values:
            counter(values[key], key, where)
    if values.get("tau") is not None:
        tau = values["tau"]
        if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (0.0 < float(tau) < float("inf")):
            raise ValueError(f"{where}tau must be a finite number > 0, got {tau!r:.100}")


def _values(t: Tensor) -> Tensor | None:
    """The tensor whose values this process holds (a DTensor's local shard), or None (meta)."""
    local = t.to_local() if is_dtensor(t) else t
    return None if local.device.type == "meta" else local


def check_tensor(t: Any, key: str, shape: Sequence[int], where: str, *, kind: str = "float",
                 nonnegative: bool = False) -> None:
    """Raise a ValueError unless ``t`` is a tensor of ``shape`` (global, for a DTensor), of
    ``kind`` ("float": real floating; "int8"), finite, and >= 0 when ``nonnegative``; the message
    is ``where`` + the entry ``key`` + what is wrong."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{where}{key} must be a tensor, got {t!r:.100}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{where}{key} has shape {tuple(t.shape)}, the parameter needs {tuple(shape)}")
    if kind == "int8":
        if t.dtype != torch.int8:
            raise ValueError(f"{where}{key} must be int8 codes, got dtype {t.dtype}")
        if _values(t) is None:
            raise ValueError(_meta_message(where, key))
        return
    if not t.is_floating_point():
        raise ValueError(f"{where}{key} must be a real floating-point tensor, got dtype {t.dtype}")
    local = _values(t)
    if local is None:
        raise ValueError(_meta_message(where, key))
    if local.numel() == 0:
        return
    lo, hi = (float(v) for v in torch.aminmax(local.detach()))  # NaN and inf propagate to an end
    if not (abs(lo) < float("inf") and abs(hi) < float("inf")):  # False for NaN too
        raise ValueError(f"{where}{key} holds NaN or inf; a step would write it into the weight")
    if nonnegative and lo < 0:
        raise ValueError(f"{where}{key} holds a negative value ({lo:g}); it is a second moment, >= 0")


def _meta_message(where: str, key: str) -> str:
    return (f"{where}{key} is on the meta device: it holds no values to load (a state dict made from an optimizer "
            "of a model built on the meta device, or read with map_location='meta'). Load the state dict as saved, "
            "with its tensors")


def _missing(where: str, what: str, taken: int) -> str:
    return (f"{where}{what} is missing, though the state dict has taken {taken} steps: loading it would restart "
            "that state from zero, and the run would no longer continue the saved one. Load the whole state dict "
            "the optimizer saved (a weight that has had no gradient yet has no entry at all)")


def check_adamw_entry(entry: Mapping[str, Any], p: Tensor, where: str, taken: int = 0) -> None:
    """Raise a ValueError unless ``entry`` is an AdamW state of parameter ``p`` (module
    docstring): ``step``, ``exp_avg``, ``exp_avg_sq``, or none of them (no step yet) when the
    state dict has taken no step (``taken``, its ``steps_taken``)."""
    keys = [k for k in ("step", "exp_avg", "exp_avg_sq") if k in entry]
    if not keys:
        if taken > 0:
            raise ValueError(_missing(where, "its AdamW state (step, exp_avg and exp_avg_sq)", taken))
        return
    if len(keys) != 3:
        missing = sorted({"step", "exp_avg", "exp_avg_sq"} - set(keys))
        raise ValueError(f"{where}an AdamW state needs step, exp_avg and exp_avg_sq; {missing} are missing")
    step = _whole(entry["step"])
    if step is None or not 0 <= step <= COUNTER_LIMIT:
        raise ValueError(f"{where}step must be a whole number >= 0, got {entry['step']!r:.100}")
    check_tensor(entry["exp_avg"], "exp_avg", p.shape, where)
    check_tensor(entry["exp_avg_sq"], "exp_avg_sq", p.shape, where, nonnegative=True)


def check_muon_entry(entry: Mapping[str, Any], p: Tensor, group: Mapping[str, Any], where: str,
                     taken: int = 0) -> None:
    """Raise a ValueError unless the Muon state ``entry`` of parameter ``p`` in ``group`` fits it
    (module docstring); entries the step would create are optional while the state dict has
    taken no step (``taken``, its ``steps_taken``), required after."""
    if taken > 0:
        if "momentum_buffer" not in entry and "momentum_int8" not in entry and "momentum_scale" not in entry:
            raise ValueError(_missing(where, "its Muon momentum (momentum_buffer, or momentum_int8 and "
                                             "momentum_scale with momentum_8bit)", taken))
        if group.get("normuon") and "neuron_second_moment" not in entry:
            raise ValueError(_missing(where, "neuron_second_moment (NorMuon's second moment; the group has "
                                             "normuon=True)", taken))
    if "momentum_buffer" in entry:
        check_tensor(entry["momentum_buffer"], "momentum_buffer", p.shape, where)
    spec = None
    if "momentum_int8" in entry or "momentum_scale" in entry:
        if not ("momentum_int8" in entry and "momentum_scale" in entry):
            raise ValueError(f"{where}8-bit momentum needs both momentum_int8 and momentum_scale")
        spec = matrix_spec(tuple(p.shape), group)
        check_tensor(entry["momentum_int8"], "momentum_int8", p.shape, where, kind="int8")
        check_tensor(entry["momentum_scale"], "momentum_scale", quant_blocks(p.shape, spec).scale_shape(p.shape),
                     where, nonnegative=True)
    if "neuron_second_moment" in entry:
        spec = spec or matrix_spec(tuple(p.shape), group)
        check_tensor(entry["neuron_second_moment"], "neuron_second_moment", (spec.batch, spec.rows), where,
                     nonnegative=True)


def check_loaded_state(state_dict: Mapping[str, Any], groups: Sequence[Mapping[str, Any]]) -> None:
    """Validate every entry of ``state_dict["state"]`` (a `muonclip.Muon` state dict in this
    version's format, as `muonclip.optim._state_dicts.prepare` returns it) against the parameter it
    will be loaded into: the saved ids of ``state_dict["param_groups"]`` matched, in order, to the
    parameters of the optimizer's ``groups``. Raises a ValueError naming the parameter and entry."""
    state = state_dict["state"]
    labels: dict[Any, str] = {}
    for gi, (saved, own) in enumerate(zip(state_dict["param_groups"], groups)):
        check_counters(saved, f"param group {gi} of the state dict: ")
        taken = _whole(saved.get("steps_taken", 0)) or 0
        merged = {**own, **{k: v for k, v in saved.items() if k not in ("params", "param_names")}}
        for i, (pid, p) in enumerate(zip(saved["params"], own["params"])):
            if pid not in state:
                continue
            entry = state[pid]
            where = labels[pid] = f"the state of {_label(own, gi, i, p)}: "
            if not isinstance(entry, Mapping):
                raise ValueError(f"{where}must be a dict of its buffers, got {entry!r:.100}")
            check_counters(entry, where)
            if merged["algorithm"] == "muon":
                check_muon_entry(entry, p, merged, where, taken)
            else:
                check_adamw_entry(entry, p, where, taken)
    for pid, entry in state.items():  # every tensor, under any key, of any entry: values to load
        for key, value in entry.items() if isinstance(entry, Mapping) else ():
            if isinstance(value, Tensor) and _values(value) is None:
                where = labels.get(pid, f"the state entry {pid!r:.40} (of no parameter of this optimizer): ")
                raise ValueError(_meta_message(where, str(key)))
