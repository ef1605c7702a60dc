"""The runtime check: a clip that does not act is reported, a clip that acts is not.

Rule (``muonclip.qkclip.check``): a head clipped by ``gamma <= 0.5`` trips when its next recorded
max logit is still ``>= 0.9`` of its max before the clip; a layer is reported when one of its
heads trips on two clips in a row. The unit tests feed the rule exact maxima; the model tests
hide a normalisation of q/k where no structural rule can see it (a function call in the
attention's forward, a projection that normalises its own output).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from muonclip.attention import MaxLogitRecorder, scaled_dot_product_attention
from muonclip.qkclip import (
    AttentionLayer,
    MHALayout,
    MuonClip,
    QKClipIneffectiveError,
    QKClipIneffectiveWarning,
)
from muonclip.qkclip.check import ClipCheck

TAU = 1.0

# ----------------------------------------------------------------------------------------------
# the rule, on exact maxima
# ----------------------------------------------------------------------------------------------


def _layers(*names, n_heads=4):
    return [AttentionLayer(n, MHALayout(torch.zeros(4 * n_heads, 3), torch.zeros(4 * n_heads, 3), n_heads, 4),
                           MaxLogitRecorder(n_heads)) for n in names]


def _observe(check, layers, maxima: dict, masked: bool = False) -> list[str]:
    """One clip with these maxima (what apply_qk_clip hands over: the maxima and gamma < 1); the reports."""
    s = {n: torch.tensor(v, dtype=torch.float32) for n, v in maxima.items()}
    clipped = {n: (v > TAU) & (not masked) for n, v in s.items()}
    return check.observe(layers, s, clipped, TAU)


def _reports(check, layers, *steps: dict, masked=()) -> list[str]:
    """The reports of a run of clips."""
    return [r for i, m in enumerate(steps) for r in _observe(check, layers, m, masked=i in masked)]


def test_a_head_that_keeps_its_max_on_two_clips_in_a_row_is_reported_once():
    check, layers = ClipCheck(), _layers("a", "b")
    # head 0 of "a": gamma 0.25 each time and its max stays (>= 0.9 of the previous): a no-op clip.
    # head 1: gamma 0.25, then the max falls to 0.3 of it (the clip acted). head 2: gamma 0.67, not checked.
    # "b": every clip acts.
    assert _observe(check, layers, {"a": [4.0, 4.0, 1.5, 0.5], "b": [4.0, 0.5, 0.5, 0.5]}) == []
    assert _observe(check, layers, {"a": [3.8, 1.2, 1.5, 0.5], "b": [1.1, 0.5, 0.5, 0.5]}) == []
    got = _observe(check, layers, {"a": [3.5, 0.9, 1.5, 0.5], "b": [1.05, 0.5, 0.5, 0.5]})
    assert len(got) == 1
    assert "attention layer 'a'" in got[0] and "head 0 clipped by gamma=0.263 (max logit 3.8 -> 1)" in got[0]
    assert "next recorded max logit 3.5" in got[0] and "head 1" not in got[0] and "Likely cause" in got[0]
    assert _observe(check, layers, {"a": [3.5, 0.9, 1.5, 0.5], "b": [1.0, 0.5, 0.5, 0.5]}) == []


@pytest.mark.parametrize(("second", "third", "reported"), [
    (3.61, 3.25, True),  # 3.61 >= 0.9 * 4 and 3.25 >= 0.9 * 3.61: two trips
    (3.59, 3.58, False),  # 3.59 < 0.9 * 4: the first clip acted (one update grew it by 3.59 / 1 = 3.6x)
    (3.61, 3.24, False),  # the second clip acted
])
def test_threshold_is_a_fraction_of_the_max_before_the_clip(second, third, reported):
    check, layers = ClipCheck(), _layers("a", n_heads=1)
    got = _reports(check, layers, *({"a": [v]} for v in (4.0, second, third)))
    assert bool(got) == reported


def test_a_chain_breaks_on_a_clip_too_mild_to_check():
    check, layers = ClipCheck(), _layers("a", n_heads=1)
    # trip (4 -> 3.8), then 3.8 -> 1.9 is checked against 3.8: no trip, and gamma 0.53 does not arm; 1.9 -> 1.9 ...
    assert _reports(check, layers, *({"a": [v]} for v in (4.0, 3.8, 1.9, 1.9, 1.9))) == []


def test_an_unrecorded_step_keeps_the_state_and_a_masked_step_arms_nothing():
    check, layers = ClipCheck(), _layers("a", "b", n_heads=1)
    # "a" is absent from the third clip: its trip chain goes on
    got = _reports(check, layers, {"a": [4.0], "b": [0.5]}, {"a": [4.0], "b": [0.5]}, {"b": [0.5]},
                   {"a": [4.0], "b": [0.5]})
    assert len(got) == 1 and "'a'" in got[0]
    # the masked clip scaled nothing, so the clip after it is not a test of a clip
    assert _reports(ClipCheck(), layers, *([{"a": [4.0]}] * 4), masked=(1,)) == []


def test_modes_and_reset():
    layers = _layers("a", n_heads=1)
    assert len(_reports(ClipCheck("raise"), layers, *([{"a": [4.0]}] * 3))) == 1  # MuonClip raises with it
    assert _reports(ClipCheck("ignore"), layers, *([{"a": [4.0]}] * 4)) == []
    check = ClipCheck()
    assert _reports(check, layers, {"a": [4.0]}, {"a": [4.0]}) == []
    check.reset()  # e.g. other weights loaded: the next maxima are not a test of the last clip
    assert _observe(check, layers, {"a": [4.0]}) == []
    assert len(_observe(check, layers, {"a": [4.0]})) == 0 and len(_observe(check, layers, {"a": [4.0]})) == 1
    with pytest.raises(ValueError, match="on_ineffective_clip must be one of"):
        ClipCheck("error")
    with pytest.raises(ValueError, match="on_ineffective_clip must be one of"):
        MuonClip(nn.Linear(4, 4), layers=_layers("a"), on_ineffective_clip="error")


# ----------------------------------------------------------------------------------------------
# MuonClip on models whose q/k normalisation no structural rule sees
# ----------------------------------------------------------------------------------------------

D, NH, HD, V, T = 16, 2, 8, 32, 12


class Attention(nn.Module):
    """Causal self-attention; with ``normalise`` it L2-normalises q and k per head in its forward
    (a plain function call: nothing for a structural check to find) and multiplies them by 3."""

    def __init__(self, normalise: bool) -> None:
        super().__init__()
        self.normalise = normalise
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.recorder = MaxLogitRecorder(NH)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, NH, HD).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.normalise:
            q, k = 3 * F.normalize(q, dim=-1), 3 * F.normalize(k, dim=-1)
        out = scaled_dot_product_attention(q, k, v, is_causal=True, recorder=self.recorder)
        return out.transpose(1, 2).reshape(b, t, D)


class Net(nn.Module):
    def __init__(self, normalise: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(V, D)
        self.attn = nn.ModuleList(Attention(normalise) for _ in range(2))
        self.head = nn.Linear(D, V)
        with torch.no_grad():
            for a in self.attn:
                a.q_proj.weight.mul_(3.0)
                a.k_proj.weight.mul_(3.0)

    def layers(self):
        return [AttentionLayer(f"attn.{i}", MHALayout(a.q_proj.weight, a.k_proj.weight, NH, HD), a.recorder)
                for i, a in enumerate(self.attn)]

    def forward(self, ids):
        x = self.emb(ids)
        for a in self.attn:
            x = x + a(x)
        return self.head(x)


def _train(net, opt, steps, device="cpu", same_batch=False):
    """Steps on random tokens; returns [(max logits, clipped)] of every clip, on the CPU."""
    g = torch.Generator().manual_seed(1)
    log = []
    ids = torch.randint(0, V, (4, T + 1), generator=g)
    for _ in range(steps):
        if not same_batch:
            ids = torch.randint(0, V, (4, T + 1), generator=g)
        ids = ids.to(device)
        logits = net(ids[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        log.append(({n: s.cpu() for n, s in opt.last_max_logits.items()},
                    {n: c.cpu() for n, c in opt.last_clipped.items()}))
    return log


def _armed_checks(log, tau) -> int:
    """How many (head, step) pairs the rule checked: clipped with gamma <= 0.5, then recorded."""
    n = 0
    for (s, c), (s_next, _) in zip(log, log[1:]):
        n += sum(int((c[k] & (tau / s[k] <= 0.5)).sum()) for k in s if k in s_next)
    return n


@pytest.mark.parametrize("lr", [0.0, 3e-3])
def test_hidden_normalisation_is_reported_naming_each_layer(lr):
    net = Net(normalise=True)
    opt = MuonClip(net, lr=lr, tau=TAU, layers=net.layers())
    with pytest.warns(QKClipIneffectiveWarning) as caught:
        _train(net, opt, 3)
    msgs = [str(w.message) for w in caught if issubclass(w.category, QKClipIneffectiveWarning)]
    assert len(msgs) == 2 and "attention layer 'attn.0'" in msgs[0] and "attention layer 'attn.1'" in msgs[1]
    assert all("F.normalize" in m and "plain muonclip.Muon" in m for m in msgs)
    with warnings.catch_warnings():
        warnings.simplefilter("error", QKClipIneffectiveWarning)
        _train(net, opt, 2)  # once per layer

    net = Net(normalise=True)
    opt = MuonClip(net, lr=lr, tau=TAU, layers=net.layers(), on_ineffective_clip="raise")
    with pytest.raises(QKClipIneffectiveError, match="attention layer 'attn.0'"):
        _train(net, opt, 3)


@pytest.mark.parametrize(("lr", "same_batch"), [(0.0, True), (0.02, False)])
def test_a_clip_that_acts_is_never_reported(lr, same_batch):
    """The same model without the normalisation: the clip acts, and is checked (armed heads), but
    never reported — with lr=0 on one batch the next max is exactly min(S, tau); with lr=0.02 (ten
    times a usual lr for the default adjust_lr_fn="match_rms_adamw") the updates grow the logits between clips."""
    net = Net(normalise=False)
    opt = MuonClip(net, lr=lr, tau=TAU, layers=net.layers(), on_ineffective_clip="raise")
    log = _train(net, opt, 12, same_batch=same_batch)
    assert _armed_checks(log, TAU) >= 4  # the test can tell: the rule looked at clips below 0.5


def test_a_projection_that_normalises_its_output_is_reported_on_an_hf_model():
    """attach() sees a Llama with nothing wrong (its q/k projections are Linear subclasses that
    normalise their output, under a name and class no structural rule knows); the runtime check
    reports it."""
    transformers = pytest.importorskip("transformers")

    class UnitHeads(nn.Linear):
        def forward(self, x):
            y = super().forward(x)
            return 4 * F.normalize(y.view(*y.shape[:-1], -1, 8), dim=-1).flatten(-2)

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2))
    for layer in model.model.layers:
        for name in ("q_proj", "k_proj"):
            new = UnitHeads(32, 32, bias=False)
            new.weight.data.copy_(getattr(layer.self_attn, name).weight)
            setattr(layer.self_attn, name, new)
    opt = MuonClip(model, lr=1e-3, tau=TAU, on_ineffective_clip="raise")  # attaches without complaint
    ids = torch.randint(3, V, (2, T), generator=torch.Generator().manual_seed(0))
    model.train()
    with pytest.raises(QKClipIneffectiveError, match=r"attention layer 'model\.layers\.0\.self_attn'.*Likely cause"):
        for _ in range(3):
            model(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_check_makes_no_host_sync_on_cuda_and_reports_later():
    """On CUDA the check never waits for the device (sync debug mode "error" during the steps);
    its report arrives at a later step, once the copy of the evidence has completed."""
    net = Net(normalise=True).cuda()
    opt = MuonClip(net, lr=1e-3, tau=TAU, layers=net.layers(), on_nonfinite="mask")
    g = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):  # arm, first trip, second trip: the evidence exists on the device after the third
        ids = torch.randint(0, V, (4, T + 1), device="cuda", generator=g)
        F.cross_entropy(net(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
        torch.cuda.set_sync_debug_mode("error")  # the step only: the forward is not this test's business
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()  # the third step's copy is complete: the next step reads it
    with pytest.warns(QKClipIneffectiveWarning, match="attention layer 'attn.0'"):
        _train(net, opt, 1, device="cuda")
