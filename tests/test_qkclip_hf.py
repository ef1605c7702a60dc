"""QK-Clip on Hugging Face transformers models built from tiny configs (never downloaded).

Reference for every max logit: the probe of ``hf_probe`` (a test-only attention function that
captures the query (after RoPE), key and mask transformers hands to its stock SDPA
implementation, and computes ``scaling * q.k`` explicitly, masked, per head).
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from clip_input import assert_clip_input  # noqa: E402
from hf_probe import (  # noqa: E402
    assert_only_clipped_rows_changed,
    capture_forward,
    changeable,
    reference_max,
    replay_max,
    save_attention_inputs,
    tau_between_heads,
)
from transformers import (  # noqa: E402
    AttentionInterface,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from muonclip.integrations.hf import ATTN_IMPLEMENTATION, RECORDER_ATTR, attach  # noqa: E402
from muonclip.qkclip import GQALayout, MHALayout, MLALayout, Rows  # noqa: E402

VOCAB, B, T = 64, 3, 9

# ----------------------------------------------------------------------------------------------
# tiny models
# ----------------------------------------------------------------------------------------------

COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, pad_token_id=0)


def _llama(n_kv: int):
    return LlamaForCausalLM(LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=n_kv, head_dim=8))


def _qwen2(n_kv: int, sliding_window: int | None = None):
    window = dict(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=0) if sliding_window else {}
    return Qwen2ForCausalLM(Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=n_kv, **window))


def _dsv3(q_lora_rank: int | None):
    cfg = DeepseekV3Config(
        **COMMON, moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
    )
    return DeepseekV3ForCausalLM(cfg)


def _phi3(n_kv: int):
    return Phi3ForCausalLM(Phi3Config(**COMMON, num_attention_heads=4, num_key_value_heads=n_kv))


def _gpt2():
    cfg = GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2, scale_attn_by_inverse_layer_idx=True,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: train and eval forwards agree
    return GPT2LMHeadModel(cfg)


MODELS = {
    "llama-mha": (lambda: _llama(4), MHALayout),
    "llama-gqa": (lambda: _llama(2), GQALayout),
    "qwen2-gqa-bias": (lambda: _qwen2(2), GQALayout),
    "qwen2-mqa-bias": (lambda: _qwen2(1), GQALayout),
    "qwen2-sliding-window": (lambda: _qwen2(2, sliding_window=3), GQALayout),  # mask kept for sliding layers too
    "dsv3-mla-qlora": (lambda: _dsv3(16), MLALayout),
    "dsv3-mla-qproj": (lambda: _dsv3(None), MLALayout),
    "phi3-fused-gqa": (lambda: _phi3(2), GQALayout),  # qkv_proj rows [q | k | v]
    "gpt2-fused-conv1d": (_gpt2, MHALayout),  # c_attn stored (in, out), columns [q | k | v], biases
}
FUSED = ("phi3-fused-gqa", "gpt2-fused-conv1d")


def build(kind: str, seed: int = 0):
    torch.manual_seed(seed)
    model = MODELS[kind][0]().float().eval()
    with torch.no_grad():  # larger q/k weights: logits of order 5-30, heads spread apart; non-zero biases
        for name, p in model.named_parameters():
            if any(s in name for s in ("q_proj", "k_proj", "q_b_proj", "kv_b_proj", "kv_a_proj")) and p.ndim == 2:
                p.mul_(torch.linspace(10.0, 30.0, p.shape[0])[:, None])
            if "qkv_proj.weight" in name:  # q and k rows of the fused (out, in) weight
                p[:48].mul_(torch.linspace(10.0, 30.0, 48)[:, None])
            if "c_attn.weight" in name:  # GPT-2's Conv1D is (in, out): q and k are the first 64 columns
                p[:, :64].mul_(torch.linspace(10.0, 30.0, 64)[None, :])
            if name.endswith("_proj.bias") or name.endswith("c_attn.bias"):
                p.normal_(0.0, 0.5)
    return model


def batch(seed: int = 1):
    """Input ids and a LEFT-padded attention mask (row 1: 3 pads, row 2: 5 pads)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, :3] = 0
    am[2, :5] = 0
    return ids.masked_fill(am == 0, 0), am


# ----------------------------------------------------------------------------------------------
# attach: layouts, attention output, mask, recorded maxima
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [k for k in MODELS if k not in FUSED])
def test_attach_finds_layers_and_layouts(kind):
    model = build(kind)
    layers = attach(model)
    assert [ly.name for ly in layers] == [f"model.layers.{i}.self_attn" for i in range(2)]
    assert all(type(ly.layout) is MODELS[kind][1] for ly in layers)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    attn = model.model.layers[0].self_attn
    lay = layers[0].layout
    assert getattr(attn, RECORDER_ATTR) is layers[0].recorder and layers[0].recorder.n_heads == 4
    if isinstance(lay, MLALayout):
        q = attn.q_b_proj if attn.q_b_proj is not None else attn.q_proj
        assert lay.q_weight is q.weight and lay.kv_b_weight is attn.kv_b_proj.weight
        assert (lay.qk_nope_head_dim, lay.qk_rope_head_dim, lay.v_head_dim) == (8, 4, 6)
    else:
        assert lay.q_weight is attn.q_proj.weight and lay.k_weight is attn.k_proj.weight
        assert lay.q_bias is attn.q_proj.bias and lay.k_bias is attn.k_proj.bias
        assert (lay.q_bias is not None) == kind.startswith("qwen2")
    # attaching again keeps the same recorders (MuonClip's discovery may call it after the user)
    again = attach(model)
    assert all(a.recorder is b.recorder for a, b in zip(layers, again))


@pytest.mark.parametrize("kind", list(MODELS))
def test_output_and_grads_equal_stock_sdpa_with_padding(kind):
    ids, am = batch()
    ref = build(kind).train()  # training forwards (no dropout in these configs): they record
    ours = copy.deepcopy(ref)
    layers = attach(ours)
    assert ref.config._attn_implementation == "sdpa"
    for mask in (am, None):
        ref.zero_grad()
        ours.zero_grad()
        a = ref(ids, attention_mask=mask, use_cache=False).logits
        b = ours(ids, attention_mask=mask, use_cache=False).logits
        real = (am.bool() if mask is not None else torch.ones_like(am, dtype=torch.bool))[..., None]
        torch.testing.assert_close(b * real, a * real, rtol=1e-6, atol=1e-6)
        (a * real).square().sum().backward()
        (b * real).square().sum().backward()
        for (n, p), q in zip(ref.named_parameters(), ours.parameters()):
            if p.grad is not None:
                torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=n)
    # the mask is kept: without it, the real tokens of the left-padded rows would read the pads
    with torch.no_grad():
        masked = ours(ids, attention_mask=am, use_cache=False).logits
        unmasked = ours(ids, use_cache=False).logits
    assert not torch.allclose(masked[1, 3:], unmasked[1, 3:], atol=1e-4)
    assert all(ly.recorder.value is not None for ly in layers)


@pytest.mark.parametrize("kind", list(MODELS))
def test_recorded_max_equals_explicit_masked_max(kind):
    model = build(kind)
    ids, am = batch()
    layers = attach(model)
    model.train()  # training forwards (grad enabled, training mode) feed the recorders; no dropout in these configs
    for mask in (None, am):  # GQA through enable_gqa (no mask) and through repeated heads (mask)
        ref = reference_max(model, ids, mask)
        model(ids, attention_mask=mask, use_cache=False)
        for ly in layers:
            torch.testing.assert_close(ly.recorder.value, ref[ly.name], rtol=1e-5, atol=1e-5)
            assert torch.isfinite(ly.recorder.value).all()  # real logits, not the masked -inf/finfo.min
            ly.recorder.reset()
    model(ids, attention_mask=am, use_cache=False)
    # running max over two micro-batches == max over both; reset forgets
    ids2, am2 = batch(seed=7)
    ref2 = reference_max(model, ids2, am2)
    model(ids2, attention_mask=am2, use_cache=False)
    for ly in layers:
        torch.testing.assert_close(ly.recorder.value, torch.maximum(ref[ly.name], ref2[ly.name]), rtol=1e-5, atol=1e-5)
        ly.recorder.reset()
        assert ly.recorder.value is None


def test_mask_is_lost_without_the_mask_registration():
    """Why the mask interface matters: transformers builds no mask for an unknown implementation."""
    model = build("llama-gqa")
    ids, am = batch()
    with torch.no_grad():
        ref = model(ids, attention_mask=am, use_cache=False).logits
    name = "muonclip_test_no_mask"
    AttentionInterface.register(name, capture_forward)
    try:
        model.set_attn_implementation(name)
        with torch.no_grad():
            lost = model(ids, attention_mask=am, use_cache=False).logits
    finally:
        model.set_attn_implementation("sdpa")
        del AttentionInterface._global_mapping[name]
    assert not torch.allclose(lost[1, 3:], ref[1, 3:], atol=1e-4)
    attach(model)
    with torch.no_grad():
        kept = model(ids, attention_mask=am, use_cache=False).logits
    torch.testing.assert_close(kept[1, 3:], ref[1, 3:], rtol=1e-6, atol=1e-6)


def test_detach_restores_sdpa():
    from muonclip.integrations.hf import detach

    model = build("llama-gqa")
    attach(model)
    detach(model)
    assert model.config._attn_implementation == "sdpa"
    assert not any(hasattr(m, RECORDER_ATTR) for m in model.modules())


def test_attach_walks_the_model_a_fixed_number_of_times_whatever_its_layers(monkeypatch):
    """Finding the layers walks the module tree a number of times that does not grow with the
    layer count (once per layer it was quadratic: minutes on K2's 61 layers of 384 experts held as
    modules; benchmarks/bench_bookkeeping.py)."""
    walks: list[int] = []
    named_modules = torch.nn.Module.named_modules

    def counted(self, *args, **kwargs):
        if self is walks[0]:
            walks[1] += 1
        return named_modules(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "named_modules", counted)
    counts = []
    for layers in (1, 4):
        model = LlamaForCausalLM(LlamaConfig(**{**COMMON, "num_hidden_layers": layers}, num_attention_heads=4,
                                             num_key_value_heads=2, head_dim=8))
        walks[:] = [model, 0]
        assert len(attach(model)) == layers
        counts.append(walks[1])
    assert counts[0] == counts[1], counts


# ----------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------


def test_qwen3_qk_norm_gets_a_clear_error():
    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn.*q_norm \(Qwen3RMSNorm\), k_norm.*cannot bound"):
        attach(model)
    assert model.config._attn_implementation == "sdpa"  # nothing switched


def test_no_attention_and_wrong_shapes_are_clear_errors():
    with pytest.raises(ValueError, match="no attention modules found"):
        attach(torch.nn.Sequential(torch.nn.Linear(4, 4)))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        attach("llama")
    model = build("llama-gqa")
    model.config.num_key_value_heads = 4  # the config is not read: head counts come from each module
    assert isinstance(attach(model)[0].layout, GQALayout)
    model = build("llama-gqa")
    model.model.layers[0].self_attn.num_key_value_groups = 1  # the module now says 4 key heads, k_proj holds 2
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn.*k_weight has 16 rows.*32"):
        attach(model)


# ----------------------------------------------------------------------------------------------
# MuonClip with lr=0: the clip is the only change
# ----------------------------------------------------------------------------------------------


def _muonclip_and_plain_muon_step(kind: str, lr: float, gqa_policy: str = "per_head"):
    """One MuonClip step on a tiny model and one plain Muon step on a copy, with identical gradients.

    Returns (model, opt, plain_model, plain_opt, tau, S before, each attention module's saved inputs,
    weights before the step)."""
    from muonclip.optim import Muon, param_groups
    from muonclip.qkclip import MuonClip

    model = build(kind)
    ids, am = batch()
    labels = ids.masked_fill(am == 0, -100)
    before = reference_max(model, ids, am)
    tau = tau_between_heads(before)

    plain = copy.deepcopy(model)
    opt = MuonClip(model, lr=lr, tau=tau, weight_decay=0.1, layers=attach(model, gqa_policy=gqa_policy))
    plain_opt = Muon(param_groups(plain), lr=lr, weight_decay=0.1)

    saved, hooks = save_attention_inputs(model)
    model.train()
    model(ids, attention_mask=am, labels=labels, use_cache=False).loss.backward()
    for h in hooks:
        h.remove()
    for p, q in zip(model.parameters(), plain.parameters()):
        if p.grad is not None:
            q.grad = p.grad.clone()  # identical gradients for the plain optimizer

    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    plain_opt.step()
    return model, opt, plain, plain_opt, tau, before, saved, w0


@pytest.mark.parametrize("kind", list(MODELS))
def test_muonclip_lr0_clips_exactly_to_tau(kind):
    """Exact parts, on any machine: with lr 0 the plain step leaves every weight as it is (IEEE); rows the
    clip may not touch are multiplied by exactly 1 or not written; the state is the same ops on the
    same values. tau lies more than 5e-4 from every head's max (_tau_between_heads), so the clipped
    heads do not depend on round-off."""
    model, opt, plain, plain_opt, tau, before, saved, w0 = _muonclip_and_plain_muon_step(kind, lr=0.0)
    for n, p in plain.named_parameters():
        assert torch.equal(p, w0[n]), f"lr=0 Muon step changed {n}"

    layers = {ly.name: ly for ly in opt.layers}
    after = replay_max(model, saved)
    n_clipped = 0
    for name, s in before.items():
        assert_clip_input(opt.last_max_logits[name], opt.last_bounded[name], s, tau)
        torch.testing.assert_close(after[name], torch.clamp(s, max=tau), rtol=1e-5, atol=1e-5)
        clipped = s > tau
        assert torch.equal(opt.last_clipped[name].cpu(), clipped)
        n_clipped += int(clipped.sum())
        assert layers[name].recorder.value is None  # consumed by the clip
    assert 0 < n_clipped < sum(s.numel() for s in before.values())
    assert_only_clipped_rows_changed(model, opt.layers, {n: s > tau for n, s in before.items()}, w0)

    # optimizer state: exactly what plain Muon (same grads, lr=0, no clip) holds (besides MuonClip's tau)
    plain_params = dict(plain.named_parameters())
    for n, p in model.named_parameters():
        st, ref_st = opt.state.get(p, {}), plain_opt.state.get(plain_params[n], {})
        assert st.pop("tau", opt.tau) == opt.tau
        assert st.keys() == ref_st.keys(), n
        for k in st:
            a, b = st[k], ref_st[k]
            assert torch.equal(a, b) if torch.is_tensor(a) else a == b, f"{n}: state {k} differs"


@pytest.mark.parametrize("kind", ["llama-mha", "qwen2-gqa-bias", "dsv3-mla-qlora", *FUSED])
def test_muonclip_normal_step_scales_clipped_heads_by_gamma(kind):
    """lr > 0: each head's logits are gamma_h times those of plain Muon's updated weights.

    What the clip may not touch equals plain Muon's bit for bit on any machine: both ran the same
    step on copies with identical gradients, and the clip multiplies those rows by exactly 1 or
    leaves them."""
    model, opt, plain, _, tau, before, saved, _ = _muonclip_and_plain_muon_step(kind, lr=0.02)
    clipped_ml, plain_ml = replay_max(model, saved), replay_max(plain, saved)
    layers = {ly.name: ly for ly in opt.layers}
    masks: dict[int, torch.Tensor] = {}
    for name, s in before.items():
        gamma = torch.where(s > tau, tau / s, torch.ones_like(s))
        assert not torch.allclose(plain_ml[name], s, rtol=1e-3)  # the weights did move
        torch.testing.assert_close(clipped_ml[name], gamma * plain_ml[name], rtol=1e-5, atol=1e-5)
        changeable(layers[name], s > tau, masks)
    plain_params = dict(plain.named_parameters())
    for n, p in model.named_parameters():  # everything the clip may not touch equals plain Muon's
        m = masks.get(id(p), torch.zeros(p.shape, dtype=torch.bool))
        assert torch.equal(p.detach()[~m], plain_params[n].detach()[~m]), n


@pytest.mark.parametrize("policy", ["balanced", "group"])
def test_other_gqa_policies(policy):
    """"balanced" keeps the logit invariant (shared key scaled too); "group" over-clips whole groups."""
    model, opt, *_, tau, before, saved, _ = _muonclip_and_plain_muon_step("llama-gqa", lr=0.0, gqa_policy=policy)
    assert all(ly.layout.policy == policy for ly in opt.layers)
    after = replay_max(model, saved)
    for name, s in before.items():
        if policy == "balanced":
            torch.testing.assert_close(after[name], torch.clamp(s, max=tau), rtol=1e-5, atol=1e-5)
        else:
            assert (after[name] <= torch.clamp(s, max=tau) * (1 + 1e-5)).all()
    if policy == "group":  # some head at or below tau shares its key head with a clipped one
        over = [(after[n] < torch.clamp(s, max=tau) * (1 - 1e-3)).any() for n, s in before.items()]
        assert any(over)


@pytest.mark.parametrize("kind", FUSED)
def test_attach_fused_projections_as_row_ranges(kind):
    """Phi-3's qkv_proj rows [q | k | v] and GPT-2's Conv1D c_attn columns [q | k | v] become Rows.

    scale_rows_ against the same single multiplication: equal bit for bit (IEEE rounds it alike)."""
    model = build(kind)
    layers = attach(model)
    assert len(layers) == 2 and all(type(ly.layout) is MODELS[kind][1] for ly in layers)
    lay = layers[0].layout
    if kind.startswith("phi3"):
        w = model.model.layers[0].self_attn.qkv_proj.weight  # (4*8 + 2*8 + 2*8, 32)
        assert (lay.q_weight, lay.k_weight) == (Rows(w, 0, 32), Rows(w, 32, 48))
        assert lay.q_bias is None and lay.n_kv_heads == 2
    else:
        c = model.transformer.h[0].attn.c_attn  # weight (32, 96) = (in, out), bias (96,)
        assert (lay.q_weight, lay.k_weight) == (Rows(c.weight, 0, 32, True), Rows(c.weight, 32, 64, True))
        assert (lay.q_bias, lay.k_bias) == (Rows(c.bias, 0, 32), Rows(c.bias, 32, 64))
    from muonclip.qkclip._layouts import scale_rows_

    t = torch.randn(6, 10)
    for rows, expect in ((Rows(t, 2, 5), lambda x, f: x[2:5] * f[:, None]),
                         (Rows(t, 4, 9, True), lambda x, f: x[:, 4:9] * f[None, :])):
        x, f = t.clone(), torch.rand(rows.stop - rows.start) + 0.5
        want = expect(x, f)
        scale_rows_(Rows(x, rows.start, rows.stop, rows.transposed), f)
        got = x[rows.start:rows.stop] if not rows.transposed else x[:, rows.start:rows.stop]
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        untouched = torch.ones_like(x, dtype=torch.bool)
        if rows.transposed:
            untouched[:, rows.start:rows.stop] = False
        else:
            untouched[rows.start:rows.stop] = False
        assert torch.equal(x[untouched], t[untouched])
    with pytest.raises(ValueError, match="do not fit the 6 rows"):
        MHALayout(Rows(t, 0, 8), Rows(t, 0, 4), 2, 2).check()


# ----------------------------------------------------------------------------------------------
# discovery: MuonClip(model) finds a transformers model's layers through the registered discoverer
# ----------------------------------------------------------------------------------------------


def test_discover_layers_asks_the_registered_discoverers_in_order(monkeypatch):
    """`import muonclip` registers `hf_layers`; a discoverer answering None passes the model on."""
    from muonclip.integrations import hf_layers
    from muonclip.qkclip import _discovery as discovery

    assert hf_layers in discovery.DISCOVERERS
    asked = []
    monkeypatch.setattr(discovery, "DISCOVERERS", [lambda m: asked.append(m) or None, *discovery.DISCOVERERS])
    model = build("llama-gqa")
    found = discovery.discover_layers(model)
    assert asked == [model]
    assert [(l.name, type(l.layout)) for l in found] == [(l.name, type(l.layout)) for l in attach(build("llama-gqa"))]
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert hf_layers(plain) is None
    with pytest.raises(ValueError, match="could not find attention layers in Sequential"):
        discovery.discover_layers(plain)


@pytest.mark.parametrize("kind", ["llama-gqa", "qwen2-sliding-window", "gpt2-fused-conv1d"])
def test_attention_function_gates_with_muonclips_tau(kind):
    """Through transformers' attention interface (left padding, GQA, a sliding window, GPT-2's fused
    projection), MuonClip's tau reaches the recorders: heads below tau may be recorded as LSE bounds
    (at or below tau, at least the exact max: at least one is, so the gate ran), and every head above tau
    holds its exact max."""
    from muonclip.qkclip import MuonClip

    model = build(kind)
    ids, am = batch()
    exact = reference_max(model, ids, am)
    tau = tau_between_heads(exact)
    opt = MuonClip(model, lr=0.0, tau=tau, layers=attach(model))
    assert all(layer.recorder.threshold == tau for layer in opt.layers)
    model.train()
    model(ids, attention_mask=am, use_cache=False)
    n_bounded = 0
    for layer in opt.layers:
        assert_clip_input(layer.recorder.value, layer.recorder.bounded, exact[layer.name], tau)
        n_bounded += int(layer.recorder.bounded.sum())
    assert n_bounded > 0
