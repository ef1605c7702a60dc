"""Head layouts: which rows of which weights make up each attention head's q and k.

QK-Clip (docs/design.md, "QK-Clip") rescales, after the optimizer step, the query/key projection rows of
every head whose max logit ``S_h`` passed ``tau``, so that head h's logits ``scale * q.k`` are
multiplied by exactly ``gamma_h = tau / S_h`` (1 for heads at or below tau) and nothing else
changes. How to do that depends on how heads are laid out in the weights, and a layout is
*stated*, never guessed from shapes:

* `MHALayout` — one key head per query head: head h's rows of W_q and W_k (and biases) times
  ``sqrt(gamma_h)``.
* `GQALayout` — ``n_heads`` query heads share ``n_kv_heads`` key heads (MQA: 1). Default
  ``policy="per_head"``: head h's W_q rows (and q bias) times ``gamma_h``, shared key untouched
  (exact per head, like MLA's shared rotary key).
* `MLALayout` — DeepSeek-V3 / Kimi K2 multi-head latent attention with decoupled RoPE: the
  per-head non-rotary q^C and k^C by ``sqrt(gamma_h)``, the per-head rotary q^R by ``gamma_h``,
  the shared rotary key k^R and V untouched.

Every layout has ``n_heads`` (query heads = max-logit entries), ``clip(gamma)``, ``check()``
and ``params()``. ``clip`` multiplies by a per-row factor that is exactly 1.0 for heads with
``gamma_h == 1``, and ``x * 1.0 == x`` bit for bit in IEEE arithmetic, so those rows stay
bit-identical without any host sync. An `AttentionLayer` ties a layout to a name and to the
`MaxLogitRecorder` that the attention call fills.

Any layout weight or bias may be, besides a tensor whose rows are the heads' rows, a `Rows`
range or `StridedRows` blocks of a fused projection, and a weight may be DoRA's `Magnitudes`
(`muonclip.qkclip._rows`: what each means). `scale_rows_` scales the rows of any of them;
weights sharded by rows as a DTensor (FSDP2 ``Shard(0)``) are scaled on their local rows with
the global row offset (docs/design.md, "QK-Clip"); a transposed `Rows` scales columns, which
every local row holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..attention._recorder import MaxLogitRecorder
from ..common._dtensor import local_rows
from ._rows import Magnitudes, Rows, StridedRows, Weight, check_rows, tensor_of

GQA_POLICIES = ("per_head", "balanced", "group")


def _check_positive(**dims: int) -> None:
    for k, v in dims.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k} must be a positive int, got {v!r}")


def _per_row(head_factor: Tensor, rows_per_head: int) -> Tensor:
    return head_factor.repeat_interleave(rows_per_head)


def _rows_here(t: Tensor) -> tuple[Tensor, int]:
    """``(data, row_offset)``: the rows of ``t`` this process holds, to scale in place, and the
    global index of the first. A plain tensor (or parameter) holds them all, from row 0; anything
    else (a DTensor's row shard) is `muonclip.common._dtensor.local_rows`'s."""
    data = t.data if isinstance(t, nn.Parameter) else t
    return (data, 0) if type(data) is Tensor else local_rows(data)


@torch.no_grad()
def scale_rows_(t: Weight | None, factor: Tensor) -> None:
    """In place: ``t[r, ...] *= factor[r]`` for every row r (``factor`` of shape ``(t.shape[0],)``).

    For `Magnitudes`: entry r times ``factor[r]`` (row r of the effective weight).
    For a `Rows` ``t``: row ``start + r`` of its ``(out, in)`` matrix times ``factor[r]``
    (``factor`` of shape ``(stop - start,)``); for a transposed one, those columns of the stored
    ``(in, out)`` tensor. For a `StridedRows` ``t``: matrix row ``t.indices()[r]`` times
    ``factor[r]``, every other row times exactly 1.0. Computed in float32 and rounded once to
    ``t``'s dtype; rows with factor exactly 1.0 stay bit-identical. A DTensor sharded on dim 0 (FSDP2) scales its local
    rows using the global row offset (a transposed weight's local rows hold every column); a
    replicated DTensor scales its local copy.
    """
    if t is None:
        return
    if isinstance(t, Magnitudes):  # entry r stands for row r
        scale_rows_(t.tensor, factor)
        return
    if isinstance(t, StridedRows):  # a whole-matrix factor, 1.0 off the set: no sync, any row sharding
        full = torch.ones(t.out_features, dtype=torch.float32, device=factor.device)
        full[t.indices(factor.device)] = factor.float()
        if t.transposed:
            data, _ = _rows_here(t.tensor)
            data.mul_(full.to(data.device).view(1, -1))
        else:
            scale_rows_(t.tensor, full)
        return
    if isinstance(t, Rows):
        data, offset = _rows_here(t.tensor)
        f = factor.to(device=data.device, dtype=torch.float32)
        if t.transposed:
            data[:, t.start : t.stop].mul_(f.view(1, -1))
            return
        lo, hi = max(t.start, offset), min(t.stop, offset + data.shape[0])
        if lo < hi:
            data[lo - offset : hi - offset].mul_(f[lo - t.start : hi - t.start].view(-1, *([1] * (data.ndim - 1))))
        return
    data, offset = _rows_here(t)  # FSDP2 Shard(0): this rank's rows and the global index of the first
    factor = factor[offset : offset + data.shape[0]]
    f = factor.to(device=data.device, dtype=torch.float32).view(-1, *([1] * (data.ndim - 1)))
    data.mul_(f)


# ----------------------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------------------


@dataclass
class MHALayout:
    """Multi-head attention: query head h and key head h are rows ``[h*head_dim, (h+1)*head_dim)``.

    Clip: those rows of ``q_weight`` and ``k_weight`` (and of ``q_bias``/``k_bias``) times
    ``sqrt(gamma_h)``, so head h's logits are multiplied by ``gamma_h``.

    Each weight and bias may also be a `Rows` range or `StridedRows` blocks of a fused projection.

    Args:
        q_weight: ``(n_heads*head_dim, d_in)`` query projection weight.
        k_weight: ``(n_heads*head_dim, d_in)`` key projection weight.
        n_heads: number of heads.
        head_dim: query/key dimension per head.
        q_bias: ``(n_heads*head_dim,)`` query bias or None (default).
        k_bias: ``(n_heads*head_dim,)`` key bias or None (default).
    """

    q_weight: Weight
    k_weight: Weight
    n_heads: int
    head_dim: int
    q_bias: Weight | None = None
    k_bias: Weight | None = None

    def check(self) -> None:
        """Raise ValueError naming the weight whose shape does not fit the layout."""
        _check_positive(n_heads=self.n_heads, head_dim=self.head_dim)
        rows, why = self.n_heads * self.head_dim, f"n_heads*head_dim = {self.n_heads}*{self.head_dim}"
        check_rows("q_weight", self.q_weight, rows, why)
        check_rows("k_weight", self.k_weight, rows, why)
        check_rows("q_bias", self.q_bias, rows, why, vector=True)
        check_rows("k_bias", self.k_bias, rows, why, vector=True)

    def params(self) -> list[Tensor]:
        return [tensor_of(t) for t in (self.q_weight, self.k_weight, self.q_bias, self.k_bias) if t is not None]

    @torch.no_grad()
    def clip(self, gamma: Tensor) -> None:
        """Scale head h's q and k rows by ``sqrt(gamma[h])``; ``gamma`` is ``(n_heads,)`` float32."""
        f = _per_row(gamma.float().sqrt(), self.head_dim)
        for t in (self.q_weight, self.k_weight, self.q_bias, self.k_bias):
            scale_rows_(t, f)


@dataclass
class GQALayout:
    """Grouped-query attention: ``n_heads`` query heads share ``n_kv_heads`` key heads (MQA: 1).

    Query head h is rows ``[h*head_dim, (h+1)*head_dim)`` of ``q_weight`` and uses key head
    ``h // (n_heads // n_kv_heads)`` (consecutive query heads share a key head, as in
    ``repeat_interleave`` / ``enable_gqa``). Policies, with ``g(h)`` the key head of query head h
    and ``m_g`` the smallest gamma of group g:

    * ``"per_head"`` (default): head h's q rows times ``gamma_h``; keys untouched. Keeps the
      QK-Clip invariant exactly: head h's logits times ``gamma_h``, every other weight
      bit-identical. The query norm alone absorbs the clip.
    * ``"balanced"``: key head g times ``sqrt(m_g)``, head h's q rows times ``gamma_h / sqrt(m_g)``.
      Head h's logits are still multiplied by ``gamma_h`` (to float rounding), so the logit
      invariant holds, and the shrink is shared between q and k like MHA's ``sqrt``; but the
      weights of unclipped heads that share a key head with a clipped one change (their q rows
      grow by ``1/sqrt(m_g)`` while their logits stay the same), so "unclipped weights
      bit-identical" holds only per group with no clipped head.
    * ``"group"``: what peers do — q rows of every head of group g and key head g times
      ``sqrt(m_g)``, so every head of the group is multiplied by ``m_g``. This BREAKS the
      invariant: unclipped heads (and heads with a larger gamma) in a group with a clipped head
      are over-clipped.

    Each weight and bias may also be a `Rows` range or `StridedRows` blocks of a fused projection.

    Args:
        q_weight: ``(n_heads*head_dim, d_in)``.
        k_weight: ``(n_kv_heads*head_dim, d_in)``.
        n_heads: query heads; must be a multiple of ``n_kv_heads``.
        n_kv_heads: key/value heads (1 = MQA).
        head_dim: query/key dimension per head.
        q_bias: ``(n_heads*head_dim,)`` or None (default).
        k_bias: ``(n_kv_heads*head_dim,)`` or None (default).
        policy: ``"per_head"`` (default), ``"balanced"`` or ``"group"``.
    """

    q_weight: Weight
    k_weight: Weight
    n_heads: int
    n_kv_heads: int
    head_dim: int
    q_bias: Weight | None = None
    k_bias: Weight | None = None
    policy: str = "per_head"

    def check(self) -> None:
        """Raise ValueError naming the weight or option that does not fit the layout."""
        _check_positive(n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.policy not in GQA_POLICIES:
            raise ValueError(f"GQA policy must be one of {GQA_POLICIES}, got {self.policy!r}")
        q_rows, k_rows = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        check_rows("q_weight", self.q_weight, q_rows, f"n_heads*head_dim = {self.n_heads}*{self.head_dim}")
        check_rows("q_bias", self.q_bias, q_rows, f"n_heads*head_dim = {self.n_heads}*{self.head_dim}", vector=True)
        why = f"n_kv_heads*head_dim = {self.n_kv_heads}*{self.head_dim}"
        check_rows("k_weight", self.k_weight, k_rows, why)
        check_rows("k_bias", self.k_bias, k_rows, why, vector=True)

    def params(self) -> list[Tensor]:
        ts = [self.q_weight, self.q_bias]
        if self.policy != "per_head":
            ts += [self.k_weight, self.k_bias]
        return [tensor_of(t) for t in ts if t is not None]

    @torch.no_grad()
    def clip(self, gamma: Tensor) -> None:
        """Scale rows per ``policy`` so head h's logits are multiplied by ``gamma[h]`` (see class doc)."""
        gamma = gamma.float()
        if self.policy == "per_head":
            q_factor, k_factor = gamma, None
        else:
            group_min = gamma.view(self.n_kv_heads, -1).amin(dim=1)  # (n_kv_heads,)
            k_factor = group_min.sqrt()
            per_query = k_factor.repeat_interleave(self.n_heads // self.n_kv_heads)  # (n_heads,)
            q_factor = gamma / per_query if self.policy == "balanced" else per_query
        f = _per_row(q_factor, self.head_dim)
        scale_rows_(self.q_weight, f)
        scale_rows_(self.q_bias, f)
        if k_factor is not None:
            f = _per_row(k_factor, self.head_dim)
            scale_rows_(self.k_weight, f)
            scale_rows_(self.k_bias, f)


@dataclass
class MLALayout:
    """Multi-head latent attention (DeepSeek-V3 / Kimi K2) with decoupled RoPE.

    ``q_weight`` (``q_b_proj``, or ``q_proj`` without a query LoRA) has, per head h, rows
    ``[nope | rope]`` = ``qk_nope_head_dim + qk_rope_head_dim`` rows; ``kv_b_weight``
    (``kv_b_proj``) has, per head, rows ``[k_nope | v]`` = ``qk_nope_head_dim + v_head_dim``.
    The rotary key k^R is one head shared by all heads (rows of ``kv_a_proj_with_mqa``) and is
    never touched. Head h's logit is ``q^C . k^C + q^R . k^R``, so the clip scales q^C (nope
    rows of q) and k^C (k_nope rows of kv_b) by ``sqrt(gamma_h)`` and q^R (rope rows of q) by
    ``gamma_h``: both terms, hence the logit, are multiplied by ``gamma_h``. V rows untouched.

    Each weight and bias may also be a `Rows` range or `StridedRows` blocks of a fused projection.

    Args:
        q_weight: ``(n_heads*(qk_nope_head_dim+qk_rope_head_dim), d_q)``.
        n_heads: query heads.
        qk_nope_head_dim: non-rotary q/k dimension per head.
        qk_rope_head_dim: rotary q/k dimension per head.
        kv_b_weight: ``(n_heads*(qk_nope_head_dim+v_head_dim), kv_lora_rank)``.
        v_head_dim: value dimension per head.
        q_bias: ``(n_heads*(qk_nope_head_dim+qk_rope_head_dim),)`` or None (default).
        kv_b_bias: ``(n_heads*(qk_nope_head_dim+v_head_dim),)`` or None (default); only its
            k_nope entries are scaled.
    """

    q_weight: Weight
    n_heads: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    kv_b_weight: Weight
    v_head_dim: int
    q_bias: Weight | None = None
    kv_b_bias: Weight | None = None

    def check(self) -> None:
        """Raise ValueError naming the weight whose shape does not fit the layout."""
        _check_positive(n_heads=self.n_heads, qk_nope_head_dim=self.qk_nope_head_dim,
                        qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        nq = self.qk_nope_head_dim + self.qk_rope_head_dim
        nkv = self.qk_nope_head_dim + self.v_head_dim
        why_q = f"n_heads*(qk_nope_head_dim+qk_rope_head_dim) = {self.n_heads}*{nq}"
        why_kv = f"n_heads*(qk_nope_head_dim+v_head_dim) = {self.n_heads}*{nkv}"
        check_rows("q_weight", self.q_weight, self.n_heads * nq, why_q)
        check_rows("q_bias", self.q_bias, self.n_heads * nq, why_q, vector=True)
        check_rows("kv_b_weight", self.kv_b_weight, self.n_heads * nkv, why_kv)
        check_rows("kv_b_bias", self.kv_b_bias, self.n_heads * nkv, why_kv, vector=True)

    def params(self) -> list[Tensor]:
        return [tensor_of(t) for t in (self.q_weight, self.q_bias, self.kv_b_weight, self.kv_b_bias) if t is not None]

    @torch.no_grad()
    def clip(self, gamma: Tensor) -> None:
        """q^C, k^C rows of head h times ``sqrt(gamma[h])``, q^R rows times ``gamma[h]``."""
        gamma = gamma.float()
        root = gamma.sqrt()
        ones = torch.ones_like(gamma)
        q_f = torch.cat([root[:, None].expand(-1, self.qk_nope_head_dim),
                         gamma[:, None].expand(-1, self.qk_rope_head_dim)], dim=1).reshape(-1)
        kv_f = torch.cat([root[:, None].expand(-1, self.qk_nope_head_dim),
                          ones[:, None].expand(-1, self.v_head_dim)], dim=1).reshape(-1)
        scale_rows_(self.q_weight, q_f)
        scale_rows_(self.q_bias, q_f)
        scale_rows_(self.kv_b_weight, kv_f)
        scale_rows_(self.kv_b_bias, kv_f)


Layout = MHALayout | GQALayout | MLALayout


@dataclass
class AttentionLayer:
    """One attention layer QK-Clip acts on: a name (for logs), its head layout and its recorder.

    Args:
        name: the layer's name, e.g. ``"blocks.0.attn"`` (keys of `MuonClip.last_max_logits`).
        layout: an `MHALayout`, `GQALayout` or `MLALayout` (or any object with ``n_heads``,
            ``clip(gamma)``, ``check()`` and ``params()``).
        recorder: the `MaxLogitRecorder` the layer's attention call updates; its ``n_heads``
            must equal the layout's.
    """

    name: str
    layout: Layout
    recorder: MaxLogitRecorder

    def check(self) -> None:
        """Validate the layout and the recorder; errors name the layer."""
        try:
            self.layout.check()
        except ValueError as e:
            raise ValueError(f"attention layer '{self.name}': {e}") from None
        if self.recorder.n_heads != self.layout.n_heads:
            raise ValueError(
                f"attention layer '{self.name}': recorder has {self.recorder.n_heads} heads but the layout "
                f"has {self.layout.n_heads} query heads"
            )

    @property
    def device(self) -> torch.device:
        """Where the layer's maxima live: the recorder's values, else its first weight (CPU if none)."""
        if self.recorder.value is not None:
            return self.recorder.value.device
        params = self.layout.params()
        return params[0].device if params else torch.device("cpu")
