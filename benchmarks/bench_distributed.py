"""Distributed Muon vs distributed AdamW: NS flops per rank, bytes on the wire, time per step.

Runs the reference GPT with one process and with 2 gloo processes on CPU (DDP and FSDP2
``fully_shard``), each process on one thread, and prints per optimizer step:

* Newton–Schulz flops this rank ran and the group total (should be ~1/N each);
* bytes each rank sends per step: the training collectives (DDP's gradient all-reduce,
  counted as a ring: 2 (N-1)/N x gradient bytes; FSDP2's parameter all-gathers and gradient
  reduce-scatters, counted by wrapping ``dist.all_gather_single`` / ``reduce_scatter_single``:
  (N-1)/N x the full tensor) plus Muon's own exchanges (`Muon.last_step_stats.comm`), and the
  ratio to the same setup with ``torch.optim.AdamW`` (Moonlight: Muon within 1.25x);
* time of forward+backward and of the optimizer step (median over the measured steps, max
  over ranks).

    python benchmarks/bench_distributed.py [--steps 8] [--layers 4] [--width 128]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from muonclip import Muon, param_groups
from muonclip.models import GPT, GPTConfig

VARIANTS = [  # (name, optimizer, comm_dtype)
    ("AdamW", "adamw", None),
    ("Muon, fp32 wire", "muon", None),
    ("Muon, bf16 wire", "muon", torch.bfloat16),
]


def _model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.width))


def _optimizer(params_model, kind, comm_dtype):
    if kind == "adamw":
        return torch.optim.AdamW(params_model.parameters(), lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95))
    return Muon(param_groups(params_model), lr=1e-3, comm_dtype=comm_dtype)


class WireCounter:
    """Counts bytes FSDP2 sends through all_gather_single / reduce_scatter_single (ring model)."""

    def __init__(self, world: int) -> None:
        self.world, self.bytes = world, 0
        self._real = {}
        for op in ("all_gather_single", "reduce_scatter_single"):
            if hasattr(dist, op):
                self._real[op] = getattr(dist, op)
                setattr(dist, op, self._wrap(op, self._real[op]))

    def _wrap(self, op, real):
        def counted(*a, **k):
            if op == "all_gather_single":
                full = a[0] if a else k["output_tensor"]
            else:
                full = a[1] if len(a) > 1 else k["input"]
            self.bytes += full.numel() * full.element_size() * (self.world - 1) // self.world
            return real(*a, **k)

        return counted

    def restore(self) -> None:
        for op, real in self._real.items():
            setattr(dist, op, real)


def _run(world, mode, args) -> list[dict]:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    rows = []
    for name, kind, comm_dtype in VARIANTS:
        model = _model(args)
        n_params = sum(p.numel() for p in model.parameters())
        if mode == "ddp":
            net = torch.nn.parallel.DistributedDataParallel(model)
        elif mode == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            net = fully_shard(model)
        else:
            net = model
        opt = _optimizer(model, kind, comm_dtype)  # FSDP2: model's parameters are now DTensors
        counter = WireCounter(world) if mode == "fsdp" else None
        fb, st, wire, opt_bytes, flops = [], [], [], [], None
        for step in range(args.warmup + args.steps):
            x = torch.randint(0, 256, (args.batch // world, args.block + 1), generator=g)
            if counter:
                counter.bytes = 0
            t0 = time.perf_counter()
            _, loss = net(x[:, :-1], x[:, 1:])
            loss.backward()
            t1 = time.perf_counter()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t2 = time.perf_counter()
            if step >= args.warmup:
                fb.append(t1 - t0)
                st.append(t2 - t1)
                train = counter.bytes if counter else (2 * (world - 1) * n_params * 4 // world if mode == "ddp" else 0)
                extra = opt.last_step_stats.comm.bytes_sent if kind == "muon" else 0
                wire.append(train + extra)
                opt_bytes.append(extra)
                if kind == "muon":
                    flops = (opt.last_step_stats.ns_flops, opt.last_step_stats.total_ns_flops)
        if counter:
            counter.restore()
        times = torch.tensor([statistics.median(fb), statistics.median(st)], dtype=torch.float64)
        if world > 1:
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
        rows.append(dict(name=name, fb=times[0].item(), step=times[1].item(), wire=statistics.mean(wire),
                         opt_bytes=statistics.mean(opt_bytes), flops=flops, params=n_params))
    return rows


def _entry(rank, world, port, mode, args, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rows = _run(world, mode, args)
        if rank == 0:
            torch.save(rows, path)
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    results = {"single": _run(1, "single", args)}
    for mode in ("ddp", "fsdp"):
        path = f"/tmp/bench_distributed_{os.getpid()}_{mode}.pt"
        mp.spawn(_entry, args=(2, _port(), mode, args, path), nprocs=2)
        results[mode] = torch.load(path)
        os.remove(path)
    print(f"GPT {args.layers} layers, width {args.width}, block {args.block}, global batch {args.batch}; "
          f"{results['single'][0]['params']:,} parameters; torch {torch.__version__}, 1 thread per process")
    print("| setup | optimizer | fwd+bwd ms | opt step ms | opt / fwd+bwd | NS flops this rank / total "
          "| bytes sent per rank per step | of which Muon exchange | vs AdamW |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, rows in results.items():
        base = rows[0]["wire"]
        for r in rows:
            fl = "-" if r["flops"] is None else f"{r['flops'][0] / 1e6:.0f}M / {r['flops'][1] / 1e6:.0f}M"
            ratio = "-" if base == 0 else f"{r['wire'] / base:.2f}x"
            print(f"| {mode} | {r['name']} | {r['fb'] * 1e3:.0f} | {r['step'] * 1e3:.0f} | {r['step'] / r['fb']:.1%} "
                  f"| {fl} | {r['wire'] / 1e6:.2f} MB | {r['opt_bytes'] / 1e6:.2f} MB | {ratio} |")


if __name__ == "__main__":
    main()
