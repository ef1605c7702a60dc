"""Test helpers for QK-Clip on Hugging Face models: an independent max-logit probe and the clip's footprint.

The probe is a test-only attention function registered with transformers: it captures the query
(after RoPE), key, mask and scale that the model hands to its attention function, computes
``scaling * q.k`` explicitly in float64, masked, per head, and then runs transformers' own SDPA
attention, so the model computes exactly what it computes with ``"sdpa"``. Padding queries are
left out by the batch's own 2-D attention mask (`real_tokens`), never by the library's rule.
"""

from __future__ import annotations

import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from muonclip.qkclip import GQALayout, MLALayout, Rows, StridedRows

CAPTURE = "muonclip_test_capture"
_captured: dict[int, torch.Tensor] = {}
_real: list[torch.Tensor | None] = [None]


def real_tokens(mask_2d: torch.Tensor | None) -> None:
    """The batch's 2-D attention mask (nonzero: a real token), or None: the probe's next runs leave
    out every query whose token it marks as padding (its self-attention calls over ``B x T`` tokens)."""
    _real[0] = None if mask_2d is None else mask_2d.bool()


def explicit_max(query, key, mask, scaling, causal=True, real=None):
    """Per-head max of scaling * q.k over allowed pairs of real queries ((B, Tq) bool, None: all);
    q (B, nh, Tq, D), k (B, nkv, Tk, D)."""
    nh, nkv = query.shape[1], key.shape[1]
    k = key.repeat_interleave(nh // nkv, dim=1)
    s = scaling * (query.double() @ k.double().transpose(-1, -2))  # (B, nh, Tq, Tk)
    if mask is None:  # stock sdpa uses is_causal for q_len > 1 without a mask
        tq, tk = s.shape[-2:]
        allowed = torch.ones(tq, tk, dtype=torch.bool)
        allowed = allowed.tril() if causal and tq > 1 else allowed
    else:  # a boolean mask, or an additive one (its finite values are a bias, not part of q.k)
        allowed = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
    if real is not None:
        allowed = allowed & real[:, None, :, None]
    return s.masked_fill(~allowed, float("-inf")).amax(dim=(0, 2, 3)).float()


def capture_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    causal = kwargs.get("is_causal")
    causal = causal if causal is not None else getattr(module, "is_causal", True)
    tokens, (b, tq, tk) = _real[0], (query.shape[0], query.shape[2], key.shape[2])
    real = tokens[:, tk - tq:] if tokens is not None and tokens.shape == (b, tk) and tq <= tk else None
    m = explicit_max(query, key, attention_mask, scaling, causal, real)
    for slot in (module.layer_idx, id(module)):
        prev = _captured.get(slot)
        _captured[slot] = m if prev is None else torch.maximum(prev, m)
    if kwargs.get("s_aux") is not None:  # sinks: the module's own eager attention (SDPA's function takes none)
        eager = sys.modules[type(module).__module__].eager_attention_forward
        if attention_mask is None:
            attention_mask = torch.ones(tq, tk, dtype=torch.bool, device=query.device).tril(tk - tq)[None, None]
        if attention_mask.dtype == torch.bool:
            attention_mask = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~attention_mask, torch.finfo(query.dtype).min)
        kwargs.pop("is_causal", None)
        return eager(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)


AttentionInterface.register(CAPTURE, capture_forward)
AttentionMaskInterface.register(CAPTURE, sdpa_mask)


def attention_modules(model) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in model.named_modules() if hasattr(m, "layer_idx") and type(m).__name__.endswith("Attention")}


def reference_max(model, ids, am) -> dict[str, torch.Tensor]:
    """Explicit per-head max logits of one forward on the stock SDPA path; restores the implementation."""
    impl = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    _captured.clear()
    try:
        with torch.no_grad():
            model(ids, attention_mask=am, use_cache=False)
    finally:
        model.set_attn_implementation(impl)
    return {n: _captured[m.layer_idx] for n, m in attention_modules(model).items()}


def replay_max(model, saved) -> dict[str, torch.Tensor]:
    """Max logits of each attention module re-run on its own saved inputs (so clipping layer 0
    does not change layer 1's input)."""
    impl = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    _captured.clear()
    out = {}
    try:
        with torch.no_grad():
            for n, m in attention_modules(model).items():
                args, kwargs = saved[n]
                m(*args, **kwargs)
                out[n] = _captured[m.layer_idx]
    finally:
        model.set_attn_implementation(impl)
    return out


def _with_capture(model, run):
    """Run ``run()`` with ``model`` on the capture function, then give every (sub-)model its own
    implementation back (a composite model's sub-models may differ from the top)."""
    from transformers import PreTrainedModel

    models = [m for m in model.modules() if isinstance(m, PreTrainedModel)]  # parents first
    impls = [m.config._attn_implementation for m in models]
    model.set_attn_implementation(CAPTURE)
    _captured.clear()
    try:
        with torch.no_grad():
            run()
    finally:
        for m, impl in zip(models, impls):
            m.set_attn_implementation(impl)


def probe_layer_max(model, module, ids, am) -> torch.Tensor:
    """Explicit per-head max logits of attention ``module`` in one forward of ``model`` (whose other layers
    run transformers' SDPA: ``module``'s inputs do not depend on them when it is the first layer)."""
    _with_capture(model, lambda: model(input_ids=ids, attention_mask=am, use_cache=False))
    return _captured[id(module)]


def replay_layer_max(model, module, args, kwargs) -> torch.Tensor:
    """Explicit per-head max logits of ``module`` re-run on its saved inputs."""
    _with_capture(model, lambda: module(*args, **kwargs))
    return _captured[id(module)]


def tau_between(s: torch.Tensor) -> float:
    """A tau with about half the heads of ``s`` above and half below, none within float tolerance of it."""
    v = s.sort().values
    gaps = v[1:] - v[:-1]
    mid = len(v) // 2
    i = max(range(1, len(v)), key=lambda j: (gaps[j - 1] > 1e-2, -abs(j - mid)))
    assert gaps[i - 1] > 1e-3, v
    return float(v[i - 1] + v[i]) / 2


def save_attention_inputs(model) -> tuple[dict, list]:
    """Forward pre-hooks that save each attention module's (args, kwargs); returns (saved, hooks)."""
    saved: dict = {}
    hooks = [
        m.register_forward_pre_hook(lambda mod, a, kw, n=n: saved.__setitem__(n, (a, dict(kw))), with_kwargs=True)
        for n, m in attention_modules(model).items()
    ]
    return saved, hooks


def changeable(layer, clipped: torch.Tensor, masks: dict[int, torch.Tensor]) -> None:
    """OR into ``masks`` (id(param) -> bool mask of the param's shape) the elements the clip may
    change, given the clipped heads ((n_heads,) bool); fused weights (`Rows`, `StridedRows`) get their rows."""
    for t, rows in _changeable_rows(layer, clipped):
        p = t.tensor if isinstance(t, (Rows, StridedRows)) else t
        m = masks.setdefault(id(p), torch.zeros(p.shape, dtype=torch.bool))
        if isinstance(t, StridedRows):
            idx = t.indices()
            if t.transposed:
                m[:, idx] |= rows[None, :]
            else:
                m[idx] |= rows.view(-1, *([1] * (p.ndim - 1)))
        elif not isinstance(t, Rows):
            m |= rows.view(-1, *([1] * (p.ndim - 1))).expand(p.shape)
        elif t.transposed:
            m[:, t.start:t.stop] |= rows[None, :]
        else:
            m[t.start:t.stop] |= rows.view(-1, *([1] * (p.ndim - 1)))


def _changeable_rows(layer, clipped: torch.Tensor) -> list[tuple]:
    """(weight or Rows, bool rows the clip may change) pairs, given the clipped heads."""
    lay = layer.layout
    if isinstance(lay, MLALayout):
        q_rows = clipped.repeat_interleave(lay.qk_nope_head_dim + lay.qk_rope_head_dim)
        kv = torch.cat([clipped[:, None].expand(-1, lay.qk_nope_head_dim),
                        torch.zeros(lay.n_heads, lay.v_head_dim, dtype=torch.bool)], dim=1).reshape(-1)
        pairs = [(lay.q_weight, q_rows), (lay.q_bias, q_rows), (lay.kv_b_weight, kv), (lay.kv_b_bias, kv)]
    elif isinstance(lay, GQALayout):  # exact per-head policy: only q rows, shared key untouched
        q_rows = clipped.repeat_interleave(lay.head_dim)
        pairs = [(lay.q_weight, q_rows), (lay.q_bias, q_rows)]
    else:
        rows = clipped.repeat_interleave(lay.head_dim)
        pairs = [(lay.q_weight, rows), (lay.q_bias, rows), (lay.k_weight, rows), (lay.k_bias, rows)]
    return [(p, r) for p, r in pairs if p is not None]


def tau_between_heads(s: dict[str, torch.Tensor]) -> float:
    """A tau with half the heads above and half below, none within float tolerance of it."""
    s_all = torch.cat(list(s.values())).sort().values
    mid = s_all.numel() // 2
    assert s_all[mid] - s_all[mid - 1] > 1e-3
    return float(s_all[mid - 1] + s_all[mid]) / 2


def assert_only_clipped_rows_changed(model, layers, clipped: dict[str, torch.Tensor], w0: dict[str, torch.Tensor]):
    """Every element outside the clipped heads' q/k rows is bit-identical to ``w0`` (``x * 1.0 == x``
    in IEEE arithmetic); the clipped heads' rows did change."""
    masks: dict[int, torch.Tensor] = {}
    for layer in layers:
        if layer.name in clipped:
            changeable(layer, clipped[layer.name], masks)
    for n, p in model.named_parameters():
        m = masks.get(id(p), torch.zeros(p.shape, dtype=torch.bool))
        assert torch.equal(p.detach()[~m], w0[n][~m]), f"{n}: rows of unclipped heads / other weights changed"
        assert not m.any() or not torch.equal(p.detach()[m], w0[n][m]), f"{n}: clipped rows unchanged"
