"""`MaxLogitRecorder`: the running per-head max logit of one attention layer.

QK-Clip (docs/design.md, "QK-Clip") needs, per attention head h, ``S_h = scale * max q_i^h . k_j^h`` over
every token pair the mask lets through, over the whole step: every micro-batch of gradient
accumulation (and, in `MuonClip.step`, every data-parallel rank). On a training forward
(training mode and grad enabled; `muonclip.attention.forward_rule`) the attention call
(`muonclip.attention.record.attend`, which every entry point takes) computes the maximum of one
call over the pairs the clip sees (`muonclip.attention.pairs`) and hands it to the layer's
recorder; the recorder keeps the running max until the clip consumes it
(`reset`). Evaluation and generation never reach it (`MaxLogitMonitor` reads those).

**The threshold.** A recorder told the clip's threshold (``threshold = tau``; `MuonClip` sets
it on every layer it clips) lets the attention call skip the exact max of heads that provably
cannot exceed it (the LSE gate, `muonclip.attention._gate`): such a head is recorded as an
upper bound ``<= threshold`` and flagged (`bounded`). Every head that could exceed the
threshold is computed exactly, so after any number of calls a value above the threshold is
the exact running max and a value at or below it means "no clip": the clip's decision and
every ``gamma`` are those of the exact path. A recorder without a threshold (the default)
receives exact maxima only.
"""

from __future__ import annotations

import math

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
            (`muonclip.qkclip.tensor_parallel.record_local_heads` sets it from the q weight).
        threshold: the clip's tau, a finite number > 0, or None (default): every recorded
            value is exact. See the module docstring; `MuonClip` sets it.

    Attributes:
        n_heads: as given.
        heads: ``range`` of the heads recorded here (``range(n_heads)`` by default).
        threshold: as given (settable).
        value: ``(n_heads,)`` float32 running max, on the device of the first update; ``None``
            when nothing was recorded since the last reset. A head that saw no allowed token pair
            (all its rows fully masked) holds ``-inf`` (or, gated, a bound ``<= threshold``).
            Where `bounded` is True it is an upper bound of the exact max (at or below the
            threshold); elsewhere it is the exact max.
        exact: ``(n_heads,)`` running max over the exactly computed values only (``-inf``
            where every value was a bound); ``None`` with ``value``.

    ``update`` never syncs with the host (it only launches ``torch.maximum``), and stores
    detached values, so recording costs nothing in the autograd graph.
    """

    def __init__(self, n_heads: int, *, heads: range | None = None, threshold: float | None = None) -> None:
        if not isinstance(n_heads, int) or n_heads < 1:
            raise ValueError(f"n_heads must be a positive int, got {n_heads!r}")
        self.n_heads = n_heads
        self.heads = range(n_heads)
        self.threshold = threshold
        self.value: Tensor | None = None
        self.exact: Tensor | None = None
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
        self.exact = None

    @property
    def threshold(self) -> float | None:
        """The clip's tau (None: exact maxima only)."""
        return self._threshold

    @threshold.setter
    def threshold(self, tau: float | None) -> None:
        if tau is not None and (
            isinstance(tau, bool) or not isinstance(tau, (int, float)) or not (math.isfinite(tau) and tau > 0)
        ):
            raise ValueError(f"a recorder's threshold is the clip's tau: a finite number > 0 or None, got {tau!r}")
        self._threshold = None if tau is None else float(tau)

    def update(self, per_head_max: Tensor, is_bound: Tensor | None = None) -> None:
        """Fold one call's per-head maxima into the running max.

        Args:
            per_head_max: ``(len(heads),)`` the maximum logit of each query head computed here
                in one call (all ``n_heads`` unless `shard_heads` was called).
            is_bound: ``(len(heads),)`` bool (default None: all exact): heads whose value is an
                upper bound ``<= threshold`` rather than the exact max (the LSE gate).
        """
        n = len(self.heads)
        if per_head_max.shape != (n,):
            raise ValueError(
                f"recorder for {n} heads got maxima of shape {tuple(per_head_max.shape)}; "
                f"expected ({n},) — is the recorder attached to the right layer?"
            )
        m = per_head_max.detach().to(torch.float32)
        e = m if is_bound is None else m.masked_fill(is_bound.to(m.device), -math.inf)
        if n != self.n_heads:  # tensor parallel: this rank's heads at their global positions
            m, e = self._globally(m), self._globally(e)
        if self.value is None:
            self.value, self.exact = m.clone(), e.clone()
        else:
            self.value = torch.maximum(self.value, m.to(self.value.device))
            self.exact = torch.maximum(self.exact, e.to(self.exact.device))

    def _globally(self, local: Tensor) -> Tensor:
        """``(n_heads,)``: ``local`` at the positions of `heads`, ``-inf`` (MAX's identity) elsewhere."""
        full = torch.full((self.n_heads,), -math.inf, dtype=local.dtype, device=local.device)
        full[self.heads.start : self.heads.stop] = local
        return full

    @property
    def bounded(self) -> Tensor | None:
        """``(n_heads,)`` bool: True where `value` is an upper bound, not the exact max (None when
        nothing was recorded)."""
        if self.value is None:
            return None
        if self.exact is None:  # value set directly (e.g. restored): exact by assumption
            return torch.zeros(self.n_heads, dtype=torch.bool, device=self.value.device)
        return self.value > self.exact

    def reset(self) -> None:
        """Forget everything recorded (called by the clip once it has used the maxima)."""
        self.value = None
        self.exact = None

    def __repr__(self) -> str:
        heads = "" if len(self.heads) == self.n_heads else f", heads={self.heads}"
        return (f"MaxLogitRecorder(n_heads={self.n_heads}{heads}, threshold={self.threshold}, "
                f"recorded={self.value is not None})")
