"""`muonclip train` under ``torchrun``: the process group, model wrapping, data slices and collectives.

Launch (one process per GPU, or a few CPU processes with the gloo backend)::

    torchrun --standalone --nproc_per_node=2 $(which muonclip) train --preset tiny --out runs/ddp
    torchrun --standalone --nproc_per_node=2 $(which muonclip) train --preset tiny --out runs/fsdp --fsdp
    muonclip train --out runs/fsdp --resume --steps 60      # continue on one process (or any N)

(``-m muonclip.app`` instead of ``$(which muonclip)`` works too.) ``--out`` is required
under torchrun: every rank must write to the same folder.

Where a process stands is the library's `muonclip.distributed.GroupContext` (``group``,
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
* checkpoints are sharded (`muonclip.app.checkpoint_write.save_checkpoint`) and resume on any
  number of ranks, with DDP, FSDP2 or in one process; a one-process checkpoint file resumes
  under torchrun too;
* the ranks check that they agree before any work (`check_same_everywhere`: the config, the
  optimizer, the flags and ``--out``), and every collective waits at most ``--timeout`` seconds
  (`DEFAULT_TIMEOUT`), so a rank that stops answering ends the job in bounded time instead of
  blocking the others: the ranks that wait give up after ``--timeout`` (exit code 4,
  `is_collective_failure`), and torchrun kills the silent rank after its own shutdown timeout
  (``--shutdown-timeout``, 30 s by default);
* each worker dies with its launcher (`die_with_parent`): if torchrun itself is killed, its
  workers get SIGKILL from the kernel instead of training on, orphaned.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import hashlib
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..distributed._context import SINGLE, GroupContext

DEFAULT_TIMEOUT = 300.0
"""Seconds a collective (and the rendezvous) may wait for the other ranks (``--timeout``)."""

LAUNCH_HINT = ("launch it with torchrun, e.g. `torchrun --standalone --nproc_per_node=2 $(which muonclip) "
               "train --fsdp --out DIR ...` (or `... -m muonclip.app train --fsdp ...`)")


def die_with_parent() -> bool:
    """Ask Linux to SIGKILL this process when its parent (under torchrun: the launcher agent) dies
    (``prctl(PR_SET_PDEATHSIG)``); return False where that is not available. If the parent is
    already gone when this runs, the process kills itself at once."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # 1 = PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def is_collective_failure(e: BaseException) -> bool:
    """True when ``e`` is a collective operation of a multi-rank launch that failed because another
    rank did not answer within the timeout or died: torch's ``DistError`` family, or the plain
    ``RuntimeError`` that gloo raises ("Timed out waiting ... for recv", "Connection closed by
    peer"). False in one process."""
    if not launched_by_torchrun() or int(os.environ.get("WORLD_SIZE", "1")) < 2:
        return False
    if isinstance(e, dist.DistError):
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and any(s in text for s in (
        "Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "Broken pipe"))


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
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--tp must be a whole number of ranks >= 1, got {tp!r}")
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


def check_timeout(timeout: float) -> float:
    """Raise ValueError naming ``--timeout`` unless it is a finite number of seconds > 0."""
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < 1e7:
        raise ValueError(f"--timeout must be a number of seconds > 0 (and below 1e7), got {timeout!r}")
    return float(timeout)


@contextlib.contextmanager
def session(fsdp: bool = False, tp: int = 1, timeout: float = DEFAULT_TIMEOUT) -> Iterator[GroupContext]:
    """Context manager: initialise the default process group from torchrun's environment (NCCL on
    CUDA, else gloo), every collective and the rendezvous waiting at most ``timeout`` seconds,
    and destroy it on leaving (also on errors and Ctrl-C) if this call created it. Under torchrun
    the process also dies with its launcher (`die_with_parent`). Without ``RANK``/``WORLD_SIZE``
    nothing is initialised and `SINGLE` is yielded.

    Raises:
        ValueError: ``fsdp`` without torchrun (the message says how to launch); a bad ``tp``
            (`current_group`) or ``timeout``.
    """
    check_timeout(timeout)
    if tp < 1:
        current_group(fsdp, tp)  # the message for a bad --tp, before any rendezvous
    created = launched_by_torchrun() and not (dist.is_available() and dist.is_initialized())
    if created:
        die_with_parent()
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
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
    _settled(dist.all_reduce(t, op=op, group=ctx.group, async_op=True), [t])
    return t.tolist()


def _settled(work: Any, tensors: Sequence[Tensor], limit: float = 1.0) -> bool:
    """Wait for ``work``, then (CPU tensors: gloo) until its worker thread has let go of ``tensors``
    (at most ``limit`` seconds, sleeping without the GIL). That thread needs the GIL to drop a tensor
    Python made, and cannot take it once the interpreter is finalising: a process leaving right after
    a collective (every rank stopping together on an error) would abort ("terminate called without
    an active exception") instead of exiting with its code. Returns False if ``limit`` ran out first."""
    work.wait()
    del work  # the caller passes the only reference
    held = [t for t in tensors if t.device.type == "cpu" and hasattr(t, "_use_count")]  # torch's refcount probe
    deadline = time.monotonic() + limit
    while any(t._use_count() > 1 for t in held):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.0002)
    return True


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


def barrier(ctx: GroupContext) -> None:
    """Wait for every rank (nothing in one process). Call on every rank."""
    if ctx.world_size > 1:
        dist.barrier(group=ctx.group)


class RankFailed(ValueError):
    """Another rank stopped on an error (`agree`); the message is that rank's."""


def agree(error: BaseException | None, ctx: GroupContext,
          make: Callable[[BaseException], BaseException] | None = None) -> None:
    """Stop every rank together. When any rank passes an ``error`` (one all-reduce tells), every
    rank raises: the ranks that had one raise ``make(error)`` (default: the error itself), the
    others a `RankFailed` with the first failing rank's message (gathered). Nothing happens when
    none did. Call on every rank."""
    mine = None if error is None else (make(error) if make else error)
    if ctx.world_size > 1:
        if all_max([float(mine is not None)], ctx)[0] == 0:
            return
        texts = all_gather_text("" if mine is None else str(mine), ctx)
        if mine is None:
            r = next(i for i, t in enumerate(texts) if t)
            raise RankFailed(f"rank {r}: {texts[r]}")
    if mine is not None:
        raise mine


def all_gather_text(text: str, ctx: GroupContext) -> list[str]:
    """Every rank's ``text``, in rank order (two all-gathers: lengths, then the UTF-8 bytes padded
    to the longest). Call on every rank."""
    if ctx.world_size == 1:
        return [text]
    dev = device(ctx)
    data = torch.tensor(list(text.encode("utf-8")), dtype=torch.int32, device=dev)
    n = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
    sizes = [torch.zeros_like(n) for _ in range(ctx.world_size)]
    _settled(dist.all_gather(sizes, n, group=ctx.group, async_op=True), [*sizes, n])
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.int32, device=dev)
    padded[:data.numel()] = data
    parts = [torch.zeros_like(padded) for _ in range(ctx.world_size)]
    _settled(dist.all_gather(parts, padded, group=ctx.group, async_op=True), [*parts, padded])
    return [bytes(p[:int(s)].tolist()).decode("utf-8") for p, s in zip(parts, sizes)]


def check_same_everywhere(values: dict[str, Any], ctx: GroupContext) -> None:
    """Raise ValueError on every rank, naming each difference, unless every rank passes the same
    ``values`` (a JSON dict: the config, the optimizer, the flags, the run folder). One
    all-gather of a SHA-256 digest; only when they differ are the values themselves gathered.
    Call on every rank."""
    if ctx.world_size == 1:
        return
    text = json.dumps(values, sort_keys=True)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    digests = all_gather_text(digest, ctx)
    if len(set(digests)) == 1:
        return
    everyone = [json.loads(t) for t in all_gather_text(text, ctx)]
    ref = everyone[0]
    diffs = []
    for r, mine in enumerate(everyone[1:], start=1):
        for k in sorted(set(ref) | set(mine)):
            if ref.get(k) != mine.get(k):
                diffs.append(f"rank {r} has {k}={mine.get(k)!r} where rank 0 has {ref.get(k)!r}")
    shown = "; ".join(diffs[:6]) + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else "")
    raise ValueError(f"the ranks were launched with different settings ({shown}); every rank must run the same "
                     "command with the same --out (a folder on a file system they all share)")
