"""The structural check: a normalisation inside an attention block is found by type and by name.

The families of transformers are in ``test_qkclip_families.py`` (Llama 4's ``qk_norm``, Qwen3's
``q_norm``, ...); here, attention blocks written for the test, so that each rule is shown alone.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from muonclip.integrations.families import QK_NORM_CLASSES
from muonclip.qkclip.qknorm import check_no_qk_norm, find_qk_norms


class Scale(nn.Module):
    """A module whose class name says nothing: multiplies by a learned per-feature gain."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.g


class HeadwiseUnitNorm(nn.Module):
    """A norm written by a user: its class name is all the structural check can know about it."""

    def forward(self, x):
        return nn.functional.normalize(x, dim=-1)


class Block(nn.Module):
    """Attention-like module: projections plus whatever children the test gives it."""

    def __init__(self, **children: nn.Module) -> None:
        super().__init__()
        self.layer_idx = 0
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        for name, child in children.items():
            setattr(self, name, child)


@pytest.mark.parametrize(("children", "found"), [
    ({"scaler": HeadwiseUnitNorm()}, ["scaler (HeadwiseUnitNorm)"]),  # by class name, under a neutral name
    ({"post": nn.RMSNorm(8), "mix": nn.GroupNorm(2, 8)}, ["post (RMSNorm)", "mix (GroupNorm)"]),  # torch types
    ({"q_ln": Scale(8)}, ["q_ln (Scale)"]),  # by name, whatever the class
    ({"qk_norm": Scale(8)}, ["qk_norm (Scale)"]),
    ({"norm_query": Scale(8)}, ["norm_query (Scale)"]),
    ({"q_proj": nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))}, ["q_proj.1 (LayerNorm)"]),  # inside a projection
    ({"k_norm": nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8))}, ["k_norm (Sequential)"]),  # its children not again
])
def test_norms_are_found_by_type_and_by_name(children, found):
    block = Block(**children)
    assert find_qk_norms(block) == found
    with pytest.raises(ValueError, match=r"attention layer 'layers\.0\.attn' \(Block\) normalises q/k after the "
                                         r"projection \(" + found[0].replace("(", r"\(").replace(")", r"\)")):
        check_no_qk_norm("layers.0.attn", block)


@pytest.mark.parametrize("children", [
    {},
    {"q_norm": nn.Identity(), "k_norm": nn.Identity()},  # a disabled norm
    {"rotary_emb": Scale(8), "attn_dropout": nn.Dropout(0.1), "dense": nn.Linear(8, 8)},
])
def test_blocks_without_norms_pass(children):
    block = Block(**children)
    assert find_qk_norms(block) == []
    check_no_qk_norm("layers.0.attn", block)


def test_stated_inputs_of_the_scaled_projections_are_allowed():
    """MLA's latent norms normalise the inputs of q_b_proj / kv_b_proj, which the clip scales."""
    block = Block(q_a_layernorm=nn.RMSNorm(8), kv_a_layernorm=nn.RMSNorm(8), k_norm=nn.RMSNorm(8))
    assert find_qk_norms(block, inputs=[block.q_a_layernorm, block.kv_a_layernorm]) == ["k_norm (RMSNorm)"]
    assert len(find_qk_norms(block)) == 3


def test_known_classes_are_refused_without_a_norm_module():
    assert {"Qwen3Attention", "Olmo2Attention", "Gemma3Attention"} <= set(QK_NORM_CLASSES)
    cls = type("Qwen3Attention", (Block,), {})
    block = cls()
    assert find_qk_norms(block) == []
    with pytest.raises(ValueError, match=r"\(Qwen3Attention\) normalises q/k after the projection \(Qwen3Attention "
                                         r"normalises q/k inside its forward\).*cannot bound the logits"):
        check_no_qk_norm("layers.0.attn", block)


class DispatchingBlock(Block):
    """A `Block` whose forward calls transformers' attention interface, as a transformers attention class does."""

    def forward(self, x):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        q, k, v = (t(x).view(1, -1, 2, 4).transpose(1, 2) for t in (self.q_proj, self.k_proj, self.v_proj))
        return ALL_ATTENTION_FUNCTIONS["sdpa"](self, q, k, v, None)[0]


def test_attach_refuses_a_custom_attention_with_a_norm_child():
    """The check runs in attach, on any module that calls transformers' attention interface, before anything
    is switched."""
    pytest.importorskip("transformers")
    from muonclip.integrations.hf import RECORDER_ATTR, attach

    model = nn.ModuleDict({"attn": DispatchingBlock(scaler=HeadwiseUnitNorm())})
    with pytest.raises(ValueError, match=r"attention layer 'attn' \(DispatchingBlock\) normalises q/k.*scaler "
                                         r"\(HeadwiseUnitNorm\)"):
        attach(model)
    assert not hasattr(model["attn"], RECORDER_ATTR)
