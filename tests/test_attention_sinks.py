"""Attention sinks (`muonclip.attention.sinks`): output and every gradient (q, k, v and the sinks) equal
the eager formula of transformers' sink models (the sink as one more softmax column, dropped), on both
paths (the kernel's LSE, one more key), with masks, the causal rule and GQA; the recorded max logit is
over q.k only, and the LSE gate still decides exactly."""

from __future__ import annotations

import math

import pytest
import torch

import muonclip.attention.sinks as sinks_mod
from muonclip import scaled_dot_product_attention
from muonclip.attention import MaxLogitRecorder, chunked_max_logits
from muonclip.attention.sinks import sink_attention

B, HQ, T, D = 2, 4, 7, 8


def eager_sinks(q, k, v, sinks, mask=None, is_causal=False, scale=None):
    """The eager formula of GPT-OSS (transformers): sink column, softmax, column dropped; float64."""
    q, k, v, sinks = (t.double() for t in (q, k, v, sinks))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * q @ k.transpose(-1, -2)
    tq, tk = s.shape[-2:]
    if is_causal:
        s = s.masked_fill(~torch.ones(tq, tk, dtype=torch.bool).tril(), -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    sink = sinks.view(1, -1, 1, 1).expand(*s.shape[:-1], 1)
    p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    return p @ v


def _inputs(hkv=HQ, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = (2 * torch.randn(B, HQ, T, D, generator=g)).to(dtype).requires_grad_()
    k = torch.randn(B, hkv, T, D, generator=g).to(dtype).requires_grad_()
    v = torch.randn(B, hkv, T, D, generator=g).to(dtype).requires_grad_()
    sinks = torch.tensor([-3.0, 0.0, 1.5, 4.0], dtype=dtype).requires_grad_()
    return q, k, v, sinks


def _padding():
    keep = torch.ones(B, 1, T, T, dtype=torch.bool).tril()
    keep[1, :, :, :3] = False  # left padding of row 1: rows 0-2 see nothing
    return keep


CASES = {
    "causal": dict(is_causal=True),
    "padding": dict(mask="bool"),
    "additive": dict(mask="float"),
    "gqa": dict(is_causal=True, hkv=2),
    "gqa_padding": dict(mask="bool", hkv=1),
}


@pytest.mark.parametrize("path", ["lse", "extra_key"])
@pytest.mark.parametrize("case", list(CASES))
def test_output_and_gradients_equal_eager(case, path, monkeypatch):
    if path == "extra_key":
        monkeypatch.setattr(sinks_mod, "_fused_lse_path", lambda *a: False)
    elif sinks_mod.cpu_lse_backward_op() is None:
        pytest.skip("this torch has no CPU flash kernel with its backward")
    spec = dict(CASES[case])
    hkv = spec.pop("hkv", HQ)
    q, k, v, sinks = _inputs(hkv)
    mask = spec.pop("mask", None)
    if mask is not None:
        mask = _padding() if mask == "bool" else torch.where(_padding(), -0.3 * torch.rand(B, 1, T, T), -math.inf)
    out, lse = sink_attention(q, k, v, sinks, attn_mask=mask, enable_gqa=hkv != HQ, **spec)
    assert (lse is not None) == (path == "lse")
    ref = eager_sinks(q, k, v, sinks, mask, **spec)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)  # rows that see no key: 0, as eager
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    grads = torch.autograd.grad(out, (q, k, v, sinks), g)
    refs = torch.autograd.grad(ref, (q, k, v, sinks), g.double())
    for name, a, b in zip("qkvs", grads, refs):
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"d{n}: {m}")


def test_sinks_shape_is_checked():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match=r"one logit per query head, shape \(4,\)"):
        sink_attention(q, k, v, torch.zeros(3))


@pytest.mark.parametrize("backend_gate", [True, False])
def test_recorded_max_is_over_qk_only_and_gate_is_exact(backend_gate, monkeypatch):
    """The sink never enters the recorded max (it is not a product of W_q and W_k): the drop-in with
    ``sinks`` records the exact q.k maxima (a sink far above every logit changes nothing), and with the
    gate the decisions at tau equal the exact path's."""
    q, k, v, _ = _inputs()
    big = torch.full((HQ,), 50.0)
    exact = chunked_max_logits(q, k, is_causal=True)
    tau = float(exact.sort().values[1:3].mean())  # two heads above, two below
    rec = MaxLogitRecorder(HQ, threshold=tau if backend_gate else None)
    out = scaled_dot_product_attention(q, k, v, is_causal=True, sinks=big, recorder=rec)
    torch.testing.assert_close(out.double(), eager_sinks(q, k, v, big, is_causal=True), rtol=1e-5, atol=1e-6)
    above = exact > tau
    assert torch.equal(rec.value > tau, above)
    torch.testing.assert_close(rec.value[above], exact[above], rtol=0, atol=0)
    if not backend_gate:
        torch.testing.assert_close(rec.value, exact, rtol=0, atol=0)
