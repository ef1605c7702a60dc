"""`MuonClip`: Muon + AdamW + QK-Clip in one ``step()`` (Kimi K2, arXiv 2507.20534, section 2.1,
Algorithm 1; docs/design.md, "QK-Clip").

`MuonClip.step` runs Muon's step body, then the clip's path, in this file (`MuonClip._clip`)::

    recorded maxima   S_h, each head's max logit since the last clip (the layer's
                      `muonclip.attention.MaxLogitRecorder`)
    reduce            all_reduce_max_: the max over the ranks, only when there is a process group
    gammas            compute_gamma: gamma_h = tau / S_h if S_h > tau else 1
    scale rows        apply_qk_clip: layout.clip(gamma), head h's logits times exactly gamma_h
                      (`muonclip.qkclip._layouts`); then recorder.reset()

and the runtime check (`muonclip.qkclip.check`) looks at what the clip did. In one process that
is all a step enters beyond Muon's: the binding (`muonclip.qkclip.binding`) is consulted only
when a wrapper replaced a parameter, the wrapper lookup (`muonclip.optim._wrappers`) only when
``clip`` is called through a framework's wrapper, the DTensor geometry only for DTensor weights.

Under data parallelism every rank recorded the max of its own micro-batches; one packed
``all_reduce(MAX)`` over all layers and heads (plus one "recorded" flag per layer), over the
optimizer's process group (`MuonClip._reduce_group`), on every rank of it, never under a rank
condition, makes every rank clip with the global maxima.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..common import defaults as D
from ..distributed._context import collective_group
from ..optim import Muon, param_groups
from ..optim._stepping import needs_engine
from ..optim._validation import number
from ..optim._wrappers import WRAPPED_ATTRS, wrapped_optimizer
from ..optim.flat import refuse_flat_model
from ._discovery import discover_layers
from ._layouts import AttentionLayer
from .binding import ParameterBinding, parameter_owners
from .check import ClipCheck, QKClipIneffectiveError, QKClipIneffectiveWarning, world_size
from .clip_targets import check_clip_targets


class MuonClip(Muon):
    r"""Muon (hidden matrices) + AdamW (embeddings, head, vectors) + QK-Clip, in one ``step()``.

    One step::

        Muon / AdamW update of every parameter             # muonclip.Muon.step
        S = all_reduce_MAX(recorded per-head max logits)   # one packed call, over the optimizer's process group
        for each attention layer, head h with S_h > tau:
            gamma_h = tau / S_h; scale head h's q/k rows so its logits are times gamma_h
        reset the recorders

    The max logits are recorded by the training forward passes since the last step (all
    micro-batches of gradient accumulation) through `muonclip.scaled_dot_product_attention`: a
    forward feeds the clip only with the model in training mode and grad enabled, so evaluation
    and generation never do (`muonclip.attention.forward_rule`; `MaxLogitMonitor` reads them for
    logging). A step that updates parameters with nothing recorded warns (the model was in eval
    mode or under ``no_grad`` while training, so the step was plain Muon). If the Muon
    step is skipped (``on_nonfinite="skip"``), the clip is skipped too and the recorders are
    reset. If it is masked (``on_nonfinite="mask"``), the clip runs with every gamma 1 on the
    device, so no weight changes and nothing waits for the device (``last_clipped`` is all
    False; ``last_max_logits`` holds the maxima recorded); the recorders are reset. The
    optimizer state (momentum, Adam moments) is never touched by the clip.

    A clip that does not act is reported, never silent: when a head clipped by gamma <= 0.5
    records at the next step a max logit still >= 0.9 of its max before the clip, on two clips
    in a row, something between its projections and its logits undoes the rescaling (a q/k
    normalisation the structural check of `muonclip.integrations.hf.attach` could not see, e.g.
    ``F.normalize`` in the attention's forward). `muonclip.qkclip.check` states the rule, why a
    clip that acts does not trip it, and its cost: no host sync on CUDA.

    The maxima are nearly free: `MuonClip` tells every layer's recorder its ``tau``
    (``recorder.threshold``; setting ``opt.tau`` updates them), so an attention call on a
    kernel that returns its log-sum-exp computes the exact max only for heads that could
    exceed tau, and records the others as an upper bound at or below tau (the LSE gate,
    `muonclip.attention._gate`). The clip's decisions and gammas are exactly those of the exact
    maxima. ``last_bounded`` and ``clip_stats()`` say which logged maxima are such bounds.

    The maxima are reduced over the optimizer's process group
    (`muonclip.distributed._context.collective_group`, the group its step uses): the DTensor
    parameters' mesh, else every rank when several run, a ``ProcessGroup`` given as
    ``process_group=``; ``process_group="local"`` issues no collective, so independent models in
    one job each clip with their own maxima.

    Wrappers may replace the parameters after the optimizer is built: accelerate's FSDP2
    ``prepare`` (new DTensor parameters in the model and, swapped in, in the param groups),
    ``fully_shard`` or ``load_state_dict(assign=True)`` after it (in the model only). Before every
    step, ``state_dict`` and ``load_state_dict``, `MuonClip` takes the tensors in use
    (`muonclip.qkclip.binding`): it trains and clips as if built after the wrapper, or says by
    name why it cannot. A model wrapped in FSDP1 or holding DeepSpeed ZeRO's flat pieces is
    refused (`muonclip.optim.flat`). Lightning's ``LightningOptimizer`` (``self.optimizers()``)
    and accelerate's ``AcceleratedOptimizer`` (what ``Accelerator.prepare`` returns, once
    accelerate is imported when the optimizer is built: `muonclip.integrations.accelerate`) pass on
    every attribute (``clip_stats()``, ``tau``, read and set, ``last_max_logits``, ...;
    `muonclip.optim._wrappers`); `muonclip.integrations.unwrap_optimizer` finds the optimizer under
    any wrapper.

    What the clip writes follows one rule (`muonclip.qkclip.clip_targets`): only trainable, plain
    floating-point tensors in the optimizer's param groups. A layer whose clip would scale a
    frozen tensor (the base weight under a LoRA adapter), a quantized one (a 4-bit base) or one
    the optimizer does not hold is refused here, with the weight named and the alternatives,
    never silently left unclipped. On a peft model with DoRA on q/k the clip scales the rows of
    the adapter's magnitude vectors (exact; docs/design.md, "QK-Clip on adapters").

    Args:
        model: the model (a ``torch.nn.Module``; a peft ``PeftModel`` too); used for the default
            ``groups`` and ``layers``. Anything else (a list of parameters, as the Hugging Face
            Trainer passes an optimizer class) raises a TypeError saying what to pass.
        lr: learning rate (default 1e-3).
        tau: max-logit threshold, a finite number > 0 (default 100.0, Kimi K2's; small models
            often use 30–50).
        layers: the `AttentionLayer`\ s to clip (default None: `discover_layers(model)` — the
            reference GPT, Hugging Face models, else an error asking for this argument).
        groups: param groups (default None: `muonclip.param_groups(model)`). Every tensor the
            clip writes must be in one of them.
        on_ineffective_clip: what to do when the runtime check finds a layer whose clip had no
            effect: ``"warn"`` (default: a `muonclip.qkclip.check.QKClipIneffectiveWarning` once
            per layer), ``"raise"`` (a `muonclip.qkclip.check.QKClipIneffectiveError`, on every
            rank at the same step under ``torch.distributed``) or ``"ignore"`` (no check).
        **muon_kwargs: any keyword of `muonclip.Muon` (momentum, weight_decay, adjust_lr_fn, normuon,
            cautious_weight_decay, momentum_8bit, ...).

    Attributes:
        tau: the threshold (settable; also the threshold of every layer's recorder; kept in every
            param group, so state dicts carry it).
        layers: the attention layers.
        last_max_logits: per layer name, the ``(n_heads,)`` maxima the last clip used (layers
            with nothing recorded are absent): exact where `last_bounded` is False, else an
            upper bound of the exact max that is at or below ``tau`` (within ``log(keys)`` of it).
        last_bounded: per layer name, ``(n_heads,)`` bool: which of ``last_max_logits`` are
            LSE bounds (never a clipped head).
        last_clipped: per layer name, ``(n_heads,)`` bool: which heads the last clip scaled.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = D.LR,
        tau: float = D.TAU,
        *,
        layers: Sequence[AttentionLayer] | None = None,
        groups: Sequence[dict[str, Any]] | None = None,
        on_ineffective_clip: str = "warn",
        **muon_kwargs: Any,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(_not_a_model(model))
        _check_tau(tau)
        refuse_flat_model(model)  # FSDP1 / DeepSpeed ZeRO pieces: named, before any layout's shape check
        clip_check = ClipCheck(on_ineffective_clip)
        layers = list(discover_layers(model) if layers is None else layers)
        names = [layer.name for layer in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"attention layer names must be unique, got {names}")
        for layer in layers:
            if not isinstance(layer, AttentionLayer):
                raise TypeError(f"layers must be AttentionLayer objects, got {type(layer).__name__}")
            layer.check()
        groups = list(param_groups(model) if groups is None else groups)
        owners = parameter_owners(model)  # one walk, for the names here and the binding below
        check_clip_targets(layers, [g if isinstance(g, Mapping) else {"params": [g]} for g in groups],
                           {i: name for i, (_, _, name) in owners.items()})
        self.layers = layers
        self._tau = float(tau)  # before Muon's __init__, which copies the optimizer-wide values into the groups
        super().__init__(groups, lr=lr, **muon_kwargs)
        self.tau = float(tau)
        self._binding = ParameterBinding(model, self.param_groups, layers, owners)
        self.last_max_logits: dict[str, Tensor] = {}
        self.last_bounded: dict[str, Tensor] = {}
        self.last_clipped: dict[str, Tensor] = {}
        self._clip_check = clip_check

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Optimizer update, then QK-Clip with the maxima recorded since the last step (torch's step
        hooks run once around the whole: the update is `muonclip.Muon`'s step body, not its
        wrapped ``step``; stepped by DeepSpeed ZeRO on its partitions: `muonclip.integrations.deepspeed`,
        through `muonclip.Muon._flat_driver`)."""
        driver = self._flat_driver()
        if driver is not None:
            return driver.step(closure)
        self._follow()  # a wrapper may have replaced parameters
        taken = self.steps_taken  # a skipped step does not count (a masked one does: it runs, undone on the device)
        loss = self._muon_step(closure)
        if self.steps_taken == taken:
            for layer in self.layers:
                layer.recorder.reset()
            self.last_max_logits, self.last_bounded, self.last_clipped = {}, {}, {}
            return loss
        self._followed = True  # nothing replaces a parameter between the `_follow` above and the clip
        try:
            self.clip(self.last_masked)  # through `clip`, which loggers may wrap (muonclip.qkclip.step_metrics)
        finally:
            self.__dict__.pop("_followed", None)
        if not self.last_max_logits and any(p.grad is not None for g in self.param_groups for p in g["params"]) \
                and any(number(g["lr"]) != 0 for g in self.param_groups):  # lr 0 everywhere: DCP creating state
            warnings.warn(
                "MuonClip.step: no attention max logit was recorded since the last step, so QK-Clip did nothing. "
                "Only training forwards feed the clip: the model in training mode (model.train()) with grad enabled "
                "(not under torch.no_grad() or torch.inference_mode()). Forwards in eval mode never count.",
                stacklevel=outside_frames(),
            )
        return loss

    @torch.no_grad()
    def clip(self, masked: Tensor | None = None) -> None:
        """Only the QK-Clip part of ``step()`` (all-reduce, clip, runtime check, reset); normally called by ``step``.

        ``masked``: 0-D bool device flag of a masked step (``on_nonfinite="mask"``; default
        None): where set, every gamma is 1, so no weight changes (no host sync).
        """
        if self.__dict__.keys() & WRAPPED_ATTRS:  # maybe a framework's wrapper (`muonclip.optim._wrappers`)
            inner = wrapped_optimizer(self, MuonClip)
            if inner is not None:  # it is: the optimizer's own clip, and its record
                inner.clip(masked)
                return
        self._clip(masked)

    def _clip(self, masked: Tensor | None) -> None:
        """The clip's path (module docstring), then the runtime check."""
        if not self.__dict__.pop("_followed", False):  # called alone, not by `step` (which has followed)
            self._follow()
        # recorded maxima: each layer's recorder holds S_h, its heads' max logit since the last clip
        group = self._reduce_group()
        if group is not None:  # reduce: the max over the ranks (none in one process)
            all_reduce_max_(self.layers, group)
        self.last_bounded = {
            layer.name: layer.recorder.bounded for layer in self.layers if layer.recorder.value is not None
        }
        # gammas, then scale rows: gamma_h = tau / S_h above tau, head h's logits times gamma_h
        self.last_max_logits, self.last_clipped = apply_qk_clip(self.layers, self.tau, masked=masked)
        reports = self._clip_check.observe(self.layers, self.last_max_logits, self.last_clipped, self.tau,
                                           distributed=group is not None)
        if reports and self._clip_check.mode == "raise":
            raise QKClipIneffectiveError("\n".join(reports))
        for msg in reports:
            warnings.warn(msg, QKClipIneffectiveWarning, stacklevel=outside_frames())

    def _reduce_group(self) -> dist.ProcessGroup | None:
        """The group the maxima are reduced over: the optimizer's process group
        (`muonclip.distributed._context.collective_group`), asked only when the core says the step
        has one (DTensors or a process group: `muonclip.optim._stepping.needs_engine`); None in
        one process."""
        params = [p for g in self.param_groups for p in g["params"]]
        return collective_group(params, self.process_group) if needs_engine(params, self.process_group) else None

    def _follow(self, force: bool = False) -> None:
        """`ParameterBinding.follow` when a wrapper replaced a parameter since it last looked (or
        ``force``), unless a wrapper steps this optimizer on its flat partitions (DeepSpeed: the
        layouts stay on the model's parameters, and the driver maps them)."""
        if self._flat_driver(force) is None and (force or self._replaced()):
            self._binding.follow(self.param_groups, self.state)

    def _replaced(self) -> bool:
        """Whether the param groups or the model hold a tensor other than the one the binding last
        saw there: one identity test per parameter (`ParameterBinding.follow` finds which, and
        follows it or says why it cannot)."""
        groups = self.param_groups
        try:
            return any(groups[s.group]["params"][s.index] is not s.tensor
                       or (s.owner is not None and s.owner._parameters.get(s.attr) is not s.tensor)
                       for s in self._binding.slots)
        except (IndexError, KeyError):  # the groups were rebuilt: follow says so
            return True

    def clip_stats(self) -> dict[str, float]:
        """Numbers for loggers about the last clip (one host sync when something was recorded).

        Keys, always present (before the first step too): ``"max_logit"`` (max over layers and
        heads), ``"max_logit_is_bound"`` (1.0 when that value is an LSE upper bound, not the
        exact max: every head was at or below tau and the exact max lies within ``log(keys)``
        below it; else 0.0), ``"clipped_heads"`` (how many heads were scaled),
        ``"clipped_fraction"`` (of the heads of the layers that recorded), and for every layer
        ``"max_logit/<name>"``, ``"max_logit_is_bound/<name>"`` and ``"clipped_heads/<name>"``.
        A max logit nothing was recorded for (no clip yet, a step without training forwards, a
        layer that did not run) is NaN, its counts 0.0.
        """
        stats = {"max_logit": math.nan, "max_logit_is_bound": 0.0, "clipped_heads": 0.0, "clipped_fraction": 0.0}
        for layer in self.layers:
            stats.update({f"max_logit/{layer.name}": math.nan, f"max_logit_is_bound/{layer.name}": 0.0,
                          f"clipped_heads/{layer.name}": 0.0})
        if not self.last_max_logits:
            return stats
        names = list(self.last_max_logits)
        rows = []
        for n in names:
            v = self.last_max_logits[n].float()
            bounded = self.last_bounded.get(n)
            exact = v if bounded is None else v.masked_fill(bounded.to(v.device), -math.inf)
            rows.append(torch.stack([v.max(), exact.max(), self.last_clipped[n].sum().float()]).cpu())
        maxes, exacts, clips = torch.stack(rows).T.tolist()
        n_heads = sum(self.last_clipped[n].numel() for n in names)
        stats |= {
            "max_logit": max(maxes),
            "max_logit_is_bound": float(max(maxes) > max(exacts)),
            "clipped_heads": float(sum(clips)),
            "clipped_fraction": sum(clips) / n_heads,
        }
        for n, m, e, c in zip(names, maxes, exacts, clips):
            stats[f"max_logit/{n}"] = m
            stats[f"max_logit_is_bound/{n}"] = float(m > e)
            stats[f"clipped_heads/{n}"] = c
        return stats

    @property
    def tau(self) -> float:
        """The max-logit threshold; setting it (a finite number > 0) also sets every layer's
        ``recorder.threshold``, so the LSE gate always gates at the clip's own tau."""
        return self._tau

    @tau.setter
    def tau(self, value: float) -> None:
        inner = wrapped_optimizer(self, MuonClip)
        if inner is not None:  # set through a framework's wrapper (muonclip.optim._wrappers)
            inner.tau = value
            return
        _check_tau(value)
        value = float(value)
        for layer in self.layers:  # values bounded at the old tau must stay at or below the new one
            r = layer.recorder
            if r.value is not None and r.threshold is not None and value < r.threshold and bool(
                (r.bounded & (r.value > value)).any()
            ):
                raise ValueError(
                    f"MuonClip.tau cannot go from {r.threshold:g} down to {value:g} now: layer {layer.name!r} "
                    f"recorded heads as LSE bounds at or below the old tau (exact only above it) and some "
                    f"exceed {value:g}, so the clip would not be exact. Set tau between steps (before the "
                    "forward passes), or record with set_max_logit_backend('chunked')."
                )
        self._tau = value
        for layer in self.layers:
            layer.recorder.threshold = value
        self._record_wide_state()

    def _wide_state(self) -> dict[str, Any]:
        """Muon's optimizer-wide values and ``tau``: every param group carries them."""
        return {**super()._wide_state(), "tau": self.tau}

    def _load_wide_state(self, values: dict[str, Any]) -> None:
        """Muon's counters, and ``tau`` when the loaded state has one."""
        super()._load_wide_state(values)
        if values.get("tau") is not None:
            self.tau = values["tau"]

    def _kept_for_load(self) -> dict[str, Any]:
        """Muon's, and ``tau`` (`muonclip.Muon.load_state_dict` puts them back when a load fails)."""
        return {**super()._kept_for_load(), "_tau": self._tau}

    def _put_back(self, kept: dict[str, Any]) -> None:
        super()._put_back(kept)
        for layer in self.layers:  # the recorders gate at the clip's tau (see tau)
            layer.recorder.threshold = self._tau

    def state_dict(self) -> dict[str, Any]:
        """`muonclip.Muon.state_dict`, of the parameters the model holds now
        (`muonclip.qkclip.binding`); every param group also holds ``tau``."""
        self._follow(force=True)
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """`muonclip.Muon.load_state_dict` into the parameters the model holds now
        (`muonclip.qkclip.binding`; ``tau`` restored when the state dict has one); the runtime
        check starts afresh."""
        self._follow(force=True)
        super().load_state_dict(state_dict)
        self._clip_check.reset()


# ----------------------------------------------------------------------------------------------
# the clip's path
# ----------------------------------------------------------------------------------------------


def compute_gamma(max_logits: Tensor, tau: float) -> Tensor:
    """Per-head factor ``tau / S_h`` where ``S_h > tau``, else exactly 1.0.

    Args:
        max_logits: ``(n_heads,)`` recorded maxima ``S_h`` (``-inf``: head saw no token pair;
            NaN is never clipped).
        tau: the threshold, > 0.

    Returns:
        ``(n_heads,)`` float32 gamma in ``(0, 1]``.
    """
    s = max_logits.float()
    over = s > tau
    return torch.where(over, tau / torch.where(over, s, torch.ones_like(s)), torch.ones_like(s))


@torch.no_grad()
def all_reduce_max_(layers: Sequence[AttentionLayer], group: dist.ProcessGroup | None = None) -> None:
    """Replace every layer's recorded maxima by the max over the data-parallel ranks, in ONE all-reduce.

    The packed buffer holds, for each layer, its ``n_heads`` maxima (``-inf`` when nothing was
    recorded on this rank), the maxima of its exactly computed values (the recorder's
    ``exact``: which values are LSE bounds stays known after the reduction) and a flag (1 if
    recorded here, else 0). After the ``MAX``
    reduction a layer recorded on no rank stays unrecorded (``value = None``); one host read
    of the L flags decides that. Must be called on every rank of ``group`` (every rank holds
    the same layers). ``group`` None is the default group. No-op without an initialised process
    group or for a group of one rank.
    """
    if not layers or world_size() == 1 or dist.get_world_size(group) == 1:
        return
    device = layers[0].device
    if dist.get_backend(group) == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    parts = []
    for layer in layers:
        v = layer.recorder.value
        if v is None:
            parts.append(torch.full((2 * layer.recorder.n_heads + 1,), -math.inf, device=device))
        else:
            e = v if layer.recorder.exact is None else layer.recorder.exact
            parts.append(torch.cat([v.to(device), e.to(device), torch.ones(1, device=device)]))
    packed = torch.cat(parts)
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=group)
    sizes = [2 * layer.recorder.n_heads + 1 for layer in layers]
    chunks = packed.split(sizes)
    flags = torch.stack([c[-1] for c in chunks]).tolist()  # one host sync for L flags
    for layer, chunk, flag in zip(layers, chunks, flags):
        target, n = layer.device, layer.recorder.n_heads
        layer.recorder.value = chunk[:n].to(target).clone() if flag > 0 else None
        layer.recorder.exact = chunk[n:2 * n].to(target).clone() if flag > 0 else None


@torch.no_grad()
def apply_qk_clip(
    layers: Sequence[AttentionLayer], tau: float, masked: Tensor | None = None
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """Clip every layer with recorded maxima, then reset every recorder.

    Args:
        layers: the attention layers.
        tau: threshold, > 0.
        masked: 0-D bool tensor (default None): where True every gamma is exactly 1, so no
            weight changes, decided on the device (a step masked by ``on_nonfinite="mask"``).

    Returns:
        ``(max_logits, clipped)``: per layer name that had something recorded, the ``(n_heads,)``
        maxima used and the ``(n_heads,)`` bool "clipped" mask. Layers with nothing recorded are
        absent (nothing to clip; no error). No host sync.
    """
    if not tau > 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    max_logits: dict[str, Tensor] = {}
    clipped: dict[str, Tensor] = {}
    for layer in layers:
        s = layer.recorder.value
        layer.recorder.reset()
        if s is None:
            continue
        gamma = compute_gamma(s, tau)
        if masked is not None:
            gamma = torch.where(masked.to(gamma.device, non_blocking=True), torch.ones_like(gamma), gamma)
        layer.layout.clip(gamma)
        max_logits[layer.name] = s
        clipped[layer.name] = gamma < 1.0
    return max_logits, clipped


def outside_frames() -> int:
    """``stacklevel`` of the nearest caller outside muonclip and torch (the user's ``opt.step()``,
    past torch's optimizer-hook and no_grad wrappers), for warnings."""
    inside = (os.path.dirname(os.path.dirname(__file__)), os.path.dirname(torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _not_a_model(value: object) -> str:
    """The TypeError message for a `MuonClip` given something other than the model."""
    what = type(value).__name__
    return (
        f"MuonClip needs the model (a torch.nn.Module) to find its attention layers and route its parameters, got "
        f"a {what}. A list of parameters or param groups is what Trainer(optimizer_cls_and_kwargs=(MuonClip, "
        "{...})) passes: use optimizer_cls_and_kwargs=muonclip.integrations.hf.trainer_optimizer(MuonClip, "
        "lr=..., tau=...), or optimizers=(MuonClip(model, ...), None). Own param groups go in "
        "MuonClip(model, groups=...)."
    )


def _check_tau(tau: float) -> None:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite number > 0 (Kimi K2 uses 100; small models 30-50), got {tau!r}")
