"""Only training forwards feed the clip (`muonclip.attention.forward_rule`), on every path; the monitor.

* The reference GPT and a Hugging Face model: a forward records into the clip's recorders iff
  the model is in training mode and grad is enabled (eval mode, ``no_grad``, ``inference_mode``
  and ``model.generate()`` do not); `MaxLogitMonitor` reads such a pass, and what it reads equals
  what a training forward on the same input records.
* `MuonClip.step` warns when it found nothing recorded (a model trained in eval mode).
* Gradient checkpointing (reentrant and not, with attention dropout): the clip's maxima, the
  clipped heads and the weights equal those of the same model without checkpointing, step by
  step, over gradient-accumulation windows whose micro-batches each hold some head's max (so a
  dropped micro-batch would show).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from muonclip import MuonClip
from muonclip.attention import MaxLogitMonitor, MaxLogitRecorder, is_training_forward
from muonclip.models import GPT, GPTConfig


def tiny_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32, **kw))


def ids(B: int = 2, T: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(seed))


def recorded(layers) -> list:
    return [layer.recorder.value for layer in layers]


# ----------------------------------------------------------------------------------------------
# the rule
# ----------------------------------------------------------------------------------------------


def test_is_training_forward_is_training_mode_and_grad_mode():
    assert is_training_forward(True)
    assert not is_training_forward(False)
    with torch.no_grad():
        assert not is_training_forward(True)
    with torch.inference_mode():
        assert not is_training_forward(True)
    with torch.no_grad(), torch.enable_grad():  # recomputation in backward runs under enable_grad
        assert is_training_forward(True)


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_gpt_records_training_forwards_only_and_the_monitor_reads_the_rest(attention):
    """Eval mode (with or without grad), no_grad and inference_mode leave the clip's recorders
    empty; the monitor sees those passes, and its maxima equal the training forward's on the same
    input bit for bit (dropout 0: the same kernels on the same inputs)."""
    model = tiny_gpt(attention=attention)
    opt = MuonClip(model, lr=0.02, tau=1e9)
    for layer in opt.layers:  # exact maxima (no LSE bounds), as the monitor's own recorders take
        layer.recorder.threshold = None
    x = ids()
    model.train()
    model(x)
    train_max = [v.clone() for v in recorded(opt.layers)]
    assert all(v is not None for v in train_max)
    for layer in opt.layers:
        layer.recorder.reset()

    monitor = MaxLogitMonitor(opt.layers)
    passes = [("eval", torch.enable_grad), ("eval", torch.no_grad), ("train", torch.no_grad),
              ("train", torch.inference_mode)]
    for mode, context in passes:
        model.train(mode == "train")
        with context():
            model(x)
            with monitor:
                model(x)
        assert recorded(opt.layers) == [None, None], (mode, context)
        for layer, expected in zip(opt.layers, train_max):
            assert torch.equal(monitor.max_logits[layer.name], expected), (mode, context)
    # a training forward inside a monitor feeds both, with the same values
    model.train()
    with monitor:
        model(x)
    for layer, expected in zip(opt.layers, train_max):
        assert torch.equal(layer.recorder.value, expected) and torch.equal(monitor.max_logits[layer.name], expected)


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, initializer_range=0.25, max_position_embeddings=64,
                      pad_token_id=0, **kw)
    return LlamaForCausalLM(cfg)


def test_hf_eval_and_generate_do_not_record_and_the_monitor_reads_them():
    """The issue's cases: ``model.eval()`` + ``no_grad`` forward, and ``model.generate()`` with the
    model left in training mode (generate runs under no_grad), record nothing; a monitor reads
    the evaluation forward with the values a training forward records."""
    pytest.importorskip("transformers")
    model = _llama()
    opt = MuonClip(model, lr=0.05, tau=0.25)
    x = ids(T=12)
    model.eval()
    with torch.no_grad():
        model(x)
    assert recorded(opt.layers) == [None, None]
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generation-config chatter
        model.generate(x[:, :6], max_new_tokens=3, do_sample=False)
    assert recorded(opt.layers) == [None, None]
    model(x)  # a training forward
    train_max = [v.clone() for v in recorded(opt.layers)]
    for layer in opt.layers:
        layer.recorder.reset()
    model.eval()
    with MaxLogitMonitor(opt.layers) as monitor, torch.no_grad():
        model(x)
    assert recorded(opt.layers) == [None, None]
    for layer, expected in zip(opt.layers, train_max):
        assert torch.equal(monitor.max_logits[layer.name], expected)


def test_step_with_nothing_recorded_warns_and_a_training_step_does_not():
    model = tiny_gpt()
    opt = MuonClip(model, lr=0.02, tau=0.01)
    x = ids()
    with torch.no_grad():  # an evaluation between steps
        model.eval()
        model(x)
    model.train()
    model(x, x)[1].backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # recorded: no warning
    assert opt.last_max_logits and any(c.any() for c in opt.last_clipped.values())
    opt.zero_grad()
    opt.step()  # no gradient, nothing recorded: nothing to say either
    model.eval()
    model(x, x)[1].backward()
    with pytest.warns(UserWarning, match=r"no attention max logit was recorded.*training mode"):
        opt.step()


# ----------------------------------------------------------------------------------------------
# the monitor
# ----------------------------------------------------------------------------------------------


def test_monitor_starts_empty_on_enter_keeps_figures_after_and_refuses_bad_input():
    model = tiny_gpt()
    opt = MuonClip(model, lr=0.02, tau=1e9)
    monitor = MaxLogitMonitor({layer.name: layer.recorder for layer in opt.layers})
    model.eval()
    with torch.no_grad():
        with monitor:
            assert monitor.active and monitor.stats() == {}
            model(ids(seed=1))
            with pytest.raises(RuntimeError, match="already active"):
                monitor.__enter__()
        assert not monitor.active
        first = dict(monitor.max_logits)
        model(ids(seed=2))  # outside the block: not seen
        assert all(torch.equal(monitor.max_logits[n], v) for n, v in first.items())
        with monitor:  # starts from nothing again
            model(ids(seed=2))
        second = dict(monitor.max_logits)
        with MaxLogitMonitor(opt.layers) as alone:
            model(ids(seed=2))
    assert set(first) == set(second) == {"blocks.0.attn", "blocks.1.attn"}
    for n in second:  # the same kernels on the same inputs
        assert torch.equal(second[n], alone.max_logits[n])
    assert any((first[n] > second[n]).any() for n in first), "the first block's record would not show"
    stats = monitor.stats(prefix="eval_")
    assert stats["eval_max_logit"] == pytest.approx(max(float(v.max()) for v in second.values()))
    for n, v in second.items():
        assert stats[f"eval_max_logit/{n}"] == pytest.approx(float(v.max()))
    assert recorded(opt.layers) == [None, None]
    monitor.reset()
    assert monitor.max_logits == {} and monitor.stats() == {}

    with pytest.raises(ValueError, match="at least one"):
        MaxLogitMonitor([])
    with pytest.raises(TypeError, match="MaxLogitRecorder"):
        MaxLogitMonitor({"a": object()})
    rec = MaxLogitRecorder(4)
    with pytest.raises(ValueError, match="given twice"):
        MaxLogitMonitor({"a": rec, "b": rec})


# ----------------------------------------------------------------------------------------------
# gradient checkpointing
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_hf_gradient_checkpointing_clips_exactly_as_without(use_reentrant):
    """transformers' gradient checkpointing, reentrant (forward under no_grad records nothing, the
    recomputation in backward records) or not (forward and recomputation both record the same
    maxima), with attention dropout 0.2: every step's maxima, clipped heads and the weights equal
    the un-checkpointed model's bit for bit. That rests on what the code guarantees: the
    recomputation runs the same kernels on the same inputs and weights, with the forward's RNG
    state restored by torch.utils.checkpoint (the same dropout masks), and the RNG stream after
    backward is the forward's (checkpoint forks it around the recomputation)."""
    pytest.importorskip("transformers")
    base = _llama(attention_dropout=0.2)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(1, 64, (2, 12), generator=g) for _ in range(6)]
    tau = 2.0

    def run(checkpointing: bool):
        model = copy.deepcopy(base)
        if checkpointing:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # gradient_checkpointing_enable is deprecated in favour of a new name
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
        opt = MuonClip(model, lr=0.02, tau=tau)
        per_micro: list[list[torch.Tensor]] = []
        orig_update = opt.layers[0].recorder.update

        def update(m, is_bound=None):  # every fold into layer 0's recorder, to tell the micro-batches apart
            per_micro.append(m.clone())
            orig_update(m, is_bound)

        opt.layers[0].recorder.update = update
        model.train()
        torch.manual_seed(5)
        steps = []
        for step in range(3):
            for mb in data[2 * step: 2 * step + 2]:
                (model(mb, labels=mb, use_cache=False).loss / 2).backward()
            opt.step()
            opt.zero_grad()
            steps.append(({k: v.clone() for k, v in opt.last_max_logits.items()},
                          {k: v.clone() for k, v in opt.last_clipped.items()}))
        return model, steps, per_micro

    plain, plain_steps, plain_micro = run(False)
    ckpt, ckpt_steps, ckpt_micro = run(True)
    assert len(plain_micro) == 6  # one fold per micro-batch without checkpointing
    # reentrant: only the recomputation records (6); non-reentrant: forward and recomputation (12)
    assert len(ckpt_micro) == (6 if use_reentrant else 12)
    mixed = sum(int(((a > b).any() & (b > a).any()).item()) for a, b in zip(plain_micro[0::2], plain_micro[1::2]))
    assert mixed > 0, "no window where both micro-batches hold some head's max: a dropped one would not show"
    for (m_a, c_a), (m_b, c_b) in zip(plain_steps, ckpt_steps):
        assert m_a.keys() == m_b.keys() == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
        for name in m_a:
            assert torch.equal(m_a[name], m_b[name]) and torch.equal(c_a[name], c_b[name]), name
    n_clipped = [sum(int(c.sum()) for c in clipped.values()) for _, clipped in plain_steps]
    assert sum(n_clipped) > 0, f"the clip should fire: {n_clipped}"
    for (n, p), q in zip(plain.named_parameters(), ckpt.parameters()):
        assert torch.equal(p, q), n
