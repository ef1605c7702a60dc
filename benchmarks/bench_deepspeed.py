"""MuonClip's Muon under DeepSpeed ZeRO 1-3 side by side with DeepSpeed's own Muon (CPU, gloo, 2 ranks).

For each ZeRO stage and each optimizer -- ours (`muonclip.Muon` handed to ``deepspeed.initialize``,
``adjust_lr_fn="original"``, Newton–Schulz ns5 in bfloat16, Nesterov: DeepSpeed Muon's update) and
DeepSpeed's (``"optimizer": {"type": "Muon", "params": {"ns_method": "standard"}}``) -- the same
GPT, initial weights and batches, in a fresh pair of processes, prints per rank:

* the optimizer step time: ``engine.step()``, median of the timed steps (DeepSpeed's own
  partition copies and all-gather included, for both);
* the bytes this rank handed to collectives during ``engine.step()`` (every ``torch.distributed``
  collective counted by its input tensors);
* the process's peak resident memory (``ru_maxrss``);
* and, after the first step, the agreement of the two updates on the matrices both orthogonalise
  (attention and MLP weights): the cosine between the weight changes and their relative difference.

Run: ``python benchmarks/bench_deepspeed.py [--layers 2 --width 128 --steps 4]``. Figures taken on a
shared, loaded CPU are provisional; ratios measured in one run are the comparison.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import deepspeed_harness  # noqa: E402

COLLECTIVES = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
               "all_gather", "reduce_scatter", "all_to_all", "reduce")


def _count_bytes() -> list[int]:
    """Patch ``torch.distributed``'s collectives to add their input bytes to the returned counter."""
    import torch.distributed as dist

    sent = [0]
    for name in COLLECTIVES:
        real = getattr(dist, name, None)
        if real is None:
            continue

        def counted(*args, _real=real, **kwargs):
            for a in list(args) + list(kwargs.values()):
                for t in a if isinstance(a, (list, tuple)) else (a,):
                    if isinstance(t, torch.Tensor):
                        sent[0] += t.numel() * t.element_size()
                        break
            return _real(*args, **kwargs)

        setattr(dist, name, counted)
    return sent


def _worker(rank: int, world: int, impl: str, stage: int, cfg: dict, steps: int, out: str) -> None:
    import deepspeed

    import muonclip
    from muonclip.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    if impl == "muonclip":
        opt = muonclip.Muon(muonclip.param_groups(model), lr=0.02, weight_decay=0.0, adjust_lr_fn="original",
                            orth_dtype=torch.bfloat16)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    else:
        if stage == 3:
            ds["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed's Muon refuses ZeRO-3's reduce-scatter
        ds["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0,
                                                      "ns_method": "standard"}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    sent = _count_bytes()
    times, moved, first = [], [], None
    n = 4
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x = torch.randint(0, cfg["vocab_size"], (8, cfg["block_size"] + 1), generator=g)
        _, loss = engine(x[rank * n:(rank + 1) * n, :-1], x[rank * n:(rank + 1) * n, 1:])
        engine.backward(loss)
        sent[0] = 0
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
        moved.append(sent[0])
        if s == 0:
            from deepspeed.utils import safe_get_full_fp32_param

            first = {}
            for name, p in engine.module.named_parameters():
                w = safe_get_full_fp32_param(p) if stage > 0 else p.detach()
                first[name] = (w.float() - before[name]).clone()
    if rank == 0:
        torch.save({"time": statistics.median(times[1:]), "bytes": statistics.median(moved[1:]),
                    "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "delta": first}, out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--stages", default="1,2,3")
    args = ap.parse_args()
    cfg = dict(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width)
    print(f"GPT {args.layers} layers x {args.width}, 2 gloo ranks on CPU, {args.steps} steps (median of the last "
          f"{args.steps - 1})")
    print(f"{'stage':>5} {'optimizer':>14} {'step ms':>9} {'MiB sent':>9} {'peak RSS MiB':>13}")
    with tempfile.TemporaryDirectory() as tmp:
        for stage in [int(s) for s in args.stages.split(",")]:
            res = {}
            for impl in ("muonclip", "deepspeed"):
                out = f"{tmp}/{impl}-{stage}.pt"
                deepspeed_harness.launch(_worker, impl, stage, cfg, args.steps, out, limit_s=900)
                res[impl] = torch.load(out)
                r = res[impl]
                label = "muonclip.Muon" if impl == "muonclip" else "DeepSpeed Muon"
                print(f"{stage:>5} {label:>14} {1e3 * r['time']:>9.1f} {r['bytes'] / 2**20:>9.2f} "
                      f"{r['rss_mib']:>13.0f}")
            a, b = res["muonclip"]["delta"], res["deepspeed"]["delta"]
            names = [k for k in a if a[k].ndim == 2 and ("attn" in k or "mlp" in k)]
            cos = [torch.nn.functional.cosine_similarity(a[k].flatten(), b[k].flatten(), dim=0).item() for k in names]
            rel = [((a[k] - b[k]).norm() / b[k].norm()).item() for k in names]
            print(f"      first update on {len(names)} attention/MLP matrices: cosine min {min(cos):.5f}, "
                  f"relative difference max {max(rel):.4f}")
            ratio = res["muonclip"]["time"] / res["deepspeed"]["time"]
            print(f"      step time ratio (ours / DeepSpeed's): {ratio:.2f}")


if __name__ == "__main__":
    main()
