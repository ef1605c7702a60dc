"""`muonclip train` under ``torchrun``: process group, model wrapping, data slices, collectives
and sharded checkpoints.

Launch (one process per GPU, or a few CPU processes with the gloo backend)::

    torchrun --standalone --nproc_per_node=2 $(which muonclip) train --preset tiny --out runs/ddp
    torchrun --standalone --nproc_per_node=2 $(which muonclip) train --preset tiny --out runs/fsdp --fsdp
    muonclip train --out runs/fsdp --resume --steps 60      # continue on one process (or any N)

(``-m muonclip.cli.main`` instead of ``$(which muonclip)`` works too.) ``--out`` is required
under torchrun: every rank must write to the same folder.

What changes when ``RANK``/``WORLD_SIZE`` are set (`session`):

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
* checkpoints are written with ``torch.distributed.checkpoint`` (`save_sharded`): a folder
  ``checkpoint-step<N>.dcp`` plus the pointer file ``checkpoint.dcp.json`` (optimizer, config,
  step, bookkeeping). All ranks write into a temporary folder, then rank 0 renames it and
  replaces the pointer atomically, so an interrupted save leaves the previous checkpoint
  loadable. Such a checkpoint resumes on any number of ranks, with DDP, FSDP2 or in one
  process; a one-process ``checkpoint.pt`` resumes under torchrun too (`find_checkpoint`).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .checkpoint import CheckpointError, load_checkpoint, write_atomically

SHARDED_POINTER = "checkpoint.dcp.json"
SHARDED_FORMAT = "muonclip-sharded-checkpoint"
SHARDED_VERSION = 1
FILE_CHECKPOINT = "checkpoint.pt"
LAUNCH_HINT = ("launch it with torchrun, e.g. `torchrun --standalone --nproc_per_node=2 $(which muonclip) "
               "train --fsdp --out DIR ...` (or `... -m muonclip.cli.main train --fsdp ...`)")


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands: ``rank`` of ``world_size``, FSDP2 or DDP, and its device.

    ``active`` is False for a plain single-process run (no wrapping, no collective, the
    ``checkpoint.pt`` format); a torchrun launch with one process and no ``--fsdp`` is one too.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    fsdp: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    tp: int = 1

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: ``world_size / tp`` (the ranks of one tensor-parallel group share a batch)."""
        return self.world_size // self.tp

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index on the ``(dp, tp)`` mesh (global rank = dp_rank * tp + tp_rank)."""
        return self.rank // self.tp

    @property
    def active(self) -> bool:
        """True when the run is wrapped (DDP or FSDP2) and uses collectives."""
        return self.world_size > 1 or self.fsdp

    @property
    def is_main(self) -> bool:
        """True on rank 0, the rank that prints and writes the run's files."""
        return self.rank == 0

    @property
    def mode(self) -> str:
        """``"fsdp"``, ``"fsdp x tp"``, ``"ddp"`` or ``"single"``."""
        if self.tp > 1:
            return "fsdp x tp"
        return "fsdp" if self.fsdp else ("ddp" if self.active else "single")


SINGLE = DistEnv()


def launched_by_torchrun() -> bool:
    """True when ``RANK`` and ``WORLD_SIZE`` are set in the environment (torchrun sets both)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def current_env(fsdp: bool = False, tp: int = 1) -> DistEnv:
    """The `DistEnv` of an already initialised default process group (`SINGLE` if there is none).

    ``tp`` > 1: tensor parallel over groups of ``tp`` consecutive ranks, FSDP2 over the rest
    (needs ``fsdp``).

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
    rank, world = dist.get_rank(), dist.get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"--tp {tp} must divide the number of processes ({world})")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    cuda = dist.get_backend() == "nccl" and torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    return DistEnv(rank, world, local_rank, fsdp, device, tp)


def init_from_env(fsdp: bool = False, tp: int = 1) -> DistEnv:
    """Initialise the default process group from torchrun's environment (NCCL on CUDA, else gloo).

    Without ``RANK``/``WORLD_SIZE`` this is a single-process run and nothing is initialised.

    Raises:
        ValueError: ``fsdp`` without torchrun (the message says how to launch).
    """
    if not launched_by_torchrun():
        return current_env(fsdp, tp)
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    return current_env(fsdp, tp)


@contextlib.contextmanager
def session(fsdp: bool = False, tp: int = 1) -> Iterator[DistEnv]:
    """Context manager: `init_from_env`, and ``destroy_process_group`` on leaving (also on errors and
    Ctrl-C) if this call created the group."""
    created = launched_by_torchrun() and not (dist.is_available() and dist.is_initialized())
    env = init_from_env(fsdp, tp)
    try:
        yield env
    finally:
        if created and dist.is_initialized():
            dist.destroy_process_group()


def wrap_model(model: nn.Module, env: DistEnv) -> tuple[nn.Module, nn.Module]:
    """Wrap ``model`` for ``env``; return ``(train_module, inner)``.

    ``train_module`` is what the training forward calls (DDP wrapper, or the model itself);
    ``inner`` is the module with the original parameter names, to build the optimizer on, read
    max logits from, evaluate with and checkpoint. FSDP2: ``fully_shard`` on every block of
    ``model.blocks`` (the muonclip GPT), then on the root; both returned values are the model.
    With ``env.tp`` > 1, first tensor parallel on the ``"tp"`` dimension of a ``(dp, tp)`` mesh
    (`muonclip.models.parallel.tensor_parallel`), then FSDP2 on its ``"dp"`` dimension.
    """
    if not env.active:
        return model, model
    model.to(env.device)
    if env.fsdp:
        from torch.distributed.fsdp import fully_shard

        mesh = None
        if env.tp > 1:
            from torch.distributed.device_mesh import init_device_mesh

            from ..models.parallel import tensor_parallel

            mesh2 = init_device_mesh(env.device.type, (env.dp_size, env.tp), mesh_dim_names=("dp", "tp"))
            tensor_parallel(model, mesh2["tp"])
            mesh = mesh2["dp"]
        for block in getattr(model, "blocks", []):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, model
    from torch.nn.parallel import DistributedDataParallel

    ids = [env.device.index] if env.device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids), model


def check_batch(batch_size: int, env: DistEnv) -> None:
    """Raise ValueError unless the global ``batch_size`` splits evenly over the data-parallel ranks."""
    n = env.dp_size
    if batch_size % n:
        raise ValueError(
            f"batch_size ({batch_size}) is the global batch, split between the {n} data-parallel processes; "
            f"it must be divisible by {n}: e.g. --set batch_size={n * max(1, batch_size // n)}"
        )


def rank_rows(t: Tensor, env: DistEnv) -> Tensor:
    """This rank's contiguous block of rows of a global batch ``t`` (all of it in one process), on its
    device; the ranks of one tensor-parallel group take the same block."""
    if env.dp_size > 1:
        n = t.shape[0] // env.dp_size
        t = t[env.dp_rank * n:(env.dp_rank + 1) * n]
    return t.to(env.device)


def _reduce(values: Sequence[float], env: DistEnv, op: Any) -> list[float]:
    if not env.active or env.world_size == 1 or not values:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=op)
    return t.tolist()


def all_sum(values: Sequence[float], env: DistEnv) -> list[float]:
    """Element-wise sum of ``values`` over all ranks (one all-reduce; identity in one process).
    Call on every rank."""
    return _reduce(values, env, dist.ReduceOp.SUM)


def all_mean(values: Sequence[float], env: DistEnv) -> list[float]:
    """Element-wise mean of ``values`` over all ranks (a NaN/inf on any rank makes the result
    non-finite everywhere). Call on every rank."""
    return [v / env.world_size for v in all_sum(values, env)]


def all_max(values: Sequence[float], env: DistEnv) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks. Call on every rank."""
    return _reduce(values, env, dist.ReduceOp.MAX)


def barrier(env: DistEnv) -> None:
    """Wait for every rank (nothing in one process)."""
    if env.active and env.world_size > 1:
        dist.barrier()


# --------------------------------------------------------------------------------------------
# checkpoints


@dataclass
class FoundCheckpoint:
    """The latest checkpoint of a run folder: ``kind`` ``"file"`` (``checkpoint.pt``, ``data`` is its
    whole dict) or ``"sharded"`` (``data`` is the pointer: optimizer, config, step, dir, extra)."""

    kind: str
    path: Path
    data: dict[str, Any]

    @property
    def optimizer(self) -> str:
        return str(self.data["optimizer"])

    @property
    def config(self) -> dict[str, Any]:
        return dict(self.data["config"])

    @property
    def step(self) -> int:
        return int(self.data["step"])


def read_pointer(run_dir: str | Path) -> dict[str, Any]:
    """Read and validate ``run_dir/checkpoint.dcp.json``; raise `CheckpointError` if unusable."""
    path = Path(run_dir) / SHARDED_POINTER
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"checkpoint pointer {path} is corrupt or unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"{path} is not a muonclip sharded checkpoint pointer")
    if data.get("version") != SHARDED_VERSION:
        raise CheckpointError(f"{path} has version {data.get('version')}, this muonclip reads {SHARDED_VERSION}")
    missing = [k for k in ("optimizer", "config", "step", "dir", "shapes") if k not in data]
    if missing:
        raise CheckpointError(f"checkpoint pointer {path} lacks {missing}; it is incomplete")
    folder = Path(run_dir) / data["dir"]
    if not (folder / ".metadata").is_file():
        raise CheckpointError(f"{path} points to {folder}, which holds no torch.distributed.checkpoint")
    return data


def find_checkpoint(run_dir: str | Path) -> FoundCheckpoint:
    """The latest checkpoint of ``run_dir``: ``checkpoint.pt`` or the sharded one (the higher step wins).

    Raises:
        CheckpointError: none there, or the one there is corrupt.
    """
    run_dir = Path(run_dir)
    found = []
    if (run_dir / SHARDED_POINTER).exists():
        found.append(FoundCheckpoint("sharded", run_dir / SHARDED_POINTER, read_pointer(run_dir)))
    if (run_dir / FILE_CHECKPOINT).exists() or not found:
        found.append(FoundCheckpoint("file", run_dir / FILE_CHECKPOINT, load_checkpoint(run_dir / FILE_CHECKPOINT)))
    return max(found, key=lambda f: (f.step, f.path.stat().st_mtime))


def has_checkpoint(run_dir: str | Path) -> bool:
    """True if ``run_dir`` holds a checkpoint of either kind."""
    return (Path(run_dir) / FILE_CHECKPOINT).exists() or (Path(run_dir) / SHARDED_POINTER).exists()


def remove_sharded(run_dir: str | Path) -> None:
    """Remove the sharded checkpoint of ``run_dir`` (after a newer ``checkpoint.pt`` was written)."""
    run_dir = Path(run_dir)
    pointer = run_dir / SHARDED_POINTER
    if not pointer.exists():
        return
    try:
        target = json.loads(pointer.read_text(encoding="utf-8")).get("dir")
    except (OSError, ValueError):
        target = None
    pointer.unlink(missing_ok=True)
    if target:
        shutil.rmtree(run_dir / target, ignore_errors=True)


def model_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Global shape of every tensor of ``model.state_dict()`` (DTensors: the whole tensor's)."""
    return {k: list(v.shape) for k, v in model.state_dict().items()}


def save_sharded(run_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, env: DistEnv, *,
                 meta: dict[str, Any], rng: dict[str, Any]) -> Path:
    """Write a reshardable checkpoint of ``model``/``optimizer`` into ``run_dir``; call on every rank.

    ``meta`` (optimizer, config, step, extra; JSON) goes into the pointer file, ``rng`` (rank 0's
    RNG states) into the checkpoint. All ranks write ``.checkpoint-step<N>.dcp.tmp``; after a
    barrier rank 0 renames it to ``checkpoint-step<N>.dcp``, atomically replaces the pointer,
    then removes the previous folder and any ``checkpoint.pt``. Returns the pointer's path.
    """
    from ..distributed import checkpoint as dcp_ckpt

    run_dir = Path(run_dir)
    step = int(meta["step"])
    tmp = run_dir / f".checkpoint-step{step}.dcp.tmp"
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # left by an interrupted save
    barrier(env)
    dcp_ckpt.save(tmp, model, optimizer, extra={"rng": rng})
    barrier(env)
    pointer = run_dir / SHARDED_POINTER
    if env.is_main:
        old = None
        if pointer.exists():
            with contextlib.suppress(OSError, ValueError):
                old = json.loads(pointer.read_text(encoding="utf-8")).get("dir")
        name, n = f"checkpoint-step{step}.dcp", 1
        while (run_dir / name).exists():  # never overwrite the folder the pointer may name
            name, n = f"checkpoint-step{step}-{n}.dcp", n + 1
        os.replace(tmp, run_dir / name)
        body = {"format": SHARDED_FORMAT, "version": SHARDED_VERSION, "dir": name, "world_size": env.world_size,
                "mode": env.mode, "shapes": model_shapes(model), **meta}
        write_atomically(pointer, lambda f: json.dump(body, f, indent=1), text=True)
        if old and old != name:
            shutil.rmtree(run_dir / old, ignore_errors=True)
        for stale in run_dir.glob(".checkpoint-step*.dcp.tmp"):  # left by interrupted saves
            shutil.rmtree(stale, ignore_errors=True)
        (run_dir / FILE_CHECKPOINT).unlink(missing_ok=True)
    barrier(env)
    return pointer


def load_sharded(run_dir: str | Path, pointer: dict[str, Any], model: nn.Module,
                 optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load the sharded checkpoint named by ``pointer`` into ``model``/``optimizer`` (any number of
    ranks, or one process); return the RNG states stored with it. Call on every rank."""
    from ..distributed import checkpoint as dcp_ckpt

    folder = Path(run_dir) / pointer["dir"]
    try:
        with warnings.catch_warnings():  # DCP warns that it loads "in a single process": intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            extra = dcp_ckpt.load(folder, model, optimizer)
    except Exception as e:  # DCP raises many kinds (CheckpointException wraps per-rank errors)
        raise CheckpointError(f"sharded checkpoint {folder} cannot be loaded ({type(e).__name__}: {e})") from None
    return extra.get("rng", {})


def load_full_into_sharded(model: nn.Module, optimizer: torch.optim.Optimizer, data: dict[str, Any],
                           build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]) -> None:
    """Load a one-process ``checkpoint.pt`` (``data``) into an FSDP2 ``model`` and its ``optimizer``.

    ``build()`` must return a fresh plain ``(model, optimizer)`` pair of the same run: the file
    is loaded into it and its state dicts, keyed by parameter name, are distributed into the
    shards with ``set_state_dict(full_state_dict=True)``. Call on every rank.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    plain, plain_opt = build()
    plain.load_state_dict(data["model"])
    plain_opt.load_state_dict(data["optim"])
    msd, osd = get_state_dict(plain, plain_opt)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True))
    for k in ("steps_taken", "steps_skipped"):
        if hasattr(plain_opt, k):
            setattr(optimizer, k, getattr(plain_opt, k))


__all__ = [
    "DistEnv", "FoundCheckpoint", "LAUNCH_HINT", "SHARDED_POINTER", "SINGLE", "all_max", "all_mean", "all_sum",
    "barrier", "check_batch", "current_env", "find_checkpoint", "has_checkpoint", "init_from_env",
    "launched_by_torchrun", "load_full_into_sharded", "load_sharded", "model_shapes", "read_pointer",
    "remove_sharded", "save_sharded", "session", "wrap_model",
]
