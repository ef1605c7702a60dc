"""The step's working set bounded: buckets orthogonalised in chunks of at most
`STEP_CHUNK_BYTES` (`muonclip.optim._buckets.chunk_plan`), with the same update as the whole
bucket.

The bound is checked exactly, on every tensor the step asks its workspace for and every call it
makes (a recording workspace). A chunk batches the products over fewer matrices than the whole
bucket, and a batched product over k matrices need not round as one over N does, so the
updates are compared at round-off tolerance.
"""

from __future__ import annotations

import pytest
import torch

import muonclip
from muonclip.fast import BufferedWorkspace
from muonclip.optim import _buckets as buckets
from muonclip.optim._buckets import CALL_TENSORS, Chunk, chunk_plan, matrix_bytes
from muonclip.optim.workspace import CoreWorkspace

SHAPE = (16, 24)  # every matrix of the test model, so that all share one bucket


class Recording:
    """A workspace that records the shape of every bucket it hands out and orthogonalises."""

    def __init__(self, inner) -> None:
        self.inner, self.inputs, self.calls = inner, [], []

    def empty(self, role, shape, dtype, device):
        self.inputs.append((role, tuple(shape), dtype))
        return self.inner.empty(role, shape, dtype, device)

    def orthogonalize(self, V, method, steps=None, dtype=None, **kw):
        self.calls.append(tuple(V.shape))
        return self.inner.orthogonalize(V, method, steps, dtype, **kw)


def _params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "plain": torch.randn(16, 24, generator=g),  # one matrix
        "experts": torch.randn(7, 16, 24, generator=g),  # a stack: cut between experts
        "experts_t": torch.randn(5, 24, 16, generator=g),  # a transposed stack, stored (E, B, A)
        "fused": torch.randn(32, 24, generator=g),  # two blocks of 16 rows
        "fused_experts": torch.randn(3, 32, 24, generator=g),  # a stack of two blocks: never cut
    }


KEYS = {"experts_t": {"transposed": True}, "fused": {"split_sizes": [16, 16]},
        "fused_experts": {"split_sizes": [16, 16]}}


def _run(workspace, steps: int = 3, **kw):
    params = {n: torch.nn.Parameter(t.clone()) for n, t in _params().items()}
    groups = [{"params": [p], "param_names": [n], **KEYS.get(n, {})} for n, p in params.items()]
    opt = muonclip.Muon(groups, lr=0.05, weight_decay=0.1, orth_dtype=torch.float32, workspace=workspace, **kw)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params.values():
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return params, opt


def test_chunk_plan_covers_each_slot_once_within_the_limit():
    """Every matrix of every slot in exactly one chunk, in order; chunks near-equal and at most
    the limit; a slot that may not be cut is whole, alone when larger than the limit; no limit
    (or a bucket that fits): one chunk."""
    batches, splittable = [1, 7, 5, 1, 6, 1], [False, True, True, False, False, False]
    for limit in range(1, 22):
        chunks = chunk_plan(batches, limit, splittable)
        covered = [(j, e) for c in chunks for j, lo, hi in c.parts for e in range(lo, hi)]
        assert covered == [(j, e) for j, n in enumerate(batches) for e in range(n)]
        for c in chunks:
            assert c.size == sum(hi - lo for _, lo, hi in c.parts)
            assert c.size <= limit or (len(c.parts) == 1 and not splittable[c.parts[0][0]])
        for j, lo, hi in (p for c in chunks for p in c.parts):
            assert splittable[j] or (lo, hi) == (0, batches[j])
    assert [c.size for c in chunk_plan([1] * 24, 7)] == [6, 6, 6, 6]
    assert chunk_plan(batches, None) == chunk_plan(batches, 21) == [Chunk(((0, 0, 1), (1, 0, 7), (2, 0, 5),
                                                                            (3, 0, 1), (4, 0, 6), (5, 0, 1)), 21)]


@pytest.mark.parametrize("options", [{}, {"normuon": True, "cautious_weight_decay": True}, {"momentum_8bit": True}],
                         ids=["muon", "normuon-cautious", "8bit"])
@pytest.mark.parametrize("inner", [CoreWorkspace, BufferedWorkspace], ids=["core", "buffered"])
def test_chunked_step_stays_under_the_bound_and_equals_the_whole_bucket(monkeypatch, options, inner):
    """With the CPU bound set to 4 matrices' worth, every bucket input the step asks for and every
    orthogonalisation call holds at most 4 matrices, except the fused stack's blocks (3 matrices
    each, never cut); the stacks are cut between experts; after three steps the weights equal
    those of the whole-bucket step (bound removed) at round-off tolerance."""
    bound = 4 * CALL_TENSORS * matrix_bytes(*SHAPE, torch.float32)
    monkeypatch.setitem(buckets.STEP_CHUNK_BYTES, "cpu", bound)
    capped = Recording(inner())
    got, _ = _run(capped, **options)
    monkeypatch.delitem(buckets.STEP_CHUNK_BYTES, "cpu")
    whole = Recording(inner())
    want, _ = _run(whole, **options)

    n = sum(t.shape[0] if t.ndim == 3 else 1 for t in _params().values()) + 1 + 3  # fused: 2 blocks each
    assert whole.calls == [(n, *SHAPE)] * 3  # uncapped: one call a step, the whole bucket
    assert capped.calls and len(capped.calls) > 3
    assert sum(c[0] for c in capped.calls) == 3 * n
    for role, shape, dtype in capped.inputs:
        assert role == "input" and shape[1:] == SHAPE and dtype == torch.float32
        assert shape[0] * CALL_TENSORS * matrix_bytes(*SHAPE, dtype) <= bound or shape[0] == 3  # a fused block
    assert max(c[0] for c in capped.calls) <= 4
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-6, msg=name)


def test_cpu_bound_and_chunk_sizes_of_the_benchmark_model():
    """The bound's worked figures (its docstring): 16 MiB on CPU holds 14 of 384 x 384 in
    bfloat16, 4 of 512 x 512 in float32 and one 2048 x 512 in float32; other device types take
    the bucket whole."""
    assert buckets.STEP_CHUNK_BYTES == {"cpu": 16 * 2**20}
    cpu = torch.device("cpu")
    assert buckets.chunk_limit(384, 384, torch.bfloat16, cpu) == 14
    assert buckets.chunk_limit(512, 512, torch.float32, cpu) == 4
    assert buckets.chunk_limit(512, 2048, torch.float32, cpu) == 1
    assert buckets.chunk_limit(512, 512, torch.float32, torch.device("meta")) is None


class Measured(BufferedWorkspace):
    """The buffered workspace, recording what its buffers hold when each step ends."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[tuple[int, set[str]]] = []

    def release(self) -> None:
        self.held.append((self.buffers.nbytes(), self.buffers.roles()))
        super().release()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("wide_first", [False, True], ids=["square-first", "wide-first"])
def test_kept_buffers_stay_under_the_bound_however_bucket_shapes_mix(monkeypatch, dtype, wide_first):
    """A square bucket and a wide one in a step: the buffers kept for V, the result, S and P (each
    grown to its largest call) hold at most the bound together when the step ends, and are freed
    then. The bound is 6 square matrices' worth: the square bucket runs 6 at a time, the wide one
    (four times a square's V, the same S) one at a time; with chunks sized on one call's sum
    (two wide V beside six square S and P) the buffers would hold 7 of 6 square matrices' worth."""
    monkeypatch.setattr(BufferedWorkspace.__module__ + ".KEEP_BYTES", 0)
    bound = 6 * CALL_TENSORS * matrix_bytes(16, 16, dtype)
    monkeypatch.setitem(buckets.STEP_CHUNK_BYTES, "cpu", bound)
    g = torch.Generator().manual_seed(0)
    shapes = [(16, 16)] * 12 + [(16, 64)] * 3
    params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in (shapes[::-1] if wide_first else shapes)]
    workspace = Measured()
    opt = muonclip.Muon(params, lr=0.02, orth_dtype=dtype, workspace=workspace)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
        assert len(workspace.buffers) == 0  # freed when the step ended
    assert [roles for _, roles in workspace.held] == [{"input", "result", "ns.S", "ns.P"}] * 2
    assert [held for held, _ in workspace.held] == [bound] * 2
