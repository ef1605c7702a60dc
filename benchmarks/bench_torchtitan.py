"""torchtitan: AdamW vs torchtitan's DistMuon vs our Muon / MuonClip, whole step and optimizer step.

torchtitan's llama3 (shrunk: ``--width``, ``--layers``, GQA 8 heads / 4 key-value heads), built as
its trainer builds it (FSDP2 over ``--nproc`` processes, selective activation checkpointing), with
``muonclip.integrations.torchtitan``'s set-up and recording attention (on CPU: gloo, float32, SDPA;
``--device cuda``: NCCL, one GPU per process, FlexAttention). Every optimizer trains its own copy
of the model (the same initial weights and batches) in the same processes, interleaved: each
round steps every optimizer once, in a shuffled order (the same on every rank), so a burst of
load from other processes on a shared machine hits all alike. Per optimizer, the median over
the rounds (the slowest rank's) of:

* the whole step (forward + backward + ``optimizers.step()``) and the optimizer step alone;
* the bytes this rank sends in the optimizer step, counted by wrapping torch.distributed's
  collectives (FSDP2's own all-gathers and reduce-scatters are outside the step and the same
  for every optimizer);

and the whole-step ratios Muon / AdamW, MuonClip / AdamW and MuonClip / Muon: the median of
the per-round ratios. ``--clock process`` times each process's CPU time instead of the wall clock
(steadier on a machine shared with other jobs).

AdamW is torchtitan's default container (``default_adamw``); DistMuon is torchtitan's own
(``optimizer_name="DistMuon"``), which refuses CPU processes ("DistMuon requires one CUDA device
per process"): the script tries it and prints the refusal.

``--pp N``: the same under torchtitan's pipeline (N stages of ``--schedule``; FSDP2 over the
``nproc / N`` ranks of each stage), built by its ``pipelining_fn`` as
`muonclip.integrations.torchtitan` sets it up, each optimizer's model its own pipeline; a step is
the schedule's step over every row as a micro-batch of one row (torchtitan's call,
``step(arg_mbs=..., target_mbs=..., loss_kwargs=...)``), then the optimizer step. Each rank times
its own stages' optimizer step; the slowest rank's counts.

    python benchmarks/bench_torchtitan.py [--steps 10] [--width 128] [--layers 4] [--device cuda --nproc 1]
    python benchmarks/bench_torchtitan.py --pp 2 --optimizers AdamW,Muon,MuonClip
"""

from __future__ import annotations

import argparse
import datetime
import os
import random
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from timing import CLOCKS, machine

SEQ, VOCAB, BATCH = 64, 512, 4
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_to_all", "all_to_all_single",
               "reduce_scatter_tensor", "broadcast", "send")  # not isend: the pipeline's P2POp must get torch's own


def _config(args, name: str, world: int):
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
    cfg = with_muonclip(base, device_type=args.device)
    cfg.parallelism.data_parallel_shard_degree = world // args.pp
    cfg.training.seq_len = SEQ
    if args.pp > 1:
        from torchtitan.components.loss import CrossEntropyLoss

        cfg.parallelism.pipeline_parallel_degree = args.pp
        cfg.parallelism.pipeline_parallel_schedule = args.schedule
        cfg.parallelism.pipeline_parallel_microbatch_size = 1
        cfg.training.local_batch_size = BATCH * args.pp // world
        cfg.loss = CrossEntropyLoss.Config()
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
        cfg.optimizer.name, cfg.optimizer.tau, cfg.optimizer.lr = name, 100.0, 0.02
    return cfg


def _build(cfg, world: int, device: str):
    from torchtitan.distributed import ParallelDims

    model_config = cfg.model_spec.model
    model_config.update_from_config(config=cfg)
    with torch.device("meta"):
        model = model_config.build()
    model = cfg.model_spec.parallelize_fn(model, parallel_dims=ParallelDims.from_config(cfg.parallelism, world),
                                          training=cfg.training, parallelism=cfg.parallelism,
                                          compile_config=cfg.compile, ac_config=cfg.activation_checkpoint,
                                          dump_folder="")
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def _build_pipeline(cfg, world: int, device: str):
    """``(schedule, model parts, has first stage, has last stage)`` as torchtitan's trainer builds them."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    model_config = cfg.model_spec.model
    model_config.update_from_config(config=cfg)
    with torch.device("meta"):
        model = model_config.build()
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)
    pipe = cfg.model_spec.pipelining_fn(
        model, parallel_dims=ParallelDims.from_config(cfg.parallelism, world), training=cfg.training,
        parallelism=cfg.parallelism, compile_config=cfg.compile, ac_config=cfg.activation_checkpoint, dump_folder="",
        device=torch.device(device), model_config=model_config, parallelize_fn=cfg.model_spec.parallelize_fn,
        loss_fn=cfg.loss.build(compile_config=cfg.compile))
    for m in pipe[1]:
        m.to_empty(device=device)
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        m.train()
    return pipe


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


def _batch(s: int, rank: int, world: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(s)
    x = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    n = BATCH // world
    return x[rank * n:(rank + 1) * n].to(device)


def _step(model, opt, x, device, counter=None, tick=time.perf_counter) -> tuple[float, float]:
    """One whole step (forward, backward, optimizer step): its seconds and the optimizer step's, by ``tick``.
    ``model``: a module, or a pipeline (`_build_pipeline`) whose schedule runs every row as a micro-batch."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    dist.barrier()
    sync()
    t0 = tick()
    if isinstance(model, tuple):
        schedule, _, first, last = model
        xs, ys = x[:, :-1].split(1), x[:, 1:].split(1)
        schedule.step(arg_mbs=[(xm,) for xm in xs] if first else None, kwarg_mbs=[{} for _ in xs],
                      target_mbs=list(ys) if last else None, losses=[] if last else None,
                      loss_kwargs={"global_valid_tokens": torch.tensor(BATCH * SEQ, device=x.device)},
                      return_outputs=False)
    else:
        out_ = model(x[:, :-1])
        loss = F.cross_entropy(out_.flatten(0, 1).float(), x[:, 1:].flatten(), reduction="sum") / (BATCH * SEQ)
        loss.backward()
    sync()
    if counter is not None:
        counter.n, counter.active = 0, True
    t1 = tick()
    opt.step()
    sync()
    t2 = tick()
    if counter is not None:
        counter.active = False
    opt.zero_grad()
    return t2 - t0, t2 - t1


def _worker(rank, world, port, args, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    else:
        torch.set_num_threads(args.threads)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        runs, errors = {}, {}
        for name in args.optimizers.split(","):
            cfg = _config(args, name, world)
            torch.manual_seed(0)
            model = _build(cfg, world, device) if args.pp == 1 else _build_pipeline(cfg, world, device)
            try:
                runs[name] = (model, cfg.optimizer.build(model_parts=[model] if args.pp == 1 else model[1]))
            except Exception as e:  # DistMuon on CPU
                errors[name] = f"{type(e).__name__}: {e}"
        counter = _Bytes()
        counter.install()
        names = list(runs)
        times: dict[str, list[float]] = {n: [] for n in names}
        opt_times: dict[str, list[float]] = {n: [] for n in names}
        byte_counts: dict[str, list[int]] = {n: [] for n in names}
        for r in range(args.warmup + args.steps):
            order = names[:]
            random.Random(r).shuffle(order)  # the same order on every rank
            for name in order:
                model, opt = runs[name]
                dp = world // args.pp  # torchtitan's meshes put the pipeline outermost
                step, opt_s = _step(model, opt, _batch(r, rank % dp, dp, device), args.device, counter,
                                    CLOCKS[args.clock])
                if r >= args.warmup:
                    times[name].append(step)
                    opt_times[name].append(opt_s)
                    byte_counts[name].append(counter.n)
        out[rank] = {"step": times, "opt": opt_times, "bytes": byte_counts, "errors": errors}
    finally:
        dist.barrier()
        dist.destroy_process_group()


def _ratios(res: dict, a: str, b: str) -> list[float]:
    """Per round, whole step of ``a`` over ``b`` (each the slowest rank's)."""
    n = len(res[0]["step"][a])
    step = {k: [max(r["step"][k][i] for r in res.values()) for i in range(n)] for k in (a, b)}
    return [x / y for x, y in zip(step[a], step[b])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="measured rounds (one step of every optimizer each)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2, help="processes (FSDP2 over them; 1: no FSDP2)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (FSDP2 over nproc / pp ranks per stage)")
    p.add_argument("--schedule", default="1F1B", help="torchtitan's pipeline schedule with --pp > 1 (default 1F1B)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process on CPU")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: one GPU per process, NCCL")
    p.add_argument("--optimizers", default="AdamW,DistMuon,Muon,MuonClip", help="comma-separated")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="wall clock, or each process's CPU time (less sensitive to other jobs on a shared machine; "
                        "leaves out time a rank waits in a collective without spinning)")
    args = p.parse_args()
    if args.pp < 1 or args.nproc % args.pp or (BATCH * args.pp) % args.nproc:
        p.error(f"--pp {args.pp} must divide --nproc {args.nproc}, and the {args.nproc // args.pp} ranks of a stage "
                f"the batch of {BATCH}")
    torch.set_num_threads(args.threads)  # as in each process, for the report's thread count
    dp = args.nproc // args.pp
    layout = "FSDP2 over " if dp > 1 else ""
    if args.pp > 1:
        layout = (f"pipeline: {args.pp} stages ({args.schedule}, micro-batches of 1 row)"
                  f"{f' x FSDP2 over {dp}' if dp > 1 else ''}, ")
    print(f"torchtitan llama3, width {args.width}, {args.layers} layers, GQA 8/4 heads, seq {SEQ}, batch {BATCH}; "
          f"{layout}{args.nproc} {'NCCL' if args.device == 'cuda' else 'gloo'} "
          f"process(es); {machine()}; {args.clock} clock; {datetime.date.today()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = mp.Manager().dict()
    mp.start_processes(_worker, args=(args.nproc, port, args, out), nprocs=args.nproc, start_method="spawn")
    res = dict(out)
    for name, err in res[0]["errors"].items():
        print(f"{name:<10} does not run here: {err}")
    names = list(res[0]["step"])
    print(f"{'optimizer':<10} {'step ms':>8} {'opt ms':>8} {'opt bytes/rank':>15}")
    for name in names:
        step = statistics.median(max(r["step"][name][i] for r in res.values()) for i in range(args.steps))
        opt = statistics.median(max(r["opt"][name][i] for r in res.values()) for i in range(args.steps))
        b = max(statistics.median(r["bytes"][name]) for r in res.values())
        print(f"{name:<10} {1e3 * step:8.1f} {1e3 * opt:8.1f} {b:15,.0f}")
    print("whole step, median of the per-round ratios (each round steps every optimizer once, shuffled):")
    for a, b in (("Muon", "AdamW"), ("MuonClip", "AdamW"), ("MuonClip", "Muon")):
        if a in names and b in names:
            r = _ratios(res, a, b)
            print(f"  {a} / {b}: {statistics.median(r):.3f}x (rounds {min(r):.2f}-{max(r):.2f}x)")


if __name__ == "__main__":
    sys.exit(main())
