"""Hugging Face transformers: QK-Clip without editing model code, and the Trainer callback.

Everything muonclip does with transformers lives in the ``hf*`` modules of this package
(``pip install 'muonclip[hf]'``; transformers is imported there, never by ``import muonclip``):

* `muonclip.integrations.hf_attention` — the ``"muonclip"`` attention function: the model's
  attention (SDPA semantics, attention sinks) recording per-head max logits; keywords by an
  allow-list.
* `muonclip.integrations.hf_check` — the one-time check that it computes what the model's own
  attention computes.
* `muonclip.integrations.hf_layouts` — which modules are softmax attention, and each one's
  head layout.
* `muonclip.integrations.hf_callback` — `MuonClipTrainerCallback`, MuonClip's figures in the
  Trainer's logs.
* `muonclip.integrations.hf_trainer` — `trainer_optimizer`: the Trainer's (and TRL's)
  ``optimizer_cls_and_kwargs`` for `muonclip.MuonClip` / `muonclip.Muon`.
* `muonclip.integrations.hf_adapters` — peft adapters on q/k: which tensor QK-Clip scales.
* this module — `attach` / `detach`: finding a model's attention layers and switching the
  model to the function; every public name of the others is importable from here too.

`muonclip.MuonClip` finds a transformers model's attention layers through `attach`
(`muonclip.integrations` registers it with `muonclip.qkclip.discovery`). `attach(model)`:

1. **Finds the softmax-attention layers, per module** (`muonclip.integrations.hf_layouts`):
   modules whose class calls transformers' attention interface. Token mixers without softmax
   attention in a hybrid model (linear attention, KDA, Mamba, convolutions) are skipped, never
   a reason to refuse the model, and listed by `attach_report`. Each attention layer gets its
   head layout (head counts from the module) and a `MaxLogitRecorder` on the module (attribute
   ``muonclip_recorder``; calling `attach` again reuses it).
2. **Registers the attention function** ``"muonclip"`` and its mask function (the SDPA boolean
   mask) with transformers, and gives each layer a `ForwardCheck`: on the layer's first training
   forward the model's previous attention runs on the same inputs and the outputs must agree
   (`muonclip.integrations.hf_check`; ``verify_attention=False`` turns it off).
3. **Switches the model** to it (``model.set_attn_implementation("muonclip")``), and makes a
   packed batch (``DataCollatorWithFlattening``: no attention mask, ``position_ids`` restarting
   per document) attend within its documents: a forward pre-hook asks transformers for the
   document mask by passing ``use_cache=False`` (transformers builds it from ``position_ids``
   only without a cache), and refuses a packed batch given with a cache of its own.

Refused, before any step, with the cause named: a model whose attention does not go through
transformers' attention interface (``_supports_attention_backend`` false: its attention code
would never reach the function), a model with no softmax attention, an attention layer that
normalises q/k after its projections (`muonclip.qkclip.qknorm`) or whose projections have no
known layout, and at the first forward a keyword the function does not implement
(`muonclip.integrations.hf_attention.check_keywords`).

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

Only training forwards are recorded (``module.training`` and grad enabled, the rule of
`muonclip.attention.forward_rule`): ``Trainer.evaluate`` / ``predict`` and ``model.generate()``
never reach the clip, and gradient checkpointing (reentrant or not) counts every micro-batch.
`MuonClip.step` consumes and resets the record; `muonclip.attention.MaxLogitMonitor` reads the
max logits of an evaluation or a generation for logging.

Reference: Kimi K2 (arXiv 2507.20534) section 2.1; transformers' attention interface docs
(https://huggingface.co/docs/transformers/en/attention_interface).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

try:
    from transformers import PreTrainedModel
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "muonclip.integrations.hf needs Hugging Face transformers >= 4.56: pip install 'muonclip[hf]'"
    ) from e

from ..attention.running_max import MaxLogitRecorder
from ..common.dtensor import is_dtensor
from ..qkclip.layouts import AttentionLayer, MLALayout
from ..qkclip.tensor_parallel import record_local_heads
from .hf_attention import (
    ATTN_IMPLEMENTATION,
    CHECK_ATTR,
    KEYWORDS,
    LAYER_ATTR,
    OFF_ONLY,
    RECORDER_ATTR,
    muonclip_attention_forward,
    register,
)
from .hf_callback import MuonClipTrainerCallback
from .hf_check import AttentionMismatchError, ForwardCheck
from .hf_layouts import Layout, attention_modules, layout_of, mixers_without_attention
from .hf_trainer import TrainerArgumentsWarning, trainer_optimizer

PACKING_HOOK_ATTR = "muonclip_packing_hook"
"""Attribute of a switched ``PreTrainedModel`` holding its packed-batch forward pre-hook."""

logger = logging.getLogger("muonclip")


@dataclass
class AttachReport:
    """What `attach` does with a model's layers.

    Attributes:
        attention: names of the softmax-attention layers, each clipped per head.
        skipped: ``(name, class name)`` of the token mixers without softmax attention (linear
            attention, KDA, Mamba, convolutions): nothing to clip, so not attached.
    """

    attention: list[str] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"QK-Clip attaches to {len(self.attention)} softmax-attention layers"]
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} token mixers without softmax attention (no max logit to clip):")
            lines += [f"  {name} ({cls})" for name, cls in self.skipped]
        return "\n".join(lines)


def attach_report(model: nn.Module) -> AttachReport:
    """Which layers of ``model`` `attach` clips and which it skips (see `AttachReport`)."""
    attention = [name for name, _ in attention_modules(model)]
    return AttachReport(attention, mixers_without_attention(model, attention))


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


def _record_tp_heads(name: str, layout: Layout, recorder: MaxLogitRecorder) -> None:
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


def _outermost_pretrained(model: nn.Module) -> list[PreTrainedModel]:
    """Every outermost ``PreTrainedModel`` inside ``model`` (``model`` itself included)."""
    covered: set[int] = set()
    out = []
    for m in model.modules():  # parents come before their children
        if isinstance(m, PreTrainedModel) and id(m) not in covered:
            out.append(m)
            covered.update(id(sub) for sub in m.modules())
    return out


def _refuse_without_attention(model: nn.Module) -> None:
    """No softmax-attention module: say why (attention outside the interface, or none at all)."""
    pretrained = _outermost_pretrained(model)
    own_code = [type(m).__name__ for m in pretrained if not getattr(m, "_supports_attention_backend", True)]
    named = [f"{n} ({type(m).__name__})" for n, m in model.named_modules() if type(m).__name__.endswith("Attention")]
    mixers = mixers_without_attention(model, [])
    if pretrained and mixers and not named:
        raise ValueError(
            f"{type(pretrained[0]).__name__} has no softmax attention: its token mixers "
            f"({', '.join(f'{n} ({c})' for n, c in mixers[:3])}{', ...' if len(mixers) > 3 else ''}) compute no "
            "softmax over q.k, so there is no max logit for QK-Clip to bound. Train it with plain muonclip.Muon."
        )
    if own_code:
        raise ValueError(
            f"{', '.join(own_code)} computes attention in its own code, not through transformers' "
            f"AttentionInterface (the class sets _supports_attention_backend = False), so the '{ATTN_IMPLEMENTATION}' "
            "attention function would never run and no max logit could be recorded"
            + (f"; its attention modules: {', '.join(named[:4])}{', ...' if len(named) > 4 else ''}" if named else "")
            + ". State the layers yourself: MuonClip(model, layers=[AttentionLayer(...)]) with an attention that "
            "calls muonclip.scaled_dot_product_attention(..., recorder=...)."
        )
    raise ValueError(
        f"no attention modules found in {type(model).__name__}: attach() recognises transformers attention "
        "modules that call transformers' attention interface (Llama, Qwen2, Mistral, GPT-OSS, DeepSeek-V3, ...). "
        "For another model pass MuonClip(model, layers=[AttentionLayer(...)])"
    )


def _packed(position_ids: Tensor) -> bool:
    """Whether any row of ``position_ids`` restarts (a packed batch: several documents per row)."""
    return position_ids.ndim >= 1 and position_ids.shape[-1] > 1 and bool((position_ids.diff(dim=-1) != 1).any())


def _packing_pre_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """Forward pre-hook of a switched model: a packed batch without an attention mask attends per document.

    transformers builds the document mask from ``position_ids`` only when no attention mask and no
    cache are given; in training mode ``use_cache`` defaults to the config's (usually True), which
    skips it and lets documents attend to each other. So for a packed batch this asks for
    ``use_cache=False``; a packed batch given with a cache of its own is refused.
    """
    signature = inspect.signature(module.forward)
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return None
    for p in signature.parameters.values():  # keywords the signature collects in **kwargs
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            bound = {**bound, **bound.pop(p.name, {})}
    position_ids = bound.get("position_ids")
    if not isinstance(position_ids, Tensor) or bound.get("attention_mask") is not None or not _packed(position_ids):
        return None
    if bound.get("past_key_values") is not None or bound.get("cache") is not None:
        raise ValueError(
            f"{type(module).__name__}: a packed batch (position_ids restart inside a row) given with a cache: "
            "transformers builds no document mask then, so documents would attend to each other. Pass the packed "
            "batch without past_key_values, or pad it and pass an attention_mask."
        )
    if "use_cache" not in signature.parameters and not any(
        p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
    ):
        return None
    kwargs = dict(kwargs)
    kwargs["use_cache"] = False
    return args, kwargs


def _switch(model: nn.Module) -> None:
    """Switch every outermost PreTrainedModel inside ``model`` to ``"muonclip"`` (it switches its
    sub-models) and give it the packed-batch pre-hook (`_packing_pre_hook`)."""
    for m in _outermost_pretrained(model):
        m.set_attn_implementation(ATTN_IMPLEMENTATION)
        if getattr(m, PACKING_HOOK_ATTR, None) is None:
            setattr(m, PACKING_HOOK_ATTR, m.register_forward_pre_hook(_packing_pre_hook, with_kwargs=True))


def attach(model: nn.Module, *, gqa_policy: str = "per_head", verify_attention: bool = True) -> list[AttentionLayer]:
    """Find a transformers model's softmax-attention layers, make them record max logits, return them.

    Args:
        model: a transformers ``PreTrainedModel`` (e.g. ``LlamaForCausalLM``, ``GptOssForCausalLM``,
            ``DeepseekV3ForCausalLM`` built from a config or loaded), or any module containing one
            (a peft ``PeftModel``: the layers are found through the wrapper, and a DoRA / LoRA /
            ``modules_to_save`` projection gives the rows of `muonclip.integrations.hf_adapters`).
        gqa_policy: `GQALayout` policy for layers with fewer key than query heads: ``"per_head"``
            (default, exact), ``"balanced"`` or ``"group"`` (see `GQALayout`). To use another
            policy with `MuonClip`, pass ``MuonClip(model, layers=attach(model, gqa_policy=...))``.
        verify_attention: check, on each layer's first training forward, that the ``"muonclip"``
            attention function's output equals the model's own attention (the implementation
            the model was set to: ``"sdpa"``, else its eager attention) on the same inputs
            (default True; `muonclip.integrations.hf_check`, which raises
            `AttentionMismatchError`). ``False`` attaches without it:
            ``MuonClip(model, layers=attach(model, verify_attention=False))``.

    Returns:
        One `AttentionLayer` per softmax-attention module, in module order, named by its module
        path (e.g. ``"model.layers.0.self_attn"``), with its head layout (checked against the
        weights) and the recorder that the ``"muonclip"`` attention function fills. Token mixers
        without softmax attention are skipped (`attach_report` lists them; logged at INFO).

    Raises:
        ValueError: a model whose attention does not go through transformers' attention
            interface, or without softmax attention; an attention module that normalises q/k
            after its projections (`muonclip.qkclip.qknorm.check_no_qk_norm`) or without
            projections we know; a weight that does not fit the module's head counts; a model
            whose attention implementation cannot be switched; a tensor-parallel q weight split
            inside a head, or a tensor-parallel fused q projection; with ``verify_attention``, an
            attention module whose modeling file has no eager attention to check against.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach expects a torch.nn.Module (a transformers model), got {type(model).__name__}")
    register()
    found = attention_modules(model)
    if not found:
        _refuse_without_attention(model)
    layers: list[AttentionLayer] = []
    for name, module in found:
        config = getattr(module, "config", None) or getattr(model, "config", None)
        layout = layout_of(name, module, config, gqa_policy)
        recorder = getattr(module, RECORDER_ATTR, None)
        if not isinstance(recorder, MaxLogitRecorder) or recorder.n_heads != layout.n_heads:
            recorder = MaxLogitRecorder(layout.n_heads)
        if not _fsdp_managed(model, name, module):  # FSDP2 shards are gathered whole: every head computed
            _record_tp_heads(name, layout, recorder)
        layer = AttentionLayer(name, layout, recorder)
        layer.check()
        layers.append(layer)
    checks: list[ForwardCheck | None] = []
    for name, module in found:
        previous = getattr(module, CHECK_ATTR, None)
        if previous is not None:
            previous.close()
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if implementation == ATTN_IMPLEMENTATION:  # attached before: check against what it had then
            implementation = getattr(previous, "implementation", None)
        setattr(module, LAYER_ATTR, name)
        checks.append(ForwardCheck(module, implementation) if verify_attention else None)
    for (_, module), layer, check in zip(found, layers, checks):
        setattr(module, RECORDER_ATTR, layer.recorder)  # plain attributes: not submodules, not in state_dict
        setattr(module, CHECK_ATTR, check)
    _switch(model)
    wrong = [
        name for name, module in found
        if getattr(getattr(module, "config", None), "_attn_implementation", ATTN_IMPLEMENTATION) != ATTN_IMPLEMENTATION
    ]
    if wrong:
        raise ValueError(
            f"could not switch attention layers {wrong} to attn_implementation='{ATTN_IMPLEMENTATION}' (their model "
            "does not dispatch through transformers' AttentionInterface), so their max logits would never be recorded"
        )
    report = attach_report(model)
    if report.skipped:
        logger.info("%s", report)
    return layers


def detach(model: nn.Module, attn_implementation: str = "sdpa") -> None:
    """Undo `attach`: remove the recorders, checks and hooks, and switch the model back (default ``"sdpa"``)."""
    for module in model.modules():
        check = getattr(module, CHECK_ATTR, None)
        if check is not None:
            check.close()
        for attr in (RECORDER_ATTR, CHECK_ATTR, LAYER_ATTR):
            if hasattr(module, attr):
                delattr(module, attr)
    for m in _outermost_pretrained(model):
        hook = getattr(m, PACKING_HOOK_ATTR, None)
        if hook is not None:
            hook.remove()
            delattr(m, PACKING_HOOK_ATTR)
        m.set_attn_implementation(attn_implementation)


__all__ = [
    "ATTN_IMPLEMENTATION", "KEYWORDS", "OFF_ONLY", "RECORDER_ATTR", "AttachReport", "AttentionMismatchError",
    "ForwardCheck", "MuonClipTrainerCallback", "TrainerArgumentsWarning", "attach", "attach_report", "detach",
    "muonclip_attention_forward", "register", "trainer_optimizer",
]
