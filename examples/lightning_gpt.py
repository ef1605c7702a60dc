"""PyTorch Lightning: the reference GPT with MuonClip, gradient accumulation, a checkpoint and a resume.

    python examples/lightning_gpt.py --steps 8

``configure_optimizers`` returns `MuonClip`; Lightning calls ``step()`` once per
``accumulate_grad_batches`` micro-batches, so the clip sees the max logits of all of them.
`MuonClipLightningCallback` logs ``muonclip/max_logit``, ``muonclip/clipped_heads`` and
``muonclip/update_rms`` after every optimizer step. The script trains half the steps, saves a
Lightning checkpoint, resumes from it in a fresh Trainer for the other half, and checks the
weights against an uninterrupted run: a resume continues identically.

The text (the app's built-in corpus) needs ``pip install "muonclip[cli]"``, Lightning
``pip install "muonclip[lightning]"``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from muonclip import MuonClip
from muonclip.app.data import load_corpus
from muonclip.integrations.lightning import MuonClipLightningCallback
from muonclip.models import GPT, GPTConfig

ACCUM, BATCH = 2, 4


class LitGPT(pl.LightningModule):
    def __init__(self, block_size: int, lr: float, tau: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(vocab_size=256, block_size=block_size, n_layer=2, n_head=4, n_embd=64))
        self.lr, self.tau = lr, tau

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        _, loss = self.model(x, y)
        self.log("loss", loss, on_step=True, prog_bar=True)
        return loss

    def configure_optimizers(self) -> MuonClip:
        return MuonClip(self.model, lr=self.lr, tau=self.tau)


def loader(steps_per_epoch: int, block_size: int) -> DataLoader:
    corpus = load_corpus()
    n = steps_per_epoch * ACCUM * BATCH
    data = corpus.train[: n * (block_size + 1)].long().view(n, block_size + 1)
    return DataLoader(TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH, shuffle=False)


def trainer(epochs: int) -> pl.Trainer:
    return pl.Trainer(
        max_epochs=epochs, accumulate_grad_batches=ACCUM, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[MuonClipLightningCallback()],
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps in all, an even number (default 8)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--tau", type=float, default=30.0, help="QK-Clip threshold (default 30; Kimi K2: 100)")
    args = ap.parse_args()
    if args.steps < 2 or args.steps % 2:
        ap.error("--steps must be an even number >= 2 (two epochs of steps/2 optimizer steps)")
    data = loader(args.steps // 2, args.block_size)

    full = LitGPT(args.block_size, args.lr, args.tau)
    t = trainer(2)
    t.fit(full, data)
    m = t.callback_metrics
    print(f"uninterrupted: {t.global_step} steps, loss {float(m['loss']):.4f}, "
          f"max logit {float(m['muonclip/max_logit']):.3f}, clipped heads {int(m['muonclip/clipped_heads'])}, "
          f"update RMS {float(m['muonclip/update_rms']):.3f}")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "half.ckpt"
        first = trainer(1)
        first.fit(LitGPT(args.block_size, args.lr, args.tau), data)
        first.save_checkpoint(ckpt)
        resumed = LitGPT(args.block_size, args.lr, args.tau)
        second = trainer(2)
        second.fit(resumed, data, ckpt_path=str(ckpt))
    same = all(torch.equal(a, b) for a, b in zip(full.state_dict().values(), resumed.state_dict().values()))
    print(f"resumed from step {args.steps // 2} to {second.global_step}: weights identical to the uninterrupted run: "
          f"{same}")
    if not same:
        raise SystemExit("resume diverged from the uninterrupted run")


if __name__ == "__main__":
    main()
