"""The parameter sets of the step benchmarks (`bench_step.py`, `bench_overhead.py`, `bench_trees.py`).

Kept free of any muonclip import, so that `bench_trees.py` can build them in a process that
imports another source tree.
"""

from __future__ import annotations

import torch

LR, WD = 0.02, 0.1


def gpt_shapes(d: int = 384, layers: int = 6) -> list[tuple[int, ...]]:
    """Hidden matrices of a GPT block stack: q, k, v, o (d x d), c_fc (4d x d), c_proj (d x 4d)."""
    return [s for _ in range(layers) for s in [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]]


def make_params(shapes, grads, device):
    """Parameters of ``shapes`` (random, scaled by 0.02) on ``device``, with ``grads`` as gradients."""
    params = [torch.nn.Parameter(torch.randn(s, device=device) * 0.02) for s in shapes]
    for p, g in zip(params, grads):
        p.grad = g.to(device).clone()
    return params
