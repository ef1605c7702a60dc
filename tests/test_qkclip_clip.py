"""Head layouts and the clip: head h's logits times exactly gamma_h, everything else untouched."""

from __future__ import annotations

import math

import pytest
import torch

from muonclip.attention import MaxLogitRecorder
from muonclip.qkclip import (
    AttentionLayer,
    GQALayout,
    MHALayout,
    MLALayout,
    StridedRows,
    all_reduce_max_,
    apply_qk_clip,
    compute_gamma,
)

D_IN, HD = 12, 4


def _rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def head_logits(x, wq, bq, wk, bk, n_heads, n_kv):
    """(n_heads, T, T) logits q_h . k_{g(h)} for input x (T, D_IN)."""
    q = (x @ wq.T + (0 if bq is None else bq)).view(-1, n_heads, HD).transpose(0, 1)
    k = (x @ wk.T + (0 if bk is None else bk)).view(-1, n_kv, HD).transpose(0, 1)
    k = k.repeat_interleave(n_heads // n_kv, dim=0)
    return q.double() @ k.double().transpose(-1, -2)


GAMMA = torch.tensor([1.0, 0.25, 1.0, 0.6])


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kind", ["mha", "gqa", "mqa"])
def test_mha_gqa_per_head_clip_scales_logits_by_gamma(kind, bias):
    """Unclipped heads and shared keys keep their bits on any machine: their factor is exactly 1 (or they
    are not written)."""
    n_kv = {"mha": 4, "gqa": 2, "mqa": 1}[kind]
    wq, wk = _rand(4 * HD, D_IN, seed=1), _rand(n_kv * HD, D_IN, seed=2)
    bq, bk = (_rand(4 * HD, seed=3), _rand(n_kv * HD, seed=4)) if bias else (None, None)
    x = _rand(5, D_IN, seed=5)
    before = head_logits(x, wq, bq, wk, bk, 4, n_kv)
    orig = [t.clone() if t is not None else None for t in (wq, bq, wk, bk)]
    if kind == "mha":
        layout = MHALayout(wq, wk, 4, HD, bq, bk)
    else:
        layout = GQALayout(wq, wk, 4, n_kv, HD, bq, bk)
    layout.check()
    layout.clip(GAMMA)
    after = head_logits(x, wq, bq, wk, bk, 4, n_kv)
    torch.testing.assert_close(after, GAMMA.double()[:, None, None] * before, rtol=1e-5, atol=1e-5)
    for h in (0, 2):  # unclipped heads: bit-identical rows
        rows = slice(h * HD, (h + 1) * HD)
        assert torch.equal(wq[rows], orig[0][rows])
        if bias:
            assert torch.equal(bq[rows], orig[1][rows])
        if kind == "mha":
            assert torch.equal(wk[rows], orig[2][rows])
    if kind != "mha":  # per-head policy: the shared key heads are never touched
        assert torch.equal(wk, orig[2]) and (not bias or torch.equal(bk, orig[3]))


def test_gqa_balanced_keeps_logit_invariant_and_group_policy_overclips():
    """Group 1's rows keep their bits: their factor is exactly 1."""
    x = _rand(5, D_IN, seed=5)
    gamma = torch.tensor([1.0, 0.25, 1.0, 1.0])  # group 0 = heads (0, 1) has a clipped head; group 1 has none
    wq0, wk0 = _rand(4 * HD, D_IN, seed=1), _rand(2 * HD, D_IN, seed=2)
    before = head_logits(x, wq0, None, wk0, None, 4, 2)
    wq, wk = wq0.clone(), wk0.clone()
    GQALayout(wq, wk, 4, 2, HD, policy="balanced").clip(gamma)
    torch.testing.assert_close(head_logits(x, wq, None, wk, None, 4, 2), gamma.double()[:, None, None] * before)
    torch.testing.assert_close(wk[:HD], wk0[:HD] * 0.5)  # key head 0 by sqrt(min gamma of its group)
    assert torch.equal(wq[2 * HD:], wq0[2 * HD:]) and torch.equal(wk[HD:], wk0[HD:])  # group 1 untouched
    wq, wk = wq0.clone(), wk0.clone()
    GQALayout(wq, wk, 4, 2, HD, policy="group").clip(gamma)
    overclip = torch.tensor([0.25, 0.25, 1.0, 1.0], dtype=torch.float64)  # head 0 is clipped too: documented
    torch.testing.assert_close(head_logits(x, wq, None, wk, None, 4, 2), overclip[:, None, None] * before)


def test_mla_clip_scales_both_logit_terms_and_leaves_v_and_shared_rope_key():
    """V rows and head 1 keep their bits: V is never scaled and head 1's factor is exactly 1."""
    H, nope, rope, dv, rank = 3, 4, 2, 5, 6
    qw, kvw = _rand(H * (nope + rope), D_IN, seed=1), _rand(H * (nope + dv), rank, seed=2)
    qb, kvb = _rand(H * (nope + rope), seed=3), _rand(H * (nope + dv), seed=4)
    x, c = _rand(5, D_IN, seed=5), _rand(5, rank, seed=6)
    k_rope = _rand(5, rope, seed=7)  # the shared rotary key: not a parameter of the layout

    def logits():
        q = (x @ qw.T + qb).view(5, H, nope + rope).transpose(0, 1)
        kv = (c @ kvw.T + kvb).view(5, H, nope + dv).transpose(0, 1)
        k = torch.cat([kv[..., :nope], k_rope.expand(H, 5, rope)], dim=-1)
        return q.double() @ k.double().transpose(-1, -2), kv[..., nope:].clone()

    before, v_before = logits()
    orig = qw.clone(), kvw.clone(), qb.clone(), kvb.clone()
    gamma = torch.tensor([0.3, 1.0, 0.8])
    layout = MLALayout(qw, H, nope, rope, kvw, dv, q_bias=qb, kv_b_bias=kvb)
    layout.check()
    layout.clip(gamma)
    after, v_after = logits()
    torch.testing.assert_close(after, gamma.double()[:, None, None] * before, rtol=1e-5, atol=1e-5)
    assert torch.equal(v_after, v_before)
    q_rows, kv_rows = slice(nope + rope, 2 * (nope + rope)), slice(nope + dv, 2 * (nope + dv))
    assert torch.equal(qw[q_rows], orig[0][q_rows]) and torch.equal(kvw[kv_rows], orig[1][kv_rows])
    torch.testing.assert_close(qw[nope:nope + rope], orig[0][nope:nope + rope] * 0.3)  # q^R by gamma
    torch.testing.assert_close(qw[:nope], orig[0][:nope] * math.sqrt(0.3))  # q^C by sqrt(gamma)


def test_unclipped_rows_bit_identical_in_bf16():
    """Exact in bf16 too: x * 1 = x in IEEE, whatever the dtype."""
    wq, wk = _rand(4 * HD, D_IN).bfloat16(), _rand(4 * HD, D_IN, seed=1).bfloat16()
    oq = wq.clone()
    MHALayout(wq, wk, 4, HD).clip(torch.tensor([1.0, 0.5, 1.0, 1.0]))
    assert torch.equal(wq[:HD], oq[:HD]) and torch.equal(wq[2 * HD:], oq[2 * HD:])
    assert not torch.equal(wq[HD:2 * HD], oq[HD:2 * HD]) and wq.dtype == torch.bfloat16


def test_compute_gamma():
    s = torch.tensor([50.0, 100.0, 200.0, -math.inf, math.nan, 400.0])
    torch.testing.assert_close(compute_gamma(s, 100.0), torch.tensor([1.0, 1.0, 0.5, 1.0, 1.0, 0.25]))
    assert compute_gamma(s, 100.0)[:2].eq(1.0).all()


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: MHALayout(_rand(15, D_IN), _rand(16, D_IN), 4, HD), "q_weight has 15 rows"),
        (lambda: MHALayout(_rand(16, D_IN), _rand(16, D_IN), 4, HD, k_bias=_rand(12)), "k_bias has 12 rows"),
        (lambda: MHALayout(_rand(16), _rand(16, D_IN), 4, HD), "q_weight must be a weight matrix"),
        (lambda: GQALayout(_rand(16, D_IN), _rand(8, D_IN), 4, 3, HD), "not a multiple"),
        (lambda: GQALayout(_rand(16, D_IN), _rand(16, D_IN), 4, 2, HD), "k_weight has 16 rows"),
        (lambda: GQALayout(_rand(16, D_IN), _rand(8, D_IN), 4, 2, HD, policy="max"), "policy"),
        (lambda: MLALayout(_rand(18, D_IN), 3, 4, 2, _rand(26, 6), 5), "kv_b_weight has 26 rows"),
        (lambda: MLALayout(_rand(18, D_IN), 3, 4, 0, _rand(27, 6), 5), "qk_rope_head_dim must be a positive"),
        (lambda: MHALayout(StridedRows(_rand(36, D_IN), 0, 4, 3, 3), StridedRows(_rand(36, D_IN), 4, 4, 12, 3), 3, HD),
         "blocks of 4 rows at stride 3 overlap"),
        (lambda: MHALayout(StridedRows(_rand(36, D_IN), 4, 4, 12, 3), StridedRows(_rand(36, D_IN), 9, 4, 12, 3), 3, HD),
         "k_weight: StridedRows .* end at row 37, past the 36 rows"),
        (lambda: MHALayout(StridedRows(_rand(36, D_IN), 0, 4, 12, 2), StridedRows(_rand(36, D_IN), 4, 4, 12, 3), 3, HD),
         r"q_weight has 8 rows \(2 blocks of 4\) but the stated head layout needs 12"),
        (lambda: MHALayout(_rand(12, D_IN), _rand(12, D_IN), 3, HD, q_bias=StridedRows(_rand(36, D_IN), 0, 4, 12, 3)),
         "q_bias must be 1-D entries of a bias"),
    ],
)
def test_layout_shape_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make().check()


def test_attention_layer_check_names_the_layer():
    bad = AttentionLayer("blocks.3.attn", MHALayout(_rand(15, D_IN), _rand(16, D_IN), 4, HD), MaxLogitRecorder(4))
    with pytest.raises(ValueError, match="'blocks.3.attn': q_weight has 15 rows"):
        bad.check()
    mismatch = AttentionLayer("a", MHALayout(_rand(16, D_IN), _rand(16, D_IN), 4, HD), MaxLogitRecorder(2))
    with pytest.raises(ValueError, match="recorder has 2 heads"):
        mismatch.check()


def test_apply_qk_clip_consumes_maxima_and_skips_unrecorded_layers():
    """Unclipped rows keep their bits: their factor is exactly 1."""
    wq, wk = _rand(16, D_IN), _rand(16, D_IN)
    oq, ok = wq.clone(), wk.clone()
    rec_a, rec_b = MaxLogitRecorder(4), MaxLogitRecorder(4)
    layers = [AttentionLayer("a", MHALayout(wq, wk, 4, HD), rec_a),
              AttentionLayer("b", MHALayout(_rand(16, D_IN), _rand(16, D_IN), 4, HD), rec_b)]
    maxima, clipped = apply_qk_clip(layers, 10.0)  # nothing recorded: nothing to clip, no error
    assert maxima == {} and clipped == {} and torch.equal(wq, oq)
    rec_a.update(torch.tensor([5.0, 40.0, 10.0, 20.0]))
    all_reduce_max_(layers)  # no process group: a no-op
    maxima, clipped = apply_qk_clip(layers, 10.0)
    assert list(maxima) == ["a"] and clipped["a"].tolist() == [False, True, False, True]
    assert rec_a.value is None and rec_b.value is None
    torch.testing.assert_close(wq[HD:2 * HD], oq[HD:2 * HD] * 0.5)
    torch.testing.assert_close(wk[3 * HD:], ok[3 * HD:] * math.sqrt(0.5))
    assert torch.equal(wq[:HD], oq[:HD]) and torch.equal(wk[2 * HD:3 * HD], ok[2 * HD:3 * HD])
    with pytest.raises(ValueError, match="tau"):
        apply_qk_clip(layers, 0.0)


@pytest.mark.parametrize("transposed", [False, True])
def test_strided_rows_scale_exactly_their_rows(transposed):
    """GPT-NeoX's query_key_value: head h's q rows [12h, 12h+4), k rows [12h+4, 12h+8), v the rest.
    An MHA clip of StridedRows scales q and k rows of clipped heads by sqrt(gamma), and leaves every
    other element bit-identical (factor exactly 1.0)."""
    w = _rand(36, D_IN, seed=7)  # (out, in) = (3 heads * [q k v] * 4 rows, D_IN)
    b = _rand(36, seed=8)
    stored = w.T.clone() if transposed else w.clone()
    bias = b.clone()
    q, k = StridedRows(stored, 0, 4, 12, 3, transposed), StridedRows(stored, 4, 4, 12, 3, transposed)
    assert q.indices().tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 24, 25, 26, 27] and q.n_rows == 12
    layout = MHALayout(q, k, 3, HD, StridedRows(bias, 0, 4, 12, 3), StridedRows(bias, 4, 4, 12, 3))
    layout.check()
    gamma = torch.tensor([1.0, 0.25, 0.64])
    layout.clip(gamma)
    got = stored.T if transposed else stored
    root = gamma.sqrt()
    factor = torch.ones(3, 3, 4)
    factor[:, :2] = root[:, None, None]  # per head: [q k] rows by sqrt(gamma), v rows by 1
    torch.testing.assert_close(got, w * factor.reshape(36, 1), rtol=0, atol=0)
    torch.testing.assert_close(bias, b * factor.reshape(36), rtol=0, atol=0)
    untouched = factor.reshape(36) == 1.0
    assert torch.equal(got[untouched], w[untouched]) and torch.equal(bias[untouched], b[untouched])


def test_the_step_clips_through_the_public_clip_that_loggers_wrap():
    """`MuonClip.step` runs its clip through ``opt.clip``, so a logger that wraps it (an instance
    attribute, as `muonclip.qkclip.step_metrics.UpdateRMS` does to measure the update before the clip)
    sees every clip, with the weights as the update left them."""
    from muonclip import MuonClip
    from muonclip.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)).train()
    opt = MuonClip(model, lr=0.02, tau=1e-3, orth_dtype=torch.float32)
    inner, seen = opt.clip, []

    def wrapped(*args, **kwargs):
        seen.append(model.blocks[0].attn.q_proj.weight.detach().clone())
        return inner(*args, **kwargs)

    opt.clip = wrapped
    idx = torch.randint(0, 32, (2, 8))
    model(idx, idx)[1].backward()
    opt.step()
    assert len(seen) == 1 and opt.last_clipped["blocks.0.attn"].all()
    assert not torch.equal(seen[0], model.blocks[0].attn.q_proj.weight)  # wrapped before the clip scaled the rows
