"""The LSE-gated capture (`muonclip.attention._gate`, `muonclip.attention._lse`): the clip's decisions and
gammas are those of the exact path, the output and gradients are SDPA's, the fallback where the kernel
with the LSE is missing, and the recorder / MuonClip / clip_stats side of it."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import muonclip.attention._lse as lse_mod
import muonclip.attention.record as record_mod
from muonclip import MuonClip, scaled_dot_product_attention
from muonclip.attention import (
    AttentionCall,
    MaxLogitMonitor,
    MaxLogitRecorder,
    chunked_max_logits,
    gated_max_logits,
    lse_bound,
    sdpa_with_lse,
    set_max_logit_backend,
)
from muonclip.models import GPT, GPTConfig
from muonclip.qkclip import compute_gamma

needs_lse = pytest.mark.skipif(lse_mod.cpu_lse_op() is None, reason="this torch has no CPU SDPA kernel with the LSE")

TAU = 10.0
# per-head target max logit as a multiple of tau: far below, below, just below, just above, above
TARGETS = (0.2, 0.7, 0.995, 1.005, 3.0)


def _case(name: str, seed: int = 0, slope: float = 0.3):
    """q, k, v and SDPA keywords of one layout; heads' max logits are placed later by `_straddle`."""
    g = torch.Generator().manual_seed(seed)
    B, hq, hkv, tq, tk, d = 2, len(TARGETS), len(TARGETS), 12, 12, 8
    kw: dict = {}
    if name == "causal":
        kw["is_causal"] = True
    elif name == "padding":
        kw["attn_mask"] = (torch.arange(tk)[None, :] < torch.tensor([tk, 5])[:, None]).view(B, 1, 1, tk)
    elif name == "gqa":  # 5 query heads need Hq % Hkv == 0: 5 heads over one key head (MQA)
        hkv, kw["enable_gqa"], kw["is_causal"] = 1, True, True
    elif name == "cross":
        tq, tk = 5, 17
    elif name == "cross_causal":
        tq, tk, kw["is_causal"] = 17, 6, True
    elif name == "fully_masked_rows":
        keep = torch.rand(B, 1, tq, tk, generator=g) > 0.3
        keep[0, :, 2] = False
        keep[1, :, 7] = False
        kw["attn_mask"] = keep
    elif name == "negative_bias":  # ALiBi-like distance penalty plus -inf padding: the bound must pay c
        dist = (torch.arange(tq)[:, None] - torch.arange(tk)[None, :]).abs().float()
        bias = -slope * dist.expand(B, 1, tq, tk).clone()
        bias[1, :, :, 9:] = -math.inf
        kw["attn_mask"] = bias
    elif name == "positive_bias_finfo_min":
        bias = torch.rand(B, 1, tq, tk, generator=g) * 3.0
        bias[0, :, :, 10:] = torch.finfo(torch.float32).min
        kw["attn_mask"] = bias
    elif name == "mla":  # DeepSeek MLA: q = [q^C | q^R], k = [k^C | k^R shared], one scale 1/sqrt(nope + rope)
        nope, rope = 6, 4
        d = nope + rope
        kw["scale"] = 1.0 / math.sqrt(d)
        kw["is_causal"] = True
    q = torch.randn(B, hq, tq, d, generator=g)
    k = torch.randn(B, hkv, tk, d, generator=g)
    if name == "mla":
        k[:, :, :, 6:] = k[:, :1, :, 6:]  # the rotary key part is shared by all heads
    v = torch.randn(B, hkv, tk, d, generator=g)  # the CPU kernel needs Dv == D (else SDPA's math backend)
    return q, k, v, kw


def _straddle(q, k, kw, tau=TAU):
    """Scale each query head so that its exact max logit is TARGETS[h] * tau (a positive factor
    scales every logit of the head, so the max moves by that factor)."""
    m = chunked_max_logits(q, k, kw.get("attn_mask"), kw.get("is_causal", False), kw.get("scale"),
                           kw.get("enable_gqa", False))
    factor = torch.tensor(TARGETS, device=m.device) * tau / m
    assert bool((m > 0).all())
    return q * factor.view(1, -1, 1, 1)


CASES = ["plain", "causal", "padding", "gqa", "cross", "cross_causal", "fully_masked_rows", "negative_bias",
         "positive_bias_finfo_min", "mla"]


@needs_lse
@pytest.mark.parametrize("name", CASES)
def test_decisions_and_gammas_equal_the_exact_paths(name):
    """Heads at 0.2, 0.7, 0.995, 1.005 and 3 tau: the gated recorder's clip decisions equal the exact
    path's, every gamma equals it (to float32 round-off: the exact max of the flagged heads is the same
    chunked computation on a batch of fewer heads, which need not round alike), the bounded heads hold
    an upper bound <= tau, and the heads above tau are never bounds."""
    q, k, v, kw = _case(name)
    q = _straddle(q, k, kw)
    gated, exact = MaxLogitRecorder(q.shape[1], threshold=TAU), MaxLogitRecorder(q.shape[1])
    scaled_dot_product_attention(q, k, v, **kw, recorder=gated)
    scaled_dot_product_attention(q, k, v, **kw, recorder=exact)
    assert not exact.bounded.any()
    ref = exact.value
    torch.testing.assert_close(ref, torch.tensor(TARGETS) * TAU, rtol=1e-5, atol=0)
    assert torch.equal(gated.value > TAU, ref > TAU)
    torch.testing.assert_close(compute_gamma(gated.value, TAU), compute_gamma(ref, TAU), rtol=1e-6, atol=0)
    b = gated.bounded
    assert bool(b[0]), "the head far below tau should be decided by its bound"
    assert not bool(b[3:].any()), "heads above tau are exact"
    assert bool((gated.value[b] <= TAU).all()) and bool((gated.value[b] >= ref[b]).all())
    torch.testing.assert_close(gated.value[~b], ref[~b], rtol=1e-6, atol=0)


@needs_lse
def test_every_head_above_tau_gives_the_exact_path_bit_for_bit():
    """Every head flagged: the gate hands the very same arguments to the same chunked computation as the
    exact path, so the maxima are equal bit for bit."""
    q, k, v, kw = _case("causal")
    q = _straddle(q, k, kw, tau=TAU / 100)  # every head >= 2 tau
    gated, exact = MaxLogitRecorder(q.shape[1], threshold=TAU / 100), MaxLogitRecorder(q.shape[1])
    scaled_dot_product_attention(q, k, v, **kw, recorder=gated)
    scaled_dot_product_attention(q, k, v, **kw, recorder=exact)
    assert torch.equal(gated.value, exact.value) and not gated.bounded.any()


@needs_lse
@pytest.mark.parametrize("name", CASES)
def test_output_and_gradients_are_sdpas_bit_for_bit(name):
    """The gated path calls the kernel F.scaled_dot_product_attention itself runs on this call (the
    dispatcher's own choice, torch._fused_sdp_choice, is checked first) with the inputs SDPA gives it
    (a boolean mask turned into 0 / -inf in the query's dtype): the same kernel on the same inputs, so
    output and gradients are equal bit for bit."""
    q, k, v, kw = _case(name)
    q = _straddle(q, k, kw)
    assert sdpa_with_lse(AttentionCall(q, k, v, **kw)) is not None, "the gated path should run here"
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rec = MaxLogitRecorder(q.shape[1], threshold=TAU)
    out = scaled_dot_product_attention(*leaves, **kw, recorder=rec)
    ref = F.scaled_dot_product_attention(*ref_leaves, **kw)
    assert torch.equal(out, ref)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, ref_leaves, grad)):
        assert torch.equal(a, b)
    assert rec.bounded.any()  # the gate did bound some heads on this call


@needs_lse
def test_micro_batches_give_the_decisions_of_the_whole_batch():
    """Two micro-batches folded into one gated recorder decide and scale like the exact max of the whole
    batch: values above tau are the exact maxima, the rest bounds <= tau."""
    q, k, v, kw = _case("causal")
    q = _straddle(q, k, kw)
    rec, whole = MaxLogitRecorder(q.shape[1], threshold=TAU), MaxLogitRecorder(q.shape[1])
    for i in range(2):
        scaled_dot_product_attention(q[i:i + 1], k[i:i + 1], v[i:i + 1], **kw, recorder=rec)
    scaled_dot_product_attention(q, k, v, **kw, recorder=whole)
    assert torch.equal(rec.value > TAU, whole.value > TAU)
    torch.testing.assert_close(compute_gamma(rec.value, TAU), compute_gamma(whole.value, TAU), rtol=1e-6, atol=0)
    assert bool((rec.value[rec.bounded] <= TAU).all())


@needs_lse
def test_bound_is_an_upper_bound_and_within_log_n_plus_bias():
    """max_i lse_i - c is >= the exact max and <= the exact max + log(keys) - c (+ its round-off margin),
    with c the most negative allowed bias; without paying c a negative bias would break the bound."""
    q, k, v, kw = _case("negative_bias", slope=1.5)
    q = q * 4
    mask, tk = kw["attn_mask"], k.shape[2]
    out, lse = sdpa_with_lse(AttentionCall(q, k, v, mask))
    bound = lse_bound(AttentionCall(q, k, v, mask), lse)
    exact = chunked_max_logits(q, k, mask)
    c = float(mask[mask > -math.inf].min())
    assert bool((bound >= exact).all())
    assert bool((bound <= exact + math.log(tk) - c + 1e-3).all())
    assert bool((lse.amax(dim=(0, 2)) < exact).any()), "this case needs c: the raw LSE is below some max"


@needs_lse
def test_gate_flags_nan_heads_for_the_exact_path():
    """A NaN in a head's scores makes its LSE NaN: the head takes the exact path (NaN, never clipped)."""
    q, k, v, kw = _case("plain")
    q[0, 2, 3, 0] = math.nan
    out, lse = sdpa_with_lse(AttentionCall(q, k, v))
    values, is_bound = gated_max_logits(AttentionCall(q, k, v), lse, TAU)
    assert not bool(is_bound[2]) and math.isnan(float(values[2]))


def test_fallback_when_the_kernel_with_the_lse_is_absent(monkeypatch):
    """Forced: a torch without the CPU op (or with another schema) takes the exact path on every call,
    with SDPA's output, and records no bound."""
    monkeypatch.setattr(lse_mod, "schema_matches", lambda op, spec=None: False)
    lse_mod.cpu_lse_op.cache_clear()
    try:
        assert lse_mod.cpu_lse_op() is None
        q, k, v, kw = _case("causal")
        q = _straddle(q, k, kw)
        assert sdpa_with_lse(AttentionCall(q, k, v, is_causal=True)) is None
        rec = MaxLogitRecorder(q.shape[1], threshold=TAU)
        out = scaled_dot_product_attention(q, k, v, **kw, recorder=rec)
    finally:
        monkeypatch.undo()
        lse_mod.cpu_lse_op.cache_clear()
    assert torch.equal(out, F.scaled_dot_product_attention(q, k, v, **kw))
    assert not rec.bounded.any()
    assert torch.equal(rec.value, chunked_max_logits(q, k, is_causal=True))


def test_schema_detection():
    """The op is accepted only with the argument names, keyword-only arguments and two returns the
    gate calls it with; another attention op's schema is refused."""
    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is not None:
        assert lse_mod.schema_matches(op) == (
            [a.name for a in op.default._schema.arguments]
            == ["query", "key", "value", "dropout_p", "is_causal", "attn_mask", "scale"]
        )
    assert not lse_mod.schema_matches(torch.ops.aten._scaled_dot_product_efficient_attention)
    assert not lse_mod.schema_matches(object())


def test_cuda_op_detection():
    """The CUDA ops' schemas are registered in every build (CPU too): each backend's op is found with
    the arguments it is called with (flash, efficient, cuDNN), the math backend and unknown numbers
    have none, and an op is refused under another backend's schema."""
    for backend, name in ((1, "_scaled_dot_product_flash_attention"), (2, "_scaled_dot_product_efficient_attention"),
                          (3, "_scaled_dot_product_cudnn_attention")):
        op = getattr(torch.ops.aten, name, None)
        if op is not None:  # present since torch 2.2 (cuDNN) / 2.0 (the others)
            assert lse_mod.cuda_lse_op(backend) is op
    assert lse_mod.cuda_lse_op(0) is None and lse_mod.cuda_lse_op(4) is None and lse_mod.cuda_lse_op(-1) is None
    assert not lse_mod.schema_matches(torch.ops.aten._scaled_dot_product_cudnn_attention, lse_mod._CUDA_OPS[2])


@needs_lse
def test_calls_that_the_kernel_cannot_run_stay_exact():
    """Dropout and a value head size other than the query's (SDPA runs its math backend on CPU), a
    recorder without threshold, an active monitor and the "chunked" backend: exact maxima only."""
    q, k, v, kw = _case("causal")
    q = _straddle(q, k, kw)
    ref = chunked_max_logits(q, k, is_causal=True)
    rec = MaxLogitRecorder(q.shape[1], threshold=TAU)
    torch.manual_seed(0)
    scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.3, recorder=rec)
    assert not rec.bounded.any() and torch.equal(rec.value, ref)
    plain = MaxLogitRecorder(q.shape[1])
    scaled_dot_product_attention(q, k, v, is_causal=True, recorder=plain)
    assert not plain.bounded.any() and torch.equal(plain.value, ref)
    rec.reset()
    with MaxLogitMonitor({"layer": rec}) as monitor:
        scaled_dot_product_attention(q, k, v, is_causal=True, recorder=rec)
    assert not rec.bounded.any() and torch.equal(monitor.max_logits["layer"], ref)
    rec.reset()
    scaled_dot_product_attention(q, k, v[..., :5], is_causal=True, recorder=rec)  # Dv != D: SDPA's math backend
    assert not rec.bounded.any() and torch.equal(rec.value, ref)
    rec.reset()
    set_max_logit_backend("chunked")
    try:
        scaled_dot_product_attention(q, k, v, is_causal=True, recorder=rec)
    finally:
        set_max_logit_backend("gated")
    assert not rec.bounded.any() and torch.equal(rec.value, ref)
    assert record_mod.call_threshold([MaxLogitRecorder(2, threshold=5.0), MaxLogitRecorder(2, threshold=3.0)]) == 3.0


def test_recorder_threshold_and_bounds():
    """The recorder keeps which of its values are bounds across calls: a later exact value above a
    bound makes the head exact again; thresholds are validated."""
    rec = MaxLogitRecorder(3, threshold=5.0)
    rec.update(torch.tensor([4.0, 1.0, 2.0]), torch.tensor([True, True, False]))
    assert rec.bounded.tolist() == [True, True, False]
    rec.update(torch.tensor([3.0, 6.0, 1.0]), torch.tensor([True, False, False]))
    assert rec.value.tolist() == [4.0, 6.0, 2.0] and rec.bounded.tolist() == [True, False, False]
    rec.reset()
    assert rec.bounded is None and rec.exact is None
    for bad in (0.0, -1.0, math.inf, math.nan, True, "5"):
        with pytest.raises(ValueError, match="threshold"):
            MaxLogitRecorder(2, threshold=bad)


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, n_layer=2, n_head=4, n_embd=32, block_size=16))


def test_muonclip_tells_its_recorders_tau_and_labels_bounds_in_clip_stats():
    """MuonClip sets every recorder's threshold to tau (also when tau is set or loaded); a step with
    every head far below tau logs bounds, labelled max_logit_is_bound = 1, and the same step with a
    tau below every head logs the exact maxima (label 0), equal to the exact path's."""
    model = _gpt()
    opt = MuonClip(model, lr=0.0, tau=1e4)
    assert all(layer.recorder.threshold == 1e4 for layer in opt.layers)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    _, loss = model(x, x)
    loss.backward()
    opt.step()
    stats = opt.clip_stats()
    assert stats["max_logit_is_bound"] == 1.0 and stats["clipped_heads"] == 0
    assert all(b.all() for b in opt.last_bounded.values())
    assert all(stats[f"max_logit_is_bound/{n}"] == 1.0 for n in opt.last_bounded)

    set_max_logit_backend("chunked")
    try:
        model(x, x)
    finally:
        set_max_logit_backend("gated")
    exact = [layer.recorder.value.clone() for layer in opt.layers]
    for layer in opt.layers:
        layer.recorder.reset()
    opt.tau = 1e-3  # every head above: every value exact
    assert all(layer.recorder.threshold == 1e-3 for layer in opt.layers)
    model(x, x)
    opt.clip()
    stats = opt.clip_stats()
    assert stats["max_logit_is_bound"] == 0.0 and stats["clipped_heads"] == 8
    for layer, e in zip(opt.layers, exact):
        torch.testing.assert_close(opt.last_max_logits[layer.name], e, rtol=1e-6, atol=0)

    sd = opt.state_dict()
    opt2 = MuonClip(_gpt(), lr=0.0, tau=5.0)
    opt2.load_state_dict(sd)
    assert all(layer.recorder.threshold == 1e-3 for layer in opt2.layers)


def test_lowering_tau_below_recorded_bounds_is_refused():
    """Bounds recorded at the old tau may exceed a lower one: the clip could not be exact, so the
    setter refuses (raising tau, or lowering it with nothing recorded, is fine)."""
    model = _gpt()
    opt = MuonClip(model, lr=0.0, tau=1e4)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    model(x, x)
    with pytest.raises(ValueError, match="cannot go from"):
        opt.tau = 1e-3
    opt.tau = 2e4
    for layer in opt.layers:
        layer.recorder.reset()
    opt.tau = 1e-3
