"""The files of a run folder, read and written safely: no link followed, nothing but regular files
read, every write atomic (`muonclip.app.runfolder` has the rules; this module, the means).

* `open_file` opens a path inside a folder without following a symbolic link at any step
  (``O_NOFOLLOW`` through the folder's own descriptors) and refuses anything but a regular file
  before a byte is read (`read_bytes`, `read_json`, `file_digest` read through it);
* `write_atomically` writes a file to a temporary beside it (`temporary_name`, carrying the
  writer's token, `new_token`; created exclusively), flushes it and renames it onto its name, so
  a kill at any moment leaves the old file or the new one (`write_json`);
* `OutputError`: the output folder cannot be used, with what to do.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

TEMPORARY_NAME = re.compile(r"\.(?P<name>.+)\.muonclip-tmp-(?P<token>[0-9a-f]{32})")
JSON_LIMIT = 64 * 2**20
"""The largest ``config.json`` or ``checkpoint.json`` read (a run's are a few KiB to a few MiB)."""


class OutputError(RuntimeError):
    """The output folder cannot be used (unwritable, in use, or holding something else than a run
    that may be continued); the message says why and what to do."""


def new_token() -> str:
    """A writer's token: 32 random hex digits (uuid4), in its temporaries' names and in ``.lock``."""
    return uuid.uuid4().hex


def temporary_name(name: str, token: str) -> str:
    """The temporary of ``name`` written by the writer of ``token`` (`TEMPORARY_NAME`)."""
    return f".{name}.muonclip-tmp-{token}"


def fsync_dir(folder: Path) -> None:
    """Flush ``folder``'s entries (renames into it) to disk, where the platform allows it."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def file_kind(mode: int) -> str:
    """What a file of ``mode`` (``st_mode``) is, in words ("a symbolic link", "a FIFO (named pipe)", ...)."""
    return {stat.S_IFLNK: "a symbolic link", stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFCHR: "a character device",
            stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket", stat.S_IFDIR: "a folder"}.get(
        stat.S_IFMT(mode), "not a regular file")


def not_plain(folder: Path, rel: str, what: str) -> OutputError:
    """The error for ``folder/rel``, which is ``what`` (`file_kind`) instead of a plain file or folder."""
    return OutputError(f"--out {folder}: {rel} is {what}; a run folder holds plain files and folders only, and "
                       "muonclip neither follows a link out of it nor reads anything else (remove it, or choose "
                       "another --out)")


def open_file(folder: str | Path, rel: str, flags: int = os.O_RDONLY, mode: int = 0o644) -> int:
    """Open ``folder/rel`` (``rel``: a path inside the folder, ``/``-separated) and return its
    descriptor, following no symbolic link on the way (each folder of ``rel`` and the file itself
    are opened with ``O_NOFOLLOW``, relative to the one before) and refusing anything but a
    regular file (checked on the open descriptor, opened non-blocking so a FIFO cannot hang).

    Raises:
        OutputError: a component of ``rel`` is a link, or the file is not a regular file.
        OSError: anything else (absent, permissions, ...).
    """
    folder = Path(folder)
    parts = rel.split("/")
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # --out itself: the user's path
    try:
        for i, part in enumerate(parts[:-1]):
            try:
                nfd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dfd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise not_plain(folder, "/".join(parts[: i + 1]), file_kind(os.lstat(part, dir_fd=dfd).st_mode)) \
                        from None
                raise
            os.close(dfd)
            dfd = nfd
        try:
            fd = os.open(parts[-1], flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise not_plain(folder, rel, "a symbolic link") from None
            if e.errno == errno.ENXIO:  # a FIFO opened for writing without a reader, a socket
                raise not_plain(folder, rel, file_kind(os.lstat(parts[-1], dir_fd=dfd).st_mode)) from None
            raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise not_plain(folder, rel, file_kind(st.st_mode))
    os.set_blocking(fd, True)
    return fd


def read_bytes(folder: str | Path, rel: str, limit: int | None = None) -> bytes:
    """The bytes of ``folder/rel``, opened by `open_file`; ``limit``: refuse a larger file
    (`OutputError`) before reading it."""
    fd = open_file(folder, rel)
    with os.fdopen(fd, "rb") as f:
        if limit is not None and os.fstat(fd).st_size > limit:
            raise OutputError(f"--out {folder}: {rel} holds {os.fstat(fd).st_size} bytes, more than a run's {rel} "
                              f"can ({limit}); the run folder is damaged")
        return f.read()


def read_json(folder: str | Path, rel: str) -> Any:
    """``folder/rel`` parsed as JSON (`read_bytes`, at most `JSON_LIMIT` bytes).

    Raises:
        OutputError: a link, a special file, a file too large.
        OSError, ValueError: unreadable, not UTF-8 JSON.
    """
    return json.loads(read_bytes(folder, rel, JSON_LIMIT).decode("utf-8"))


def write_atomically(path: str | Path, write: Callable[[IO[Any]], object], text: bool = False,
                     token: str | None = None) -> Path:
    """``write(f)`` into ``.<name>.muonclip-tmp-<token>`` beside ``path``, fsync, then ``os.replace``
    onto ``path`` (which replaces a link there, never writes through it).

    The temporary is created exclusively (``O_EXCL``, no link followed). On any failure (Ctrl-C,
    a full disk) it is removed and ``path`` is untouched; a kill leaves it, for the next writer to
    remove when ``token`` is recorded in the folder's lock (`remove_leftovers`).

    Args:
        path: the file to (re)place.
        write: called once with the open temporary file.
        text: open it in text mode, UTF-8 (default False: binary).
        token: the writer's token (default None: a fresh one, which no lock records).
    """
    path = Path(path)
    tmp = path.with_name(temporary_name(path.name, token or new_token()))
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        with os.fdopen(fd, "w" if text else "wb", **({"encoding": "utf-8"} if text else {})) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_json(path: str | Path, obj: Any, token: str | None = None) -> Path:
    """`write_atomically` of ``obj`` as indented JSON (no NaN or infinity: they are not JSON)."""
    return write_atomically(path, lambda f: json.dump(obj, f, indent=1, allow_nan=False), text=True, token=token)


def file_digest(folder: str | Path, rel: str) -> dict[str, Any]:
    """``{"bytes": size, "sha256": hex digest}`` of ``folder/rel`` (opened by `open_file`, read in
    1 MiB blocks)."""
    h = hashlib.sha256()
    size = 0
    with os.fdopen(open_file(folder, rel), "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}
