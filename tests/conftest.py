"""Fixtures shared by the test modules: the `muonclip` command's corpus, FlexAttention on the CPU,
both of ``orth_dtype="auto"``'s answers on any CPU; torch's compiled-kernel cache kept per CPU
capability."""

from __future__ import annotations

import inspect
import os
import tempfile

import pytest
import torch

from muonclip.app.data import builtin_corpus_dir, read_document
from muonclip.common._hardware import CPU_BF16_ENV

# torch's inductor cache does not tell kernels built for one CPU capability from another's: a
# kernel compiled under ``ATEN_CPU_CAPABILITY=avx2`` (`make test-avx2`) and then loaded by a run
# with the CPU's own (AVX-512) capability, or the reverse, returns NaN (test_ortho_fast's compiled
# Newton-Schulz). So each capability compiles into its own folder; the processes tests start inherit it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"torchinductor-muonclip-{os.getuid()}-{torch.backends.cpu.get_cpu_capability()}"))


@pytest.fixture(scope="module")
def text(tmp_path_factory) -> str:
    """A small corpus file: Macbeth, from the built-in plays, as plain text."""
    path = tmp_path_factory.mktemp("text") / "macbeth.txt"
    path.write_text(read_document(builtin_corpus_dir() / "tragedies" / "macbeth.md"))
    return str(path)


@pytest.fixture(params=["native-bf16", "no-bf16"])
def bf16_answer(request, monkeypatch) -> torch.dtype:
    """Runs the test under each answer the CPU probe can give, whatever this CPU is: the CPU
    multiplies bfloat16 natively (``orth_dtype="auto"`` picks bfloat16, as on a CPU with AMX or
    AVX512-BF16) and it does not (``"auto"`` picks float32, as on an AVX2-only CPU), through
    ``MUONCLIP_CPU_BF16`` (`muonclip.common._hardware`), which processes the test starts inherit.
    Returns the dtype ``"auto"`` picks on the CPU under this answer."""
    native = request.param == "native-bf16"
    monkeypatch.setenv(CPU_BF16_ENV, "1" if native else "0")
    return torch.bfloat16 if native else torch.float32


@pytest.fixture
def flex_on_cpu(monkeypatch):
    """`flex_attention_with_max` and the ``"flex"`` backend run on the CPU through
    FlexAttention's own dense reference implementation (its compile-debug mode), with torch's
    CPU refusal of ``max_scores`` lifted: the wrapper's masks, causal rule, GQA, scale and
    reduction are then the code a GPU runs; only the fused kernel is not (the CUDA test above)."""
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    if not all(hasattr(fa, n) for n in ("AuxRequest", "_apply_kernel_options", "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG")):
        pytest.skip("this torch's FlexAttention has no max_scores or a different debug mode")
    import muonclip.attention._max_logits as max_logits
    import muonclip.attention.record as record

    real = fa._apply_kernel_options
    signature = inspect.signature(real)
    if "return_aux" not in signature.parameters:
        pytest.skip("this torch's FlexAttention sets its kernel options differently")

    def allow_max_on_cpu(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        aux = call.arguments.get("return_aux")
        call.arguments["return_aux"] = None  # what torch refuses on CPU is asked for below
        options = real(*call.args, **call.kwargs)
        options["OUTPUT_MAX"] = bool(aux is not None and aux.max_scores)
        return options

    monkeypatch.setattr(fa, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    monkeypatch.setattr(fa, "_apply_kernel_options", allow_max_on_cpu)
    monkeypatch.setattr(max_logits, "_compiled_flex", lambda: fa.flex_attention)
    monkeypatch.setattr(record, "flex_available", lambda query: True)
    max_logits._causal_block_mask.cache_clear()
    record.set_max_logit_backend("flex")
    yield fa
    record.set_max_logit_backend("gated")
    max_logits._causal_block_mask.cache_clear()
