"""Attention with max-logit capture: the drop-in SDPA, the exact chunked max (one Triton kernel on a
GPU: `triton_max_logits`), the LSE gate that makes it nearly free (`gate`, on the kernels of
`lse`), attention with learned sinks (`sinks`), the recorder (`running_max`), the rule for which
forwards feed the clip and the monitor for those that must not (`forward_rule`)."""

from .forward_rule import MaxLogitMonitor, is_training_forward
from .gate import exact_max_logits, gated_max_logits, lse_bound
from .lse import sdpa_with_lse
from .max_logits import DEFAULT_CHUNK_ELEMENTS, chunked_max_logits
from .running_max import MaxLogitRecorder
from .sdpa import get_max_logit_backend, scaled_dot_product_attention, set_max_logit_backend
from .sinks import sink_attention

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "MaxLogitMonitor",
    "MaxLogitRecorder",
    "chunked_max_logits",
    "exact_max_logits",
    "gated_max_logits",
    "get_max_logit_backend",
    "is_training_forward",
    "lse_bound",
    "scaled_dot_product_attention",
    "sdpa_with_lse",
    "set_max_logit_backend",
    "sink_attention",
]
