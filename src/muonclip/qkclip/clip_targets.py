"""What QK-Clip may write: the rule, checked once for every tensor a layout scales.

The clip rescales rows of q/k weights in place after each optimizer step
(`muonclip.qkclip._layouts`). A tensor it writes must be one the optimizer trains:

* **trainable** — ``requires_grad`` True. A frozen tensor is frozen on purpose (the base weight
  under a LoRA adapter, a layer kept fixed), and a change to it is lost on saving whatever
  saves only the trained tensors (peft's ``save_pretrained`` saves the adapter only);
* **plain floating point** — a ``torch.Tensor`` / ``nn.Parameter`` (or a DTensor) of a float
  dtype of 16 bits or more. A quantized or packed weight (bitsandbytes' ``Params4bit`` /
  ``Int8Params``, integer or 8-bit float storage, any other tensor subclass) cannot be scaled row
  by row in place: the multiplication would corrupt the packing or fail;
* **in one of the optimizer's param groups** — otherwise nothing keeps it in step with training.

`check_clip_targets` applies the rule to every layer before any step: `muonclip.MuonClip`
calls it at construction, so a model whose clip would break the rule is refused with the
weight named and the alternatives listed, never silently left unclipped. The rule holds for
every layout (MHA, GQA, MLA, fused `Rows` / `StridedRows`, biases, DoRA `Magnitudes`): it
looks at the tensors a layout's ``params()`` returns, which are exactly the tensors its
``clip`` writes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from torch import Tensor, nn

from ..common._dtensor import is_dtensor
from ..common.family_readers import under_adapter_base
from ._layouts import AttentionLayer


def refusal(t: Tensor, trainable: set[int]) -> str | None:
    """Why QK-Clip may not write ``t`` (see the module doc), or None when it may.

    Args:
        t: a tensor a layout scales.
        trainable: ``id`` of every parameter in the optimizer's param groups.
    """
    if not is_dtensor(t) and type(t) not in (Tensor, nn.Parameter):
        return (f"a {type(t).__name__} (a tensor subclass: quantized or packed storage cannot be scaled row by row "
                "in place)")
    if not t.dtype.is_floating_point or t.dtype.itemsize < 2:
        return f"stored as {t.dtype} (quantized: a row scale in place would corrupt it)"
    if not t.requires_grad:
        return "frozen (requires_grad=False)"
    if id(t) not in trainable:
        return "in none of the optimizer's param groups"
    return None


def _role(layout: object, t: Tensor) -> str:
    """The layout field holding ``t`` (``q_weight``, ``k_bias``, ...), for messages."""
    if dataclasses.is_dataclass(layout):
        for f in dataclasses.fields(layout):
            v = getattr(layout, f.name)
            if v is t or getattr(v, "tensor", None) is t:
                return f.name
    return "a weight"


def _advice(name: str) -> str:
    if under_adapter_base(name):  # the weight an additive adapter (LoRA, LoHa, LoKr, ...) wraps
        return (
            " It is the frozen base weight W0 under an additive adapter (LoRA: W = W0 + s*B*A). Scaling row r of W "
            "by c needs c*W0[r], and B and A cannot produce it: scaling row r of B scales s*B[r]A only, and no "
            "change of A alone scales a single row. So plain LoRA on a projection the clip scales has no exact "
            "clip. Alternatives: DoRA (LoraConfig(use_dora=True): the clip scales the rows of the adapter's "
            "magnitude vector, exact and saved with the adapter); LoRA only on v/o/MLP with q/k trained in full "
            "(modules_to_save=['q_proj', 'k_proj']); full fine-tuning; or muonclip.Muon (no clip)."
        )
    return (
        " Alternatives: make it trainable and give it to the optimizer (full fine-tuning, or peft's "
        "modules_to_save=['q_proj', 'k_proj']); DoRA (use_dora=True) on q/k; leave this layer out "
        "(MuonClip(model, layers=[...])); or train with muonclip.Muon (no clip)."
    )


def check_clip_targets(
    layers: Sequence[AttentionLayer], groups: Iterable[Mapping], names: Mapping[int, str] | None = None
) -> None:
    """Refuse any layer whose clip would write a tensor the rule forbids (module doc).

    Args:
        layers: the attention layers the clip acts on.
        groups: the optimizer's param groups (dicts with ``"params"``).
        names: ``id(tensor) -> name`` for messages (default None: the layout field only).

    Raises:
        ValueError: naming the layer, the weight, why it may not be written, and the alternatives.
    """
    trainable = {id(p) for g in groups for p in g["params"]}
    names = names or {}
    for layer in layers:
        for t in layer.layout.params():
            why = refusal(t, trainable)
            if why is None:
                continue
            name = names.get(id(t), "")
            label = f"'{name}' ({_role(layer.layout, t)})" if name else _role(layer.layout, t)
            raise ValueError(
                f"QK-Clip of attention layer '{layer.name}' would scale rows of {label}, which is {why}. The clip "
                "never writes a frozen, quantized or unoptimized tensor." + _advice(name)
            )


__all__ = ["check_clip_targets", "refusal"]
