"""The rule of muonclip.qkclip.clip_targets: QK-Clip never writes a frozen, quantized or unoptimized tensor.

Every layout (MHA, GQA with each policy, MLA, fused Rows / StridedRows, q/k biases, DoRA Magnitudes):
for each tensor the layout's clip writes, making it frozen, quantized (an integer tensor, a tensor
subclass) or leaving it out of the optimizer's groups makes MuonClip refuse at construction, naming
it; a tensor the clip does not write (GQA per_head's shared keys) may be frozen. Accepted layers are
clipped exactly (head h's rows times its factor) and every other tensor keeps its bits.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from muonclip.attention import MaxLogitRecorder
from muonclip.qkclip import AttentionLayer, GQALayout, Magnitudes, MHALayout, MLALayout, MuonClip, Rows, StridedRows
from muonclip.qkclip.clip_targets import refusal

H, HD, D = 4, 4, 12


def _p(*shape, seed=0):
    return nn.Parameter(torch.randn(*shape, generator=torch.Generator().manual_seed(seed)))


class Holder(nn.Module):
    """A model that owns the layout's tensors (names = the layout fields) plus one tensor the clip never writes."""

    def __init__(self, tensors: dict[str, nn.Parameter]) -> None:
        super().__init__()
        self.t = nn.ParameterDict(tensors)
        self.other = _p(D, D, seed=99)


def _layouts():
    """name -> (tensors, make layout from the holder's tensors, the fields the clip writes)."""
    fused = lambda: _p(3 * H * HD, D, seed=1)  # noqa: E731
    return {
        "mha+bias": (
            {"q": _p(H * HD, D, seed=1), "k": _p(H * HD, D, seed=2), "qb": _p(H * HD, seed=3), "kb": _p(H * HD, seed=4)},
            lambda t: MHALayout(t["q"], t["k"], H, HD, q_bias=t["qb"], k_bias=t["kb"]),
            ["q", "k", "qb", "kb"],
        ),
        "gqa-per_head+bias": (
            {"q": _p(H * HD, D, seed=1), "k": _p(2 * HD, D, seed=2), "qb": _p(H * HD, seed=3), "kb": _p(2 * HD, seed=4)},
            lambda t: GQALayout(t["q"], t["k"], H, 2, HD, q_bias=t["qb"], k_bias=t["kb"]),
            ["q", "qb"],
        ),
        "gqa-balanced": (
            {"q": _p(H * HD, D, seed=1), "k": _p(2 * HD, D, seed=2)},
            lambda t: GQALayout(t["q"], t["k"], H, 2, HD, policy="balanced"),
            ["q", "k"],
        ),
        "mla+bias": (
            {"q": _p(H * 6, D, seed=1), "kv": _p(H * 9, 5, seed=2), "qb": _p(H * 6, seed=3), "kvb": _p(H * 9, seed=4)},
            lambda t: MLALayout(t["q"], H, 4, 2, t["kv"], 5, q_bias=t["qb"], kv_b_bias=t["kvb"]),
            ["q", "kv", "qb", "kvb"],
        ),
        "fused-rows": (
            {"qkv": fused(), "b": _p(3 * H * HD, seed=2)},
            lambda t: MHALayout(Rows(t["qkv"], 0, H * HD), Rows(t["qkv"], H * HD, 2 * H * HD), H, HD,
                                q_bias=Rows(t["b"], 0, H * HD), k_bias=Rows(t["b"], H * HD, 2 * H * HD)),
            ["qkv", "b"],
        ),
        "fused-strided": (
            {"qkv": fused()},
            lambda t: MHALayout(StridedRows(t["qkv"], 0, HD, 3 * HD, H), StridedRows(t["qkv"], HD, HD, 3 * HD, H), H,
                                HD),
            ["qkv"],
        ),
        "dora-magnitudes": (
            {"mq": _p(H * HD, seed=1), "mk": _p(2 * HD, seed=2)},
            lambda t: GQALayout(Magnitudes(t["mq"]), Magnitudes(t["mk"]), H, 2, HD, policy="balanced"),
            ["mq", "mk"],
        ),
    }


LAYOUTS = _layouts()


def _make(kind):
    tensors, make, writes = _layouts()[kind]
    model = Holder(tensors)
    layer = AttentionLayer("attn", make(model.t), MaxLogitRecorder(H))
    return model, layer, writes


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_each_written_tensor_frozen_or_outside_the_groups_is_refused_by_name(kind):
    _, _, writes = _make(kind)
    for field in writes:
        model, layer, _ = _make(kind)
        model.t[field].requires_grad_(False)
        with pytest.raises(ValueError, match=rf"'t\.{field}'.*frozen \(requires_grad=False\)"):
            MuonClip(model, tau=1.0, layers=[layer])

        model, layer, _ = _make(kind)
        groups = [{"params": [p for n, p in model.named_parameters() if n != f"t.{field}" and p.ndim >= 2]},
                  {"params": [p for n, p in model.named_parameters() if n != f"t.{field}" and p.ndim < 2],
                   "algorithm": "adamw"}]
        with pytest.raises(ValueError, match=rf"'t\.{field}'.*in none of the optimizer's param groups"):
            MuonClip(model, tau=1.0, layers=[layer], groups=[g for g in groups if g["params"]])


@pytest.mark.parametrize("kind", list(LAYOUTS))
def test_quantized_written_tensor_is_refused(kind):
    """An integer tensor (4-bit / 8-bit storage) and a Parameter subclass (bitsandbytes' Params4bit) are
    refused before any step, whatever their requires_grad."""

    class Params4bit(nn.Parameter):  # stands for bitsandbytes' class: a Parameter subclass
        pass

    _, _, writes = _make(kind)
    model, layer, _ = _make(kind)
    field = writes[0]
    packed = Params4bit(model.t[field].detach().clone())
    model.t[field] = packed
    layer = AttentionLayer("attn", _layouts()[kind][1](model.t), MaxLogitRecorder(H))
    with pytest.raises(ValueError, match=r"Params4bit \(a tensor subclass"):
        MuonClip(model, tau=1.0, layers=[layer])
    assert refusal(torch.zeros(3, dtype=torch.uint8), set()).startswith("stored as torch.uint8")
    assert refusal(torch.zeros(3, dtype=torch.float8_e4m3fn), set()).startswith("stored as torch.float8_e4m3fn")


def test_tensors_the_clip_does_not_write_may_be_frozen_and_keep_their_bits():
    """GQA per_head never writes the shared keys: a frozen k (and its bias) is accepted; the clip
    scales head h's q rows by gamma_h exactly, unclipped rows and every other tensor keep their bits."""
    model, layer, _ = _make("gqa-per_head+bias")
    model.t["k"].requires_grad_(False)
    model.t["kb"].requires_grad_(False)
    model.other.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = MuonClip(model, tau=1.0, layers=[layer], lr=0.0)
    layer.recorder.value = torch.tensor([0.5, 4.0, 1.0, 2.0])
    opt.clip()
    gamma = torch.tensor([1.0, 0.25, 1.0, 0.5]).repeat_interleave(HD)
    for n, p in model.named_parameters():
        if n in ("t.q", "t.qb"):
            factor = gamma.view(-1, *([1] * (p.ndim - 1)))
            torch.testing.assert_close(p, before[n] * factor, rtol=1e-6, atol=0.0)
            keep = gamma == 1.0
            assert torch.equal(p[keep], before[n][keep])
        else:
            assert torch.equal(p, before[n]), n


def test_magnitudes_scale_the_effective_rows_exactly():
    """W' = m * V / ||V||_row: scaling m's rows of head h by sqrt(gamma_h) (MHA) multiplies head h's logits by gamma_h."""
    torch.manual_seed(0)
    vq, vk = torch.randn(H * HD, D), torch.randn(H * HD, D)
    mq, mk = nn.Parameter(torch.rand(H * HD) + 0.5), nn.Parameter(torch.rand(H * HD) + 0.5)
    x = torch.randn(5, D)

    def logits():
        wq = mq.detach()[:, None] * vq / vq.norm(dim=1, keepdim=True)
        wk = mk.detach()[:, None] * vk / vk.norm(dim=1, keepdim=True)
        q, k = (x @ wq.T).view(5, H, HD).transpose(0, 1), (x @ wk.T).view(5, H, HD).transpose(0, 1)
        return (q.double() @ k.double().transpose(-1, -2)).amax(dim=(1, 2))

    holder = nn.Module()
    holder.mq, holder.mk = mq, mk
    layer = AttentionLayer("attn", MHALayout(Magnitudes(mq), Magnitudes(mk), H, HD), MaxLogitRecorder(H))
    opt = MuonClip(holder, tau=1.0, layers=[layer], groups=[{"params": [mq, mk], "algorithm": "adamw"}])
    s = logits()
    tau = float(s.sort().values[1:3].mean())
    opt.tau = tau
    layer.recorder.value = s.float()
    opt.clip()
    torch.testing.assert_close(logits(), s.clamp(max=tau), rtol=1e-5, atol=1e-6)


def test_magnitudes_must_be_a_vector_of_the_layout_rows():
    with pytest.raises(ValueError, match="q_weight has 15 magnitudes"):
        MHALayout(Magnitudes(torch.ones(15)), torch.ones(16, D), H, HD).check()
    with pytest.raises(ValueError, match="must be 1-D"):
        MHALayout(Magnitudes(torch.ones(16, 2)), torch.ones(16, D), H, HD).check()
