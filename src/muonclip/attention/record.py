"""The recording path: every attention call that may feed QK-Clip goes through `attend`.

Every entry point (the drop-in `muonclip.scaled_dot_product_attention`, and through it the
reference GPT; the Hugging Face ``"muonclip"`` attention function; the torchtitan SDPA,
FlexAttention and varlen recorders) describes its call as an `muonclip.attention.call.AttentionCall` and
its attention kernel as a `Kernel`, and calls `attend`, which

1. asks the forward rule which recorders the call feeds
   (`muonclip.attention.forward_rule.recorders_to_feed`: the layer's own on a training forward,
   those of active monitors); none: the kernel runs alone, nothing else is computed;
2. chooses, in `maxima` and nowhere else, how the call's per-head max logits are computed
   (the backend, `set_max_logit_backend`):

   * the kernel's own row maxima, where it returns them (FlexAttention's ``max_scores``): the
     ``"flex"`` backend of the SDPA kernel, and kernels that describe their pairs only to
     themselves (a block mask);
   * the LSE gate (``"gated"``, the default) where every recorder has a threshold, the kernel
     returns its log-sum-exp, and the gate pays (`gate_pays`; never inside ``torch.compile``):
     `muonclip.attention.gated_max_logits`;
   * else the exact max (``"chunked"``): `muonclip.attention.exact_max_logits` (one Triton
     kernel on a GPU, `chunked_max_logits` elsewhere);

   always over the pairs of the pair rule (`muonclip.attention.pairs`: allowed by the mask,
   real queries, real keys); and
3. feeds the recorders, in `feed` and nowhere else, outside selective activation
   checkpointing's dispatch modes.

A new attention kernel joins by implementing `Kernel`: `Kernel.run` returns its output and,
when asked, its LSE; `Kernel.run_with_row_max` its row maxima where it computes them in the same
kernel. Nothing else changes. A varlen kernel (packed documents, torchtitan's
``VarlenAttention``: `muonclip.integrations.torchtitan_attention.VarlenKernel`) describes its
documents in the call (``cu_seq_lens``); the gate and the exact max then work document by
document (`muonclip.attention.documents`).

**Backends** (`set_max_logit_backend`):

* ``"gated"`` (default): when every recorder fed by the call has a threshold (the clip's tau,
  which `MuonClip` sets) and the kernel returns its log-sum-exp (`muonclip.attention._lse`: the
  CPU flash kernel; on CUDA the cuDNN, memory-efficient and flash kernels), the LSE bounds every
  head's max, and only heads whose bound passes the threshold get their exact max
  (`muonclip.attention._gate`; on a GPU the gate runs inside the Triton max-logit kernel, per
  block of query rows: no host sync). Clip decisions and gammas are those of the exact path.
  Anywhere else (a recorder without a threshold, a monitor, dropout, a call SDPA runs with its
  math backend, a torch without those kernels, on a GPU a call too small for the gate to pay:
  `gate_pays`, and any call inside ``torch.compile``, where choosing heads by their bound would
  be a data-dependent graph break) it is ``"chunked"``.
* ``"chunked"``: the kernel, then the exact max of every head: on CPU (or without Triton)
  `muonclip.attention.chunked_max_logits` (bounded memory; never the full
  ``(B, H, Tq, Tk)`` scores at once), on a CUDA GPU the same computation in one Triton kernel
  (`muonclip.attention._triton_max_logits`). About one more causal ``Q K^T`` per call.
* ``"flex"`` (CUDA): eligible SDPA calls (no dropout, no sinks, no mask or a boolean mask, no
  key-side token mask) run FlexAttention, which returns output and row maxima from one fused
  kernel. FlexAttention is compiled with ``dynamic=False``: each new (shape, dtype, mask kind)
  compiles once, and past dynamo's ``recompile_limit`` (8 by default) it runs unfused, still
  correct (raise ``torch._dynamo.config.recompile_limit`` for many sequence lengths). The output
  is the FlexAttention kernel's, equal to SDPA's within kernel round-off, not bit-identical.
  That path is opt-in; its CUDA test runs in `benchmarks/gpu_check.sh`. Other calls fall back
  to ``"gated"``.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import Tensor

from . import _triton_max_logits as triton_max
from ._gate import exact_max_logits, gated_max_logits
from ._lse import sdpa_with_lse
from ._max_logits import flex_attention_with_max, flex_available
from ._recorder import MaxLogitRecorder
from .call import AttentionCall
from .forward_rule import recorders_to_feed, unseen_by_selective_checkpointing
from .sinks import attention_with_sinks

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


class Kernel(ABC):
    """How an attention call computes its output, and what it can return besides.

    Subclasses implement `run`; a kernel that computes each query row's max logit in the same
    pass implements `run_with_row_max`; one whose pairs only it knows (a block mask the call's
    ``attn_mask`` cannot express), or whose row maxima cost nothing (it materialises the scores),
    sets ``row_max_only``, and then `run_with_row_max` must succeed.
    """

    row_max_only = False
    """True when the max is to come from the kernel itself (`run_with_row_max`): the call's
    ``attn_mask`` / ``is_causal`` do not describe the kernel's pairs, or the kernel has its row
    maxima for free."""

    @abstractmethod
    def run(self, call: AttentionCall, lse: bool) -> tuple[Tensor, Tensor | None]:
        """``(output (B, Hq, Tq, Dv), lse)``: the attention output and, when ``lse`` is asked for
        and the kernel has it, each row's natural-log log-sum-exp ``(B, Hq, Tq)`` (else None)."""

    def run_with_row_max(self, call: AttentionCall) -> tuple[Tensor, Tensor] | None:
        """``(output, row_max (B, Hq, Tq))``, each row's max of ``scale * q.k`` over the pairs
        the kernel allows, from the same kernel; None where this call cannot have it."""
        return None


class SDPAKernel(Kernel):
    """``F.scaled_dot_product_attention`` (with sinks: `muonclip.attention.sinks`); the LSE from
    the op SDPA runs (`muonclip.attention._lse`); row maxima from FlexAttention with the
    ``"flex"`` backend on CUDA."""

    def run(self, call: AttentionCall, lse: bool) -> tuple[Tensor, Tensor | None]:
        if call.cu_seq_lens is not None:
            raise ValueError("SDPA has no packed documents: a call with cu_seq_lens needs a varlen kernel "
                             "(muonclip.integrations.torchtitan_attention.VarlenKernel)")
        if call.sinks is not None:
            out, row_lse = attention_with_sinks(call)
            return out, row_lse if lse else None
        if lse:
            with_lse = sdpa_with_lse(call)
            if with_lse is not None:
                return with_lse
        return F.scaled_dot_product_attention(call.query, call.key, call.value, **call.sdpa_kwargs()), None

    def run_with_row_max(self, call: AttentionCall) -> tuple[Tensor, Tensor] | None:
        if (
            call.dropout_p != 0.0
            or call.sinks is not None
            or call.real_keys is not None
            or (call.attn_mask is not None and call.attn_mask.dtype != torch.bool)
            or not flex_available(call.query)
        ):
            return None
        return flex_attention_with_max(call.query, call.key, call.value, call.attn_mask, call.is_causal, call.scale,
                                       call.enable_gqa)


SDPA = SDPAKernel()


def attend(call: AttentionCall, recorder: MaxLogitRecorder | None, training: bool, kernel: Kernel = SDPA) -> Tensor:
    """Run ``kernel`` on ``call``; on a call that feeds recorders (step 1 of the module
    docstring), compute its per-head max logits (`maxima`) and feed them (`feed`).

    Args:
        call: the attention call.
        recorder: the calling layer's `MaxLogitRecorder` (``n_heads == Hq``), or None (nothing
            recorded).
        training: the calling module's ``training`` flag (`muonclip.attention.forward_rule`).
        kernel: the attention kernel (default: SDPA, `SDPAKernel`).

    Returns:
        The kernel's output ``(B, Hq, Tq, Dv)``.

    Raises:
        ValueError: the recorder's head count is not the query's, or shapes do not fit.
    """
    if recorder is not None:
        hq, _ = call.heads()
        if len(recorder.heads) != hq:
            raise ValueError(f"recorder records {len(recorder.heads)} heads but query has {hq} heads")
    targets = recorders_to_feed(recorder, training)
    if not targets:  # no recorder, or evaluation / generation with no monitor watching: no max to compute
        return kernel.run(call, lse=False)[0]
    out, per_head, is_bound = maxima(call, targets, kernel)
    feed(targets, per_head, is_bound)
    return out


def maxima(call: AttentionCall, targets: list[MaxLogitRecorder], kernel: Kernel = SDPA) -> tuple[
        Tensor, Tensor, Tensor | None]:
    """The kernel's output and the call's per-head max logits, by the backend (module docstring).

    Returns:
        ``(output, per_head (Hq,) float32, is_bound (Hq,) bool or None)``: ``is_bound`` True where
        the value is an upper bound at or below every recorder's threshold (the LSE gate).
    """
    if kernel.row_max_only or _backend == "flex":
        with_max = kernel.run_with_row_max(call)
        if with_max is not None:
            out, rows = with_max
            with unseen_by_selective_checkpointing():
                return out, row_maxima_per_head(call, rows), None
        if kernel.row_max_only:
            raise ValueError(f"{type(kernel).__name__} describes its pairs only to itself, so the max logit must come "
                             "from its own row maxima, which this call cannot have (a key-side token mask?)")
    threshold = call_threshold(targets) if gating(call) else None
    out, lse = kernel.run(call, lse=threshold is not None)
    with unseen_by_selective_checkpointing():
        if lse is not None:
            per_head, is_bound = gated_max_logits(call, lse, threshold)
            return out, per_head, is_bound
        return out, exact_max_logits(call), None


def row_maxima_per_head(call: AttentionCall, rows: Tensor) -> Tensor:
    """``(Hq,)`` float32: the max over batch and the rows of real queries of a kernel's row
    maxima ``(B, Hq, Tq)`` (``-inf`` for a head without any)."""
    rows = rows.detach().float()
    if call.real_queries is not None:
        rows = rows.masked_fill(~call.real_queries.to(torch.bool)[:, None, :], -math.inf)
    if rows.numel() == 0:
        return torch.full((rows.shape[1],), -math.inf, device=rows.device)
    return rows.amax(dim=(0, 2))


def feed(targets: list[MaxLogitRecorder], per_head: Tensor, is_bound: Tensor | None) -> None:
    """Fold one call's per-head maxima into every recorder the call feeds (no host sync)."""
    with unseen_by_selective_checkpointing():
        for target in targets:
            target.update(per_head, is_bound)


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


def gating(call: AttentionCall) -> bool:
    """Whether this call may take the LSE gate: the ``"gated"`` (or ``"flex"``) backend, a call where
    the gate pays (`gate_pays`; always for packed documents, whose exact max is a loop over the
    documents), and not inside ``torch.compile``: there the gate's choice of heads
    would be a data-dependent graph break, so a compiled forward computes every head's exact max
    (the same clip decisions)."""
    return _backend != "chunked" and not torch.compiler.is_compiling() and (
        call.cu_seq_lens is not None or gate_pays(call.query, call.key))


def call_threshold(targets: list[MaxLogitRecorder]) -> float | None:
    """The threshold one call may gate with: the smallest of its recorders', None when any has none."""
    thresholds = [t.threshold for t in targets]
    return None if any(t is None for t in thresholds) else min(thresholds)


__all__ = [
    "BACKENDS", "GPU_GATE_MIN_WORK", "SDPA", "Kernel", "SDPAKernel", "attend", "call_threshold", "feed", "gate_pays",
    "gating", "get_max_logit_backend", "maxima", "row_maxima_per_head", "set_max_logit_backend",
]
