"""FSDP2 (``fully_shard``) with MuonClip, launched by torchrun (gloo on CPU works; NCCL on GPUs).

    torchrun --standalone --nproc_per_node=2 examples/torchrun_fsdp.py --steps 5

Every weight is a DTensor sharded by rows (``Shard(0)``) and the momentum stays sharded.
Muon must orthogonalise whole matrices, never a shard: `MuonClip` gathers each matrix to one
owner rank, orthogonalises it there once and scatters the result back; QK-Clip scales the
local rows of each clipped head. The script checks, with ``--check``, that the gathered
weights equal one process trained on the same global batches (a per-shard Newton–Schulz would
be a different optimizer and fail this by orders of magnitude).

The text (the app's built-in corpus) needs ``pip install "muonclip[cli]"``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from muonclip import MuonClip
from muonclip.app.data import load_corpus, train_batch
from muonclip.models import GPT, GPTConfig


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
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    ap.add_argument("--batch-size", type=int, default=4, help="rows per rank (default 4)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--tau", type=float, default=30.0, help="QK-Clip threshold (default 30; Kimi K2: 100)")
    ap.add_argument("--check", action="store_true", help="compare with a single-process run on rank 0")
    args = ap.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    corpus = load_corpus()

    model = build(args.block_size)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)  # the root: embeddings (tied with the head) and the final norm
    opt = MuonClip(model, lr=args.lr, tau=args.tau)
    for step in range(args.steps):
        x, y = batch(corpus, step, rank, world, args)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = opt.clip_stats()  # the same on every rank: the maxima were all-reduced
        if rank == 0:
            print(f"step {step + 1} | loss(rank 0) {loss.item():.4f} | max logit {stats['max_logit']:.3f} "
                  f"| clipped heads {int(stats['clipped_heads'])}")

    full = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}  # gathers shards
    shard = next(p for p in model.parameters() if p.ndim == 2)
    dist.destroy_process_group()  # the reference below is a plain single-process run
    if rank != 0:
        return
    print(f"{world} ranks, parameters sharded as {shard.placements}, local shard {tuple(shard.to_local().shape)} "
          f"of {tuple(shard.shape)}")
    if args.check:
        ref = build(args.block_size)
        ref_opt = MuonClip(ref, lr=args.lr, tau=args.tau)
        for step in range(args.steps):
            for r in range(world):  # the mean over ranks of per-rank mean losses, as FSDP averages
                x, y = batch(corpus, step, r, world, args)
                (ref(x, y)[1] / world).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        diff = max(float((full[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
        print(f"max |W_fsdp - W_single_process| = {diff:.2e}")
        if diff > 1e-3:
            raise SystemExit("FSDP2 run diverged from the single-process run")


if __name__ == "__main__":
    main()
