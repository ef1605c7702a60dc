"""A slow, obviously-correct Muon + AdamW, written from docs/design.md ("Muon") for the tests to compare with.

One parameter at a time, one matrix at a time, float64, no batching, no buffers shared.
"""

from __future__ import annotations

import math

import torch

from muonclip.ortho import polar_express_coefficients, svd_polar

NS5 = (3.4445, -4.7750, 2.0315)


def orth(V: torch.Tensor, method: str, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Orthogonalise ONE matrix (A, B) with a plain loop."""
    if method == "svd":
        return svd_polar(V, dtype=dtype)
    X = V.to(dtype)
    tall = X.shape[0] > X.shape[1]
    if tall:
        X = X.T
    if method == "ns5":
        X = X / (X.norm() + 1e-7)
        coeffs = [NS5] * steps
    else:
        X = X / (X.norm() * 1.01 + 1e-7)
        coeffs = polar_express_coefficients(steps)
    for a, b, c in coeffs:
        S = X @ X.T
        X = a * X + (b * S + c * S @ S) @ X
    return X.T if tall else X


def scale(rule: str, A: int, B: int) -> float:
    return {"match_rms_adamw": 0.2 * math.sqrt(max(A, B)), "original": math.sqrt(max(1.0, A / B)),
            "unscaled": 1.0}[rule]


def matrices(t: torch.Tensor, flatten: bool, split_sizes):
    """Yield (index tuple of rows, matrix) for every matrix the parameter holds."""
    if flatten or t.ndim >= 4:
        mats = [t.reshape(t.shape[0], -1)]
    elif t.ndim == 3:
        mats = list(t)
    else:
        mats = [t]
    out = []
    for e, m in enumerate(mats):
        start = 0
        for size in split_sizes or [m.shape[0]]:
            out.append((e, start, size, m[start : start + size]))
            start += size
    return out


class ReferenceMuon:
    """Muon for a list of parameters, in float64, one matrix at a time."""

    def __init__(self, params, lr, momentum=0.95, nesterov=True, weight_decay=0.1,
                 adjust_lr_fn="match_rms_adamw", method="ns5", ns_steps=5, orth_dtype=torch.float64, flatten=False,
                 split_sizes=None):
        self.params = list(params)
        self.opts = dict(lr=lr, mu=momentum, nesterov=nesterov, wd=weight_decay, rule=adjust_lr_fn,
                         method=method, steps=ns_steps, dtype=orth_dtype, flatten=flatten, split=split_sizes)
        self.M = [torch.zeros_like(p, dtype=torch.float64) for p in self.params]

    @torch.no_grad()
    def step(self):
        o = self.opts
        for p, M in zip(self.params, self.M):
            if p.grad is None:
                continue
            G = p.grad.double()
            M.mul_(o["mu"]).add_(G)
            V = G + o["mu"] * M if o["nesterov"] else M.clone()
            U = torch.zeros_like(V)
            U_mats = matrices(U, o["flatten"], o["split"])
            for (_, _, _, v), (_, _, _, u) in zip(matrices(V, o["flatten"], o["split"]), U_mats):
                u.copy_(orth(v, o["method"], o["steps"], o["dtype"]) * scale(o["rule"], v.shape[0], v.shape[1]))
            W = p.double() * (1 - o["lr"] * o["wd"]) - o["lr"] * U
            p.copy_(W)
