"""torchtitan's pipeline parallelism with Muon and MuonClip: each stage's own ranks, a step this torch runs.

torchtitan pipelines a model with ``--parallelism.pipeline_parallel_degree N`` through its model's
``pipelining_fn`` (``pipeline_llm``): the model is cut into stages (one per rank with 1F1B and
GPipe, two or more with the looped and V schedules: Interleaved1F1B, LoopedBFS,
InterleavedZeroBubble, ZBVZeroBubble, DualPipeV), each stage is parallelised by its
``parallelize_fn`` (FSDP2, HSDP, tensor and expert parallelism, on meshes that span every
stage), and the rank trains the stages it holds, its "model parts". `with_muonclip` replaces
that ``pipelining_fn`` by `pipelining` of it: torchtitan's own, then

* **the stage's group** (`stage_group`): the ranks whose pipeline coordinate is this rank's: the
  data, context, tensor and expert-parallel ranks of this rank's stages, which hold the same
  parameters, and nothing of the other stages. One process group per pipeline coordinate,
  made on every rank (none for a stage of one rank: ``"local"``). Each model part carries it
  (``muonclip_stage``, a `Stage`), and `muonclip.integrations.torchtitan.MuonClipOptimizers`
  builds one optimizer over the rank's parts with ``process_group=`` that group: every matrix
  is orthogonalised once, whole, on an owner balanced by Newton–Schulz flops among the
  stage's ranks; the max-logit all-reduce and the step's checks run within the stage. The
  meshes of the parameters span every stage, whose coordinates hold other parameters, not
  replicas: the automatic group (the mesh) would take them for replicas.
* **the schedule step** (`MicrobatchSchedule`): torchtitan 0.3.0's trainer and validator call
  ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...)``,
  the micro-batch-list form of the schedules of a newer torch. Where the installed torch's
  ``step`` takes a whole batch instead (``step(*args, target=..., losses=...)``: torch 2.13,
  where torchtitan's call fails with ``Expecting 4 arg_mbs but got 1``), the schedule is
  wrapped: its ``step`` and ``eval`` run torchtitan's micro-batches, as given (documents'
  block masks and positions included), through the schedule's own micro-batch loop
  (``_step_microbatches``, which torch's whole-batch ``step`` runs after splitting), with what
  torch's ``step`` does around it (the stages' ``has_backward``, their per-step state cleared).
  A torch with neither form is refused when the pipeline is built.

Refused when the pipeline is built, before anything is split (a ValueError saying what to use
instead):

* a torch whose schedules offer neither call (above; `check_pipeline`), or whose schedules do
  not run their shape inference where `muonclip.integrations.pipelining.unrecorded_shape_inference`
  keeps it out of the clip;
* a zero-bubble schedule (InterleavedZeroBubble, ZBVZeroBubble, DualPipeV: each backward split
  into its input and weight gradients) with selective activation checkpointing, torchtitan's
  default (`check_schedule`): torch's selective checkpointing allows one backward through a
  checkpointed region, so the weight-gradient half fails ("Trying to backward an extra time"),
  whatever the optimizer. Full checkpointing (``activation-checkpoint:full``) or none
  (``activation-checkpoint:none``) run, as does every other schedule with selective
  checkpointing.

Every attention layer lives on one stage; its recorder keeps the running max of every
micro-batch's forward until the clip, whatever the schedule's order of forwards and
(split) backwards: every forward of a step runs before its optimizer step.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..common._dtensor import mesh_grid
from ..optim.multiprocess import LOCAL
from .pipelining import unrecorded_shape_inference

MICROBATCH_ARGS = ("arg_mbs", "kwarg_mbs", "target_mbs", "losses", "return_outputs", "loss_kwargs")
"""The parameters of a schedule's micro-batch loop (``_step_microbatches``) that `MicrobatchSchedule` passes."""


@dataclass(frozen=True)
class Stage:
    """Where a model part sits in torchtitan's pipeline.

    Attributes:
        group: the process group of the ranks of this rank's stages (``"local"``: this rank alone),
            what `MuonClipOptimizers` passes as ``process_group``.
        ranks: those ranks (global ranks, ascending).
        pp_rank, pp_degree: this rank's pipeline coordinate and the pipeline degree.
        stages: the stage indices this rank holds, in model-part order; ``n_stages`` of them in all.
    """

    group: Any
    ranks: tuple[int, ...]
    pp_rank: int
    pp_degree: int
    stages: tuple[int, ...]
    n_stages: int

    def describe(self) -> str:
        """``pipeline stage 0 of 2 (ranks 0, 2)``, ``pipeline stages 0, 3 of 4 (rank 0)``."""
        which = "stage" if len(self.stages) == 1 else "stages"
        ranks = "rank" if len(self.ranks) == 1 else "ranks"
        return (f"pipeline {which} {', '.join(map(str, self.stages))} of {self.n_stages} "
                f"({ranks} {', '.join(map(str, self.ranks))})")


def stage_ranks(pp_mesh: Any) -> list[list[int]]:
    """The global ranks at each pipeline coordinate of ``pp_mesh`` (torchtitan's ``"pp"`` mesh):
    ``out[s]`` are the ranks of the stages held at coordinate ``s``, from the mesh's rank layout
    (`muonclip.common._dtensor.mesh_grid`), with no communication."""
    shape, where = mesh_grid(pp_mesh)
    out: list[list[int]] = [[] for _ in range(shape[-1])]
    for rank, coord in sorted(where.items()):
        out[coord[-1]].append(rank)
    return out


def stage_group(parallel_dims: Any) -> tuple[Any, tuple[int, ...]]:
    """``(group, ranks)`` of this rank's pipeline coordinate under torchtitan's ``parallel_dims``:
    one process group per coordinate, created on every rank (call it on every rank, in the same
    order); the group is ``"local"`` when a stage is held by one rank."""
    import torch.distributed as dist

    per_stage = stage_ranks(parallel_dims.get_mesh("pp"))
    me = dist.get_rank()
    mine = next(tuple(r) for r in per_stage if me in r)
    if len(mine) == 1:
        return LOCAL, mine
    group, _ = dist.new_subgroups_by_enumeration(per_stage)
    return group, mine


def _takes_microbatches(schedule: Any) -> bool:
    """Whether the schedule's ``step`` takes torchtitan's micro-batch lists (``arg_mbs=``, a newer torch)."""
    return "arg_mbs" in inspect.signature(schedule.step).parameters


def _has_microbatch_loop(schedule: Any) -> bool:
    loop = getattr(schedule, "_step_microbatches", None)
    if not callable(loop):
        return False
    params = inspect.signature(loop).parameters
    return all(p in params for p in MICROBATCH_ARGS)


def check_pipeline(schedule: Any) -> None:
    """Refuse a schedule `MicrobatchSchedule` cannot drive as torchtitan calls it (module docstring)."""
    if _takes_microbatches(schedule) or _has_microbatch_loop(schedule):
        return
    raise ValueError(
        f"torchtitan's pipeline calls {type(schedule).__name__}.step(arg_mbs=..., kwarg_mbs=...), which this torch "
        f"({torch.__version__}) has neither as step() nor as its micro-batch loop _step_microbatches("
        f"{', '.join(MICROBATCH_ARGS)}). Use torch 2.13 (or a torch whose schedules take arg_mbs=) with torchtitan "
        "0.3.0, or --parallelism.pipeline_parallel_degree 1 with FSDP2, HSDP and tensor parallelism"
    )


def split_backward(schedule_name: str) -> bool:
    """Whether torch's schedule ``schedule_name`` splits each backward into its input and weight
    gradients (the zero-bubble schedules)."""
    from torch.distributed.pipelining.schedules import (
        ScheduleDualPipeV,
        ScheduleInterleavedZeroBubble,
        ScheduleZBVZeroBubble,
        get_schedule_class,
    )

    return issubclass(get_schedule_class(schedule_name),
                      (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV))


def check_schedule(parallelism: Any, ac_config: Any) -> None:
    """Refuse a zero-bubble schedule with selective activation checkpointing (module docstring),
    before torchtitan builds the pipeline. ``parallelism``: torchtitan's ``ParallelismConfig``;
    ``ac_config``: its activation-checkpointing config (None: none)."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    name = parallelism.pipeline_parallel_schedule
    if parallelism.pipeline_parallel_schedule_csv or not isinstance(ac_config, SelectiveAC.Config):
        return
    if split_backward(name):
        raise ValueError(
            f"--parallelism.pipeline_parallel_schedule {name} splits each backward into its input and weight "
            "gradients, and torch's selective activation checkpointing (torchtitan's default) allows one backward "
            "through a checkpointed region: the weight half would fail at the first step, with any optimizer. Use "
            "activation-checkpoint:full or activation-checkpoint:none, or a schedule without split backward "
            "(1F1B, Interleaved1F1B, GPipe, LoopedBFS)"
        )


class MicrobatchSchedule:
    """A torch pipeline schedule called as torchtitan 0.3.0 calls it, on a torch whose ``step``
    takes a whole batch (module docstring).

    ``step`` and ``eval`` take torchtitan's keywords: ``arg_mbs`` (per micro-batch, the first
    stage's positional inputs; None elsewhere), ``kwarg_mbs`` (per micro-batch, keyword inputs of
    every stage), ``target_mbs`` (the last stage's targets), ``losses`` (a list the last stage
    fills with each micro-batch's loss), ``loss_kwargs`` (keywords of the loss function, the
    same for every micro-batch) and ``return_outputs``. Every other attribute is the schedule's.

    Args:
        schedule: the schedule torchtitan built (``PipelineScheduleSingle`` or ``PipelineScheduleMulti``).
    """

    def __init__(self, schedule: Any) -> None:
        check_pipeline(schedule)
        self.schedule = schedule

    def __getattr__(self, name: str) -> Any:
        if name == "schedule":
            raise AttributeError(name)
        return getattr(self.schedule, name)


    def step(self, *, arg_mbs: list | None = None, kwarg_mbs: list | None = None, target_mbs: list | None = None,
             losses: list | None = None, loss_kwargs: dict[str, Any] | None = None,
             return_outputs: bool = True) -> Any:
        """One iteration over the given micro-batches (forwards and, when the schedule has a loss,
        backwards); the last stage's merged outputs with ``return_outputs``, else None."""
        s = self.schedule
        if s._has_backward and getattr(s, "_backward_requires_autograd", True) and not torch.is_grad_enabled():
            raise RuntimeError("step() runs the backward passes and needs grad enabled; use eval() under no_grad")
        stages = schedule_stages(s)
        for stage in stages:
            stage.has_backward = s._has_backward
            stage.clear_runtime_states()
        s._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        for stage in stages:
            if stage.is_last and return_outputs:
                return s._merge_outputs(stage.output_chunks)
        return None

    def eval(self, *, arg_mbs: list | None = None, kwarg_mbs: list | None = None, target_mbs: list | None = None,
             losses: list | None = None, loss_kwargs: dict[str, Any] | None = None,
             return_outputs: bool = True) -> Any:
        """`step` with forwards only (the losses still computed on the last stage)."""
        s = self.schedule
        saved = s._has_backward
        s._has_backward = False
        try:
            return self.step(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs, losses=losses,
                             loss_kwargs=loss_kwargs, return_outputs=return_outputs)
        finally:
            s._has_backward = saved


def schedule_stages(schedule: Any) -> list[Any]:
    """The pipeline stages a torch schedule runs on this rank (``_stages`` of a multi-stage
    schedule, ``_stage`` of a single-stage one)."""
    stages = getattr(schedule, "_stages", None)
    return list(stages) if stages is not None else [schedule._stage]


def runnable(schedule: Any) -> Any:
    """``schedule`` itself when its ``step`` takes torchtitan's micro-batch lists, else a
    `MicrobatchSchedule` of it."""
    return schedule if _takes_microbatches(schedule) else MicrobatchSchedule(schedule)


def pipelining(fn: Callable[..., Any]) -> Callable[..., Any]:
    """torchtitan's ``pipelining_fn`` ``fn`` with each stage's group on its model parts and a
    schedule this torch runs (module docstring); called by torchtitan's trainer on every rank."""
    if getattr(fn, "muonclip_pipelining", False):
        return fn

    @functools.wraps(fn)
    def pipeline(model: nn.Module, *, parallel_dims: Any, **kwargs: Any) -> tuple[Any, list[nn.Module], bool, bool]:
        if "parallelism" in kwargs:
            check_schedule(kwargs["parallelism"], kwargs.get("ac_config"))
        schedule, parts, has_first, has_last = fn(model, parallel_dims=parallel_dims, **kwargs)
        stages = schedule_stages(schedule)
        schedule = runnable(unrecorded_shape_inference(schedule))
        group, ranks = stage_group(parallel_dims)
        stage = Stage(group, ranks, parallel_dims.get_mesh("pp").get_local_rank(), parallel_dims.pp,
                      tuple(st.stage_index for st in stages), stages[0].num_stages)
        for part in parts:
            part.muonclip_stage = stage
        return schedule, parts, has_first, has_last

    pipeline.muonclip_pipelining = True  # type: ignore[attr-defined]
    return pipeline


def stage_of(model_parts: list[nn.Module]) -> Stage | None:
    """The `Stage` the model parts carry (None: not pipelined).

    Raises:
        ValueError: several parts without one (built by a ``pipelining_fn`` other than
            `pipelining`'s), or parts of different stage groups.
    """
    found = {id(s): s for s in (getattr(p, "muonclip_stage", None) for p in model_parts)}
    if len(found) > 1:
        raise ValueError("the model parts belong to different pipeline stages' groups (or some to none); give "
                         "MuonClipOptimizers the parts of one rank, as torchtitan's trainer does")
    stage = next(iter(found.values()), None)
    if stage is None and len(model_parts) > 1:
        raise ValueError(
            f"MuonClipOptimizers got {len(model_parts)} model parts without their pipeline stage: build the model "
            "with a config from muonclip.integrations.torchtitan.with_muonclip (its pipelining_fn finds each "
            "stage's ranks), so that each stage steps on its own ranks"
        )
    return stage


__all__ = ["MICROBATCH_ARGS", "MicrobatchSchedule", "Stage", "check_pipeline", "check_schedule", "pipelining",
           "runnable", "schedule_stages", "split_backward", "stage_group", "stage_of", "stage_ranks"]
