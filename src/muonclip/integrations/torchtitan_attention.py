"""torchtitan inner-attention modules that record each query head's max logit for QK-Clip.

torchtitan's attention modules (``GQAttention``, DeepSeek-V3's MLA ``Attention``) project q, k
and v, apply RoPE, and hand ``(B, L, heads, head_dim)`` tensors to an *inner attention* chosen by
the model config (``inner_attention``: ``FlexAttention``, ``VarlenAttention``,
``ScaledDotProductAttention``). The two modules here take that place and, besides the output,
fold the per-head max of ``scale * q.k`` over the batch, the queries and the keys the mask lets
through into the layer's `muonclip.attention.MaxLogitRecorder` (``muonclip_recorder``, set by
`muonclip.integrations.torchtitan_layouts.attention_layers`), on training forwards only (the
rule of `muonclip.attention.forward_rule`). Both describe their call as a
`muonclip.attention.call.AttentionCall` and go through the one recording path,
`muonclip.attention.record.attend` (torchtitan's batches are packed without padding: every
token is real):

* `RecordingSDPA` (any device; the CPU path): causal attention through
  `muonclip.scaled_dot_product_attention` (the LSE gate where the kernel returns its
  log-sum-exp). Like torchtitan's ``ScaledDotProductAttention`` it takes no block mask: it is
  causal over the whole packed sequence (documents are not separated).
* `RecordingVarlen` (CUDA): torchtitan's ``VarlenAttention`` (``attn_backend="varlen"``: packed
  documents through torch's ``varlen_attn``, which returns only the LSE) as `VarlenKernel`; the
  call carries the documents (``cu_seq_lens``), the LSE gates, and the heads that may exceed tau
  get their exact max document by document (`muonclip.attention.documents`). torch's varlen
  kernel does not run on CPU; the CPU tests run this module's code with a per-document
  reference kernel in its place.
* `RecordingFlexAttention` (CUDA): torchtitan's ``FlexAttention`` with its block masks
  (document-causal, sliding window, ...), as a `muonclip.attention.record.Kernel` whose pairs
  only it knows: the max logit comes from FlexAttention's ``max_scores`` in the same fused kernel
  (``AuxRequest(max_scores=True)``). torch has no FlexAttention backward on CPU and refuses
  ``max_scores`` there; the CPU tests run this module's code through FlexAttention's dense
  reference implementation, the fused kernel only where a GPU is present.

Under tensor parallelism a rank's inner attention sees its own heads; the recorder has been
told which (`MaxLogitRecorder.shard_heads`), so it stores them at their global positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

from ..attention._recorder import MaxLogitRecorder
from ..attention.call import AttentionCall
from ..attention.record import Kernel, attend


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
        call = AttentionCall(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=is_causal, scale=scale,
                             enable_gqa=enable_gqa)
        out = attend(call, self.muonclip_recorder, self.training).transpose(1, 2)
        if spec is not None:
            from torch.distributed.tensor import DTensor

            out = DTensor.from_local(out, spec[0], spec[1], run_check=False)
        return out


class _FlexKernel(Kernel):
    """torchtitan's compiled FlexAttention on one block mask, as a recording-path kernel: its pairs
    are the block mask's (no dense ``attn_mask``), so its max is its own ``max_scores``; the LSE
    is kept for ``out_transform``."""

    row_max_only = True

    def __init__(self, block_mask: Any, kernel_options: dict, want_lse: bool) -> None:
        self.block_mask, self.kernel_options, self.want_lse = block_mask, kernel_options, want_lse
        self.lse: Tensor | None = None

    def _flex(self, call: AttentionCall, max_scores: bool) -> tuple[Tensor, Any]:
        from torch.nn.attention.flex_attention import AuxRequest

        out, aux = FlexAttention.compiled_flex_attn(
            call.query, call.key, call.value, score_mod=None, block_mask=self.block_mask, scale=call.scale,
            enable_gqa=call.enable_gqa, return_aux=AuxRequest(lse=self.want_lse, max_scores=max_scores),
            kernel_options=self.kernel_options,
        )
        self.lse = aux.lse if self.want_lse else None
        return out, aux

    def run(self, call: AttentionCall, lse: bool) -> tuple[Tensor, Tensor | None]:
        return self._flex(call, max_scores=False)[0], None

    def run_with_row_max(self, call: AttentionCall) -> tuple[Tensor, Tensor] | None:
        if call.real_keys is not None:
            return None
        out, aux = self._flex(call, max_scores=True)
        return out, _local(aux.max_scores)[0]


class RecordingFlexAttention(FlexAttention):
    """torchtitan's ``FlexAttention`` (block masks, compiled kernel) that also records per-head max
    logits from FlexAttention's ``max_scores`` (CUDA; see the module docstring).

    The forward is ``FlexAttention.forward``'s through the recording path: on a training forward
    FlexAttention is asked for ``max_scores`` ``(B, N, L)``, each query row's max of the scaled
    score over the keys its block mask allows (``-inf`` for a fully masked row); its max over the
    batch and the rows is the head's max logit. A ``score_mod`` is refused (ValueError): it
    changes the scores, so ``max_scores`` would not be the q·k logits QK-Clip bounds.

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
        from torch.nn.attention.flex_attention import BlockMask

        if not isinstance(attention_masks, BlockMask):
            raise TypeError(f"attention_masks must be a BlockMask, got {type(attention_masks).__name__}")
        if score_mod is not None:
            raise ValueError("RecordingFlexAttention takes no score_mod: it changes the scores, so FlexAttention's "
                             "max_scores would not be the q.k logits QK-Clip bounds")
        kernel = _FlexKernel(attention_masks, self.kernel_options, want_lse=out_transform is not None)
        call = AttentionCall(q_BLNH.transpose(1, 2), k_BLNH.transpose(1, 2), v_BLNH.transpose(1, 2), scale=scale,
                             enable_gqa=enable_gqa)
        out_BLNH = attend(call, self.muonclip_recorder, self.training, kernel).transpose(1, 2)
        if out_transform is None:
            return out_BLNH
        return out_transform(out_BLNH, kernel.lse.transpose(1, 2))


class VarlenKernel(Kernel):
    """torch's ``varlen_attn`` (``torch.nn.attention.varlen``, FlashAttention's varlen kernel) on
    torchtitan's ``VarlenMetadata``, as a recording-path kernel: the call is one packed row
    ``(1, Hq, T, D)`` whose documents are ``cu_seq_lens``; the kernel returns its output and,
    when asked (the LSE gate, or an ``out_transform``), its LSE ``(Hq, T)``, kept as
    ``(1, Hq, T)`` for the gate and in ``lse``."""

    def __init__(self, metadata: Any, window_size: tuple[int, int], want_lse: bool, **varlen_kwargs: Any) -> None:
        self.metadata, self.window_size, self.want_lse, self.kwargs = metadata, window_size, want_lse, varlen_kwargs
        self.lse: Tensor | None = None

    def run(self, call: AttentionCall, lse: bool) -> tuple[Tensor, Tensor | None]:
        from torch.nn.attention.varlen import AuxRequest, varlen_attn

        m = self.metadata
        q, k, v = (t[0].transpose(0, 1) for t in (call.query, call.key, call.value))  # (T, N, H)
        aux = AuxRequest(lse=True) if lse or self.want_lse else None
        result = varlen_attn(q, k, v, m.cu_seq_q, m.cu_seq_k, m.max_q, m.max_k, return_aux=aux, scale=call.scale,
                             window_size=self.window_size, enable_gqa=call.enable_gqa, **self.kwargs)
        out, row_lse = (result, None) if aux is None else result
        self.lse = None if row_lse is None else row_lse.unsqueeze(0)  # (1, Hq, T)
        return out.transpose(0, 1).unsqueeze(0), self.lse if lse else None


class RecordingVarlen(VarlenAttention):
    """torchtitan's ``VarlenAttention`` (packed documents through torch's ``varlen_attn``) that also
    records per-head max logits, exact per document where QK-Clip could act (CUDA: torch's
    varlen kernel runs on GPUs only).

    The forward is ``VarlenAttention.forward``'s (q, k, v cast to bfloat16, packed to ``(T, N,
    H)``; ``out_transform`` given the LSE) through the recording path, with the call's documents
    the metadata's ``cu_seq_q`` (`muonclip.attention.call.AttentionCall`, ``cu_seq_lens``): the
    pairs QK-Clip sees are the kernel's, within a document. The kernel returns only its LSE,
    not its row maxima, so the max logit is the LSE gate's (`muonclip.attention.documents`):
    every head bounded over the packed row, the exact max computed, document by document, only
    for the heads whose bound passes tau. Windows other than causal ``(-1, 0)`` and full
    ``(-1, -1)``, and ``cu_seq_k`` other than ``cu_seq_q`` (not self-attention), are refused
    (ValueError).

    Attributes:
        muonclip_recorder: the layer's `MaxLogitRecorder` (None: plain varlen attention).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(VarlenAttention.Config):
        pass

    def __init__(self, config: Config | None = None) -> None:
        super().__init__(config if config is not None else RecordingVarlen.Config())
        if tuple(self.window_size) not in ((-1, 0), (-1, -1)):
            raise ValueError(f"RecordingVarlen records causal (-1, 0) or full (-1, -1) attention within documents, "
                             f"got window_size {tuple(self.window_size)}")
        self.muonclip_recorder: MaxLogitRecorder | None = None

    def forward(
        self,
        q_BLNH: Tensor,
        k_BLNH: Tensor,
        v_BLNH: Tensor,
        *,
        attention_masks: Any,
        scale: float | None = None,
        out_transform: Any = None,
        **kwargs: Any,
    ) -> Tensor:
        from torch.nn.attention import current_flash_attention_impl
        from torchtitan.distributed.utils import is_in_batch_invariant_mode
        from torchtitan.models.common.attention import VarlenMetadata

        if not isinstance(attention_masks, VarlenMetadata):
            raise TypeError(f"attention_masks must be a VarlenMetadata, got {type(attention_masks).__name__}")
        m = attention_masks
        if m.cu_seq_k is not m.cu_seq_q and not torch.equal(m.cu_seq_k, m.cu_seq_q):
            raise ValueError("RecordingVarlen records self-attention over packed documents: cu_seq_k must be cu_seq_q")
        B, L = q_BLNH.shape[:2]
        dv = v_BLNH.shape[-1]
        q, k, v = (t.reshape(B * L, t.shape[2], t.shape[3]).to(torch.bfloat16).transpose(0, 1).unsqueeze(0)
                   for t in (q_BLNH, k_BLNH, v_BLNH))
        varlen_kwargs: dict[str, Any] = {}
        if (current_flash_attention_impl() in (None, "FA2") or is_in_batch_invariant_mode()) \
                and torch.version.hip is None:
            varlen_kwargs["num_splits"] = 1  # as torchtitan's VarlenAttention (FA2's split heuristic, batch invariance)
        kernel = VarlenKernel(m, tuple(self.window_size), out_transform is not None, **varlen_kwargs)
        call = AttentionCall(q, k, v, is_causal=tuple(self.window_size) == (-1, 0), scale=scale,
                             enable_gqa=bool(kwargs.get("enable_gqa", False)), cu_seq_lens=m.cu_seq_q,
                             cu_seq_lens_host=m.cu_seq_q_host)
        out = attend(call, self.muonclip_recorder, self.training, kernel)  # (1, Hq, T, Dv)
        out_BLNH = out[0].transpose(0, 1).reshape(B, L, -1, dv).to(q_BLNH.dtype)
        if out_transform is None:
            return out_BLNH
        return out_transform(out_BLNH, kernel.lse[0].transpose(0, 1).reshape(B, L, -1))


def recording_attention_config(device_type: str, varlen: Any = None) -> Any:
    """The inner-attention config that records on ``device_type``: `RecordingFlexAttention` on
    ``"cuda"``, `RecordingSDPA` elsewhere; for a ``VarlenAttention.Config`` ``varlen`` on
    ``"cuda"``, `RecordingVarlen` with its window (torch's varlen kernel runs on GPUs only:
    elsewhere `RecordingSDPA`, causal over the packed sequence)."""
    if device_type != "cuda":
        return RecordingSDPA.Config()
    if varlen is not None:
        return RecordingVarlen.Config(window_size=tuple(varlen.window_size))
    return RecordingFlexAttention.Config()


def is_recording(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of the recording inner attentions."""
    return isinstance(module, (RecordingSDPA, RecordingFlexAttention, RecordingVarlen))


__all__ = ["RecordingFlexAttention", "RecordingSDPA", "RecordingVarlen", "VarlenKernel", "is_recording",
           "recording_attention_config"]
