"""Attention with max-logit capture: the drop-in SDPA, the exact chunked max, the recorder, the
rule for which forwards feed the clip and the monitor for those that must not (`recording`)."""

from .max_logits import DEFAULT_CHUNK_ELEMENTS, chunked_max_logits
from .recorder import MaxLogitRecorder
from .recording import MaxLogitMonitor, is_training_forward
from .sdpa import get_max_logit_backend, scaled_dot_product_attention, set_max_logit_backend

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "MaxLogitMonitor",
    "MaxLogitRecorder",
    "chunked_max_logits",
    "get_max_logit_backend",
    "is_training_forward",
    "scaled_dot_product_attention",
    "set_max_logit_backend",
]
