"""The family table: what muonclip knows of each model family's modules, in one place.

`TABLE` is registered with the core (`muonclip.common.families.register_families`) when this
module is imported (``import muonclip`` does), and both `muonclip.param_groups` (which weight
is which matrices) and `muonclip.MuonClip` on a transformers model (which rows are each head's
q and k, `muonclip.integrations.hf_layouts`) read it. Classes and attributes are named as
strings: nothing here imports transformers or peft, so the table serves a plain torch model
too (``nn.MultiheadAttention``, muonclip's reference GPT).

**Fused attention projections** (`FUSED_QKV`), by class; the rows of the ``(out, in)`` matrix,
read off each class's forward:

* Phi-3 style ``qkv_proj`` (``Phi3Attention``, ``Phi4MultimodalAttention``; ``PhimoeAttention``
  where it has one): ``[q | k | v]`` = ``[n_heads * d, n_kv_heads * d, n_kv_heads * d]``.
* GPT-2's ``c_attn`` (``GPT2Attention``; a ``Conv1D`` stored ``(in, out)``): ``[q | k | v]``,
  ``hidden_size`` each; a cross-attention layer's ``c_attn`` holds ``[k | v]``, its queries
  ``q_attn`` (GPTBigCode's too).
* GPTBigCode's ``c_attn`` (``GPTBigCodeAttention``, an ``nn.Linear``): with ``multi_query``
  ``[q | k | v]`` = ``[n_heads * d, d, d]`` (split by ``(embed_dim, kv_dim, kv_dim)``); without,
  interleaved per head ``[h0: q k v | h1: q k v | ...]`` (viewed as ``(n_heads, 3 * d)``).
* GPT-NeoX / Pythia's ``query_key_value``: interleaved per head ``[h0: q k v | h1: q k v | ...]``.
* CodeGen's ``qkv_proj``: ``[p0: q v k | p1: q v k | ...]`` over its ``mp_num`` model-parallel
  partitions (heads in partition order).
* ``torch.nn.MultiheadAttention``'s ``in_proj_weight`` / ``in_proj_bias``: ``[q | k | v]``,
  ``embed_dim`` each (absent when ``kdim``/``vdim`` differ: separate projections then).

**Separate projections** (`PROJECTIONS`): Llama style ``q_proj``/``k_proj``/``v_proj`` (and
muonclip's reference GPT), BERT style ``query``/``key``/``value``, CTRL's ``Wq``/``Wk``/``Wv``.

**Head counts** (`HEADS`): from the module (``num_heads``/``n_head``/``num_attention_heads``;
``num_key_value_heads``/``n_kv_head``, else ``num_key_value_groups``; ``head_dim``/``head_size``),
else the config (``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
``hidden_size // heads``). Layers of one model may differ (MiMo-V2-Flash's sliding-window
layers have twice the key heads of its full-attention layers), hence the module first.

**Multi-head latent attention** (`LATENT`, DeepSeek-V3 and the reference GPT): ``kv_b_proj``
(``[k_nope | v]`` per head), ``q_b_proj`` (or ``q_proj`` without a query LoRA; ``[nope |
rope]`` per head), ``kv_a_proj_with_mqa`` (``[c_kv | shared rotary key]``); the latent norms
``q_a_layernorm`` / ``kv_a_layernorm`` feed the up-projections.

**MLP and experts**: a ``gate_up_proj`` layer (`FUSED_MLP`: transformers' fused gated MLP, Phi-3,
GLM, ...; every one in transformers 5 splits its output with ``chunk(2)``) is ``[gate | up]``,
``intermediate_size`` each. Stacked experts declared by transformers'
``use_experts_implementation`` (`EXPERTS`: Mixtral, DeepSeek-V3, Qwen2-MoE, gpt-oss, ...) state
``is_transposed`` (stored ``(E, in, out)``), ``is_concatenated`` (``[gate | up]`` per expert, else
rows alternating) and ``has_gate``. Routers (`ROUTERS`): a ``gate`` or ``router`` layer beside
an ``experts`` module, one row per expert.

**Storage**: transformers' ``Conv1D`` stores ``(in, out)`` (`TRANSPOSED`).

**q/k normalisation and clamps** (the clip's refusals, `muonclip.qkclip.qknorm`): the attention
classes transformers builds with an unconditional q/k norm (`QK_NORM_CLASSES`; the family test
``tests/test_qkclip_families.py`` checks every class of the installed transformers); the norms
that act on the attention's output (`OUTPUT_NORMS`: DiffLlama's ``groupnorm``, BitNet's
``attn_sub_norm``) and the children that only pick keys (`SELECTION_CHILDREN`: DeepSeek sparse
attention's ``indexer``), which cannot undo a rescaling; the attributes that clamp q, k and v
after the projection (`CLAMPS`: DBRX's ``clip_qkv``).

**peft adapters** (`ADAPTERS`, and the names `muonclip.integrations.hf_adapters` reads): LoRA's
``lora_A``/``lora_B``, ``lora_embedding_A``/``lora_embedding_B``, DoRA's
``lora_magnitude_vector``, a trainable copy under ``modules_to_save.<adapter>``, the wrapped
weight under ``base_layer``. transformers' ``get_output_embeddings`` names a model's output layer.

**Names that say a weight is fused** (`FUSED_NAMES`): one whose layout is not in this table is
reported by `muonclip.param_groups` as "fused? layout unknown" and kept whole, and refused by
the clip.
"""

from __future__ import annotations

from ..common.families import (
    Adapters,
    FamilyTable,
    FusedMLP,
    FusedQKV,
    HeadSources,
    LatentAttention,
    Projections,
    Read,
    Router,
    StackedExperts,
    TransposedLinear,
    register_families,
)

LORA_A = "lora_A"
"""peft's LoRA layer: the ModuleDict of its A factors."""
DORA_MAGNITUDE = "lora_magnitude_vector"
"""peft's DoRA layer: the ModuleDict of its magnitude vectors."""
ADAPTER_BASE = "base_layer"
"""peft's adapter layers: the child holding the layer they wrap."""
ADAPTER_COPIES = "modules_to_save"
"""peft's ``ModulesToSaveWrapper``: the ModuleDict of its trainable copies."""

HEADS = HeadSources(
    heads=Read(("num_heads", "n_head", "num_attention_heads"), ("num_attention_heads",)),
    kv_heads=Read(("num_key_value_heads", "n_kv_head"), ("num_key_value_heads",)),
    kv_groups=("num_key_value_groups",),
    head_dim=Read(("head_dim", "head_size"), ("head_dim",)),
    width=("hidden_size",),
)

FUSED_QKV = (
    FusedQKV(("Phi3Attention", "Phi4MultimodalAttention", "PhimoeAttention"), "qkv_proj"),
    FusedQKV(("GPT2Attention", "GPTBigCodeAttention"), "c_attn", order=("k", "v"), query="q_attn",
             when=(("is_cross_attention", True),)),
    FusedQKV(("GPT2Attention",), "c_attn"),
    FusedQKV(("GPTBigCodeAttention",), "c_attn", when=(("multi_query", True),)),
    FusedQKV(("GPTBigCodeAttention",), "c_attn", per_kv_head=True),
    FusedQKV(("GPTNeoXAttention",), "query_key_value", per_kv_head=True),
    FusedQKV(("CodeGenAttention",), "qkv_proj", order=("q", "v", "k"), groups="mp_num"),
    FusedQKV(("MultiheadAttention",), "in_proj", config=False),
)

PROJECTIONS = (Projections("q_proj", "k_proj", "v_proj"), Projections("query", "key", "value"),
               Projections("Wq", "Wk", "Wv"))

LATENT = (
    LatentAttention(
        kv_up="kv_b_proj",
        q_up=("q_b_proj", "q_proj"),
        kv_down="kv_a_proj_with_mqa",
        nope=Read(("qk_nope_head_dim", "nope"), ("qk_nope_head_dim",)),
        rope=Read(("qk_rope_head_dim", "rope"), ("qk_rope_head_dim",)),
        v=Read(("v_head_dim", "v_dim"), ("v_head_dim",)),
        input_norms=("q_a_layernorm", "kv_a_layernorm"),
    ),
)

FUSED_MLP = (FusedMLP("gate_up_proj", ("gate", "up"), Read(("intermediate_size",), ("intermediate_size",))),)

EXPERTS = (
    StackedExperts(
        transposed="is_transposed", concatenated="is_concatenated", gated="has_gate", gate_up="gate_up_proj",
        bias_suffix="_bias",
        size=Read(("intermediate_dim", "intermediate_size", "moe_intermediate_size"),
                  ("moe_intermediate_size", "intermediate_size")),
    ),
)

ROUTERS = (Router(("gate", "router"), "experts",
                  Read(("num_experts",), ("num_local_experts", "num_experts", "n_routed_experts"))),)

FUSED_NAMES = ("qkv_proj", "qkv", "Wqkv", "wqkv", "query_key_value", "c_attn", "in_proj", "in_proj_weight",
               "gate_up_proj", "gate_up", "w13", "kv_proj")

TRANSPOSED = (TransposedLinear(("Conv1D",), "nf"),)

QK_NORM_CLASSES = (
    "ChameleonAttention", "Gemma3Attention", "Gemma3nTextAttention", "Olmo2Attention", "Olmo3Attention",
    "OlmoeAttention", "Qwen3Attention", "Qwen3MoeAttention",
)
"""transformers attention classes that always normalise q/k after the projections. Classes whose
norm depends on the config (``Llama4TextAttention`` with ``use_qk_norm``, ``CohereAttention``,
``PhiAttention``, ``StableLmAttention``, ``PersimmonAttention``, ``Glm4MoeAttention``) are decided
by their modules (`muonclip.qkclip.qknorm`)."""

OUTPUT_NORMS: dict[str, tuple[str, ...]] = {
    "DiffLlamaAttention": ("groupnorm",),
    "BitNetAttention": ("attn_sub_norm",),
}
"""Attention class -> children that normalise the attention's *output* (after the softmax and V),
hence cannot undo a rescaling of W_q/W_k (each one's family is a supported row of the family table,
``tests/test_qkclip_families.py``: its clip is exact)."""

SELECTION_CHILDREN = ("indexer",)
"""Children that pick which keys a query sees (DeepSeek sparse attention's indexer) from their own
projections and norms: they never rescale the q and k of the logits."""

CLAMPS = ("clip_qkv",)
"""Attention attributes that clamp q, k and v after the projection (DBRX): a rescaled row is clamped again."""

ADAPTERS = Adapters(
    roles=((LORA_A, "LoRA A"), ("lora_B", "LoRA B"), ("lora_embedding_A", "LoRA embedding"),
           ("lora_embedding_B", "LoRA embedding"), (DORA_MAGNITUDE, "DoRA magnitude")),
    copies=(ADAPTER_COPIES,),
    bases=(ADAPTER_BASE,),
)

TABLE = FamilyTable(
    heads=HEADS,
    fused_qkv=FUSED_QKV,
    projections=PROJECTIONS,
    latent=LATENT,
    fused_mlp=FUSED_MLP,
    experts=EXPERTS,
    routers=ROUTERS,
    fused_names=FUSED_NAMES,
    transposed=TRANSPOSED,
    qk_norm_classes=QK_NORM_CLASSES,
    adapters=ADAPTERS,
    output_layers=("get_output_embeddings",),
)
"""The table registered with the core."""

register_families(TABLE)

__all__ = [
    "ADAPTERS", "ADAPTER_BASE", "ADAPTER_COPIES", "CLAMPS", "DORA_MAGNITUDE", "EXPERTS", "FUSED_MLP", "FUSED_NAMES",
    "FUSED_QKV", "HEADS", "LATENT", "LORA_A", "OUTPUT_NORMS", "PROJECTIONS", "QK_NORM_CLASSES", "ROUTERS",
    "SELECTION_CHILDREN", "TABLE", "TRANSPOSED",
]
