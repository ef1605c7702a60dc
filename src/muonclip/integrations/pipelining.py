"""MuonClip under ``torch.distributed.pipelining``: each stage steps on its own ranks, shape inference unrecorded.

A pipeline cuts the model into stages (``PipelineStage``), each held by some ranks, and a
schedule (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``, ...) runs every
micro-batch through them. Give each rank one `muonclip.MuonClip` (or `muonclip.Muon`) over the
stage modules it holds, with two things (docs/integrations.md, "torch.distributed.pipelining"):

* ``process_group=`` the group of the ranks that hold the same stage: its data-parallel
  replicas or its FSDP2 shards, e.g. ``mesh["dp"].get_group()`` of a ``("pp", "dp")`` mesh;
  ``"local"`` when each stage is held by one rank. The automatic group would be every rank
  (plain tensors: taken for DDP replicas) or the parameters' whole mesh (FSDP2 over
  ``mesh["dp"]``: the mesh spans the ``"pp"`` dimension), and the other stages' ranks hold
  other parameters, not replicas. With the stage's group, each matrix is orthogonalised once,
  whole, on an owner balanced among the stage's ranks, and the max logits of the stage's
  attention layers are reduced over those ranks only.
* `unrecorded_shape_inference` on the schedule: before the first step (and after each switch
  between training and evaluation) torch's schedule runs every stage once on tensors of the
  right shapes whose values are uninitialised memory, in training mode with grad enabled, to
  learn the shapes the stages exchange; that pass would feed garbage (NaN, huge maxima) to the
  clip of the first step.

Then one step is ``schedule.step(...)`` (every micro-batch's forward records into its layers'
recorders, whatever the schedule's order) and ``opt.step()``: the clip uses the running max over
all micro-batches of the step. ``examples/torchrun_pipeline.py`` splits the reference GPT in
two stages this way and checks the result against one process.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..attention.forward_rule import unrecorded_forward


def unrecorded_shape_inference(schedule: Any) -> Any:
    """``schedule`` (a ``torch.distributed.pipelining`` schedule) with its stages' shape inference
    run inside `muonclip.attention.forward_rule.unrecorded_forward`: no attention call of that
    pass feeds the clip (module docstring). Idempotent; returns ``schedule``.

    torch 2.13's schedules run that pass, forward and backward, in ``_initialize_pp_stages``,
    which this wraps on the schedule object.

    Raises:
        ValueError: the schedule has no ``_initialize_pp_stages`` (another torch), so the pass
            cannot be told apart from the micro-batches' forwards.
    """
    init = getattr(schedule, "_initialize_pp_stages", None)
    if init is None:
        raise ValueError(
            f"{type(schedule).__name__} (torch {torch.__version__}) has no _initialize_pp_stages, where torch 2.13's "
            "schedules run their stages' shape inference on uninitialised tensors: muonclip cannot keep that pass "
            "out of QK-Clip's max logits with this torch. Use torch 2.13, or train without pipeline parallelism"
        )
    if getattr(init, "muonclip_unrecorded", False):
        return schedule

    @functools.wraps(init)
    def initialise(*args: Any, **kwargs: Any) -> Any:
        with unrecorded_forward():
            return init(*args, **kwargs)

    initialise.muonclip_unrecorded = True  # type: ignore[attr-defined]
    schedule._initialize_pp_stages = initialise
    return schedule


__all__ = ["unrecorded_shape_inference"]
