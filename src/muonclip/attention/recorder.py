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
        heads: the query heads this process computes (default None: all of them). Under tensor
            parallelism each rank computes a contiguous range of heads (column-parallel q/k);
            its attention call then hands over maxima for those heads only, and the recorder
            keeps them at their global positions with ``-inf`` elsewhere, so that a MAX
            reduction over every rank gives each head the max over the ranks that computed it
            (`muonclip.distributed.tensor_parallel.record_local_heads` sets it from the q weight).

    Attributes:
        n_heads: as given.
        heads: ``range`` of the heads recorded here (``range(n_heads)`` by default).
        value: ``(n_heads,)`` float32 running max, on the device of the first update; ``None``
            when nothing was recorded since the last reset. A head that saw no allowed token pair
            (all its rows fully masked) holds ``-inf``.

    ``update`` never syncs with the host (it only launches a ``torch.maximum``), and stores
    detached values, so recording costs nothing in the autograd graph.
    """

    def __init__(self, n_heads: int, heads: range | None = None) -> None:
        if not isinstance(n_heads, int) or n_heads < 1:
            raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
        self.n_heads = n_heads
        self.heads = range(n_heads)
        self.value: Tensor | None = None
        if heads is not None:
            self.shard_heads(heads)

    def shard_heads(self, heads: range) -> None:
        """Record only ``heads`` (a non-empty ``range`` within ``range(n_heads)``) from now on."""
        if not isinstance(heads, range) or heads.step != 1 or not len(heads) or heads.start < 0 \
                or heads.stop > self.n_heads:
            raise ValueError(f"heads must be a non-empty range of consecutive heads in 0..{self.n_heads}, "
                             f"got {heads!r}")
        self.heads = heads
        self.value = None

    def update(self, per_head_max: Tensor) -> None:
        """Fold one call's per-head maxima into the running max.

        Args:
            per_head_max: ``(len(heads),)`` the maximum logit of each query head computed here
                in one call (all ``n_heads`` unless `shard_heads` was called).
        """
        n = len(self.heads)
        if per_head_max.shape != (n,):
            raise ValueError(
                f"recorder for {n} heads got maxima of shape {tuple(per_head_max.shape)}; "
                f"expected ({n},) — is the recorder attached to the right layer?"
            )
        m = per_head_max.detach().to(torch.float32)
        if n != self.n_heads:  # tensor parallel: this rank's heads at their global positions
            full = torch.full((self.n_heads,), -torch.inf, dtype=torch.float32, device=m.device)
            full[self.heads.start:self.heads.stop] = m
            m = full
        if self.value is None:
            self.value = m.clone()
        else:
            self.value = torch.maximum(self.value, m.to(self.value.device))

    def reset(self) -> None:
        """Forget everything recorded (called by the clip once it has used the maxima)."""
        self.value = None

    def __repr__(self) -> str:
        heads = "" if len(self.heads) == self.n_heads else f", heads={self.heads}"
        return f"MaxLogitRecorder(n_heads={self.n_heads}{heads}, recorded={self.value is not None})"


__all__ = ["MaxLogitRecorder"]
