"""FSDP2 x tensor parallel with MuonClip on a 2-D mesh, launched by torchrun (gloo on CPU; NCCL on GPUs).

    torchrun --standalone --nproc_per_node=4 examples/torchrun_fsdp_tp.py --tp 2 --steps 5

The ranks form a ``("dp", "tp")`` mesh of ``world / tp`` x ``tp``. Each transformer block is
tensor-parallel over ``"tp"`` (`muonclip.models.parallel.tensor_parallel`: q, k, v and the
MLP's first layer column-parallel, so each TP rank computes whole heads; the output
projections row-parallel), then FSDP2 shards every weight over ``"dp"`` (a q weight is then
placed ``(_StridedShard(0), Shard(0))``). `MuonClip` still orthogonalises every matrix once,
whole, on one owner rank of the mesh, and QK-Clip reduces each head's max logit over the
ranks that computed it and scales its rows where they live. ``--check`` compares the gathered
weights with one process trained on the same global batches.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from muonclip import MuonClip
from muonclip.app.data import load_corpus, train_batch
from muonclip.models import GPT, GPTConfig
from muonclip.models.parallel import tensor_parallel


def build(block_size: int) -> GPT:
    torch.manual_seed(0)  # the same initial weights on every rank
    return GPT(GPTConfig(vocab_size=256, block_size=block_size, n_layer=2, n_head=4, n_embd=64))


def batch(corpus, step: int, rank: int, world: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s share of step ``step``'s global batch (world * batch_size rows)."""
    x, y = train_batch(corpus, step, batch_size=world * args.batch_size, block_size=args.block_size, seed=0)
    rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    return x[rows], y[rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size; must divide the world size and 4 heads")
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    ap.add_argument("--batch-size", type=int, default=4, help="rows per data-parallel rank (default 4)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--tau", type=float, default=30.0, help="QK-Clip threshold (default 30; Kimi K2: 100)")
    ap.add_argument("--check", action="store_true", help="compare with a single-process run on rank 0")
    args = ap.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if world % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the number of processes ({world})")
    mesh = init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (world // args.tp, args.tp),
                            mesh_dim_names=("dp", "tp"))
    dp, n_dp = mesh["dp"].get_local_rank(), world // args.tp
    corpus = load_corpus()

    # --check: float32 Newton-Schulz on both sides. Tensor parallelism sums each activation and
    # gradient in another order than one process; bfloat16 Newton-Schulz turns that round-off into
    # bf16-sized differences of the update, which would hide a real error behind a loose tolerance.
    orth = torch.float32 if args.check else None
    model = tensor_parallel(build(args.block_size), mesh["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])  # the root: embeddings (tied with the head) and the final norm
    opt = MuonClip(model, lr=args.lr, tau=args.tau, orth_dtype=orth)
    for step in range(args.steps):
        x, y = batch(corpus, step, dp, n_dp, args)  # the TP ranks of one data-parallel rank share its batch
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = opt.clip_stats()  # the same on every rank: the maxima were all-reduced
        if rank == 0:
            print(f"step {step + 1} | loss(rank 0) {loss.item():.4f} | max logit {stats['max_logit']:.3f} "
                  f"| clipped heads {int(stats['clipped_heads'])}")

    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}  # gathers shards
    shard = model.blocks[0].attn.q_proj.weight
    dist.destroy_process_group()  # the reference below is a plain single-process run
    if rank != 0:
        return
    print(f"{world} ranks on a {n_dp}x{args.tp} (dp, tp) mesh; q_proj.weight placed {shard.placements}, local shard "
          f"{tuple(shard.to_local().shape)} of {tuple(shard.shape)}")
    if args.check:
        ref = build(args.block_size)
        ref_opt = MuonClip(ref, lr=args.lr, tau=args.tau, orth_dtype=orth)
        for step in range(args.steps):
            for r in range(n_dp):  # the mean over data-parallel ranks of their mean losses, as FSDP averages
                x, y = batch(corpus, step, r, n_dp, args)
                (ref(x, y)[1] / n_dp).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        diff, worst = max((float((full[n] - p.detach()).abs().max()), n) for n, p in ref.named_parameters())
        print(f"max |W_fsdp_tp - W_single_process| = {diff:.2e} ({worst})")
        if diff > 1e-3:
            raise SystemExit("FSDP2 x TP run diverged from the single-process run")


if __name__ == "__main__":
    main()
