r"""Forward equality, checked: on its first training forward, each attached layer also runs the
attention the model had before `muonclip.integrations.hf.attach`, and the outputs must agree.

The ``"muonclip"`` attention function (`muonclip.integrations.hf_attention`) is written to compute
what the model's own attention computes; this check makes that a measured fact for the model
at hand rather than an assumption. `attach` gives every attention module a `ForwardCheck`
holding the *reference*: the implementation the model was set to (``"sdpa"``: transformers'
``sdpa_attention_forward``; ``"eager"``, and any other implementation (flash, flex, ...): the
module's own ``eager_attention_forward``, the reference every transformers family ships). On the
module's first training forward (``module.training`` and grad enabled: the forward that feeds the
clip), the attention function hands its inputs and its output to `ForwardCheck.run`, which

1. picks the rows to compare: the whole call when its score matrix has at most
   `CHECK_SCORES` entries, else the first batch rows and evenly spaced query rows so that it
   does (attention rows are independent given the keys);
2. writes the mask as the reference receives it from transformers: the boolean mask for
   ``"sdpa"``, ``0`` / ``finfo.min`` for eager, the causal rule spelt out where the call had
   no mask;
3. runs the reference on the same query, key, value and keywords (dropout 0), under
   ``torch.no_grad``; in float32 for 16-bit inputs, and then also recomputes the
   ``"muonclip"`` output in float32 (without recording), so that the comparison measures
   semantics rather than the two kernels' bf16 round-off; with dropout on, the ``"muonclip"``
   output is also recomputed without dropout;
4. compares every row that sees at least one key (a row with none has no defined output:
   eager spreads it uniformly, SDPA writes zeros) and raises `AttentionMismatchError` when

\[
\max |o - o_\text{ref}| > 16\, u\, (1 + L)\, \max |v|, \qquad
L = \text{scale} \cdot \max_i \lVert q_i\rVert \max_j \lVert k_j\rVert \ (+ \max |\text{sink}|)
\]

   (\(u\) the unit round-off of the compared dtype; \(L\) bounds every logit, so \(u L\) bounds
   the softmax's round-off). A dropped sink, a lost mask or a wrong scale changes outputs by a
   fraction of \(\max|v|\), far above this.

A module that runs a training forward without calling the attention function at all while its
model is switched to it (it does not dispatch through transformers' ``AttentionInterface`` on
that path) raises too: its max logits would never be recorded. Each check runs once; `pending`
is then False and the hook is removed. The cost is one reference attention call per layer, once, on at most
`CHECK_SCORES` scores (``benchmarks/bench_hf_overhead.py`` measures it). Under ``torch.compile``
the check is one opaque custom op in the graph (`forward_check`): the compiled first training
forward hands it the call's tensors and plain keywords, it compares when the graph runs and
raises from there, and no forward breaks its graph; the forward after the check recompiles once
without it. Turning it off is an explicit choice: ``attach(model, verify_attention=False)``,
then ``MuonClip(model, layers=that)``.
"""

from __future__ import annotations

import ast
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..attention.forward_rule import is_training_forward
from ..attention.pairs import allowed_pairs
from .hf_attention import ATTN_IMPLEMENTATION, TOKENS_KWARG, attend, layer_name

CHECK_SCORES = 1 << 22
"""Largest score matrix (batch rows x heads x query rows x keys) the check computes per layer."""


class AttentionMismatchError(RuntimeError):
    """The ``"muonclip"`` attention function computed something other than the model's own attention."""


def reference_function(module: nn.Module, implementation: str | None) -> tuple[str, Callable]:
    """``(name, function)`` of the attention ``module`` ran with ``implementation`` before attaching:
    transformers' SDPA function for ``"sdpa"``, else the module's ``eager_attention_forward``.

    Raises:
        ValueError: an eager reference is needed and the module's modeling file defines none.
    """
    if implementation == "sdpa":
        return "sdpa", ALL_ATTENTION_FUNCTIONS["sdpa"]
    for cls in type(module).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "eager_attention_forward", None)
        if callable(fn):
            return "eager", fn
    raise ValueError(
        f"attention layer '{layer_name(module)}' ({type(module).__name__}): its modeling file defines no "
        "eager_attention_forward to check the 'muonclip' attention function against. Pass "
        "attach(model, verify_attention=False) to attach without the check."
    )


def _rows(b: int, heads: int, tq: int, tk: int) -> tuple[int, Tensor | None]:
    """How many batch rows, and which query rows (None: all), keep the scores within `CHECK_SCORES`."""
    per_batch = heads * tq * tk
    if b * per_batch <= CHECK_SCORES:
        return b, None
    nb = max(1, CHECK_SCORES // per_batch)
    if nb > 1 or per_batch <= CHECK_SCORES:
        return min(nb, b), None
    nq = max(1, CHECK_SCORES // (heads * tk))
    return 1, torch.linspace(0, tq - 1, nq).round().long().unique()


def _allowed(mask: Tensor | None, is_causal: bool, nb: int, tq: int, tk: int, device: torch.device) -> Tensor:
    """``(nb, 1 or H, tq, tk)`` boolean "pair allowed" of the call's first ``nb`` batch rows (the causal
    rule spelt out where the call had no mask)."""
    if mask is None:
        allowed = torch.ones(tq, tk, dtype=torch.bool, device=device)
        return (allowed.tril() if is_causal else allowed).expand(nb, 1, tq, tk)
    m = allowed_pairs(mask)
    m = m.reshape((1,) * (4 - m.ndim) + tuple(m.shape))
    return (m[:nb] if m.shape[0] > 1 else m).expand(nb, m.shape[1], tq, tk)


class ForwardCheck:
    """The one-time forward-equality check of one attention module (module docstring).

    Args:
        module: the attention module.
        implementation: the model's attention implementation before attaching (``"sdpa"``,
            ``"eager"``, ...), which picks the reference (`reference_function`).

    Attributes:
        implementation: as given.
        reference: ``"sdpa"`` or ``"eager"``.
        pending: True until the check has run (then False: it never runs again).
        max_error, tolerance: the figures of the comparison once it ran (None before).
    """

    def __init__(self, module: nn.Module, implementation: str | None) -> None:
        self.implementation = implementation
        self.reference, self._fn = reference_function(module, implementation)
        self.pending = True
        self.max_error: float | None = None
        self.tolerance: float | None = None
        self._module = module
        self._hook = module.register_forward_hook(self._after_forward)
        _CHECKS[id(self)] = self

    def close(self) -> None:
        """Stop checking (the check ran, or the module is detached). Inside ``torch.compile`` the
        hook is left in place (a no-op from now on) and removed by the next eager forward."""
        self.pending = False
        if not torch.compiler.is_compiling() and self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self.pending:
            self.close()
            return
        switched = getattr(getattr(module, "config", None), "_attn_implementation", ATTN_IMPLEMENTATION)
        if is_training_forward(module.training) and switched == ATTN_IMPLEMENTATION:
            raise AttentionMismatchError(
                f"attention layer '{layer_name(module)}' ({type(module).__name__}) ran a training forward without "
                f"calling the '{ATTN_IMPLEMENTATION}' attention function (it does not dispatch through transformers' "
                "AttentionInterface on this path), so its max logits would never be recorded and its clip never "
                "run. Leave this layer out: MuonClip(model, layers=[...])."
            )

    def run(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
            dropout: float, scaling: float | None, is_causal: bool | None, kwargs: dict[str, Any],
            out: Tensor) -> Tensor:
        """Compare ``out`` (the ``"muonclip"`` output ``(B, Tq, H, Dv)``) with the reference on a training
        forward (module docstring); a no-op on any other forward. Returns ``out`` (inside
        ``torch.compile``: its copy, through the check's custom op). Raises `AttentionMismatchError`."""
        if not (self.pending and is_training_forward(module.training)):
            return out
        self.close()
        if torch.compiler.is_compiling():  # the comparison runs when the graph runs, as one opaque op
            plain = repr(tuple((k_, v_) for k_, v_ in kwargs.items()
                               if isinstance(v_, (bool, int, float, str, type(None)))))
            return torch.ops.muonclip.forward_check(
                out, query, key, value, attention_mask, kwargs.get("s_aux"), id(self), float(dropout), scaling,
                is_causal, plain)
        with torch.no_grad():
            self._compare(module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs, out)
        return out

    def _compare(self, module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                 dropout: float, scaling: float | None, is_causal: bool | None, kwargs: dict[str, Any],
                 out: Tensor) -> None:
        B, H, tq, D = query.shape
        causal = bool(tq > 1 and attention_mask is None and (
            is_causal if is_causal is not None else getattr(module, "is_causal", True)))
        if causal and key.shape[2] > tq:  # as the attention function: keys cropped to the queries
            key, value = key[:, :, :tq], value[:, :, :tq]
        tk = key.shape[2]
        nb, rows = _rows(B, H, tq, tk)
        allowed = _allowed(attention_mask, causal, nb, tq, tk, query.device)
        q = query[:nb]
        if rows is not None:
            q, allowed = q[:, :, rows], allowed[:, :, rows]
        k, v = key[:nb], value[:nb]
        dtype = query.dtype if query.dtype in (torch.float32, torch.float64) else torch.float32
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        sinks = kwargs.get("s_aux")
        if attention_mask is not None and attention_mask.dtype != torch.bool:  # an additive mask: its values
            bias = attention_mask.reshape((1,) * (4 - attention_mask.ndim) + tuple(attention_mask.shape))
            bias = (bias[:nb] if bias.shape[0] > 1 else bias).expand(nb, bias.shape[1], tq, tk).to(dtype)
            ref_mask = bias[:, :, rows] if rows is not None else bias
            ours_mask = ref_mask
        else:
            ours_mask = allowed
            ref_mask = allowed if self.reference == "sdpa" else torch.zeros(
                allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, torch.finfo(dtype).min)
        ref_kwargs = {k_: v_ for k_, v_ in kwargs.items() if k_ not in ("is_causal", TOKENS_KWARG)}
        ref = self._fn(module, q, k, v, ref_mask, dropout=0.0, scaling=scaling, **ref_kwargs)[0]  # (nb, tq', H, Dv)
        if dtype == query.dtype and dropout == 0.0 and rows is None:
            ours = out[:nb]
        else:
            ours = attend(module, q, k, v, ours_mask, 0.0, scaling, False,
                          None if sinks is None else sinks.to(dtype), None)
        live = allowed.any(-1).expand(nb, H, allowed.shape[2]).transpose(1, 2)  # (nb, tq', H)
        err = (ours.to(dtype) - ref.to(dtype)).abs().amax(-1)[live]
        scale = (scaling if scaling is not None else D ** -0.5)
        logit = abs(scale) * q.norm(dim=-1).amax() * k.norm(dim=-1).amax()
        if sinks is not None:
            logit = logit + sinks.detach().abs().amax().to(logit)
        u = torch.finfo(dtype).eps / 2
        self.tolerance = float(16 * u * (1 + logit) * v.abs().amax().clamp(min=1e-30))
        self.max_error = float(err.amax()) if err.numel() else 0.0
        if not self.max_error <= self.tolerance:
            raise AttentionMismatchError(
                f"attention layer '{layer_name(module)}' ({type(module).__name__}): the '{ATTN_IMPLEMENTATION}' "
                f"attention function's output differs from the model's own '{self.reference}' attention by "
                f"{self.max_error:.3g} (tolerance {self.tolerance:.3g}) on its first training forward, so "
                "attaching MuonClip would change what this model computes. Keywords of the call: "
                f"{sorted(kwargs)}. Train it with plain muonclip.Muon (and report the family); to attach "
                "anyway, attach(model, verify_attention=False)."
            )


_CHECKS: weakref.WeakValueDictionary[int, ForwardCheck] = weakref.WeakValueDictionary()
"""Every live `ForwardCheck` by id: how `forward_check` finds its check when a compiled graph runs."""


@torch.library.custom_op("muonclip::forward_check", mutates_args=())
def forward_check(out: Tensor, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                  sinks: Tensor | None, check: int, dropout: float, scaling: float | None, is_causal: bool | None,
                  keywords: str) -> Tensor:
    """The one-time check inside a compiled graph: an opaque op (no graph break) that runs
    `ForwardCheck` number ``check``'s comparison eagerly when the graph runs, on the call's tensors
    and its keywords (``s_aux`` as ``sinks``; the others that are plain values as ``keywords``, the
    ``repr`` of their ``(name, value)`` pairs), and returns a copy of ``out`` (so that the graph
    keeps the op; its gradient passes through unchanged). Raises `AttentionMismatchError`."""
    found = _CHECKS.get(check)
    if found is not None:
        kwargs = dict(ast.literal_eval(keywords))
        if sinks is not None:
            kwargs["s_aux"] = sinks
        with torch.no_grad():
            found._compare(found._module, query, key, value, attention_mask, dropout, scaling, is_causal, kwargs, out)
    return out.clone()


@forward_check.register_fake
def _(out: Tensor, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, sinks: Tensor | None,
      check: int, dropout: float, scaling: float | None, is_causal: bool | None, keywords: str) -> Tensor:
    return torch.empty_like(out)


def _forward_check_backward(ctx: Any, grad: Tensor) -> tuple:
    return (grad,) + (None,) * 10


forward_check.register_autograd(_forward_check_backward)


__all__ = ["CHECK_SCORES", "AttentionMismatchError", "ForwardCheck", "forward_check", "reference_function"]
