"""Buffers kept between calls for the temporaries of a step that runs every step, on CPU.

glibc returns a freed multi-MB block to the OS when it lies at the top of the heap, so a
computation that allocates the same large temporaries on every call faults their pages in
again on every call (the kernel zeroes each 4 KiB page). Newton–Schulz on the GPT set's
24 x 384 x 384 bucket makes 7 MB temporaries: `muonclip.Muon`'s default step took 10,304
minor page faults, and ran 7–10% slower than with them kept (benchmarks/RESULTS.md, fifth
session). A caller that runs the same shapes every step keeps a dict (the *scratch*) and
passes it down; `kept` cuts each temporary from a buffer held there for its role and dtype,
grown when too small. Tensors under `KEEP_BYTES` are allocated as usual (glibc serves them
from its heap without faults, and a lookup would cost more than it saves), and so is everything
on a GPU (its caching allocator reuses memory).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

KEEP_BYTES = 128 * 1024  # glibc's default mmap threshold: smaller blocks come from its heap


def kept(scratch: dict[Any, Tensor] | None, role: str, shape: Sequence[int], dtype: torch.dtype,
         device: torch.device, avoid: Tensor | None = None) -> Tensor | None:
    """A ``shape`` view of the scratch buffer for (``role``, ``dtype``), or None (no scratch, not
    on the CPU, or under `KEEP_BYTES`: the caller allocates as usual, e.g. by passing
    ``out=None``).

    Args:
        scratch: the caller's dict of buffers (None: none kept).
        role: what the tensor is for; tensors alive at the same time need different roles.
        shape, dtype, device: of the tensor wanted.
        avoid: a tensor the result must not share storage with (ping-pong: where ``role``'s
            buffer holds ``avoid``, the role's second buffer is used), e.g. the input of an
            update written into the same role every step.

    Returns:
        A contiguous view of the first ``prod(shape)`` elements of the buffer (its contents
        are left over from earlier use), or None.
    """
    if scratch is None or device.type != "cpu":
        return None
    n = math.prod(shape)
    if n * dtype.itemsize < KEEP_BYTES:
        return None
    buf = _grown(scratch, (role, dtype), n, dtype, device)
    if avoid is not None and buf.untyped_storage().data_ptr() == avoid.untyped_storage().data_ptr():
        buf = _grown(scratch, (role + "'", dtype), n, dtype, device)
    return buf[:n].view(*shape)


def _grown(scratch: dict[Any, Tensor], key: tuple[str, torch.dtype], n: int, dtype: torch.dtype,
           device: torch.device) -> Tensor:
    buf = scratch.get(key)
    if buf is None or buf.numel() < n:
        buf = scratch[key] = torch.empty(n, dtype=dtype, device=device)
    return buf
