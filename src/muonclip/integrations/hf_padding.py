"""A padded training batch given without its attention mask: warned, once per model.

Without an ``attention_mask`` transformers has nothing to tell padding from tokens: a causal
model lets every query see the keys before it, so under right padding (the pads after each
row's tokens, labels ``-100`` on them: what a hand-written loop often builds) the real tokens'
outputs and the loss are unchanged, but the pads' queries attend to the real keys before them,
and QK-Clip records their logits like any other: a pad embedding whose logits exceed a head's
real ones clips that head for nothing, or too hard. No optimizer can know which tokens are
padding; only the mask says.

So `warn_unmasked_padding` warns (`UnmaskedPaddingWarning`, once per model) when a forward that
feeds the clip (`muonclip.attention.forward_rule`: training mode, grad enabled) of an attached
model gets ``input_ids`` and no ``attention_mask`` (and is not a padding-free packed batch, whose
pads `muonclip.integrations.hf.real_tokens` finds) and some row ends in what can only be padding
(`padded_rows`):

* the model config's ``pad_token_id`` at the row's end, twice or more; or once, when the pad token
  is not also the eos, bos or sep token (then a row may end with it as a real token);
* or the row's last two tokens are one token repeated, with labels ``-100`` on both (``labels``
  passed to the forward, as the loss of a causal LM takes them): trailing tokens nobody trains
  on, whatever the pad id (``pad_token_id`` unset in the config, as in Llama's).

A row that ends with a single eos while eos is also the pad token, or that ends with the pad
token when the config has none, and no labels say otherwise, is taken as real. Left padding
without a mask is not looked for: the real tokens then attend to the pads, which changes the
model's own outputs, not only the clip. The check reads the last two columns (one host sync, in
forwards without a mask only) until it has warned. The fix is to pass the mask (docs/
integrations.md, "Padded batches need their attention mask").
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..attention.forward_rule import is_training_forward
from ..qkclip._muonclip import outside_frames

WARNED_ATTR = "muonclip_unmasked_padding_warned"
"""Attribute of a switched ``PreTrainedModel``: True once it has warned (`warn_unmasked_padding`)."""

IGNORE_INDEX = -100
"""The label transformers' losses ignore (``CrossEntropyLoss``'s ``ignore_index``)."""


class UnmaskedPaddingWarning(UserWarning):
    """A training batch of an attached model ends in padding and comes without ``attention_mask``:
    its pads' logits feed QK-Clip (`muonclip.integrations.hf_padding`)."""


def _ids(value: Any) -> set[int]:
    values = value if isinstance(value, (list, tuple)) else [value]
    return {v for v in values if isinstance(v, int) and not isinstance(v, bool)}


def padded_rows(input_ids: Tensor, labels: Tensor | None, pad_token_id: int | None,
                special_ids: set[int]) -> list[int]:
    """The rows of ``input_ids`` ``(B, T)`` that end in what can only be padding (module
    docstring): ``pad_token_id`` twice at the end, or once when it is none of ``special_ids``
    (eos, bos, sep); or two equal last tokens whose ``labels`` are both -100."""
    tail = input_ids[:, -2:]
    flags = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    if pad_token_id is not None:
        at_pad = tail == pad_token_id
        if pad_token_id not in special_ids:
            flags |= at_pad[:, -1]
        elif tail.shape[1] == 2:
            flags |= at_pad.all(dim=-1)
    if isinstance(labels, Tensor) and labels.shape == input_ids.shape and tail.shape[1] == 2:
        flags |= (labels[:, -2:] == IGNORE_INDEX).all(dim=-1) & (tail[:, 0] == tail[:, 1])
    return flags.nonzero().flatten().tolist()


def warn_unmasked_padding(model: nn.Module, bound: Mapping[str, Any]) -> None:
    """Warn once per ``model`` (`UnmaskedPaddingWarning`) when its forward's arguments ``bound``
    are a training batch without ``attention_mask`` that ends in padding (module docstring).
    Called by `muonclip.integrations.hf`'s forward pre-hook for a batch that is not packed."""
    if getattr(model, WARNED_ATTR, False) or bound.get("attention_mask") is not None:
        return
    input_ids = bound.get("input_ids")
    if not isinstance(input_ids, Tensor) or input_ids.ndim != 2 or input_ids.shape[1] == 0:
        return
    if torch.compiler.is_compiling() or not is_training_forward(model.training):
        return
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad = getattr(text, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and not isinstance(pad, bool) else None
    special = set().union(*(_ids(getattr(text, k, None)) for k in ("eos_token_id", "bos_token_id", "sep_token_id")))
    rows = padded_rows(input_ids, bound.get("labels"), pad, special)
    if not rows:
        return
    setattr(model, WARNED_ATTR, True)
    shown = ", ".join(map(str, rows[:8])) + (" ..." if len(rows) > 8 else "")
    warnings.warn(
        f"{type(model).__name__}: a training batch without attention_mask whose rows {shown} (of "
        f"{input_ids.shape[0]}) end in padding (the pad token {pad} there, or a token repeated with labels "
        "-100). Without a mask nothing tells padding from tokens: the pads' queries attend to the tokens "
        "before them and QK-Clip records their logits as the model's, which can clip heads whose real logits "
        "stay below tau. Pass attention_mask (1 for tokens, 0 for padding, as the tokenizer returns it with "
        "padding=True), or pack the batch without padding. This warning is shown once per model.",
        UnmaskedPaddingWarning, stacklevel=outside_frames(),
    )


__all__ = ["IGNORE_INDEX", "UnmaskedPaddingWarning", "padded_rows", "warn_unmasked_padding"]
