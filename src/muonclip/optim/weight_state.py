"""The per-weight state of a Muon step: the momentum (float32, or 8-bit) and NorMuon's second moment.

`momentum_state` and `second_moment_state` create a weight's state at its first step, as the
param group asks (``momentum_8bit``, ``normuon``), and hand the step the tensors it updates in
place; `muonclip.Muon` (one process) and `muonclip.distributed` (several) both use them, so the
state is the same in both. A weight whose group switched ``momentum_8bit`` since its state was
made keeps its momentum, converted.

* ``momentum_buffer``: float32 (float64 for float64 weights), the weight's shape.
* ``momentum_int8`` + ``momentum_scale`` (``momentum_8bit``): int8 codes, the weight's shape,
  and float32 scales ``(*leading dims, blocks per row)`` (`muonclip.optim.quantized`); for a
  DTensor weight both are DTensors with its placements.
* ``neuron_second_moment`` (``normuon``): float32 ``(batch, rows)`` (E experts or 1; the rows
  of the ``(out, in)`` matrix, block after block: `muonclip.optim.matrices.MatrixSpec.block_offset`),
  the whole weight's on every rank (a plain tensor: it is small, and every rank updates it the
  same way).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..common.dtensor import is_dtensor
from .matrices import MatrixSpec
from .quantized import QuantLayout, dequantize, layout, quantize_
from .state_dicts import state_dtype


def momentum_state(state: dict[str, Any], p: Tensor, group: dict[str, Any], spec: MatrixSpec,
                   local: Callable[[Tensor], Tensor],
                   new_buffer: Callable[[Tensor], Tensor]) -> tuple[Tensor | None, Any]:
    """A Muon weight's momentum for `muonclip.optim.functional.step_momentum`, created at the
    first step and converted when the group's ``momentum_8bit`` changed since the state was made:
    ``(local float32 buffer, None)``, or ``(None, (local codes, local scales, layout))``.
    ``new_buffer(p)`` makes a zero float32 buffer like ``p`` (a DTensor for a DTensor)."""
    lay = quant_layout(p.shape, spec)
    if group["momentum_8bit"]:
        if "momentum_int8" not in state:
            buffer = state.pop("momentum_buffer", None)
            q = new_buffer(p).to(torch.int8)
            state["momentum_scale"] = scale_like(p, lay)
            state["momentum_int8"] = q
            if buffer is not None:  # a float32 momentum from before: kept, quantised
                quantize_(local(buffer), local(q), local(state["momentum_scale"]), lay)
        return None, (local(state["momentum_int8"]), local(state["momentum_scale"]), lay)
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = new_buffer(p)
        if "momentum_int8" in state:  # an 8-bit momentum from before: kept, dequantised
            q, s = state.pop("momentum_int8"), state.pop("momentum_scale")
            local(state["momentum_buffer"]).copy_(dequantize(local(q), local(s), lay, local(s).dtype))
    return local(state["momentum_buffer"]), None


def quant_layout(shape: Sequence[int], spec: MatrixSpec) -> QuantLayout:
    """The 8-bit momentum blocks of a weight (`muonclip.optim.quantized.layout`): cut at the
    matrix-block edges that run along its last dimension (a transposed weight's splits)."""
    cuts = [a for segs in spec.blocks for a, _ in segs] if spec.axis == len(shape) - 1 and spec.n_blocks > 1 else []
    return layout(shape, spec.flatten, cuts)


def scale_like(p: Tensor, lay: QuantLayout) -> Tensor:
    """Zero float32 scales for ``p``'s blocks: a DTensor with ``p``'s placements for a DTensor
    ``p`` (its leading dimensions are the weight's, so a checkpoint reshards it like ``p``)."""
    if not is_dtensor(p):
        return torch.zeros(lay.scale_shape(p.shape), dtype=state_dtype(p), device=p.device)
    from torch.distributed.tensor import DTensor

    loc = p.to_local()
    zeros = torch.zeros(lay.scale_shape(loc.shape), dtype=state_dtype(p), device=loc.device)
    shape = lay.scale_shape(p.shape)
    stride = tuple(int(math.prod(shape[i + 1:])) for i in range(len(shape)))
    return DTensor.from_local(zeros, p.device_mesh, p.placements, run_check=False, shape=torch.Size(shape),
                              stride=stride)


def second_moment_state(state: dict[str, Any], p: Tensor, group: dict[str, Any], spec: MatrixSpec) -> Tensor | None:
    """NorMuon's ``(batch, rows)`` float32 buffer of a Muon weight, created at its first step
    (the whole weight's rows on every rank, also for a sharded weight), or None without NorMuon."""
    if not group["normuon"]:
        return None
    if "neuron_second_moment" not in state:
        device = p.device_mesh.device_type if is_dtensor(p) else p.device
        state["neuron_second_moment"] = torch.zeros(spec.batch, spec.rows, dtype=state_dtype(p), device=device)
    return state["neuron_second_moment"]


__all__ = ["momentum_state", "quant_layout", "scale_like", "second_moment_state"]
