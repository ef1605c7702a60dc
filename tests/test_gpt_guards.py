"""The reference GPT's other logit guards, each against a direct computation from the layer's own weights:
Gemma 2's soft-capping (``attn_softcap``) and QK-norm (MHA: whole heads; MLA: the non-rotary parts), and
QK-Clip's refusal of both."""

from __future__ import annotations

import math

import pytest
import torch

import muonclip
from muonclip.models import GPT, GPTConfig
from muonclip.models._gpt import apply_rope


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, **kw))


def _heads(x: torch.Tensor, n: int) -> torch.Tensor:
    B, T, _ = x.shape
    return x.view(B, T, n, -1).transpose(1, 2)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cap: float) -> torch.Tensor:
    """Loop over (query, key) pairs: weights softmax_j(cap tanh(s_ij / cap)) over j <= i (cap 0: no cap)."""
    B, H, T, _ = q.shape
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    for i in range(T):
        s = torch.stack([(q[:, :, i] * k[:, :, j]).sum(-1) * scale for j in range(i + 1)], dim=-1)  # (B, H, i+1)
        if cap:
            s = cap * torch.tanh(s / cap)
        w = torch.exp(s - s.max(-1, keepdim=True).values)
        w = w / w.sum(-1, keepdim=True)
        out[:, :, i] = torch.einsum("bhj,bhjd->bhd", w, v[:, :, : i + 1])
    return out


def mha_reference(attn, x: torch.Tensor, cap: float) -> torch.Tensor:
    """The MHA/GQA layer's output in float64, from its weights."""
    d = lambda m: m.weight.double()  # noqa: E731
    x = x.double()
    H, hd = attn.n_head, attn.head_dim
    q, k, v = _heads(x @ d(attn.q_proj).T, H), _heads(x @ d(attn.k_proj).T, attn.n_kv_head), \
        _heads(x @ d(attn.v_proj).T, attn.n_kv_head)
    if attn.q_norm is not None:
        q, k = _rms(q, d(attn.q_norm), attn.q_norm.eps or 1e-6), _rms(k, d(attn.k_norm), attn.k_norm.eps or 1e-6)
    T = x.shape[1]
    cos, sin = attn.cos[:T].double(), attn.sin[:T].double()
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    group = H // attn.n_kv_head
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    y = _attend(q, k, v, 1 / math.sqrt(hd), cap)
    return y.transpose(1, 2).reshape(x.shape[0], T, -1) @ d(attn.o_proj).T


def mla_reference(attn, x: torch.Tensor, cap: float) -> torch.Tensor:
    """The MLA layer's output in float64, from its weights (full-rank q_proj)."""
    d = lambda m: m.weight.double()  # noqa: E731
    x = x.double()
    B, T, _ = x.shape
    H, nope, rope = attn.n_head, attn.nope, attn.rope
    q = _heads(x @ d(attn.q_proj).T, H)
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    a = x @ d(attn.kv_a_proj_with_mqa).T
    c_kv, k_rope = a[..., : attn.kv_rank], a[..., attn.kv_rank:]
    kv = _heads(_rms(c_kv, d(attn.kv_a_norm), attn.kv_a_norm.eps or 1e-6) @ d(attn.kv_b_proj).T, H)
    k_nope, v = kv[..., :nope], kv[..., nope:]
    if attn.q_norm is not None:
        q_nope = _rms(q_nope, d(attn.q_norm), attn.q_norm.eps or 1e-6)
        k_nope = _rms(k_nope, d(attn.k_norm), attn.k_norm.eps or 1e-6)
    cos, sin = attn.cos[:T].double(), attn.sin[:T].double()
    q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], -1)
    k = torch.cat([k_nope, apply_rope(k_rope.view(B, 1, T, rope), cos, sin).expand(B, H, T, rope)], -1)
    y = _attend(q, k, v, 1 / math.sqrt(nope + rope), cap)
    return y.transpose(1, 2).reshape(B, T, -1) @ d(attn.o_proj).T


def _perturb(model: GPT) -> None:
    """Larger q/k weights and norm gains than at init, so that the logits pass the cap and the gains act."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "kv_b_proj.weight", "kv_a_proj_with_mqa.weight")):
                p.mul_(40)


@pytest.mark.parametrize("kw", [dict(attn_softcap=2.0), dict(attn_softcap=2.0, n_kv_head=2), dict(qk_norm=True),
                                dict(qk_norm=True, attn_softcap=1.5)])
def test_mha_guards_equal_their_direct_computation(kw):
    model = tiny(**kw)
    _perturb(model)
    attn = model.blocks[0].attn
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(attn(x).double(), mha_reference(attn, x, kw.get("attn_softcap", 0.0)),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kw", [dict(attn_softcap=2.0), dict(qk_norm=True), dict(qk_norm=True, attn_softcap=1.5)])
def test_mla_guards_equal_their_direct_computation(kw):
    """MLA's QK-norm normalises q^C and k^C of each head (their own gains); q^R and the shared k^R are not."""
    model = tiny(attention="mla", **kw)
    _perturb(model)
    attn = model.blocks[0].attn
    assert attn.q_norm.weight.shape == (attn.nope,) if kw.get("qk_norm") else attn.q_norm is None
    x = torch.randn(2, 12, 32, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(attn(x).double(), mla_reference(attn, x, kw.get("attn_softcap", 0.0)),
                               rtol=1e-4, atol=1e-5)


def test_the_cap_changes_what_the_softmax_sees_but_the_recorder_keeps_the_raw_logits():
    """The same weights with and without a cap: the first layer's recorded per-head maxima are equal (the
    raw logits of the same input), well above the cap; the outputs differ; a cap far above every logit gives
    the uncapped output."""
    plain = tiny()
    _perturb(plain)
    capped, loose = tiny(attn_softcap=2.0), tiny(attn_softcap=1e6)
    capped.load_state_dict(plain.state_dict())
    loose.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(4))
    out = {name: m(idx)[0] for name, m in (("plain", plain), ("capped", capped), ("loose", loose))}
    raw = {name: m.pop_max_logits() for name, m in (("plain", plain), ("capped", capped))}
    first = "blocks.0.attn"  # the later layers' inputs differ once the first one caps
    torch.testing.assert_close(raw["capped"][first], raw["plain"][first], rtol=1e-5, atol=1e-5)
    assert float(raw["capped"][first].min()) > 10 * 2.0
    assert (out["capped"] - out["plain"]).abs().max() > 1e-2
    torch.testing.assert_close(out["loose"], out["plain"], rtol=1e-4, atol=1e-4)
    capped.eval()
    capped(idx)
    assert capped.pop_max_logits() == {}  # evaluation never feeds the recorder


@pytest.mark.parametrize(("kw", "match"), [
    (dict(attn_softcap=30.0), r"soft-caps its logits \(attn_softcap=30\).*not supported.*attn_softcap=0"),
    (dict(attention="mla", attn_softcap=30.0), "soft-caps its logits"),
    (dict(attention="mla", qk_norm=True), "has QK-norm"),
])
def test_muonclip_refuses_a_layer_guarded_another_way(kw, match):
    with pytest.raises(ValueError, match=match):
        muonclip.MuonClip(tiny(**kw), lr=0.02, tau=30.0)
    muonclip.Muon(muonclip.param_groups(tiny(**kw)), lr=0.02)  # plain Muon takes it


@pytest.mark.parametrize("cap", [-1.0, math.inf, math.nan])
def test_a_bad_cap_is_refused(cap):
    with pytest.raises(ValueError, match="attn_softcap must be a finite number >= 0"):
        GPTConfig(attn_softcap=cap)
