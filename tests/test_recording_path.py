"""One recording path: every entry point's maxima are computed by `muonclip.attention.record.maxima` and
reach a recorder only through `muonclip.attention.record.feed` (the drop-in SDPA, the reference GPT, the
Hugging Face attention function, torchtitan's SDPA and FlexAttention recorders), and the rule of which
pairs count lives in `muonclip.attention.pairs` alone. The torchtitan recorders' records equal an
explicit float64 max (FlexAttention on the CPU through its dense reference implementation).
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import pytest
import torch

import muonclip
import muonclip.attention.record as record
from muonclip import scaled_dot_product_attention
from muonclip.attention import MaxLogitRecorder
from muonclip.models import GPT, GPTConfig

SRC = Path(muonclip.__file__).parent


@pytest.fixture
def fed(monkeypatch):
    """Every recorder update, with the function that made it; and every `record.maxima` call."""
    updates, maxima = [], []
    real_update, real_maxima = MaxLogitRecorder.update, record.maxima

    def update(self, per_head, is_bound=None):
        updates.append(inspect.stack()[1].function)
        return real_update(self, per_head, is_bound)

    def counted(*args, **kwargs):
        maxima.append(1)
        return real_maxima(*args, **kwargs)

    monkeypatch.setattr(MaxLogitRecorder, "update", update)
    monkeypatch.setattr(record, "maxima", counted)
    return updates, maxima


def explicit(q, k, allowed, scale=None):
    """float64 ``scale * q.k`` per query head over the ``allowed`` (Tq, Tk) or (B, 1, Tq, Tk) pairs."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = scale * (q.double() @ k.double().transpose(-1, -2))
    return s.masked_fill(~allowed.expand_as(s), -math.inf).amax(dim=(0, 2, 3)).float()


def test_the_drop_in_and_the_gpt_go_through_the_path(fed):
    updates, maxima = fed
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    scaled_dot_product_attention(q, k, v, is_causal=True, recorder=MaxLogitRecorder(4))
    assert updates == ["feed"] and maxima == [1]
    model = GPT(GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)).train()
    model(torch.randint(0, 32, (2, 8)))
    assert updates == ["feed"] * 3 and maxima == [1] * 3


def test_the_hugging_face_function_goes_through_the_path(fed):
    transformers = pytest.importorskip("transformers")
    from muonclip.integrations.hf import attach

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).train()
    attach(model)
    updates, maxima = fed
    model(torch.randint(0, 32, (2, 8)), attention_mask=torch.tensor([[1] * 8, [1] * 5 + [0] * 3]))
    assert updates == ["feed", "feed"] and maxima == [1, 1]


def test_torchtitans_sdpa_recorder_goes_through_the_path(fed):
    pytest.importorskip("torchtitan")
    from muonclip.integrations.torchtitan_attention import RecordingSDPA

    updates, maxima = fed
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(2, 7, 4, 8, generator=g) * 3, torch.randn(2, 7, 2, 8, generator=g), torch.randn(2, 7, 2, 8)
    inner = RecordingSDPA()
    inner.muonclip_recorder = MaxLogitRecorder(4)
    out = inner(q, k, v, scale=0.3, enable_gqa=True)
    assert out.shape == (2, 7, 4, 8) and updates == ["feed"] and maxima == [1]
    want = explicit(q.transpose(1, 2), k.transpose(1, 2), torch.ones(7, 7, dtype=torch.bool).tril(), 0.3)
    torch.testing.assert_close(inner.muonclip_recorder.value, want, rtol=1e-5, atol=1e-5)


def test_torchtitans_flex_recorder_goes_through_the_path(flex_on_cpu, monkeypatch, fed):
    """torchtitan's FlexAttention with a document block mask: the record is the float64 max over each
    document's causal pairs, from FlexAttention's own max_scores; a score_mod is refused."""
    pytest.importorskip("torchtitan")
    from torch.nn.attention.flex_attention import create_block_mask
    from torchtitan.models.common.attention import FlexAttention

    from muonclip.integrations.torchtitan_attention import RecordingFlexAttention

    monkeypatch.setattr(FlexAttention, "_compiled_flex_attn", flex_on_cpu.flex_attention)
    updates, maxima = fed
    g = torch.Generator().manual_seed(2)
    q, k, v = torch.randn(1, 8, 4, 8, generator=g) * 3, torch.randn(1, 8, 4, 8, generator=g), torch.randn(1, 8, 4, 8)
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1])

    def document_causal(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    block = create_block_mask(document_causal, 1, None, 8, 8, device="cpu")
    inner = RecordingFlexAttention()
    inner.muonclip_recorder = MaxLogitRecorder(4)
    out = inner(q, k, v, attention_masks=block)
    assert out.shape == (1, 8, 4, 8) and updates == ["feed"] and maxima == [1]
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(8, 8, dtype=torch.bool).tril()
    want = explicit(q.transpose(1, 2), k.transpose(1, 2), allowed)
    torch.testing.assert_close(inner.muonclip_recorder.value, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="takes no score_mod"):
        inner(q, k, v, attention_masks=block, score_mod=lambda s, b, h, qi, ki: s)


def _sources() -> dict[str, str]:
    return {str(p.relative_to(SRC)): p.read_text(encoding="utf-8") for p in SRC.rglob("*.py")}


def test_the_rule_is_written_once():
    """Who feeds recorders, and what a masked float entry is, are each written in one module."""
    sources = _sources()
    feeds = sorted(n for n, s in sources.items() if re.search(r"\brecorders_to_feed\(", s))
    assert feeds == ["attention/forward_rule.py", "attention/record.py"]  # its definition, its one caller
    updates = sorted(n for n, s in sources.items() if re.search(r"\b(target|recorder)\.update\(", s))
    assert updates == ["attention/record.py"]
    thresholds = sorted(n for n, s in sources.items() if re.search(r"[<>]=? *(torch\.)?finfo\([^)]*\)\.min", s)
                        or re.search(r"MASKED_AT *=", s))
    assert thresholds == ["attention/pairs.py"]
