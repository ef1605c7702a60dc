"""Attention that also returns each query row's log-sum-exp (LSE), from SDPA's own kernel.

Fused attention kernels compute, per query row ``i`` of head ``h``, the natural-log
``lse_i = log sum_j exp(scale * q_i . k_j + b_ij)`` over the keys the row may see (``b`` the
additive mask). SDPA throws it away; the LSE gate (`muonclip.attention._gate`) bounds the max
logit with it.

Where it comes from (detected, never assumed: private ops change between torch releases):

* **CPU**: ``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, key, value,
  dropout_p, is_causal, *, attn_mask, scale) -> (output, logsumexp)``, the kernel that
  ``F.scaled_dot_product_attention`` itself runs on CPU when its dispatcher picks the flash
  backend. `sdpa_with_lse` uses it only when (1) the op exists with exactly that schema
  (argument names and two returns; `cpu_lse_op`), and (2) for this very call the dispatcher
  would pick that kernel (``torch._fused_sdp_choice`` returns the flash backend: float
  inputs, no dropout, 4-D tensors, ...). It then passes what SDPA passes: a boolean mask
  converted to an additive one (0 where allowed, ``-inf`` elsewhere) in the query's dtype.
  Same kernel, same inputs: the output and its gradients are those of
  ``F.scaled_dot_product_attention`` bit for bit (``tests/test_attention_gate.py`` checks it).
* **CUDA**: the op ``F.scaled_dot_product_attention`` itself runs there, picked the way SDPA
  picks it (``torch._fused_sdp_choice``), each used only when its schema is the one this module
  calls (`cuda_lse_op`): cuDNN (``_scaled_dot_product_cudnn_attention``, LSE ``(B, H, Tq, 1)``),
  memory-efficient (``_scaled_dot_product_efficient_attention``, LSE padded to a multiple of 32
  rows, sliced off) and flash (``_scaled_dot_product_flash_attention``). The inputs are what
  SDPA hands that op: a boolean mask turned additive in the query's dtype; for the efficient
  kernel a mask whose strides are not multiples of 16 padded and sliced back (a view with
  aligned strides) and expanded to ``(B, H, Tq, Tk)``; for flash a head dim padded to a
  multiple of 8 (the scale computed from the original one) and the output sliced back. The
  LSE is asked for (``compute_log_sumexp=True``) even where SDPA would skip it: only on a
  training forward, where SDPA computes it too. Bit-equality with SDPA on a GPU is checked by
  ``tests/test_attention_gate.py`` (CUDA-only tests).
* **Anything else** (an older or newer torch whose op differs, dropout, a call SDPA would run
  with its math backend, another device): `sdpa_with_lse` returns None and the caller computes
  the exact max of every head.
"""

from __future__ import annotations

import math
from functools import cache, lru_cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .call import AttentionCall

# the ints torch._fused_sdp_choice returns (torch.nn.attention.SDPBackend)
_FLASH, _EFFICIENT, _CUDNN = 1, 2, 3
# per op: (name, its arguments in order, the keyword-only ones, the least number of returns)
_CPU_OP = ("_scaled_dot_product_flash_attention_for_cpu",
           ("query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"), ("attn_mask", "scale"), 2)
_CUDA_OPS = {
    _FLASH: ("_scaled_dot_product_flash_attention",
             ("query", "key", "value", "dropout_p", "is_causal", "return_debug_mask", "scale"), ("scale",), 2),
    _EFFICIENT: ("_scaled_dot_product_efficient_attention",
                 ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal", "scale"),
                 ("scale",), 2),
    _CUDNN: ("_scaled_dot_product_cudnn_attention",
             ("query", "key", "value", "attn_bias", "compute_log_sumexp", "dropout_p", "is_causal",
              "return_debug_mask", "scale"), ("scale",), 2),
}


def schema_matches(op: Any, spec: tuple = _CPU_OP) -> bool:
    """Whether ``op`` (an ``OpOverloadPacket``) has the schema ``spec`` names (default: the CPU
    flash op's, ``(query, key, value, dropout_p, is_causal, *, attn_mask, scale)`` with two
    returns): the same arguments in the same order, the same keyword-only ones, and at least the
    returns this module reads (output and LSE first)."""
    _, args, kw, n_returns = spec
    try:
        schema = op.default._schema
    except (AttributeError, RuntimeError):
        return False
    names = tuple(a.name for a in schema.arguments)
    kw_only = tuple(a.name for a in schema.arguments if a.kwarg_only)
    return names == args and kw_only == kw and len(schema.returns) >= n_returns


@lru_cache(maxsize=1)
def cpu_lse_op() -> Any | None:
    """The CPU flash-attention op returning ``(output, logsumexp)``, or None when this torch has
    no op of that name and schema (then the drop-in computes the exact max on every call)."""
    op = getattr(torch.ops.aten, _CPU_OP[0], None)
    if op is None or not schema_matches(op, _CPU_OP) or not hasattr(torch, "_fused_sdp_choice"):
        return None
    return op


@cache
def cuda_lse_op(backend: int) -> Any | None:
    """The CUDA op of SDPA backend ``backend`` (1 flash, 2 efficient, 3 cuDNN) that returns the
    LSE, or None when this torch has none of that name and schema."""
    spec = _CUDA_OPS.get(backend)
    op = None if spec is None else getattr(torch.ops.aten, spec[0], None)
    if op is None or not schema_matches(op, spec) or not hasattr(torch, "_fused_sdp_choice"):
        return None
    return op


def sdpa_choice(call: AttentionCall) -> int:
    """The backend SDPA's dispatcher picks for this call (-1 where it cannot be asked)."""
    try:
        choice = torch._fused_sdp_choice(call.query, call.key, call.value, call.attn_mask, call.dropout_p,
                                         call.is_causal, scale=call.scale, enable_gqa=call.enable_gqa)
    except (TypeError, RuntimeError):  # an older signature, or inputs the dispatcher refuses
        return -1
    return int(choice)


def additive_mask(attn_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """SDPA's boolean-mask conversion: 0 where allowed, ``-inf`` elsewhere, in ``dtype``."""
    if attn_mask is None or attn_mask.dtype != torch.bool:
        return attn_mask
    return torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device).masked_fill_(~attn_mask, -math.inf)


def _aligned_bias(bias: Tensor, query: Tensor, key: Tensor) -> Tensor:
    """SDPA's mask preparation for the efficient kernel: strides multiples of 16 (else the last
    dim padded to a multiple of 16 and sliced back: same values, aligned rows), then expanded to
    ``(B, H, Tq, Tk)``."""
    if bias.stride(-1) != 1 or any(st % 16 for st in bias.stride()[:-1]):
        n = bias.shape[-1]
        bias = F.pad(bias, (0, 16 - n % 16))[..., :n]
    return bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])


def _cuda_sdpa_with_lse(call: AttentionCall) -> tuple[Tensor, Tensor] | None:
    if call.dropout_p != 0.0:
        return None
    choice = sdpa_choice(call)
    op = cuda_lse_op(choice)
    if op is None:
        return None
    query, key, value, scale, is_causal = call.query, call.key, call.value, call.scale, call.is_causal
    B, H, Tq, _ = query.shape
    bias = additive_mask(call.attn_mask, query.dtype)
    if choice == _CUDNN:
        res = op(query, key, value, bias, True, 0.0, is_causal, False, scale=scale)
        return res[0], res[1].reshape(B, H, Tq)
    if choice == _EFFICIENT:
        bias = None if bias is None else _aligned_bias(bias, query, key)
        res = op(query, key, value, bias, True, 0.0, is_causal, scale=scale)
        return res[0], res[1][..., :Tq]
    # flash: no mask (the dispatcher never picks it with one); head dims padded to multiples of 8
    dv = value.shape[-1]
    q, k, v = (F.pad(t, (0, -t.shape[-1] % 8)) if t.shape[-1] % 8 else t for t in (query, key, value))
    res = op(q, k, v, 0.0, is_causal, False, scale=call.softmax_scale)
    out = res[0][..., :dv] if dv % 8 else res[0]
    return out, res[1]


def sdpa_with_lse(call: AttentionCall) -> tuple[Tensor, Tensor] | None:
    """``F.scaled_dot_product_attention``'s output and the kernel's LSE, or None where unavailable.

    Args:
        call: the attention call (`AttentionCall`; its ``sinks`` and token masks are not read).

    Returns:
        ``(output (B, Hq, Tq, Dv), lse (B, Hq, Tq))``: the output is SDPA's (same kernel, same
        inputs, same autograd graph); ``lse`` is the natural-log LSE of each row's scaled,
        masked scores, float32 (a row with no allowed key holds whatever its kernel writes
        there: 0 on CPU, ``finfo.min`` for an ``finfo.min`` mask, ``-inf`` or NaN on some CUDA
        kernels; the gate only ever loses tightness or sends the head to the exact path for
        it). None when the call cannot run on that kernel (see the module docstring).
    """
    query = call.query
    if query.ndim != 4:
        return None
    if query.device.type == "cuda":
        return _cuda_sdpa_with_lse(call)
    op = cpu_lse_op() if query.device.type == "cpu" else None
    if op is None or sdpa_choice(call) != _FLASH:
        return None
    out, lse = op(query, call.key, call.value, call.dropout_p, call.is_causal,
                  attn_mask=additive_mask(call.attn_mask, query.dtype), scale=call.scale)
    return out, lse
