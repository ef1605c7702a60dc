"""Attention with max-logit capture: the drop-in SDPA, the exact chunked max, the recorder."""

from .max_logits import DEFAULT_CHUNK_ELEMENTS, chunked_max_logits
from .recorder import MaxLogitRecorder
from .sdpa import get_max_logit_backend, scaled_dot_product_attention, set_max_logit_backend

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "MaxLogitRecorder",
    "chunked_max_logits",
    "get_max_logit_backend",
    "scaled_dot_product_attention",
    "set_max_logit_backend",
]
