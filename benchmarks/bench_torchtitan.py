"""torchtitan on CPU: AdamW vs torchtitan's DistMuon vs our Muon / MuonClip, per optimizer step.

torchtitan's llama3 (shrunk: ``--width``, ``--layers``, GQA 8 heads / 4 key-value heads), built as
its trainer builds it (FSDP2 over 2 gloo processes, selective activation checkpointing, float32),
with ``muonclip.integrations.torchtitan``'s CPU set-up and recording attention. Per optimizer,
the median over the measured steps (max over ranks) of:

* the optimizer step time (``optimizers.step()``) and the whole step (forward + backward + step);
* the bytes this rank sends in the optimizer step, counted by wrapping torch.distributed's
  collectives (FSDP2's own all-gathers and reduce-scatters are outside the step and the same
  for every optimizer).

AdamW is torchtitan's default container (``default_adamw``); DistMuon is torchtitan's own
(``optimizer_name="DistMuon"``), which refuses CPU processes ("DistMuon requires one CUDA device
per process"): the script tries it and prints the refusal.

    python benchmarks/bench_torchtitan.py [--steps 6] [--width 128] [--layers 4]
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

SEQ, VOCAB, BATCH = 64, 512, 4
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
               "reduce_scatter_tensor", "broadcast", "send", "isend")


def _config(args, name: str):
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from muonclip.integrations.torchtitan import with_muonclip

    d = args.width
    base = llama3_debugmodel()
    base.model_spec.model = Llama3Model.Config(
        dim=d, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=d, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=d, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=d, out_features=VOCAB, param_init=_output_linear_init(d)),
        layers=_build_llama3_layers(fuse_qkv=True, n_layers=args.layers, dim=d, n_heads=8, n_kv_heads=4,
                                    hidden_dim=4 * d,
                                    rope=ComplexRoPE.Config(dim=d // 8, max_seq_len=SEQ, theta=500000,
                                                            scaling="llama"),
                                    attn_backend="flex"))
    cfg = with_muonclip(base, device_type="cpu")
    cfg.parallelism.data_parallel_shard_degree = 2
    cfg.training.seq_len = SEQ
    if name == "AdamW":
        cfg.optimizer = default_adamw(lr=1e-3, implementation="foreach")
    elif name == "DistMuon":  # torchtitan's Kimi recipe, reduced: every hidden matrix Owned (whole) on one rank
        from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
        from torchtitan.distributed.flex_shard import BucketConfig, ComputeLayout, Owned

        fqns = [f"layers.{i}.{m}.weight" for i in range(args.layers)
                for m in ("attention.qkv_linear.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2",
                          "feed_forward.w3")]
        owned = ComputeLayout(shardings_by_mesh_axis={"dp_shard": Owned()})
        cfg.optimizer = OptimizersContainer.Config(implementation="foreach", param_groups=[
            ParamGroupConfig(pattern=r"layers\..*\.(wqkv|wo|w1|w2|w3)\.weight$", optimizer_name="DistMuon",
                             optimizer_kwargs={"lr": 0.02, "weight_decay": 0.1, "foreach": False,
                                               "adjust_lr_fn": "match_rms_adamw"}),
            ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-3})],
            optimizer_factory_kwargs_by_name={"DistMuon": {
                "compute_sharding_by_fqn": dict.fromkeys(fqns, owned),
                "bucket_configs": (BucketConfig(name="all", patterns=tuple(fqns)),)}})
    else:
        cfg.optimizer.name, cfg.optimizer.tau = name, 100.0
    return cfg


def _build(cfg):
    from torchtitan.distributed import ParallelDims

    model_config = cfg.model_spec.model
    model_config.update_from_config(config=cfg)
    with torch.device("meta"):
        model = model_config.build()
    model = cfg.model_spec.parallelize_fn(model, parallel_dims=ParallelDims.from_config(cfg.parallelism, 2),
                                          training=cfg.training, parallelism=cfg.parallelism,
                                          compile_config=cfg.compile, ac_config=cfg.activation_checkpoint,
                                          dump_folder="")
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


class _Bytes:
    """Counts the bytes of every tensor handed to torch.distributed's collectives while active."""

    def __init__(self) -> None:
        self.n, self.active, self.saved = 0, False, {}

    def install(self) -> None:
        for name in COLLECTIVES:
            fn = getattr(dist, name, None)
            if fn is None:
                continue
            self.saved[name] = fn

            def wrapped(*a, _fn=fn, **k):
                if self.active:
                    t = a[0] if a else next(iter(k.values()))
                    ts = t if isinstance(t, (list, tuple)) else [t]
                    self.n += sum(x.numel() * x.element_size() for x in ts if torch.is_tensor(x))
                return _fn(*a, **k)

            setattr(dist, name, wrapped)


def _worker(rank, world, port, args, name, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        cfg = _config(args, name)
        torch.manual_seed(0)
        model = _build(cfg)
        try:
            opt = cfg.optimizer.build(model_parts=[model])
        except Exception as e:  # DistMuon on CPU
            out[rank] = {"error": f"{type(e).__name__}: {e}"}
            return
        counter = _Bytes()
        counter.install()
        steps, opt_times, byte_counts = [], [], []
        for s in range(args.warmup + args.steps):
            g = torch.Generator().manual_seed(s)
            x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)[rank * BATCH // 2:(rank + 1) * BATCH // 2]
            dist.barrier()
            t0 = time.perf_counter()
            out_ = model(x[:, :-1])
            loss = F.cross_entropy(out_.flatten(0, 1), x[:, 1:].flatten(), reduction="sum") / (BATCH * SEQ)
            loss.backward()
            counter.n, counter.active = 0, True
            t1 = time.perf_counter()
            opt.step()
            t2 = time.perf_counter()
            counter.active = False
            opt.zero_grad()
            if s >= args.warmup:
                steps.append(t2 - t0)
                opt_times.append(t2 - t1)
                byte_counts.append(counter.n)
        out[rank] = {"step": statistics.median(steps), "opt": statistics.median(opt_times),
                     "bytes": statistics.median(byte_counts)}
    finally:
        dist.barrier()
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--optimizers", default="AdamW,DistMuon,Muon,MuonClip", help="comma-separated, AdamW first")
    args = p.parse_args()
    print(f"torchtitan llama3, width {args.width}, {args.layers} layers, GQA 8/4 heads, seq {SEQ}, batch {BATCH}; "
          f"FSDP2 over 2 gloo processes, 1 thread each; torch {torch.__version__}")
    rows = []
    for name in args.optimizers.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = mp.Manager().dict()
        mp.start_processes(_worker, args=(2, port, args, name, out), nprocs=2, start_method="spawn")
        rows.append((name, dict(out)))
    base = max(r["step"] for r in rows[0][1].values())
    print(f"{'optimizer':<10} {'step ms':>8} {'opt ms':>8} {'x AdamW step':>12} {'opt bytes/rank':>15}")
    for name, res in rows:
        if any("error" in r for r in res.values()):
            print(f"{name:<10} does not run here: {next(r['error'] for r in res.values() if 'error' in r)}")
            continue
        step = max(r["step"] for r in res.values())
        opt = max(r["opt"] for r in res.values())
        b = max(r["bytes"] for r in res.values())
        print(f"{name:<10} {1e3 * step:8.1f} {1e3 * opt:8.1f} {step / base:12.2f} {b:15,.0f}")


if __name__ == "__main__":
    sys.exit(main())
