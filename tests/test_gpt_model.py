"""The reference GPT: shapes, causality, RoPE, GQA head mapping, routing, recording, config errors."""

from __future__ import annotations

import math

import pytest
import torch

import muonclip
from muonclip.models import GPT, GPTConfig
from muonclip.models._gpt import apply_rope, rope_tables


def tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32, **kw))


VARIANTS = [dict(), dict(n_kv_head=2), dict(n_kv_head=1), dict(attention="mla"),
            dict(attention="mla", q_lora_rank=8, bias=True), dict(qk_norm=True), dict(bias=True, tie_embeddings=False),
            dict(attention="mla", n_expert=4, n_expert_active=2, n_shared_expert=1)]


@pytest.mark.parametrize("kw", VARIANTS)
def test_forward_shapes_loss_and_causality(kw):
    model = tiny(**kw)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 16, 64)
    assert abs(loss.item() - math.log(64)) < 0.3 + (0.05 if kw.get("n_expert") else 0)  # near-uniform at init
    # (with experts the training loss adds 0.01 x the load-balancing loss, about 1 per layer)
    assert model(idx)[1] is None
    idx2 = idx.clone()
    idx2[:, 10:] = (idx2[:, 10:] + 1) % 64  # change the future: the past must not move
    torch.testing.assert_close(model(idx2)[0][:, :10], logits[:, :10])
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_rope_logits_depend_on_relative_position_only():
    cos, sin = rope_tables(8, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def dot(i, j):
        qi = apply_rope(q.expand(1, 1, 32, 8), cos, sin)[0, 0, i]
        kj = apply_rope(k.expand(1, 1, 32, 8), cos, sin)[0, 0, j]
        return (qi * kj).sum()

    torch.testing.assert_close(dot(5, 2), dot(20, 17), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dot(3, 3), (q * k).sum(), rtol=1e-5, atol=1e-6)


def test_gqa_equals_mha_with_repeated_kv_heads():
    """Query head h uses kv head h // group: the mapping GQALayout assumes."""
    gqa = tiny(n_kv_head=2)
    mha = tiny()
    mha.load_state_dict({k: v for k, v in gqa.state_dict().items() if not k.endswith(("k_proj.weight", "v_proj.weight"))},
                        strict=False)
    for a, b in zip(gqa.attention_modules(), mha.attention_modules()):
        for name in ("k_proj", "v_proj"):
            w = getattr(a, name).weight.view(2, 8, 32).repeat_interleave(2, dim=0).reshape(32, 32)
            getattr(b, name).weight.data.copy_(w)
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(gqa(idx)[0], mha(idx)[0], rtol=1e-5, atol=1e-5)


def test_routing_attention_to_muon_embeddings_to_adamw():
    routes = {r.name: r for r in muonclip.param_groups(tiny(attention="mla", q_lora_rank=8)).routes}
    assert routes["wte.weight"].algorithm == "adamw"
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
        assert routes[f"blocks.0.attn.{name}.weight"].algorithm == "muon"
    assert routes["blocks.0.attn.kv_a_norm.weight"].algorithm == "adamw"
    assert "lm_head.weight" not in routes  # tied: routed once, as the embedding


def test_training_mode_records_eval_does_not_and_pop_resets():
    model = tiny(attention="mla")
    idx = torch.randint(0, 64, (2, 16))
    model.eval()
    model(idx)
    assert model.pop_max_logits() == {}
    model.train()
    model(idx)
    maxima = model.pop_max_logits()
    assert set(maxima) == {"blocks.0.attn", "blocks.1.attn"} and maxima["blocks.0.attn"].shape == (4,)
    assert all(a.recorder.value is None for a in model.attention_modules())


def test_mla_shared_rotary_key_is_one_head():
    attn = tiny(attention="mla").blocks[0].attn
    assert attn.kv_a_proj_with_mqa.weight.shape == (32 + 8, 32)  # [c_kv | k_rope], k_rope shared
    assert attn.q_proj.weight.shape == (4 * (16 + 8), 32)
    assert attn.kv_b_proj.weight.shape == (4 * (16 + 16), 32)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(attention="gqa"), "attention must be"),
        (dict(n_head=3), "divisible"),
        (dict(n_kv_head=3), "multiple of n_kv_head"),
        (dict(attn_softcap=-1.0), "attn_softcap must be a finite number >= 0"),
        (dict(attention="mla", qk_rope_head_dim=3), "even"),
        (dict(n_expert=4, n_expert_active=5), "n_expert_active=5 must be between 1 and n_expert=4"),
    ],
)
def test_config_errors(kw, match):
    with pytest.raises(ValueError, match=match):
        GPTConfig(n_embd=32, **kw)


def test_sequence_longer_than_block_size():
    with pytest.raises(ValueError, match="block_size"):
        tiny()(torch.zeros(1, 17, dtype=torch.long))


def _moe_reference(moe, x):
    """Token by token: softmax over the router's scores, the top-k renormalised, each chosen expert's
    GELU MLP (its slices of the 3-D stacks), plus the shared expert; and the load-balancing loss
    E * sum_e f_e P_e with f_e the share of token-slots routed to e and P_e the mean probability."""
    flat = x.reshape(-1, x.shape[-1])
    E, k = moe.experts.num_experts, moe.top_k
    outs, counts, probs_sum = [], [0] * E, torch.zeros(E)
    for token in flat:
        p = torch.softmax(moe.router.weight @ token, dim=0)
        probs_sum += p
        top = sorted(range(E), key=lambda e: -p[e])[:k]
        y = moe.shared_expert(token)
        for e in top:
            counts[e] += 1
            h = torch.nn.functional.gelu(moe.experts.w_fc[e] @ token)
            y = y + p[e] / sum(p[j] for j in top) * (moe.experts.w_proj[e] @ h)
        outs.append(y)
    aux = E * sum(counts[e] / (len(flat) * k) * probs_sum[e] / len(flat) for e in range(E))
    return torch.stack(outs).reshape(x.shape), aux


def test_moe_equals_its_token_by_token_definition():
    torch.manual_seed(0)
    model = tiny(n_expert=4, n_expert_active=2, n_shared_expert=1, expert_hidden=24)
    moe = model.blocks[0].mlp
    assert moe.experts.w_fc.shape == (4, 24, 32) and moe.experts.w_proj.shape == (4, 32, 24)
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        got = moe(x)
        want, aux = _moe_reference(moe, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.aux_loss, aux.float(), rtol=1e-5, atol=1e-6)
    idx = torch.randint(0, 64, (2, 16))
    model.train()
    ce_plus_aux = model(idx, idx)[1]
    model.eval()
    ce = model(idx, idx)[1]  # evaluation: cross-entropy alone
    model.train()
    model(idx, idx)
    torch.testing.assert_close(ce_plus_aux, ce + 0.01 * model.aux_loss(), rtol=1e-6, atol=1e-6)


def test_muon_orthogonalises_each_expert_of_a_stack_on_its_own():
    """The experts of a 3-D stack (E, out, in) are E matrices: one Muon step on the stack equals, expert
    by expert, the step on E separate 2-D parameters with the same gradients (float32 orthogonalisation;
    a tolerance, as a batched matmul need not round like per-matrix ones). Orthogonalising the stack as
    one (E out, in) matrix would be another update."""
    torch.manual_seed(0)
    grads = torch.randn(4, 24, 32)
    stack = torch.nn.Parameter(torch.zeros(4, 24, 32))
    parts = [torch.nn.Parameter(torch.zeros(24, 32)) for _ in range(4)]
    opts = [muonclip.Muon([{"params": ps, "algorithm": "muon"}], lr=1.0, weight_decay=0.0, orth_dtype=torch.float32)
            for ps in ([stack], parts)]
    stack.grad = grads.clone()
    for p, g in zip(parts, grads):
        p.grad = g.clone()
    for o in opts:
        o.step()
    whole = muonclip.orthogonalize(grads.reshape(96, 32).float(), method="svd").reshape(4, 24, 32)
    for e in range(4):
        torch.testing.assert_close(stack.detach()[e], parts[e].detach(), rtol=1e-4, atol=1e-5)
        rms = stack.detach()[e].pow(2).mean().sqrt()
        assert 0.2 * 0.68 < rms < 0.2 * 1.13  # each expert moved by Muon's rms scale on its own
        mine, joint = -stack.detach()[e], whole[e]
        assert (mine / mine.norm() - joint / joint.norm()).norm() > 0.1  # not a block of the stack's polar factor
