"""What the max-logit capture costs: exact on every call, and with the LSE gate (the default).

1. Forward time of one causal attention call (float32 unless ``--dtype``) at the shapes (B, H, T, D) below
   (on a GPU also a larger one):
   ``F.scaled_dot_product_attention``; the drop-in with a recorder on the exact path
   (``set_max_logit_backend("chunked")``: on CPU the exact chunked max, on a GPU the one-kernel
   Triton max); the default drop-in with tau far above every head (no head near tau: only the bound
   is computed) and with tau below every head (every head needs its exact max). On a GPU the
   default gates only calls from ``GPU_GATE_MIN_WORK`` up (smaller ones take the exact kernel), and
   a last column times SDPA followed by the chunked max loop, without the Triton kernel.
   ``--queue N`` queues N calls per timed sample (a GPU's throughput, host work overlapping).
2. One default training step of the CLI's model (``muonclip compare``'s defaults: the reference
   GPT with 4 layers, 4 heads, width 128, context 128, batch 16, byte vocabulary): forward,
   backward and step with Muon (no capture at all), with MuonClip (tau 100, the gate) and with
   MuonClip on the exact path.

Times are medians of interleaved rounds (``timing.round_robin``: each round runs every
contender once, in a shuffled order, so load from other processes hits them alike); the
ratios are from this one run. Usage::

    python benchmarks/bench_gated_capture.py [--rounds 15] [--threads 0] [--clock wall]
    python benchmarks/bench_gated_capture.py --device cuda --dtype bfloat16 --queue 10

On a shared machine, ``--threads 1 --clock process`` measures this process's CPU time, which
other processes barely disturb.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from timing import machine, round_robin, setup_threads

from muonclip import MuonClip
from muonclip.attention import (
    MaxLogitRecorder,
    chunked_max_logits,
    scaled_dot_product_attention,
    set_max_logit_backend,
)
from muonclip.attention.record import gate_pays
from muonclip.models import GPT, GPTConfig
from muonclip.optim import Muon, param_groups

SHAPES = ((16, 4, 128, 32), (8, 8, 512, 64), (2, 8, 2048, 64))
GPU_SHAPES = ((8, 16, 2048, 128),)  # a GPU's working size: the three above are launch-bound there
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def on_backend(name: str, fn):
    """``fn`` run with the max-logit backend ``name``, the default restored after it."""
    def run():
        set_max_logit_backend(name)
        try:
            return fn()
        finally:
            set_max_logit_backend("gated")
    return run


def time_shape(B: int, H: int, T: int, D: int, rounds: int, clock: str, device: str = "cpu",
               dtype: torch.dtype = torch.float32, queue: int = 1) -> str:
    """One row of the table: the four contenders on one shape."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(device, dtype) for _ in range(3))
    far, above = MaxLogitRecorder(H, threshold=100.0), MaxLogitRecorder(H, threshold=1e-3)
    exact = MaxLogitRecorder(H)

    def call(rec):
        out = scaled_dot_product_attention(q, k, v, is_causal=True, recorder=rec)
        rec.reset()
        return out

    contenders = {
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "exact": on_backend("chunked", lambda: call(exact)),
        "far": lambda: call(far),
        "above": lambda: call(above),
    }
    if device != "cpu":  # the exact path without the Triton kernel: SDPA, then the chunked loop
        contenders["loop"] = lambda: (F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                      chunked_max_logits(q, k, is_causal=True))
    if queue > 1:  # GPU: each sample queues `queue` calls, then waits once (host work overlaps the GPU's)
        contenders = {name: (lambda fn=fn: [fn() for _ in range(queue)]) for name, fn in contenders.items()}
    times = round_robin(contenders, rounds=rounds, warmup=2, clock=clock, device=device)
    times = {name: t / queue for name, t in times.items()}
    scaled_dot_product_attention(q, k, v, is_causal=True, recorder=far)
    if gate_pays(q, k):  # on a GPU, calls below GPU_GATE_MIN_WORK take the exact kernel instead
        assert bool(far.bounded.all()), "tau 100 should be far above every head of random q, k"
    t0 = times["sdpa"]
    row = (f"| {B}, {H}, {T}, {D} | {1e3 * t0:.3f} | {1e3 * times['exact']:.3f} | {times['exact'] / t0:.2f}x "
           f"| {1e3 * times['far']:.3f} | {times['far'] / t0:.2f}x | {1e3 * times['above']:.3f} "
           f"| {times['above'] / t0:.2f}x |")
    if "loop" in times:
        row += f" {1e3 * times['loop']:.3f} | {times['loop'] / t0:.2f}x |"
    return row


def capture_table(rounds: int, clock: str, device: str, dtype: torch.dtype, queue: int) -> None:
    print("| (B, H, T, D) | SDPA fwd ms | exact capture ms | ratio | gated, no head near tau ms | ratio "
          "| gated, every head above tau ms | ratio |"
          + (" SDPA + chunked loop ms | ratio |" if device != "cpu" else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|" if device != "cpu" else ""))
    for shape in SHAPES + (GPU_SHAPES if device != "cpu" else ()):
        print(time_shape(*shape, rounds, clock, device, dtype, queue), flush=True)


def train_steps(rounds: int, clock: str, device: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
    base = GPT(cfg).to(device)
    data = torch.randint(0, 256, (16, 129), generator=torch.Generator().manual_seed(1)).to(device)
    x, y = data[:, :-1], data[:, 1:]
    autocast = torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32)

    muon_model = copy.deepcopy(base)
    for attn in muon_model.attention_modules():
        attn.recorder = None  # plain SDPA: Muon's step without any capture
    muon = Muon(param_groups(muon_model), lr=1e-2, weight_decay=0.1)
    clip_model, exact_model = copy.deepcopy(base), copy.deepcopy(base)
    clip = MuonClip(clip_model, lr=1e-2, tau=100.0, weight_decay=0.1)
    clip_exact = MuonClip(exact_model, lr=1e-2, tau=100.0, weight_decay=0.1)

    def step(model, opt):
        def run():
            with autocast:
                _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return run

    times = round_robin({
        "muon": step(muon_model, muon),
        "muonclip": step(clip_model, clip),
        "muonclip_exact": on_backend("chunked", step(exact_model, clip_exact)),
    }, rounds=rounds, warmup=2, clock=clock, device=device)
    t = times["muon"]
    print("\n| train step (CLI default model, batch 16 x 128) | ms | / Muon |")
    print("|---|---|---|")
    for name, label in (("muon", "Muon (no capture)"), ("muonclip", "MuonClip, gated capture (default)"),
                        ("muonclip_exact", "MuonClip, exact on every call (backend \"chunked\")")):
        print(f"| {label} | {1e3 * times[name]:.1f} | {times[name] / t:.3f}x |")
    stats = clip.clip_stats()
    print(f"\n(MuonClip's last step: max_logit {stats['max_logit']:.2f}, "
          f"{'an LSE bound' if stats['max_logit_is_bound'] else 'exact'}; tau 100)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=15, help="timed rounds per contender (median reported)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave torch's default)")
    ap.add_argument("--clock", choices=["wall", "process"], default="wall",
                    help="wall time, or this process's CPU time (with --threads 1: insensitive to other processes)")
    ap.add_argument("--skip-train", action="store_true", help="only the attention table")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                    help="attention inputs' dtype (the train step runs under autocast to it)")
    ap.add_argument("--queue", type=int, default=1,
                    help="calls queued per timed sample before one sync (GPU: >1 measures throughput)")
    args = ap.parse_args()
    if args.threads:
        setup_threads(args.threads)
    dtype = DTYPES[args.dtype]
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else machine()
    print(f"# bench_gated_capture: {name}; torch {torch.__version__}; {args.dtype}, causal; clock={args.clock}; "
          f"median of {args.rounds} interleaved rounds; {args.queue} call(s) queued per sample\n")
    capture_table(args.rounds, args.clock, args.device, dtype, args.queue)
    if not args.skip_train:
        train_steps(args.rounds, args.clock, args.device, dtype)


if __name__ == "__main__":
    main()
