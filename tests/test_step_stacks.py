"""Small weights stepped in stacks (`muonclip.optim._buckets.STACK_BYTES`, `stack_runs`;
`muonclip.optim.functional.StepMomenta.write_plain`, `apply_plain`): the runs of whole 2-D
weights of one bucket whose settings agree take their momentum, V, decay and update as one call
per stack, with the update each weight gets one by one (the step with no stacks is the
reference: every run of one weight takes the per-weight path)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import muonclip
from muonclip.optim import _buckets as buckets
from muonclip.optim._buckets import stack_runs

SHAPE = (8, 16)


def _params() -> list[list[nn.Parameter]]:
    """Four groups of ``SHAPE`` weights (one group of bfloat16 weights, one weight stored
    transposed in memory), with random gradients."""
    gen = torch.Generator().manual_seed(0)

    def p(dtype=torch.float32, transposed=False):
        t = torch.randn(SHAPE[::-1], generator=gen).t() if transposed else torch.randn(SHAPE, generator=gen)
        return nn.Parameter(t.to(dtype))

    return [[p() for _ in range(4)] + [p(transposed=True)] + [p()], [p() for _ in range(3)],
            [p() for _ in range(2)], [p(torch.bfloat16) for _ in range(3)]]


def _groups(params: list[list[nn.Parameter]]) -> list[dict]:
    base = {"algorithm": "muon", "orth_dtype": torch.float32}
    return [{**base, "params": params[0], "lr": 0.1, "weight_decay": 0.5},  # a decay of 5% a step
            {**base, "params": params[1], "lr": 0.05, "weight_decay": 0.2, "momentum": 0.8, "nesterov": False,
             "cautious_weight_decay": True},
            {**base, "params": params[2], "lr": 0.1, "momentum_8bit": True},
            {**base, "params": params[3], "lr": 0.1, "weight_decay": 0.1}]


def _run(stack_bytes: int, monkeypatch, steps: int = 2, **options):
    """``steps`` Muon steps of `_params` with stacks of at most ``stack_bytes``; the weights, the
    optimizer and the length of each stack copied back (the momenta's and the weights':
    ``torch._foreach_copy_``'s lists)."""
    monkeypatch.setattr(buckets, "STACK_BYTES", stack_bytes)
    params = _params()
    flat = [p for group in params for p in group]
    opt = muonclip.Muon(_groups(params), **options)
    stacked, copy_ = [], torch._foreach_copy_

    def spy(tensors, *args, **kwargs):
        stacked.append(len(tensors))
        return copy_(tensors, *args, **kwargs)

    gen = torch.Generator().manual_seed(1)
    monkeypatch.setattr(torch, "_foreach_copy_", spy)
    for _ in range(steps):
        for p in flat:
            p.grad = torch.randn(SHAPE, generator=gen).to(p.dtype)
        opt.step()
    monkeypatch.setattr(torch, "_foreach_copy_", copy_)
    return flat, opt, stacked


def test_stacked_runs_give_each_weight_its_own_update(monkeypatch):
    """Two steps of 14 weights in four groups (decay, cautious decay without Nesterov, 8-bit
    momentum, bfloat16 weights, a weight transposed in memory): with stacks, every weight and
    every momentum equals the step taken one weight at a time; the runs stacked are the groups'
    float32 and bfloat16 weights of equal settings (the 8-bit momenta one by one)."""
    alone, opt_alone, none = _run(0, monkeypatch)
    stacked, opt, sizes = _run(2**20, monkeypatch)
    assert none == []  # the reference: nothing stacked
    assert sizes == [6, 3, 3, 6, 3, 2, 3] * 2  # per step: the momenta of groups 0, 1, 3 (2's are 8-bit), every group's weights
    for a, b in zip(alone, stacked):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        sa, sb = opt_alone.state[a], opt.state[b]
        assert sa.keys() == sb.keys()
        for key in sa:
            torch.testing.assert_close(sb[key], sa[key], rtol=1e-6, atol=1e-7)
    start = _params()
    for group_start, group_end in zip(start, [stacked[:6], stacked[6:9], stacked[9:11], stacked[11:]]):
        for p0, p1 in zip(group_start, group_end):
            assert not torch.allclose(p0.float(), p1.float(), atol=1e-3)  # every weight moved


def test_stacks_write_in_place_the_tensors_the_model_and_the_state_hold(monkeypatch):
    """The weights stay the model's objects (and a weight transposed in memory keeps its
    strides); each momentum buffer is the same tensor after a step, with the step's values."""
    params, opt, _ = _run(2**20, monkeypatch, steps=1)
    buffers = {id(p): opt.state[p].get("momentum_buffer") for p in params}
    ids = [id(p) for p in params]
    strides = [p.stride() for p in params]
    before = [b.clone() for b in buffers.values() if b is not None]
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert [id(p) for p in params] == ids and [p.stride() for p in params] == strides
    assert params[4].stride() == (1, SHAPE[0])
    after = [opt.state[p].get("momentum_buffer") for p in params]
    assert [b is buffers[id(p)] for p, b in zip(params, after)] == [True] * len(params)
    assert all(not torch.equal(b0, b1) for b0, b1 in zip(before, [b for b in after if b is not None]))


def test_a_masked_step_leaves_stacked_weights_and_momenta_as_they_were(monkeypatch):
    """``on_nonfinite="mask"``: a NaN in one gradient of a stacked run, and no weight nor
    momentum of any run changes."""
    params, opt, _ = _run(2**20, monkeypatch, steps=1, on_nonfinite="mask")
    weights = [p.detach().clone() for p in params]
    momenta = [opt.state[p]["momentum_buffer"].clone() for p in params[:6]]
    params[2].grad = torch.randn(SHAPE)
    params[2].grad[1, 1] = float("nan")
    for p in params:
        if p is not params[2]:
            p.grad = torch.randn(SHAPE).to(p.dtype)
    opt.step()
    assert all(torch.equal(w, p) for w, p in zip(weights, params))
    assert all(torch.equal(m, opt.state[p]["momentum_buffer"]) for m, p in zip(momenta, params[:6]))


def test_stack_runs_cut_at_a_change_of_key_a_lone_key_and_the_byte_bound(monkeypatch):
    """Runs of equal keys, a None key alone, at most ``STACK_BYTES`` of float32 each: a weight
    larger than the bound runs alone."""
    monkeypatch.setattr(buckets, "STACK_BYTES", 2 * 4 * 10)  # two float32 matrices of 10 elements
    keys = ["a", "a", "a", None, "a", "b", "b", "b", "b", "b"]
    assert list(stack_runs(keys, 10)) == [(0, 2), (2, 3), (3, 4), (4, 5), (5, 7), (7, 9), (9, 10)]
    assert list(stack_runs(keys, 21)) == [(i, i + 1) for i in range(10)]
    assert list(stack_runs([], 10)) == []


@pytest.mark.parametrize("nesterov", [True, False])
def test_a_stacked_run_equals_muon_update_of_each_weight(nesterov):
    """Reference: `muonclip.optim.muon_update` on each weight alone (a bucket of one, no stack)
    against one Muon step of the five, stacked."""
    gen = torch.Generator().manual_seed(2)
    weights = [torch.randn(SHAPE, generator=gen) for _ in range(5)]
    grads = [torch.randn(SHAPE, generator=gen) for _ in range(5)]
    momenta = [torch.randn(SHAPE, generator=gen) for _ in range(5)]
    params = [nn.Parameter(w.clone()) for w in weights]
    opt = muonclip.Muon([{"params": params, "algorithm": "muon"}], lr=0.1, weight_decay=0.3, nesterov=nesterov,
                        orth_dtype=torch.float32)
    for p, g, m in zip(params, grads, momenta):
        p.grad = g.clone()
        opt.state[p]["momentum_buffer"] = m.clone()
    opt.step()
    for w, g, m, p in zip(weights, grads, momenta, params):
        muonclip.optim.muon_update(w, g, m, lr=0.1, weight_decay=0.3, nesterov=nesterov, dtype=torch.float32)
        torch.testing.assert_close(p.detach(), w, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], m, rtol=1e-6, atol=1e-7)
