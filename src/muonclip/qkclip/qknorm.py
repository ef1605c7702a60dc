"""Structural check: does anything inside an attention block undo a rescaling of W_q / W_k rows?

QK-Clip bounds head h's logits by multiplying rows of the query/key projections (docs/design.md,
"QK-Clip is never a silent no-op").
A normalisation applied to q or k after the projection — QK-norm (Qwen3, Gemma 3, OLMo 2), Llama
4's L2 norm, Phi / StableLM / Persimmon's ``qk_layernorm`` — divides that factor out again: the
weights shrink, the logits do not move, and the clip is a silent no-op. `find_qk_norms` looks
for such modules before QK-Clip attaches to a layer; `check_no_qk_norm` refuses the layer.

The rule fails closed. Every module inside the attention module (its descendants) that is a
normalisation is presumed to sit between the projections and the logits, unless the caller
states that it feeds a projection the clip scales (``inputs``: DeepSeek MLA's
``q_a_layernorm`` / ``kv_a_layernorm`` normalise the low-rank latents *before* ``q_b_proj`` /
``kv_b_proj``, so the clip acts after them). A module is a normalisation when any of these holds:

* its type is one of torch's normalisation layers (`torch.nn.LayerNorm`, `torch.nn.RMSNorm`,
  `torch.nn.GroupNorm`, batch / instance norms, `torch.nn.LocalResponseNorm`);
* its class name, or the name of a class it derives from, contains ``"Norm"``
  (``Qwen3RMSNorm``, ``Llama4TextL2Norm``, ``CohereLayerNorm``, ``StableLmLayerNormPerHead``);
* its attribute name says so: a ``_``-separated part that contains ``"norm"`` or is ``"ln"``
  (``q_norm``, ``qk_norm``, ``k_layernorm``, ``q_layer_norm``, ``norm_query``, ``q_ln``) —
  except a `torch.nn.Identity` (a disabled norm).

Independently of its children, an attention class that the registered family table states
always normalises q/k (`muonclip.common.family_readers.normalises_qk`; transformers' classes are
listed in `muonclip.integrations.families.QK_NORM_CLASSES`) is refused, so a release that moves
the norm into a function call is still caught. Classes whose norm depends on the config are
decided by their modules.

The layer's input norm: transformers keeps it in the decoder layer (``input_layernorm``,
``ln_1``), outside the attention module, so it is never examined. Inside the attention module
an input norm cannot be told from a q/k norm by type or by width (OLMo 2's ``q_norm``
normalises the whole hidden width, as an input norm does), so it is refused too; move it out
of the attention module or state the layers yourself (``MuonClip(model, layers=[...])``).

Not seen here: a normalisation written as a function call inside ``forward`` (``F.normalize``,
``F.layer_norm``) or hidden inside a projection module. The runtime check of `MuonClip`
(`muonclip.qkclip.check`) is the safety net for those.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from ..common.family_readers import normalises_qk

_TORCH_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)


def is_norm_module(attr: str, module: nn.Module) -> bool:
    """True when ``module`` (held under attribute name ``attr``) is a normalisation (see module doc)."""
    if isinstance(module, _TORCH_NORMS):
        return True
    if any("Norm" in cls.__name__ for cls in type(module).__mro__):
        return True
    if isinstance(module, nn.Identity):
        return False
    return any("norm" in part or part == "ln" for part in attr.lower().split("_"))


def find_qk_norms(module: nn.Module, inputs: Iterable[nn.Module] = ()) -> list[str]:
    """Normalisation modules inside ``module`` that could undo a rescaling of its q/k projection rows.

    Args:
        module: an attention module (the module that computes q, k and the logits).
        inputs: modules stated to feed a projection the clip scales, hence harmless (default
            none): their outputs are rescaled by the clip, not the other way round.

    Returns:
        ``"path (ClassName)"`` for each such descendant of ``module``, in module order, without
        the children of a norm already listed (empty: none found).
    """
    allowed = {id(m) for m in inputs}
    found: list[str] = []
    inside: list[str] = []  # paths of the norms found: their own children are not listed again
    for path, sub in module.named_modules():
        if not path or id(sub) in allowed or any(path.startswith(p + ".") for p in inside):
            continue
        if is_norm_module(path.rsplit(".", 1)[-1], sub):
            found.append(f"{path} ({type(sub).__name__})")
            inside.append(path)
    return found


def check_no_qk_norm(name: str, module: nn.Module, inputs: Iterable[nn.Module] = ()) -> None:
    """Raise ValueError when attention layer ``name`` normalises q/k after its projections.

    Refused: a layer with a normalisation module found by `find_qk_norms` (``inputs`` as there),
    or whose class always normalises q/k (`muonclip.common.family_readers.normalises_qk`). The message
    names the layer, its class and the modules, says why QK-Clip cannot bound its logits and what
    to do instead.
    """
    cls = type(module).__name__
    norms = find_qk_norms(module, inputs)
    if not norms and not normalises_qk(module):
        return
    what = ", ".join(norms) if norms else f"{cls} normalises q/k inside its forward"
    raise ValueError(
        f"attention layer '{name}' ({cls}) normalises q/k after the projection ({what}): QK-Clip rescales "
        "rows of W_q/W_k, which a norm undoes, so it cannot bound the logits of this model. QK-norm already bounds "
        "them (by the norm gains): train it with plain muonclip.Muon, or clip the norm gains yourself by passing "
        "MuonClip(layers=[...]) with your own layout. (A norm of the layer's input that lives inside the attention "
        "module is refused too: move it out of the module or pass layers=[...].)"
    )


__all__ = ["check_no_qk_norm", "find_qk_norms", "is_norm_module"]
