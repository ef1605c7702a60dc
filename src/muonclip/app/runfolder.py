"""What a `muonclip train` run folder holds, who may write it, and how its files are read and written.

A run folder (``--out``) holds one run and nothing else::

    config.json                  the run's config, optimizer and identity (`write_config`)
    metrics.jsonl, metrics.csv   one row per step (`muonclip.app.metrics`)
    checkpoint.json              the current checkpoint: what it is, and a SHA-256 manifest of its files
    checkpoint-step<N>.pt        that checkpoint, one file (one process) ...
    checkpoint-step<N>.dcp/      ... or a torch.distributed.checkpoint folder (several ranks)
    .lock                        held by the process writing the run (`RunLock`), and the record of its writers
    <tensorboard folder>         the run's TensorBoard event files, when ``--tensorboard`` is inside ``--out``
                                 (named in ``config.json``; its event files directly in the folder for
                                 ``--tensorboard`` = ``--out``)

(`muonclip.app.checkpoints` writes and reads the checkpoint.) Rules:

* **Only its own runs.** `inspect_folder` sorts an ``--out`` into absent, empty, one of our runs,
  or anything else; `muonclip train` starts a new run only in an absent or empty folder and
  resumes only a run folder whose entries all have the names above, so nothing a user wrote is
  ever overwritten (``--out /`` included). A folder whose run lost its checkpoint is refused,
  never restarted over (a run that stopped before its first checkpoint restarts from its
  start: `muonclip.app.resume`). Nothing is added to another run's folder: a new run's ``--out``
  inside one is refused (`check_outside_runs`, `enclosing_run`), and so is a TensorBoard folder
  (`muonclip.app.train_setup.check_tensorboard`).
* **No link is followed, nothing but files is read.** A run folder holds files and folders
  only: `inspect_folder` refuses a symbolic link or a special file (a FIFO, a device, a
  socket) anywhere in it, naming it (the CLI exits with 2), and every file of the folder is
  opened by `muonclip.app.safe_files.open_file`, without following a link at any step of its path (``O_NOFOLLOW``
  through the folder's own descriptors) and refused unless it is a regular file, before a byte
  is read; so neither a read nor a write ever leaves the folder, and nothing hangs on a FIFO or
  ``/dev/zero``. (``--out`` itself may be a link: it is the user's own path.)
* **Nothing shared is written in place.** Every file but ``.lock`` is written by a rename (below),
  which replaces a hard link's name and leaves the file it shared untouched; ``.lock``, stamped in
  place, is refused when it has more than one name (`RunLock`).
* **One writer.** `RunLock` holds an exclusive ``flock`` on ``.lock`` for the run's life; the
  operating system releases it when the process ends, however it ends. A second writer gets a
  clear error. (``flock`` works on local file systems and, on Linux, on NFS v4; on a file system
  without locks the lock is not enforced.)
* **Never half-written.** Every file is written to a temporary ``.<name>.muonclip-tmp-<token>``
  beside it (created exclusively: never an existing file or link), flushed to disk and renamed
  onto its name (`muonclip.app.safe_files.write_atomically`), so a kill at any moment leaves the
  old file or the new one.
* **Only what muonclip wrote is deleted.** ``<token>`` is the writer's random 128-bit token
  (`muonclip.app.safe_files.new_token`), which `RunLock.stamp` records in ``.lock``; a temporary counts as the run's
  (`is_own_entry`) only when its token is recorded there, so a user's ``.notes.tmp-2024`` or
  ``.checkpoint-step5.dcp.tmp/`` makes the folder foreign instead of being removed. The next
  writer removes, under the lock, the recorded temporaries and the checkpoints that a kill left
  behind (`remove_leftovers`), and nothing else.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .safe_files import TEMPORARY_NAME, OutputError, file_kind, not_plain, open_file, read_bytes, read_json, write_json

CONFIG = "config.json"
POINTER = "checkpoint.json"
LOCK = ".lock"
METRICS = ("metrics.jsonl", "metrics.csv")
CHECKPOINT_NAME = re.compile(r"checkpoint-step\d+(-\d+)?\.(pt|dcp)")
TENSORBOARD_EVENTS = re.compile(r"events\.out\.tfevents\..+")
LOCK_RECORD = 16
"""Tokens of earlier writers kept in ``.lock`` (each writer removes what the ones before it left)."""


def recorded_tokens(folder: str | Path) -> set[str]:
    """The writer tokens ``folder/.lock`` records (`RunLock.stamp`): whose temporaries are the
    run's. Empty without a lock file.

    Raises:
        OutputError: ``.lock`` is a link or a special file.
    """
    try:
        text = read_bytes(folder, LOCK, 1 << 16).decode("utf-8", "replace")
    except FileNotFoundError:
        return set()
    except OSError:
        return set()
    return set(re.findall(r"\b[0-9a-f]{32}\b", text))


def is_own_entry(name: str, tokens: Iterable[str] = (), tensorboard: Iterable[str] = ()) -> bool:
    """True for the names a run folder may hold (module docstring): its files, checkpoints,
    temporaries whose token is among ``tokens`` (`recorded_tokens`), and the TensorBoard entries
    ``tensorboard`` names (``"."``: event files in the folder itself)."""
    if name in (CONFIG, POINTER, LOCK, *METRICS) or CHECKPOINT_NAME.fullmatch(name):
        return True
    tb = set(tensorboard)
    if name in tb or ("." in tb and TENSORBOARD_EVENTS.fullmatch(name)):
        return True
    m = TEMPORARY_NAME.fullmatch(name)
    return m is not None and m["token"] in set(tokens)


@dataclass(frozen=True)
class FolderState:
    """What an ``--out`` holds (`inspect_folder`).

    Attributes:
        kind: ``"absent"``, ``"empty"`` (nothing, or only what a run leaves before its first
            write: the lock and its temporaries), ``"run"`` (a run folder: its config or its
            checkpoint, and nothing that is not ours) or ``"foreign"`` (anything else).
        foreign: entries that are not a run folder's (for ``"foreign"``).
        has_checkpoint: the folder holds ``checkpoint.json``.
        has_config: the folder holds ``config.json``.
    """

    kind: str
    foreign: tuple[str, ...] = ()
    has_checkpoint: bool = False
    has_config: bool = False


def inspect_folder(folder: str | Path, allowed: Iterable[str] = ()) -> FolderState:
    """Sort ``folder`` (`FolderState`); ``allowed`` names TensorBoard entries the run writes into
    it (`is_own_entry`), besides those its ``config.json`` records.

    Entries that are not a run folder's make it foreign whatever they are; the run folder's own
    entries (and everything inside its own folders) must be plain: files where files belong,
    folders where folders do.

    Raises:
        OutputError: ``folder`` (or a parent) is a file, or it cannot be listed; one of its own
            entries is a symbolic link, a special file, or a folder where a file belongs (or
            the reverse), naming it.
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
        with os.scandir(folder) as it:
            entries = {e.name: e for e in it}
    except OSError as e:
        raise OutputError(f"--out {folder}: cannot list it ({e.strerror or e}); choose another --out") from None
    names = sorted(entries)
    tokens = recorded_tokens(folder) if LOCK in entries else set()
    own_config = CONFIG in entries and _is_run_config(folder)
    tensorboard = {*allowed, *(_recorded_tensorboard(folder) if own_config else ())}
    foreign = tuple(n for n in names if not is_own_entry(n, tokens, tensorboard) or (n == CONFIG and not own_config))
    if foreign:
        return FolderState("foreign", foreign)
    for name in names:
        _check_plain(folder, name, entries[name], tensorboard)
    if CONFIG in names or POINTER in names or any(CHECKPOINT_NAME.fullmatch(n) for n in names) \
            or any(n in METRICS for n in names):
        return FolderState("run", has_checkpoint=POINTER in names, has_config=CONFIG in names)
    return FolderState("empty")


def _check_plain(folder: Path, name: str, entry: os.DirEntry, tensorboard: set[str]) -> None:
    """Raise `OutputError` unless the run folder's own ``entry`` is what its name says: a folder
    (a sharded checkpoint, its temporary, a TensorBoard folder) holding only plain files and
    folders, or a regular file."""
    mode = entry.stat(follow_symlinks=False).st_mode
    temporary = TEMPORARY_NAME.fullmatch(name)
    is_dir = name in tensorboard or (temporary["name"] if temporary else name).endswith(".dcp")
    if stat.S_ISLNK(mode) or not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
        raise not_plain(folder, name, file_kind(mode))
    if is_dir != stat.S_ISDIR(mode):
        raise not_plain(folder, name, "a file, where a folder belongs" if is_dir else "a folder, where a file belongs")
    if is_dir:
        for root, dirs, files in os.walk(folder / name, followlinks=False):
            for sub in (*dirs, *files):
                m = os.lstat(os.path.join(root, sub)).st_mode
                if not (stat.S_ISDIR(m) or stat.S_ISREG(m)):
                    raise not_plain(folder, os.path.relpath(os.path.join(root, sub), folder), file_kind(m))


def _is_run_config(folder: Path) -> bool:
    """True when ``folder/config.json`` is a run's: a JSON object naming an optimizer.

    Raises:
        OutputError: it is a link or a special file.
    """
    try:
        data = read_json(folder, CONFIG)
    except (OSError, ValueError):  # OutputError (a link, a FIFO) is not an OSError: it goes up
        return False
    return isinstance(data, dict) and "optimizer" in data


def _recorded_tensorboard(folder: Path) -> list[str]:
    """The TensorBoard entries ``folder/config.json`` records (``run.tensorboard``), if well formed."""
    try:
        run = read_json(folder, CONFIG).get("run")
    except (OSError, ValueError, AttributeError):
        return []
    entries = run.get("tensorboard") if isinstance(run, dict) else None
    if not isinstance(entries, list):
        return []
    return [e for e in entries if isinstance(e, str) and (e == "." or (Path(e).name == e and e not in ("", "..")))]


def enclosing_run(path: str | Path) -> Path | None:
    """The muonclip run folder that ``path`` is or lies in, or None: the nearest of ``path`` and its
    parents, taken by their real path (links resolved, as a writer there would follow them), whose
    ``config.json`` or ``checkpoint.json`` is a run's (a JSON object naming an optimizer and the
    run's identity, ``run``; read by `muonclip.app.safe_files.read_json`: no link followed)."""
    real = Path(os.path.realpath(path))
    for folder in (real, *real.parents):
        for name in (CONFIG, POINTER):
            try:
                data = read_json(folder, name) if os.path.lexists(folder / name) else None
            except (OSError, ValueError, OutputError):  # unreadable, not JSON, a link: not a run's
                continue
            if isinstance(data, dict) and "optimizer" in data and isinstance(data.get("run"), dict):
                return folder
    return None


def check_outside_runs(folder: str | Path) -> None:
    """Raise `OutputError` when ``folder`` (an ``--out`` to create) lies inside a run's folder
    (`enclosing_run` of its parent), which holds one run and nothing else: a folder added to it
    would stop that run from being continued."""
    outer = enclosing_run(Path(os.path.realpath(folder)).parent)
    if outer is not None:
        raise OutputError(f"--out {folder} lies inside {outer}, the folder of another muonclip run, which holds "
                          "one run and nothing else (a folder added to it would stop it from being continued); "
                          "choose an --out outside it")


def check_new_run_folder(folder: str | Path, allowed: Iterable[str] = ()) -> FolderState:
    """Raise `OutputError` unless a new run may start in ``folder``: absent, or empty, and writable,
    and not inside another run's folder (which holds one run and nothing else: that run could no
    longer be continued)."""
    folder = Path(folder)
    check_outside_runs(folder)
    state = inspect_folder(folder, allowed)
    if state.kind == "run":
        if state.has_checkpoint:
            raise OutputError(f"--out {folder} already holds a run; continue it with --resume or choose another --out")
        raise OutputError(f"--out {folder} holds a run without a checkpoint ({POINTER}), and a new run will not "
                          "overwrite it: continue it with --resume (a run that stopped before its first checkpoint "
                          "restarts from its start), or choose another --out")
    if state.kind == "foreign":
        raise OutputError(_foreign(folder, state.foreign))
    check_writable(folder)
    return state


def check_run_folder(folder: str | Path, allowed: Iterable[str] = ()) -> FolderState:
    """Raise `OutputError` unless ``folder`` holds a run that may be continued: a run folder (and
    nothing else), writable, with its checkpoint or, for a run that stopped before its first one,
    its ``config.json`` (whether such a run may restart is `muonclip.app.resume.check_restart`'s
    to say)."""
    folder = Path(folder)
    state = inspect_folder(folder, allowed)
    if state.kind in ("absent", "empty"):
        raise OutputError(f"--out {folder} holds no run to continue (no {POINTER}); start one without --resume")
    if state.kind == "foreign":
        raise OutputError(_foreign(folder, state.foreign))
    if not state.has_checkpoint and not state.has_config:
        raise OutputError(f"--out {folder} holds a run whose checkpoint ({POINTER}) and config ({CONFIG}) are "
                          "missing; it cannot be continued: start a new run in another --out")
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

    ``.lock`` is the one file of the folder written in place (every other is replaced by a
    rename): it is opened without following a symbolic link (`muonclip.app.safe_files.open_file`)
    and refused when it has another name (a hard link, which could be a file outside the folder),
    before a byte is written.

    Raises:
        OutputError: another process holds the lock (a run is writing there), ``.lock`` is a
            symbolic or hard link or not a regular file, or the folder cannot be created.
    """

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.token = ""
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = open_file(self.folder, LOCK, os.O_RDWR | os.O_CREAT)
        except OSError as e:
            raise OutputError(f"--out {self.folder}: cannot create it ({e.strerror or e}); choose another --out") \
                from None
        links = os.fstat(fd).st_nlink
        if links > 1:  # a hard link: stamping it would write into a file outside the folder
            os.close(fd)
            raise OutputError(f"--out {self.folder}: {LOCK} is a hard link ({links} names share its file, which may "
                              f"lie outside the folder), and muonclip writes no file that it shares; remove "
                              f"{self.folder / LOCK} (the file's other names keep its contents) or choose another "
                              "--out")
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
        """Write this process's id and host and ``token`` (`muonclip.app.safe_files.new_token`) into
        the lock file, for a second writer's message and for the other ranks' shared-folder check, and add ``token`` to
        the record of the folder's writers (the last `LOCK_RECORD`), whose temporaries are the run's."""
        if self.fd is None:
            return
        self.token = token
        text = os.pread(self.fd, 1 << 16, 0).decode("utf-8", "replace")
        line = next((x for x in text.splitlines() if x.startswith("writers ")), text)  # oldest first
        earlier = re.findall(r"\b[0-9a-f]{32}\b", line)
        record = [t for t in dict.fromkeys(earlier) if t != token][-(LOCK_RECORD - 1):]
        text = f"{os.getpid()} {os.uname().nodename} {token}\nwriters {' '.join([*record, token])}\n".encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, text, 0)
        os.fsync(self.fd)

    def release(self) -> None:
        """Release the lock (the ``.lock`` file stays: removing it would let two writers lock two files)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_lock_token(folder: str | Path) -> str:
    """The token `RunLock.stamp` wrote into ``folder/.lock`` last ("" when none can be read)."""
    try:
        parts = read_bytes(folder, LOCK, 1 << 16).decode("utf-8", "replace").split()
    except (OSError, OutputError):
        return ""
    return parts[2] if len(parts) >= 3 else ""


def remove_leftovers(folder: str | Path, keep: str | None) -> list[str]:
    """Remove what a killed writer left in ``folder``: temporaries whose token ``.lock`` records
    (`recorded_tokens`) and any checkpoint file or folder other than ``keep`` (the one
    ``checkpoint.json`` names); nothing else. Call under the lock. Returns the names."""
    folder = Path(folder)
    tokens = recorded_tokens(folder)
    removed = []
    for p in sorted(folder.iterdir()):
        temporary = TEMPORARY_NAME.fullmatch(p.name)
        if (temporary and temporary["token"] in tokens) or (CHECKPOINT_NAME.fullmatch(p.name) and p.name != keep):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(p.name)
    return removed


def read_config(folder: str | Path) -> dict[str, Any] | None:
    """The dict of ``folder/config.json`` (read by `muonclip.app.safe_files.read_json`: no link
    followed), or None when it is absent. Its fields are checked by `muonclip.app.checkpoints.read_run_config`.

    Raises:
        OutputError: it is not a JSON object, or not a plain file.
    """
    try:
        data = read_json(folder, CONFIG)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise OutputError(f"{Path(folder) / CONFIG} cannot be read ({type(e).__name__}: {e}); the run folder is "
                          "damaged") from None
    if not isinstance(data, dict):
        raise OutputError(f"{Path(folder) / CONFIG} is not a run's config (a JSON object); the run folder is damaged")
    return data


def write_config(folder: str | Path, optimizer: str, config: dict[str, Any], run: dict[str, Any],
                 token: str | None = None) -> Path:
    """Write ``folder/config.json`` atomically: ``{"optimizer": ..., <config fields>, "run": run}``
    (``run``: the run's identity and history, `muonclip.app.run_state.RunIdentity`; ``token``:
    the writer's, `muonclip.app.safe_files.write_atomically`)."""
    return write_json(Path(folder) / CONFIG, {"optimizer": optimizer, **config, "run": run}, token=token)
