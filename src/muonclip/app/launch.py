"""`muonclip train` under ``torchrun``: the process group, model wrapping, data slices and collectives.

Launch (one process per GPU, or a few CPU processes with the gloo backend)::

    torchrun --standalone --nproc_per_node=2 $(which muonclip) train --preset tiny --out runs/ddp
    torchrun --standalone --nproc_per_node=2 $(which muonclip) train --preset tiny --out runs/fsdp --fsdp
    muonclip train --out runs/fsdp --resume --steps 60      # continue on one process (or any N)

(``-m muonclip.app`` instead of ``$(which muonclip)`` works too.) ``--out`` is required
under torchrun: every rank must write to the same folder.

Where a process stands is the library's `muonclip.distributed.context.GroupContext` (``group``,
``rank``, ``world_size``; `SINGLE` for one process); the launch details the app adds are
functions of it (`device`) or flags of the command (``fsdp``). What changes when
``RANK``/``WORLD_SIZE`` are set (`session`):

* the default process group is initialised from the environment (NCCL on CUDA, else gloo)
  and destroyed when the command ends, whatever way it ends;
* the model is wrapped in ``DistributedDataParallel``, or with ``--fsdp`` every transformer
  block and then the root are ``fully_shard``-ed (FSDP2); the optimizer is built after that, on
  the unwrapped module, so `muonclip.MuonClip` finds the attention layers under the same names;
* ``batch_size`` is the global batch: step s uses the same batch as a single-process run and
  rank r trains on its contiguous block of ``batch_size / world_size`` rows (`rank_rows`), so an
  N-rank run equals the one-process run up to the order of float reductions;
* the loss, the stop flags (non-finite loss, Ctrl-C), validation losses, max logits and update
  RMS are reduced over all ranks, so every rank takes the same decisions; only rank 0 prints
  and writes metrics, the config and TensorBoard;
* checkpoints are sharded (`muonclip.distributed.checkpoint.save_sharded`) and resume on any
  number of ranks, with DDP, FSDP2 or in one process; a one-process ``checkpoint.pt`` resumes
  under torchrun too.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed.context import SINGLE, GroupContext

LAUNCH_HINT = ("launch it with torchrun, e.g. `torchrun --standalone --nproc_per_node=2 $(which muonclip) "
               "train --fsdp --out DIR ...` (or `... -m muonclip.app train --fsdp ...`)")


def launched_by_torchrun() -> bool:
    """True when ``RANK`` and ``WORLD_SIZE`` are set in the environment (torchrun sets both)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def current_group(fsdp: bool = False, tp: int = 1) -> GroupContext:
    """The `GroupContext` of an already initialised default process group (`SINGLE` if there is none).

    ``tp`` > 1: tensor parallel over groups of ``tp`` consecutive ranks, FSDP2 over the rest
    (needs ``fsdp``; see `wrap_model`).

    Raises:
        ValueError: ``fsdp`` or ``tp`` > 1 is asked for but no process group is initialised;
            ``tp`` without ``fsdp``, or not dividing the number of processes.
    """
    if tp > 1 and not fsdp:
        raise ValueError(f"--tp {tp} shards each block over {tp} ranks and FSDP2 over the rest: add --fsdp")
    if not (dist.is_available() and dist.is_initialized()):
        if fsdp:
            raise ValueError(f"--fsdp shards the model over several processes; {LAUNCH_HINT}")
        return SINGLE
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"--tp {tp} must divide the number of processes ({world})")
    return GroupContext(dist.group.WORLD, dist.get_rank(), world)


def data_parallel(ctx: GroupContext, tp: int = 1) -> tuple[int, int]:
    """``(dp_size, dp_rank)``: the data-parallel ranks, ``world_size / tp`` (the ranks of one
    tensor-parallel group share a batch), and this rank's index among them on the ``(dp, tp)``
    mesh (global rank = dp_rank * tp + tp_rank)."""
    return ctx.world_size // tp, ctx.rank // tp


def mode(ctx: GroupContext, fsdp: bool, tp: int = 1) -> str:
    """``"fsdp x tp"``, ``"fsdp"``, ``"ddp"`` or ``"single"``."""
    if tp > 1:
        return "fsdp x tp"
    return "fsdp" if fsdp else ("ddp" if is_active(ctx, fsdp) else "single")


def device(ctx: GroupContext) -> torch.device:
    """This process's device: ``cuda:<LOCAL_RANK>`` under an NCCL group on a CUDA machine, else the CPU."""
    if ctx.group is not None and dist.get_backend(ctx.group) == "nccl" and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", ctx.rank)))
    return torch.device("cpu")


def is_active(ctx: GroupContext, fsdp: bool) -> bool:
    """True when the run is wrapped (DDP or FSDP2) and uses collectives: several ranks, or ``--fsdp``.
    A torchrun launch with one process and no ``--fsdp`` is a plain one-process run."""
    return ctx.world_size > 1 or fsdp


@contextlib.contextmanager
def session(fsdp: bool = False, tp: int = 1) -> Iterator[GroupContext]:
    """Context manager: initialise the default process group from torchrun's environment (NCCL on
    CUDA, else gloo) and destroy it on leaving (also on errors and Ctrl-C) if this call created it.
    Without ``RANK``/``WORLD_SIZE`` nothing is initialised and `SINGLE` is yielded.

    Raises:
        ValueError: ``fsdp`` without torchrun (the message says how to launch); a bad ``tp``
            (`current_group`).
    """
    created = launched_by_torchrun() and not (dist.is_available() and dist.is_initialized())
    if created:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    try:
        yield current_group(fsdp, tp)
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def wrap_model(model: nn.Module, ctx: GroupContext, fsdp: bool, tp: int = 1) -> tuple[nn.Module, nn.Module]:
    """Wrap ``model`` for this launch; return ``(train_module, inner)``.

    ``train_module`` is what the training forward calls (DDP wrapper, or the model itself);
    ``inner`` is the module with the original parameter names, to build the optimizer on, read
    max logits from, evaluate with and checkpoint. FSDP2: ``fully_shard`` on every block of
    ``model.blocks`` (the muonclip GPT), then on the root; both returned values are the model.
    With ``tp`` > 1, first tensor parallel on the ``"tp"`` dimension of a ``(dp, tp)`` mesh
    (`muonclip.models.parallel.tensor_parallel`), then FSDP2 on its ``"dp"`` dimension.
    """
    if not is_active(ctx, fsdp):
        return model, model
    dev = device(ctx)
    model.to(dev)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            from ..models.parallel import tensor_parallel

            mesh2 = init_device_mesh(dev.type, (ctx.world_size // tp, tp), mesh_dim_names=("dp", "tp"))
            tensor_parallel(model, mesh2["tp"])
            mesh = mesh2["dp"]
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    from torch.nn.parallel import DistributedDataParallel

    ids = [dev.index] if dev.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids), model


def check_batch(batch_size: int, ctx: GroupContext, tp: int = 1) -> None:
    """Raise ValueError unless the global ``batch_size`` splits evenly over the data-parallel ranks."""
    n, _ = data_parallel(ctx, tp)
    if batch_size % n:
        raise ValueError(
            f"batch_size ({batch_size}) is the global batch, split between the {n} data-parallel processes; "
            f"it must be divisible by {n}: e.g. --set batch_size={n * max(1, batch_size // n)}"
        )


def rank_rows(t: Tensor, ctx: GroupContext, dev: torch.device | None = None, tp: int = 1) -> Tensor:
    """This rank's contiguous block of rows of a global batch ``t`` (all of it in one process), on
    ``dev`` (default: the CPU, where batches are made); the ranks of one tensor-parallel group
    (``tp``) take the same block."""
    dp_size, dp_rank = data_parallel(ctx, tp)
    if dp_size > 1:
        n = t.shape[0] // dp_size
        t = t[dp_rank * n:(dp_rank + 1) * n]
    return t if dev is None else t.to(dev)


def _reduce(values: Sequence[float], ctx: GroupContext, op: Any) -> list[float]:
    if ctx.world_size == 1 or not values:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device(ctx))
    dist.all_reduce(t, op=op, group=ctx.group)
    return t.tolist()


def all_sum(values: Sequence[float], ctx: GroupContext) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (one all-reduce; identity in one process).
    Call on every rank."""
    return _reduce(values, ctx, dist.ReduceOp.SUM)


def all_mean(values: Sequence[float], ctx: GroupContext) -> list[float]:
    """Element-wise mean of ``values`` over all ranks (a NaN/inf on any rank makes the result
    non-finite everywhere). Call on every rank."""
    return [v / ctx.world_size for v in all_sum(values, ctx)]


def all_max(values: Sequence[float], ctx: GroupContext) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks. Call on every rank."""
    return _reduce(values, ctx, dist.ReduceOp.MAX)


__all__ = [
    "LAUNCH_HINT", "SINGLE", "all_max", "all_mean", "all_sum", "check_batch", "current_group", "device",
    "data_parallel", "is_active", "launched_by_torchrun", "mode", "rank_rows", "session", "wrap_model",
]
