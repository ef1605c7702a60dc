"""The pairs QK-Clip sees (`muonclip.attention.pairs`), through the drop-in SDPA, with both max-logit
backends, against an explicit float64 max built here from q and k (never from the library's masks):

* padding queries (``real_queries``) and keys (``real_keys``) are never recorded, however large
  their logits, under right and left padding, with a causal rule, a sliding window and sinks;
* an additive float mask entry at or below -1e4 masks (``-inf``, ``-1e9``, ``finfo(float32).min``,
  ``finfo(bfloat16).min`` in a float32 call): the same record as the boolean mask; an entry
  above it is a bias whose pair counts (and whose value does not);
* the output never changes.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from muonclip import scaled_dot_product_attention
from muonclip.attention import MASKED_AT, MaxLogitRecorder, set_max_logit_backend
from muonclip.attention.pairs import allowed_pairs, clip_pairs


@pytest.fixture(params=["gated", "chunked"])
def backend(request):
    set_max_logit_backend(request.param)
    yield request.param
    set_max_logit_backend("gated")


def explicit(q, k, allowed, scale=None):
    """float64 ``scale * q.k`` per query head, max over the ``allowed`` (B, 1|H, Tq, Tk) pairs."""
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q.double() @ k.double().transpose(-1, -2))
    return s.masked_fill(~allowed.expand_as(s), -math.inf).amax(dim=(0, 2, 3)).float()


def qkv(B=3, hq=4, hkv=2, t=9, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, hq, t, d, generator=g), torch.randn(B, hkv, t, d, generator=g),
            torch.randn(B, hkv, t, d, generator=g))


def lengths_mask(t, lengths, side):
    """(B, T) real tokens: row b has lengths[b] real tokens, padded on ``side``."""
    pos = torch.arange(t)[None, :]
    n = torch.tensor(lengths)[:, None]
    return pos < n if side == "right" else pos >= t - n


def between(want):
    """A threshold with half the heads of ``want`` above it (the gate then bounds some, computes others)."""
    v = want.sort().values
    return float(v[len(v) // 2 - 1] + v[len(v) // 2]) / 2


def record(q, k, v, want, **kw):
    rec = MaxLogitRecorder(q.shape[1], threshold=between(want))
    out = scaled_dot_product_attention(q, k, v, recorder=rec, enable_gqa=q.shape[1] != k.shape[1], **kw)
    return rec, out


def assert_records(rec, want):
    """Exact where recorded exactly; where the gate recorded a bound, it is <= tau and >= the exact max."""
    exact = ~rec.bounded
    torch.testing.assert_close(rec.value[exact], want[exact], rtol=1e-5, atol=1e-5)
    tau = rec.threshold
    assert bool((rec.value[~exact] <= tau).all()) and bool((rec.value[~exact] >= want[~exact] - 1e-5).all())


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("sinks", [False, True])
def test_padding_queries_and_keys_are_never_recorded(backend, side, window, sinks):
    """Adversarial padding: pad queries and keys 20 times larger than the real ones. Under right padding
    the pad queries see the real keys (the mask hides only padding keys, as transformers builds it);
    with ``real_queries`` and ``real_keys`` their pairs are not recorded, and the output is SDPA's."""
    q, k, v = qkv()
    t = q.shape[2]
    real = lengths_mask(t, [9, 6, 4], side)
    q = torch.where(real[:, None, :, None], q * 3, q * 60)
    k = torch.where(real[:, None, :, None], k, k * 20)
    allowed = torch.ones(t, t, dtype=torch.bool).tril()
    if window:
        allowed &= ~torch.ones(t, t, dtype=torch.bool).tril(-window)
    mask = allowed & real[:, None, None, :]  # padding keys hidden, padding queries not
    want = explicit(q, k, mask & real[:, None, :, None])
    if side == "right":  # left padding: the pad queries see nothing but padding keys, hidden by the mask
        assert bool((explicit(q, k, mask) > want + 1).any()), "the padding queries must matter"
    s = torch.linspace(-2.0, 2.0, q.shape[1]) if sinks else None
    rec, out = record(q, k, v, want, attn_mask=mask, real_queries=real, real_keys=real, sinks=s)
    assert_records(rec, want)
    plain = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, sinks=s)
    assert torch.equal(out, plain)
    # a mask that lets padding keys through (a custom model's): real_keys keeps them out of the record
    if side == "left":  # right padding: the pad keys come after every real query
        assert bool((explicit(q, k, allowed[None, None] & real[:, None, :, None]) > want + 1).any())
    rec, _ = record(q, k, v, want, is_causal=window is None, attn_mask=None if window is None else allowed,
                    real_queries=real, real_keys=real, sinks=s)
    assert_records(rec, want)


@pytest.mark.parametrize("fill", ["bool", "-inf", "-1e9", "finfo(float32).min", "finfo(bfloat16).min", "-1e4"])
def test_a_float_mask_at_or_below_the_threshold_masks(backend, fill):
    """A packed row of two documents as a 4-D mask; the cross-document pairs are the largest logits.
    Every fill value at or below -1e4 gives the boolean mask's record; the output is the model's."""
    q, k, v = qkv(B=1, hq=4, hkv=4, t=10, seed=1)
    doc = torch.tensor([0] * 5 + [1] * 5)
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(10, 10, dtype=torch.bool).tril()
    cross = (doc[:, None] == 1) & (doc[None, :] == 0)
    q = q * 3
    q[0, :, 5:] += 6 * k[0, :, :5].mean(dim=1, keepdim=True)  # document 1's queries align with document 0's keys
    want = explicit(q, k, allowed[None, None])
    assert bool((explicit(q, k, (allowed | cross)[None, None]) > want + 1).any()), "cross pairs must matter"
    value = {"-inf": -math.inf, "-1e9": -1e9, "finfo(float32).min": torch.finfo(torch.float32).min,
             "finfo(bfloat16).min": torch.finfo(torch.bfloat16).min, "-1e4": MASKED_AT}.get(fill)
    mask = allowed if fill == "bool" else torch.zeros(10, 10).masked_fill(~allowed, value)
    rec, out = record(q, k, v, want, attn_mask=mask)
    assert_records(rec, want)
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=allowed), rtol=1e-6, atol=1e-6)


def test_a_bias_above_the_threshold_is_a_bias(backend):
    """ALiBi-style: entries above -1e4 are seen pairs; the record is their q.k max, without the bias."""
    q, k, v = qkv(B=2, hq=4, hkv=4, t=8, seed=2)
    q = q * 3
    t = 8
    distance = (torch.arange(t)[:, None] - torch.arange(t)[None, :]).clamp(min=0).float()
    bias = (-0.5 * distance).masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), -math.inf)
    bias[3, 0] = -9999.0  # just above the threshold: still a bias
    want = explicit(q, k, torch.ones(t, t, dtype=torch.bool).tril()[None, None])
    rec, _ = record(q, k, v, want, attn_mask=bias)
    assert_records(rec, want)


def test_the_rule_in_one_place():
    """`clip_pairs` without token masks hands the call's own mask through (no copy); with them, one
    boolean mask: allowed by the mask, real query, real key; the threshold is -1e4."""
    m = torch.zeros(1, 1, 4, 4).masked_fill(~torch.ones(4, 4, dtype=torch.bool).tril(), -1e9)
    assert clip_pairs(m, False, 4, 4) == (m, False)
    assert torch.equal(allowed_pairs(torch.tensor([-1e4, -9999.0, -math.inf, 0.0])),
                       torch.tensor([False, True, False, True]))
    real = torch.tensor([[True, True, True, False]])
    seen, causal = clip_pairs(None, True, 4, 4, real_queries=real, real_keys=real)
    want = torch.ones(4, 4, dtype=torch.bool).tril() & real[0][:, None] & real[0][None, :]
    assert not causal and torch.equal(seen[0, 0], want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.sh runs it)")
@pytest.mark.parametrize("name", ["gated", "chunked", "flex"])
def test_the_rule_on_cuda(name, monkeypatch):
    """The Triton kernels (exact, and the gate fused into them, on every call size) and FlexAttention's
    row maxima see the same pairs: adversarial right padding, and a -1e9 document mask."""
    import muonclip.attention.record as record

    monkeypatch.setattr(record, "GPU_GATE_MIN_WORK", {})
    set_max_logit_backend(name)
    try:
        q, k, v = qkv()
        t = q.shape[2]
        real = lengths_mask(t, [9, 6, 4], "right")
        q = torch.where(real[:, None, :, None], q * 3, q * 60)
        mask = torch.ones(t, t, dtype=torch.bool).tril() & real[:, None, None, :]
        want = explicit(q, k, mask & real[:, None, :, None])
        rec, _ = record_on(q, k, v, want, "cuda", attn_mask=mask, real_queries=real)
        assert_records(rec, want)
        doc = torch.tensor([0] * 4 + [1] * 5)
        allowed = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
        want = explicit(q, k, allowed[None, None])
        rec, _ = record_on(q, k, v, want, "cuda", attn_mask=torch.zeros(t, t).masked_fill(~allowed, -1e9))
        assert_records(rec, want)
    finally:
        set_max_logit_backend("gated")


def record_on(q, k, v, want, device, **kw):
    moved = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}
    rec = MaxLogitRecorder(q.shape[1], threshold=between(want))
    out = scaled_dot_product_attention(q.to(device), k.to(device), v.to(device), recorder=rec,
                                       enable_gqa=q.shape[1] != k.shape[1], **moved)
    rec.value, rec.exact = rec.value.cpu(), rec.exact.cpu()
    return rec, out
