"""Runtime check that QK-Clip acted: a head clipped well below 1 must see its next max logit come down.

The structural check (`muonclip.qkclip.qknorm`) refuses attention blocks with a normalisation
module between the q/k projections and the logits. It cannot see a normalisation written as a
function call (``F.normalize`` in ``forward``, a projection that normalises its output), nor a
layout that names the wrong rows. This check is the safety net: it watches what the clip does.

**The rule.** After a clip of head h by ``gamma_h = tau / S_h``, the next forward runs on the
clipped weights, so head h's logits are ``gamma_h`` times those of the updated, unclipped
weights: its next recorded max is about ``gamma_h * S_h * g``, with ``g`` the growth that the
next update and the next batch bring. A clip that did nothing leaves it about ``S_h * g``. A
head is *armed* by a clip with ``gamma_h <= ARM_GAMMA`` (0.5) and *trips* when its next
recorded max is ``>= KEEP_RATIO * S_h`` (0.9); a layer is reported when one of its heads trips
on ``STRIKES`` (2) clips in a row. So:

* a clip that acted trips only when ``g >= KEEP_RATIO / gamma_h >= 1.8``: the head's max
  logit grows by 80% in one step on top of the clipped value. An update of normal size moves
  the logits by a few per cent; a batch with an outlier can do more once, which is why one
  trip is not enough — the growth must repeat at the next clip. Only updates so large that
  they multiply the logits every step (a learning rate far above the usual, the regime the
  clip cannot hold anyway) can be reported by mistake;
* a clip that did nothing trips every step while the max stays above ``2 * tau`` and does
  not fall by more than 10% per step on its own: reported at the second check;
* a clip with ``gamma_h > 0.5`` is not checked: there the growth that a genuine clip may see
  (a factor ``1 / gamma_h < 2``) cannot be told apart from a no-op. Logits that a no-op lets
  run away cross ``2 * tau``, and are then caught.

Every clip of every layer is checked on the next step that records the layer — the first clip
included. A layer that records nothing in a step keeps its heads' state; a masked step
(``on_nonfinite="mask"``, every gamma 1) arms nothing.

**Cost.** Per device, per step: one concatenation of the layers' maxima and about a dozen
element-wise kernels on ``(heads,)`` vectors; nothing waits for the device:

* tensors on the CPU are read at once;
* on CUDA, each step copies the ``(3, heads)`` evidence without blocking into pinned memory
  and records an event; a later step reads the copy once the event has completed, and starts
  the next copy only then (the evidence is sticky, so a skipped copy loses nothing). In one
  process nothing is ever waited on, so a report may come a step or two late. With
  ``torch.distributed`` (world size > 1) the copy is read at the next step: the all-reduce of
  the maxima has read its flags on the host in the meantime, so the copy is complete and every
  rank reports at the same step (``"raise"`` raises on every rank of the same step);
* on other devices the evidence is read synchronously each step.

**The report,** once per layer: a `QKClipIneffectiveWarning` (mode ``"warn"``, the default of
`MuonClip`), or a `QKClipIneffectiveError` (mode ``"raise"``), naming the layer, the heads that
tripped, their gamma and their max logit before and after, and the likely cause.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ._layouts import AttentionLayer

ARM_GAMMA = 0.5
"""A head is checked after a clip with gamma at or below this."""

KEEP_RATIO = 0.9
"""An armed head trips when its next max logit is at least this fraction of its max before the clip."""

STRIKES = 2
"""A layer is reported when one of its heads trips on this many clips in a row."""

ON_INEFFECTIVE_CLIP = ("warn", "raise", "ignore")


def world_size() -> int:
    """Ranks of the default process group; 1 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


class QKClipIneffectiveWarning(UserWarning):
    """A clipped head's max logit did not come down: QK-Clip is probably not acting on that layer."""


class QKClipIneffectiveError(RuntimeError):
    """Raised instead of `QKClipIneffectiveWarning` with ``on_ineffective_clip="raise"``."""


@dataclass
class _Group:
    """The layers whose maxima live on one device, with their heads concatenated."""

    names: list[str]
    sizes: list[int]
    device: torch.device
    armed_s: Tensor  # (H,) max logit of the last clip of an armed head, NaN elsewhere
    armed_g: Tensor  # (H,) its gamma, NaN elsewhere
    strikes: Tensor  # (H,) consecutive trips
    evidence: Tensor  # (3, H) gamma, max before, max after when a head reached STRIKES; NaN: never
    host: Tensor | None = None  # pinned copy of ``evidence`` (CUDA)
    event: torch.cuda.Event | None = None  # completion of the pending copy (CUDA)


class ClipCheck:
    """Checks, after every clip, that the previous clip acted (see module doc).

    `observe` returns the reports; `muonclip.MuonClip` warns or raises with them.

    Args:
        mode: ``"warn"`` (default: a `QKClipIneffectiveWarning` once per layer), ``"raise"``
            (a `QKClipIneffectiveError`) or ``"ignore"`` (no check, no cost).
    """

    def __init__(self, mode: str = "warn") -> None:
        if mode not in ON_INEFFECTIVE_CLIP:
            raise ValueError(f"on_ineffective_clip must be one of {ON_INEFFECTIVE_CLIP}, got {mode!r}")
        self.mode = mode
        self.reported: set[str] = set()
        self._groups: list[_Group] | None = None

    def reset(self) -> None:
        """Forget the armed heads and pending copies (e.g. after loading other weights); reports stay made."""
        self._groups = None

    @torch.no_grad()
    def observe(
        self,
        layers: Sequence[AttentionLayer],
        max_logits: Mapping[str, Tensor],
        clipped: Mapping[str, Tensor],
        tau: float,
        distributed: bool | None = None,
    ) -> list[str]:
        """After a clip: check the maxima just used against the previous clip, then arm for the next.

        Args:
            layers: the attention layers (their names and head counts; fixed at the first call
                until `reset`).
            max_logits: per layer name, the ``(n_heads,)`` maxima this clip used (layers that
                recorded nothing absent), as returned by `apply_qk_clip`.
            clipped: per layer name, the ``(n_heads,)`` bool mask of the heads this clip scaled.
            tau: the threshold this clip used.
            distributed: whether the maxima were reduced over several ranks, which then must
                report at the same step (default None: ``torch.distributed`` initialised with
                more than one rank).

        Returns:
            One message per layer found ineffective since the last call (each layer once; empty
            with mode ``"ignore"``).
        """
        if self.mode == "ignore" or not layers:
            return []
        if self._groups is None:
            self._groups = _groups(layers, max_logits)
        if distributed is None:
            distributed = world_size() > 1
        for group in self._groups:
            _update(group, max_logits, clipped, tau)
        return [msg for group in self._groups for msg in self._poll(group, distributed)]

    def _poll(self, group: _Group, distributed: bool) -> list[str]:
        if group.device.type == "cpu":
            return self._read(group, group.evidence)
        if group.device.type != "cuda":
            return self._read(group, group.evidence.cpu())
        reports = []
        if group.event is not None:
            if distributed:
                group.event.synchronize()  # complete already: the all-reduce read its flags after it
            if group.event.query():
                group.event = None
                reports = self._read(group, group.host)
        if group.event is None:
            if group.host is None:
                group.host = torch.empty(group.evidence.shape, dtype=group.evidence.dtype, pin_memory=True)
            group.host.copy_(group.evidence, non_blocking=True)
            group.event = torch.cuda.Event()
            group.event.record()
        return reports

    def _read(self, group: _Group, evidence: Tensor) -> list[str]:
        """Reports of the layers newly tripped in ``evidence`` (a tensor in host memory)."""
        tripped = ~torch.isnan(evidence[0])
        reports, lo = [], 0
        for name, n in zip(group.names, group.sizes):
            hi = lo + n
            if name not in self.reported and bool(tripped[lo:hi].any()):
                self.reported.add(name)
                reports.append(_message(name, evidence[:, lo:hi], tripped[lo:hi]))
            lo = hi
        return reports


def _message(name: str, evidence: Tensor, tripped: Tensor) -> str:
    """The report of layer ``name``: its tripped heads with their gamma and maxima, the likely cause."""
    heads = tripped.nonzero().flatten().tolist()
    gamma, before, after = (evidence[i].tolist() for i in range(3))
    shown = "; ".join(
        f"head {h} clipped by gamma={gamma[h]:.3g} (max logit {before[h]:.4g} -> {gamma[h] * before[h]:.4g}), "
        f"next recorded max logit {after[h]:.4g}"
        for h in heads[:4]
    )
    more = f" (and {len(heads) - 4} more heads)" if len(heads) > 4 else ""
    return (
        f"QK-Clip had no effect on attention layer '{name}': {shown}{more}. A clip that acts brings a head's next "
        "max logit to about gamma times its max before the clip (times one update's growth); these heads kept at "
        f"least {KEEP_RATIO:g} of it on {STRIKES} clips in a row. Likely cause: something between the q/k "
        "projections and the logits undoes a rescaling of W_q/W_k rows - a normalisation of q or k (QK-norm, an "
        "L2 norm, F.normalize or layer_norm inside the attention's forward or its projections) - or the layout "
        "names the wrong rows. QK-Clip does not protect this layer: train the model with plain muonclip.Muon (a "
        "q/k norm bounds the logits by its gains), or pass MuonClip(layers=[...]) with a layout that scales what "
        "the logits depend on. MuonClip(on_ineffective_clip='ignore') turns this check off."
    )


def _groups(layers: Sequence[AttentionLayer], max_logits: Mapping[str, Tensor]) -> list[_Group]:
    """Layers by the device of their maxima (of their weights when nothing was recorded yet)."""
    by_device: dict[torch.device, list[AttentionLayer]] = {}
    for layer in layers:
        value = max_logits.get(layer.name)
        device = value.device if value is not None else layer.device
        by_device.setdefault(device, []).append(layer)
    groups = []
    for device, members in by_device.items():
        h = sum(layer.recorder.n_heads for layer in members)
        nan = torch.full((h,), math.nan, device=device)
        groups.append(_Group([layer.name for layer in members], [layer.recorder.n_heads for layer in members],
                             device, nan, nan.clone(), torch.zeros(h, device=device),
                             torch.full((3, h), math.nan, device=device)))
    return groups


def _update(group: _Group, max_logits: Mapping[str, Tensor], clipped: Mapping[str, Tensor], tau: float) -> None:
    """Count the trips of the armed heads, keep the evidence of heads reaching STRIKES, arm this clip's heads."""
    dev = group.device
    s_parts, c_parts = [], []
    for name, n in zip(group.names, group.sizes):
        s = max_logits.get(name)
        if s is None:  # not recorded this step: NaN never trips and keeps the layer's armed heads
            s_parts.append(torch.full((n,), math.nan, device=dev))
            c_parts.append(torch.zeros(n, dtype=torch.bool, device=dev))
        else:
            s_parts.append(s.to(dev, torch.float32))
            c_parts.append(clipped[name].to(dev))
    s, c = torch.cat(s_parts), torch.cat(c_parts)
    recorded = ~torch.isnan(s)
    trip = s >= KEEP_RATIO * group.armed_s  # False where not armed (NaN)
    group.strikes = torch.where(recorded, torch.where(trip, group.strikes + 1, 0.0), group.strikes)
    first = (group.strikes >= STRIKES) & torch.isnan(group.evidence[0])
    group.evidence = torch.where(first, torch.stack([group.armed_g, group.armed_s, s]), group.evidence)
    gamma = tau / s
    arm = c & (gamma <= ARM_GAMMA)
    group.armed_s = torch.where(recorded, torch.where(arm, s, math.nan), group.armed_s)
    group.armed_g = torch.where(recorded, torch.where(arm, gamma, math.nan), group.armed_g)


__all__ = ["ARM_GAMMA", "KEEP_RATIO", "ON_INEFFECTIVE_CLIP", "STRIKES", "ClipCheck", "QKClipIneffectiveError",
           "QKClipIneffectiveWarning"]
