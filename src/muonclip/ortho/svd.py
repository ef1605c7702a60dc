"""Exact polar factor by SVD: the reference every fast orthogonaliser is tested against."""

from __future__ import annotations

import torch
from torch import Tensor


def svd_polar(V: Tensor, *, dtype: torch.dtype = torch.float64) -> Tensor:
    """Return ``U V^T`` from the thin SVD of each matrix in ``V`` (shape ``(..., A, B)``).

    Directions whose singular value is below ``max(A, B) * eps(dtype) * sigma_max`` (the
    numerical rank cut that ``torch.linalg.matrix_rank`` uses) are dropped, so a zero or
    rank-deficient matrix maps to the same thing Newton–Schulz converges to (zeros on the
    null space) instead of arbitrary singular vectors.

    Args:
        V: matrices of shape ``(..., A, B)``.
        dtype: compute dtype (default float64; float32 is accepted).

    Returns:
        A tensor of ``V``'s shape in ``dtype``.
    """
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"svd orthogonalisation computes in float32 or float64, got {dtype}")
    A, B = V.shape[-2:]
    U, S, Vh = torch.linalg.svd(V.to(dtype), full_matrices=False)
    tol = S.amax(dim=-1, keepdim=True) * (max(A, B) * torch.finfo(dtype).eps)
    keep = (S > tol).to(dtype)  # (..., k)
    return (U * keep.unsqueeze(-2)) @ Vh
