"""QK-Clip over Hugging Face model families, each built from a tiny config (never downloaded).

One row per family. A supported family must clip exactly: ``MuonClip(model, lr=0.0,
weight_decay=0.0, tau=...)``, one step, and every head's max logit measured by the independent
probe of ``hf_probe`` (re-run on the attention's saved inputs) is ``min(S_h, tau)``, every weight
element outside the clipped heads' q/k rows bit-identical (V included). A family that QK-Clip
cannot serve must be refused with a message that says why, before any training step. So a
transformers release that changes an attention class shows up as a failing row, not as a silent
no-op. A family missing from the installed transformers is skipped.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_probe import (  # noqa: E402
    assert_only_clipped_rows_changed,
    reference_max,
    replay_max,
    save_attention_inputs,
    tau_between_heads,
)

from muonclip.integrations.hf import attach  # noqa: E402
from muonclip.qkclip import MuonClip, StridedRows  # noqa: E402

VOCAB, B, T = 64, 2, 12
C = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, pad_token_id=0, bos_token_id=1,
         eos_token_id=2)
H = dict(num_attention_heads=4, num_key_value_heads=2)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
DSV3 = dict(num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=8, q_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=6, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
            n_group=1, topk_group=1, n_shared_experts=1, moe_intermediate_size=16)
LLAMA4 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2)  # the configuration of the report: qk_norm on by default

# family: (model class, config class, config kwargs)
SUPPORTED = {
    "llama (GQA)": ("LlamaForCausalLM", "LlamaConfig", {**C, **H, "head_dim": 8}),
    "mistral (GQA)": ("MistralForCausalLM", "MistralConfig", {**C, **H, "head_dim": 8}),
    "gemma (MQA)": ("GemmaForCausalLM", "GemmaConfig", {**C, **H, "num_key_value_heads": 1, "head_dim": 8}),
    "starcoder2 (GQA, biases)": ("Starcoder2ForCausalLM", "Starcoder2Config", {**C, **H}),
    "granite (attention multiplier)": ("GraniteForCausalLM", "GraniteConfig", {**C, **H, "attention_multiplier": 0.3}),
    "mixtral (MoE)": ("MixtralForCausalLM", "MixtralConfig", {**C, **H, "num_local_experts": 4}),
    "qwen2 (GQA, biases)": ("Qwen2ForCausalLM", "Qwen2Config", {**C, **H}),
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {**C, **H, **MOE, "shared_expert_intermediate_size": 16}),
    "phi (partial rotary)": ("PhiForCausalLM", "PhiConfig", {**C, "num_attention_heads": 4}),
    "phi-3 (fused qkv_proj)": ("Phi3ForCausalLM", "Phi3Config", {**C, **H}),
    "deepseek-v3 (MLA)": ("DeepseekV3ForCausalLM", "DeepseekV3Config", {**C, **DSV3}),
    "gpt-2 (fused Conv1D c_attn)": ("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2)),
    "gpt-neox (per-head interleaved query_key_value)": ("GPTNeoXForCausalLM", "GPTNeoXConfig", {
        **C, "num_attention_heads": 4, "rotary_pct": 0.5}),
    "llama-4 without qk_norm": ("Llama4ForCausalLM", "Llama4TextConfig", {**LLAMA4, "use_qk_norm": False}),
}

QK_NORM = r"normalises q/k after the projection \({}\): QK-Clip rescales rows of W_q/W_k, which a norm undoes, " \
          r"so it cannot bound the logits"
NO_LAYOUT = r"has no q_proj/k_proj, fused qkv_proj/c_attn, GPT-NeoX query_key_value or MLA kv_b_proj"

# family: (model class, config class, config kwargs, layer, message regex, refused at "attach" or first "forward")
REFUSED = {
    "gemma-2 (logit soft-capping)": ("Gemma2ForCausalLM", "Gemma2Config", {**C, **H, "head_dim": 8}, "",
                                     r"does not support logit soft-capping", "forward"),
    "gemma-3 (q_norm/k_norm)": ("Gemma3ForCausalLM", "Gemma3TextConfig", {**C, **H, "head_dim": 8},
                                "model.layers.0.self_attn", QK_NORM.format(r"q_norm \(Gemma3RMSNorm\), k_norm "
                                                                           r"\(Gemma3RMSNorm\)"), "attach"),
    "qwen3 (q_norm/k_norm)": ("Qwen3ForCausalLM", "Qwen3Config", {**C, **H, "head_dim": 8}, "model.layers.0.self_attn",
                              QK_NORM.format(r"q_norm \(Qwen3RMSNorm\), k_norm \(Qwen3RMSNorm\)"), "attach"),
    "qwen3-moe (q_norm/k_norm)": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {**C, **H, **MOE, "head_dim": 8},
                                  "model.layers.0.self_attn", QK_NORM.format(r"q_norm \(Qwen3MoeRMSNorm\), k_norm "
                                                                             r"\(Qwen3MoeRMSNorm\)"), "attach"),
    "olmo-2 (q_norm/k_norm)": ("Olmo2ForCausalLM", "Olmo2Config", {**C, **H}, "model.layers.0.self_attn",
                               QK_NORM.format(r"q_norm \(Olmo2RMSNorm\), k_norm \(Olmo2RMSNorm\)"), "attach"),
    "olmoe (q_norm/k_norm)": ("OlmoeForCausalLM", "OlmoeConfig", {**C, **H, "num_experts": 4, "num_experts_per_tok": 2},
                              "model.layers.0.self_attn", QK_NORM.format(r"q_norm \(OlmoeRMSNorm\), k_norm "
                                                                         r"\(OlmoeRMSNorm\)"), "attach"),
    "llama-4 (L2 qk_norm)": ("Llama4ForCausalLM", "Llama4TextConfig", LLAMA4, "model.layers.0.self_attn",
                             QK_NORM.format(r"qk_norm \(Llama4TextL2Norm\)"), "attach"),
    "cohere with use_qk_norm": ("CohereForCausalLM", "CohereConfig", {**C, **H, "use_qk_norm": True},
                                "model.layers.0.self_attn", QK_NORM.format(r"q_norm \(CohereLayerNorm\), k_norm "
                                                                           r"\(CohereLayerNorm\)"), "attach"),
    "phi with qk_layernorm": ("PhiForCausalLM", "PhiConfig", {**C, "num_attention_heads": 4, "qk_layernorm": True},
                              "model.layers.0.self_attn", QK_NORM.format(r"q_layernorm \(LayerNorm\), k_layernorm "
                                                                         r"\(LayerNorm\)"), "attach"),
    "stablelm with qk_layernorm": ("StableLmForCausalLM", "StableLmConfig", {**C, **H, "qk_layernorm": True},
                                   "model.layers.0.self_attn", QK_NORM.format(
                                       r"q_layernorm \(StableLmLayerNormPerHead\), k_layernorm "
                                       r"\(StableLmLayerNormPerHead\)"), "attach"),
    "persimmon (qk_layernorm)": ("PersimmonForCausalLM", "PersimmonConfig", {**C, "num_attention_heads": 4},
                                 "model.layers.0.self_attn", QK_NORM.format(r"q_layernorm \(LayerNorm\), k_layernorm "
                                                                            r"\(LayerNorm\)"), "attach"),
    "bloom (ALiBi, fused query_key_value)": ("BloomForCausalLM", "BloomConfig", dict(
        vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4, pad_token_id=0, bos_token_id=1, eos_token_id=2),
        "transformer.h.0.self_attention", NO_LAYOUT, "attach"),
    "falcon (fused query_key_value)": ("FalconForCausalLM", "FalconConfig", dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0, bos_token_id=1,
        eos_token_id=2), "transformer.h.0.self_attention", NO_LAYOUT, "attach"),
}


def build(model_cls: str, config_cls: str, kwargs: dict, seed: int = 0):
    if not (hasattr(transformers, model_cls) and hasattr(transformers, config_cls)):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).float()
    for m in model.modules():  # train mode (the mode optimizer steps run in) without randomness
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for a in ("attention_dropout", "dropout"):
            if isinstance(getattr(m, a, None), float):
                setattr(m, a, 0.0)
    with torch.no_grad():  # non-zero biases, so that scaling them shows
        for n, p in model.named_parameters():
            if n.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model.train()


def batch(seed: int = 1):
    """Input ids and a left-padded attention mask (row 1: 4 pads)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[1, :4] = 0
    return ids.masked_fill(am == 0, 0), am


@pytest.mark.parametrize("family", list(SUPPORTED))
def test_supported_family_clips_exactly_to_tau(family):
    model = build(*SUPPORTED[family])
    layers = attach(model)
    assert len(layers) == 2
    with torch.no_grad():  # heads far apart: head h's logits times 3..30 (so some pass tau, some do not)
        for layer in layers:
            layer.layout.clip(torch.linspace(3.0, 30.0, layer.layout.n_heads))
    ids, am = batch()
    before = reference_max(model, ids, am)
    assert before.keys() == {ly.name for ly in layers}
    tau = tau_between_heads(before)
    opt = MuonClip(model, lr=0.0, weight_decay=0.0, tau=tau, layers=layers, on_ineffective_clip="raise")

    saved, hooks = save_attention_inputs(model)
    model(ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100), use_cache=False).loss.backward()
    for h in hooks:
        h.remove()
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()

    after = replay_max(model, saved)
    clipped = {n: s > tau for n, s in before.items()}
    for name, s in before.items():
        torch.testing.assert_close(opt.last_max_logits[name], s, rtol=1e-5, atol=1e-5)  # what the clip used
        assert torch.equal(opt.last_clipped[name], clipped[name])
        torch.testing.assert_close(after[name], torch.clamp(s, max=tau), rtol=1e-5, atol=1e-5)
    n_clipped = sum(int(c.sum()) for c in clipped.values())
    assert 0 < n_clipped < sum(c.numel() for c in clipped.values())
    assert_only_clipped_rows_changed(model, layers, clipped, w0)


@pytest.mark.parametrize("family", list(REFUSED))
def test_unsupported_family_is_refused_before_training(family):
    model_cls, config_cls, kwargs, layer, match, when = REFUSED[family]
    model = build(model_cls, config_cls, kwargs)
    if when == "attach":
        impl = model.config._attn_implementation
        with pytest.raises(ValueError, match=rf"attention layer '{layer}' \(\w+\) {match}"):
            MuonClip(model, tau=10.0)
        assert model.config._attn_implementation == impl  # nothing switched
    else:  # the attention call refuses: the first forward, before any step
        MuonClip(model, tau=10.0)
        ids, am = batch()
        with pytest.raises(ValueError, match=match):
            model(ids, attention_mask=am, use_cache=False)


def test_gpt_neox_strided_rows_are_the_q_and_k_its_forward_uses():
    """The layout's q/k rows of query_key_value (weight and bias) are exactly what GPT-NeoX's forward
    splits off as each head's query and key (independent of the clip: the model's own view/chunk)."""
    model = build(*SUPPORTED["gpt-neox (per-head interleaved query_key_value)"])
    layer = attach(model)[0]
    attn = model.gpt_neox.layers[0].attention
    f = attn.query_key_value
    lay = layer.layout
    assert isinstance(lay.q_weight, StridedRows) and lay.q_weight.tensor is f.weight and lay.q_bias.tensor is f.bias
    x = torch.randn(5, 32)
    with torch.no_grad():
        qkv = f(x).view(5, 4, 3 * 8)  # as GPTNeoXAttention.forward: (..., heads, 3 * head_size), chunk(3)
        q, k, v = qkv.chunk(3, dim=-1)
        for t, bias, ref in ((lay.q_weight, lay.q_bias, q), (lay.k_weight, lay.k_bias, k)):
            idx = t.indices()
            torch.testing.assert_close(x @ f.weight[idx].T + f.bias[idx], ref.reshape(5, -1), rtol=1e-6, atol=1e-6)
            assert torch.equal(bias.indices(), idx)
        v_rows = torch.ones(96, dtype=torch.bool)
        v_rows[lay.q_weight.indices()] = False
        v_rows[lay.k_weight.indices()] = False
        torch.testing.assert_close(x @ f.weight[v_rows].T + f.bias[v_rows], v.reshape(5, -1), rtol=1e-6, atol=1e-6)
