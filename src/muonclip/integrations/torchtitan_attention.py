"""torchtitan inner-attention modules that record each query head's max logit for QK-Clip.

torchtitan's attention modules (``GQAttention``, DeepSeek-V3's MLA ``Attention``) project q, k
and v, apply RoPE, and hand ``(B, L, heads, head_dim)`` tensors to an *inner attention* chosen by
the model config (``inner_attention``: ``FlexAttention``, ``VarlenAttention``,
``ScaledDotProductAttention``). The two modules here take that place and, besides the output,
fold the per-head max of ``scale * q.k`` over the batch, the queries and the keys the mask lets
through into the layer's `muonclip.attention.MaxLogitRecorder` (``muonclip_recorder``, set by
`muonclip.integrations.torchtitan_layouts.attention_layers`), on training forwards only (the
rule of `muonclip.attention.forward_rule`):

* `RecordingSDPA` (any device; the CPU path): causal attention through
  `muonclip.scaled_dot_product_attention` (the LSE gate where the kernel returns its
  log-sum-exp). Like torchtitan's ``ScaledDotProductAttention`` it takes no block mask: it is
  causal over the whole packed sequence (documents are not separated).
* `RecordingFlexAttention` (CUDA): torchtitan's ``FlexAttention`` with its block masks
  (document-causal, sliding window, ...), asking FlexAttention for ``max_scores`` in the same
  fused kernel (``AuxRequest(max_scores=True)``). torch has no FlexAttention backward on CPU and
  refuses ``max_scores`` there, so this path is written for GPUs and is not exercised by the CPU
  test suite.

Under tensor parallelism a rank's inner attention sees its own heads; the recorder has been
told which (`MaxLogitRecorder.shard_heads`), so it stores them at their global positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

from ..attention.forward_rule import recorders_to_feed, unseen_by_selective_checkpointing
from ..attention.running_max import MaxLogitRecorder
from ..attention.sdpa import scaled_dot_product_attention


def _local(t: Tensor) -> tuple[Tensor, Any]:
    """``(local tensor, (mesh, placements))`` of a DTensor, ``(t, None)`` for a plain tensor."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.to_local(), (t.device_mesh, t.placements)
    return t, None


class RecordingSDPA(ScaledDotProductAttention):
    """Causal SDPA that also records per-head max logits (`muonclip.scaled_dot_product_attention`).

    A drop-in for torchtitan's ``ScaledDotProductAttention``: inputs and output ``(B, L, N, H)``,
    ``scale`` and ``enable_gqa`` as given by the attention module, ``is_causal`` True by
    default; ``attention_masks`` must be None (a ValueError otherwise: use
    `RecordingFlexAttention` for block masks). DTensor inputs (tensor parallelism with a
    DTensor backend) are computed on their local heads and returned as DTensors with the same
    placements.

    Attributes:
        muonclip_recorder: the layer's `MaxLogitRecorder` (None: plain SDPA, nothing recorded).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ScaledDotProductAttention.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config if config is not None else RecordingSDPA.Config())
        self.muonclip_recorder: MaxLogitRecorder | None = None

    def forward(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        is_causal: bool = True,
        **kwargs: Any,
    ) -> Tensor:
        if attention_masks is not None:
            raise ValueError(
                "RecordingSDPA is causal SDPA and takes no attention_masks; for block masks (documents, sliding "
                "windows) use RecordingFlexAttention (CUDA)"
            )
        q, spec = _local(q_BLNH)
        k, _ = _local(k_BLNH)
        v, _ = _local(v_BLNH)
        out = scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=is_causal, scale=scale,
            enable_gqa=enable_gqa, recorder=self.muonclip_recorder, training=self.training,
        ).transpose(1, 2)
        if spec is not None:
            from torch.distributed.tensor import DTensor

            out = DTensor.from_local(out, spec[0], spec[1], run_check=False)
        return out


class RecordingFlexAttention(FlexAttention):
    """torchtitan's ``FlexAttention`` (block masks, compiled kernel) that also records per-head max
    logits from FlexAttention's ``max_scores`` (CUDA; not tested on CPU, see the module docstring).

    The forward is ``FlexAttention.forward``'s with ``AuxRequest(max_scores=True)`` added on a
    training forward: ``max_scores`` ``(B, N, L)`` holds each query row's max of the scaled score
    over the keys its block mask allows (``-inf`` for a fully masked row); its max over the batch
    and the rows is the head's max logit.

    Attributes:
        muonclip_recorder: the layer's `MaxLogitRecorder` (None: plain FlexAttention).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(FlexAttention.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config if config is not None else RecordingFlexAttention.Config())
        self.muonclip_recorder: MaxLogitRecorder | None = None

    def forward(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: Any,
        score_mod: Any = None,
        scale: float | None = None,
        enable_gqa: bool = False,
        out_transform: Any = None,
        **kwargs: Any,
    ) -> Tensor:
        from torch.nn.attention.flex_attention import AuxRequest, BlockMask

        if not isinstance(attention_masks, BlockMask):
            raise TypeError(f"attention_masks must be a BlockMask, got {type(attention_masks).__name__}")
        targets = recorders_to_feed(self.muonclip_recorder, self.training)
        out_BNLH, aux = FlexAttention.compiled_flex_attn(
            q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2),
            score_mod=score_mod, block_mask=attention_masks, scale=scale, enable_gqa=enable_gqa,
            return_aux=AuxRequest(lse=out_transform is not None, max_scores=bool(targets)),
            kernel_options=self.kernel_options,
        )
        if targets:
            with unseen_by_selective_checkpointing():
                scores, _ = _local(aux.max_scores)
                per_head = scores.detach().float().amax(dim=(0, 2))
                for target in targets:
                    target.update(per_head)
        out_BLNH = out_BNLH.transpose(1, 2)
        if out_transform is None:
            return out_BLNH
        return out_transform(out_BLNH, aux.lse.transpose(1, 2))


def recording_attention_config(device_type: str) -> ScaledDotProductAttention.Config | FlexAttention.Config:
    """The inner-attention config that records on ``device_type``: `RecordingFlexAttention` on
    ``"cuda"``, `RecordingSDPA` elsewhere."""
    return RecordingFlexAttention.Config() if device_type == "cuda" else RecordingSDPA.Config()


def is_recording(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of the recording inner attentions."""
    return isinstance(module, (RecordingSDPA, RecordingFlexAttention))


__all__ = ["RecordingFlexAttention", "RecordingSDPA", "is_recording", "recording_attention_config"]
