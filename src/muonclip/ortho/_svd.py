"""Exact polar factor by SVD: the reference every fast orthogonaliser is tested against."""

from __future__ import annotations

import torch
from torch import Tensor

from ._newton_schulz import overflow_scale


def svd_polar(V: Tensor, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """Return ``U V^T`` from the thin SVD of each matrix in ``V`` (shape ``(..., A, B)``).

    Directions whose singular value is below ``max(A, B) * eps(dtype) * sigma_max`` (the
    numerical rank cut that ``torch.linalg.matrix_rank`` uses) are dropped, so a zero or
    rank-deficient matrix maps to the same thing Newton–Schulz converges to (zeros on the
    null space) instead of arbitrary singular vectors. Matrices whose entries are so large that
    the SVD's norms would overflow are first scaled by a power of two
    (`muonclip.ortho._newton_schulz.overflow_scale`; the polar factor does not depend on it).

    Args:
        V: matrices of shape ``(..., A, B)``.
        dtype: compute dtype (default float64; float32 is accepted).

    Returns:
        A tensor of ``V``'s shape in ``dtype``.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"svd orthogonalisation computes in float32 or float64, got {dtype}")
    A, B = V.shape[-2:]
    X = V.to(dtype)
    if X.numel():  # exact; 1 unless the entries are huge
        X = X * overflow_scale(X.reshape(-1, A, B)).reshape(*X.shape[:-2], 1, 1)
    U, S, Vh = torch.linalg.svd(X, full_matrices=False)
    tol = S.amax(dim=-1, keepdim=True) * (max(A, B) * torch.finfo(dtype).eps)
    keep = (S > tol).to(dtype)  # (..., k)
    return (U * keep.unsqueeze(-2)) @ Vh
