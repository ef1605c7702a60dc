"""The parameters `muonclip.MuonClip` steps and clips, found again before every step.

Wrappers replace a model's parameters by new tensor objects after the optimizer was built:

* accelerate's FSDP2 ``prepare`` calls ``fully_shard`` on the model (new DTensor parameters)
  and swaps the new tensors into the optimizer's ``param_groups`` by position;
* ``fully_shard`` (or ``model.load_state_dict(..., assign=True)``, or a module's weight set
  anew) after the optimizer was built replaces them in the model only.

A QK-Clip layout holds the tensors it scales (`muonclip.qkclip._layouts`), so after such a swap it
would scale tensors nobody trains. `ParameterBinding` records, when the optimizer is built, every
parameter's place in the param groups (group, index) and in the model (the module and the
attribute that hold it), and `ParameterBinding.follow` looks at both: `muonclip.MuonClip` calls it
before a step and a clip when one identity test per parameter (`MuonClip._replaced`) sees a
tensor replaced, and before ``state_dict`` and ``load_state_dict`` always:

* the optimizer holds a new tensor (accelerate's swap): the layouts are pointed at it;
* the model holds a new tensor and the optimizer the old one (a late ``fully_shard``, an
  ``assign=True`` load): the optimizer's slot takes the model's tensor (its state moves with it
  when the new tensor is laid out like the old one; before the first step there is none), and
  the layouts are pointed at it;
* nothing changed: nothing happens (one identity test per parameter).

What cannot be followed is refused with the wrapper named and what to do: a replacement of
another global shape (FSDP1's flat parameters, DeepSpeed ZeRO-3's partitions: Muon needs whole
matrices), a tensor the model dropped, a model and an optimizer that hold two different new
tensors, optimizer state that cannot move to a sharded tensor, a layout that is not a dataclass
(it cannot be re-pointed). The clip's writing rule (`muonclip.qkclip.clip_targets`) is checked
again on every tensor a layout is re-pointed at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ..common._dtensor import is_dtensor
from ..optim.flat import DEEPSPEED, INSTEAD, flat_kind
from ._layouts import AttentionLayer
from .clip_targets import check_clip_targets


@dataclass
class Slot:
    """One parameter of the optimizer: where it is and what it was.

    Attributes:
        group, index: its place, ``param_groups[group]["params"][index]``.
        tensor: the tensor held there when last seen.
        shape: its global shape (a DTensor's ``shape`` is the global one).
        owner, attr: the module and attribute that hold it in the model (None: not a parameter
            of the model).
        name: its name, for messages.
    """

    group: int
    index: int
    tensor: Tensor
    shape: tuple[int, ...]
    owner: nn.Module | None
    attr: str
    name: str


def parameter_owners(model: nn.Module) -> dict[int, tuple[nn.Module, str, str]]:
    """``{id(p): (module, attr, name)}`` of every parameter of ``model``: the module holding it as
    ``attr`` and its name, both as ``model.named_parameters()`` gives them first (one walk)."""
    owners: dict[int, tuple[nn.Module, str, str]] = {}
    for mname, module in model.named_modules():
        for attr, p in module._parameters.items():
            if p is not None and id(p) not in owners:
                owners[id(p)] = (module, attr, f"{mname}.{attr}" if mname else attr)
    return owners


class ParameterBinding:
    """Keeps a `MuonClip`'s param groups and clip layouts on the tensors the model trains (module doc).

    Args:
        model: the model the optimizer was built on.
        groups: the optimizer's ``param_groups`` as built.
        layers: the attention layers the clip acts on.
        owners: the model's `parameter_owners`, when the caller has them (default None: read here).
    """

    def __init__(self, model: nn.Module, groups: list[dict[str, Any]], layers: Sequence[AttentionLayer],
                 owners: dict[int, tuple[nn.Module, str, str]] | None = None) -> None:
        owners = parameter_owners(model) if owners is None else owners
        self.layers = list(layers)
        self.slots: list[Slot] = []
        for gi, g in enumerate(groups):
            names = g.get("param_names") or [None] * len(g["params"])
            for i, (p, name) in enumerate(zip(g["params"], names)):
                module, attr, mname = owners.get(id(p), (None, "", ""))
                label = name or mname or f"parameter {i} of param group {gi}"
                self.slots.append(Slot(gi, i, p, tuple(p.shape), module, attr, label))

    def follow(self, groups: list[dict[str, Any]], state: dict[Tensor, dict[str, Any]]) -> None:
        """Point the optimizer and the layouts at the tensors in use now (module doc).

        Args:
            groups: the optimizer's ``param_groups`` now (``load_state_dict`` makes new ones).
            state: the optimizer's per-parameter state (an entry moves with a parameter the
                model replaced).

        Raises:
            RuntimeError: a replacement that cannot be followed, naming the parameter, the
                wrapper it looks like and what to do.
        """
        moved: dict[int, Tensor] = {}
        for s in self.slots:
            held = self._held(groups, s)
            live = s.owner._parameters.get(s.attr) if s.owner is not None else None
            if s.owner is not None and live is None:
                live = _MISSING
            if held is s.tensor and (live is None or live is s.tensor):
                continue
            new = self._replacement(groups, s, held, live, state)
            moved[id(s.tensor)] = new
            s.tensor = new
        if moved:
            self._repoint_layouts(groups, moved)

    # ------------------------------------------------------------------------------------------

    @staticmethod
    def _held(groups: list[dict[str, Any]], s: Slot) -> Tensor:
        try:
            return groups[s.group]["params"][s.index]
        except (IndexError, KeyError):
            raise RuntimeError(
                f"MuonClip's param group {s.group} no longer has its parameter {s.index} ({s.name}): the param "
                "groups were rebuilt after MuonClip was built. Build MuonClip on the model as it is trained (after "
                "any wrapper), and change param groups only with add_param_group"
            ) from None

    @staticmethod
    def _replacement(groups: list[dict[str, Any]], s: Slot, held: Tensor, live: Any,
                     state: dict[Tensor, dict[str, Any]]) -> Tensor:
        if live is _MISSING:
            raise RuntimeError(
                f"{s.name} is no longer a parameter of its module ({type(s.owner).__name__}.{s.attr}): "
                f"{_wrapper_hint(None)}"
            )
        if held is not s.tensor:  # the optimizer's slot was swapped (accelerate's FSDP2 prepare)
            if live is not None and live is not held and live is not s.tensor:
                raise RuntimeError(
                    f"{s.name}: the model holds one new tensor and MuonClip's param group another; MuonClip cannot "
                    "tell which one is trained. Swap the same tensor into both (as accelerate's prepare does), or "
                    "build MuonClip after the wrapper"
                )
            new, where = held, "the optimizer's param group"
        else:  # the model's parameter was replaced (fully_shard after MuonClip, load_state_dict(assign=True))
            new, where = live, "the model"
        if not isinstance(new, Tensor) or tuple(new.shape) != s.shape:
            got = f"a tensor of shape {tuple(new.shape)}" if isinstance(new, Tensor) else f"a {type(new).__name__}"
            raise RuntimeError(
                f"{s.name} of shape {s.shape} was replaced in {where} by {got}, not the same matrix: "
                f"{_wrapper_hint(new)}"
            )
        if where == "the model":
            if is_dtensor(s.tensor) and not is_dtensor(new):
                raise RuntimeError(
                    f"{s.name}: the model holds a plain tensor where MuonClip holds a DTensor, as FSDP2 does between "
                    "a forward and its backward (unsharded parameters). Call step() after the backward pass"
                )
            groups[s.group]["params"][s.index] = new
        old_state = state.pop(s.tensor, None)
        if old_state:
            if new in state and state[new]:
                state[s.tensor] = old_state
                raise RuntimeError(f"{s.name} was replaced by a tensor that already has optimizer state")
            if is_dtensor(new) != is_dtensor(s.tensor) or (is_dtensor(new) and new.placements != s.tensor.placements):
                state[s.tensor] = old_state
                raise RuntimeError(
                    f"{s.name} was replaced by a tensor laid out otherwise ({_layout(s.tensor)} -> {_layout(new)}) "
                    "after the optimizer had state for it; that state cannot follow. Load optimizer state after the "
                    "wrapper is applied (accelerate: accelerator.load_state after prepare; torch: "
                    "torch.distributed.checkpoint.state_dict.set_optimizer_state_dict), or build MuonClip after it"
                )
            state[new] = {k: v.to(new.device) if isinstance(v, Tensor) and v.device != new.device else v
                          for k, v in old_state.items()}
        return new

    def _repoint_layouts(self, groups: list[dict[str, Any]], moved: Mapping[int, Tensor]) -> None:
        for layer in self.layers:
            if not any(id(t) in moved for t in layer.layout.params()):
                continue
            if not dataclasses.is_dataclass(layer.layout):
                raise RuntimeError(
                    f"attention layer '{layer.name}': its layout ({type(layer.layout).__name__}) holds tensors a "
                    "wrapper replaced, and only a dataclass layout can be re-pointed; build MuonClip after the "
                    "wrapper (fully_shard, accelerator.prepare of the model alone)"
                )
            changes = {}
            for f in dataclasses.fields(layer.layout):
                value = getattr(layer.layout, f.name)
                if isinstance(value, Tensor) and id(value) in moved:
                    changes[f.name] = moved[id(value)]
                elif isinstance(getattr(value, "tensor", None), Tensor) and id(value.tensor) in moved:
                    changes[f.name] = dataclasses.replace(value, tensor=moved[id(value.tensor)])  # Rows, Magnitudes...
            if type(layer.layout).__dataclass_params__.frozen:
                layer.layout = dataclasses.replace(layer.layout, **changes)
            else:  # in place: whoever else holds the layout sees the new tensors too
                for name, value in changes.items():
                    setattr(layer.layout, name, value)
        check_clip_targets(self.layers, groups, {id(s.tensor): s.name for s in self.slots})


_MISSING = object()


def _layout(t: Tensor) -> str:
    return f"a DTensor placed {tuple(t.placements)}" if is_dtensor(t) else "a plain tensor"


def _wrapper_hint(t: Any) -> str:
    """Which wrapper a replacement looks like, and what to use instead."""
    kind = flat_kind(t) if isinstance(t, Tensor) else None
    if kind == "DeepSpeed ZeRO":
        return ("DeepSpeed ZeRO replaces the optimizer's parameters by flat partitions of whole param groups, and "
                f"this step did not come from a DeepSpeed engine muonclip recognises. {DEEPSPEED}")
    if kind is not None:
        return f"{kind} flattens parameters. {INSTEAD}"
    if t is None or (isinstance(t, Tensor) and t.ndim == 1):
        return ("FSDP1 (FullyShardedDataParallel) flattens parameters into 1-D pieces (with use_orig_params=False "
                f"they leave their modules). {INSTEAD}")
    return "build MuonClip on the model after the wrapper that changed it"


__all__ = ["ParameterBinding", "Slot", "parameter_owners"]
