"""DeepSpeed on the CPU for the test suite: its communication extension built once, in the project's
build folder, under a lock that cannot go stale; and a launcher of gloo ranks that run many cases
in one start-up (docs/integrations.md, "DeepSpeed").

DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``) builds a shared-memory communication
extension (``deepspeed_shm_comm``) by torch's JIT loader the first time a process initialises
DeepSpeed's communication (about 30-70 s), under ``TORCH_EXTENSIONS_DIR``. torch guards the build
with a lock *file* (``lock`` in the build folder): a process killed while building leaves it
behind and every later load waits on it forever. `extensions_ready` builds (or loads) it under an
``flock`` on ``build/torch_extensions/.muonclip-build.lock`` -- a kernel lock, released when its
process dies, so it is never stale -- and, holding it, removes a torch lock file left by a killed
build (every process of ours that loads the extension holds the flock first, so none is building).
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXTENSIONS = ROOT / "build" / "torch_extensions"


def environment() -> None:
    """DeepSpeed on the CPU, its extensions in the project's build folder."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ["TORCH_EXTENSIONS_DIR"] = str(EXTENSIONS)
    os.environ.setdefault("DS_SKIP_CUDA_CHECK", "1")


@contextlib.contextmanager
def build_lock() -> Iterator[None]:
    """Hold the kernel lock over the extensions folder; remove torch's lock files left by a killed build."""
    EXTENSIONS.mkdir(parents=True, exist_ok=True)
    with open(EXTENSIONS / ".muonclip-build.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            for stale in EXTENSIONS.rglob("lock"):
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def extensions_ready() -> None:
    """Build (once) or load DeepSpeed's CPU communication extension, under `build_lock`."""
    environment()
    with build_lock():
        from deepspeed.accelerator import get_accelerator

        get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)


_READY: list[bool] = []


def extensions_ready_elsewhere(timeout_s: float = 300) -> None:
    """`extensions_ready` in a child process, once per process: the caller (pytest's process, which
    runs the rest of the suite) never imports DeepSpeed or loads its native extension; only the
    ranks' processes do."""
    if _READY:
        return
    code = "import sys; sys.path.insert(0, 'tests'); import deepspeed_harness as h; h.extensions_ready()"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=timeout_s, check=True,
                   stdout=subprocess.DEVNULL)
    _READY.append(True)


def init_rank(rank: int, world: int, port: int) -> None:
    """Initialise DeepSpeed's communication over gloo for ``rank`` of ``world`` (the extension loaded under `build_lock`)."""
    environment()
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    with build_lock():  # loaded once per process (DeepSpeed caches it), never while waiting for other ranks
        get_accelerator().create_op_builder("ShareMemCommBuilder").load(verbose=False)
    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=120))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    init_rank(rank, world, port)
    try:
        fn(rank, world, *args)
        dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(fn, *args, world: int = 2, limit_s: float = 300) -> int:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks with DeepSpeed initialised; fail (not
    hang) after ``limit_s``; a rank's exception fails the launch. Returns the launch's port, its
    shared-memory buffers removed (`shared_buffers`)."""
    import pytest
    import torch.multiprocessing as mp

    extensions_ready_elsewhere()
    port = free_port()
    ctx = mp.start_processes(_entry, args=(world, port, fn, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + limit_s
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                pytest.fail(f"{fn.__name__} did not finish in {limit_s} s on {world} ranks (a hang?)")
    finally:
        for buffer in shared_buffers(port):
            buffer.unlink(missing_ok=True)
    return port


def shared_buffers(port: int) -> list[Path]:
    """The shared-memory allreduce buffers DeepSpeed's CPU extension made for a launch on ``port``
    (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``, 66 MB each). DeepSpeed
    never unlinks them: left alone, every launch would keep that much memory until reboot."""
    return sorted(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_127.0.0.1_{port}_*"))
