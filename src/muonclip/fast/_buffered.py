"""`BufferedWorkspace`: Muon's buckets orthogonalised into buffers reused through a step (CPU).

A workspace (`muonclip.optim.workspace.Workspace`) decides where a Muon step's bucket of same-shape
matrices lives and how it is orthogonalised. The core's (`CoreWorkspace`) allocates every tensor
afresh and calls the pure `muonclip.orthogonalize`. On a CPU, fresh multi-MB tensors are
page-faulted in again on every step (glibc hands large freed blocks back to the OS), so this
workspace, for the methods whose iteration takes storage (`muonclip.ortho.Method.in_place`:
``"ns5"``, ``"polar_express"``, ``"gram"``) on CPU tensors:

* keeps the bucket's input and result, and the iteration's temporaries (S, P; Gram's R, Z,
  Q), in `Buffers` held by the workspace object, reused by every bucket and chunk of a step
  and freed when the step ends (`release`, called by `muonclip.Muon`), so that between steps
  Muon holds its state and nothing else (scratch, not state: a copy of the optimizer starts
  without them);
* has the method normalise the bucket in place and alternate the quintic's steps between it
  and the result (`muonclip.ortho._newton_schulz.quintic`'s ``out``), so a call touches two
  matrix-sized buffers besides S and P instead of a new one per step;
* optionally runs the batch in chunks of matrices (``chunk``: `chunk_size`; off by default).

It runs the core's own iteration (`muonclip.ortho._newton_schulz.quintic`,
`muonclip.ortho._gram.gram_iteration`) with its storage: without chunking it makes exactly the
core's products on the same values, so its result equals the core's bit for bit; only where
the tensors live differs. Other methods, other devices and inputs that require grad go to the
core `muonclip.orthogonalize` unchanged.

**Kept buffers** (`Buffers`). glibc returns a freed multi-MB block to the OS when it lies at the
top of the heap, so a computation that allocates the same large temporaries on every call
faults their pages in again on every call (the kernel zeroes each 4 KiB page). `Buffers.get`
cuts each temporary from a buffer kept for its role and dtype, grown when too small, so the
calls of one step (one per chunk of each bucket) share one set of pages. Tensors under
`KEEP_BYTES` are allocated as usual (glibc serves them from its heap without faults, and a
lookup would cost more than it saves), and so is everything off the CPU (a GPU's caching
allocator already reuses memory). The step bounds what each role's buffer grows to
(`muonclip.optim._buckets.STEP_CHUNK_BYTES`: each of V, the result, S and P at most a quarter
of it), and `release` frees them when the step ends: kept across steps they would sit under
every forward and backward pass, beside the activations, and raise the training's peak by
their size.

**Chunks** (`chunk_size`). A GPU takes the whole batch at once. On a CPU without matrix units
a batch whose working set is far past the L2 caches can run faster in cache-sized chunks; on a
CPU with matrix units (AMX), or when the batch fits in cache, the whole batch is as fast or
faster. Which is the case depends on the machine, so chunking is off by default and chosen by
a rule, never by timing trials (the first optimizer step costs what a later one does):

* ``None`` (default): the whole batch.
* an int ``k``: ``k`` matrices at a time.
* ``"cache"``: the most matrices whose working set (X, the new X, S and P: `working_set`) fits
  in `CPU_CHUNK_BYTES`, rounded down to a multiple of the thread count (an odd chunk leaves a
  thread idle), and the whole batch when it fits anyway.

A chunked run makes the same products on each chunk as one call makes on the batch, but a
batched matrix product over k matrices need not round as one over N does, so the result can
differ from the whole batch's in the last bits (the tests compare at round-off tolerance).

`muonclip.Muon` uses it by default for CPU parameters (``workspace="auto"``): docs/benchmarks.md
gives the measured difference on the benchmark GPT set.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ..common import defaults as D
from ..ortho import check_input, check_method, resolve_orth_dtype, run_method

KEEP_BYTES = 128 * 1024  # glibc's default mmap threshold: smaller blocks come from its heap

# Working-set budget of the "cache" rule: the L2 caches of a 2-core AMD EPYC test machine.
CPU_CHUNK_BYTES = 4 * 2**20
RULES = ("cache",)


class Buffers:
    """Named CPU buffers reused from call to call; scratch, never state (a copy starts empty)."""

    def __init__(self) -> None:
        self._store: dict[tuple[str, torch.dtype], Tensor] = {}

    def __len__(self) -> int:
        return len(self._store)

    def roles(self) -> set[str]:
        """The roles that hold a buffer."""
        return {role for role, _ in self._store}

    def nbytes(self) -> int:
        """The bytes the buffers hold."""
        return sum(v.nbytes for v in self._store.values())

    def clear(self) -> None:
        """Free every buffer (the next `get` allocates afresh)."""
        self._store.clear()

    def get(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device,
            avoid: Tensor | None = None) -> Tensor | None:
        """A ``shape`` view of the buffer kept for (``role``, ``dtype``), or None (not on the CPU,
        or under `KEEP_BYTES`: the caller allocates as usual, e.g. by passing ``out=None``). A
        `muonclip.ortho._newton_schulz.Scratch`.

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


def working_set(m: int, n: int, dtype: torch.dtype) -> int:
    """Bytes one m x n matrix (m <= n) occupies in a quintic step: X, the new X, S and P."""
    return (2 * m * n + 2 * m * m) * dtype.itemsize


def check_chunk(chunk: int | str | None) -> None:
    """Raise ValueError unless ``chunk`` is None, an int >= 1 or a rule name."""
    if chunk is None or chunk in RULES:
        return
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be None (the whole batch), an int >= 1 or one of {RULES}, got {chunk!r}")


def chunk_size(chunk: int | str | None, batch: int, p: int, q: int, dtype: torch.dtype, device: torch.device,
               threads: int | None = None) -> int:
    """Matrices per Newton–Schulz run for a batch of ``batch`` p x q matrices (module docstring,
    "Chunks"). The whole batch off the CPU, for one matrix and while compiling, whatever
    ``chunk`` says. ``threads`` defaults to ``torch.get_num_threads()``.
    """
    if chunk is None or device.type != "cpu" or batch == 1 or torch.compiler.is_compiling():
        return batch
    if chunk != "cache":
        return max(1, min(batch, int(chunk)))
    per = working_set(min(p, q), max(p, q), dtype)
    if batch * per <= CPU_CHUNK_BYTES:
        return batch
    threads = max(1, threads or torch.get_num_threads())
    fit = CPU_CHUNK_BYTES // per
    return min(batch, max(threads, fit - fit % threads))


class BufferedWorkspace:
    """Orthogonalise Muon's buckets into buffers reused through a step (see module docstring).

    Args:
        chunk: matrices per Newton–Schulz run on CPU (default None: the whole batch; an int;
            or ``"cache"``: cache-sized chunks; `chunk_size`).

    Attributes:
        buffers: the kept `Buffers`.
    """

    name = "buffered"

    def __init__(self, chunk: int | str | None = None) -> None:
        check_chunk(chunk)
        self.chunk = chunk
        self.buffers = Buffers()

    def empty(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A tensor for ``role`` (e.g. a bucket's input), cut from a kept buffer on CPU."""
        return self.buffers.empty(role, shape, dtype, device)

    def orthogonalize(self, V: Tensor, method: str, steps: int | None = D.NS_STEPS,
                      dtype: torch.dtype | str | None = D.ORTH_DTYPE, *, eps: float = D.EPS,
                      coefficients: Sequence[float] | None = D.NS_COEFFICIENTS,
                      reuse_result: bool = False) -> Tensor:
        """`muonclip.orthogonalize` of the batch ``V``, which this call may overwrite.

        ``reuse_result``: the result may live in a kept buffer that the next call overwrites
        (default False: a new tensor), for a caller that uses it before calling again.
        """
        m = check_method(method, steps, dtype, coefficients)
        check_input(V, eps)
        if (not m.in_place or V.device.type != "cpu" or V.numel() == 0
                or (torch.is_grad_enabled() and V.requires_grad)):
            return run_method(V, method, steps, dtype, eps=eps, coefficients=coefficients)
        steps = m.default_steps if steps is None else steps
        dtype = resolve_orth_dtype(dtype, method, V.device)
        *_, A, B = V.shape
        X = V.reshape(-1, A, B).to(dtype)  # V itself when it is in dtype: ours to overwrite
        out = self.buffers.get("result", X.shape, dtype, X.device) if reuse_result else None
        if out is None:
            out = torch.empty_like(X)
        N = X.shape[0]
        k = chunk_size(self.chunk, N, A, B, dtype, X.device)
        for i in range(0, N, k):  # each chunk normalised (in place) just before its steps, still in cache
            m.run(X[i : i + k], steps, dtype, eps, coefficients, out=out[i : i + k], scratch=self.buffers.get)
        return out.view(V.shape).to(V.dtype)

    def release(self) -> None:
        """Free the kept buffers: the step that used them is over (`muonclip.Muon` calls it)."""
        self.buffers.clear()

    def __repr__(self) -> str:
        return f"BufferedWorkspace(chunk={self.chunk!r})"
