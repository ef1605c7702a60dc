"""Padding never feeds QK-Clip on a Hugging Face model: one MuonClip step with lr 0 on a padded batch moves
q/k exactly as the same rows without padding, and the recorded maxima are an independent float64 max.

The reference is computed here, never from the library's masks: each row alone, unpadded, through a
test attention function (``hf_probe``) that takes ``scale * q.k`` in float64 from the q and k the model
hands to its attention, with the causal rule built by hand. The padded batch's pads are adversarial:
a pad embedding, chosen by that float64 probe among a few seeded candidates, whose queries see the real
keys (right padding) with logits above every real one of some head that gets clipped; a
padding-free packed row's trailing pads (TRL's collator with ``pad_to_multiple_of``) whose self-logit
is the largest of the layer; a 4-D mask whose masked cross-document pair is the largest logit, with
every fill value (bool, ``-inf``, ``finfo.min``, ``-1e9``, bfloat16's ``finfo.min`` in float32).
Families: Llama, Qwen2 (q/k biases), Mistral (sliding window), GPT-OSS (sinks, sliding window); both
max-logit backends. Tiny models built from configs.

A right-padded batch given *without* its mask cannot be told from real tokens: its pads feed the clip
(shown here against the same reference), and a training forward of such a batch warns, once; nothing
warns for an unpadded batch, a masked one, a packed one, or a forward that does not feed the clip.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hf_probe  # noqa: E402
from transformers import (  # noqa: E402
    GptOssConfig,
    GptOssForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from muonclip import MuonClip  # noqa: E402
from muonclip.attention import set_max_logit_backend  # noqa: E402
from muonclip.integrations.hf import UnmaskedPaddingWarning, real_tokens  # noqa: E402

V, PAD, EOS = 96, 1, 2
SIZES = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, pad_token_id=PAD, eos_token_id=EOS, bos_token_id=0)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(params=["gated", "chunked"])
def backend(request):
    set_max_logit_backend(request.param)
    yield request.param
    set_max_logit_backend("gated")


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**SIZES))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**SIZES))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**SIZES, sliding_window=4))
    else:
        model = GptOssForCausalLM(GptOssConfig(**{**SIZES, "hidden_size": 64, "intermediate_size": 64,
                                                  "head_dim": 16}, num_local_experts=4, num_experts_per_tok=2,
                                               sliding_window=4, layer_types=["sliding_attention", "full_attention"]))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("sinks"):
                    p.normal_(0.0, 2.0)
    with torch.no_grad():  # logits of order 10: tau cuts between heads
        for layer in model.model.layers:
            q = layer.self_attn.q_proj.weight
            q.mul_(torch.linspace(10.0, 40.0, q.shape[0])[:, None])
            layer.self_attn.k_proj.weight.mul_(8.0)
    return model.float().train()


def documents(lengths=(10, 6, 8), seed=3) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, V, (n,), generator=g) for n in lengths]


def padded(docs, side: str) -> tuple[torch.Tensor, torch.Tensor]:
    t = max(len(d) for d in docs)
    ids, am = torch.full((len(docs), t), PAD), torch.zeros(len(docs), t, dtype=torch.long)
    for i, d in enumerate(docs):
        cols = slice(0, len(d)) if side == "right" else slice(t - len(d), t)
        ids[i, cols], am[i, cols] = d, 1
    return ids, am


def probe(model, batches, real_2d=None) -> dict[int, torch.Tensor]:
    """float64 per-layer, per-head max of the q.k the model hands its attention, over ``batches``
    (each a dict of model inputs); with ``real_2d`` the batch's padding queries are left out."""
    out: dict[int, torch.Tensor] = {}
    hf_probe.real_tokens(real_2d)
    try:
        for kw in batches:
            hf_probe._with_capture(model, lambda kw=kw: model(**kw, use_cache=False))
            for module in hf_probe.attention_modules(model).values():
                idx, m = module.layer_idx, hf_probe._captured[module.layer_idx]
                out[idx] = m if idx not in out else torch.maximum(out[idx], m)
    finally:
        hf_probe.real_tokens(None)
    return out


def unpadded_max(model, docs) -> dict[int, torch.Tensor]:
    """The reference: each row alone, no padding, no mask (the probe writes the causal rule itself)."""
    return probe(model, [{"input_ids": d[None]} for d in docs])


def tau_between(ref: dict[int, torch.Tensor]) -> float:
    return hf_probe.tau_between(torch.cat(list(ref.values())))


def set_pad(model, direction: torch.Tensor) -> None:
    with torch.no_grad():
        model.get_input_embeddings().weight[PAD].copy_(direction)


def adversarial_pad(model, batch, ref, tau):
    """Among seeded candidates, the pad embedding whose padding queries reach the highest logit above
    the real maximum of a head over tau (the float64 probe counting every query the mask lets see a key:
    what a clip that records padding queries would see); asserts it exceeds the real max there."""
    best, gain = None, -math.inf
    for seed in range(6):
        g = torch.Generator().manual_seed(seed)
        candidate = torch.randn(model.config.hidden_size, generator=g)
        set_pad(model, candidate)
        seen = probe(model, [batch])
        g_ = max(float((seen[i] - ref[i]).masked_fill(ref[i] <= tau, -math.inf).max()) for i in ref)
        if g_ > gain:
            best, gain = candidate, g_
    set_pad(model, best)
    assert gain > 0.05, f"no candidate pad's queries exceed a clipped head's real max (gain {gain})"


def step(model, tau, batches) -> MuonClip:
    opt = MuonClip(model, lr=0.0, weight_decay=0.0, tau=tau)
    for kw in batches:
        model(**kw, use_cache=False).logits.float().square().mean().backward()
    opt.step()
    return opt


def qk(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "q_proj" in n or "k_proj" in n}


def assert_same_step(base, tau, ref, batches, docs):
    """The padded batches' step equals the unpadded rows' step: the same recorded maxima (the float64
    reference where exact, a bound <= tau elsewhere), the same heads clipped, the same q/k."""
    with_pads, without = copy.deepcopy(base), copy.deepcopy(base)
    opt_p = step(with_pads, tau, batches)
    opt_u = step(without, tau, [{"input_ids": d[None]} for d in docs])
    for idx, (name, got) in enumerate(opt_p.last_max_logits.items()):
        exact = ~opt_p.last_bounded[name]
        torch.testing.assert_close(got[exact], ref[idx][exact], rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
        assert bool((got[~exact] <= tau).all())
        assert torch.equal(opt_p.last_clipped[name], opt_u.last_clipped[name]), name
    assert any(bool(c.any()) for c in opt_p.last_clipped.values())
    w_p, w_u, w_0 = qk(with_pads), qk(without), qk(base)
    for name in w_p:
        torch.testing.assert_close(w_p[name], w_u[name], rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")
    assert any(not torch.equal(w_p[n], w_0[n]) for n in w_p)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gpt_oss"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_batch_moves_qk_as_its_rows_without_padding(backend, family, side):
    base = build(family)
    docs = documents()
    ids, am = padded(docs, side)
    batch = {"input_ids": ids, "attention_mask": am}
    ref = unpadded_max(base, docs)
    tau = tau_between(ref)
    if side == "right":  # left padding: pad queries see only padding keys, which the mask hides
        adversarial_pad(base, batch, ref, tau)
    torch.testing.assert_close(probe(base, [batch], am), ref, rtol=1e-5, atol=1e-5)  # the probe agrees padded
    assert_same_step(base, tau, ref, [batch], docs)


@pytest.mark.parametrize("multiple", [None, 12])
def test_a_padding_free_packed_row_with_trailing_pads_moves_qk_as_its_documents(backend, multiple):
    """TRL's padding-free collator (one row, position ids restarting per document, no mask); with
    ``pad_to_multiple_of`` it appends pads at position 0 that transformers' document mask makes
    one-token documents. The pad's self-logit is made the largest of layer 0."""
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    base = build("llama")
    docs = documents((5, 7, 4))
    attn, d = base.model.layers[0].self_attn, base.config.head_dim
    best = None
    for h in range(base.config.num_attention_heads):  # the top eigenvector of W_q,h^T W_k,g: a large q.k with itself
        g = h // (base.config.num_attention_heads // base.config.num_key_value_heads)
        m = attn.q_proj.weight[h * d:(h + 1) * d].T.double() @ attn.k_proj.weight[g * d:(g + 1) * d].double()
        lam, vec = torch.linalg.eigh((m + m.T) / 2)
        best = (lam[-1], vec[:, -1]) if best is None or lam[-1] > best[0] else best
    set_pad(base, best[1].float())
    collate = DataCollatorForLanguageModeling(pad_token_id=PAD, padding_free=True, pad_to_multiple_of=multiple)
    batch = {k: v for k, v in collate([{"input_ids": x.tolist()} for x in docs]).items() if k != "labels"}
    ref = unpadded_max(base, docs)
    tau = tau_between(ref)
    if multiple:
        assert batch["input_ids"].shape[1] == 24 and "attention_mask" not in batch
        assert max(float((probe(base, [batch])[i] - ref[i]).max()) for i in ref) > 1.0, "the pads must matter"
    assert_same_step(base, tau, ref, [batch], docs)


def test_real_tokens_of_a_padding_free_row():
    """A pad is a pad-token, one-token document (TRL's trailing pads at position 0); the pad id inside
    a document, or starting one, is a real token (tokenizers that pad with eos or bos)."""
    ids = torch.tensor([[7, 1, 8, 1, 9, 2, 1, 1]])
    pos = torch.tensor([[0, 1, 0, 1, 2, 3, 0, 0]])
    assert real_tokens(ids, pos, 1).tolist() == [[True, True, True, True, True, True, False, False]]
    starts_with_pad = torch.tensor([[1, 5, 6, 1, 1]]), torch.tensor([[0, 1, 2, 0, 0]])
    assert real_tokens(*starts_with_pad, 1).tolist() == [[True, True, True, False, False]]
    assert real_tokens(ids, pos, None) is None and real_tokens(ids, None, 1) is None


@pytest.mark.parametrize("fill", ["bool", "-inf", "finfo(float32).min", "-1e9", "finfo(bfloat16).min"])
def test_a_4d_mask_masks_at_every_fill_value(backend, fill):
    """A packed row given as a 4-D mask (two documents, causal within each): its output equals the
    boolean mask's whatever the fill value, and so does the clip. The masked cross-document pair is
    the largest logit of some head (checked by the float64 probe with the pair counted)."""
    base = build("llama")
    ids = torch.randint(3, V, (1, 12), generator=torch.Generator().manual_seed(5))
    doc = torch.tensor([0] * 6 + [1] * 6)
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    emb = base.get_input_embeddings().weight
    with torch.no_grad():  # document 1's query token is document 0's first token
        emb[ids[0, 0]].mul_(6.0)
        ids[0, 8] = ids[0, 0]
    value = {"-inf": -math.inf, "finfo(float32).min": torch.finfo(torch.float32).min, "-1e9": -1e9,
             "finfo(bfloat16).min": torch.finfo(torch.bfloat16).min}.get(fill)
    mask = allowed[None, None] if fill == "bool" else torch.zeros(1, 1, 12, 12).masked_fill(~allowed, value)
    docs = [ids[0, :6], ids[0, 6:]]
    ref = unpadded_max(base, docs)
    tau = tau_between(ref)
    unmasked = probe(base, [{"input_ids": ids}])  # causal over the whole row: the cross pairs counted
    assert max(float((unmasked[i] - ref[i]).masked_fill(ref[i] <= tau, -math.inf).max()) for i in ref) > 0.05
    with torch.no_grad():
        ours = base.eval()(ids, attention_mask=mask).logits
        want = base(ids, attention_mask=allowed[None, None]).logits
    base.train()
    torch.testing.assert_close(ours, want, rtol=1e-6, atol=1e-6)
    # the documents, each alone, are the reference; here they are one row with the 4-D mask
    with_mask, alone = copy.deepcopy(base), copy.deepcopy(base)
    opt_m = step(with_mask, tau, [{"input_ids": ids, "attention_mask": mask}])
    opt_a = step(alone, tau, [{"input_ids": d[None]} for d in docs])
    for idx, name in enumerate(opt_m.last_max_logits):
        exact = ~opt_m.last_bounded[name]
        torch.testing.assert_close(opt_m.last_max_logits[name][exact], ref[idx][exact], rtol=1e-5, atol=1e-5)
        assert torch.equal(opt_m.last_clipped[name], opt_a.last_clipped[name]), name
    for name, w in qk(with_mask).items():
        torch.testing.assert_close(w, qk(alone)[name], rtol=1e-6, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("reentrant", [False, True])
def test_padding_is_left_out_under_gradient_checkpointing(reentrant):
    """The queries' padding is read off the call's own mask, so the recomputed forward of activation
    checkpointing (reentrant or not: the one that records, for reentrant) sees it too."""
    base = build("qwen2")
    docs = documents()
    ids, am = padded(docs, "right")
    batch = {"input_ids": ids, "attention_mask": am}
    ref = unpadded_max(base, docs)
    tau = tau_between(ref)
    adversarial_pad(base, batch, ref, tau)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if reentrant:
        base.enable_input_require_grads()
    assert_same_step(base, tau, ref, [batch], docs)


# ------------------------------------------------------------------------------------------------
# a padded batch given without its attention mask


def no_warning(fn):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fn()
    assert not [w for w in seen if issubclass(w.category, UnmaskedPaddingWarning)], [str(w.message) for w in seen]


def test_a_right_padded_batch_without_its_mask_feeds_the_clip_and_warns_once():
    """A hand-written loop's batch: rows right-padded, labels -100 on the pads, no attention_mask. The
    loss is the masked batch's (a causal model's real tokens never see the pads after them), but the
    pads' queries see the real keys and the clip records them: a head goes above its real maximum. On
    the old code nothing said so."""
    base = build("qwen2")
    docs = documents()
    ids, am = padded(docs, "right")
    labels = ids.masked_fill(am == 0, -100)
    ref = unpadded_max(base, docs)
    tau = tau_between(ref)
    adversarial_pad(base, {"input_ids": ids, "attention_mask": am}, ref, tau)
    masked, unmasked = copy.deepcopy(base), copy.deepcopy(base)
    opt = MuonClip(unmasked, lr=0.0, weight_decay=0.0, tau=tau)
    with pytest.warns(UnmaskedPaddingWarning, match=r"Qwen2ForCausalLM: a training batch without attention_mask "
                                                    r"whose rows 1, 2 \(of 3\) end in padding .* Pass attention_mask"):
        loss = unmasked(input_ids=ids, labels=labels).loss
    loss.backward()
    opt.step()
    gain = max(float((m - ref[i]).max()) for i, m in enumerate(opt.last_max_logits.values()))
    assert gain > 0.05, "the pads' queries must be what the clip recorded"
    no_warning(lambda: unmasked(input_ids=ids, labels=labels))  # once per model
    MuonClip(masked, lr=0.0, weight_decay=0.0, tau=tau)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnmaskedPaddingWarning)
        want = masked(input_ids=ids, attention_mask=am, labels=labels).loss
    torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-6)


def right_padded_with(docs, pad: int):
    t = max(len(d) for d in docs)
    ids = torch.full((len(docs), t), pad)
    for i, d in enumerate(docs):
        ids[i, :len(d)] = d
    lengths = torch.tensor([len(d) for d in docs])
    real = torch.arange(t)[None] < lengths[:, None]
    return ids, real.long(), ids.masked_fill(~real, -100)


@pytest.mark.parametrize(("pad_token_id", "pad", "labelled"), [(PAD, PAD, False), (EOS, EOS, False), (None, EOS, True)],
                         ids=["own pad token", "pad is eos", "no pad id, labels"])
def test_the_warning_reads_the_pad_token_or_the_labels_and_spares_real_batches(pad_token_id, pad, labelled):
    """Padding is a trailing run of the config's pad token (twice, when it is also eos; once when it is
    its own token), or the last tokens repeated with labels -100 (a config without pad_token_id, as
    Llama's). Nothing warns for: rows of one length (the pad id inside them, or a single eos at their
    end when eos pads), the padded batch with its mask, in eval mode or under no_grad, a padding-free
    packed row with trailing pads, a model that was not attached."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{**SIZES, "pad_token_id": pad_token_id})).train()
    plain = copy.deepcopy(model)
    MuonClip(model, lr=0.0, tau=100.0)
    docs = documents()
    ids, am, labels = right_padded_with(docs, pad)
    kw = {"labels": labels} if labelled else {}
    no_warning(lambda: plain(input_ids=ids, **kw))
    same = torch.stack([d[:6] for d in docs])
    same[0, 2], same[1, -1] = pad, EOS  # the pad id inside a row; a row that ends with its eos
    no_warning(lambda: model(input_ids=same, labels=same))
    no_warning(lambda: model(input_ids=ids, attention_mask=am, **kw))
    model.eval()
    no_warning(lambda: model(input_ids=ids, **kw))
    model.train()
    with torch.no_grad():
        no_warning(lambda: model(input_ids=ids, **kw))
    packed = torch.cat([*docs, torch.full((3,), pad)])[None]
    positions = torch.cat([torch.arange(len(d)) for d in docs] + [torch.zeros(3, dtype=torch.long)])[None]
    no_warning(lambda: model(input_ids=packed, position_ids=positions))
    with pytest.warns(UnmaskedPaddingWarning, match=r"rows 1, 2 \(of 3\) end in padding"):
        model(input_ids=ids, **kw)
