"""Buffers kept between calls for the temporaries of a computation that runs every step, on CPU.

glibc returns a freed multi-MB block to the OS when it lies at the top of the heap, so a
computation that allocates the same large temporaries on every call faults their pages in
again on every call (the kernel zeroes each 4 KiB page). A `Buffers` object is held by whoever
runs the same shapes every step (`muonclip.fast.buffered_backend.BufferedBackend`); `Buffers.get` cuts
each temporary from a buffer kept there for its role and dtype, grown when too small. Tensors
under `KEEP_BYTES` are allocated as usual (glibc serves them from its heap without faults, and
a lookup would cost more than it saves), and so is everything off the CPU (a GPU's caching
allocator already reuses memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

KEEP_BYTES = 128 * 1024  # glibc's default mmap threshold: smaller blocks come from its heap


class Buffers:
    """Named CPU buffers reused from call to call; scratch, never state (a copy starts empty)."""

    def __init__(self) -> None:
        self._store: dict[tuple[str, torch.dtype], Tensor] = {}

    def __len__(self) -> int:
        return len(self._store)

    def roles(self) -> set[str]:
        """The roles that hold a buffer."""
        return {role for role, _ in self._store}

    def pointers(self) -> dict[tuple[str, torch.dtype], int]:
        """Where each buffer's storage is (to check that a later step reused it)."""
        return {k: v.data_ptr() for k, v in self._store.items()}

    def get(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
            avoid: Tensor | None = None) -> Tensor | None:
        """A ``shape`` view of the buffer kept for (``role``, ``dtype``), or None (not on the CPU,
        or under `KEEP_BYTES`: the caller allocates as usual, e.g. by passing ``out=None``).

        Args:
            role: what the tensor is for; tensors alive at the same time need different roles.
            shape, dtype, device: of the tensor wanted.
            avoid: a tensor the result must not share storage with (ping-pong: where ``role``'s
                buffer holds ``avoid``, the role's second buffer is used).

        Returns:
            A contiguous view of the first ``prod(shape)`` elements of the buffer (its contents
            are left over from earlier use), or None.
        """
        if device.type != "cpu":
            return None
        n = math.prod(shape)
        if n * dtype.itemsize < KEEP_BYTES:
            return None
        buf = self._grown((role, dtype), n, dtype, device)
        if avoid is not None and buf.untyped_storage().data_ptr() == avoid.untyped_storage().data_ptr():
            buf = self._grown((role + "'", dtype), n, dtype, device)
        return buf[:n].view(*shape)

    def empty(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """`get`, or a new uninitialised tensor where nothing is kept."""
        kept = self.get(role, shape, dtype, device)
        return torch.empty(tuple(shape), dtype=dtype, device=device) if kept is None else kept

    def _grown(self, key: tuple[str, torch.dtype], n: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        buf = self._store.get(key)
        if buf is None or buf.numel() < n:
            buf = self._store[key] = torch.empty(n, dtype=dtype, device=device)
        return buf

    def __getstate__(self) -> dict:  # copy.deepcopy and pickle: scratch is not copied
        return {"_store": {}}


__all__ = ["KEEP_BYTES", "Buffers"]
