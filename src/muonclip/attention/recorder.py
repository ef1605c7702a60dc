"""`MaxLogitRecorder`: the running per-head max logit of one attention layer.

QK-Clip (docs/design.md, "QK-Clip") needs, per attention head h, ``S_h = scale * max q_i^h . k_j^h`` over
every token pair the mask lets through, over the whole step: every micro-batch of gradient
accumulation (and, in `MuonClip.step`, every data-parallel rank). On a training forward
(training mode and grad enabled; `muonclip.attention.recording`) the attention call
(`muonclip.scaled_dot_product_attention`) computes the maximum of one call and hands it to
the layer's recorder; the recorder keeps the running max until the clip consumes it
(`reset`). Evaluation and generation never reach it (`MaxLogitMonitor` reads those).
"""

from __future__ import annotations

import torch
from torch import Tensor


class MaxLogitRecorder:
    """Running per-head max logit of one attention layer, over calls (micro-batches) until reset.

    Args:
        n_heads: number of query heads (one max-logit entry per query head).

    Attributes:
        n_heads: as given.
        value: ``(n_heads,)`` float32 running max, on the device of the first update; ``None``
            when nothing was recorded since the last reset. A head that saw no allowed token pair
            (all its rows fully masked) holds ``-inf``.

    ``update`` never syncs with the host (it only launches a ``torch.maximum``), and stores
    detached values, so recording costs nothing in the autograd graph.
    """

    def __init__(self, n_heads: int) -> None:
        if not isinstance(n_heads, int) or n_heads < 1:
            raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
        self.n_heads = n_heads
        self.value: Tensor | None = None

    def update(self, per_head_max: Tensor) -> None:
        """Fold one call's per-head maxima into the running max.

        Args:
            per_head_max: ``(n_heads,)`` the maximum logit of each query head in one call.
        """
        if per_head_max.shape != (self.n_heads,):
            raise ValueError(
                f"recorder for {self.n_heads} heads got maxima of shape {tuple(per_head_max.shape)}; "
                f"expected ({self.n_heads},) — is the recorder attached to the right layer?"
            )
        m = per_head_max.detach().to(torch.float32)
        if self.value is None:
            self.value = m.clone()
        else:
            self.value = torch.maximum(self.value, m.to(self.value.device))

    def reset(self) -> None:
        """Forget everything recorded (called by the clip once it has used the maxima)."""
        self.value = None

    def __repr__(self) -> str:
        return f"MaxLogitRecorder(n_heads={self.n_heads}, recorded={self.value is not None})"


__all__ = ["MaxLogitRecorder"]
