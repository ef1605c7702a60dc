"""The step's momentum bookkeeping (`muonclip.optim.functional.StepMomenta`): each weight's
momentum updated once per step, just before its V is first formed, and its float32 copy (8-bit
momentum: the dequantised M) released after the last bucket slot formed from it."""

from __future__ import annotations

import weakref

import torch

from muonclip.optim import functional as F
from muonclip.optim._buckets import step_structure
from muonclip.optim._matrices import WHOLE_MATRIX
from muonclip.optim._quantized import quant_blocks, scale_like
from muonclip.optim.workspace import CoreWorkspace

GROUP = {**WHOLE_MATRIX, "method": "ns5", "ns_steps": None, "orth_dtype": torch.float32, "eps": 1e-7,
         "ns_coefficients": None, "adjust_lr_fn": "match_rms_adamw"}
MU = 0.9


class Watching(CoreWorkspace):
    """A core workspace that notes, at each orthogonalisation, which weights' float32 momentum
    copies are still alive."""

    def __init__(self, copies: dict[int, list[weakref.ref]]) -> None:
        self.copies, self.alive = copies, []

    def orthogonalize(self, V, *args, **kwargs):
        self.alive.append(sorted(k for k, refs in self.copies.items() if any(r() is not None for r in refs)))
        return super().orthogonalize(V, *args, **kwargs)


def test_an_8bit_momentum_is_updated_once_and_its_float32_copy_freed_after_its_last_slot(monkeypatch):
    """Three weights in three buckets of ``(8, 16)``, ``(4, 16)``, ``(6, 16)``: weight 0 is fused
    (blocks of 8 and 4 rows: slots in the first two buckets), weight 1 fills the third, weight 2
    shares the first. At the first bucket's call weight 0's copy is alive (its second slot is
    still to form) and weight 2's is freed; none is alive at the later calls. Each momentum is
    updated exactly once: the codes equal one `step_momentum` of the same start."""
    shapes, groups = [(12, 16), (6, 16), (8, 16)], [{**GROUP, "split_sizes": [8, 4]}, GROUP, GROUP]
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    copies: dict[int, list[weakref.ref]] = {}
    workspace = Watching(copies)
    structure = step_structure(list(zip(groups, params)), [p.device for p in params], workspace)
    assert [(b.A, b.B) for b in structure.buckets] == [(8, 16), (4, 16), (6, 16)]

    states = []
    for p, spec in zip(params, structure.specs):
        lay = quant_blocks(p.shape, spec)
        q = torch.randint(-127, 128, p.shape, dtype=torch.int8, generator=gen)
        s = scale_like(p, lay).uniform_(0.5, 1.0, generator=gen)
        states.append((q, s, lay))
    expected = []
    for (q, s, lay), g in zip(states, grads):  # one momentum update, on copies of the codes
        q2, s2 = q.clone(), s.clone()
        F.step_momentum(g, MU, quantized=(q2, s2, lay))
        expected.append((q2, s2))

    real = F.step_momentum

    def tracked(grad, momentum, buffer=None, quantized=None):
        M = real(grad, momentum, buffer, quantized)
        k = next(i for i, g in enumerate(grads) if g is grad)
        copies.setdefault(k, []).append(weakref.ref(M))
        return M

    monkeypatch.setattr(F, "step_momentum", tracked)
    weights = [F.MuonWeight(p, g, None, 0.01, 0.0, MU, True, quantized=st) for p, g, st in zip(params, grads, states)]
    F.muon_step(weights, structure)

    assert workspace.alive == [[0], [], []]
    assert {k: len(refs) for k, refs in copies.items()} == {0: 1, 1: 1, 2: 1}  # once per weight
    for (q, s, _), (q2, s2) in zip(states, expected):
        assert torch.equal(q, q2) and torch.equal(s, s2)
