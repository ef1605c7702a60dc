"""`discover_layers`: find the attention layers QK-Clip acts on, without the user editing model code.

Order:

1. Modules with a method ``qk_clip_layer(name) -> AttentionLayer`` — the project's reference
   GPT (`muonclip.models.GPT`) and any model written against this protocol.
2. The registered discoverers (`register_discoverer`), in order: each returns the layers of a
   model it recognises, else None. `muonclip.integrations` registers Hugging Face transformers'
   (`muonclip.integrations.hf.attach`: Llama, Qwen2, DeepSeek-V3, Phi-3, GPT-2, ...), which
   imports transformers only for a model that is one.
3. Anything else: a ValueError asking for ``layers=[AttentionLayer(...)]``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from ..common.family_readers import lacks
from ._layouts import AttentionLayer

Discoverer = Callable[[nn.Module], "list[AttentionLayer] | None"]

_PROTOCOL = frozenset({"qk_clip_layer"})

DISCOVERERS: list[Discoverer] = []
"""The functions `discover_layers` asks after the ``qk_clip_layer`` protocol, in order."""


def register_discoverer(discoverer: Discoverer) -> None:
    """Ask ``discoverer(model)`` for the layers of a model without ``qk_clip_layer`` modules; it
    returns them, or None for a model it does not know (registering it again is a no-op)."""
    if discoverer not in DISCOVERERS:
        DISCOVERERS.append(discoverer)


def discover_layers(model: nn.Module) -> list[AttentionLayer]:
    """Return one `AttentionLayer` per attention layer of ``model`` (see module doc).

    Raises:
        ValueError: no attention layer could be found (pass ``layers=`` to `MuonClip`), or a
            layer cannot be clipped (e.g. it has QK-norm).
    """
    layers = [
        module.qk_clip_layer(name)
        for name, module in model.named_modules()
        if not lacks(module, _PROTOCOL) and callable(getattr(module, "qk_clip_layer", None))
    ]
    if layers:
        return layers
    for discoverer in DISCOVERERS:
        found = discoverer(model)
        if found is not None:
            return found
    raise ValueError(
        f"could not find attention layers in {type(model).__name__}: it is neither a muonclip.models.GPT-style "
        "model (modules with qk_clip_layer(name)) nor a Hugging Face PreTrainedModel. Name them yourself: "
        "MuonClip(model, layers=[AttentionLayer(name, MHALayout(q.weight, k.weight, n_heads, head_dim), recorder)]), "
        "and call muonclip.scaled_dot_product_attention(..., recorder=recorder) in the layer's forward."
    )
