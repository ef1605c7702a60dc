"""What a `muonclip train` run folder holds, who may write it, and how its files are written.

A run folder (``--out``) holds one run and nothing else::

    config.json                  the run's config, optimizer and identity (`write_config`)
    metrics.jsonl, metrics.csv   one row per step (`muonclip.app.metrics`)
    checkpoint.json              the current checkpoint: what it is, and a SHA-256 manifest of its files
    checkpoint-step<N>.pt        that checkpoint, one file (one process) ...
    checkpoint-step<N>.dcp/      ... or a torch.distributed.checkpoint folder (several ranks)
    .lock                        held by the process writing the run (`RunLock`)

(`muonclip.app.checkpoints` writes and reads the checkpoint.) Rules:

* **Only its own runs.** `inspect_folder` sorts an ``--out`` into absent, empty, one of our runs,
  or anything else; `muonclip train` starts a new run only in an absent or empty folder and
  resumes only a run folder whose entries all have the names above, so nothing a user wrote is
  ever overwritten (``--out /`` included). A folder whose run lost its checkpoint is refused,
  never restarted over.
* **One writer.** `RunLock` holds an exclusive ``flock`` on ``.lock`` for the run's life; the
  operating system releases it when the process ends, however it ends. A second writer gets a
  clear error. (``flock`` works on local file systems and, on Linux, on NFS v4; on a file system
  without locks the lock is not enforced.)
* **Never half-written.** Every file is written to a temporary ``.<name>.tmp-<pid>`` beside it,
  flushed to disk and renamed onto its name (`write_atomically`), so a kill at any moment
  leaves the old file or the new one. Temporaries and checkpoints that a kill left behind
  are removed by the next writer (`remove_leftovers`), under the lock.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

CONFIG = "config.json"
POINTER = "checkpoint.json"
LOCK = ".lock"
METRICS = ("metrics.jsonl", "metrics.csv")
CHECKPOINT_NAME = re.compile(r"checkpoint-step\d+(-\d+)?\.(pt|dcp)")
TEMPORARY_NAME = re.compile(r"\..+\.tmp-\d+|\.checkpoint-step\d+(-\d+)?\.dcp\.tmp")


class OutputError(RuntimeError):
    """The output folder cannot be used (unwritable, in use, or holding something else than a run
    that may be continued); the message says why and what to do."""


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (renames into it) to disk, where the platform allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomically(path: str | Path, write: Callable[[IO[Any]], object], text: bool = False) -> Path:
    """``write(f)`` into ``.<name>.tmp-<pid>`` beside ``path``, fsync, then ``os.replace`` onto ``path``.

    On any failure (Ctrl-C, a full disk) the temporary file is removed and ``path`` is untouched.

    Args:
        path: the file to (re)place.
        write: called once with the open temporary file.
        text: open it in text mode, UTF-8 (default False: binary).
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w" if text else "wb", **({"encoding": "utf-8"} if text else {})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json(path: str | Path, obj: Any) -> Path:
    """`write_atomically` of ``obj`` as indented JSON (no NaN or infinity: they are not JSON)."""
    return write_atomically(path, lambda f: json.dump(obj, f, indent=1, allow_nan=False), text=True)


def file_digest(path: str | Path) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex digest}`` of the file at ``path`` (read in 1 MiB blocks)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


def is_own_entry(name: str) -> bool:
    """True for the names a run folder may hold (module docstring), temporaries included."""
    return (name in (CONFIG, POINTER, LOCK, *METRICS) or CHECKPOINT_NAME.fullmatch(name) is not None
            or TEMPORARY_NAME.fullmatch(name) is not None)


@dataclass(frozen=True)
class FolderState:
    """What an ``--out`` holds (`inspect_folder`).

    Attributes:
        kind: ``"absent"``, ``"empty"`` (nothing, or only what a run leaves before its first
            write: the lock and temporaries), ``"run"`` (a run folder: its config or its
            checkpoint, and nothing that is not ours) or ``"foreign"`` (anything else).
        foreign: entries that are not a run folder's (for ``"foreign"``).
        has_checkpoint: the folder holds ``checkpoint.json``.
    """

    kind: str
    foreign: tuple[str, ...] = ()
    has_checkpoint: bool = False


def inspect_folder(folder: str | Path, allowed: Iterable[str] = ()) -> FolderState:
    """Sort ``folder`` (`FolderState`); ``allowed`` names more entries that may be in it (e.g. a
    TensorBoard folder the run writes into it).

    Raises:
        OutputError: ``folder`` (or a parent) is a file, or it cannot be listed.
    """
    folder = Path(folder)
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise OutputError(f"--out {folder}: {probe} is a file, not a folder")
    if not folder.exists():
        return FolderState("absent")
    try:
        names = sorted(os.listdir(folder))
    except OSError as e:
        raise OutputError(f"--out {folder}: cannot list it ({e.strerror or e}); choose another --out") from None
    allowed = set(allowed)
    foreign = tuple(n for n in names if n not in allowed and not (is_own_entry(n) and (n != CONFIG or _is_run_config(
        folder / n))))
    if foreign:
        return FolderState("foreign", foreign)
    if CONFIG in names or POINTER in names or any(CHECKPOINT_NAME.fullmatch(n) for n in names) \
            or any(n in METRICS for n in names):
        return FolderState("run", has_checkpoint=POINTER in names)
    return FolderState("empty")


def _is_run_config(path: Path) -> bool:
    """True when ``path`` is a run's ``config.json``: a JSON object naming an optimizer."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "optimizer" in data


def check_new_run_folder(folder: str | Path, allowed: Iterable[str] = ()) -> FolderState:
    """Raise `OutputError` unless a new run may start in ``folder``: absent, or empty, and writable."""
    folder = Path(folder)
    state = inspect_folder(folder, allowed)
    if state.kind == "run":
        if state.has_checkpoint:
            raise OutputError(f"--out {folder} already holds a run; continue it with --resume or choose another --out")
        raise OutputError(f"--out {folder} holds a run whose checkpoint ({POINTER}) is missing; it cannot be "
                          "continued, and a new run will not overwrite it: choose another --out")
    if state.kind == "foreign":
        raise OutputError(_foreign(folder, state.foreign))
    check_writable(folder)
    return state


def check_run_folder(folder: str | Path, allowed: Iterable[str] = ()) -> FolderState:
    """Raise `OutputError` unless ``folder`` holds a run that may be continued: a run folder (and
    nothing else) with its checkpoint, writable."""
    folder = Path(folder)
    state = inspect_folder(folder, allowed)
    if state.kind in ("absent", "empty"):
        raise OutputError(f"--out {folder} holds no run to continue (no {POINTER}); start one without --resume")
    if state.kind == "foreign":
        raise OutputError(_foreign(folder, state.foreign))
    if not state.has_checkpoint:
        raise OutputError(f"--out {folder} holds a run whose checkpoint ({POINTER}) is missing; it cannot be "
                          "continued: start a new run in another --out")
    check_writable(folder)
    return state


def check_writable(folder: Path) -> None:
    """Raise `OutputError` unless ``folder`` (or its nearest existing parent) can be written."""
    probe = folder
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"--out {folder}: cannot write to {probe} (permission denied); choose another --out")


LEGACY_NAMES = ("checkpoint.pt", "checkpoint.dcp.json")  # checkpoint format 1: no manifest


def _foreign(folder: Path, names: tuple[str, ...]) -> str:
    """The message for a folder holding entries that are not a run folder's."""
    if any(n in LEGACY_NAMES for n in names):
        return (f"--out {folder} holds a run written by an earlier muonclip (checkpoint format 1, without "
                "checksums), which this version does not continue; start a new run in another --out")
    return f"--out {folder} holds files that are not a muonclip run's ({_listed(names)}); choose a new or empty folder"


def _listed(names: tuple[str, ...]) -> str:
    shown = ", ".join(repr(n) for n in names[:5])
    return shown + (f" and {len(names) - 5} more" if len(names) > 5 else "")


class RunLock:
    """An exclusive ``flock`` on ``folder/.lock``, held until `release` (or the process ends).

    Args:
        folder: the run folder (created with its parents if absent).

    Raises:
        OutputError: another process holds the lock (a run is writing there), or the folder
            cannot be created.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.folder / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise OutputError(f"--out {self.folder}: cannot create it ({e.strerror or e}); choose another --out") \
                from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").split()
            os.close(fd)
            who = f" (process {holder[0]} on {holder[1]})" if len(holder) >= 2 else ""
            raise OutputError(f"--out {self.folder} is being written by another muonclip run{who}; wait for it to "
                              "end, stop it, or choose another --out") from None
        self.fd: int | None = fd

    def stamp(self, token: str = "") -> None:
        """Write this process's id and host (and ``token``) into the lock file, for a second writer's
        message and for the other ranks' shared-folder check."""
        if self.fd is None:
            return
        text = f"{os.getpid()} {os.uname().nodename} {token}\n".encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text, 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Release the lock (the ``.lock`` file stays: removing it would let two writers lock two files)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_lock_token(folder: str | Path) -> str:
    """The token `RunLock.stamp` wrote into ``folder/.lock`` ("" when none can be read)."""
    try:
        parts = (Path(folder) / LOCK).read_text(encoding="utf-8").split()
    except OSError:
        return ""
    return parts[2] if len(parts) >= 3 else ""


def remove_leftovers(folder: str | Path, keep: str | None) -> list[str]:
    """Remove what a killed writer left in ``folder``: temporaries and any checkpoint file or folder
    other than ``keep`` (the one ``checkpoint.json`` names). Call under the lock. Returns the names."""
    folder = Path(folder)
    removed = []
    for p in sorted(folder.iterdir()):
        if TEMPORARY_NAME.fullmatch(p.name) or (CHECKPOINT_NAME.fullmatch(p.name) and p.name != keep):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def read_config(folder: str | Path) -> dict[str, Any] | None:
    """The dict of ``folder/config.json``, or None when it is absent.

    Raises:
        OutputError: it is not a JSON object.
    """
    path = Path(folder) / CONFIG
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise OutputError(f"{path} cannot be read ({type(e).__name__}: {e}); the run folder is damaged") from None
    if not isinstance(data, dict):
        raise OutputError(f"{path} is not a run's config (a JSON object); the run folder is damaged")
    return data


def write_config(folder: str | Path, optimizer: str, config: dict[str, Any], run: dict[str, Any]) -> Path:
    """Write ``folder/config.json`` atomically: ``{"optimizer": ..., <config fields>, "run": run}``
    (``run``: the run's identity and history, `muonclip.app.checkpoints.RunIdentity`)."""
    return write_json(Path(folder) / CONFIG, {"optimizer": optimizer, **config, "run": run})


__all__ = [
    "CHECKPOINT_NAME", "CONFIG", "LOCK", "METRICS", "POINTER", "TEMPORARY_NAME", "FolderState", "OutputError",
    "RunLock", "check_new_run_folder", "check_run_folder", "check_writable", "file_digest", "fsync_dir",
    "inspect_folder", "is_own_entry", "read_config", "read_lock_token", "remove_leftovers", "write_atomically",
    "write_config", "write_json",
]
