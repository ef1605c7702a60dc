"""How often the runtime check of QK-Clip (`muonclip.qkclip.check`) fires: on clips that act, and on a no-op.

A tiny Hugging Face Llama (2 layers, 4 heads of 8, q/k weights scaled up 8x so that clips fall
below gamma 0.5) trained with `MuonClip` on random tokens, for each (lr, tau) of a grid:

* **acting clip** (the stock model): of the (head, step) pairs the rule checks (clipped with
  gamma <= ARM_GAMMA, recorded at the next step), how many tripped (next max >= KEEP_RATIO of
  the max before the clip), how many tripped on STRIKES clips in a row, and how many layers
  MuonClip reported (``QKClipIneffectiveWarning``) — a report here is a false alarm;
* **no-op clip** (the same model whose q/k projections L2-normalise their output per head, so
  rescaling W_q/W_k rows changes nothing): the step at which each layer was reported.

Usage: ``python benchmarks/bench_clip_check.py [--steps 100] [--seed 0]``. Counts, no timings.
"""

from __future__ import annotations

import argparse
import platform
import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from muonclip.qkclip import MuonClip, QKClipIneffectiveWarning
from muonclip.qkclip.check import ARM_GAMMA, KEEP_RATIO, STRIKES

GRID = [(0.02, 1.0), (0.02, 0.3), (0.05, 0.5), (0.1, 0.5), (0.1, 2.0), (0.3, 0.3)]
V = 64


class UnitHeads(nn.Linear):
    """A q/k projection that L2-normalises each head's output (times 4): a hidden QK-norm."""

    def forward(self, x):
        y = super().forward(x)
        return 4 * F.normalize(y.view(*y.shape[:-1], -1, 8), dim=-1).flatten(-2)


def model(seed: int, hidden_norm: bool) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    m = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=4, head_dim=8, pad_token_id=0,
                                     bos_token_id=1, eos_token_id=2))
    for layer in m.model.layers:
        for name in ("q_proj", "k_proj"):
            old = getattr(layer.self_attn, name)
            with torch.no_grad():
                old.weight.mul_(8.0)
            if hidden_norm:
                new = UnitHeads(32, 32, bias=False)
                new.weight.data.copy_(old.weight)
                setattr(layer.self_attn, name, new)
    return m.train()


def run(lr: float, tau: float, steps: int, seed: int, hidden_norm: bool):
    """(maxima per step, clipped per step, {layer: step of its report})."""
    m = model(seed, hidden_norm)
    opt = MuonClip(m, lr=lr, tau=tau)
    g = torch.Generator().manual_seed(seed + 1)
    maxima, clipped, reported = [], [], {}
    for step in range(steps):
        ids = torch.randint(3, V, (2, 16), generator=g)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", QKClipIneffectiveWarning)
            m(ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        for w in caught:
            if issubclass(w.category, QKClipIneffectiveWarning):
                reported[str(w.message).split("'")[1]] = step
        maxima.append(torch.cat(list(opt.last_max_logits.values())))
        clipped.append(torch.cat(list(opt.last_clipped.values())))
    return torch.stack(maxima), torch.stack(clipped), reported


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"{platform.machine()} CPU, torch {torch.__version__}; rule: gamma <= {ARM_GAMMA}, next max >= "
          f"{KEEP_RATIO} x before, {STRIKES} in a row; {args.steps} steps, adjust_lr_fn='match_rms_adamw'")
    print(f"{'lr':>6} {'tau':>5} | {'acting: checked':>15} {'tripped':>8} {'in a row':>9} {'reported':>9} | "
          "no-op: reported at step (per layer)")
    for lr, tau in GRID:
        s, c, reported = run(lr, tau, args.steps, args.seed, hidden_norm=False)
        gamma = torch.where(c, tau / s, torch.ones_like(s))
        armed = c[:-1] & (gamma[:-1] <= ARM_GAMMA)
        trip = armed & (s[1:] >= KEEP_RATIO * s[:-1])
        in_row = trip[1:] & trip[:-1]
        _, _, noop = run(lr, tau, args.steps, args.seed, hidden_norm=True)
        steps = ", ".join(str(noop.get(f"model.layers.{i}.self_attn", "never")) for i in range(2))
        print(f"{lr:>6g} {tau:>5g} | {int(armed.sum()):>15} {int(trip.sum()):>8} {int(in_row.sum()):>9} "
              f"{len(reported):>9} | {steps}")


if __name__ == "__main__":
    main()
