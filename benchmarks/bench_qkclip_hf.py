"""Cost of MuonClip on a Hugging Face model: max-logit capture in forward+backward, and the clip.

Builds a small Llama (GQA) from a config (never downloads), then measures in one run:

* forward+backward time with transformers' stock ``"sdpa"`` attention vs ``"muonclip"``
  (`muonclip.integrations.hf.attach`: same SDPA output plus the chunked per-head max logit);
* ``MuonClip.step()`` vs plain ``Muon.step()`` on the same gradients (the clip's own cost);
* the clip with its runtime check (`muonclip.qkclip.check`, the default) vs without
  (``on_ineffective_clip="ignore"``), interleaved.

Usage: ``python benchmarks/bench_qkclip_hf.py [--seq 256] [--batch 2] [--reps 5]``. Prints
medians and ratios; the machine and torch version are printed too.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from muonclip.integrations.hf import attach
from muonclip.optim import Muon, param_groups
from muonclip.qkclip import MuonClip
from muonclip.qkclip.check import QKClipIneffectiveWarning


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_medians(fns: list, reps: int) -> list[float]:
    """Median wall time of each fn, runs interleaved (a, b, a, b, ...) so load changes hit both alike."""
    for fn in fns:
        fn()  # warm-up
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(reps):
        for t, fn in zip(times, fns):
            _sync()
            t0 = time.perf_counter()
            fn()
            _sync()
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2)
    stock = LlamaForCausalLM(cfg).to(args.device).train()
    ours = copy.deepcopy(stock)
    layers = attach(ours)
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device=args.device)

    def fwd_bwd(model):
        def run():
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids, use_cache=False).loss.backward()
        return run

    t_sdpa, t_ours = interleaved_medians([fwd_bwd(stock), fwd_bwd(ours)], args.reps)

    # the clip alone (all-reduce is a no-op on one process): tau small, so every head is clipped.
    # The maxima are made up (the same every time), which the runtime check rightly takes for a
    # clip without effect: its warning is silenced, its cost is what is timed.
    opt = MuonClip(ours, lr=1e-3, tau=1e-3, layers=layers)
    unchecked = MuonClip(ours, lr=1e-3, tau=1e-3, layers=layers, on_ineffective_clip="ignore")
    fwd_bwd(ours)()
    plain = Muon(param_groups(stock), lr=1e-3)
    fwd_bwd(stock)()
    clip_times: dict[str, list[float]] = {"checked": [], "unchecked": []}
    warnings.simplefilter("ignore", QKClipIneffectiveWarning)
    for _ in range(args.reps):
        for key, o in (("checked", opt), ("unchecked", unchecked)):
            for ly in layers:
                ly.recorder.update(torch.full((ly.recorder.n_heads,), 10.0, device=args.device))
            _sync()
            t0 = time.perf_counter()
            o.clip()
            _sync()
            clip_times[key].append(time.perf_counter() - t0)
    (t_step,) = interleaved_medians([plain.step], args.reps)
    t_clip, t_unchecked = (statistics.median(clip_times[k]) for k in ("checked", "unchecked"))

    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"{platform.machine()} CPU"
    print(f"device: {dev}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"Llama 4 layers, d=256, 8 q heads / 2 kv heads, batch {args.batch} x seq {args.seq}")
    print(f"forward+backward  sdpa {t_sdpa * 1e3:8.1f} ms   muonclip {t_ours * 1e3:8.1f} ms   "
          f"ratio {t_ours / t_sdpa:.3f}")
    print(f"clip (every head) {t_clip * 1e3:8.2f} ms   Muon step {t_step * 1e3:8.1f} ms   "
          f"ratio {t_clip / t_step:.3f}")
    print(f"clip with runtime check {t_clip * 1e3:8.2f} ms   without {t_unchecked * 1e3:8.2f} ms   "
          f"ratio {t_clip / t_unchecked:.3f}   (check / Muon step {(t_clip - t_unchecked) / t_step:.4f})")


if __name__ == "__main__":
    main()
