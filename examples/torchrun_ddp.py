"""DDP with MuonClip, launched by torchrun (gloo on CPU works; NCCL on GPUs).

    torchrun --standalone --nproc_per_node=2 examples/torchrun_ddp.py --steps 5

Every rank holds the whole model (DDP averages the gradients); `MuonClip` splits the
orthogonalisation of the hidden matrices between the ranks and exchanges the results, and
folds every rank's max logits into the clip with one MAX all-reduce per step — nothing to set
up beyond passing the unwrapped model. Each rank reads different batches; the script checks
that all ranks end with the same weights and, with ``--check``, that they equal one process
trained on the same global batches (``--check`` costs rank 0 a second, single-process run).

The text (the app's built-in corpus) needs ``pip install "muonclip[cli]"``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

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
    ddp = DDP(model)
    opt = MuonClip(model, lr=args.lr, tau=args.tau)
    for step in range(args.steps):
        x, y = batch(corpus, step, rank, world, args)
        _, loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = opt.clip_stats()  # the same on every rank: the maxima were all-reduced
        if rank == 0:
            print(f"step {step + 1} | loss(rank 0) {loss.item():.4f} | max logit {stats['max_logit']:.3f} "
                  f"| clipped heads {int(stats['clipped_heads'])}")

    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    spread = max(float((g - flat).abs().max()) for g in gathered)
    dist.destroy_process_group()  # the reference below is a plain single-process run
    if rank != 0:
        return
    print(f"{world} ranks, weights identical across ranks: {spread == 0.0}")
    if spread != 0.0:
        raise SystemExit(f"ranks disagree by {spread}")
    if args.check:
        ref = build(args.block_size)
        ref_opt = MuonClip(ref, lr=args.lr, tau=args.tau)
        for step in range(args.steps):
            for r in range(world):  # the mean over ranks of per-rank mean losses, as DDP averages
                x, y = batch(corpus, step, r, world, args)
                (ref(x, y)[1] / world).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        diff = max(float((a - b).detach().abs().max()) for a, b in zip(model.parameters(), ref.parameters()))
        print(f"max |W_ddp - W_single_process| = {diff:.2e}")
        if diff > 1e-3:
            raise SystemExit("DDP run diverged from the single-process run")

if __name__ == "__main__":
    main()
