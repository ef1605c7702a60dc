"""Deterministic batches: the batch of step s depends only on (seed, s), so a resumed run sees
exactly the batches an uninterrupted run would have seen, and every optimizer in
``muonclip compare`` sees the same data in the same order.

Training batch of step s: ``batch_size`` windows of ``block_size + 1`` tokens whose start
offsets are drawn uniformly from the training stream by a ``torch.Generator`` seeded with a
mix of (seed, s); inputs are the first ``block_size`` tokens, targets the last ``block_size``.
Validation: a fixed set of ``n_batches * batch_size`` windows, evenly spaced over the
validation stream (no randomness), so validation losses of different runs are comparable.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .corpus import Corpus, DataError

_MIX = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: spreads neighbouring (seed, step) pairs apart


def step_seed(seed: int, step: int) -> int:
    """The generator seed of training step ``step`` (a fixed mix of ``seed`` and ``step``)."""
    return (int(seed) * _MIX + int(step) * 0x2545F4914F6CDD1D + 1) % (2**63 - 1)


def check_fits(corpus: Corpus, batch_size: int, block_size: int) -> None:
    """Raise `DataError` if the corpus is smaller than one batch.

    The training stream must hold at least ``batch_size * block_size + 1`` tokens (one
    batch of distinct text) and the validation stream at least ``block_size + 1``.
    """
    need_train = batch_size * block_size + 1
    if corpus.train.numel() < need_train:
        raise DataError(
            f"the corpus ({corpus.source}) has {corpus.train.numel():,} training bytes, fewer than one batch "
            f"(batch_size {batch_size} x block_size {block_size} + 1 = {need_train:,}); "
            "give more text or lower them, e.g. --set batch_size=4 --set block_size=32"
        )
    if corpus.val.numel() < block_size + 1:
        raise DataError(
            f"the corpus ({corpus.source}) has {corpus.val.numel():,} validation bytes, fewer than one window "
            f"(block_size {block_size} + 1); give more text or lower block_size"
        )


MAX_EPOCHS = 10  # more passes over the training text than this: warned about (memorisation)


def corpus_warnings(corpus: Corpus, *, steps: int, batch_size: int, block_size: int) -> list[str]:
    """What is doubtful, though not wrong, about training on ``corpus`` (each a sentence for the user).

    * The run reads more than `MAX_EPOCHS` times as many bytes as the training stream holds
      (``steps * batch_size * block_size``): the model can memorise the text, and its
      validation loss then says little.
    * The validation stream is smaller than one batch (``batch_size * block_size + 1`` bytes):
      the validation windows overlap, so the validation loss is measured on little text.

    Small corpora are legitimate (a test, a demo), so these are warnings, not errors.
    """
    found = []
    read = steps * batch_size * block_size
    epochs = read / max(1, corpus.train.numel())
    if epochs > MAX_EPOCHS:
        found.append(
            f"the run reads its {corpus.train.numel():,} training bytes about {epochs:,.0f} times (steps {steps} x "
            f"batch_size {batch_size} x block_size {block_size} = {read:,} bytes); the model can learn them by heart "
            "and the validation loss will say little. Give more text or fewer steps"
        )
    need_val = batch_size * block_size + 1
    if corpus.val.numel() < need_val:
        found.append(
            f"the validation split holds {corpus.val.numel():,} bytes, less than one batch (batch_size {batch_size} "
            f"x block_size {block_size} + 1 = {need_val:,}); its windows overlap and the validation loss rests on "
            "little text. Give more text, or raise val_fraction"
        )
    return found


def _windows(stream: Tensor, starts: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    idx = starts[:, None] + torch.arange(block_size + 1)[None, :]  # (B, T+1)
    chunk = stream[idx].long()  # (B, T+1)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


def train_batch(corpus: Corpus, step: int, *, batch_size: int, block_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """The training batch of ``step``: ``(x, y)``, both ``(batch_size, block_size)`` int64, y = x shifted by one."""
    g = torch.Generator().manual_seed(step_seed(seed, step))
    high = corpus.train.numel() - block_size  # last valid start + 1
    starts = torch.randint(0, high, (batch_size,), generator=g)
    return _windows(corpus.train, starts, block_size)


def val_batches(corpus: Corpus, *, n_batches: int, batch_size: int, block_size: int) -> list[tuple[Tensor, Tensor]]:
    """The fixed validation set: ``n_batches`` batches of evenly spaced windows of the validation stream."""
    if n_batches < 1:
        raise DataError(f"eval_batches must be >= 1, got {n_batches}")
    last = corpus.val.numel() - block_size - 1
    starts = torch.linspace(0, last, n_batches * batch_size).round().long()
    return [
        _windows(corpus.val, starts[i * batch_size : (i + 1) * batch_size], block_size) for i in range(n_batches)
    ]
