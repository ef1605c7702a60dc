"""Fused projections orthogonalised as the separate maps they are; per-head blocks; routers.

`param_groups` splits a fused weight (Phi-3 ``qkv_proj``/``gate_up_proj``, GPT-2 ``c_attn``,
GPT-NeoX's interleaved ``query_key_value``, transformers' stacked experts) into its maps, sizes
from the config, so the model takes the steps of its twin that stores the maps as separate
``nn.Linear`` layers (`toy_models.unfuse`), to float32 round-off with float32
orthogonalisation; GPTBigCode's and CodeGen's fused q/k/v take one exact blockwise step per map,
the maps read off each model's forward. Per-head blocks are checked against a per-head loop and the exact polar
factor. Tiny transformers models are built from configs (nothing downloaded).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from toy_models import unfuse

import muonclip
from muonclip.optim.fused import weight_splits
from muonclip.optim.workspace import CoreWorkspace

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()

OPT = dict(lr=0.02, weight_decay=0.1, orth_dtype=torch.float32)
TOL = 1e-5  # float32 round-off over a few steps (the fused and separate matmuls round differently)

CONFIGS = {
    # q 4 heads x 8 = 32 rows > hidden 16, k = v = 8: q and k/v get different "rms" scales
    "phi3": lambda: transformers.Phi3Config(vocab_size=64, hidden_size=16, intermediate_size=20, num_hidden_layers=1,
                                            num_attention_heads=4, num_key_value_heads=1, head_dim=8, pad_token_id=0),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=64, n_embd=24, n_layer=1, n_head=3, n_positions=16,
                                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "neox": lambda: transformers.GPTNeoXConfig(vocab_size=64, hidden_size=24, intermediate_size=48, num_hidden_layers=1,
                                               num_attention_heads=3),
    "mixtral": lambda: transformers.MixtralConfig(vocab_size=64, hidden_size=24, intermediate_size=12,
                                                  num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1,
                                                  num_local_experts=3, num_experts_per_tok=2),
    "deepseek": lambda: transformers.DeepseekV3Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8),
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        shared_expert_intermediate_size=24, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2),
    "gpt_oss": lambda: transformers.GptOssConfig(vocab_size=64, hidden_size=24, intermediate_size=12,
                                                 num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=1,
                                                 head_dim=8, num_local_experts=3, num_experts_per_tok=2),
    "llama": lambda: transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                              num_attention_heads=4, num_key_value_heads=2),
    "bigcode_mqa": lambda: transformers.GPTBigCodeConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                                                         multi_query=True, resid_pdrop=0.0, embd_pdrop=0.0,
                                                         attn_pdrop=0.0),
    "bigcode_mha": lambda: transformers.GPTBigCodeConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16,
                                                         multi_query=False, resid_pdrop=0.0, embd_pdrop=0.0,
                                                         attn_pdrop=0.0),
    # 8 heads of 4 rows over CodeGen's 4 partitions: 2 heads per partition
    "codegen": lambda: transformers.CodeGenConfig(vocab_size=64, n_embd=32, n_layer=1, n_head=8, rotary_dim=4,
                                                  n_positions=16, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
}


def tiny(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(CONFIGS[kind]())


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(100 + step))


def train(model: nn.Module, groups, steps: int = 3, **kw) -> muonclip.Muon:
    opt = muonclip.Muon(groups, **{**OPT, **kw})
    for s in range(steps):
        x = batch(s)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach() for n, p in model.named_parameters()}


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def group_of(groups, name: str) -> dict:
    return next(g for g in groups for n in g["param_names"] if n == name)


def route(groups, name: str):
    return next(r for r in groups.routes if r.name == name)


# ------------------------------------------------------------------------------------------------
# routing: what each tiny transformers model gets, sizes from its config
# ------------------------------------------------------------------------------------------------

EXPECTED = {  # param -> (reason, group options that must be set)
    "phi3": {
        "model.layers.0.self_attn.qkv_proj.weight": ("fused qkv", {"split_sizes": [32, 8, 8]}),
        "model.layers.0.mlp.gate_up_proj.weight": ("fused gate|up", {"split_sizes": [20, 20]}),
    },
    "gpt2": {"transformer.h.0.attn.c_attn.weight": ("fused qkv", {"split_sizes": [24, 24, 24], "transposed": True})},
    "neox": {
        "gpt_neox.layers.0.attention.query_key_value.weight": ("fused qkv",
                                                               {"split_sizes": [8, 8, 8], "split_groups": 3}),
    },
    "mixtral": {
        "model.layers.0.mlp.experts.gate_up_proj": ("experts, fused gate|up", {"split_sizes": [12, 12]}),
        "model.layers.0.mlp.experts.down_proj": ("experts", {}),
        "model.layers.0.mlp.gate.weight": ("router", {}),
    },
    "deepseek": {
        "model.layers.1.mlp.experts.gate_up_proj": ("experts, fused gate|up", {"split_sizes": [16, 16]}),
        "model.layers.1.mlp.gate.weight": ("router", {}),
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": ("MLA", {}),
        "model.layers.0.self_attn.q_b_proj.weight": ("MLA", {}),
        "model.layers.0.self_attn.kv_b_proj.weight": ("MLA", {}),
    },
    "qwen2_moe": {
        "model.layers.0.mlp.experts.gate_up_proj": ("experts, fused gate|up", {"split_sizes": [16, 16]}),
        "model.layers.0.mlp.gate.weight": ("router", {}),
        "model.layers.0.mlp.shared_expert_gate.weight": ("hidden matrix", {}),
    },
    "gpt_oss": {  # (E, in, out) experts, gate/up rows alternating; per-expert biases are vectors
        "model.layers.0.mlp.experts.gate_up_proj": ("experts, fused gate|up",
                                                    {"split_sizes": [1, 1], "split_groups": 12, "transposed": True}),
        "model.layers.0.mlp.experts.down_proj": ("experts", {"transposed": True}),
        "model.layers.0.mlp.router.weight": ("router", {}),
    },
    "llama": {"model.layers.0.self_attn.q_proj.weight": ("hidden matrix", {})},
    "bigcode_mqa": {"transformer.h.0.attn.c_attn.weight": ("fused qkv", {"split_sizes": [32, 8, 8]})},
    "bigcode_mha": {"transformer.h.0.attn.c_attn.weight": ("fused qkv", {"split_sizes": [8, 8, 8],
                                                                          "split_groups": 4})},
    "codegen": {"transformer.h.0.attn.qkv_proj.weight": ("fused qkv", {"split_sizes": [8, 8, 8],
                                                                        "split_groups": 4})},
}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_fused_weights_are_split_by_config_and_reported(kind):
    model = tiny(kind)
    groups = muonclip.param_groups(model)
    report = groups.report()
    split_keys = ("split_sizes", "split_groups", "transposed")
    for name, (reason, opts) in EXPECTED[kind].items():
        g, r = group_of(groups, name), route(groups, name)
        assert g["algorithm"] == "muon" and r.reason == reason, (name, r)
        assert {k: g[k] for k in split_keys if k in g} == opts, name
        assert name in report and reason in report
    # every Muon weight not listed is one plain matrix
    listed = set(EXPECTED[kind])
    for g in groups:
        if g["algorithm"] == "muon" and not set(g["param_names"]) & listed:
            assert "split_sizes" not in g, g["param_names"]
    # the group options are valid Muon options: a step runs on them
    train(model, groups, steps=1)


def test_gpt_oss_expert_biases_are_vectors_without_weight_decay():
    groups = muonclip.param_groups(tiny("gpt_oss"))
    for name in ("model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.experts.down_proj_bias"):
        g = group_of(groups, name)
        assert g["algorithm"] == "adamw" and g["weight_decay"] == 0.0 and route(groups, name).reason == "vector"


def test_router_reason_and_how_to_move_it():
    model = tiny("mixtral")
    groups = muonclip.param_groups(model)
    r = route(groups, "model.layers.0.mlp.gate.weight")
    assert r.algorithm == "muon" and "Moonlight" in r.detail and "Megatron-LM" in r.detail
    moved = muonclip.param_groups(model, adamw=["*.mlp.gate.weight"])
    assert group_of(moved, "model.layers.0.mlp.gate.weight")["algorithm"] == "adamw"


# ------------------------------------------------------------------------------------------------
# equivalence: fused (split by default) == the twin with separate nn.Linear maps
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["phi3", "gpt2", "neox", "mixtral"])
def test_fused_model_steps_as_its_twin_with_separate_maps(kind):
    """Phi-3: 2-D fused attention [q|k|v] (GQA, per-block scales differ) and fused MLP [gate|up];
    GPT-2: Conv1D stored (in, out); GPT-NeoX: q/k/v interleaved per head; Mixtral: 3-D stacked
    experts [gate|up] per expert. 3 steps with float32 orthogonalisation; the control (fused
    weights kept whole) must miss the twin by far more, so the test can tell.

    GPT-2 and GPT-NeoX have k biases, whose true gradient is exactly zero (q . b_k is the same
    for every key): AdamW would step on the sign of round-off, which differs between the fused
    and separate matmuls, so there AdamW runs at lr 0 (the Muon weights are what is compared)."""
    fused = tiny(kind)
    twin = copy.deepcopy(fused)
    whole = copy.deepcopy(fused)
    twin_params = unfuse(twin)
    kw = {"adamw_lr": 0.0} if kind in ("gpt2", "neox") else {}
    train(fused, muonclip.param_groups(fused, **kw))
    train(twin, muonclip.param_groups(twin, **kw))
    train(whole, muonclip.param_groups(whole, split_fused=False, **kw))
    diff = max_diff(params(fused), twin_params())
    control = max_diff(params(whole), twin_params())
    print(f"{kind}: max |fused - separate| = {diff:.3g}; kept whole: {control:.3g}")
    assert diff <= TOL, diff
    assert control > 100 * TOL, control


def test_fused_3d_transposed_interleaved_experts_step_as_separate_gate_and_up():
    """gpt-oss stores experts (E, in, out) with gate/up columns alternating: the fused weight
    (split by `param_groups`' options) takes the steps of separate gate and up stacks."""
    layout = muonclip.param_groups(tiny("gpt_oss"))
    opts = {k: v for k, v in group_of(layout, "model.layers.0.mlp.experts.gate_up_proj").items()
            if k in ("split_sizes", "split_groups", "transposed")}
    g = torch.Generator().manual_seed(0)
    E, H, inter = 3, 24, 12
    w = torch.randn(E, H, 2 * inter, generator=g) * 0.1
    fused = nn.Parameter(w.clone())
    gate, up = nn.Parameter(w[..., ::2].clone()), nn.Parameter(w[..., 1::2].clone())
    opt = muonclip.Muon([{"params": [fused], **opts}, {"params": [gate, up], "transposed": True}], **OPT)
    for _ in range(3):
        grad = torch.randn(E, H, 2 * inter, generator=g)
        fused.grad, gate.grad, up.grad = grad, grad[..., ::2].clone(), grad[..., 1::2].clone()
        opt.step()
    torch.testing.assert_close(fused.detach()[..., ::2], gate.detach(), atol=TOL, rtol=0)
    torch.testing.assert_close(fused.detach()[..., 1::2], up.detach(), atol=TOL, rtol=0)


BLOCKWISE = {  # model, its fused q/k/v weight, and the maps of its rows as the model's own forward splits them
    # GPTBigCodeAttention, multi_query: c_attn(x).split((embed_dim, kv_dim, kv_dim))
    "bigcode_mqa": ("transformer.h.0.attn.c_attn.weight", lambda rows: torch.arange(rows).split((32, 8, 8))),
    # GPTBigCodeAttention, multi-head: c_attn(x).view(..., n_heads, 3 * head_dim).split(3 * [head_dim])
    "bigcode_mha": ("transformer.h.0.attn.c_attn.weight",
                    lambda rows: torch.arange(rows).view(4, 3 * 8).split(8, dim=1)),
    # CodeGenAttention: qkv_proj(x).view(..., mp_num, 3 * local_dim); query, value, key = .split(local_dim)
    "codegen": ("transformer.h.0.attn.qkv_proj.weight", lambda rows: torch.arange(rows).view(4, 3 * 8).split(8, dim=1)),
}


@pytest.mark.parametrize("kind", list(BLOCKWISE))
def test_fused_attention_step_is_blockwise_orthogonalisation(kind):
    """GPTBigCode (multi-query and multi-head) and CodeGen: one Muon step (no momentum, no weight
    decay, exact polar factor in float64) moves each of q, k and v, the rows the model's forward
    takes for it, by the polar factor of its own gradient rows times the update scale of its own
    shape, to 1e-6; orthogonalising the fused weight whole (`split_fused=False`) misses by far
    more."""
    name, maps_of = BLOCKWISE[kind]
    model = tiny(kind)
    groups = muonclip.param_groups(model)
    assert route(groups, name).reason == "fused qkv"
    w = dict(model.named_parameters())[name]
    before = w.detach().double()
    x = batch(0)
    model(input_ids=x, labels=x).loss.backward()
    grad = w.grad.detach().double()
    muonclip.Muon(groups, lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, method="svd",
                  orth_dtype=torch.float64).step()
    maps = [m.reshape(-1) for m in maps_of(w.shape[0])]
    assert sorted(torch.cat(maps).tolist()) == list(range(w.shape[0]))
    cols = w.shape[1]

    def polar(g):
        u, _, vh = torch.linalg.svd(g, full_matrices=False)
        return u @ vh

    expected = before.clone()
    for rows in maps:
        expected[rows] -= 0.1 * 0.2 * max(len(rows), cols) ** 0.5 * polar(grad[rows])
    torch.testing.assert_close(w.detach().double(), expected, atol=1e-6, rtol=0)
    whole = before - 0.1 * 0.2 * max(w.shape) ** 0.5 * polar(grad)
    assert (whole - expected).abs().max() > 1e-3


# ------------------------------------------------------------------------------------------------
# per-head orthogonalisation
# ------------------------------------------------------------------------------------------------

PER_HEAD = {  # model, weight, its head blocks as (first row, rows), stored rows
    "llama": ("model.layers.0.self_attn.q_proj.weight", [(8 * h, 8) for h in range(4)]),
    "neox": ("gpt_neox.layers.0.attention.query_key_value.weight", [(8 * b, 8) for b in range(9)]),
    "deepseek": ("model.layers.0.self_attn.kv_b_proj.weight", [(16 * h, 16) for h in range(4)]),
}


@pytest.mark.parametrize("kind", list(PER_HEAD))
@pytest.mark.parametrize("method", ["ns5", "svd"])
def test_per_head_step_is_the_per_head_loop(kind, method):
    """One step (no momentum, no weight decay): each head's block moves by its own
    orthogonalised gradient times the update scale of its own shape — against a loop over the
    heads (ns5 in float32: batched vs one at a time, to round-off) and against the exact polar
    factor U V^T of each block's SVD (svd in float64)."""
    name, blocks = PER_HEAD[kind]
    model = tiny(kind)
    groups = muonclip.param_groups(model, per_head=True)
    assert route(groups, name).reason == "per-head"
    w = dict(model.named_parameters())[name]
    before = w.detach().clone()
    x = batch(0)
    model(input_ids=x, labels=x).loss.backward()
    grad = w.grad.detach().clone()
    dtype = torch.float32 if method == "ns5" else torch.float64
    opt = muonclip.Muon(groups, lr=0.1, weight_decay=0.0, momentum=0.0, nesterov=False, method=method,
                        orth_dtype=dtype)
    opt.step()
    cols = w.shape[1]
    for a, n in blocks:
        g = grad[a:a + n].to(dtype)
        if method == "ns5":
            o = muonclip.orthogonalize(g, "ns5", 5, torch.float32)
        else:
            u, _, vh = torch.linalg.svd(g, full_matrices=False)
            o = u @ vh
        expected = before[a:a + n] - 0.1 * 0.2 * max(n, cols) ** 0.5 * o.float()
        torch.testing.assert_close(w.detach()[a:a + n], expected, atol=2e-6, rtol=0)
    # the test can tell: the whole-matrix update is different
    whole = muonclip.orthogonalize(grad.double(), "svd")
    moved = (before - w.detach()).double() / (0.1 * 0.2 * max(w.shape) ** 0.5)
    assert (moved - whole).abs().max() > 1e-2


def test_per_head_blocks_are_batched_in_one_call():
    """Llama, 4 query heads and 2 key/value heads of 8 rows: every head block of q, k and v is
    an (8, 32) matrix, and all 8 go to the orthogonaliser in one call."""
    model = tiny("llama")
    calls = []

    class Spy(CoreWorkspace):
        def orthogonalize(self, V, *a, **k):
            calls.append(tuple(V.shape))
            return super().orthogonalize(V, *a, **k)

    train(model, muonclip.param_groups(model, per_head=True), steps=1, workspace=Spy())
    assert [c for c in calls if c[1:] == (8, 32)] == [(8, 8, 32)]


def test_per_head_covers_fused_and_mla_up_projections():
    checks = {
        "phi3": {"model.layers.0.self_attn.qkv_proj.weight": [8] * 6},
        "gpt2": {"transformer.h.0.attn.c_attn.weight": [8] * 9},
        "deepseek": {"model.layers.0.self_attn.q_b_proj.weight": [12] * 4,
                     "model.layers.0.self_attn.kv_b_proj.weight": [16] * 4,
                     "model.layers.0.self_attn.kv_a_proj_with_mqa.weight": None},
        "mixtral": {"model.layers.0.self_attn.k_proj.weight": [8],
                    "model.layers.0.self_attn.o_proj.weight": None,  # heads along columns: not split
                    "model.layers.0.mlp.experts.gate_up_proj": [12, 12]},
    }
    for kind, expected in checks.items():
        groups = muonclip.param_groups(tiny(kind), per_head=True)
        for name, sizes in expected.items():
            assert group_of(groups, name).get("split_sizes") == sizes, (kind, name)
            assert "split_groups" not in group_of(groups, name)


# ------------------------------------------------------------------------------------------------
# unknown layouts, opt-outs, explicit splits, bad input
# ------------------------------------------------------------------------------------------------


class MyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv_proj = nn.Linear(16, 48, bias=False)
        self.o_proj = nn.Linear(16, 16, bias=False)


class MyExperts(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(3, 8, 16))


def test_a_fused_weight_of_unknown_layout_is_reported_not_guessed():
    net = nn.ModuleDict({"attn": MyAttention(), "experts": MyExperts()})
    groups = muonclip.param_groups(net)
    for name in ("attn.qkv_proj.weight", "experts.gate_up_proj"):
        assert route(groups, name).reason == "fused? layout unknown"
        assert "split_sizes" not in group_of(groups, name)
    assert "Fused, layout unknown" in groups.report() and "attn.qkv_proj.weight" in groups.report()
    # a known class whose config does not fit its weight: reported, left whole
    model = tiny("phi3")
    model.model.layers[0].self_attn.num_key_value_heads = 3
    groups = muonclip.param_groups(model)
    name = "model.layers.0.self_attn.qkv_proj.weight"
    assert route(groups, name).reason == "fused? layout unknown" and "split_sizes" not in group_of(groups, name)


class PackedAttention(nn.Module):
    """A user's attention packing q, k and v per key/value group (2 query heads of 4 rows per key head)."""

    def __init__(self):
        super().__init__()
        self.n_q, self.n_kv, self.head_dim = 4, 2, 4
        self.packed = nn.Linear(16, 2 * (2 + 1 + 1) * 4)


def test_a_registered_family_is_split_as_its_table_states(monkeypatch):
    """The registry is the extension point: a table naming a class, its fused child and where its head
    counts are (merged after the registered ones) makes `param_groups` split it into q, k and v per
    key/value group; unregistered, the same module is reported, not guessed."""
    from muonclip.common import families, family_readers

    net = nn.ModuleDict({"attn": PackedAttention()})
    name = "attn.packed.weight"
    assert "split_sizes" not in group_of(muonclip.param_groups(net), name)  # "packed" is no fused name: plain
    monkeypatch.setattr(families, "TABLES", list(families.TABLES))
    table = families.FamilyTable(
        heads=families.HeadSources(heads=families.Read(("n_q",)), kv_heads=families.Read(("n_kv",))),
        fused_qkv=(families.FusedQKV(("PackedAttention",), "packed", per_kv_head=True),),
    )
    families.register_families(table)
    families.register_families(table)  # again: a no-op
    assert families.TABLES.count(table) == 1
    rows = family_readers.fused_qkv(net["attn"], None)
    assert (rows.groups, rows.sizes, rows.rows("k")) == (2, (8, 4, 4), (8, 4, 16, 2))
    groups = muonclip.param_groups(net)
    assert route(groups, name).reason == "fused qkv"
    assert {k: group_of(groups, name)[k] for k in ("split_sizes", "split_groups")} == {"split_sizes": [8, 4, 4],
                                                                                       "split_groups": 2}
    assert group_of(muonclip.param_groups(net, per_head=True), name)["split_sizes"] == [4] * 8
    with pytest.raises(TypeError, match="FamilyTable"):
        families.register_families({"fused_qkv": ()})
    with pytest.raises(ValueError, match="q in it or from query="):
        families.FusedQKV(("X",), "kv", order=("k", "v"))


def test_opt_out_and_explicit_split_keep_what_was_asked():
    model = tiny("phi3")
    name = "model.layers.0.self_attn.qkv_proj.weight"
    whole = muonclip.param_groups(model, split_fused=False)
    assert "split_sizes" not in group_of(whole, name) and "kept whole" in route(whole, name).detail
    given = muonclip.param_groups(model, split={"*.qkv_proj.weight": [16, 32]})
    assert group_of(given, name)["split_sizes"] == [16, 32] and "as split=" in route(given, name).detail
    assert group_of(given, "model.layers.0.mlp.gate_up_proj.weight")["split_sizes"] == [20, 20]  # others still split
    grouped = muonclip.param_groups(model, split={"*.qkv_proj.weight": {"split_sizes": [8, 4], "split_groups": 4}})
    assert {k: group_of(grouped, name)[k] for k in ("split_sizes", "split_groups")} == {"split_sizes": [8, 4],
                                                                                       "split_groups": 4}
    with pytest.raises(ValueError, match="split_sizes"):
        muonclip.param_groups(model, split={"*.qkv_proj.weight": {"sizes": [8, 4]}})


def test_split_groups_bad_input_is_a_clear_error():
    p = nn.Parameter(torch.randn(12, 4))
    with pytest.raises(ValueError, match="split_groups=3 needs split_sizes"):
        muonclip.Muon([{"params": [p], "split_groups": 3}])
    with pytest.raises(ValueError, match=r"x split_groups=3 must add up to the 12 rows"):
        muonclip.Muon([{"params": [p], "split_sizes": [1, 2], "split_groups": 3}])
    with pytest.raises(ValueError, match="split_groups must be an int >= 1"):
        muonclip.Muon([{"params": [p], "split_sizes": [12], "split_groups": 0}])


def test_layouts_of_torch_multihead_attention():
    """Heads from the module itself, never from the config of a model holding it (a vision tower's
    ``nn.MultiheadAttention`` inside a model whose text config has 2 key/value heads)."""
    mha = nn.MultiheadAttention(16, 4)
    found = weight_splits(mha)[id(mha.in_proj_weight)]
    assert found.split_sizes == (16, 16, 16)
    assert weight_splits(mha, per_head=True)[id(mha.in_proj_weight)].split_sizes == (4,) * 12
    holder = nn.ModuleDict({"pool": mha})
    holder.config = transformers.LlamaConfig(num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    assert weight_splits(holder)[id(mha.in_proj_weight)].split_sizes == (16, 16, 16)
