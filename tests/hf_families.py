"""Every causal-LM family of the installed transformers, built tiny from its own default config.

`families()` reads transformers' own registry (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and
``CONFIG_MAPPING``); `tiny_config` shrinks a family's default config generically, by attribute
name: widths, layers (keeping one layer of each per-layer kind), heads, head dims, experts,
vocabulary, positions, windows; `FAMILY_OVERRIDES` holds the few settings a family needs on top.
`build` returns the model in float32, training mode, dropout off.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import transformers
from hf_probe import assert_only_clipped_rows_changed, real_tokens, replay_layer_max, tau_between
from transformers import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import muonclip
from muonclip.integrations.hf import attach, attach_report, detach
from muonclip.integrations.hf_attention import CHECK_ATTR
from muonclip.optim import fused
from muonclip.optim._matrices import matrix_spec
from muonclip.qkclip import MLALayout, MuonClip, Rows, StridedRows

VOCAB = 128
WIDTH = 64
HEADS = 4
HEAD_DIM = 16

HIDDEN = {"hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "dim", "model_dim", "hidden_dim",
          "word_embed_proj_dim", "embedding_size", "embedding_dim", "emb_dim", "attention_hidden_size",
          "hidden_size_global", "lru_width", "backbone_hidden_size", "out_hidden_size"}
INTERMEDIATE = {"ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim", "encoder_ffn_dim", "dim_ff", "dff",
                "feed_forward_size", "d_inner", "expert_ffn_hidden_size", "mlp_dim", "intermediate_size_mlp"}
LAYERS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
          "num_decoder_layers", "num_encoder_layers", "conf_num_hidden_layers", "depth")  # in this order
N_HEADS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads", "encoder_attention_heads",
           "attention_heads", "swa_num_attention_heads", "conf_num_attention_heads", "num_encoder_attention_heads",
           "num_decoder_attention_heads", "linear_num_heads", "linear_num_key_heads", "linear_num_value_heads",
           "mamba_n_heads", "mamba_num_heads", "n_mamba_heads", "index_n_heads"}
KV_HEADS = {"num_key_value_heads", "n_kv_heads", "num_kv_heads", "swa_num_key_value_heads", "kv_n_heads",
            "num_query_groups", "multi_query_group_num"}
HEAD_DIMS = {"head_dim", "global_head_dim", "swa_head_dim", "attention_head_dim", "d_head", "dim_head", "kv_channels",
             "attention_head_size", "d_kv", "v_head_dim", "qk_nope_head_dim", "linear_head_dim", "linear_key_head_dim",
             "linear_value_head_dim", "index_head_dim", "mamba_d_head", "mamba_head_dim", "mamba_headdim"}
SMALL_DIMS = {"qk_rope_head_dim": HEAD_DIM, "rotary_dim": 8, "kv_lora_rank": 16, "q_lora_rank": 32, "o_lora_rank": 16, "index_topk": 4,
              "mamba_d_state": 8, "state_size": 8, "ssm_state_size": 8, "mamba_d_ssm": 64, "mamba_dt_rank": 8,
              "time_step_rank": 8, "mamba_chunk_size": 8, "chunk_size": 8, "conv_L_cache": 3, "mamba_n_groups": 1,
              "mamba_ngroups": 1, "n_groups": 1, "laurel_rank": 8, "hidden_size_per_layer_input": 8,
              "vocab_size_per_layer_input": VOCAB, "altup_num_inputs": 2, "hc_mult": 2, "o_groups": 2,
              "num_nextn_predict_layers": 0}
EXPERTS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts", "num_experts_per_layer"}
TOP_K = {"num_experts_per_tok", "num_experts_per_token", "top_k", "moe_topk", "moe_k", "moe_top_k"}
ONE = {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group", "topk_group", "num_expert_group",
       "first_k_dense_replace", "num_dense_layers", "num_kv_shared_layers", "decoder_sparse_step",
       "interleave_moe_layer_step", "moe_layer_interval", "num_mem_blocks"}
POSITIONS = {"max_position_embeddings", "n_positions", "max_source_positions", "max_target_positions", "n_ctx",
             "model_max_length", "original_max_position_embeddings", "max_seq_len", "context_length",
             "num_position_embeddings"}
WINDOWS = {"sliding_window", "sliding_window_size", "attention_window_size", "local_attention_window_len",
           "window_size", "attention_chunk_size", "keep_window_size"}
KEEP = {"chunk_size_feed_forward", "pretraining_tp", "type_vocab_size", "num_labels", "rope_theta",
        "relative_attention_num_buckets", "relative_attention_max_distance", "seed", "linear_conv_kernel_dim",
        "conv_kernel", "mamba_d_conv", "mamba_expand", "expand", "patch_size", "num_channels", "image_size",
        "spatial_merge_size", "temporal_patch_size", "in_channels", "kernel_size", "conv1d_width", "num_codebooks"}
IDS_SUFFIXES = ("_id", "token_id", "_index", "token_index", "_idx")

FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": {"mamba_n_heads": 8},
    "granitemoehybrid": {"mamba_n_heads": 8},
    "mamba2": {"num_heads": 8},
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
    "dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
             "ffn_config": {"hidden_size": WIDTH, "ffn_hidden_size": WIDTH, "moe_num_experts": 4, "moe_top_k": 2}},
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1, "num_hidden_layers": 3,
             "layer_types": None},
    "lfm2_moe": {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "musicgen": {"num_codebooks": 1},
    "musicgen_melody": {"num_codebooks": 1},
    "qwen4_exp": {"indexer_budget": 8, "indexer_compress_ratio": 2, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                  "indexer_head_dim": HEAD_DIM},
    "qwen4_exp_text": {"indexer_budget": 8, "indexer_compress_ratio": 2, "indexer_n_heads": 2, "indexer_kv_heads": 1,
                       "indexer_head_dim": HEAD_DIM},
    "reformer": {"axial_pos_embds_dim": [32, 32], "axial_pos_shape": [3, 4], "attn_layers": ["local", "local"], "is_decoder": True},
    "zamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "num_hidden_layers": 4, "layers_block_type": None},
    "zamba2": {"n_mamba_heads": 8, "hybrid_layer_ids": None},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
}
"""Settings a family needs beyond the generic shrink (model_type -> config keywords)."""


def families() -> dict[str, tuple[str, str]]:
    """``model_type -> (model class name, config class name)`` for every causal-LM family registered."""
    out = {}
    for model_type, model_cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        if model_type in CONFIG_MAPPING:
            out[model_type] = (model_cls, CONFIG_MAPPING[model_type].__name__)
    return dict(sorted(out.items()))


def _layer_picks(d: dict[str, Any], n_layers: int) -> list[int]:
    """Layer indices that keep one layer of each combination of the per-layer lists (at least 2)."""
    lists = [v for k, v in d.items() if isinstance(v, list) and len(v) == n_layers and n_layers > 1]
    by_index = [_layer_keyed(v) for v in d.values() if _layer_keyed(v)]
    seen, picks = set(), []
    for i in range(n_layers):
        kind = tuple(str(v[i]) for v in lists) + tuple(str(m.get(i)) for m in by_index)
        if kind not in seen:
            seen.add(kind)
            picks.append(i)
    for i in range(n_layers):
        if len(picks) >= 2:
            break
        if i not in picks:
            picks.append(i)
    return sorted(picks)


def _layer_keyed(v: Any) -> dict[int, Any] | None:
    """A dict keyed by layer index (``{5: ...}`` or ``{"05": ...}``) as ``{int: value}``, else None."""
    if not isinstance(v, dict) or not v or not all(isinstance(k, int) or str(k).isdigit() for k in v):
        return None
    return {int(k): x for k, x in v.items()}


def _shrink_value(name: str, value: Any, d: dict[str, Any]) -> Any:
    if isinstance(value, float) and ("dropout" in name or "pdrop" in name or name.endswith("_drop")):
        return 0.0  # training-mode forwards of two copies must agree
    if isinstance(value, bool) or not isinstance(value, int):
        return value
    if name in KEEP:
        return value
    if name in HIDDEN:
        return WIDTH
    if "intermediate_size" in name or name in INTERMEDIATE:
        return WIDTH
    if name in N_HEADS:
        return HEADS
    if name in KV_HEADS:
        return min(value, 2)
    if name in HEAD_DIMS:
        return HEAD_DIM if value > 0 else value
    if name in SMALL_DIMS:
        return SMALL_DIMS[name]
    if name in EXPERTS:
        return 4
    if name in TOP_K:
        return min(value, 2)
    if name in ONE:
        return min(value, 1)
    if "vocab" in name:
        return VOCAB
    if name in POSITIONS:
        return min(value, 256)
    if name in WINDOWS:
        return min(value, 4)
    if name.endswith(IDS_SUFFIXES):
        return value if value < VOCAB - 8 else VOCAB - 1 - (sum(map(ord, name)) % 6)
    if name.endswith("_period"):
        return min(value, 2)
    if name.endswith("_offset"):
        return min(value, 1)
    return value


def _shrink_dict(d: dict[str, Any]) -> dict[str, Any]:
    n_layers = next((d[k] for k in LAYERS if isinstance(d.get(k), int)), None)
    picks = _layer_picks(d, n_layers) if n_layers else []
    out = {}
    for k, v in d.items():
        if v is None and k in HEAD_DIMS | KV_HEADS | EXPERTS | TOP_K | ONE:  # no default the model can use
            out[k] = _shrink_value(k, 10**6, d)
            continue
        if v is None or (isinstance(v, dict) and not v):  # the class's own default applies
            continue
        if _layer_keyed(v) is not None and picks:  # per-layer settings, by layer index
            out[k] = {picks.index(i): _shrink_dict(x) if isinstance(x, dict) else x
                      for i, x in _layer_keyed(v).items() if i in picks}
        elif isinstance(v, dict) and k not in ("id2label", "label2id"):
            out[k] = _shrink_dict(v) if "model_type" in v or any(a in v for a in (*HIDDEN, *LAYERS)) else v
        elif isinstance(v, list) and n_layers and len(v) == n_layers and n_layers > 1:
            out[k] = [v[i] for i in picks]
        elif k in LAYERS and isinstance(v, int):
            out[k] = len(picks) if picks else min(v, 2)
        else:
            out[k] = _shrink_value(k, v, d)
    hid = next((k for k in ("hidden_size", "d_model", "n_embd") if isinstance(d.get(k), int)), None)
    if hid and isinstance(d.get("attention_hidden_size"), int) and d["attention_hidden_size"] % d[hid] == 0:
        out["attention_hidden_size"] = WIDTH * (d["attention_hidden_size"] // d[hid])  # a multiple of the width
    nope, rope = d.get("qk_nope_head_dim"), d.get("qk_rope_head_dim")
    if isinstance(d.get("head_dim"), int) and isinstance(rope, int):  # head_dim tied to the MLA dims
        if d["head_dim"] == rope:
            out["head_dim"] = out["qk_rope_head_dim"]
        elif isinstance(nope, int) and d["head_dim"] == nope + rope:
            out["head_dim"] = out["qk_nope_head_dim"] + out["qk_rope_head_dim"]
    heads = next((k for k in ("num_attention_heads", "n_head", "n_heads", "num_heads", "decoder_attention_heads")
                  if isinstance(d.get(k), int)), None)
    for k in KV_HEADS:  # multi-head attention stays multi-head
        if heads and isinstance(d.get(k), int) and d[k] == d[heads]:
            out[k] = out[heads]
    if isinstance(out.get("qk_head_dim"), int) and isinstance(out.get("qk_nope_head_dim"), int):
        out["qk_head_dim"] = out["qk_nope_head_dim"] + out.get("qk_rope_head_dim", 0)
    for k in ("id2label", "label2id", "transformers_version", "_name_or_path", "architectures", "model_type"):
        out.pop(k, None)
    return out


def tiny_config(model_type: str, variant: dict[str, Any] | None = None):
    """The family's default config, shrunk (module docstring), plus its `FAMILY_OVERRIDES` and
    ``variant`` (config keywords of a variant of the family, e.g. GPTBigCode without multi-query
    attention); the config class is the model class's own (a multimodal family's causal LM takes
    its text config)."""
    cls = getattr(transformers, families()[model_type][0]).config_class
    overrides = {**FAMILY_OVERRIDES.get(model_type, {}), **(variant or {})}
    try:  # a family whose default config fails its own validation starts from the overrides
        base = cls(**overrides)
    except Exception:  # noqa: BLE001 - transformers' strict-dataclass validation raises its own types
        base = cls()
    d = _shrink_dict(base.to_dict())
    d.update(overrides)
    return cls(**{k: v for k, v in d.items() if v is not None})


def build(model_type: str, seed: int = 0, variant: dict[str, Any] | None = None) -> torch.nn.Module:
    """The family's tiny model (``variant``: as `tiny_config`): float32, training mode, every dropout
    probability 0, projection biases drawn from N(0.25, 0.25^2): a zero bias would hide whether the clip
    scales it, and q/k biases of one sign keep the max logits of a model without RoPE positive."""
    model_cls, _ = families()[model_type]
    torch.manual_seed(seed)
    config = tiny_config(model_type, variant)
    model = getattr(transformers, model_cls)(config).float()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for a in ("attention_dropout", "dropout", "attn_dropout"):
            if isinstance(getattr(m, a, None), float):
                setattr(m, a, 0.0)
        bias = getattr(m, "bias", None)
        if isinstance(bias, torch.nn.Parameter) and isinstance(getattr(m, "weight", None), torch.Tensor) \
                and bias.ndim == 1 and m.weight.ndim == 2:  # projections' biases non-zero: a clip shows
            with torch.no_grad():
                bias.normal_(0.25, 0.25)
    return model.train()


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


FAMILY_SETUP: dict[str, Callable[[torch.nn.Module], None]] = {
    "xmod": lambda model: model.set_default_language("en_XX"),
}
"""What a family's model needs after building (model_type -> function of the model)."""


# ----------------------------------------------------------------------------------------------
# one family's verdict
# ----------------------------------------------------------------------------------------------

B, T = 2, 12
REFUSAL_CAUSES = {
    "q/k normalised after the projection": r"normalises q/k after the projection",
    "attention in the model's own code": r"computes attention in its own code, not through transformers' "
                                         r"AttentionInterface",
    "no softmax attention": r"has no softmax attention: its token mixers",
    "no known head layout": r"head layout muonclip knows",
    "q/k clamped after the projection": r"clamps q, k and v to \[",
    "a keyword the attention function does not compute": r"passes `\w+`, which the 'muonclip' attention function "
                                                        r"does not compute",
    "a keyword the attention function does not implement": r"passes `\w+` \([^)]*\) to its attention function, a "
                                                          r"keyword the 'muonclip' attention function does not "
                                                          r"implement",
}
"""Each refusal's cause, as the pattern of its message (a refusal must match one)."""


@dataclass
class Verdict:
    """A family's row: ``verdict`` is ``"supported"``, ``"refused"`` or ``"not built"``; ``why`` says it."""

    family: str
    verdict: str
    why: str
    detail: str = ""


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Input ids and an attention mask padded on both sides: row 0 right-padded (3 pads, whose
    queries see the real keys before them), row 1 left-padded (4 pads)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (B, T), generator=g)
    am = torch.ones(B, T, dtype=torch.long)
    am[0, T - 3:] = 0
    am[1, :4] = 0
    return ids.masked_fill(am == 0, 0), am


def _logits(model, ids, am):
    out = model(input_ids=ids, attention_mask=am, use_cache=False)
    return out.logits if hasattr(out, "logits") else out[0]


def _cause(message: str) -> str | None:
    return next((name for name, pattern in REFUSAL_CAUSES.items() if re.search(pattern, message)), None)


def _refused(family: str, e: Exception, when: str) -> Verdict:
    message = str(e).splitlines()[0]
    cause = _cause(message)
    assert isinstance(e, ValueError) and cause is not None, (
        f"{family}: neither supported nor refused with a named cause ({when}): {type(e).__name__}: {message}")
    return Verdict(family, "refused", f"{cause} ({when})", message[:240])


def _supported_why(layers, model) -> str:
    kinds = sorted({type(ly.layout).__name__ for ly in layers})
    sinks = any(getattr(model.get_submodule(ly.name), "sinks", None) is not None for ly in layers)
    skipped = len(attach_report(model).skipped)
    parts = [f"{len(layers)} attention layers, {'/'.join(kinds)}"]
    if sinks:
        parts.append("attention sinks")
    if skipped:
        parts.append(f"{skipped} mixers without softmax attention skipped")
    return "; ".join(parts)


def _clip_rows(t: Any) -> tuple[torch.Tensor, list[int]] | None:
    """``(tensor, the matrix rows the clip scales, in head order)`` of a layout weight (None: DoRA
    magnitudes, not rows of a weight)."""
    if isinstance(t, Rows):
        return t.tensor, list(range(t.start, t.stop))
    if isinstance(t, StridedRows):
        return t.tensor, t.indices().tolist()
    if isinstance(t, torch.Tensor):
        return t, list(range(t.shape[0]))
    return None


def _routed_maps(group: dict[str, Any], p: torch.Tensor) -> set[tuple[int, ...]]:
    """The matrices Muon sees in weight ``p`` of param group ``group``, each as the tuple of its
    ``(out, in)`` rows (`muonclip.optim._matrices.MatrixSpec.blocks`)."""
    spec = matrix_spec(p.shape, {"split_sizes": group.get("split_sizes"), "split_groups": group.get("split_groups", 1),
                                 "transposed": group.get("transposed", False), "flatten": group.get("flatten", False),
                                 "adjust_lr_fn": "match_rms_adamw", "method": "ns5", "ns_steps": None})
    return {tuple(sorted(r for lo, hi in segs for r in range(lo, hi))) for segs in spec.blocks}


def check_routing_agrees(family: str, model: torch.nn.Module, layers: list) -> None:
    """Routing and the clip see the same maps: wherever the clip scales rows of a weight as a layer's
    q or k, `muonclip.param_groups` gives Muon exactly those rows as one matrix of that weight (a
    fused weight is split into the maps the clip scales), and with ``per_head=True`` each head's rows
    as one matrix. (MLA's ``kv_b_proj``, whose per-head rows hold k and v, is left out.)"""
    for per_head in (False, True):
        routed = {id(p): g for g in muonclip.param_groups(model, per_head=per_head) for p in g["params"]}
        for ly in layers:
            lay = ly.layout
            if isinstance(lay, MLALayout):
                fields = [("q_weight", lay.n_heads, lay.qk_nope_head_dim + lay.qk_rope_head_dim)]
            else:
                fields = [("q_weight", lay.n_heads, lay.head_dim),
                          ("k_weight", getattr(lay, "n_kv_heads", lay.n_heads), lay.head_dim)]
            for field, heads, d in fields:
                found = _clip_rows(getattr(lay, field))
                if found is None:
                    continue
                t, rows = found
                group = routed.get(id(t))
                assert group is not None and group["algorithm"] == "muon", f"{family}: {ly.name}.{field} not on Muon"
                maps = _routed_maps(group, t)
                wanted = [rows[h * d:(h + 1) * d] for h in range(heads)] if per_head else [rows]
                for w in wanted:
                    assert tuple(sorted(w)) in maps, (
                        f"{family}: {ly.name}.{field} (per_head={per_head}): the clip scales rows {w[:4]}... "
                        f"({len(w)} rows), which are not one matrix of param_groups' split "
                        f"{ {k: group.get(k) for k in ('split_sizes', 'split_groups', 'transposed')} }")


def check_rules_skip_nothing(family: str, model: torch.nn.Module) -> None:
    """`muonclip.optim.fused.weight_splits` skips the split rules on a module that lacks every
    attribute they look up first (`fused._gates`): the skip changes no split of the family's model
    (every option), against the rules run on every module."""
    for options in ({}, {"per_head": True}, {"split_fused": False}):
        gated = fused.weight_splits(model, **options)
        with mock.patch.object(fused, "lacks", lambda module, names: False):
            every = fused.weight_splits(model, **options)
        assert gated == every, f"{family} {options}: a rule was skipped on a module it splits"


def run_family(family: str, variant: dict[str, Any] | None = None) -> Verdict:
    """Build the family tiny (``variant``: as `tiny_config`) and decide its row
    (``tests/test_qkclip_families.py`` states the criteria).

    Raises:
        AssertionError: the family is neither supported (every criterion) nor refused with a
            cause of `REFUSAL_CAUSES` before any step, or routing splits a weight the clip scales
            into other maps than the clip's (`check_routing_agrees`).
    """
    try:
        model = build(family, variant=variant)
    except Exception as e:  # noqa: BLE001 - any failure to build is recorded with its message
        return Verdict(family, "not built", f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
    if family in FAMILY_SETUP:
        FAMILY_SETUP[family](model)
    check_rules_skip_nothing(family, model)
    ref = copy.deepcopy(model)
    impl = model.config._attn_implementation
    impls = [(m, m.config._attn_implementation) for m in model.modules() if isinstance(m, transformers.PreTrainedModel)]
    try:
        layers = attach(model)
    except ValueError as e:
        assert model.config._attn_implementation == impl, f"{family}: refused but switched"
        return _refused(family, e, "when attaching")
    check_routing_agrees(family, model, layers)
    ids, am = _batch()
    real = am.bool()
    try:
        with torch.no_grad():  # eval mode: the model's own output
            ours, theirs = _logits(model.eval(), ids, am), _logits(ref.eval(), ids, am)
        torch.testing.assert_close(ours[real], theirs[real], rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"{family}: eval forward differs: {m}")
        model.train(), ref.train()
        ours, theirs = _logits(model, ids, am), _logits(ref, ids, am)  # the forward check runs here
    except ValueError as e:
        return _refused(family, e, "at the first forward")
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-4, atol=1e-4,
                               msg=lambda m: f"{family}: train forward differs: {m}")
    ran = [ly for ly in layers if ly.recorder.value is not None]  # cross-attention without an encoder: not run
    assert ran and ran[0] is layers[0], f"{family}: the first attention layer recorded nothing"
    checks = [getattr(model.get_submodule(ly.name), CHECK_ATTR) for ly in ran]
    assert all(c is not None and not c.pending for c in checks), f"{family}: a forward check did not run"
    for ly in layers:
        ly.recorder.reset()
    model.zero_grad(set_to_none=True)

    first = layers[0]
    with torch.no_grad():  # layer 0's heads far apart: logits times 3..30, so some pass tau and some do not
        first.layout.clip(torch.linspace(3.0, 30.0, first.layout.n_heads))
    module = model.get_submodule(first.name)
    saved: list = []  # the layer's calls that feed the clip (grad enabled); a model may call it more than once

    def save(m, args, kwargs):
        if torch.is_grad_enabled():
            saved.append((args, dict(kwargs)))

    hook = module.register_forward_pre_hook(save, with_kwargs=True)
    _logits(model, ids, am)[real].float().square().mean().backward()  # recorders without a threshold: exact
    hook.remove()
    real_tokens(am)  # the probe leaves padding queries out by the batch's own mask
    try:
        before = torch.stack([replay_layer_max(model, module, a, kw) for a, kw in saved]).amax(0)
        tau = tau_between(before)
        opt = MuonClip(model, lr=0.0, weight_decay=0.0, tau=tau, layers=layers, on_ineffective_clip="raise")
        w0 = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        after = torch.stack([replay_layer_max(model, module, a, kw) for a, kw in saved]).amax(0)
    finally:
        real_tokens(None)
    clipped = before > tau
    torch.testing.assert_close(opt.last_max_logits[first.name].cpu(), before, rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"{family}: recorded max logits: {m}")
    torch.testing.assert_close(opt.last_clipped[first.name].cpu(), clipped, msg=f"{family}: clip decisions")
    torch.testing.assert_close(after, torch.clamp(before, max=tau), rtol=2e-5, atol=2e-5,
                               msg=lambda m: f"{family}: layer 0 not clipped to tau: {m}")
    assert 0 < int(clipped.sum()) < clipped.numel()
    assert_only_clipped_rows_changed(model, [first], {first.name: clipped}, w0)
    detach(model)  # every (sub-)model back to its own implementation, nothing of ours left
    assert [m.config._attn_implementation for m, _ in impls] == [i for _, i in impls], f"{family}: detach"
    assert not any(hasattr(m, CHECK_ATTR) or m._forward_pre_hooks for m in model.modules()), f"{family}: detach"
    return Verdict(family, "supported", _supported_why(layers, model))
