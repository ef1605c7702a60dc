"""Plain PyTorch: the reference GPT trained with MuonClip on the built-in Shakespeare corpus.

    python examples/plain_pytorch.py --steps 20

One optimizer for the whole model: `MuonClip` routes hidden matrices to Muon and embeddings,
norms and the head to AdamW (`muonclip.param_groups`), and clips the attention heads whose max
logit passed ``tau`` after each step. Gradient accumulation needs nothing special: every
micro-batch's forward pass records its max logits and ``step()`` clips with the max of all.

The optimizer and the reference GPT need torch alone; the text (the app's built-in corpus,
`muonclip.app.data`) needs ``pip install "muonclip[cli]"``.
"""

from __future__ import annotations

import argparse
import time

import torch

import muonclip
from muonclip.app.data import load_corpus, train_batch
from muonclip.models import GPT, GPTConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    ap.add_argument("--accum", type=int, default=2, help="micro-batches per step (default 2)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--tau", type=float, default=30.0, help="QK-Clip threshold (default 30; Kimi K2: 100)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    corpus = load_corpus()  # the Shakespeare plays shipped with the package, byte tokens
    model = GPT(GPTConfig(vocab_size=corpus.vocab_size, block_size=args.block_size, n_layer=2, n_head=4, n_embd=64))
    opt = muonclip.MuonClip(model, lr=args.lr, tau=args.tau)
    print(muonclip.param_groups(model).report())
    print(f"corpus: {corpus.source}, {corpus.train.numel():,} training bytes")

    model.train()
    t0 = time.perf_counter()
    for step in range(args.steps):
        total = 0.0
        for micro in range(args.accum):
            x, y = train_batch(corpus, step * args.accum + micro, batch_size=args.batch_size,
                               block_size=args.block_size, seed=args.seed)
            _, loss = model(x, y)
            (loss / args.accum).backward()
            total += loss.item() / args.accum
        opt.step()  # Muon + AdamW update, then QK-Clip with the max over both micro-batches
        opt.zero_grad(set_to_none=True)
        stats = opt.clip_stats()
        print(f"step {step + 1:4d} | loss {total:.4f} | max logit {stats['max_logit']:7.3f} "
              f"| clipped heads {int(stats['clipped_heads'])}")
    print(f"done: {args.steps} steps in {time.perf_counter() - t0:.1f}s, final loss {total:.4f}")


if __name__ == "__main__":
    main()
