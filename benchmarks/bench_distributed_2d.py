"""Distributed Muon vs distributed AdamW on a 2x2 mesh: bytes on the wire and Newton–Schulz flops.

Runs the reference GPT on 4 gloo processes on CPU, on a ``("dp", "tp")`` mesh of 2 x 2, in two
layouts: FSDP2 x tensor parallel (`muonclip.models.parallel.tensor_parallel` on ``"tp"``, then
``fully_shard`` on ``"dp"``) and HSDP (``fully_shard`` on the whole mesh: replicate x shard).
For AdamW, Muon with a float32 wire and Muon with a bfloat16 wire (``comm_dtype``) it prints,
per optimizer step and per rank (mean over ranks and steps):

* bytes sent, counted, not timed (exact for a given model and mesh): every collective of the
  training step — FSDP2's all-gathers and reduce-scatters and every other ``torch.distributed``
  call (ring model: an all-reduce of b bytes over n ranks sends 2 (n-1)/n b, an all-gather
  (n-1) x its input, a reduce-scatter (n-1)/n x its input, an all-to-all what leaves the rank),
  and DTensor's functional collectives of tensor parallelism (seen by a dispatch mode) — and
  what of it is Muon's own exchange (`Muon.last_step_stats.comm`);
* the ratio to AdamW on the same mesh (goal: Muon with a bf16 wire within 1.25x);
* Newton–Schulz flops on this rank and on the whole mesh (every matrix once).

    python benchmarks/bench_distributed_2d.py [--steps 3] [--layers 4] [--width 128]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_distributed import _port  # a sibling script: benchmarks/ is on sys.path when run
from torch.utils._python_dispatch import TorchDispatchMode

from muonclip import Muon, param_groups
from muonclip.models import GPT, GPTConfig

VARIANTS = [("AdamW", "adamw", None), ("Muon, fp32 wire", "muon", None), ("Muon, bf16 wire", "muon", torch.bfloat16)]
WORLD = 4


class Wire:
    """Bytes this rank sends: ``torch.distributed`` calls (wrapped) and functional collectives (a dispatch mode)."""

    OPS = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor",
           "reduce_scatter_single", "all_to_all_single")

    def __init__(self) -> None:
        self.bytes, self._inside, self._real = 0, False, {}
        for op in self.OPS:
            if hasattr(dist, op):
                self._real[op] = getattr(dist, op)
                setattr(dist, op, self._wrap(op, self._real[op]))

    def _wrap(self, op, real):
        def counted(*a, **k):
            if not self._inside:
                group = k.get("group")
                n = dist.get_world_size(group) if group is not None else dist.get_world_size()
                if op == "all_reduce":
                    t = a[0] if a else k["tensor"]
                    self.bytes += 2 * (n - 1) * t.numel() * t.element_size() // n
                elif op.startswith("all_gather"):
                    t = a[1] if len(a) > 1 else k.get("input_tensor", k.get("input"))
                    self.bytes += (n - 1) * t.numel() * t.element_size()
                elif op.startswith("reduce_scatter"):
                    t = a[1] if len(a) > 1 else k.get("input", k.get("input_tensor"))
                    self.bytes += (n - 1) * t.numel() * t.element_size() // n
                else:
                    send = a[1]
                    splits = a[3] if len(a) > 3 else k.get("input_split_sizes")
                    me = dist.get_rank(group) if group is not None else dist.get_rank()
                    own = splits[me] if splits else send.numel() // n
                    self.bytes += (send.numel() - own) * send.element_size()
            self._inside = True
            try:
                return real(*a, **k)
            finally:
                self._inside = False

        return counted

    def restore(self) -> None:
        for op, real in self._real.items():
            setattr(dist, op, real)


class FunctionalWire(TorchDispatchMode):
    """Counts DTensor's functional collectives (``_c10d_functional``), which bypass ``torch.distributed``."""

    def __init__(self, wire: Wire) -> None:
        super().__init__()
        self.wire = wire

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if func.namespace == "_c10d_functional" and not name.startswith("wait_tensor"):
            t = args[0]
            if isinstance(t, (list, tuple)):
                t = t[0]
            b = t.numel() * t.element_size()
            if name.startswith("all_reduce"):
                n = dist.get_world_size(dist.distributed_c10d._resolve_process_group(args[2]))
                self.wire.bytes += 2 * (n - 1) * b // n
            elif name.startswith("all_gather_into_tensor"):
                self.wire.bytes += (args[1] - 1) * b
            elif name.startswith("reduce_scatter_tensor"):
                self.wire.bytes += (args[2] - 1) * b // args[2]
        return func(*args, **(kwargs or {}))


def _model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.width))


def _net(args, layout, mesh):
    from torch.distributed.fsdp import fully_shard

    from muonclip.models.parallel import tensor_parallel

    model = _model(args)
    if layout == "fsdp_x_tp":
        tensor_parallel(model, mesh["tp"])
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        return fully_shard(model, mesh=mesh["dp"]), mesh["dp"].get_local_rank(), 2
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh), dist.get_rank(), WORLD


def _run(args, layout) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rows = []
    for name, kind, comm_dtype in VARIANTS:
        net, part, parts = _net(args, layout, mesh)
        if kind == "adamw":
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=0.1)
        else:
            opt = Muon(param_groups(net), lr=1e-3, comm_dtype=comm_dtype)
        g = torch.Generator().manual_seed(1)
        wire = Wire()
        total, muon_bytes, flops = [], [], None
        try:
            for _ in range(args.steps):
                x = torch.randint(0, 256, (args.batch, args.block + 1), generator=g)
                x = x[part * args.batch // parts:(part + 1) * args.batch // parts]
                wire.bytes = 0
                with FunctionalWire(wire):
                    _, loss = net(x[:, :-1], x[:, 1:])
                    loss.backward()
                    opt.step()
                opt.zero_grad(set_to_none=True)
                total.append(wire.bytes)
                if kind == "muon":
                    muon_bytes.append(opt.last_step_stats.comm.bytes_sent)
                    flops = (opt.last_step_stats.ns_flops, opt.last_step_stats.total_ns_flops)
        finally:
            wire.restore()
        stats = torch.tensor([statistics.mean(total), statistics.mean(muon_bytes) if muon_bytes else 0.0,
                              flops[0] if flops else 0.0], dtype=torch.float64)
        every = [torch.zeros_like(stats) for _ in range(WORLD)]
        dist.all_gather(every, stats)
        rows.append(dict(name=name, wire=[e[0].item() for e in every], muon=[e[1].item() for e in every],
                         flops=[e[2].item() for e in every], total_flops=flops[1] if flops else 0))
    return rows


def _entry(rank, port, args, path):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        out = {layout: _run(args, layout) for layout in ("fsdp_x_tp", "hsdp")}
        if rank == 0:
            torch.save(out, path)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    path = f"/tmp/bench_distributed_2d_{os.getpid()}.pt"
    mp.spawn(_entry, args=(_port(), args, path), nprocs=WORLD)
    results = torch.load(path)
    os.remove(path)
    print(f"GPT {args.layers} layers, width {args.width}, block {args.block}, global batch {args.batch}; "
          f"4 gloo ranks on a 2x2 mesh; torch {torch.__version__}")
    print("| layout | optimizer | bytes sent per rank per step | of which Muon exchange | vs AdamW "
          "| NS flops per rank (min-max) / mesh total |")
    print("|---|---|---:|---:|---:|---:|")
    for layout, rows in results.items():
        base = statistics.mean(rows[0]["wire"])
        for r in rows:
            w, m = statistics.mean(r["wire"]), statistics.mean(r["muon"])
            fl = "-" if not r["total_flops"] else (f"{min(r['flops']) / 1e6:.0f}M-{max(r['flops']) / 1e6:.0f}M / "
                                                  f"{r['total_flops'] / 1e6:.0f}M")
            print(f"| {layout} | {r['name']} | {w / 1e6:.2f} MB | {m / 1e6:.2f} MB | {w / base:.2f}x | {fl} |")


if __name__ == "__main__":
    main()
