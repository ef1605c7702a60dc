"""MuonClip's Muon under DeepSpeed ZeRO 1-3 side by side with DeepSpeed's own Muon (CPU, gloo, 2 ranks).

For each ZeRO stage and each optimizer -- ours (`muonclip.Muon` handed to ``deepspeed.initialize``)
and DeepSpeed's (``"optimizer": {"type": "Muon", "params": {"ns_method": "standard"}}``) -- the same
GPT, initial weights and batches, in a fresh pair of processes, it measures per rank:

* the time of the whole training step (forward, ``engine.backward``, ``engine.step()``) and of
  ``engine.step()`` alone, medians of the timed steps after ``--warmup`` untimed ones (DeepSpeed's
  Muon is ``torch.compile``d: its first steps compile). DeepSpeed's Muon orthogonalises ZeRO-1/2's
  matrices while it reduces the gradients, inside ``engine.backward``; ours in ``engine.step()``:
  only the whole step compares like with like;
* the bytes each rank hands to collectives in the forward + backward and in the step: every
  collective of ``torch.distributed`` (what muonclip calls) and the ones DeepSpeed's communication
  backend bound at start-up (``deepspeed.comm``'s all-gather and reduce-scatter functions), counted
  by their input tensors, once per call;
* the process's peak resident memory (``ru_maxrss``), rank by rank;
* the first update of the matrices both orthogonalise (attention and MLP weights): cosine and
  relative difference of ours against DeepSpeed's.

The two updates coincide when: the scale is ``sqrt(max(1, rows/cols))`` (ours
``adjust_lr_fn="original"``), both use Nesterov momentum (DeepSpeed's average ``b = mu b + (1 - mu) g``
is ``(1 - mu)`` times our sum, and Newton–Schulz is blind to the factor), the decay is decoupled and
applied before the update (both), and Newton–Schulz (the same quintic, ``ns5``) runs in the same
dtype: DeepSpeed's ``standard`` method runs in bfloat16 on the CPU, so the timed runs use
``orth_dtype=torch.bfloat16`` for ours; ``--agreement-float32`` runs one more pair with both in
float32 (DeepSpeed's ``ns_compute_dtype`` pointed at float32), where the updates agree to float32
rounding.

Run: ``python benchmarks/bench_deepspeed.py [--layers 2 --width 128 --steps 6 --warmup 2]``.
Figures taken on a shared, loaded CPU are provisional; ratios measured in one run are the comparison.
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
               "all_gather", "reduce_scatter", "all_to_all", "reduce", "gather", "scatter")


class ByteCounter:
    """Counts the input bytes of every collective, per phase (``phase``: a key of ``sent``)."""

    def __init__(self) -> None:
        import deepspeed.comm.comm as ds_comm
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d

        self.phase, self.sent = "other", {}
        for module in (dist, c10d):
            for name in COLLECTIVES:
                real = getattr(module, name, None)
                if real is not None:
                    setattr(module, name, self._counted(real))
        backend = ds_comm.cdb  # DeepSpeed's TorchBackend bound these two at start-up
        for name in ("all_gather_function", "reduce_scatter_function"):
            real = getattr(backend, name, None)
            if real is not None:
                setattr(backend, name, self._counted(real))

    def _counted(self, real):
        if getattr(real, "_counted", False):
            return real

        def counted(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                t = a[0] if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor) else a
                if isinstance(t, torch.Tensor):
                    n = sum(x.numel() * x.element_size() for x in a) if isinstance(a, (list, tuple)) else \
                        t.numel() * t.element_size()
                    self.sent[self.phase] = self.sent.get(self.phase, 0) + n
                    break
            return real(*args, **kwargs)

        counted._counted = True
        return counted


def _worker(rank: int, world: int, impl: str, stage: int, cfg: dict, steps: int, warmup: int, ns: str,
            out: str) -> None:
    import deepspeed
    import torch.distributed as dist

    import muonclip
    from muonclip.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(**cfg))
    ds = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
          "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    dtype = torch.float32 if ns == "float32" else torch.bfloat16
    if impl == "muonclip":
        opt = muonclip.Muon(muonclip.param_groups(model), lr=0.02, momentum=0.95, weight_decay=0.1,
                            adjust_lr_fn="original", nesterov=True, orth_dtype=dtype, eps=1e-7 / (1 - 0.95))
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds)
    else:
        if ns == "float32":
            import deepspeed.runtime.zero.muon.original_muon as original_muon

            original_muon.ns_compute_dtype = lambda method="gram": torch.float32
        if stage == 3:
            ds["zero_optimization"]["reduce_scatter"] = False  # DeepSpeed's Muon refuses ZeRO-3's reduce-scatter
        ds["optimizer"] = {"type": "Muon", "params": {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1,
                                                      "ns_method": "standard"}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    counter = ByteCounter()
    whole, step, sent_fb, sent_step, first = [], [], [], [], None
    n = 4
    for s in range(steps):
        g = torch.Generator().manual_seed(s)
        x = torch.randint(0, cfg["vocab_size"], (8, cfg["block_size"] + 1), generator=g)
        counter.sent, counter.phase = {}, "backward"
        dist.barrier()
        t0 = time.perf_counter()
        _, loss = engine(x[rank * n:(rank + 1) * n, :-1], x[rank * n:(rank + 1) * n, 1:])
        engine.backward(loss)
        counter.phase = "step"
        t1 = time.perf_counter()
        engine.step()
        t2 = time.perf_counter()
        counter.phase = "other"
        whole.append(t2 - t0)
        step.append(t2 - t1)
        sent_fb.append(counter.sent.get("backward", 0))
        sent_step.append(counter.sent.get("step", 0))
        if s == 0:
            from deepspeed.utils import safe_get_full_fp32_param

            first = {}
            for name, p in engine.module.named_parameters():
                w = safe_get_full_fp32_param(p) if stage > 0 else p.detach()
                first[name] = (w.float() - before[name]).clone()
    mine = {"whole": statistics.median(whole[warmup:]), "step": statistics.median(step[warmup:]),
            "sent_fb": statistics.median(sent_fb[warmup:]), "sent_step": statistics.median(sent_step[warmup:]),
            "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        torch.save({"ranks": ranks, "delta": first}, out)


def _agreement(a: dict, b: dict) -> tuple[int, float, float]:
    names = [k for k in a if a[k].ndim == 2 and ("attn" in k or "mlp" in k)]
    cos = [torch.nn.functional.cosine_similarity(a[k].flatten(), b[k].flatten(), dim=0).item() for k in names]
    rel = [((a[k] - b[k]).norm() / b[k].norm()).item() for k in names]
    return len(names), min(cos), max(rel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--stages", default="1,2,3")
    ap.add_argument("--agreement-float32", action="store_true",
                    help="also one pair with Newton-Schulz in float32 for both (ZeRO-2): the updates' agreement")
    args = ap.parse_args()
    cfg = dict(vocab_size=512, block_size=64, n_layer=args.layers, n_head=4, n_embd=args.width)
    print(f"GPT {args.layers} layers x {args.width}, 2 gloo ranks on CPU, {args.steps} steps, medians of the last "
          f"{args.steps - args.warmup}; Newton-Schulz in bfloat16 for both")
    print(f"{'stage':>5} {'optimizer':>14} {'fwd+bwd+step ms':>16} {'step ms':>8} {'MiB fwd+bwd':>12} "
          f"{'MiB step':>9} {'peak RSS MiB (r0, r1)':>22}")
    with tempfile.TemporaryDirectory() as tmp:
        runs = [(int(s), "bfloat16") for s in args.stages.split(",") if s]
        if args.agreement_float32:
            runs.append((2, "float32"))
        for stage, ns in runs:
            res = {}
            for impl in ("muonclip", "deepspeed"):
                out = f"{tmp}/{impl}-{stage}-{ns}.pt"
                deepspeed_harness.launch(_worker, impl, stage, cfg, args.steps, args.warmup, ns, out, limit_s=900)
                res[impl] = torch.load(out)
                if ns != "bfloat16":
                    continue
                r = res[impl]["ranks"]
                label = "muonclip.Muon" if impl == "muonclip" else "DeepSpeed Muon"
                rss = ", ".join(f"{x['rss_mib']:.0f}" for x in r)
                print(f"{stage:>5} {label:>14} {1e3 * max(x['whole'] for x in r):>16.1f} "
                      f"{1e3 * max(x['step'] for x in r):>8.1f} {max(x['sent_fb'] for x in r) / 2**20:>12.2f} "
                      f"{max(x['sent_step'] for x in r) / 2**20:>9.2f} {rss:>22}")
            k, cos, rel = _agreement(res["muonclip"]["delta"], res["deepspeed"]["delta"])
            print(f"      first update, {k} attention/MLP matrices, Newton-Schulz in {ns}: cosine min {cos:.6f}, "
                  f"relative difference max {rel:.2e}")
            if ns == "bfloat16":
                a, b = res["muonclip"]["ranks"], res["deepspeed"]["ranks"]
                print(f"      whole-step time ratio (ours / DeepSpeed's): "
                      f"{max(x['whole'] for x in a) / max(x['whole'] for x in b):.2f}")


if __name__ == "__main__":
    main()
