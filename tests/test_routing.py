"""param_groups: routing exactly as docs/design.md ("Which matrices") says, every parameter exactly once."""

import pytest
import torch
from torch import nn
from toy_models import Conv1DNet, Mixed, TinyLM

import muonclip


def routed(groups):
    return {name: (g["algorithm"], g) for g in groups for name in g["param_names"]}


def check_exactly_once(model, groups):
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}


@pytest.mark.parametrize("tie", [True, False])
def test_small_gpt_routing(tie):
    model = TinyLM(tie=tie, bias=True)
    groups = muonclip.param_groups(model)
    check_exactly_once(model, groups)
    r = routed(groups)
    muon = {n for n, (a, _) in r.items() if a == "muon"}
    expected_muon = {f"blocks.{i}.{m}.weight" for i in range(2) for m in ("q", "k", "v", "o", "fc", "proj")}
    assert muon == expected_muon
    assert r["wte.weight"][0] == "adamw"
    if tie:
        assert "lm_head.weight" not in r  # one parameter, routed once, as the embedding
        assert model.lm_head.weight is model.wte.weight
    else:
        assert r["lm_head.weight"][0] == "adamw"
    for name, (algo, g) in r.items():
        if name.endswith("bias") or ".ln_" in name or name.startswith("ln_f"):
            assert algo == "adamw" and g["weight_decay"] == 0.0
    report = groups.report()
    for name in r:
        assert name in report


def test_head_found_by_size_and_position_without_name():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(50, 8)
            self.hidden = nn.Linear(8, 8)
            self.unnamed = nn.Linear(8, 50)

    r = routed(muonclip.param_groups(M()))
    assert r["hidden.weight"][0] == "muon"
    assert r["unnamed.weight"][0] == "adamw"


def test_hf_style_get_output_embeddings():
    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(8, 8)
            self.proj_out = nn.Linear(8, 8)
            self.last = nn.Linear(8, 8)

        def get_output_embeddings(self):
            return self.proj_out

    r = routed(muonclip.param_groups(M()))
    assert r["proj_out.weight"][0] == "adamw"
    assert r["body.weight"][0] == "muon" and r["last.weight"][0] == "muon"


def test_conv_experts_scalars_and_overrides():
    model = Mixed()
    groups = muonclip.param_groups(model, adamw=["lin.*"], split={"experts": [2, 4]})
    check_exactly_once(model, groups)
    r = routed(groups)
    assert r["conv.weight"][0] == "muon" and r["conv.weight"][1]["flatten"] is True
    assert r["experts"][0] == "muon" and r["experts"][1]["split_sizes"] == [2, 4]
    assert r["lin.weight"][0] == "adamw"  # override
    for name in ("emb.weight", "head.weight", "gate", "norm.weight", "conv.bias", "head.bias"):
        assert r[name][0] == "adamw", name
    reasons = {rt.name: rt.reason for rt in groups.routes}
    assert reasons["conv.weight"] == "conv" and reasons["experts"] == "experts" and reasons["gate"] == "vector"


def test_muon_override_of_a_vector_is_an_error():
    with pytest.raises(ValueError, match="norm.weight"):
        muonclip.param_groups(Mixed(), muon=["norm.weight"])


def test_frozen_parameters_are_left_out():
    model = TinyLM()
    model.blocks[0].q.weight.requires_grad_(False)
    names = {n for g in muonclip.param_groups(model) for n in g["param_names"]}
    assert "blocks.0.q.weight" not in names


def test_groups_feed_muon_and_options_apply():
    model = TinyLM(tie=False)
    groups = muonclip.param_groups(model, lr=0.02, adamw_lr=3e-3, weight_decay=0.0)
    opt = muonclip.Muon(groups, lr=1.0)
    for g in opt.param_groups:
        assert g["lr"] == (0.02 if g["algorithm"] == "muon" else 3e-3)
    loss = model(torch.randint(0, 32, (2, 5))).logsumexp(-1).mean()
    loss.backward()
    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_conv1d_weights_are_muon_with_transposed_layout():
    """transformers' Conv1D stores (in, out): its weight goes to Muon in a transposed=True group,
    and split= patterns cut the rows of the (out, in) matrix."""
    model = Conv1DNet(d=8)
    groups = muonclip.param_groups(model, split={"*.c_attn.weight": [8, 8, 8]})
    check_exactly_once(model, groups)
    r = routed(groups)
    for i in range(2):
        algo, g = r[f"blocks.{i}.c_attn.weight"]
        assert algo == "muon" and g["transposed"] is True and g["split_sizes"] == [8, 8, 8]
        algo, g = r[f"blocks.{i}.c_proj.weight"]
        assert algo == "muon" and g["transposed"] is True and "split_sizes" not in g
        assert r[f"blocks.{i}.c_attn.bias"][0] == "adamw"
    assert "transposed" not in r["inp.weight"][1]
    assert "conv1d (in, out)" in groups.report()
    opt = muonclip.Muon(groups, lr=0.02)
    model(torch.randn(5, 6)).pow(2).mean().backward()
    opt.step()
    assert opt.last_step_stats.matrices == 2 * (3 + 1) + 2  # split c_attn, c_proj; inp and out (plain Linear)


def test_gpt2_from_transformers_routes_conv1d_transposed_and_tied_head_to_adamw():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg)
    groups = muonclip.param_groups(model)
    check_exactly_once(model, groups)
    r = routed(groups)
    muon = {n for n, (a, _) in r.items() if a == "muon"}
    assert muon == {f"transformer.h.{i}.{m}.weight" for i in range(2)
                    for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert all(r[n][1]["transposed"] is True for n in muon)
    assert r["transformer.wte.weight"][0] == r["transformer.wpe.weight"][0] == "adamw"  # lm_head is tied to wte
    # "shape" scale of c_fc: stored (32, 128) = (in, out), so the matrix is 128 x 32 and the scale sqrt(4) = 2
    opt = muonclip.Muon(groups, lr=0.01, weight_decay=0.0, adjust_lr_fn="original", momentum=0.0, nesterov=False,
                        method="svd", orth_dtype=torch.float64)
    w = model.transformer.h[0].mlp.c_fc.weight
    before = w.detach().clone()
    model(torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8))).loss.backward()
    expected = before - 0.01 * 2.0 * muonclip.orthogonalize(w.grad.double(), "svd").float()
    opt.step()
    torch.testing.assert_close(w.detach(), expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_reference_gpt_has_no_fused_weights_and_per_head_splits_its_projections(attention):
    """The reference GPT stores q, k, v apart and has a plain MLP: nothing is split by default.
    per_head=True cuts q/k/v (GQA: 4 query, 2 key/value heads of 8 rows) or MLA's up-projections
    (per head [q_nope 16 | q_rope 8] and [k_nope 16 | v 16]) into one block per head."""
    from muonclip.models import GPT, GPTConfig

    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32, attention=attention,
                          n_kv_head=2 if attention == "mha" else None))
    assert not any("split_sizes" in g for g in muonclip.param_groups(model))
    groups = muonclip.param_groups(model, per_head=True)
    if attention == "mha":
        expected = {"q_proj": [8] * 4, "k_proj": [8] * 2, "v_proj": [8] * 2, "o_proj": None}
    else:
        expected = {"q_proj": [24] * 4, "kv_b_proj": [32] * 4, "kv_a_proj_with_mqa": None, "o_proj": None}
    r = routed(groups)
    for attr, sizes in expected.items():
        assert r[f"blocks.0.attn.{attr}.weight"][1].get("split_sizes") == sizes, attr


def _count_root_walks(model):
    """Wrap ``model.named_modules`` on the root alone: ``modules()``, ``named_parameters()``,
    ``parameters()`` and ``named_modules()`` of the root each walk the whole tree through it."""
    walks = []
    inner = model.named_modules

    def counted(*args, **kwargs):
        walks.append(1)
        return inner(*args, **kwargs)

    model.named_modules = counted
    return walks


@pytest.mark.parametrize("depth", [1, 4])
def test_param_groups_walks_the_module_tree_once(depth):
    """param_groups reads owners, names, aliases, the vocabulary, the last linear layer, the flat-parameter
    check and the fused weights' splits from one walk of the tree, whatever the model's depth."""
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=depth, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))
    expected = muonclip.param_groups(model).report()
    walks = _count_root_walks(model)
    assert muonclip.param_groups(model).report() == expected
    assert len(walks) == 1


def test_lacks_agrees_with_hasattr():
    """`lacks` is True only where ``hasattr`` is False for every name: class attributes and properties,
    instance attributes (set through ``__dict__`` too), parameters, buffers and children count; a class
    with its own ``__getattr__`` is never said to lack anything."""
    from muonclip.common.family_readers import lacks

    class WithProperty(nn.Linear):
        @property
        def kv_b_proj(self):
            return nn.Linear(2, 2)

    class Forwarding(nn.Module):
        def __getattr__(self, name):
            return 1 if name == "kv_b_proj" else super().__getattr__(name)

    plain = nn.Linear(2, 2)
    in_dict = nn.Linear(2, 2)
    object.__setattr__(in_dict, "kv_b_proj", nn.Linear(2, 2))
    flagged = nn.Linear(2, 2)
    flagged.kv_b_proj = True
    child = nn.Sequential()
    child.kv_b_proj = nn.Linear(2, 2)
    param = nn.Module()
    param.kv_b_proj = nn.Parameter(torch.ones(2))
    buffer = nn.Module()
    buffer.register_buffer("kv_b_proj", torch.ones(2))
    names = frozenset({"kv_b_proj", "experts"})
    for module in (plain, in_dict, flagged, child, param, buffer, WithProperty(2, 2), Forwarding(), nn.SiLU()):
        has = any(hasattr(module, n) for n in names)
        assert not (lacks(module, names) and has), type(module).__name__
    assert lacks(plain, names) and lacks(nn.SiLU(), names)
    assert not lacks(Forwarding(), frozenset({"experts"}))
