"""The LSE gate on a GPU: the one-kernel exact max (`muonclip.attention._triton_max_logits`) against the
chunked reference, the gate whose flags never leave the device, and on CUDA the kernels with the LSE
(`muonclip.attention._lse`): SDPA's output and gradients bit for bit, every decision and gamma those of
the exact path, and no host sync in a gated call.

Each device test runs on "interpreter" (CPU tensors under Triton's interpreter, TRITON_INTERPRET=1:
the kernel's logic without a GPU) and on "cuda" (the compiled kernel; skipped without a GPU)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from test_attention_gate import CASES, TARGETS, TAU, _case, _straddle

import muonclip.attention.record as record_mod
from muonclip import scaled_dot_product_attention
from muonclip.attention import (
    AttentionCall,
    MaxLogitRecorder,
    chunked_max_logits,
    exact_max_logits,
    gated_max_logits,
    sdpa_with_lse,
)
from muonclip.attention import _triton_max_logits as triton_max
from muonclip.qkclip import compute_gamma

triton = pytest.importorskip("triton")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(params=["interpreter", pytest.param("cuda", marks=needs_cuda)])
def device(request, monkeypatch):
    if request.param == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        return "cpu"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return "cuda"


def _moved(case, device, dtype=torch.float32):
    q, k, v, kw = case
    kw = dict(kw)
    if "attn_mask" in kw:
        m = kw["attn_mask"]
        kw["attn_mask"] = m.to(device) if m.dtype == torch.bool else m.to(device, dtype)
    return q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), kw


def _args(kw):
    return kw.get("attn_mask"), kw.get("is_causal", False), kw.get("scale"), kw.get("enable_gqa", False)


INTERPRETED_BF16_LAYOUTS = ["padding", "mla"]  # bfloat16 input under the interpreter: two layouts suffice


@pytest.mark.parametrize(("device", "name", "dtype"), [
    *[("interpreter", name, torch.float32) for name in CASES],
    *[("interpreter", name, torch.bfloat16) for name in INTERPRETED_BF16_LAYOUTS],
    *[pytest.param("cuda", name, dtype, marks=needs_cuda) for name in CASES for dtype in (torch.float32, torch.bfloat16)],
], indirect=["device"])
def test_kernel_equals_the_chunked_reference(device, name, dtype):
    """Every layout (masks boolean / additive / finfo.min, fully masked rows, causal with Tq != Tk, GQA,
    MLA's scale): the kernel's per-head max equals `chunked_max_logits` on the same tensors (float32
    accumulation of the same products in another order: to float32 round-off of the scores). On CUDA
    every layout in float32 and bfloat16; under the interpreter every layout in float32 and two in
    bfloat16 (the dtype enters the kernel through its loads and the products' input type only, not
    through the mask or layout logic)."""
    q, k, v, kw = _moved(_case(name), device, dtype)
    q = _straddle(q.float(), k.float(), kw).to(dtype)
    ref = chunked_max_logits(q, k, *_args(kw))
    got = triton_max.triton_max_logits(q, k, *_args(kw))
    assert got.dtype == torch.float32 and got.device == q.device
    torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)


def test_kernel_edge_cases(device):
    """Several row blocks with a partial last one (Tq = 130 over blocks of 64), a head dim that is not a
    power of two, no key at all (-inf), a NaN score (NaN, as torch's amax), and the calls it refuses."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 130, 24, generator=g), torch.randn(1, 2, 70, 24, generator=g)
    q, k = q.to(device), k.to(device)
    for causal in (False, True):
        torch.testing.assert_close(triton_max.triton_max_logits(q, k, is_causal=causal),
                                   chunked_max_logits(q, k, is_causal=causal), rtol=2e-6, atol=1e-6)
    empty = triton_max.triton_max_logits(q, k[:, :, :0])
    assert bool((empty == -math.inf).all())
    bad = q.clone()
    bad[0, 1, 7, 3] = math.nan
    got = triton_max.triton_max_logits(bad, k)
    assert math.isnan(float(got[1])) and torch.equal(got[0], chunked_max_logits(bad, k)[0])
    assert not triton_max.usable(q.double(), k.double())
    assert not triton_max.usable(q, k, scale=-1.0)
    assert not triton_max.usable(torch.randn(1, 1, 4, 300, device=device), torch.randn(1, 1, 4, 300, device=device))
    with pytest.raises(ValueError, match="chunked_max_logits"):
        triton_max.triton_max_logits(q.double(), k.double())


GATE_LAYOUTS = ["plain", "causal", "padding", "gqa", "negative_bias", "fully_masked_rows"]
INTERPRETED_GATE_LAYOUTS = ["gqa", "fully_masked_rows"]  # the interpreter takes 30-90 s a layout on 2 cores


@pytest.mark.parametrize(("device", "name"), [
    *[("interpreter", name) for name in INTERPRETED_GATE_LAYOUTS],
    *[pytest.param("cuda", name, marks=needs_cuda) for name in GATE_LAYOUTS],
], indirect=["device"])
def test_fused_gate_decides_like_the_exact_path(device, name):
    """The gate fused into the kernel (per block of rows, no host read): heads at 0.2 .. 3 tau get the
    exact path's clip decisions and gammas; bounded heads hold a bound <= tau above the exact max; every
    other head equals the kernel's exact max bit for bit. Every layout on CUDA; under the interpreter the
    two that exercise the kernel's head mapping and its fully masked rows (each layout's exact max is
    checked under the interpreter by `test_kernel_equals_the_chunked_reference`)."""
    q, k, v, kw = _case(name)
    q = _straddle(q, k, kw)
    if device == "cpu":  # interpreter: the CPU kernel's LSE, the Triton kernel's exact max
        out, lse = sdpa_with_lse(AttentionCall(q, k, v, **kw))
    else:
        q, k, v, kw = _moved((q, k, v, kw), device)
        lse = _reference_lse(q, k, kw)
    values, is_bound = gated_max_logits(AttentionCall(q, k, v, **kw), lse, TAU)
    exact = exact_max_logits(AttentionCall(q, k, v, **kw))
    assert torch.equal(exact, triton_max.triton_max_logits(q, k, *_args(kw)))  # the kernel is the exact path
    assert torch.equal(values > TAU, exact > TAU)
    torch.testing.assert_close(compute_gamma(values, TAU), compute_gamma(exact, TAU), rtol=0, atol=0)
    assert bool(is_bound[0]) and not bool((is_bound & (exact > TAU)).any())
    assert bool((values[is_bound] <= TAU).all()) and bool((values[is_bound] >= exact[is_bound]).all())
    assert torch.equal(values[~is_bound], exact[~is_bound])


def _reference_lse(q, k, kw):
    """The LSE of each row from the full scores (float64), for a test that checks the gate alone."""
    mask, causal, scale, gqa = _args(kw)
    kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1) if gqa else k
    s = (q.double() @ kk.double().mT) * (scale or 1 / math.sqrt(q.shape[-1]))
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril().logical_not(), -math.inf)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else s + mask.double()
    return s.logsumexp(-1).float()


# ------------------------------------------------------------------------------------------------
# CUDA only: the kernels with the LSE, end to end through the drop-in
# ------------------------------------------------------------------------------------------------

BACKENDS = ["default", "flash", "efficient", "cudnn"]


def _backend_ctx(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if name == "default":
        return contextlib.nullcontext()
    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "cudnn": SDPBackend.CUDNN_ATTENTION}[name])


@needs_cuda
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", CASES)
def test_cuda_output_and_gradients_are_sdpas_bit_for_bit(monkeypatch, name, dtype, backend):
    """On each CUDA backend SDPA can pick for the call: the gated drop-in's output and gradients equal
    F.scaled_dot_product_attention's bit for bit (the same op on the inputs SDPA gives it), and the clip
    decisions and gammas equal the exact path's. Where the backend cannot run the call, SDPA refuses it
    and so does the drop-in."""
    q, k, v, kw = _moved(_case(name), "cuda", dtype)
    q = _straddle(q.float(), k.float(), kw).to(dtype)
    monkeypatch.setattr(record_mod, "GPU_GATE_MIN_WORK", {})  # gate these small calls too
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rec = MaxLogitRecorder(q.shape[1], threshold=TAU)
    with _backend_ctx(backend):
        try:
            ref = F.scaled_dot_product_attention(*ref_leaves, **kw)
        except RuntimeError:
            with pytest.raises(RuntimeError):
                scaled_dot_product_attention(*leaves, **kw, recorder=rec)
            return
        out = scaled_dot_product_attention(*leaves, **kw, recorder=rec)
        # rows with no allowed key are undefined on some kernels (cuDNN leaves them as they come):
        # compared where defined, and given no gradient
        mask = kw.get("attn_mask")
        defined = torch.ones((), dtype=torch.bool, device="cuda")
        if mask is not None and mask.dtype == torch.bool:
            defined = mask.any(-1, keepdim=True)
        torch.testing.assert_close(torch.where(defined, out, 0), torch.where(defined, ref, 0), rtol=0, atol=0)
        grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
        grad = torch.where(defined, grad, 0)
        for a, b in zip(torch.autograd.grad(out, leaves, grad), torch.autograd.grad(ref, ref_leaves, grad)):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    exact = exact_max_logits(AttentionCall(q, k, v, **kw))
    assert torch.equal(rec.value > TAU, exact > TAU)
    torch.testing.assert_close(compute_gamma(rec.value, TAU), compute_gamma(exact, TAU), rtol=0, atol=0)
    assert bool((rec.value[rec.bounded] <= TAU).all())


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cuda_lse_is_each_kernels_and_bounds_large_logits(dtype):
    """Logits in the hundreds (tau = 100 territory): the LSE each CUDA kernel returns is the row's LSE
    (to float32 round-off of the scores) and the bound is above the exact max of every head."""
    g = torch.Generator().manual_seed(7)
    q = (torch.randn(2, 4, 96, 64, generator=g) * 6).to("cuda", dtype)
    k = (torch.randn(2, 4, 96, 64, generator=g) * 6).to("cuda", dtype)
    v = torch.randn(2, 4, 96, 64, generator=g).to("cuda", dtype)
    from muonclip.attention import lse_bound

    for backend in BACKENDS[1:]:
        with _backend_ctx(backend):
            try:
                res = sdpa_with_lse(AttentionCall(q, k, v, is_causal=True))
            except RuntimeError:
                continue
        if res is None:
            continue
        _, lse = res
        torch.testing.assert_close(lse, _reference_lse(q, k, {"is_causal": True}), rtol=1e-5, atol=1e-4)
        exact = exact_max_logits(AttentionCall(q, k, v, is_causal=True))
        assert bool((exact > 100).any())
        assert bool((lse_bound(AttentionCall(q, k, v, is_causal=True), lse) >= exact).all())


@needs_cuda
def test_cuda_gated_call_never_syncs(monkeypatch):
    """A gated training call on CUDA (bounded and exact heads mixed) runs without one device-to-host
    synchronisation: torch's sync debug mode would raise."""
    q, k, v, kw = _moved(_case("causal"), "cuda", torch.bfloat16)
    q = _straddle(q.float(), k.float(), kw).to(torch.bfloat16).requires_grad_()
    monkeypatch.setattr(record_mod, "GPU_GATE_MIN_WORK", {})
    rec = MaxLogitRecorder(q.shape[1], threshold=TAU)
    scaled_dot_product_attention(q, k, v, **kw, recorder=rec)  # first call: kernels compiled, ops looked up
    rec.reset()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = scaled_dot_product_attention(q, k, v, **kw, recorder=rec)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == q.shape and bool(rec.bounded[0]) and not bool(rec.bounded[-1])
    assert len(TARGETS) == q.shape[1]


def test_gpu_gate_threshold_rule(monkeypatch):
    """On CPU the gate always runs; on a GPU from the measured work threshold up (per dtype), so a call
    too small for the gate to pay takes the one-kernel exact path (same decisions either way), and
    never where the Triton kernel cannot run (meta tensors stand in for a GPU's)."""
    q, k = torch.empty(1, 1, 8, 8), torch.empty(1, 1, 8, 8)
    assert record_mod.gate_pays(q, k)
    meta = dict(device="meta")
    huge = torch.empty(64, 64, 4096, 128, **meta)
    assert not record_mod.gate_pays(huge, huge)  # no Triton kernel for it: no gate
    monkeypatch.setattr(triton_max, "usable", lambda *a, **kw: True)
    small = torch.empty(16, 4, 128, 32, dtype=torch.bfloat16, **meta)
    big = torch.empty(8, 16, 2048, 128, dtype=torch.bfloat16, **meta)
    assert not record_mod.gate_pays(small, small) and record_mod.gate_pays(big, big)
    f32 = torch.empty(2, 8, 2048, 64, **meta)
    assert record_mod.gate_pays(f32, f32) and not record_mod.gate_pays(f32.bfloat16(), f32.bfloat16())
