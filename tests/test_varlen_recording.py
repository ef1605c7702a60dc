"""QK-Clip's max logits on packed documents (a varlen kernel: torchtitan's ``attn_backend="varlen"``).

torch's ``varlen_attn`` runs on CUDA only; here a per-document float64 reference kernel with the same
signature and the same ``cu_seq_lens`` stands in for it (`_reference_varlen`), and every max is checked
against a per-document float64 brute force (`_reference_max`):

* the LSE gate on documents: heads above tau exact, the others bounds at or below tau that are not below
  their exact max; exact maxima for every head without a threshold; a document-blind max would differ
  (the data puts a larger logit across a document boundary), so the test sees the pair rule;
* torchtitan's ``VarlenAttention`` recorder (`RecordingVarlen`) on CPU: its output and the LSE handed to
  ``out_transform`` are the kernel's, its recorder holds the reference maxima; GQA;
* refusals: SDPA given documents, documents with a batch, sliding windows, cross-attention metadata.

The CUDA run of the real kernel is in benchmarks/gpu_check.sh (``tests`` part, ``-k cuda``).
"""

from __future__ import annotations

import math

import pytest
import torch

from muonclip.attention import MaxLogitRecorder
from muonclip.attention.call import AttentionCall
from muonclip.attention.documents import document_max_logits
from muonclip.attention.pairs import clip_pairs
from muonclip.attention.record import attend

CU = [2, 7, 8, 20, 29]  # tokens 0-1 and 29-31 in no document; a one-token document; T = 32
T, HQ, HKV, D = 32, 4, 2, 8


def _reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size=(-1, -1),
                      enable_gqa=False, **_):
    """torch's varlen_attn computed per document in float64: output (T, Hq, Dv), LSE (Hq, T) when asked."""
    t, hq, d = q.shape
    g = hq // k.shape[1]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(t, hq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((hq, t), -math.inf, dtype=torch.float64)
    cu = cu_q.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        qd = q[a:b].double().transpose(0, 1)
        kd = k[a:b].double().transpose(0, 1).repeat_interleave(g, 0)
        vd = v[a:b].double().transpose(0, 1).repeat_interleave(g, 0)
        s = scale * qd @ kd.transpose(1, 2)
        if tuple(window_size) == (-1, 0):
            s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), -math.inf)
        lse[:, a:b] = s.logsumexp(-1)
        out[a:b] = (s.softmax(-1) @ vd).transpose(0, 1)
    out = out.to(q.dtype)
    return out if return_aux is None else (out, lse.float())


def _reference_max(q, k, cu, causal, scale=None):
    """(Hq,) float64: per head, the max of scale * q.k over the pairs within each document."""
    hq, g = q.shape[1], q.shape[1] // k.shape[1]
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    best = torch.full((hq,), -math.inf, dtype=torch.float64)
    for a, b in zip(cu[:-1], cu[1:]):
        s = scale * q[0, :, a:b].double() @ k[0, :, a:b].double().repeat_interleave(g, 0).transpose(1, 2)
        if causal:
            s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), -math.inf)
        best = torch.maximum(best, s.amax(dim=(1, 2)))
    return best


def _qkv(seed=0):
    """(1, H, T, D) q, k, v; heads 0 and 2 scaled up (above tau 3), and a large logit across the boundary
    of documents 0 and 1 that no allowed pair has."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HQ, T, D, generator=g)
    k = torch.randn(1, HKV, T, D, generator=g)
    v = torch.randn(1, HKV, T, D, generator=g)
    q[:, 0] *= 4
    q[:, 2] *= 3
    q[:, 1] *= 0.2
    q[:, 3] *= 0.2
    q[0, 1, 7] = 6 * k[0, 0, 6] / k[0, 0, 6].norm()  # query 7 (document 1) along key 6 (document 0)
    return q, k, v


class _RefKernel:
    """The recording path's kernel with `_reference_varlen` for torch's varlen kernel."""

    row_max_only = False

    def __init__(self, causal):
        self.window = (-1, 0) if causal else (-1, -1)

    def run(self, call, lse):
        q, k, v = (t[0].transpose(0, 1) for t in (call.query, call.key, call.value))
        cu = call.cu_seq_lens
        out, row_lse = _reference_varlen(q, k, v, cu, cu, 0, 0, return_aux=True, scale=call.scale,
                                         window_size=self.window, enable_gqa=call.enable_gqa)
        return out.transpose(0, 1).unsqueeze(0), row_lse.unsqueeze(0) if lse else None

    def run_with_row_max(self, call):
        return None


@pytest.mark.parametrize("causal", [True, False])
def test_the_gate_on_documents_is_exact_above_tau_and_a_bound_below(causal):
    q, k, v = _qkv()
    cu = torch.tensor(CU, dtype=torch.int32)
    call = AttentionCall(q, k, v, is_causal=causal, enable_gqa=True, cu_seq_lens=cu)
    want = _reference_max(q, k, CU, causal)
    blind = AttentionCall(q, k, v, is_causal=True, enable_gqa=True)  # one packed row, no documents
    from muonclip.attention import exact_max_logits

    assert (exact_max_logits(blind).double() > want + 1).any()  # a cross-document pair would be the max
    tau = 3.0
    assert (want > tau).any() and (want < tau).any()
    rec = MaxLogitRecorder(HQ, threshold=tau)
    out = attend(call, rec, True, _RefKernel(causal))
    above = want > tau
    torch.testing.assert_close(rec.value[above].double(), want[above], rtol=1e-5, atol=1e-5)
    assert not rec.bounded[above].any() and rec.bounded[~above].any()  # the gate skipped a head
    assert (rec.value[~above] <= tau).all() and (rec.value[~above].double() >= want[~above] - 1e-5).all()
    # without a threshold: every head exact; the output is the kernel's
    exact = MaxLogitRecorder(HQ)
    out2 = attend(call, exact, True, _RefKernel(causal))
    torch.testing.assert_close(exact.value.double(), want, rtol=1e-5, atol=1e-5)
    assert not exact.bounded.any()
    assert torch.equal(out, out2)
    torch.testing.assert_close(document_max_logits(call, torch.tensor([2, 0])).double(), want[[2, 0]], rtol=1e-5,
                               atol=1e-5)


def test_the_pair_rule_with_documents_is_same_document_and_causal():
    cu = torch.tensor(CU)
    mask, causal = clip_pairs(None, True, T, T, cu_seq_lens=cu)
    assert causal is False
    want = torch.zeros(T, T, dtype=torch.bool)
    for a, b in zip(CU[:-1], CU[1:]):
        want[a:b, a:b] = torch.ones(b - a, b - a, dtype=torch.bool).tril()
    assert torch.equal(mask[0, 0], want)


def test_documents_are_refused_where_they_cannot_hold():
    q, k, v = _qkv()
    cu = torch.tensor(CU)
    with pytest.raises(ValueError, match="SDPA has no packed documents"):
        attend(AttentionCall(q, k, v, is_causal=True, enable_gqa=True, cu_seq_lens=cu), MaxLogitRecorder(HQ), True)
    with pytest.raises(ValueError, match="batch 1"):
        AttentionCall(q.expand(2, -1, -1, -1), k.expand(2, -1, -1, -1), v, cu_seq_lens=cu)
    with pytest.raises(ValueError, match="no attn_mask"):
        AttentionCall(q, k, v, attn_mask=torch.ones(T, T, dtype=torch.bool), cu_seq_lens=cu)
    with pytest.raises(ValueError, match="1-D integer"):
        AttentionCall(q, k, v, cu_seq_lens=torch.tensor([0.0, 4.0]))


def _torchtitan():
    return pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed")


def test_torchtitans_varlen_attention_records_the_reference_maxima(monkeypatch):
    """`RecordingVarlen` on CPU with `_reference_varlen` in place of torch's kernel: output, the LSE given to
    out_transform, and the recorded maxima (bf16 inputs, as torchtitan's varlen path casts them)."""
    _torchtitan()
    import torch.nn.attention.varlen as tv
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from muonclip.integrations.torchtitan_attention import RecordingVarlen

    monkeypatch.setattr(tv, "varlen_attn", _reference_varlen)
    B, L = 2, 16
    positions = torch.cat([torch.arange(5), torch.arange(11), torch.arange(9), torch.arange(7)]).view(B, L)
    meta = create_varlen_metadata_for_document(positions)
    cu = meta.cu_seq_q.tolist()
    q, k, v = _qkv(1)
    q_BLNH, k_BLNH, v_BLNH = (t[0].transpose(0, 1).reshape(B, L, -1, D) for t in (q, k, v))
    tau = 3.0
    m = RecordingVarlen(RecordingVarlen.Config(window_size=(-1, 0)))
    m.muonclip_recorder = MaxLogitRecorder(HQ, threshold=tau)
    m.train()
    seen = {}

    def out_transform(out, lse):
        seen["lse"] = lse
        return out * 2

    got = m(q_BLNH, k_BLNH, v_BLNH, attention_masks=meta, enable_gqa=True, out_transform=out_transform)
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    ref_out, ref_lse = _reference_varlen(*(t[0].transpose(0, 1) for t in bf), meta.cu_seq_q, meta.cu_seq_k, 0, 0,
                                         return_aux=True, window_size=(-1, 0), enable_gqa=True)
    assert torch.equal(got, 2 * ref_out.reshape(B, L, HQ, D).float())
    assert torch.equal(seen["lse"], ref_lse.transpose(0, 1).reshape(B, L, HQ))
    want = _reference_max(bf[0], bf[1], cu, causal=True)
    rec = m.muonclip_recorder
    above = want > tau
    assert above.any() and (~above).any()
    torch.testing.assert_close(rec.value[above].double(), want[above], rtol=1e-5, atol=1e-5)
    assert (rec.value[~above] <= tau).all() and (rec.value[~above].double() >= want[~above] - 1e-5).all()
    # evaluation: nothing recorded; output unchanged
    rec.reset()
    m.eval()
    assert torch.equal(m(q_BLNH, k_BLNH, v_BLNH, attention_masks=meta, enable_gqa=True), ref_out.reshape(B, L, HQ, D)
                       .float())
    assert rec.value is None


def test_varlen_refusals_and_the_config_swap():
    _torchtitan()
    from torchtitan.models.common.attention import VarlenMetadata
    from torchtitan.models.llama3.config_registry import llama3_debugmodel_varlen_attn

    from muonclip.integrations.torchtitan import with_muonclip
    from muonclip.integrations.torchtitan_attention import RecordingSDPA, RecordingVarlen

    with pytest.raises(ValueError, match="window_size"):
        RecordingVarlen(RecordingVarlen.Config(window_size=(128, 0)))
    m = RecordingVarlen()
    x = torch.zeros(1, 4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seq_k must be cu_seq_q"):
        m(x, x, x, attention_masks=VarlenMetadata(cu, torch.tensor([0, 2], dtype=torch.int32), 4, 4))
    # with_muonclip keeps torchtitan's varlen backend on CUDA (its window too), SDPA on CPU
    for device, kind in (("cuda", RecordingVarlen), ("cpu", RecordingSDPA)):
        cfg = with_muonclip(llama3_debugmodel_varlen_attn(), device_type=device)
        inner = [c for _, c, _, a in cfg.model_spec.model.traverse(kind.Config) if a == "inner_attention"]
        assert len(inner) == 6 and all(type(c) is kind.Config for c in inner), device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's varlen kernel runs on CUDA only")
def test_cuda_varlen_kernel_records_the_per_document_reference():
    """torch's own varlen_attn (FlashAttention) under `RecordingVarlen`: output against the float64 reference
    (bf16 tolerance), the LSE gate's maxima exact above tau, bounds at or below it; run by
    benchmarks/gpu_check.sh."""
    _torchtitan()
    from torchtitan.models.common.attention import create_varlen_metadata_for_document

    from muonclip.integrations.torchtitan_attention import RecordingVarlen

    B, L = 2, 16
    positions = torch.cat([torch.arange(5), torch.arange(11), torch.arange(9), torch.arange(7)]).view(B, L).cuda()
    meta = create_varlen_metadata_for_document(positions)
    cu = meta.cu_seq_q.tolist()
    q, k, v = _qkv(1)
    q_BLNH, k_BLNH, v_BLNH = (t[0].transpose(0, 1).reshape(B, L, -1, D).cuda() for t in (q, k, v))
    tau = 3.0
    m = RecordingVarlen(RecordingVarlen.Config(window_size=(-1, 0))).cuda()
    m.muonclip_recorder = MaxLogitRecorder(HQ, threshold=tau)
    m.train()
    got = m(q_BLNH, k_BLNH, v_BLNH, attention_masks=meta, enable_gqa=True)
    bf = [t.to(torch.bfloat16) for t in (q, k, v)]
    ref_out = _reference_varlen(*(t[0].transpose(0, 1) for t in bf), meta.cu_seq_q.cpu(), meta.cu_seq_k.cpu(), 0, 0,
                                window_size=(-1, 0), enable_gqa=True)
    torch.testing.assert_close(got.cpu(), ref_out.reshape(B, L, HQ, D).float(), rtol=2e-2, atol=2e-2)
    want = _reference_max(bf[0], bf[1], cu, causal=True)
    rec = m.muonclip_recorder
    above = want > tau
    assert above.any() and (~above).any()
    torch.testing.assert_close(rec.value.cpu()[above].double(), want[above], rtol=1e-5, atol=1e-5)
    assert (rec.value.cpu()[~above] <= tau).all() and (rec.value.cpu()[~above].double() >= want[~above] - 1e-5).all()
