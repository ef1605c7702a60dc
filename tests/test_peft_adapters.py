"""MuonClip on peft models: found through the wrapper, exact through DoRA's magnitudes and modules_to_save
copies, refused for plain LoRA on q/k and for frozen q/k; the clip survives save_pretrained -> reload
(checked on logits and per-head max logits); adapter parameters routed by structure."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_probe import reference_max  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from muonclip import MuonClip, param_groups  # noqa: E402

VOCAB, B, T = 64, 2, 8
CFG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, pad_token_id=0, attention_dropout=0.0)


def _base(seed: int = 0) -> LlamaForCausalLM:
    """A one-layer GQA Llama whose q/k rows are scaled up: logits of order 5-30, heads spread apart."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CFG)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("q_proj" in name or "k_proj" in name) and p.ndim == 2:
                p.mul_(torch.linspace(10.0, 30.0, p.shape[0])[:, None])
    return model


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(1, VOCAB, (B, T), generator=g), torch.ones(B, T, dtype=torch.long)


def _peft(config: LoraConfig, seed: int = 0):
    base = _base(seed)
    state = copy.deepcopy(base.state_dict())
    model = get_peft_model(base, config)
    with torch.no_grad():  # non-zero B: the adapter changes W, so the clip is tested beyond W0
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.3, generator=torch.Generator().manual_seed(3))
    return model, state


def _tau_between(s: torch.Tensor) -> float:
    v = s.sort().values
    return float(v[1] + v[2]) / 2


def _clip_one_step(model):
    """Record S with one training forward, then a MuonClip step with lr 0 (only the clip acts)."""
    ids, am = _batch()
    base = model.get_base_model()
    s = next(iter(reference_max(base, ids, am).values()))
    tau = _tau_between(s)
    opt = MuonClip(model, lr=0.0, tau=tau)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    model.train()
    model(input_ids=ids, attention_mask=am, labels=ids).loss.backward()
    opt.step()
    model.eval()
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p, frozen[n]), f"frozen {n} changed"
    return s, tau, opt


def _reloaded(model, state, tmp_path):
    model.save_pretrained(tmp_path)
    fresh = LlamaForCausalLM(LlamaConfig(**CFG)).float()
    fresh.load_state_dict(state)
    return PeftModel.from_pretrained(fresh, tmp_path).eval()


@pytest.mark.parametrize(
    "config",
    [
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_dora=True),
        LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "o_proj"], modules_to_save=["q_proj", "k_proj"]),
    ],
    ids=["dora-qkvo", "lora-vo+modules_to_save-qk"],
)
def test_clip_is_exact_and_survives_save_and_reload(config, tmp_path):
    model, state = _peft(config)
    s, tau, opt = _clip_one_step(model)
    assert opt.last_clipped and bool(next(iter(opt.last_clipped.values())).any())
    ids, am = _batch()
    after = next(iter(reference_max(model.get_base_model(), ids, am).values()))
    torch.testing.assert_close(after, s.clamp(max=tau), rtol=1e-5, atol=1e-5)

    reloaded = _reloaded(model, state, tmp_path / "adapter")
    with torch.no_grad():
        a = model(input_ids=ids, attention_mask=am).logits
        b = reloaded(input_ids=ids, attention_mask=am).logits
    assert (a - b).abs().max().item() <= 1e-5
    again = next(iter(reference_max(reloaded.get_base_model(), ids, am).values()))
    torch.testing.assert_close(again, s.clamp(max=tau), rtol=1e-5, atol=1e-5)


def test_dora_clip_scales_the_magnitude_rows_only():
    model, _ = _peft(LoraConfig(r=4, target_modules=["q_proj", "k_proj"], use_dora=True))
    layout = MuonClip(model, tau=1.0).layers[0].layout
    attn = model.get_base_model().model.layers[0].self_attn
    assert layout.q_weight.tensor is attn.q_proj.lora_magnitude_vector["default"].weight
    assert layout.params() == [attn.q_proj.lora_magnitude_vector["default"].weight]  # GQA per_head: q only


def test_plain_lora_on_q_is_refused_with_the_maths_and_alternatives():
    model, _ = _peft(LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj"]))
    with pytest.raises(ValueError, match=r"q_proj\.base_layer\.weight.*frozen.*W0 \+ s\*B\*A.*use_dora=True"):
        MuonClip(model, tau=1.0)


def test_frozen_q_k_under_adapters_elsewhere_is_refused():
    model, _ = _peft(LoraConfig(r=4, target_modules=["v_proj", "o_proj"]))
    with pytest.raises(ValueError, match=r"self_attn\.q_proj\.weight.*frozen.*modules_to_save"):
        MuonClip(model, tau=1.0)


def test_merged_dora_is_refused():
    model, _ = _peft(LoraConfig(r=4, target_modules=["q_proj", "k_proj"], use_dora=True))
    model.merge_adapter()
    with pytest.raises(ValueError, match="merged into its base"):
        MuonClip(model, tau=1.0)


def _expected_route(name: str, lora: str) -> tuple[str, str]:
    if "lora_magnitude_vector" in name:
        return "adamw", "DoRA magnitude"
    if "lora_A" in name:
        return ("muon" if lora == "muon" else "adamw"), "LoRA A"
    if "lora_B" in name:
        return ("muon" if lora in ("muon", "muon_b") else "adamw"), "LoRA B"
    if "lm_head" in name:
        return "adamw", "lm head"
    if "embed_tokens" in name:
        return "adamw", "embedding"
    if "q_proj" in name or "k_proj" in name:
        return "muon", "hidden matrix"
    raise AssertionError(name)


@pytest.mark.parametrize("lora", ["muon", "muon_b", "adamw"])
def test_routing_of_every_parameter_of_a_dora_model(lora):
    model, _ = _peft(LoraConfig(r=4, target_modules=["v_proj", "o_proj"], use_dora=True,
                                modules_to_save=["q_proj", "k_proj", "lm_head", "embed_tokens"]))
    groups = param_groups(model, lora=lora)
    routed = {n: (r.algorithm, r.reason) for n, r in ((r.name, r) for r in groups.routes)}
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert set(routed) == trainable
    for n in trainable:
        assert routed[n] == _expected_route(n, lora), n
    for g in groups:
        for n, p in zip(g["param_names"], g["params"]):
            if p.ndim < 2:
                assert g["weight_decay"] == 0.0, n  # magnitudes are vectors: no decay
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert groups.frozen == frozen > 0
    assert f"frozen: {frozen:,} parameters not optimized" in groups.report()


def test_unknown_lora_route_is_refused():
    with pytest.raises(ValueError, match="lora must be one of"):
        param_groups(torch.nn.Linear(2, 2), lora="b_only")
