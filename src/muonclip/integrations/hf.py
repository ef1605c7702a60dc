"""Hugging Face transformers: QK-Clip without editing model code, and the Trainer callback.

Everything muonclip does with transformers is in this module (``pip install 'muonclip[hf]'``;
transformers is imported here, never by ``import muonclip``). `muonclip.MuonClip` finds a
transformers model's attention layers through `attach` (`muonclip.integrations` registers it
with `muonclip.qkclip.discovery`), and `MuonClipTrainerCallback` puts MuonClip's figures in the
Trainer's logs.

`attach(model)` does three things:

1. **Registers an attention function** named ``"muonclip"`` with transformers'
   ``AttentionInterface`` (`muonclip_attention_forward`). Every attention module of a
   transformers 5.x model calls ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module,
   query, key, value, attention_mask, dropout=..., scaling=..., **kwargs)`` with the queries
   after RoPE and the keys before GQA repetition. Ours does what transformers' own
   ``sdpa_attention_forward`` does, through `muonclip.scaled_dot_product_attention`, which also
   folds the call's per-head max logit into the recorder stored on the module.
2. **Registers the matching mask** under the same name with ``AttentionMaskInterface`` (the
   SDPA boolean mask, ``transformers.masking_utils.sdpa_mask``). Without it, transformers
   builds *no mask at all* for an unknown implementation name, and padded batches silently
   attend to padding.
3. **Switches the model** to it (``model.set_attn_implementation("muonclip")``) and returns one
   `AttentionLayer` per attention module, with its head layout:

   * Llama / Mistral / Qwen2 style (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``): `MHALayout`
     when ``num_key_value_heads == num_attention_heads``, else `GQALayout` (exact per-head
     policy by default); q/k biases (Qwen2) are part of the layout.
   * Fused projections, as `Rows` ranges of one weight: Phi-3 style ``qkv_proj`` (rows
     ``[q | k | v]``, MHA or GQA) and GPT-2's ``c_attn`` (a ``Conv1D`` stored ``(in, out)`` with
     columns ``[q | k | v]``; a cross-attention layer's queries come from ``q_attn`` and its
     ``c_attn`` holds ``[k | v]``). Biases are part of the layout.
   * GPT-NeoX / Pythia (``GPTNeoXAttention``): ``query_key_value`` interleaves q, k and v per
     head (rows ``[h0: q k v | h1: q k v | ...]``), so q and k are `StridedRows` of it (and of
     its bias) in an `MHALayout`.
   * DeepSeek-V3 MLA (``kv_b_proj``): `MLALayout` on ``q_b_proj`` (or ``q_proj`` when
     ``q_lora_rank`` is None; rows ``[nope | rope]`` per head) and ``kv_b_proj`` (rows
     ``[k_nope | v]`` per head). The shared rotary key (last ``qk_rope_head_dim`` rows of
     ``kv_a_proj_with_mqa``) and V are never touched.
   * A normalisation of q/k after the projection (QK-norm of Qwen3, Gemma 3, OLMo 2; Llama 4's
     L2 ``qk_norm``; Phi's ``qk_layernorm``; ...): a ValueError — scaling W_q/W_k does not change
     normalised q/k, so it cannot bound the logits. Found by type and by name among the
     attention module's children, not by name alone (`muonclip.qkclip.qknorm`); MLA's
     ``q_a_layernorm`` / ``kv_a_layernorm`` feed the scaled projections and are allowed.

**Tensor parallelism.** A model loaded with transformers' own TP plan
(``from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto"))`` under
``torchrun``; gloo on CPU works too) has column-parallel q/k/v projections: DTensor weights
``Shard(0)`` on the tensor-parallel mesh, each rank's attention computing a contiguous range of
heads. `attach` reads that range from the q weight and tells the layer's recorder
(`muonclip.qkclip.tensor_parallel.record_local_heads`), so `MuonClip` reduces and clips per
global head; a tensor-parallel *fused* q projection is refused (ValueError). Weights managed by
FSDP2 (``fully_shard``: gathered whole for the forward, every head computed) are left alone, so
FSDP2 *on top of* tensor parallelism is not covered here: its first training forward stops with
the recorder's shape error (not a silent wrong clip).

The recorder of each layer lives on its attention module (attribute ``muonclip_recorder``), so
the attention function finds it from ``module`` alone; calling `attach` again reuses it.
Only training forwards are recorded (``module.training`` and grad enabled, the rule of
`muonclip.attention.recording`): ``Trainer.evaluate`` / ``predict`` and ``model.generate()``
never reach the clip, and gradient checkpointing (reentrant or not) counts every micro-batch.
`MuonClip.step` consumes and resets the record; `muonclip.attention.MaxLogitMonitor` reads the
max logits of an evaluation or a generation for logging.

**The Trainer callback.** ``Trainer(..., optimizers=(MuonClip(model, ...), scheduler))`` works
without it: the Trainer calls ``optimizer.step()`` once per optimizer step, after every
micro-batch of gradient accumulation has run its forward pass, so the clip sees the max logits
of all of them (``scheduler=None`` lets the Trainer build its usual schedule on top of our
optimizer). `MuonClipTrainerCallback` adds, on every training log (every ``logging_steps``),
the figures of `muonclip.integrations.stats` with the prefix ``"muonclip/"``: ``max_logit``,
``clipped_heads``, ``clipped_fraction`` and ``update_rms`` of the last optimizer step, and
``max_logit_peak`` since the previous log; per layer with ``per_layer=True``. They land in
``trainer.state.log_history`` and in every reporting integration (TensorBoard, W&B, ...,
``report_to``) that runs after the callback — which is why `MuonClipTrainerCallback.install`
puts it first: the Trainer calls its callbacks in order and the reporting ones come before
those passed as ``callbacks=[...]``. Passed that way, the figures still reach ``log_history``
and the console. Use::

    from muonclip import MuonClip
    from muonclip.integrations.hf import MuonClipTrainerCallback

    opt = MuonClip(model, lr=1e-3, tau=100.0)        # also switches the model to the "muonclip" attention
    trainer = Trainer(model, args, train_dataset=ds, optimizers=(opt, None))
    MuonClipTrainerCallback().install(trainer)        # ahead of the reporting callbacks
    trainer.train()

Evaluation (``eval_strategy``, ``Trainer.evaluate`` / ``predict``) and ``model.generate()``
never count in a clip, with or without the callback: they run under ``torch.no_grad()``, and
only training forwards feed the clip (`muonclip.attention.recording`). To log an evaluation's
max logits, run it inside a `muonclip.attention.MaxLogitMonitor`.

Reference: Kimi K2 (arXiv 2507.20534) section 2.1; transformers' attention interface docs
(https://huggingface.co/docs/transformers/en/attention_interface).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

try:
    from transformers import (
        AttentionInterface,
        PreTrainedModel,
        Trainer,
        TrainerCallback,
        TrainerControl,
        TrainerState,
        TrainingArguments,
    )
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "muonclip.integrations.hf needs Hugging Face transformers >= 4.56: pip install 'muonclip[hf]'"
    ) from e

from ..attention.recorder import MaxLogitRecorder
from ..attention.sdpa import scaled_dot_product_attention
from ..common.dtensor import is_dtensor
from ..qkclip.layouts import AttentionLayer, GQALayout, MHALayout, MLALayout, Rows, StridedRows
from ..qkclip.qknorm import check_no_qk_norm
from ..qkclip.tensor_parallel import record_local_heads
from .stats import StepMetrics

ATTN_IMPLEMENTATION = "muonclip"
"""The name our attention function and mask are registered under."""

RECORDER_ATTR = "muonclip_recorder"
"""Attribute of an attention module holding its `MaxLogitRecorder`."""

PER_HEAD_QKV_CLASSES = ("GPTNeoXAttention",)
"""Attention classes whose ``query_key_value`` holds ``[q k v]`` per head, heads one after another."""


# ----------------------------------------------------------------------------------------------
# the attention function
# ----------------------------------------------------------------------------------------------


def muonclip_attention_forward(
    module: nn.Module,
    query: Tensor,  # (B, nh, Tq, hs) after RoPE
    key: Tensor,  # (B, nkv, Tk, hs) before GQA repetition
    value: Tensor,  # (B, nkv, Tk, hv)
    attention_mask: Tensor | None,  # (B, 1, Tq, Tk) bool (True = attend) or additive float, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers attention function: SDPA attention that records per-head max logits.

    Same semantics as transformers' ``sdpa_attention_forward``: ``is_causal`` (default: the
    module's ``is_causal``, else True) is used only when there is no mask and more than one
    query, and then keys are cropped to the query length (prefill into an empty static
    cache); GQA by ``enable_gqa`` without a mask, by repeating key/value heads with one. The
    output is ``(B, Tq, nh, hv)`` and no attention weights.

    Args:
        module: the calling attention module; its ``muonclip_recorder`` (set by `attach`)
            receives, on a training forward (``module.training`` and grad enabled), the
            per-head max of ``scaling * q.k`` over the pairs the mask allows. A module without
            one is computed without recording. With `MuonClip` (which sets the recorders'
            threshold to its tau), heads that provably stay at or below tau may be recorded as
            an upper bound from the kernel's log-sum-exp instead (`muonclip.attention.gate`):
            the clip's decisions and gammas are those of the exact maxima.
        query, key, value: as annotated above.
        attention_mask: the mask built by the registered mask function (or passed by the user).
        dropout: attention dropout probability (0.0 default; transformers passes 0 in eval).
        scaling: softmax scale (None: 1/sqrt(hs)).
        is_causal: see above (None default).
        **kwargs: transformers' extra arguments; ``softcap``, ``position_bias``, a paged
            ``cache`` and ``output_attentions=True`` are not supported (ValueError).
    """
    if kwargs.get("softcap") is not None:
        raise ValueError(
            "muonclip attention does not support logit soft-capping (`softcap`): QK-Clip bounds the raw logits "
            "that soft-capping hides; use a model config without attn_logit_softcapping"
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            "muonclip attention does not support an additive `position_bias`: clipping W_q/W_k cannot bound a "
            "learned bias; QK-Clip applies to RoPE-style models (Llama, Qwen2, DeepSeek-V3)"
        )
    if kwargs.get("cache") is not None:
        raise ValueError(
            "muonclip attention does not support paged caches (continuous batching); for generation switch back "
            "with model.set_attn_implementation('sdpa')"
        )
    if kwargs.get("output_attentions", False):
        raise ValueError("muonclip attention returns no attention weights; use attn_implementation='eager' for them")

    recorder = getattr(module, RECORDER_ATTR, None)
    n_heads, q_len = query.shape[1], query.shape[2]
    enable_gqa = False
    if key.shape[1] != n_heads:
        if n_heads % key.shape[1]:
            raise ValueError(f"{n_heads} query heads cannot share {key.shape[1]} key heads (not a divisor)")
        if attention_mask is None:
            enable_gqa = True
        else:
            rep = n_heads // key.shape[1]
            key = key.repeat_interleave(rep, dim=1)  # (B, nh, Tk, hs)
            value = value.repeat_interleave(rep, dim=1)  # (B, nh, Tk, hv)

    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = bool(q_len > 1 and attention_mask is None and is_causal)
    if is_causal and key.shape[2] > q_len:
        key, value = key[:, :, :q_len], value[:, :, :q_len]

    out = scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=enable_gqa,
        recorder=recorder,
        training=module.training,
    )  # (B, nh, Tq, hv)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register the ``"muonclip"`` attention function and its SDPA mask with transformers (idempotent)."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, muonclip_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


# ----------------------------------------------------------------------------------------------
# finding attention modules and their head layouts
# ----------------------------------------------------------------------------------------------


def _is_attention(module: nn.Module) -> bool:
    """An attention module of a transformers model: calls the attention interface with ``layer_idx``."""
    if not hasattr(module, "layer_idx"):
        return False
    names = set(dict(module.named_children()))
    return (
        ("q_proj" in names and "k_proj" in names) or bool(names & {"kv_b_proj", "qkv_proj", "c_attn"})
        or type(module).__name__.endswith("Attention")
    )


def _linear(module: nn.Module, attr: str, name: str) -> nn.Linear:
    lin = getattr(module, attr, None)
    if not isinstance(getattr(lin, "weight", None), Tensor):
        raise ValueError(f"attention layer '{name}': expected a projection '{attr}' with a weight, found {lin!r}")
    return lin


def _mla_layout(name: str, module: nn.Module) -> MLALayout:
    n_heads = int(getattr(module, "num_heads", None) or module.config.num_attention_heads)
    q = _linear(module, "q_b_proj" if getattr(module, "q_b_proj", None) is not None else "q_proj", name)
    kv_b = _linear(module, "kv_b_proj", name)
    return MLALayout(
        q_weight=q.weight,
        n_heads=n_heads,
        qk_nope_head_dim=int(module.qk_nope_head_dim),
        qk_rope_head_dim=int(module.qk_rope_head_dim),
        kv_b_weight=kv_b.weight,
        v_head_dim=int(module.v_head_dim),
        q_bias=q.bias,
        kv_b_bias=kv_b.bias,
    )


def _heads(module: nn.Module, config: Any) -> tuple[int, int, int]:
    """(query heads, key heads, head dim) of an attention module, from the module or its config."""
    n_heads = int(getattr(module, "num_heads", None) or config.num_attention_heads)
    n_kv = int(getattr(module, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None) or n_heads)
    head_dim = getattr(module, "head_dim", None) or getattr(config, "head_dim", None)
    return n_heads, n_kv, int(head_dim or config.hidden_size // n_heads)


def _make_layout(q_w, k_w, q_b, k_b, n_heads: int, n_kv: int, head_dim: int, gqa_policy: str) -> MHALayout | GQALayout:
    if n_kv == n_heads:
        return MHALayout(q_w, k_w, n_heads, head_dim, q_bias=q_b, k_bias=k_b)
    return GQALayout(q_w, k_w, n_heads, n_kv, head_dim, q_bias=q_b, k_bias=k_b, policy=gqa_policy)


def _qkv_layout(name: str, module: nn.Module, config: Any, gqa_policy: str) -> MHALayout | GQALayout:
    q, k = _linear(module, "q_proj", name), _linear(module, "k_proj", name)
    n_heads, n_kv, head_dim = _heads(module, config)
    return _make_layout(q.weight, k.weight, q.bias, k.bias, n_heads, n_kv, head_dim, gqa_policy)


def _rows(t: Tensor | None, start: int, stop: int, transposed: bool = False) -> Rows | None:
    return None if t is None else Rows(t, start, stop, transposed=transposed and t.ndim == 2)


def _fused_layout(name: str, module: nn.Module, config: Any, gqa_policy: str) -> MHALayout | GQALayout:
    """Phi-3 ``qkv_proj`` (rows ``[q | k | v]``) or GPT-2 ``c_attn`` (Conv1D, columns ``[q | k | v]``)."""
    n_heads, n_kv, head_dim = _heads(module, config)
    nq, nk = n_heads * head_dim, n_kv * head_dim
    if getattr(module, "qkv_proj", None) is not None:
        f = _linear(module, "qkv_proj", name)
        q_w, q_b = _rows(f.weight, 0, nq), _rows(f.bias, 0, nq)
        k_w, k_b = _rows(f.weight, nq, nq + nk), _rows(f.bias, nq, nq + nk)
    else:
        f = _linear(module, "c_attn", name)
        transposed = type(f).__name__ == "Conv1D"  # GPT-2's Conv1D stores (in, out); a Linear (out, in)
        if getattr(module, "is_cross_attention", False):  # queries from q_attn, c_attn = [k | v]
            q = _linear(module, "q_attn", name)
            q_w, q_b = _rows(q.weight, 0, nq, transposed), _rows(q.bias, 0, nq)
            k_w, k_b = _rows(f.weight, 0, nk, transposed), _rows(f.bias, 0, nk)
        else:
            q_w, q_b = _rows(f.weight, 0, nq, transposed), _rows(f.bias, 0, nq)
            k_w, k_b = _rows(f.weight, nq, nq + nk, transposed), _rows(f.bias, nq, nq + nk)
    return _make_layout(q_w, k_w, q_b, k_b, n_heads, n_kv, head_dim, gqa_policy)


def _per_head_qkv_layout(name: str, module: nn.Module, config: Any) -> MHALayout:
    """GPT-NeoX ``query_key_value``: rows ``[h*3d, h*3d+d)`` are head h's q, the next ``d`` its k."""
    f = _linear(module, "query_key_value", name)
    n_heads = int(config.num_attention_heads)
    d = int(getattr(module, "head_size", None) or config.hidden_size // n_heads)

    def blocks(t: Tensor | None, start: int) -> StridedRows | None:
        return None if t is None else StridedRows(t, start, d, 3 * d, n_heads)

    return MHALayout(blocks(f.weight, 0), blocks(f.weight, d), n_heads, d, q_bias=blocks(f.bias, 0),
                     k_bias=blocks(f.bias, d))


def _layout(name: str, module: nn.Module, config: Any, gqa_policy: str) -> MHALayout | GQALayout | MLALayout:
    children = dict(module.named_children())
    # MLA: the latent norms normalise the inputs of q_b_proj / kv_b_proj, which the clip scales
    mla = "kv_b_proj" in children
    inputs = [children[a] for a in ("q_a_layernorm", "kv_a_layernorm") if mla and a in children]
    check_no_qk_norm(name, module, inputs)
    if mla:
        return _mla_layout(name, module)
    if type(module).__name__ in PER_HEAD_QKV_CLASSES and "query_key_value" in children:
        return _per_head_qkv_layout(name, module, config)
    if "q_proj" in children and "k_proj" in children:
        return _qkv_layout(name, module, config, gqa_policy)
    if "qkv_proj" in children or "c_attn" in children:
        return _fused_layout(name, module, config, gqa_policy)
    raise ValueError(
        f"attention layer '{name}' ({type(module).__name__}) has no q_proj/k_proj, fused qkv_proj/c_attn, GPT-NeoX "
        "query_key_value or MLA kv_b_proj that muonclip knows how to clip. Name its q/k weights and head layout "
        "yourself: MuonClip(model, layers=[AttentionLayer(name, GQALayout(...), recorder)]), using "
        "muonclip.qkclip.Rows / StridedRows for the rows of a fused weight"
    )


def _fsdp_managed(model: nn.Module, name: str, module: nn.Module) -> bool:
    """Whether FSDP2 (``fully_shard``) manages the attention module ``name``'s weights: it or an ancestor,
    or one of its submodules, is an ``FSDPModule`` (FSDP2 gathers them whole for the forward)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    parts = name.split(".") if name else []
    ancestors = [model] + [model.get_submodule(".".join(parts[:i])) for i in range(1, len(parts))]
    return any(isinstance(m, FSDPModule) for m in (*ancestors, *module.modules()))


def _record_tp_heads(name: str, layout: MHALayout | GQALayout | MLALayout, recorder: MaxLogitRecorder) -> None:
    """Tell ``recorder`` which heads this rank computes when transformers' TP plan split the q projection.

    A model loaded with ``from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto"))``
    has its q/k/v projections column-parallel (``"colwise"``: DTensor weights ``Shard(0)`` on the
    tensor-parallel mesh), so its attention calls see this rank's heads only; the recorder keeps
    them at their global positions (`muonclip.qkclip.tensor_parallel.record_local_heads`).
    Called only for weights FSDP2 does not manage (`attach`).
    """
    q = layout.q_weight
    if not is_dtensor(q if isinstance(q, Tensor) else q.tensor):
        return
    if not isinstance(q, Tensor):
        raise ValueError(
            f"attention layer '{name}': its fused q projection is a tensor-parallel DTensor; muonclip reads the heads "
            "a rank computes from a separate column-parallel q projection (q_proj / q_b_proj) only"
        )
    rows = layout.qk_nope_head_dim + layout.qk_rope_head_dim if isinstance(layout, MLALayout) else layout.head_dim
    record_local_heads(recorder, q, rows)


def _set_implementation(model: nn.Module) -> None:
    """Switch every outermost PreTrainedModel inside ``model`` (``model`` itself included) to ours."""
    covered: set[int] = set()
    for m in model.modules():  # parents come before their children
        if isinstance(m, PreTrainedModel) and id(m) not in covered:
            m.set_attn_implementation(ATTN_IMPLEMENTATION)  # also switches its sub-models
            covered.update(id(sub) for sub in m.modules())


def attach(model: nn.Module, *, gqa_policy: str = "per_head") -> list[AttentionLayer]:
    """Find a transformers model's attention layers, make them record max logits, return them.

    Args:
        model: a transformers ``PreTrainedModel`` (e.g. ``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
            ``DeepseekV3ForCausalLM`` built from a config or loaded), or any module containing one.
        gqa_policy: `GQALayout` policy for layers with fewer key than query heads: ``"per_head"``
            (default, exact), ``"balanced"`` or ``"group"`` (see `GQALayout`). To use another
            policy with `MuonClip`, pass ``MuonClip(model, layers=attach(model, gqa_policy=...))``.

    Returns:
        One `AttentionLayer` per attention module, in module order, named by its module path
        (e.g. ``"model.layers.0.self_attn"``), with its head layout (checked against the
        weights) and the recorder that the ``"muonclip"`` attention function fills.

    Raises:
        ValueError: no attention module found; an attention module that normalises q/k after
            its projections (`muonclip.qkclip.qknorm.check_no_qk_norm`) or without projections
            we know; a weight that does not fit the head counts in the config; a model whose
            attention implementation cannot be switched; a tensor-parallel q weight split inside a
            head, or a tensor-parallel fused q projection.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach expects a torch.nn.Module (a transformers model), got {type(model).__name__}")
    register()
    layers: list[AttentionLayer] = []
    modules: list[nn.Module] = []
    for name, module in model.named_modules():
        if not _is_attention(module):
            continue
        config = getattr(module, "config", None) or getattr(model, "config", None)
        layout = _layout(name, module, config, gqa_policy)
        recorder = getattr(module, RECORDER_ATTR, None)
        if not isinstance(recorder, MaxLogitRecorder) or recorder.n_heads != layout.n_heads:
            recorder = MaxLogitRecorder(layout.n_heads)
        if not _fsdp_managed(model, name, module):  # FSDP2 shards are gathered whole: every head computed
            _record_tp_heads(name, layout, recorder)
        layer = AttentionLayer(name, layout, recorder)
        layer.check()
        layers.append(layer)
        modules.append(module)
    if not layers:
        raise ValueError(
            f"no attention modules found in {type(model).__name__}: attach() recognises transformers attention "
            "modules with q_proj/k_proj (Llama, Qwen2, Mistral, ...), qkv_proj (Phi-3), c_attn (GPT-2), "
            "query_key_value (GPT-NeoX) or kv_b_proj (DeepSeek-V3 MLA). For another "
            "model pass MuonClip(model, layers=[AttentionLayer(...)])"
        )
    for module, layer in zip(modules, layers):
        setattr(module, RECORDER_ATTR, layer.recorder)  # plain attribute: not a submodule, not in state_dict
    _set_implementation(model)
    wrong = [
        layer.name
        for module, layer in zip(modules, layers)
        if getattr(getattr(module, "config", None), "_attn_implementation", ATTN_IMPLEMENTATION) != ATTN_IMPLEMENTATION
    ]
    if wrong:
        raise ValueError(
            f"could not switch attention layers {wrong} to attn_implementation='{ATTN_IMPLEMENTATION}' (their model "
            "does not dispatch through transformers' AttentionInterface), so their max logits would never be recorded"
        )
    return layers


def detach(model: nn.Module, attn_implementation: str = "sdpa") -> None:
    """Undo `attach`: remove the recorders and switch the model back (default ``"sdpa"``)."""
    for module in model.modules():
        if hasattr(module, RECORDER_ATTR):
            delattr(module, RECORDER_ATTR)
    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            m.set_attn_implementation(attn_implementation)
            break


# ----------------------------------------------------------------------------------------------
# the Trainer callback
# ----------------------------------------------------------------------------------------------


_NOT_TRAINING_LOGS = ("eval_", "test_", "train_runtime")


class MuonClipTrainerCallback(TrainerCallback):
    """Logs MuonClip's max logits, clipped-head counts and update RMS to the Trainer's loggers.

    Args:
        update_rms: measure the update RMS (default True; keeps one copy of the hidden
            matrices during each optimizer step).
        per_layer: also log ``max_logit/<layer>`` and ``clipped_heads/<layer>`` (default False).
        prefix: key prefix (default ``"muonclip/"``).

    Attributes:
        metrics: the `StepMetrics` tracker; ``metrics.last`` holds the last step's figures.
    """

    def __init__(self, *, update_rms: bool = True, per_layer: bool = False, prefix: str = "muonclip/") -> None:
        self.metrics = StepMetrics(update_rms=update_rms, per_layer=per_layer, prefix=prefix)

    def install(self, trainer: Trainer) -> MuonClipTrainerCallback:
        """Put this callback first in ``trainer``'s callbacks (so every reporter sees its figures); returns it."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.metrics.before_step(kwargs.get("optimizer"))

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.metrics.after_step()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is None or any(k.startswith(_NOT_TRAINING_LOGS) for k in logs):
            return
        figures = self.metrics.pop_interval()
        if not figures:
            return
        logs.update(figures)
        # Trainer.log appended a copy of ``logs`` to the history just before calling us.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)


__all__ = [
    "ATTN_IMPLEMENTATION", "RECORDER_ATTR", "MuonClipTrainerCallback", "attach", "detach", "muonclip_attention_forward",
    "register",
]
