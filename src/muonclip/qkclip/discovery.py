"""`discover_layers`: find the attention layers QK-Clip acts on, without the user editing model code.

Order (design.md 2, cases a–c):

1. Modules with a method ``qk_clip_layer(name) -> AttentionLayer`` — the project's reference
   GPT (`muonclip.models.GPT`) and any model written against this protocol.
2. A Hugging Face transformers ``PreTrainedModel``: `muonclip.qkclip.hf.attach` registers the
   max-logit attention function and returns the layers (Llama, Qwen2, DeepSeek-V3, Phi-3, GPT-2, ...).
3. Anything else: a ValueError asking for ``layers=[AttentionLayer(...)]``.
"""

from __future__ import annotations

import sys

from torch import nn

from .layouts import AttentionLayer


def _is_hf_model(model: nn.Module) -> bool:
    if "transformers" not in sys.modules:  # a transformers model means transformers is imported
        return False
    from transformers import PreTrainedModel

    return isinstance(model, PreTrainedModel)


def discover_layers(model: nn.Module) -> list[AttentionLayer]:
    """Return one `AttentionLayer` per attention layer of ``model`` (see module doc).

    Raises:
        ValueError: no attention layer could be found (pass ``layers=`` to `MuonClip`), or a
            layer cannot be clipped (e.g. it has QK-norm).
    """
    layers = [
        module.qk_clip_layer(name)
        for name, module in model.named_modules()
        if callable(getattr(module, "qk_clip_layer", None))
    ]
    if layers:
        return layers
    if _is_hf_model(model):
        from .hf import attach

        return attach(model)
    raise ValueError(
        f"could not find attention layers in {type(model).__name__}: it is neither a muonclip.models.GPT-style "
        "model (modules with qk_clip_layer(name)) nor a Hugging Face PreTrainedModel. Name them yourself: "
        "MuonClip(model, layers=[AttentionLayer(name, MHALayout(q.weight, k.weight, n_heads, head_dim), recorder)]), "
        "and call muonclip.scaled_dot_product_attention(..., recorder=recorder) in the layer's forward."
    )


__all__ = ["discover_layers"]
