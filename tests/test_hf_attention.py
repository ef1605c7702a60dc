"""The "muonclip" attention function computes the model's own attention, or refuses: attention sinks
(GPT-OSS), the keyword allow-list, the one-time forward check, hybrid models decided per layer, and
packed sequences. Tiny models built from configs (never downloaded)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import (  # noqa: E402
    DataCollatorWithFlattening,
    Gemma2Config,
    Gemma2ForCausalLM,
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
)

import muonclip.integrations.hf_attention as hf_attention  # noqa: E402
import muonclip.integrations.hf_check as hf_check  # noqa: E402
from muonclip import MuonClip  # noqa: E402
from muonclip.integrations.hf import (  # noqa: E402
    AttentionMismatchError,
    attach,
    attach_report,
    detach,
)
from muonclip.integrations.hf_attention import CHECK_ATTR, KEYWORDS, muonclip_attention_forward  # noqa: E402
from muonclip.qkclip import GQALayout, MLALayout  # noqa: E402

VOCAB = 96


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def gpt_oss(seed: int = 0, sink_std: float = 2.0) -> GptOssForCausalLM:
    torch.manual_seed(seed)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
                       pad_token_id=0)
    model = GptOssForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, sink_std)
    return model


def llama(n_kv: int = 2, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=n_kv, head_dim=8, pad_token_id=0))


def batch(b: int = 2, t: int = 10, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (b, t), generator=g)
    am = torch.ones(b, t, dtype=torch.long)
    am[1, :3] = 0
    return ids.masked_fill(am == 0, 0), am


# ----------------------------------------------------------------------------------------------
# attention sinks
# ----------------------------------------------------------------------------------------------


def test_gpt_oss_output_equals_its_eager_attention_with_sinks():
    """The sinks join the softmax denominator: logits and greedy generation are the model's own."""
    model = gpt_oss()
    assert model.config._attn_implementation == "eager"
    ids, am = batch()
    ref = copy.deepcopy(model).eval()
    MuonClip(model, lr=0.0, tau=100.0)
    model.eval()
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits
    real = am.bool()
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-5)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids[:1], **gen), ref.generate(ids[:1], **gen))


def test_gpt_oss_gradients_reach_the_sinks_as_in_eager():
    """Train mode: the loss, every gradient (the sinks' included) equal eager's; the sinks are trained."""
    model = gpt_oss()
    ref = copy.deepcopy(model)
    attach(model)
    ids, am = batch()
    labels = ids.masked_fill(am == 0, -100)
    a = model(ids, attention_mask=am, labels=labels).loss
    b = ref(ids, attention_mask=am, labels=labels).loss
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    a.backward()
    b.backward()
    sinks = [n for n, _ in model.named_parameters() if n.endswith("sinks")]
    assert sinks
    params = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        if p.grad is not None or params[n].grad is not None:
            torch.testing.assert_close(p.grad, params[n].grad, rtol=1e-4, atol=1e-6, msg=n)
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in sinks)


def test_gpt_oss_clip_is_exact_and_leaves_the_sinks():
    """lr 0: clipped heads' max logits (q.k only) land on tau; sinks and unclipped heads bit-identical."""
    from hf_probe import replay_layer_max, tau_between

    model = gpt_oss()
    layers = attach(model)
    first = layers[0]
    with torch.no_grad():
        first.layout.clip(torch.linspace(3.0, 30.0, 4))
    module = model.get_submodule(first.name)
    saved = []
    hook = module.register_forward_pre_hook(lambda m, a, kw: saved.append((a, dict(kw))), with_kwargs=True)
    ids, am = batch()
    model(ids, attention_mask=am, use_cache=False).logits.square().mean().backward()
    hook.remove()
    before = replay_layer_max(model, module, *saved[0])
    tau = tau_between(before)
    opt = MuonClip(model, lr=0.0, weight_decay=0.0, tau=tau, layers=layers)
    torch.testing.assert_close(first.recorder.value, before, rtol=1e-5, atol=1e-5)  # q.k only, never the sink
    w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    torch.testing.assert_close(replay_layer_max(model, module, *saved[0]), before.clamp(max=tau), rtol=2e-5,
                               atol=2e-5)
    for n, p in model.named_parameters():
        if n.endswith("sinks") or "v_proj" in n:
            assert torch.equal(p, w0[n]), n


# ----------------------------------------------------------------------------------------------
# keywords: an allow-list
# ----------------------------------------------------------------------------------------------


def test_a_keyword_it_does_not_implement_is_refused_naming_it_and_the_layer():
    model = llama()
    attach(model)
    ids, am = batch()
    with pytest.raises(ValueError, match=r"attention layer 'model\.layers\.0\.self_attn' \(LlamaAttention\) passes "
                                         r"`my_bias` \(Tensor\) to its attention function, a keyword the 'muonclip' "
                                         r"attention function does not implement"):
        model(ids, attention_mask=am, my_bias=torch.zeros(1))
    for key in ("softcap", "position_bias", "indices", "output_attentions"):  # accepted off, refused on
        muonclip_attention_forward(model.model.layers[0].self_attn, *_qkv(), None, **{key: None})
        with pytest.raises(ValueError, match=rf"passes `{key}`, which the 'muonclip' attention function does not "
                                             r"compute"):
            muonclip_attention_forward(model.model.layers[0].self_attn, *_qkv(), None, **{key: torch.ones(1)})
    assert {"s_aux", "sliding_window", "position_ids", "dropout", "scaling"} <= set(KEYWORDS)


def _qkv(hkv: int = 2):
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, hkv, 5, 8, generator=g), \
        torch.randn(1, hkv, 5, 8, generator=g)


# ----------------------------------------------------------------------------------------------
# the one-time forward check
# ----------------------------------------------------------------------------------------------


def test_forward_check_runs_once_on_the_first_training_forward():
    model = gpt_oss()
    layers = attach(model)
    checks = [getattr(model.get_submodule(ly.name), CHECK_ATTR) for ly in layers]
    assert [c.reference for c in checks] == ["eager", "eager"]
    ids, am = batch()
    with torch.no_grad():
        model.eval()(ids, attention_mask=am)  # evaluation: not checked
    assert all(c.pending for c in checks)
    model.train()(ids, attention_mask=am)
    assert not any(c.pending for c in checks)
    assert all(c.max_error <= c.tolerance < 1e-4 for c in checks)
    llm = llama()
    layers = attach(llm)
    assert getattr(llm.get_submodule(layers[0].name), CHECK_ATTR).reference == "sdpa"


@pytest.mark.parametrize("small", [False, True])
def test_forward_check_stops_an_attention_that_drops_the_sinks(monkeypatch, small):
    """The bug the check exists for: an attention function that ignores `s_aux` changes the model; the
    first training forward says so, naming the layer. Also on a subsample of a large call's rows."""
    record_attend = hf_attention.record_attend

    def drop_sinks(call, *args, **kwargs):
        return record_attend(dataclasses.replace(call, sinks=None), *args, **kwargs)

    monkeypatch.setattr(hf_attention, "record_attend", drop_sinks)
    if small:
        monkeypatch.setattr(hf_check, "CHECK_SCORES", 4 * 3 * 10)  # one batch row, three query rows
    model = gpt_oss()
    attach(model)
    ids, am = batch()
    with pytest.raises(AttentionMismatchError, match=r"attention layer 'model\.layers\.0\.self_attn' "
                                                     r"\(GptOssAttention\): the 'muonclip' attention function's "
                                                     r"output differs from the model's own 'eager' attention"):
        model(ids, attention_mask=am)
    quiet = gpt_oss()
    attach(quiet, verify_attention=False)  # the explicit choice: no check
    quiet(ids, attention_mask=am)


def test_forward_check_in_bfloat16():
    model = gpt_oss().to(torch.bfloat16)
    layers = attach(model)
    ids, am = batch()
    model(ids, attention_mask=am)
    checks = [getattr(model.get_submodule(ly.name), CHECK_ATTR) for ly in layers]
    assert all(not c.pending and c.max_error <= c.tolerance for c in checks)


def test_a_layer_that_never_calls_the_function_is_reported():
    model = llama()
    attach(model)
    attn = model.model.layers[1].self_attn
    attn.forward = lambda hidden_states, *a, **kw: (torch.zeros_like(hidden_states), None)
    with pytest.raises(AttentionMismatchError, match=r"'model\.layers\.1\.self_attn' \(LlamaAttention\) ran a training "
                                                     r"forward without calling the 'muonclip' attention function"):
        model(*batch()[:1])


def test_detach_removes_checks_and_hooks():
    model = gpt_oss()
    attach(model)
    detach(model, "eager")
    assert not any(hasattr(m, CHECK_ATTR) for m in model.modules())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def gemma2(softcap: float | None = None):
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          attn_logit_softcapping=softcap, pad_token_id=0))


@pytest.mark.parametrize("build", ["llama", "gemma2", "gpt_oss", "mistral"])
def test_detach_restores_the_implementation_the_model_had(build):
    """Every family of the table that supports one implementation only (Gemma 2, GPT-OSS: eager) or
    was loaded with another than SDPA goes back to it; the model computes what it did before."""
    model = {"llama": llama, "gemma2": gemma2, "gpt_oss": gpt_oss,
             "mistral": lambda: _tiny("mistral")}[build]()
    if build == "mistral":
        model.set_attn_implementation("eager")
    before = model.config._attn_implementation
    ref = copy.deepcopy(model).eval()
    MuonClip(model, lr=0.0, tau=100.0)
    ids, am = batch()
    model(ids, attention_mask=am).logits.sum().backward()
    detach(model)
    assert model.config._attn_implementation == before
    assert not any(hasattr(m, a) for m in model.modules() for a in (CHECK_ATTR, "muonclip_recorder"))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(ids, attention_mask=am).logits, ref(ids, attention_mask=am).logits)


def test_detach_to_an_implementation_the_model_refuses_leaves_it_attached():
    """Gemma 2 has no SDPA path: asking for it raises, and the model stays attached as it was (switched,
    recorders, checks and hook in place), still recording."""
    model = gemma2()
    layers = attach(model)
    with pytest.raises(ValueError, match=r"detach: Gemma2ForCausalLM cannot be switched to "
                                         r"attn_implementation='sdpa' .*it is left attached\. Call detach\(model\) "
                                         r"without attn_implementation"):
        detach(model, "sdpa")
    assert model.config._attn_implementation == "muonclip"
    assert all(model.get_submodule(ly.name).muonclip_recorder is ly.recorder for ly in layers)
    model(*batch()[:1])
    assert all(ly.recorder.value is not None for ly in layers)
    detach(model)
    assert model.config._attn_implementation == "eager"


def test_soft_capping_is_refused_by_muonclip_itself_and_the_model_left_as_it_was():
    """Gemma 2 with attn_logit_softcapping: `MuonClip(model)` refuses, naming the layer and the keyword,
    before anything is switched or attached; eval and generation then run as before."""
    model = gemma2(softcap=50.0)
    ref = copy.deepcopy(model).eval()
    with pytest.raises(ValueError, match=r"attention layer 'model\.layers\.0\.self_attn' \(Gemma2Attention\) passes "
                                         r"`softcap`, which the 'muonclip' attention function does not compute: logit "
                                         r"soft-capping"):
        MuonClip(model, tau=10.0)
    assert model.config._attn_implementation == "eager"
    assert not any(hasattr(m, a) for m in model.modules() for a in (CHECK_ATTR, "muonclip_recorder"))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    ids = batch()[0][:1]
    gen = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(model.eval().generate(ids, **gen), ref.generate(ids, **gen))


def test_a_keyword_visible_in_the_source_is_refused_when_attaching():
    """A class passing a keyword the function does not implement, or an OFF_ONLY one from a module
    attribute that is on, is refused by attach; off (None), it is accepted."""
    from muonclip.integrations.hf_attention import check_module_keywords

    class Passes(torch.nn.Module):
        def forward(self, q, k, v, attention_interface):
            return attention_interface(self, q, k, v, None, bias_table=self.table)

    class Caps(torch.nn.Module):
        def __init__(self, cap):
            super().__init__()
            self.attn_logit_softcapping = cap

        def forward(self, q, k, v, attention_interface):
            return attention_interface(self, q, k, v, None, softcap=self.attn_logit_softcapping, dropout=0.0)

    with pytest.raises(ValueError, match=r"passes `bias_table` \(self\.table\) to its attention function, a keyword"):
        check_module_keywords(Passes(), "layer")
    with pytest.raises(ValueError, match=r"'layer' \(Caps\) passes `softcap`"):
        check_module_keywords(Caps(30.0), "layer")
    check_module_keywords(Caps(None), "layer")


# ----------------------------------------------------------------------------------------------
# hybrid models, per layer
# ----------------------------------------------------------------------------------------------


def _tiny(family: str):
    from hf_families import build

    return build(family)


def test_kimi_linear_mla_layers_clipped_kda_layers_skipped_and_reported():
    model = _tiny("kimi_linear")
    layers = attach(model)
    report = attach_report(model)
    assert [ly.name for ly in layers] == report.attention and layers
    assert all(isinstance(ly.layout, MLALayout) for ly in layers)
    assert report.skipped and all(cls == "KimiLinearDeltaAttention" for _, cls in report.skipped)
    assert "skipped" in str(report) and report.skipped[0][0] in str(report)


def test_mimo_head_counts_come_from_each_layer():
    """MiMo-V2-Flash's sliding-window layers have twice the key heads of its full-attention layers."""
    model = _tiny("mimo_v2_flash")
    layers = attach(model)
    kinds = {model.config.layer_types[model.get_submodule(ly.name).layer_idx]: ly.layout for ly in layers}
    full, swa = kinds["full_attention"], kinds["sliding_attention"]
    n_kv = model.config.num_key_value_heads
    assert isinstance(full, GQALayout) and full.n_kv_heads == n_kv
    assert getattr(swa, "n_kv_heads", swa.n_heads) == 2 * n_kv


def test_models_without_softmax_attention_are_refused_with_the_cause():
    with pytest.raises(ValueError, match=r"MambaForCausalLM has no softmax attention: its token mixers "
                                         r"\(backbone\.layers\.0\.mixer \(MambaMixer\)"):
        attach(_tiny("mamba"))
    with pytest.raises(ValueError, match=r"FalconForCausalLM computes attention in its own code, not through "
                                         r"transformers' AttentionInterface"):
        attach(_tiny("falcon"))


# ----------------------------------------------------------------------------------------------
# packed sequences
# ----------------------------------------------------------------------------------------------


def _documents():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 7, 4)]


def test_packed_batch_attends_per_document_like_the_unpacked_batch():
    """DataCollatorWithFlattening (one row, position_ids restarting, no mask), training mode with the
    default use_cache: per-token logits, recorded max logits and the clip equal the unpacked batch's."""
    docs = _documents()
    packed = DataCollatorWithFlattening()([{"input_ids": d} for d in docs])
    assert "attention_mask" not in packed and packed["position_ids"][0, 5] == 0
    model = llama()
    with torch.no_grad():
        for ly in model.model.layers:  # larger q/k: logits of order 10, so tau cuts between heads
            ly.self_attn.q_proj.weight.mul_(torch.linspace(5.0, 25.0, 32)[:, None])
    twin = copy.deepcopy(model)
    opts = [MuonClip(m, lr=0.0, weight_decay=0.0, tau=1.0) for m in (model, twin)]
    logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"]).logits[0]
    logits.square().mean().backward()
    start, per_doc = 0, []
    for d in docs:  # the unpacked batch: one document per call, no padding needed
        out = twin(input_ids=torch.tensor([d])).logits[0]
        out.square().mean().backward()
        per_doc.append(out)
        torch.testing.assert_close(logits[start:start + len(d)], out, rtol=1e-5, atol=1e-5)
        start += len(d)
    maxima = [{ly.name: ly.recorder.value.clone() for ly in o.layers} for o in opts]
    for name in maxima[0]:
        torch.testing.assert_close(maxima[0][name], maxima[1][name], rtol=1e-6, atol=1e-6)
    taus = torch.cat(list(maxima[0].values())).sort().values
    for o in opts:
        o.tau = float(taus[len(taus) // 2 - 1] + taus[len(taus) // 2]) / 2
        o.step()
    for name in maxima[0]:
        assert torch.equal(opts[0].last_clipped[name], opts[1].last_clipped[name])
    clipped = torch.cat(list(opts[0].last_clipped.values()))
    assert 0 < int(clipped.sum()) < clipped.numel()
    for (n, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=0, msg=n)


def test_packed_batch_with_a_cache_is_refused():
    from transformers import DynamicCache

    docs = _documents()
    packed = DataCollatorWithFlattening()([{"input_ids": d} for d in docs])
    model = llama()
    attach(model)
    with pytest.raises(ValueError, match=r"a packed batch \(position_ids restart inside a row\) given with a cache"):
        model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
              past_key_values=DynamicCache(config=model.config))
