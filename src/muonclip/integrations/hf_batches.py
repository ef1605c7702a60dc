"""The forward pre-hook `muonclip.integrations.hf.attach` gives a switched transformers model: what
its attention function needs to know of each batch (packed documents without a mask, their padding,
a right-padded batch without a mask). The rules are `muonclip.integrations.hf`'s module docstring
("Which tokens are padding")."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from .hf_attention import TOKENS_KWARG
from .hf_padding import warn_unmasked_padding


def packed_batch(position_ids: Tensor) -> bool:
    """Whether any row of ``position_ids`` restarts (a packed batch: several documents per row)."""
    return position_ids.ndim >= 1 and position_ids.shape[-1] > 1 and bool((position_ids.diff(dim=-1) != 1).any())


def real_tokens(input_ids: Tensor | None, position_ids: Tensor | None, pad_token_id: int | None) -> Tensor | None:
    """``(B, T)`` bool, the real tokens of a padding-free packed batch (no attention mask), False
    for its padding (`muonclip.integrations.hf`'s module docstring, "Which tokens are padding");
    None when nothing says.

    Args:
        input_ids: ``(B, T)`` token ids.
        position_ids: ``(B, T)`` positions, restarting per document.
        pad_token_id: the pad token id (None: padding cannot be told apart).

    A token is padding when it is ``pad_token_id`` and a one-token document: its position
    restarts (differs from the previous one's plus 1, as transformers finds packed documents)
    and so does the next token's (or the row ends there).
    """
    if not isinstance(input_ids, Tensor) or not isinstance(position_ids, Tensor) or pad_token_id is None:
        return None
    if input_ids.ndim != 2 or position_ids.shape != input_ids.shape:
        return None
    starts = position_ids.diff(dim=-1, prepend=position_ids[:, :1] - 1) != 1
    alone = starts & torch.cat([starts[:, 1:], torch.ones_like(starts[:, :1])], dim=-1)
    return ~(alone & (input_ids == pad_token_id))


def pad_token_id(model: nn.Module) -> int | None:
    """The pad token id of a model's (text) config; None when it has none."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    pad = getattr(text, "pad_token_id", None)
    return pad if isinstance(pad, int) else None


def batch_pre_hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict[str, Any]] | None:
    """Forward pre-hook of a switched model: what the attention function needs to know of the batch.

    * A packed batch without an attention mask attends per document: transformers builds the
      document mask from ``position_ids`` only when no attention mask and no cache are given; in
      training mode ``use_cache`` defaults to the config's (usually True), which skips it and lets
      documents attend to each other. So for a packed batch this asks for ``use_cache=False``; a
      packed batch given with a cache of its own is refused.
    * Such a batch's real tokens (`real_tokens`: its padding has no mask to say so) are passed
      down as the keyword `muonclip.integrations.hf_attention.TOKENS_KWARG` (transformers hands
      a model's keyword arguments to its attention function), so padding queries never feed the
      clip. A batch with a 2-D mask needs nothing: the call's mask says which queries are padding.
    * Any other training batch without a mask whose rows end in padding warns, once per model
      (`muonclip.integrations.hf_padding.warn_unmasked_padding`).
    """
    signature = inspect.signature(module.forward)
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        return None
    var_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    for p in signature.parameters.values():  # keywords the signature collects in **kwargs
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            bound = {**bound, **bound.pop(p.name, {})}
    position_ids = bound.get("position_ids")
    packed = isinstance(position_ids, Tensor) and bound.get("attention_mask") is None and packed_batch(position_ids)
    if packed and (bound.get("past_key_values") is not None or bound.get("cache") is not None):
        raise ValueError(
            f"{type(module).__name__}: a packed batch (position_ids restart inside a row) given with a cache: "
            "transformers builds no document mask then, so documents would attend to each other. Pass the packed "
            "batch without past_key_values, or pad it and pass an attention_mask."
        )
    if not packed:
        warn_unmasked_padding(module, bound)
    if not packed or ("use_cache" not in signature.parameters and not var_keyword):
        return None
    kwargs = dict(kwargs)
    kwargs["use_cache"] = False
    tokens = real_tokens(bound.get("input_ids"), position_ids, pad_token_id(module)) if var_keyword else None
    if tokens is not None:
        kwargs[TOKENS_KWARG] = tokens
    return args, kwargs


__all__ = ["batch_pre_hook", "packed_batch", "pad_token_id", "real_tokens"]
