"""What the tests read of the core's internals, and a reference layout they compare with:
helpers the library itself does not use."""

from __future__ import annotations


def latest_structure(opt):
    """The step structure `muonclip.Muon` used last (`muonclip.optim._buckets.StructureCache`;
    None before any step)."""
    return next(reversed(opt._structures._kept.values()), None)


def buffer_pointers(buffers) -> dict:
    """Where each buffer of a `muonclip.fast._buffered.Buffers` has its storage, by (role, dtype):
    to check that a later call reused it."""
    return {k: v.data_ptr() for k, v in buffers._store.items()}


def shard_rows(n_rows: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(row_offset, n_local_rows)`` of ``rank``'s block when ``n_rows`` rows are split like
    ``torch.chunk``: how ``Shard(0)`` lays out a DTensor (blocks of ``ceil(n_rows / world_size)``
    rows, the last ones shorter or empty)."""
    chunk = -(-n_rows // world_size)  # ceil
    offset = min(rank * chunk, n_rows)
    return offset, min(n_rows, offset + chunk) - offset
