"""Cost of the logging callbacks' measurements per training step (muonclip.qkclip.step_metrics).

    python benchmarks/bench_integrations.py [--steps 20]

Trains the reference GPT (4 layers, width 128, block 128, batch 8, CPU) with MuonClip and times
whole steps (forward + backward + step) three ways, interleaved step by step so machine load
hits all alike: bare; with `StepMetrics(update_rms=False)` (clip_stats only: one host sync);
with `StepMetrics()` (also update_rms: one copy of the hidden matrices and a reduction).
Prints the median step times and their ratios to the bare step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from muonclip import MuonClip
from muonclip.models import GPT, GPTConfig
from muonclip.qkclip.step_metrics import StepMetrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128))
    opt = MuonClip(model, lr=1e-3, tau=100.0)
    x = torch.randint(0, 256, (8, 128))
    y = torch.randint(0, 256, (8, 128))
    variants = {
        "bare": None, "clip_stats only": StepMetrics(update_rms=False), "clip_stats + update_rms": StepMetrics(),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}

    def step(metrics: StepMetrics | None) -> float:
        t0 = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        if metrics is not None:
            metrics.before_step(opt)
        opt.step()
        if metrics is not None:
            metrics.after_step()
        opt.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up
        step(None)
    for _ in range(args.steps):
        for name, metrics in variants.items():
            times[name].append(step(metrics))
    base = statistics.median(times["bare"])
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, {args.steps} steps each")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<26} median step {1000 * med:7.1f} ms   ratio to bare {med / base:.3f}")


if __name__ == "__main__":
    main()
