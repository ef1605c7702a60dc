"""Per-head max logits on a GPU in one Triton kernel, and the LSE gate fused into it.

`chunked_max_logits` is the reference: plain torch, any device, but a Python loop over chunks of
query rows of a few kernel launches each. On a GPU that loop is launch-bound (at T = 2048 a
chunk holds a handful of rows: hundreds of launches a call). `triton_max_logits` computes the
same quantity in one launch: one program per (batch, query head, block of ``BLOCK_M`` query
rows) walks the keys it may see in blocks of ``BLOCK_N`` (only up to the diagonal when causal),
takes ``q . k`` of the block with float32 accumulation (``tl.dot``; full float32 products for
float32 inputs, never TF32), masks disallowed pairs with ``-inf`` and keeps the row maxima; the
per-program maxima are then reduced over batch and row blocks by ``amax``. ``scale > 0`` is
applied to the reduced ``(Hq,)`` result, as `chunked_max_logits` does (``max(scale x) =
scale max(x)``, and rounding keeps the order).

**The gate, fused** (`triton_gated_max_logits`; the maths is `muonclip.attention._gate`'s): given
the attention kernel's LSE, each program first bounds the max logit of *its own rows* by
``max_i lse_i - c + margin`` (``c`` the additive mask's most negative allowed bias, the margin
the gate's round-off allowance from this block's ``max |q|`` and the call's ``max |k|``);
a program whose bound is ``<= tau`` stores the bound, raises its "bounded" flag and walks no
key block. Per head, the value is the max over its programs: above tau it comes from computed
programs only (every bound is ``<= tau``) and is the exact max; at or below tau no clip is
due, as on the exact path. Gating per block of rows instead of per head computes less (only the
blocks whose rows come near tau) and needs no host read of any flag: the whole gate is one
launch plus two reductions, asynchronous on CUDA.

What it takes: 4-D ``query (B, Hq, Tq, D)``, ``key (B, Hkv, Tk, D)`` (GQA: query head h reads
key head ``h // (Hq // Hkv)``), bfloat16, float16 or float32, any strides, ``D <= 256``; an
``attn_mask`` broadcastable to ``(B, Hq, Tq, Tk)`` (boolean: True attends; additive: allowed
where above ``MASKED_AT``, the bias itself not included: the rule of `muonclip.attention.pairs`);
torch's top-left causal rule. `usable` says whether a call qualifies; the caller falls back to
`chunked_max_logits` otherwise (float64, CPU without the interpreter, no Triton, ``D > 256``).

On CPU the kernel runs only under Triton's interpreter (``TRITON_INTERPRET=1``), which is how
the tests check it without a GPU (there, bfloat16 and float16 tiles are widened to float32
before the product: the interpreter's ``tl.dot`` is wrong for 16-bit operands; the products
are exact in float32 either way).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import Tensor

from ..common._triton_support import interpreting, triton_available
from .call import check_shapes
from .pairs import MASKED_AT

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256
BLOCK_M, BLOCK_N = 64, 64
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second dimension (the row blocks of one launch)


def usable(query: Tensor, key: Tensor, scale: float | None = None) -> bool:
    """True when `triton_max_logits` can run this call: Triton importable, the tensors on a CUDA
    device (or the interpreter on), 4-D, one of `DTYPES`, head dim at most `MAX_HEAD_DIM`, and a
    positive scale (None counts: ``1 / sqrt(D)``)."""
    return (
        triton_available()
        and (query.is_cuda or interpreting())
        and query.ndim == 4 and key.ndim == 4
        and query.dtype in DTYPES and key.dtype == query.dtype
        and 0 < query.shape[-1] <= MAX_HEAD_DIM
        and (scale is None or scale > 0)
    )


@functools.cache
def _kernel(interpret: bool) -> tuple[Any, Any]:  # triton JITFunctions (or InterpretedFunctions)
    """The kernel and its max combine, built on first use (again if the interpreter is switched on
    or off: ``triton.jit`` reads ``TRITON_INTERPRET`` when it wraps a function)."""
    del interpret  # part of the cache key only
    import triton
    import triton.language as tl

    @triton.jit
    def maximum(a, b):  # the interpreter's max: tl.max is a jit function of triton's own, which the
        # interpreter cannot call when triton was imported before TRITON_INTERPRET was set (as in a
        # test run), so there tl.reduce gets this combine, handed over as a constexpr (which the
        # compiler, for its part, does not take: it gets tl.max)
        return tl.maximum(a, b)

    @triton.jit
    def max_logit_kernel(q_ptr, k_ptr, m_ptr, lse_ptr, kmax_ptr, c_ptr, out_ptr, flag_ptr,
                         Hq, G, Tq, Tk, D, n_blocks, block0, mask_min, scale, tau, dot_margin, lse_margin,
                         s_qb, s_qh, s_qt, s_qd, s_kb, s_kh, s_kt, s_kd, s_mb, s_mh, s_mq, s_mk, s_lb, s_lh, s_lt,
                         IS_CAUSAL: tl.constexpr, MASK: tl.constexpr, GATE: tl.constexpr, HAS_C: tl.constexpr,
                         WIDEN: tl.constexpr, PRECISION: tl.constexpr, MAX: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        bh = tl.program_id(0)
        pid_m = tl.program_id(1) + block0
        b = (bh // Hq).to(tl.int64)
        h = bh % Hq
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, BLOCK_D)
        n_end = Tk
        if IS_CAUSAL:  # top-left: row i sees keys j <= i
            n_end = tl.minimum(Tk, (pid_m + 1) * BLOCK_M)
        q = tl.load(q_ptr + b * s_qb + h.to(tl.int64) * s_qh + rm[:, None] * s_qt + rd[None, :] * s_qd,
                    mask=(rm[:, None] < Tq) & (rd[None, :] < D), other=0.0)
        gated = False
        bound = 0.0
        if GATE:  # this block's rows: max lse - c + margin (muonclip.attention._gate)
            lrow = tl.load(lse_ptr + b * s_lb + h.to(tl.int64) * s_lh + rm * s_lt, mask=rm < Tq, other=float("-inf"))
            l_nan = tl.where((rm < Tq) & (lrow != lrow), 1, 0)
            qf = q.to(tl.float32)
            q_abs = tl.reshape(tl.maximum(qf, -qf), (BLOCK_M * BLOCK_D,))
            if MAX is None:
                l_max = tl.max(lrow, axis=0)
                any_l_nan = tl.max(l_nan, axis=0)
                q_max = tl.max(q_abs, axis=0)
            else:
                l_max = tl.reduce(lrow, 0, MAX)
                any_l_nan = tl.reduce(l_nan, 0, MAX)
                q_max = tl.reduce(q_abs, 0, MAX)
            base = l_max
            if HAS_C:
                base = base - tl.load(c_ptr)
            k_max = tl.load(kmax_ptr).to(tl.float32)
            bound = base + dot_margin * q_max * k_max + lse_margin * (tl.maximum(base, -base) + 1.0)
            gated = (bound <= tau) & (any_l_nan == 0)  # False for a NaN bound: computed exactly
            n_end = tl.where(gated, 0, n_end)
        if WIDEN:
            q = q.to(tl.float32)
        k_base = k_ptr + b * s_kb + (h // G).to(tl.int64) * s_kh
        m_base = m_ptr + b * s_mb + h.to(tl.int64) * s_mh
        tile_max = tl.full((BLOCK_M, BLOCK_N), float("-inf"), dtype=tl.float32)  # running, elementwise
        tile_nan = tl.full((BLOCK_M, BLOCK_N), 0, dtype=tl.int32)  # tl.max drops NaN; torch's amax keeps it
        for n0 in range(0, n_end, BLOCK_N):
            rn = n0 + tl.arange(0, BLOCK_N)
            kt = tl.load(k_base + rn[None, :] * s_kt + rd[:, None] * s_kd,
                         mask=(rn[None, :] < Tk) & (rd[:, None] < D), other=0.0)  # (BLOCK_D, BLOCK_N)
            if WIDEN:
                kt = kt.to(tl.float32)
            s = tl.dot(q, kt, input_precision=PRECISION)  # float32 accumulation
            ok = (rm[:, None] < Tq) & (rn[None, :] < Tk)
            if IS_CAUSAL:
                ok = ok & (rn[None, :] <= rm[:, None])
            if MASK == 1:  # boolean (as uint8): nonzero attends
                mv = tl.load(m_base + rm[:, None] * s_mq + rn[None, :] * s_mk, mask=ok, other=0)
                ok = ok & (mv != 0)
            if MASK == 2:  # additive: allowed where above MASKED_AT (muonclip.attention.pairs)
                mv = tl.load(m_base + rm[:, None] * s_mq + rn[None, :] * s_mk, mask=ok, other=0.0)
                ok = ok & (mv.to(tl.float32) > mask_min)
            tile_nan = tl.where(ok & (s != s), 1, tile_nan)
            tile_max = tl.maximum(tile_max, tl.where(ok, s, float("-inf")))
        flat_max = tl.reshape(tile_max, (BLOCK_M * BLOCK_N,))
        flat_nan = tl.reshape(tile_nan, (BLOCK_M * BLOCK_N,))
        if MAX is None:  # compiled
            result = tl.max(flat_max, axis=0)
            any_nan = tl.max(flat_nan, axis=0)
        else:  # interpreted
            result = tl.reduce(flat_max, 0, MAX)
            any_nan = tl.reduce(flat_nan, 0, MAX)
        result = tl.where(any_nan > 0, float("nan"), result * scale)
        if GATE:
            result = tl.where(gated, bound, result)
            tl.store(flag_ptr + bh * n_blocks + pid_m, gated.to(tl.int8))
        tl.store(out_ptr + bh * n_blocks + pid_m, result)

    return max_logit_kernel, maximum


def _mask_view(attn_mask: Tensor, shape: tuple[int, int, int, int]) -> tuple[Tensor, int, float]:
    """``(mask expanded to shape (a view), kind, threshold)``: kind 1 for boolean (viewed as
    uint8), 2 for additive (allowed above the threshold, `MASKED_AT`)."""
    try:
        m = attn_mask.expand(shape)
    except RuntimeError:
        raise ValueError(f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {shape}") from None
    if m.dtype == torch.bool:
        return m.view(torch.uint8), 1, 0.0
    return m, 2, MASKED_AT


def _launch(query, key, attn_mask, is_causal, scale, enable_gqa, gate):
    """Run the kernel; ``gate`` is None or ``(lse, tau, kmax, floor, dot_margin, lse_margin)``.
    Returns the per-program values and flags, each ``(B, Hq, n_blocks)``."""
    hq, hkv = check_shapes(query, key, enable_gqa)
    if not usable(query, key, scale):
        raise ValueError("triton_max_logits needs Triton, CUDA tensors (or TRITON_INTERPRET=1), "
                         f"a dtype in {DTYPES}, head dim <= {MAX_HEAD_DIM} and scale > 0; "
                         "use chunked_max_logits for this call")
    B, _, Tq, D = query.shape
    Tk = key.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    n_blocks = -(-Tq // BLOCK_M)
    out = torch.empty((B, hq, n_blocks), dtype=torch.float32, device=query.device)
    flags = torch.empty((B, hq, n_blocks), dtype=torch.int8, device=query.device) if gate else out
    if out.numel() == 0:  # no batch or no query rows: no pair at all
        return out, flags
    if attn_mask is None:
        mask, kind, mask_min, ms = query, 0, 0.0, (0, 0, 0, 0)  # an unused pointer
    else:
        mask, kind, mask_min = _mask_view(attn_mask, (B, hq, Tq, Tk))
        ms = mask.stride()
    if gate is None:
        lse, tau, kmax, floor, dot_margin, lse_margin = query, 0.0, query, 0.0, 0.0, 0.0  # unused
        ls = (0, 0, 0)
    else:
        lse, tau, kmax, floor, dot_margin, lse_margin = gate
        ls = lse.stride()
    has_c = isinstance(floor, Tensor)
    interpret = interpreting()
    kernel, maximum = _kernel(interpret)
    for block0 in range(0, n_blocks, MAX_GRID_Y):  # one launch unless Tq > 64 * 65535
        kernel[(B * hq, min(MAX_GRID_Y, n_blocks - block0))](
            query, key, mask, lse, kmax, floor if has_c else out, out, flags,
            hq, hq // hkv, Tq, Tk, D, n_blocks, block0, mask_min, float(scale), float(tau),
            float(dot_margin), float(lse_margin),
            *query.stride(), *key.stride(), *ms, *ls,
            IS_CAUSAL=bool(is_causal), MASK=kind, GATE=gate is not None, HAS_C=has_c,
            WIDEN=interpret and query.dtype != torch.float32, PRECISION="ieee", MAX=maximum if interpret else None,
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_D=max(16, 1 << (D - 1).bit_length()),
        )
    return out, flags


def _per_head(values: Tensor, hq: int) -> Tensor:
    if values.numel() == 0:
        return torch.full((hq,), -math.inf, device=values.device)
    return values.amax(dim=(0, 2))


@torch.no_grad()
def triton_max_logits(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """Per-query-head max logit of one attention call, as `chunked_max_logits`, in one kernel.

    Args:
        query: ``(B, Hq, Tq, D)``, on a CUDA device (or on the CPU under ``TRITON_INTERPRET=1``).
        key: ``(B, Hkv, Tk, D)``; ``Hkv == Hq``, or ``Hq % Hkv == 0`` with ``enable_gqa``.
        attn_mask: None (default), or a bool / additive float mask broadcastable to
            ``(B, Hq, Tq, Tk)``, as for ``F.scaled_dot_product_attention``.
        is_causal: top-left causal mask, ``j <= i`` (default False).
        scale: softmax scale, > 0 (default None: ``1 / sqrt(D)``).
        enable_gqa: query head h uses key head ``h // (Hq // Hkv)`` (default False).

    Returns:
        ``(Hq,)`` float32: the max over batch, queries and allowed keys of ``scale * q.k``;
        ``-inf`` for a head with no allowed pair; NaN for a head with a NaN score at an allowed
        pair (as `chunked_max_logits`).

    Raises:
        ValueError: the call does not qualify (see `usable`), or shapes do not fit.
    """
    values, _ = _launch(query, key, attn_mask, is_causal, scale, enable_gqa, None)
    return _per_head(values, query.shape[1])


@torch.no_grad()
def triton_gated_max_logits(
    query: Tensor,
    key: Tensor,
    lse: Tensor,
    threshold: float,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    bias_floor: Tensor | float = 0.0,
    dot_margin: float,
    lse_margin: float,
) -> tuple[Tensor, Tensor]:
    """The LSE gate fused into the kernel (module docstring): per head, the exact max where it
    could exceed ``threshold``, else an upper bound ``<= threshold``; no host sync.

    Args:
        query, key, attn_mask, is_causal, scale, enable_gqa: as `triton_max_logits`.
        lse: ``(B, Hq, Tq)`` float32, the attention kernel's LSE of this call (any strides).
        threshold: the clip's tau.
        bias_floor: ``c``, the most negative allowed bias of an additive mask, as a 0-d tensor on
            the device (default 0.0: no mask, or a boolean one).
        dot_margin: the round-off allowance per unit of ``max|q| max|k|``
            (`muonclip.attention._gate.margins`).
        lse_margin: the round-off allowance per unit of ``|max lse - c| + 1`` (same place).

    Returns:
        ``(values, is_bound)``, each ``(Hq,)``: ``values`` float32; ``is_bound`` True where the
        value may be a bound rather than the exact max (only ever at or below ``threshold``).
    """
    kmax = torch.linalg.vector_norm(key.detach(), ord=math.inf).reshape(1)  # max |k|: one full reduction
    gate = (lse.detach(), threshold, kmax, bias_floor, dot_margin, lse_margin)
    values, flags = _launch(query, key, attn_mask, is_causal, scale, enable_gqa, gate)
    per_head = _per_head(values, query.shape[1])
    if flags.numel() == 0:
        return per_head, torch.zeros(query.shape[1], dtype=torch.bool, device=query.device)
    return per_head, (flags.amax(dim=(0, 2)) > 0) & (per_head <= threshold)
