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
* `muonclip.integrations.hf_padding` — the warning for a padded batch given without its mask.
* this module — `attach` / `detach`: finding a model's attention layers and switching the
  model to the function; every public name of the others is importable from here too.

`muonclip.MuonClip` finds a transformers model's attention layers through `attach`
(`muonclip.integrations` registers it with `muonclip.qkclip._discovery`). `attach(model)`:

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
3. **Switches the model** to it (``model.set_attn_implementation("muonclip")``), remembering
   the implementation every (sub-)model had, which `detach` restores. A forward pre-hook on the
   model (`hf_batches.batch_pre_hook`) makes a packed batch (``DataCollatorWithFlattening``: no attention
   mask, ``position_ids`` restarting per document) attend within its documents, by asking
   transformers for the document mask with ``use_cache=False`` (transformers builds it from
   ``position_ids`` only without a cache; a packed batch given with a cache of its own is
   refused), and hands such a batch's real tokens (`real_tokens`) down to the attention
   function, so that padding never feeds the clip (the pair rule of `muonclip.attention.pairs`).

**Which tokens are padding.** With a 2-D ``attention_mask`` (0 = padding, on either side), the
mask transformers builds from it: it hides every padding key, and every other rule it writes lets
a token see itself, so a query is padding exactly when its own key is masked
(`muonclip.integrations.hf_attention.real_queries`; every family, with or without the forward
pre-hook). In padding-free packing, where the batch has no mask (TRL's
``DataCollatorForLanguageModeling(padding_free=True, pad_to_multiple_of=...)``: each trailing pad
gets position id 0, so transformers' document mask makes it a one-token document that sees
itself), a token is padding when it is the pad token (``config.pad_token_id``, which TRL's
``SFTTrainer`` sets to its collator's) *and* a one-token document of its own (its position id
restarts, and so does the next one's): exactly the trailing pads that collator appends
(`real_tokens`, handed down by the forward pre-hook). Not the labels: TRL sets ``-100`` on the
first token of every document and on prompts, which are real tokens. Not the pad id alone:
tokenizers that pad with ``eos`` or ``bos`` use it inside documents. A one-token document made of
the pad token alone is taken for padding (it carries no pair but itself). The keyword reaches the
attention function only where the family's layers pass the model's keywords on (as they must for
flash-attention's packed batches): StableLM and Nemotron at transformers 5.24 do not, so their
padding-free pads are still recorded. A padded batch given *without* its mask (rows of one
length, no restarting positions) has nothing that says which tokens are padding: its pads feed
the clip, and a training forward whose rows end in padding warns once per model
(`muonclip.integrations.hf_padding`).

Refused before any step, with the cause named, by ``attach`` (so by ``MuonClip(model)``), and
before the model is switched: a model whose attention does not go through transformers'
attention interface (``_supports_attention_backend`` false: its attention code would never
reach the function), a model with no softmax attention, an attention layer that normalises q/k
after its projections (`muonclip.qkclip.qknorm`) or whose projections have no known layout, a
keyword its class passes to the function that the function does not implement, and a feature it
does not compute that the module's configuration switches on (logit soft-capping; a sparse key
selection: `muonclip.integrations.hf_attention.check_module_keywords`). A keyword only the
forward reveals is refused there (`muonclip.integrations.hf_attention.check_keywords`).

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

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

try:
    from transformers import PreTrainedModel
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "muonclip.integrations.hf needs Hugging Face transformers >= 4.56: pip install 'muonclip[hf]'"
    ) from e

from ..attention._recorder import MaxLogitRecorder
from ..common._dtensor import is_dtensor
from ..qkclip._layouts import AttentionLayer, Layout, MLALayout
from ..qkclip.tensor_parallel import record_local_heads
from .hf_attention import (
    ATTN_IMPLEMENTATION,
    CHECK_ATTR,
    KEYWORDS,
    LAYER_ATTR,
    OFF_ONLY,
    RECORDER_ATTR,
    TEXT_ATTR,
    check_module_keywords,
    muonclip_attention_forward,
    register,
)
from .hf_batches import batch_pre_hook, real_tokens
from .hf_check import AttentionMismatchError, ForwardCheck
from .hf_layouts import attention_modules, layout_of, mixers_without_attention
from .hf_padding import WARNED_ATTR as PADDING_WARNED_ATTR
from .hf_padding import UnmaskedPaddingWarning
from .hf_trainer import TrainerArgumentsWarning, trainer_optimizer

if TYPE_CHECKING:  # imported on first access (`__getattr__`): it imports transformers' Trainer
    from .hf_callback import MuonClipTrainerCallback

PACKING_HOOK_ATTR = "muonclip_packing_hook"
"""Attribute of a switched ``PreTrainedModel`` holding its forward pre-hook (`hf_batches.batch_pre_hook`)."""

PREVIOUS_ATTR = "muonclip_previous_attn_implementation"
"""Attribute of every ``PreTrainedModel`` `attach` switched: the attention implementation it had
before (``"sdpa"``, ``"eager"``, ...), which `detach` restores."""

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


def _outermost_pretrained(model: nn.Module, modules: Sequence[nn.Module] | None = None,
                          ) -> list[tuple[PreTrainedModel, set[int]]]:
    """Every outermost ``PreTrainedModel`` inside ``model`` (``model`` itself included), each with the
    ids of its modules (``modules``: ``model.modules()``, when the caller has it)."""
    modules = list(model.modules()) if modules is None else modules
    covered: set[int] = set()
    out = []
    for m in modules:  # parents come before their children
        if isinstance(m, PreTrainedModel) and id(m) not in covered:
            ids = {id(sub) for sub in (modules if m is model else m.modules())}
            out.append((m, ids))
            covered |= ids
    return out


def _refuse_without_attention(model: nn.Module) -> None:
    """No softmax-attention module: say why (attention outside the interface, or none at all)."""
    pretrained = [m for m, _ in _outermost_pretrained(model)]
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


def _switch(modules: Sequence[nn.Module], outermost: list[tuple[PreTrainedModel, set[int]]]) -> None:
    """Switch every outermost PreTrainedModel inside the model (``outermost``: its `_outermost_pretrained`)
    to ``"muonclip"`` (it switches its sub-models), after remembering every (sub-)model's implementation
    (`PREVIOUS_ATTR`; ``modules``: ``model.modules()``), and give it the forward pre-hook
    (`muonclip.integrations.hf_batches.batch_pre_hook`)."""
    for m in modules:
        if isinstance(m, PreTrainedModel) and not hasattr(m, PREVIOUS_ATTR):
            setattr(m, PREVIOUS_ATTR, m.config._attn_implementation)
    for m, _ in outermost:
        m.set_attn_implementation(ATTN_IMPLEMENTATION)
        if getattr(m, PACKING_HOOK_ATTR, None) is None:
            setattr(m, PACKING_HOOK_ATTR, m.register_forward_pre_hook(batch_pre_hook, with_kwargs=True))


_CROSS = ("cross", "encoder_attn", "encdec")
"""Name parts of cross-attention modules (Bart's ``encoder_attn``, Bert's ``crossattention``,
Mllama's ``MllamaTextCrossAttention``, T5's ``EncDecAttention``): their queries and keys are two
sequences."""


def _text_layer(outermost: list[tuple[PreTrainedModel, set[int]]], name: str, module: nn.Module) -> bool:
    """Whether an attention module is a self-attention over the model's tokens: not a
    cross-attention (`_CROSS`, or ``is_cross_attention``), and its config is the text config of
    the outermost model containing it (the model's own config for a text-only model).
    ``outermost``: the model's `_outermost_pretrained`, each with the ids of its modules (walked
    once per `attach`, not once per layer)."""
    labels = (name.rsplit(".", 1)[-1].lower(), type(module).__name__.lower())
    if getattr(module, "is_cross_attention", False) or any(c in lab for c in _CROSS for lab in labels):
        return False
    own = getattr(module, "config", None)
    for m, ids in outermost:
        if id(module) in ids:
            config = m.config
            text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
            return own is None or own is text or own is config or (text is config and own == config)
    return False


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
            attention module whose modeling file has no eager attention to check against; a
            keyword or a configured feature the ``"muonclip"`` function does not compute
            (`muonclip.integrations.hf_attention.check_module_keywords`: logit soft-capping,
            a sparse key selection, ...). Every refusal comes before the model is switched.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach expects a torch.nn.Module (a transformers model), got {type(model).__name__}")
    register()
    named = list(model.named_modules())  # the one walk of the tree
    modules = [m for _, m in named]
    found = attention_modules(model, named=named)
    if not found:
        _refuse_without_attention(model)
    layers: list[AttentionLayer] = []
    for name, module in found:
        config = getattr(module, "config", None) or getattr(model, "config", None)
        layout = layout_of(name, module, config, gqa_policy)
        check_module_keywords(module, name)
        recorder = getattr(module, RECORDER_ATTR, None)
        if not isinstance(recorder, MaxLogitRecorder) or recorder.n_heads != layout.n_heads:
            recorder = MaxLogitRecorder(layout.n_heads)
        if not _fsdp_managed(model, name, module):  # FSDP2 shards are gathered whole: every head computed
            _record_tp_heads(name, layout, recorder)
        layer = AttentionLayer(name, layout, recorder)
        layer.check()
        layers.append(layer)
    checks: list[ForwardCheck | None] = []
    outermost = _outermost_pretrained(model, modules)
    for name, module in found:
        previous = getattr(module, CHECK_ATTR, None)
        if previous is not None:
            previous.close()
        implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
        if implementation == ATTN_IMPLEMENTATION:  # attached before: check against what it had then
            implementation = getattr(previous, "implementation", None)
        setattr(module, LAYER_ATTR, name)
        setattr(module, TEXT_ATTR, _text_layer(outermost, name, module))
        checks.append(ForwardCheck(module, implementation) if verify_attention else None)
    for (_, module), layer, check in zip(found, layers, checks):
        setattr(module, RECORDER_ATTR, layer.recorder)  # plain attributes: not submodules, not in state_dict
        setattr(module, CHECK_ATTR, check)
    _switch(modules, outermost)
    wrong = [
        name for name, module in found
        if getattr(getattr(module, "config", None), "_attn_implementation", ATTN_IMPLEMENTATION) != ATTN_IMPLEMENTATION
    ]
    if wrong:
        raise ValueError(
            f"could not switch attention layers {wrong} to attn_implementation='{ATTN_IMPLEMENTATION}' (their model "
            "does not dispatch through transformers' AttentionInterface), so their max logits would never be recorded"
        )
    attention = [name for name, _ in found]
    report = AttachReport(attention, mixers_without_attention(model, attention, named=named))
    if report.skipped:
        logger.info("%s", report)
    return layers


def detach(model: nn.Module, attn_implementation: str | None = None) -> None:
    """Undo `attach`: switch the model back, then remove the recorders, checks and hooks.

    Args:
        model: a model `attach` (or ``MuonClip(model)``) attached.
        attn_implementation: the implementation to switch to (default None: the one every
            (sub-)model had before attaching, e.g. ``"eager"`` for Gemma 2 or GPT-OSS, ``"sdpa"``
            for Llama).

    Raises:
        ValueError: the model cannot be switched to ``attn_implementation`` (transformers'
            message, and what to pass); the model is then left attached as it was, never half
            detached.
    """
    switched = [m for m in model.modules()
                if isinstance(m, PreTrainedModel) and m.config._attn_implementation == ATTN_IMPLEMENTATION]
    targets = {id(m): attn_implementation or getattr(m, PREVIOUS_ATTR, None) or "sdpa" for m in switched}
    try:
        for m in switched:  # parents first: a parent switches its sub-models, which then get their own
            if m.config._attn_implementation != targets[id(m)]:
                m.set_attn_implementation(targets[id(m)])
    except (ValueError, ImportError) as e:
        for m in switched:
            m.set_attn_implementation(ATTN_IMPLEMENTATION)
        raise ValueError(
            f"detach: {type(model).__name__} cannot be switched to attn_implementation="
            f"{attn_implementation or targets[id(switched[0])]!r} ({e}); it is left attached. Call "
            "detach(model) without attn_implementation to restore the implementation it had before attaching."
        ) from e
    for module in model.modules():
        check = getattr(module, CHECK_ATTR, None)
        if check is not None:
            check.close()
        for attr in (RECORDER_ATTR, CHECK_ATTR, LAYER_ATTR, TEXT_ATTR, PADDING_WARNED_ATTR):
            if hasattr(module, attr):
                delattr(module, attr)
    for m in model.modules():
        if not isinstance(m, PreTrainedModel):
            continue
        hook = getattr(m, PACKING_HOOK_ATTR, None)
        if hook is not None:
            hook.remove()
            delattr(m, PACKING_HOOK_ATTR)
        if hasattr(m, PREVIOUS_ATTR):
            delattr(m, PREVIOUS_ATTR)


def __getattr__(name: str) -> Any:
    """`MuonClipTrainerCallback`, imported on first access: its module imports transformers' Trainer
    machinery (``transformers.trainer``, seconds to import), which `attach` (so ``MuonClip(model)``)
    does not need."""
    if name == "MuonClipTrainerCallback":
        from .hf_callback import MuonClipTrainerCallback

        return MuonClipTrainerCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ATTN_IMPLEMENTATION", "KEYWORDS", "OFF_ONLY", "RECORDER_ATTR", "AttachReport", "AttentionMismatchError",
    "ForwardCheck", "MuonClipTrainerCallback", "TrainerArgumentsWarning", "UnmaskedPaddingWarning", "attach",
    "attach_report", "detach",
    "muonclip_attention_forward", "real_tokens", "register", "trainer_optimizer",
]
