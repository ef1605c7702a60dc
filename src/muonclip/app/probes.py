"""What the trainer measures beside the loss on mixture-of-experts and MLA models (one process).

* `ExpertRMS` — the update RMS of each expert of every 3-D expert stack, per unit learning rate
  and with the decoupled weight decay removed, as `muonclip.integrations.UpdateRMS` defines it
  for a whole matrix: ``U = (W_before (1 - lr wd) - W_after) / lr``, one RMS per expert. Muon
  orthogonalises each expert's matrix on its own, so every expert that received a gradient moves
  by the same RMS (``0.2`` times the RMS of Newton–Schulz's singular values with the default
  ``"rms"`` scale), however many tokens it was routed; a stack orthogonalised as one matrix, or
  AdamW, would give each expert its own.
* `MLAClipAudit` — for every head QK-Clip scales in a multi-head latent attention layer of the
  reference GPT, the factor each part of the head's weights was multiplied by, measured as the
  ratio of row norms just after and just before the clip: Kimi K2's rule (arXiv 2507.20534) is
  ``sqrt(gamma)`` on q^C and k^C (the non-rotary query and key rows), ``gamma`` on q^R (the rotary
  query rows), and nothing on the rotary key k^R shared by all heads, nor on the values, with
  ``gamma = tau / S_h``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn


def _groups_of(optimizer: torch.optim.Optimizer) -> dict[int, tuple[float, float]]:
    return {id(p): (float(g["lr"]), float(g.get("weight_decay", 0.0))) for g in optimizer.param_groups
            for p in g["params"]}


class ExpertRMS:
    """Per-expert update RMS of the 3-D parameters of ``model`` (module docstring): `before` (after
    the backward pass), the optimizer step, then `after`."""

    def __init__(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> None:
        self.optimizer = optimizer
        self.stacks = [(name, p) for name, p in model.named_parameters() if p.ndim == 3]
        self._before: list[tuple[str, Tensor, Tensor, float, float]] = []

    @torch.no_grad()
    def before(self) -> None:
        """Copy the stacks that will be updated (a gradient, lr > 0)."""
        groups = _groups_of(self.optimizer)
        self._before = [(name, p, p.detach().clone(), *groups[id(p)]) for name, p in self.stacks
                        if p.grad is not None and groups[id(p)][0] != 0.0]

    @torch.no_grad()
    def after(self) -> dict[str, list[float]]:
        """Stack name -> the update RMS of each of its experts since `before`."""
        out = {}
        for name, p, w0, lr, wd in self._before:
            u = (w0.mul(1.0 - lr * wd) - p.detach()).double() / lr  # (E, out, in)
            out[name] = u.pow(2).mean(dim=(1, 2)).sqrt().tolist()
        self._before = []
        return out


class MLAClipAudit:
    """The factors QK-Clip applied to the parts of each clipped MLA head (module docstring).

    Wraps ``optimizer.clip`` (a `muonclip.MuonClip`) with an instance attribute, as
    `muonclip.integrations.UpdateRMS` does; `events` returns what the last step's clip did and
    forgets it. Only the reference GPT's `muonclip.models._gpt.MultiHeadLatentAttention` layers
    are audited (the layer names ``blocks.<i>.attn``).
    """

    def __init__(self, optimizer: Any, model: nn.Module) -> None:
        from ..models._gpt import MultiHeadLatentAttention

        self.optimizer = optimizer
        self.layers = {f"blocks.{i}.attn": b.attn for i, b in enumerate(getattr(model, "blocks", []))
                       if isinstance(b.attn, MultiHeadLatentAttention)}
        self._events: list[dict[str, Any]] = []
        if self.layers and callable(getattr(optimizer, "clip", None)):
            inner = optimizer.clip

            def audited_clip(*args: Any, **kwargs: Any) -> Any:
                before = self._weights()
                result = inner(*args, **kwargs)
                self._events = self._measure(before)
                return result

            optimizer.clip = audited_clip

    def _weights(self) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
        return {name: (attn._q_weight_bias()[0].detach().clone(), attn.kv_b_proj.weight.detach().clone(),
                       attn.kv_a_proj_with_mqa.weight.detach().clone()) for name, attn in self.layers.items()}

    @torch.no_grad()
    def _measure(self, before: dict[str, tuple[Tensor, Tensor, Tensor]]) -> list[dict[str, Any]]:
        events = []
        clipped = getattr(self.optimizer, "last_clipped", None) or {}
        maxima = getattr(self.optimizer, "last_max_logits", None) or {}
        tau = float(self.optimizer.tau)
        for name, attn in self.layers.items():
            if name not in clipped or not bool(clipped[name].any()):
                continue
            q0, kvb0, kva0 = before[name]
            q1, kvb1, kva1 = (attn._q_weight_bias()[0], attn.kv_b_proj.weight, attn.kv_a_proj_with_mqa.weight)
            nq, nkv = attn.nope + attn.rope, attn.nope + attn.v_dim

            def ratio(a: Tensor, b: Tensor) -> float:
                return float(b.double().norm() / a.double().norm())

            shared = slice(attn.kv_rank, attn.kv_rank + attn.rope)
            for h in torch.nonzero(clipped[name]).flatten().tolist():
                q_c, q_r = slice(h * nq, h * nq + attn.nope), slice(h * nq + attn.nope, (h + 1) * nq)
                k_c, v = slice(h * nkv, h * nkv + attn.nope), slice(h * nkv + attn.nope, (h + 1) * nkv)
                events.append({
                    "layer": name, "head": h, "gamma": tau / float(maxima[name][h]),
                    "q_nope": ratio(q0[q_c], q1[q_c]), "k_nope": ratio(kvb0[k_c], kvb1[k_c]),
                    "q_rope": ratio(q0[q_r], q1[q_r]), "k_rope": ratio(kva0[shared], kva1[shared]),
                    "v": ratio(kvb0[v], kvb1[v]),
                })
        return events

    def events(self) -> list[dict[str, Any]]:
        """The heads the last clip scaled, each with gamma and the measured factor of every part."""
        out, self._events = self._events, []
        return out


def k2_rule_error(event: dict[str, Any]) -> float:
    """Largest gap between a `MLAClipAudit` event's measured factors and Kimi K2's rule (sqrt gamma on
    q^C and k^C, gamma on q^R, 1 on the shared k^R and on v)."""
    g = event["gamma"]
    want = {"q_nope": math.sqrt(g), "k_nope": math.sqrt(g), "q_rope": g, "k_rope": 1.0, "v": 1.0}
    return max(abs(event[k] - w) for k, w in want.items())
