"""`scaled_dot_product_attention`: a drop-in for ``F.scaled_dot_product_attention`` that also
records each query head's max logit into a `MaxLogitRecorder` (docs/design.md, "QK-Clip").

Without a recorder it is exactly ``F.scaled_dot_product_attention``. With one, the output is
still SDPA's (same kernel, same autograd graph) and, on a training forward (``training`` true
and grad mode on: the rule of `muonclip.attention.forward_rule`), the per-head max of
``scale * q.k`` over allowed pairs and over the batch is folded into the recorder's running
max, which the next QK-Clip consumes. Any other call (evaluation, generation, anything under
``torch.no_grad``) leaves the recorder alone and computes no max, unless a `MaxLogitMonitor`
watching the layer is active, which then receives it.

How the max is computed (`set_max_logit_backend`):

* ``"gated"`` (default): when every recorder fed by the call has a threshold (the clip's tau,
  which `MuonClip` sets) and SDPA runs on a kernel that returns its log-sum-exp
  (`muonclip.attention.lse`: the CPU flash kernel; on CUDA the cuDNN, memory-efficient and
  flash kernels), the output and the LSE come from that kernel, the LSE bounds every head's
  max, and only heads whose bound passes the threshold get their exact max
  (`muonclip.attention.gate`; on a GPU the gate runs inside the Triton max-logit kernel, per
  block of query rows: no host sync). Clip decisions and gammas are those of the exact path;
  heads far below tau cost a max over the LSE. Anywhere else (a recorder without a threshold,
  a monitor, dropout, a call SDPA runs with its math backend, a torch without those kernels,
  on a GPU a call too small for the gate to pay: `gate_pays`, and any call inside
  ``torch.compile``, where choosing heads by their bound would be a data-dependent graph break)
  it is ``"chunked"``.
* ``"chunked"``: SDPA, then the exact max of every head: on CPU (or without Triton)
  `muonclip.attention.max_logits.chunked_max_logits` (bounded memory; never the full
  ``(B, H, Tq, Tk)`` scores at once), on a CUDA GPU the same computation in one Triton kernel
  (`muonclip.attention.triton_max_logits`). About one more causal ``Q K^T`` per call.
* ``"flex"`` (CUDA): eligible calls (no dropout, no mask or a boolean mask) run FlexAttention,
  which returns output and row maxima from one fused kernel. FlexAttention is compiled with
  ``dynamic=False``: each new (shape, dtype, mask kind) compiles once, and past dynamo's
  ``recompile_limit`` (8 by default) it runs unfused, still correct (raise
  ``torch._dynamo.config.recompile_limit`` for many sequence lengths). The output is the
  FlexAttention kernel's, equal to SDPA's within kernel round-off, not bit-identical. That
  path is opt-in; its CUDA test runs in `benchmarks/gpu_check.sh`. Other calls fall back to
  ``"gated"``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from . import triton_max_logits as triton_max
from .forward_rule import recorders_to_feed, unseen_by_selective_checkpointing
from .gate import exact_max_logits, gated_max_logits
from .lse import sdpa_with_lse
from .max_logits import check_shapes, flex_attention_with_max, flex_available
from .running_max import MaxLogitRecorder
from .sinks import sink_attention

BACKENDS = ("gated", "chunked", "flex")
_backend = "gated"


def set_max_logit_backend(name: str) -> None:
    """Choose how recorded max logits are computed (module docstring): ``"gated"`` (default; the
    LSE gate where the kernel returns the LSE and the recorders know tau, else exact),
    ``"chunked"`` (always exact, one more ``Q K^T``; one Triton kernel on a GPU) or ``"flex"``
    (CUDA only; falls back to ``"gated"`` where FlexAttention is unavailable, the mask is
    additive, or dropout is on)."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"max-logit backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


def get_max_logit_backend() -> str:
    """The current max-logit backend name."""
    return _backend


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    sinks: Tensor | None = None,
    recorder: MaxLogitRecorder | None = None,
    training: bool = True,
) -> Tensor:
    """``F.scaled_dot_product_attention`` that also records per-head max logits.

    Args:
        query: ``(B, Hq, Tq, D)``.
        key: ``(B, Hkv, Tk, D)``.
        value: ``(B, Hkv, Tk, Dv)``.
        attn_mask: None (default), a boolean mask (True = attend) or an additive float mask,
            broadcastable to ``(B, Hq, Tq, Tk)``.
        dropout_p: attention dropout probability (default 0.0); does not affect the max logit.
        is_causal: top-left causal mask (default False).
        scale: softmax scale (default None: ``1 / sqrt(D)``).
        enable_gqa: key/value heads shared by ``Hq // Hkv`` consecutive query heads (default False).
        sinks: ``(Hq,)`` learned sink logits, one per query head, that join every row's softmax
            denominator with no value (GPT-OSS's ``sinks``; default None: no sink). Computed by
            `muonclip.attention.sinks.sink_attention` (fused; its gradient reaches ``sinks``).
            The recorded max logit stays the max of ``scale * q.k``: a sink is not a product of
            the query and key projections.
        recorder: the calling layer's `MaxLogitRecorder`, with ``n_heads == Hq`` (default
            None: plain SDPA). On a training forward it receives the max over the batch,
            queries and allowed keys of ``scale * q.k`` per query head (after whatever RoPE the
            caller applied; an additive mask's finite bias is not included; fully masked rows
            contribute ``-inf``). If the recorder has a ``threshold`` (the clip's tau), heads
            that provably stay at or below it may be recorded as an upper bound instead
            (``"gated"`` backend; `MaxLogitRecorder.bounded` says which).
        training: whether the calling module is in training mode: pass ``self.training``, as
            for ``F.dropout`` (default True). The recorder is fed only when ``training`` is
            true and grad mode is on (``torch.is_grad_enabled()``); see
            `muonclip.attention.forward_rule` for the rule and gradient checkpointing.

    Returns:
        ``(B, Hq, Tq, Dv)``: the same as ``F.scaled_dot_product_attention`` (with ``sinks``: the
        same as transformers' eager sink attention).
    """
    if recorder is not None:
        hq, _ = check_shapes(query, key, enable_gqa)
        if len(recorder.heads) != hq:
            raise ValueError(f"recorder records {len(recorder.heads)} heads but query has {hq} heads")
    targets = recorders_to_feed(recorder, training)
    if sinks is not None:
        return _with_sinks(query, key, value, sinks, attn_mask, dropout_p, is_causal, scale, enable_gqa, targets)
    if not targets:  # no recorder, or evaluation / generation with no monitor watching: no max to compute
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa,
        )
    is_bound = None  # every value exact, unless the LSE gate bounds some heads
    if (
        _backend == "flex"
        and dropout_p == 0.0
        and (attn_mask is None or attn_mask.dtype == torch.bool)
        and flex_available(query)
    ):
        out, per_head = flex_attention_with_max(query, key, value, attn_mask, is_causal, scale, enable_gqa)
    else:
        threshold = call_threshold(targets) if gating(query, key) else None
        with_lse = None if threshold is None else sdpa_with_lse(
            query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
        )
        if with_lse is not None:
            out, lse = with_lse
            with unseen_by_selective_checkpointing():
                per_head, is_bound = gated_max_logits(query, key, lse, threshold, attn_mask, is_causal, scale,
                                                      enable_gqa)
        else:
            out = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                enable_gqa=enable_gqa,
            )
            with unseen_by_selective_checkpointing():
                per_head = exact_max_logits(query, key, attn_mask, is_causal, scale, enable_gqa)
    with unseen_by_selective_checkpointing():
        for target in targets:
            target.update(per_head, is_bound)
    return out


def _with_sinks(query: Tensor, key: Tensor, value: Tensor, sinks: Tensor, attn_mask: Tensor | None, dropout_p: float,
                is_causal: bool, scale: float | None, enable_gqa: bool, targets: list[MaxLogitRecorder]) -> Tensor:
    """Sink attention, recording the q.k maxima: gated on the kernel's LSE where the fused path
    gave one (it is the LSE of the q.k scores alone), else exact."""
    out, lse = sink_attention(query, key, value, sinks, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if not targets:
        return out
    threshold = call_threshold(targets) if lse is not None and gating(query, key) else None
    with unseen_by_selective_checkpointing():
        if threshold is not None:
            per_head, is_bound = gated_max_logits(query, key, lse, threshold, attn_mask, is_causal, scale,
                                                  enable_gqa)
        else:
            per_head, is_bound = exact_max_logits(query, key, attn_mask, is_causal, scale, enable_gqa), None
        for target in targets:
            target.update(per_head, is_bound)
    return out


# On a GPU the exact max is one Triton kernel, and the gate's fixed cost (the LSE-returning op's
# dispatch, a reduction over k, two small reductions: host time) only pays where that kernel has real
# work: B * Hq * Tq * Tk * D at least this (the crossover measured by benchmarks/bench_gated_capture.py,
# figures in docs/benchmarks.md). Both paths give the same decisions.
GPU_GATE_MIN_WORK = {torch.float32: 2**31, torch.float16: 2**34, torch.bfloat16: 2**34}


def gate_pays(query: Tensor, key: Tensor) -> bool:
    """Whether the LSE gate is the cheaper exact-decision path for this call: always on CPU (where
    the exact max is the chunked loop), on a GPU from `GPU_GATE_MIN_WORK` up and only where the
    Triton kernel runs (without it the gate could not skip any work there)."""
    if query.device.type == "cpu":
        return True
    if not triton_max.usable(query, key):
        return False
    B, hq, tq, d = query.shape
    return B * hq * tq * key.shape[2] * d >= GPU_GATE_MIN_WORK.get(query.dtype, 0)


def gating(query: Tensor, key: Tensor) -> bool:
    """Whether this call may take the LSE gate: the ``"gated"`` (or ``"flex"``) backend, a call where
    the gate pays (`gate_pays`), and not inside ``torch.compile``: there the gate's choice of heads
    would be a data-dependent graph break, so a compiled forward computes every head's exact max
    (the same clip decisions)."""
    return _backend != "chunked" and not torch.compiler.is_compiling() and gate_pays(query, key)


def call_threshold(targets: list[MaxLogitRecorder]) -> float | None:
    """The threshold one call may gate with: the smallest of its recorders', None when any has none."""
    thresholds = [t.threshold for t in targets]
    return None if any(t is None for t in thresholds) else min(thresholds)


__all__ = [
    "BACKENDS", "GPU_GATE_MIN_WORK", "call_threshold", "gate_pays", "gating", "get_max_logit_backend",
    "scaled_dot_product_attention", "set_max_logit_backend",
]
