"""The QK-Clip step (Kimi K2, arXiv 2507.20534, section 2.1, Algorithm 1; docs/design.md, "QK-Clip").

After the optimizer update, with ``S_h`` each head's max logit recorded since the last clip::

    gamma_h = tau / S_h   if S_h > tau   else 1
    layout.clip(gamma)    # head h's logits times exactly gamma_h (see muonclip.qkclip._layouts)
    recorder.reset()

Under data parallelism every rank recorded the max of its own micro-batches; one packed
``all_reduce(MAX)`` over all layers and heads (plus one "recorded" flag per layer) makes every
rank clip with the global maxima. It runs over the optimizer's process group
(`muonclip.distributed._context.collective_group`: ``process_group="local"`` means no
collective, so independent models in one job each clip with their own maxima), on every rank of
it, never under a rank condition, and is skipped for a group of one rank.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ._layouts import AttentionLayer


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


def world_size() -> int:
    """Ranks of the default process group; 1 when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


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
