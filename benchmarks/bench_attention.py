"""Cost of max-logit capture and of the clip.

1. Time per attention call (forward) of `muonclip.scaled_dot_product_attention` with a recorder
   vs plain ``F.scaled_dot_product_attention`` (causal; float32 on CPU, bf16 on CUDA), at a few
   sequence lengths; and with GQA (Hkv = H/4). On CUDA also ``set_max_logit_backend("flex")``
   (the max comes out of the FlexAttention kernel) against plain compiled FlexAttention.
2. The QK-Clip's own cost per step (`MuonClip.clip`: gamma, row scaling, reset) vs the Muon
   step (`Muon.step`) and vs forward+backward, on a small reference GPT.

Prints ratios measured in this one run. Usage: ``python benchmarks/bench_attention.py [--device cuda]``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

import muonclip
from muonclip.attention import MaxLogitRecorder, scaled_dot_product_attention, set_max_logit_backend
from muonclip.models import GPT, GPTConfig


def timeit(fn, repeat: int, device: str, *args, **kwargs) -> float:
    """Best-of-3 mean seconds of ``fn(*args, **kwargs)`` over ``repeat`` calls."""
    fn(*args, **kwargs)
    if device == "cuda":
        torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(repeat):
            fn(*args, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / repeat)
    return best


def bench_capture(device: str) -> None:
    """Drop-in SDPA with a recorder vs plain SDPA; on CUDA also the FlexAttention backend vs
    plain compiled FlexAttention (the issue's "capture within 3% of attention"), in bf16."""
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:  # 8 shapes x (plain, with max) graphs: past dynamo's default limit of 8 it would run eager
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    print(f"attention forward, causal, {dtype}, B=2, H=8, D=64 ({device}, {torch.get_num_threads()} threads)")
    head = f"{'T':>6} {'Hkv':>4} {'sdpa ms':>9} {'drop-in ms':>11} {'ratio':>6}"
    if cuda:
        head += f" {'flex ms':>8} {'flex+max ms':>12} {'/ flex':>7} {'/ sdpa':>7}"
    print(head)
    for T in (256, 512, 1024, 2048):
        for hkv in (8, 2):
            q = torch.randn(2, 8, T, 64, device=device, dtype=dtype)
            k = torch.randn(2, hkv, T, 64, device=device, dtype=dtype)
            v = torch.randn(2, hkv, T, 64, device=device, dtype=dtype)
            rec = MaxLogitRecorder(8)
            repeat = max(1, 2048 // T) * (20 if cuda else 1)
            kw = dict(is_causal=True, enable_gqa=hkv != 8)
            t0 = timeit(F.scaled_dot_product_attention, repeat, device, q, k, v, **kw)
            t1 = timeit(scaled_dot_product_attention, repeat, device, q, k, v, **kw, recorder=rec)
            line = f"{T:>6} {hkv:>4} {1e3 * t0:>9.2f} {1e3 * t1:>11.2f} {t1 / t0:>6.2f}"
            if cuda:
                t_flex = timeit(plain_flex, repeat, device, q, k, v, hkv != 8)
                set_max_logit_backend("flex")
                try:
                    t_max = timeit(scaled_dot_product_attention, repeat, device, q, k, v, **kw, recorder=rec)
                finally:
                    set_max_logit_backend("gated")
                line += f" {1e3 * t_flex:>8.3f} {1e3 * t_max:>12.3f} {t_max / t_flex:>7.3f} {t_max / t0:>7.3f}"
            print(line, flush=True)


def plain_flex(q, k, v, enable_gqa: bool):
    """Compiled causal FlexAttention without auxiliary outputs: the baseline of the flex capture."""
    from muonclip.attention._max_logits import _causal_block_mask, _compiled_flex

    block_mask = _causal_block_mask(q.shape[2], k.shape[2], str(q.device))
    return _compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa)


def _fwd_bwd(model, idx):
    _, loss = model(idx, idx)
    loss.backward()


def _clip(opt, maxima):
    for layer, m in zip(opt.layers, maxima):
        layer.recorder.value = m
    opt.clip()


def bench_clip(device: str) -> None:
    torch.manual_seed(0)
    for attention in ("mha", "mla"):
        cfg = GPTConfig(n_layer=4, n_head=8, n_embd=256, block_size=256, attention=attention)
        model = GPT(cfg).to(device)
        opt = muonclip.MuonClip(model, lr=1e-3, tau=1e-3)  # tiny tau: every head clipped every step
        idx = torch.randint(0, 256, (8, 256), device=device)

        t_fb = timeit(_fwd_bwd, 3, device, model, idx)
        t_muon = timeit(muonclip.Muon.step, 3, device, opt)
        maxima = [layer.recorder.value.clone() for layer in opt.layers]
        t_clip = timeit(_clip, 20, device, opt, maxima)
        print(f"{attention}: fwd+bwd {1e3 * t_fb:.1f} ms, Muon step {1e3 * t_muon:.1f} ms, clip {1e3 * t_clip:.3f} ms "
              f"= {100 * t_clip / t_muon:.2f}% of the Muon step, {100 * t_clip / t_fb:.2f}% of fwd+bwd")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    print(f"torch {torch.__version__}")
    bench_capture(args.device)
    bench_clip(args.device)
