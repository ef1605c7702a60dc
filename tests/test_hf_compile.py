"""A transformers model with MuonClip attached compiles as cleanly as without it, and decides the same.

``torch._dynamo.explain`` counts the graph breaks of a training forward of a tiny Llama and a tiny
GPT-OSS (sinks) with the model's own attention and with the "muonclip" one: none, the first
training forward included, where the one-time forward check runs inside the graph as one opaque op
(and still catches an attention that drops the sinks); then two MuonClip steps of a model compiled
with ``backend="aot_eager"`` take the same clip decisions and reach the same weights as the same
steps run eagerly.
"""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM  # noqa: E402

from muonclip import MuonClip  # noqa: E402
from muonclip.attention import MaxLogitMonitor  # noqa: E402

VOCAB = 96


def llama():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=8))
    with torch.no_grad():  # logits of order 10: some heads clip at tau=3
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(torch.linspace(5.0, 25.0, 32)[:, None])
    return model.train()


def gpt_oss():
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=4, layer_types=["sliding_attention", "full_attention"])
    return GptOssForCausalLM(cfg).train()


def batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 10), generator=g)
    am = torch.ones(2, 10, dtype=torch.long)
    am[1, :3] = 0
    return ids, am


def _breaks(model, ids, am) -> int:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda: model(ids, attention_mask=am, use_cache=False).logits)()
    return explained.graph_break_count


@pytest.mark.parametrize("build", [llama, gpt_oss])
def test_no_graph_break_from_the_first_training_forward_on(build):
    """With MuonClip attached, the first training forward (where the one-time check runs, inside the
    graph) and a right-padded batch (its queries' padding read off the mask) break no more than the
    model's own attention: never. The check ran and passed."""
    from muonclip.integrations.hf_attention import CHECK_ATTR

    ids, am = batch()
    own = build()
    ours = copy.deepcopy(own)
    opt = MuonClip(ours, tau=3.0)
    assert _breaks(ours, ids, am.flip(-1)) == 0 == _breaks(own, ids, am.flip(-1))
    checks = [getattr(ours.get_submodule(ly.name), CHECK_ATTR) for ly in opt.layers]
    assert all(not c.pending and c.max_error <= c.tolerance for c in checks)
    assert all(ly.recorder.value is not None for ly in opt.layers)
    torch._dynamo.reset()


def test_the_check_inside_a_compiled_forward_still_stops_a_wrong_attention(monkeypatch):
    import dataclasses

    import muonclip.integrations.hf_attention as hf_attention
    from muonclip.integrations.hf import AttentionMismatchError

    record_attend = hf_attention.record_attend
    monkeypatch.setattr(hf_attention, "record_attend",
                        lambda call, *a, **kw: record_attend(dataclasses.replace(call, sinks=None), *a, **kw))
    model = gpt_oss()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 2.0)
    MuonClip(model, tau=3.0)
    ids, am = batch()
    torch._dynamo.reset()
    with pytest.raises(AttentionMismatchError, match=r"'model\.layers\.0\.self_attn' \(GptOssAttention\): the "
                                                     r"'muonclip' attention function's output differs"):
        torch.compile(model, backend="eager")(ids, attention_mask=am, use_cache=False)
    torch._dynamo.reset()


def test_compiled_steps_decide_and_update_as_eager():
    ids, am = batch()
    labels = ids.masked_fill(am == 0, -100)
    eager, compiled = llama(), llama()
    # float32 orthogonalisation: bfloat16 (what "auto" picks on most machines) would round the compiled and eager gradients'
    # last-bit differences into visibly different updates
    opts = [MuonClip(m, lr=0.02, tau=100.0, orth_dtype=torch.float32) for m in (eager, compiled)]
    with MaxLogitMonitor(opts[0].layers) as monitor, torch.no_grad():  # exact maxima: tau between the heads
        eager(ids, attention_mask=am, use_cache=False)
    maxima = torch.cat(list(monitor.max_logits.values())).sort().values
    for opt in opts:
        opt.tau = float(maxima[len(maxima) // 2])
    forward = torch.compile(compiled, backend="aot_eager")
    torch._dynamo.reset()
    clipped = []
    for step in range(2):
        losses = []
        for run, opt in ((eager, opts[0]), (forward, opts[1])):
            loss = run(ids, attention_mask=am, labels=labels, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6, msg=f"step {step}")
        for name in opts[0].last_clipped:
            assert torch.equal(opts[1].last_clipped[name], opts[0].last_clipped[name]), (step, name)
            exact = ~opts[0].last_bounded[name]  # eager may record heads far below tau as LSE bounds
            torch.testing.assert_close(opts[1].last_max_logits[name][exact], opts[0].last_max_logits[name][exact],
                                       rtol=1e-5, atol=1e-5)
        clipped += [bool(c.any()) for c in opts[0].last_clipped.values()]
    assert any(clipped)
    for (n, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=lambda m, n=n: f"{n}: {m}")
    torch._dynamo.reset()
