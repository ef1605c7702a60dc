"""Attention with max-logit capture: the drop-in SDPA (`_sdpa`), the one argument object of a call
(`call`) and the one recording path every entry point takes (`record`: the backend choice, the
recorders fed), the rule for which pairs the clip sees (`pairs`), the exact chunked max
(`_max_logits`; one Triton kernel on a GPU: `_triton_max_logits`), the LSE gate that makes it
nearly free (`_gate`, on the kernels of `_lse`), attention with learned sinks (`sinks`), the
recorder (`_recorder`), the rule for which forwards feed the clip and the monitor for those that
must not (`forward_rule`). The modules without an underscore are public; the names of the others
are exported here."""

from ._gate import exact_max_logits, gated_max_logits, lse_bound
from ._lse import sdpa_with_lse
from ._max_logits import DEFAULT_CHUNK_ELEMENTS, chunked_max_logits
from ._recorder import MaxLogitRecorder
from ._sdpa import scaled_dot_product_attention
from .call import AttentionCall
from .forward_rule import MaxLogitMonitor, is_training_forward, unrecorded_forward
from .pairs import MASKED_AT
from .record import get_max_logit_backend, set_max_logit_backend
from .sinks import sink_attention

__all__ = [
    "DEFAULT_CHUNK_ELEMENTS",
    "MASKED_AT",
    "AttentionCall",
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
    "unrecorded_forward",
]
