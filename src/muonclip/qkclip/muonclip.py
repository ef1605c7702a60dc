"""`MuonClip`: Muon + AdamW + QK-Clip in one ``step()`` (Kimi K2, arXiv 2507.20534, Algorithm 1)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..optim import Muon, param_groups
from .clip import all_reduce_max_, apply_qk_clip
from .discovery import discover_layers
from .layouts import AttentionLayer


class MuonClip(Muon):
    r"""Muon (hidden matrices) + AdamW (embeddings, head, vectors) + QK-Clip, in one ``step()``.

    One step::

        Muon / AdamW update of every parameter             # muonclip.Muon.step
        S = all_reduce_MAX(recorded per-head max logits)   # one packed call; only under torch.distributed
        for each attention layer, head h with S_h > tau:
            gamma_h = tau / S_h; scale head h's q/k rows so its logits are times gamma_h
        reset the recorders

    The max logits are recorded by the forward passes since the last step (all micro-batches
    of gradient accumulation) through `muonclip.scaled_dot_product_attention`. If the Muon
    step is skipped (``on_nonfinite="skip"``), the clip is skipped too and the recorders are
    reset. If it is masked (``on_nonfinite="mask"``), the clip runs with every gamma 1 on the
    device, so no weight changes and nothing waits for the device (``last_clipped`` is all
    False; ``last_max_logits`` holds the maxima recorded); the recorders are reset. The
    optimizer state (momentum, Adam moments) is never touched by the clip.

    Args:
        model: the model; used for the default ``groups`` and ``layers``.
        lr: learning rate (default 1e-3).
        tau: max-logit threshold, a finite number > 0 (default 100.0, Kimi K2's; small models
            often use 30–50).
        layers: the `AttentionLayer`\ s to clip (default None: `discover_layers(model)` — the
            reference GPT, Hugging Face models, else an error asking for this argument).
        groups: param groups (default None: `muonclip.param_groups(model)`).
        **muon_kwargs: any keyword of `muonclip.Muon` (momentum, weight_decay, update_scale, ...).

    Attributes:
        tau: the threshold.
        layers: the attention layers.
        last_max_logits: per layer name, the ``(n_heads,)`` maxima the last clip used (layers
            with nothing recorded are absent).
        last_clipped: per layer name, ``(n_heads,)`` bool: which heads the last clip scaled.
    """

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-3,
        tau: float = 100.0,
        *,
        layers: Sequence[AttentionLayer] | None = None,
        groups: Sequence[dict[str, Any]] | None = None,
        **muon_kwargs: Any,
    ) -> None:
        _check_tau(tau)
        layers = list(discover_layers(model) if layers is None else layers)
        names = [layer.name for layer in layers]
        if len(set(names)) != len(names):
            raise ValueError(f"attention layer names must be unique, got {names}")
        for layer in layers:
            if not isinstance(layer, AttentionLayer):
                raise TypeError(f"layers must be AttentionLayer objects, got {type(layer).__name__}")
            layer.check()
        super().__init__(param_groups(model) if groups is None else groups, lr=lr, **muon_kwargs)
        self.tau = float(tau)
        self.layers = layers
        self.last_max_logits: dict[str, Tensor] = {}
        self.last_clipped: dict[str, Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Optimizer update, then QK-Clip with the maxima recorded since the last step."""
        skipped = self._skipped_host  # host counter: reading steps_skipped would sync in "mask" mode
        loss = super().step(closure)
        if self._skipped_host != skipped:
            for layer in self.layers:
                layer.recorder.reset()
            self.last_max_logits, self.last_clipped = {}, {}
            return loss
        if self.last_masked is None:
            self.clip()
        else:
            self.clip(masked=self.last_masked)
        return loss

    @torch.no_grad()
    def clip(self, masked: Tensor | None = None) -> None:
        """Only the QK-Clip part of ``step()`` (all-reduce, clip, reset); normally called by ``step``.

        ``masked``: 0-D bool device flag of a masked step (``on_nonfinite="mask"``; default
        None): where set, every gamma is 1, so no weight changes (no host sync).
        """
        all_reduce_max_(self.layers)
        self.last_max_logits, self.last_clipped = apply_qk_clip(self.layers, self.tau, masked=masked)

    def clip_stats(self) -> dict[str, float]:
        """Numbers for loggers about the last clip (one host sync).

        Keys: ``"max_logit"`` (max over layers and heads), ``"clipped_heads"`` (how many heads
        were scaled), ``"clipped_fraction"``, and per layer ``"max_logit/<name>"`` and
        ``"clipped_heads/<name>"``. Empty when nothing was recorded.
        """
        if not self.last_max_logits:
            return {}
        names = list(self.last_max_logits)
        per_max = torch.stack([self.last_max_logits[n].max().float().cpu() for n in names])
        per_clip = torch.stack([self.last_clipped[n].sum().float().cpu() for n in names])
        maxes, clips = per_max.tolist(), per_clip.tolist()
        n_heads = sum(self.last_clipped[n].numel() for n in names)
        stats = {
            "max_logit": max(maxes),
            "clipped_heads": float(sum(clips)),
            "clipped_fraction": sum(clips) / n_heads,
        }
        for n, m, c in zip(names, maxes, clips):
            stats[f"max_logit/{n}"] = m
            stats[f"clipped_heads/{n}"] = c
        return stats

    def state_dict(self) -> dict[str, Any]:
        """Muon's state dict with ``tau`` in its ``"muonclip"`` entry."""
        sd = super().state_dict()
        sd["muonclip"]["tau"] = self.tau
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load Muon's state; restores ``tau`` when the state dict has one."""
        super().load_state_dict(state_dict)
        tau = state_dict.get("muonclip", {}).get("tau")
        if tau is not None:
            _check_tau(tau)
            self.tau = float(tau)


def _check_tau(tau: float) -> None:
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0):
        raise ValueError(f"tau must be a finite number > 0 (Kimi K2 uses 100; small models 30-50), got {tau!r}")


__all__ = ["MuonClip"]
