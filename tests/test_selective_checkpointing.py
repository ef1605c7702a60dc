"""Max-logit recording under selective activation checkpointing (torch's SAC).

``create_selective_checkpoint_contexts`` replays the forward's operations, counted one by one,
in the recomputation; the recording's own operations run outside its dispatch modes
(`muonclip.attention.forward_rule.unseen_by_selective_checkpointing`), so a MuonClip run with
selective checkpointing records the same maxima, clips the same heads and ends on the same
weights as without checkpointing: with a policy saving matmuls and attention, and with
torchtitan's own (its save list, every second matmul recomputed) when the torchtitan extra is
installed. Bit for bit: the recomputation runs the same kernels on the same inputs and weights,
and what SAC saved is the forward's own output.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from muonclip.attention import get_max_logit_backend, set_max_logit_backend
from muonclip.models import GPT, GPTConfig
from muonclip.qkclip import MuonClip

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
TAU = 0.8


def _gpt() -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    with torch.no_grad():  # logits above TAU in some heads, below in others
        for block in model.blocks:
            q = block.attn.q_proj.weight
            q.mul_(torch.linspace(2.0, 12.0, q.shape[0])[:, None])
            block.attn.k_proj.weight.mul_(4.0)
    return model


def _save_matmuls_and_attention(ctx, op, *args, **kwargs):
    ops = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default,
           torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
           torch.ops.aten._scaled_dot_product_efficient_attention.default,
           torch.ops.aten._scaled_dot_product_flash_attention.default)
    return CheckpointPolicy.MUST_SAVE if op in ops else CheckpointPolicy.PREFER_RECOMPUTE


def _with_policy(model: GPT) -> GPT:
    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(
            block, context_fn=functools.partial(create_selective_checkpoint_contexts, _save_matmuls_and_attention))
    return model


def _with_torchtitan_policy(model: GPT) -> GPT:
    activation_checkpoint = pytest.importorskip("torchtitan.distributed.activation_checkpoint")

    class Layers(torch.nn.Module):  # torchtitan wraps the children of a model's `layers`
        def __init__(self, blocks):
            super().__init__()
            self.layers = blocks

    activation_checkpoint.SelectiveAC.Config().build().apply(Layers(model.blocks))
    assert all(type(b).__name__ == "CheckpointWrapper" for b in model.blocks)
    return model


def _run(model: GPT):
    opt = MuonClip(model, lr=0.02, tau=TAU, orth_dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    steps = []
    for _ in range(2):
        for _ in range(2):  # two micro-batches: the recorder's second fold takes its running-max path
            x = torch.randint(0, CFG["vocab_size"], (2, 17), generator=g)
            _, loss = model(x[:, :-1], x[:, 1:])
            (loss / 2).backward()
        opt.step()
        opt.zero_grad()
        steps.append(({k.replace("_checkpoint_wrapped_module.", ""): v.clone() for k, v in opt.last_max_logits.items()},
                      {k.replace("_checkpoint_wrapped_module.", ""): v.clone() for k, v in opt.last_clipped.items()}))
    params = {n.replace("_checkpoint_wrapped_module.", ""): p.detach().clone() for n, p in model.named_parameters()}
    return steps, params


@pytest.mark.parametrize("backend", ["gated", "chunked"])
@pytest.mark.parametrize("wrap", [_with_policy, _with_torchtitan_policy], ids=["matmuls_and_attention", "torchtitan"])
def test_selective_checkpointing_records_and_clips_as_without(wrap, backend):
    before = get_max_logit_backend()
    set_max_logit_backend(backend)
    try:
        base = _gpt()
        plain_steps, plain = _run(copy.deepcopy(base))
        sac_steps, sac = _run(wrap(copy.deepcopy(base)))
    finally:
        set_max_logit_backend(before)
    n_clipped = [sum(int(c.sum()) for c in clipped.values()) for _, clipped in plain_steps]
    assert 0 < sum(n_clipped) < 2 * CFG["n_layer"] * CFG["n_head"], f"some heads clip, some not: {n_clipped}"
    for (m_a, c_a), (m_b, c_b) in zip(plain_steps, sac_steps):
        assert m_a.keys() == m_b.keys() == {"blocks.0.attn", "blocks.1.attn"}
        for name in m_a:
            assert torch.equal(m_a[name], m_b[name]) and torch.equal(c_a[name], c_b[name]), name
    assert plain.keys() == sac.keys()
    for n in plain:
        assert torch.equal(plain[n], sac[n]), n
