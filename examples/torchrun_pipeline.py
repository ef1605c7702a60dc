"""Pipeline parallelism with MuonClip (``torch.distributed.pipelining``), launched by torchrun (gloo on CPU works).

    torchrun --standalone --nproc_per_node=2 examples/torchrun_pipeline.py --steps 5
    torchrun --standalone --nproc_per_node=4 examples/torchrun_pipeline.py --dp 2 --schedule 1F1B

The reference GPT cut in two stages: the embedding and the first half of the blocks; the other
half, the final norm and the head. Each stage is held by ``--dp`` ranks (ranks ``0..dp-1``
stage 0, the next ones stage 1) and sharded over them by FSDP2 (``fully_shard`` over the
``"dp"`` dimension of a ``("pp", "dp")`` mesh). A schedule (``ScheduleGPipe`` or
``Schedule1F1B``) runs ``--microbatches`` micro-batches of every rank's rows through both stages,
then each rank steps its stage's MuonClip. Two things make that MuonClip the one-process one
(`muonclip.integrations.pipelining`):

* ``process_group=mesh["dp"].get_group()``: the stage's own ranks. Each matrix is orthogonalised
  once, whole, on one of them, and the stage's max logits are reduced over them only. The
  automatic group would be the parameters' whole mesh, which holds the other stage too: its
  parameters are not replicas of these.
* ``unrecorded_shape_inference(schedule)``: torch's schedule runs each stage once on
  uninitialised tensors before the first step, to learn the shapes the stages exchange; that
  pass must not feed the clip.

Every micro-batch's forward records its attention maxima; the clip after the schedule's step
uses their running max. With ``--check``, rank 0 gathers both stages' weights and compares them
with one process trained on the same global batches, in the same micro-batches.

The text (the app's built-in corpus) needs ``pip install "muonclip[cli]"``.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from muonclip import MuonClip
from muonclip.app.data import load_corpus, train_batch
from muonclip.integrations.pipelining import unrecorded_shape_inference
from muonclip.models import GPT, GPTConfig

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}


def build(block_size: int) -> GPT:
    torch.manual_seed(0)  # the same initial weights on every rank
    return GPT(GPTConfig(vocab_size=256, block_size=block_size, n_layer=2, n_head=4, n_embd=64, tie_embeddings=False))


class FirstStage(nn.Module):
    """The embedding and the first blocks (named as in the whole GPT: ``blocks.0.attn``, ...)."""

    def __init__(self, gpt: GPT, blocks: range) -> None:
        super().__init__()
        self.wte, self.drop = gpt.wte, gpt.drop
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in blocks})

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.wte(idx))
        for block in self.blocks.values():
            x = block(x)
        return x


class LastStage(nn.Module):
    """The last blocks, the final norm and the head: logits."""

    def __init__(self, gpt: GPT, blocks: range) -> None:
        super().__init__()
        self.blocks = nn.ModuleDict({str(i): gpt.blocks[i] for i in blocks})
        self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x))


def stage_module(gpt: GPT, stage: int) -> nn.Module:
    half = gpt.config.n_layer // 2
    return FirstStage(gpt, range(half)) if stage == 0 else LastStage(gpt, range(half, gpt.config.n_layer))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def batch(corpus, step: int, rank: int, world: int, args) -> tuple[torch.Tensor, torch.Tensor]:
    """Data-parallel rank ``rank``'s share of step ``step``'s global batch (world * batch_size rows)."""
    x, y = train_batch(corpus, step, batch_size=world * args.batch_size, block_size=args.block_size, seed=0)
    rows = slice(rank * args.batch_size, (rank + 1) * args.batch_size)
    return x[rows], y[rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps (default 5)")
    ap.add_argument("--dp", type=int, default=1, help="ranks per stage (FSDP2 over them; default 1)")
    ap.add_argument("--schedule", choices=sorted(SCHEDULES), default="GPipe")
    ap.add_argument("--microbatches", type=int, default=2, help="micro-batches per step (default 2)")
    ap.add_argument("--batch-size", type=int, default=4, help="rows per data-parallel rank (default 4)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--tau", type=float, default=30.0, help="QK-Clip threshold (default 30; Kimi K2: 100)")
    ap.add_argument("--check", action="store_true", help="compare with a single-process run on rank 0")
    args = ap.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2 * args.dp:
        raise SystemExit(f"two stages of --dp {args.dp} ranks need {2 * args.dp} processes, got {world}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    corpus = load_corpus()

    mesh = init_device_mesh(device.type, (2, args.dp), mesh_dim_names=("pp", "dp"))
    stage_index, dp_rank = mesh.get_coordinate()
    module = stage_module(build(args.block_size), stage_index).to(device)
    for block in module.blocks.values():
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    stage = PipelineStage(module, stage_index, 2, device, group=mesh["pp"].get_group())
    schedule = unrecorded_shape_inference(SCHEDULES[args.schedule](stage, n_microbatches=args.microbatches,
                                                                   loss_fn=loss_fn))
    opt = MuonClip(module, lr=args.lr, tau=args.tau, process_group=mesh["dp"].get_group())
    for step in range(args.steps):
        x, y = batch(corpus, step, dp_rank, args.dp, args)
        losses: list[torch.Tensor] = []
        if stage_index == 0:
            schedule.step(x.to(device))
        else:
            schedule.step(target=y.to(device), losses=losses)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = opt.clip_stats()  # this stage's layers, the same on its ranks
        mine = (stage_index, float(torch.stack(losses).detach().mean()) if losses else None, stats["max_logit"],
                int(stats["clipped_heads"]))
        every = [None] * world
        dist.all_gather_object(every, mine)
        if rank == 0:
            first, last = next(e for e in every if e[0] == 0), next(e for e in every if e[0] == 1)
            print(f"step {step + 1} | loss(last stage) {last[1]:.4f} | max logit {max(first[2], last[2]):.3f} "
                  f"| clipped heads {first[3] + last[3]} (stage 0: {first[3]}, stage 1: {last[3]})")

    full = {name: p.full_tensor().detach().clone() for name, p in module.named_parameters()}  # within the stage
    stages: list = [None] * world
    dist.all_gather_object(stages, full)
    dist.destroy_process_group()  # the reference below is a plain single-process run
    if rank != 0:
        return
    gathered = {k: v for s in stages for k, v in s.items()}
    print(f"2 stages x {args.dp} ranks, {args.schedule}, {args.microbatches} micro-batches; stage weights sharded "
          f"over their ranks")
    if args.check:
        ref = build(args.block_size)
        ref_opt = MuonClip(ref, lr=args.lr, tau=args.tau)
        for step in range(args.steps):
            for r in range(args.dp):  # each rank's rows in the same micro-batches; losses averaged as FSDP does
                x, y = batch(corpus, step, r, args.dp, args)
                for xm, ym in zip(x.tensor_split(args.microbatches), y.tensor_split(args.microbatches)):
                    (ref(xm, ym)[1] / (args.dp * args.microbatches)).backward()
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
        diff = max(float((gathered[n] - p.detach()).abs().max()) for n, p in ref.named_parameters())
        print(f"max |W_pipeline - W_single_process| = {diff:.2e}")
        if diff > 1e-3:
            raise SystemExit("the pipelined run diverged from the single-process run")


if __name__ == "__main__":
    main()
