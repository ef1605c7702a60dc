"""The drop-in SDPA: same output as F.scaled_dot_product_attention, exact recorded max logits, recorded on
training calls only (grad enabled, ``training=True``)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from muonclip import scaled_dot_product_attention
from muonclip.attention import MaxLogitRecorder, chunked_max_logits, get_max_logit_backend, set_max_logit_backend


def reference_max(q, k, allowed=None, scale=None):
    """Explicit (B, Hq, Tq, Tk) float64 logits, masked, max per query head."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q.double() @ k.double().transpose(-1, -2)
    if allowed is not None:
        s = s.masked_fill(~allowed.expand_as(s), -math.inf)
    return s.amax(dim=(0, 2, 3)).float()


def qkv(B=2, hq=4, hkv=4, tq=7, tk=7, d=8, dv=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, hq, tq, d, generator=g), torch.randn(B, hkv, tk, d, generator=g),
            torch.randn(B, hkv, tk, dv, generator=g))


def causal(tq, tk):
    return torch.ones(tq, tk, dtype=torch.bool).tril()


def padding(B, tk, lengths):
    return (torch.arange(tk)[None, :] < torch.tensor(lengths)[:, None]).view(B, 1, 1, tk)


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "causal_rect": dict(is_causal=True, tk=11),
    "bool_mask_padding": dict(mask="padding"),
    "float_mask_additive": dict(mask="float"),
    "float_mask_finfo_min": dict(mask="finfo"),
    "gqa_causal": dict(hkv=2, enable_gqa=True, is_causal=True),
    "mqa_padding": dict(hkv=1, enable_gqa=True, mask="padding"),
    "custom_scale": dict(scale=0.37, is_causal=True),
    "value_dim_differs": dict(dv=5, is_causal=True),
}


def build(case):
    c = dict(case)
    B, hkv, tk = 2, c.pop("hkv", 4), c.pop("tk", 7)
    q, k, v = qkv(B=B, hkv=hkv, tk=tk, dv=c.pop("dv", 8))
    tq = q.shape[2]
    mask_kind = c.pop("mask", None)
    allowed = None
    if c.get("is_causal"):
        allowed = causal(tq, tk)
    if mask_kind == "padding":
        c["attn_mask"] = allowed = padding(B, tk, [tk, 3])
    elif mask_kind == "float":
        bias = torch.randn(B, 1, tq, tk)
        bias[1, :, :, 4:] = -math.inf
        c["attn_mask"], allowed = bias, bias > -math.inf
    elif mask_kind == "finfo":
        keep = padding(B, tk, [5, tk]) & causal(tq, tk)
        c["attn_mask"], allowed = torch.zeros(B, 1, tq, tk).masked_fill(~keep, torch.finfo(torch.float32).min), keep
    return q, k, v, c, allowed


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("chunk", [None, 1, 3])
def test_output_equals_sdpa_and_max_equals_explicit(name, chunk, monkeypatch):
    """The output equals SDPA's bit for bit on any machine: the wrapper makes the very same
    F.scaled_dot_product_attention call (the same kernel on the same inputs). The recorded max is
    compared with an explicit float64 reference to float32 round-off."""
    q, k, v, kwargs, allowed = build(CASES[name])
    if chunk is not None:
        monkeypatch.setattr("muonclip.attention.DEFAULT_CHUNK_ELEMENTS", chunk * 2 * 4 * k.shape[2])
    rec = MaxLogitRecorder(q.shape[1])
    out = scaled_dot_product_attention(q, k, v, recorder=rec, **kwargs)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, **kwargs))
    torch.testing.assert_close(rec.value, reference_max(q, k, allowed, kwargs.get("scale")), rtol=1e-5, atol=1e-5)
    assert rec.value.dtype == torch.float32 and rec.value.grad_fn is None


def test_chunk_size_keyword_and_causal_key_skipping():
    q, k, _ = qkv(tq=13, tk=13)
    ref = reference_max(q, k, causal(13, 13))
    for chunk in (1, 2, 5, 13, 100):
        torch.testing.assert_close(chunked_max_logits(q, k, is_causal=True, chunk_size=chunk), ref)
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_max_logits(q, k, chunk_size=0)


def test_fully_masked_rows_contribute_nothing():
    q, k, v = qkv(B=1, tq=4, tk=4)
    mask = torch.ones(1, 4, 4, 4, dtype=torch.bool)
    mask[0, 0] = False  # head 0: every row masked
    mask[0, 1, 2] = False  # head 1: row 2 masked
    rec = MaxLogitRecorder(4)
    scaled_dot_product_attention(q, k, v, attn_mask=mask, recorder=rec)
    assert rec.value[0] == -math.inf
    torch.testing.assert_close(rec.value[1:], reference_max(q, k, mask)[1:])


def test_gradients_match_sdpa_and_only_training_calls_record():
    """Training call (grad on, ``training=True``): recorded, same gradients as SDPA. Under no_grad,
    inference_mode or with ``training=False``: nothing recorded, and the output is plain SDPA's.
    Bit for bit on any machine: the recording runs under no_grad, so the autograd graph, and the
    backward kernels it runs, are SDPA's own; a call that does not record is the same kernel on
    the same inputs."""
    q, k, v = qkv(hkv=2)
    q1, k1, v1 = (t.clone().requires_grad_() for t in (q, k, v))
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q, k, v))
    rec = MaxLogitRecorder(4)
    scaled_dot_product_attention(q1, k1, v1, is_causal=True, enable_gqa=True, recorder=rec).square().sum().backward()
    F.scaled_dot_product_attention(q2, k2, v2, is_causal=True, enable_gqa=True).square().sum().backward()
    for a, b in ((q1, q2), (k1, k2), (v1, v2)):
        assert torch.equal(a.grad, b.grad)
    torch.testing.assert_close(rec.value, reference_max(q, k, causal(7, 7)))
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    for context, training in ((torch.no_grad, True), (torch.inference_mode, True), (torch.enable_grad, False)):
        rec2 = MaxLogitRecorder(4)
        with context():
            out = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, recorder=rec2, training=training)
        assert rec2.value is None, (context, training)
        assert torch.equal(out, plain)


def test_dropout_does_not_change_output_or_max():
    """Bit for bit: the same seed and the same SDPA call draw the same dropout mask (the recording draws no
    random numbers)."""
    q, k, v = qkv()
    torch.manual_seed(3)
    rec = MaxLogitRecorder(4)
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True, recorder=rec)
    torch.manual_seed(3)
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True))
    torch.testing.assert_close(rec.value, reference_max(q, k, causal(7, 7)))


def test_micro_batches_accumulate_to_full_batch_max_and_reset():
    """Two micro-batches fold into the running max exactly (a max is exact: the recorder holds
    the elementwise max of the two calls' maxima), and that equals the full batch's max to
    float32 round-off (not bit for bit: a batched matmul over 2 sequences need not round each
    score as one over 4 does)."""
    q, k, v = qkv(B=4, hkv=2)
    full, parts = MaxLogitRecorder(4), MaxLogitRecorder(4)
    scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, recorder=full)
    alone = []
    for sl in (slice(0, 2), slice(2, 4)):
        scaled_dot_product_attention(q[sl], k[sl], v[sl], is_causal=True, enable_gqa=True, recorder=parts)
        one = MaxLogitRecorder(4)
        scaled_dot_product_attention(q[sl], k[sl], v[sl], is_causal=True, enable_gqa=True, recorder=one)
        alone.append(one.value)
    assert torch.equal(parts.value, torch.maximum(*alone))
    torch.testing.assert_close(full.value, parts.value, rtol=1e-6, atol=0)
    parts.reset()
    assert parts.value is None


def test_recorder_validation():
    with pytest.raises(ValueError, match="n_heads"):
        MaxLogitRecorder(0)
    rec = MaxLogitRecorder(3)
    with pytest.raises(ValueError, match=r"expected \(3,\)"):
        rec.update(torch.zeros(4))
    q, k, v = qkv()
    with pytest.raises(ValueError, match="recorder records 3 heads"):
        scaled_dot_product_attention(q, k, v, recorder=rec)
    with pytest.raises(ValueError, match="4-D"):
        scaled_dot_product_attention(q[0], k[0], v[0], recorder=MaxLogitRecorder(4))
    q, k, v = qkv(hkv=2)
    with pytest.raises(ValueError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, v, recorder=MaxLogitRecorder(4))
    with pytest.raises(ValueError, match="broadcast"):
        chunked_max_logits(q, k, attn_mask=torch.ones(3, 5, dtype=torch.bool), enable_gqa=True)


def test_without_recorder_is_plain_sdpa():
    """Without a recorder the wrapper is the very same call: equal bit for bit."""
    q, k, v = qkv()
    assert torch.equal(scaled_dot_product_attention(q, k, v, None, 0.0, True), F.scaled_dot_product_attention(q, k, v, is_causal=True))


def test_backend_switch_falls_back_on_cpu():
    """On CPU the flex backend falls back to the very same SDPA call: its output is SDPA's bit for bit."""
    assert get_max_logit_backend() == "gated"
    with pytest.raises(ValueError, match="backend"):
        set_max_logit_backend("fast")
    q, k, v = qkv()
    set_max_logit_backend("flex")
    try:
        rec = MaxLogitRecorder(4)
        out = scaled_dot_product_attention(q, k, v, is_causal=True, recorder=rec)
    finally:
        set_max_logit_backend("gated")
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    torch.testing.assert_close(rec.value, reference_max(q, k, causal(7, 7)))


@settings(max_examples=25, deadline=None)
@given(
    B=st.integers(1, 3), hkv=st.integers(1, 3), groups=st.integers(1, 3), tq=st.integers(1, 9), tk=st.integers(1, 9),
    d=st.sampled_from([2, 4, 8]), causal_=st.booleans(), chunk=st.integers(1, 4), seed=st.integers(0, 1000),
)
def test_property_chunked_max_equals_explicit(B, hkv, groups, tq, tk, d, causal_, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, hkv * groups, tq, d, generator=g) * 3
    k = torch.randn(B, hkv, tk, d, generator=g)
    keep = torch.rand(B, 1, tq, tk, generator=g) > 0.3
    allowed = keep & causal(tq, tk) if causal_ else keep
    got = chunked_max_logits(q, k, attn_mask=keep, is_causal=causal_, enable_gqa=True, chunk_size=chunk)
    torch.testing.assert_close(got, reference_max(q, k, allowed), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: FlexAttention's max_scores has no CPU kernel")
@pytest.mark.parametrize(("case", "dtype"), [("causal", torch.float32), ("gqa", torch.float32),
                                             ("padding", torch.float32), ("none", torch.float32),
                                             ("causal", torch.bfloat16)])
def test_flex_backend_max_equals_explicit_on_cuda(case, dtype):
    """FlexAttention's in-kernel max (``set_max_logit_backend("flex")``) equals the explicit
    masked float64 max per query head, and the output equals SDPA's, for causal, GQA, a
    padding mask and no mask. Tolerances: TF32/bf16 logits (|logit| up to ~10)."""
    B, hq, T, d = 2, 4, 256, 64
    hkv = 2 if case == "gqa" else hq
    g = torch.Generator(device="cuda").manual_seed(0)
    q = (3 * torch.randn(B, hq, T, d, device="cuda", generator=g)).to(dtype)
    k = torch.randn(B, hkv, T, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(B, hkv, T, d, device="cuda", generator=g).to(dtype)
    is_causal = case in ("causal", "gqa")
    mask = padding(B, T, [T, T // 3]).cuda() if case == "padding" else None
    allowed = causal(T, T).cuda() if is_causal else mask
    rec = MaxLogitRecorder(hq)
    set_max_logit_backend("flex")
    try:
        out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=hkv != hq,
                                           recorder=rec)
    finally:
        set_max_logit_backend("gated")
    ref = reference_max(q.float(), k.float(), allowed)
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(rec.value.float(), ref, rtol=tol, atol=tol)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=hkv != hq)
    torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("case", ["none", "causal", "gqa", "padding", "causal_padding", "wide_causal", "scale",
                                  "empty_row"])
def test_flex_backend_wrapper_on_cpu(flex_on_cpu, case):
    """The flex path's recorded max equals the explicit float64 max per query head and its
    output equals SDPA's, for no mask, causal, GQA, a padding mask (alone and with causal),
    Tq != Tk, a custom scale, and a query row with no allowed key (max -inf there, output row
    0).

    The zeros of the empty row are exact on any machine: FlexAttention defines the output of a row
    with no allowed key as 0 (a value set, not a rounded one)."""
    hkv = 2 if case == "gqa" else 4
    tq, tk = (5, 9) if case == "wide_causal" else (7, 7)
    q, k, v = qkv(hkv=hkv, tq=tq, tk=tk, seed=3)
    q = 3 * q
    is_causal = case in ("causal", "gqa", "causal_padding", "wide_causal")
    mask = None
    if case in ("padding", "causal_padding"):
        mask = padding(2, tk, [tk, 3])
    if case == "empty_row":
        mask = torch.ones(2, 1, tq, tk, dtype=torch.bool)
        mask[1, :, 4] = False  # query 4 of batch 1 sees nothing
    scale = 0.3 if case == "scale" else None
    allowed = mask
    if is_causal:
        allowed = causal(tq, tk) if mask is None else mask & causal(tq, tk)
    rec = MaxLogitRecorder(4)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                       enable_gqa=hkv != 4, recorder=rec)
    torch.testing.assert_close(rec.value, reference_max(q, k, allowed, scale), rtol=1e-5, atol=1e-5)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=hkv != 4)
    if case == "empty_row":  # 0, never NaN (torch 2.13's CPU SDPA agrees)
        assert torch.equal(out[1, :, 4], torch.zeros_like(out[1, :, 4]))
        want = want.nan_to_num(0.0)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_flex_backend_keeps_chunked_for_additive_masks_and_dropout(flex_on_cpu, monkeypatch):
    """An additive float mask (its bias would enter FlexAttention's max) and dropout keep the
    chunked max even with the flex backend on."""
    import muonclip.attention.record as record

    calls = []
    monkeypatch.setattr(record, "flex_attention_with_max", lambda *a, **kw: calls.append(1))
    q, k, v = qkv()
    rec = MaxLogitRecorder(4)
    bias = torch.zeros(7, 7).masked_fill(~causal(7, 7), -math.inf)
    scaled_dot_product_attention(q, k, v, attn_mask=bias, recorder=rec)
    torch.testing.assert_close(rec.value, reference_max(q, k, causal(7, 7)))
    scaled_dot_product_attention(q, k, v, dropout_p=0.5, is_causal=True, recorder=MaxLogitRecorder(4))
    assert calls == []


def test_flex_backend_follows_the_recording_rule(flex_on_cpu, monkeypatch):
    """With the flex backend on, a call that is not a training forward (no_grad) feeds no recorder
    and runs plain SDPA; inside a `MaxLogitMonitor` it computes the flex max for the monitor only."""
    import muonclip.attention.record as record
    from muonclip.attention import MaxLogitMonitor

    calls = []
    real = record.flex_attention_with_max

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(record, "flex_attention_with_max", counted)
    q, k, v = qkv(seed=3)
    rec = MaxLogitRecorder(4)
    with torch.no_grad():
        out = scaled_dot_product_attention(q, k, v, is_causal=True, recorder=rec)
        assert rec.value is None and calls == []
        assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, is_causal=True))
        with MaxLogitMonitor({"layer": rec}) as monitor:
            scaled_dot_product_attention(q, k, v, is_causal=True, recorder=rec)
    assert rec.value is None and calls == [1]
    torch.testing.assert_close(monitor.max_logits["layer"], reference_max(q, k, causal(7, 7)), rtol=1e-5, atol=1e-5)
    scaled_dot_product_attention(q, k, v, is_causal=True, recorder=rec)  # a training call: flex, recorded
    assert calls == [1, 1]
    torch.testing.assert_close(rec.value, reference_max(q, k, causal(7, 7)), rtol=1e-5, atol=1e-5)
