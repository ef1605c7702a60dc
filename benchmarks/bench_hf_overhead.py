"""What attaching MuonClip costs: the one-time forward check, and a training step with vs without MuonClip.

Measured in one run, timed round-robin (timing.py; median of the rounds):

* **The one-time forward check** (`muonclip.integrations.hf_check`): the first training step
  (forward + backward) of a freshly attached model with the check vs with
  ``attach(model, verify_attention=False)``, for a small HF Llama (the check runs transformers'
  SDPA function) and a small GPT-OSS (its eager attention, with sinks). The difference is the
  check's own cost; it is paid once per model.
* **A training step** (forward + backward + optimizer step, after warm-up) of the same HF Llama
  with its own SDPA attention and ``muonclip.Muon``, vs with MuonClip attached
  (``MuonClip(model)``: the "muonclip" attention function, the LSE gate at tau, the clip); and
  its forward + backward alone (where attaching changes anything: the attention function);
* **the CLI model** (`muonclip.models.GPT`, the `muonclip compare` default shape): recording
  off (each attention's recorder removed) with ``muonclip.Muon``, vs the same model with its
  recorders (exact max logits, what ``--optimizer muon`` runs), vs ``MuonClip`` (the gate at tau
  and the clip).

Every optimizer orthogonalises in float32 (``orth_dtype``: bfloat16 matmuls are emulated on CPUs
without AMX and would dominate every step). Usage: ``python benchmarks/bench_hf_overhead.py
[--threads 1] [--rounds 7] [--clock process] [--batch 4] [--seq 256]``. Prints the machine, the
medians and the ratios.
"""

from __future__ import annotations

import argparse
import copy
import warnings

import torch
import transformers
from timing import machine, round_robin, setup_threads
from transformers import GptOssConfig, GptOssForCausalLM, LlamaConfig, LlamaForCausalLM

from muonclip import Muon, MuonClip, param_groups
from muonclip.integrations.hf import attach
from muonclip.models import GPT, GPTConfig

VOCAB = 1024


def hf_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4)
    return LlamaForCausalLM(cfg).train()


def hf_gpt_oss() -> GptOssForCausalLM:
    torch.manual_seed(0)
    cfg = GptOssConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=4, head_dim=32, num_local_experts=4,
                       num_experts_per_tok=2, sliding_window=64)
    return GptOssForCausalLM(cfg).train()


def first_step(build, ids, verify: bool):
    """A fresh model, attached, and its first training forward + backward (the check runs there)."""
    def run():
        model = build()
        attach(model, verify_attention=verify)
        model(ids, labels=ids, use_cache=False).loss.backward()
    return run


def hf_step(model, opt, ids):
    def run():
        model(ids, labels=ids, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def gpt_step(model, opt, ids):
    def run():
        _, loss = model(ids[:, :-1], ids[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return run


def report(title: str, times: dict[str, float], base: str) -> None:
    print(f"\n{title}")
    for name, t in times.items():
        print(f"  {name:<44} {1e3 * t:9.1f} ms   {t / times[base]:5.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--clock", default="process", choices=["process", "wall"])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    transformers.logging.set_verbosity_error()
    setup_threads(args.threads)
    print(f"{machine()}; transformers {transformers.__version__}; clock {args.clock}")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), generator=g)
    timing = dict(rounds=args.rounds, warmup=1, clock=args.clock)

    times = round_robin({
        "Llama: first step, with the check": first_step(hf_llama, ids, True),
        "Llama: first step, verify_attention=False": first_step(hf_llama, ids, False),
        "GPT-OSS: first step, with the check": first_step(hf_gpt_oss, ids, True),
        "GPT-OSS: first step, verify_attention=False": first_step(hf_gpt_oss, ids, False),
    }, **timing)
    print(f"\n(B, T) = ({args.batch}, {args.seq}); the check's own cost, paid once per model:")
    for fam in ("Llama", "GPT-OSS"):
        on, off = times[f"{fam}: first step, with the check"], times[f"{fam}: first step, verify_attention=False"]
        print(f"  {fam:<8} first step {1e3 * off:7.1f} ms without the check, {1e3 * on:7.1f} ms with it: "
              f"+{1e3 * (on - off):6.1f} ms ({on / off:4.2f}x)")

    own = hf_llama()
    ours = copy.deepcopy(own)
    f32 = dict(orth_dtype=torch.float32)  # bfloat16 matmuls are emulated on CPUs without AMX
    steps = {
        "HF Llama, own SDPA + Muon": hf_step(own, Muon(param_groups(own), lr=1e-3, **f32), ids),
        "HF Llama, MuonClip attached": hf_step(ours, MuonClip(ours, lr=1e-3, tau=100.0, **f32), ids),
        "HF Llama, own SDPA: forward + backward": lambda: own(ids, labels=ids, use_cache=False).loss.backward(),
        "HF Llama, MuonClip attached: forward + backward": lambda: ours(ids, labels=ids,
                                                                       use_cache=False).loss.backward(),
    }
    ours(ids, labels=ids, use_cache=False)  # the one-time check, before timing
    times = round_robin(steps, **timing)
    title = f"HF Llama (4 layers, d=256, 8 heads / 4 kv), (B, T) = ({args.batch}, {args.seq})"
    report(f"{title}: training step", {k: v for k, v in times.items() if "forward" not in k},
           "HF Llama, own SDPA + Muon")
    report(f"{title}: forward + backward only", {k: v for k, v in times.items() if "forward" in k},
           "HF Llama, own SDPA: forward + backward")

    cfg = GPTConfig()
    torch.manual_seed(0)
    plain = GPT(cfg).train()
    recording, clipped = copy.deepcopy(plain), copy.deepcopy(plain)
    for block in plain.blocks:
        block.attn.recorder = None
    gpt_ids = torch.randint(0, cfg.vocab_size, (16, cfg.block_size + 1), generator=g)
    steps = {
        "GPT, no recording + Muon": gpt_step(plain, Muon(param_groups(plain), lr=1e-3, **f32), gpt_ids),
        "GPT, recording (exact) + Muon": gpt_step(recording, Muon(param_groups(recording), lr=1e-3, **f32),
                                                  gpt_ids),
        "GPT, MuonClip (gate at tau, clip)": gpt_step(clipped, MuonClip(clipped, lr=1e-3, tau=100.0, **f32),
                                                      gpt_ids),
    }
    report(f"CLI GPT (GPTConfig(): {cfg.n_layer} layers, d={cfg.n_embd}, {cfg.n_head} heads), (B, T) = "
           f"(16, {cfg.block_size}): training step", round_robin(steps, **timing), "GPT, no recording + Muon")


if __name__ == "__main__":
    main()
