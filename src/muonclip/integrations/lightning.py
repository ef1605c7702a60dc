"""`MuonClipLightningCallback`: MuonClip's figures in PyTorch Lightning's loggers.

Use::

    import lightning.pytorch as pl
    from muonclip import MuonClip
    from muonclip.integrations.lightning import MuonClipLightningCallback

    class Lit(pl.LightningModule):
        ...
        def configure_optimizers(self):
            return MuonClip(self.model, lr=1e-3, tau=100.0)

    pl.Trainer(accumulate_grad_batches=4, callbacks=[MuonClipLightningCallback()]).fit(Lit(), loader)

``configure_optimizers`` returning `MuonClip` works without the callback: Lightning calls
``optimizer.step(closure)`` once per ``accumulate_grad_batches`` micro-batches, after all of
their forward passes, so the clip sees the max logits of all of them. Lightning's checkpoints
save ``optimizer.state_dict()`` (momentum, Adam moments, step counters, ``tau``) and restore
it on ``fit(ckpt_path=...)``; with ``ModelParallelStrategy`` (FSDP2: shard the model in
``configure_model``) through torch's ``get_optimizer_state_dict`` / ``set_optimizer_state_dict``,
which take MuonClip's state dict as it is (`muonclip.optim._state_dicts`). The max-logit
recorders are empty at every step boundary (the clip consumed them), so a run resumed from a
checkpoint taken at a step boundary continues exactly like an uninterrupted one (given the same
data order). ``self.optimizers()`` (Lightning's ``LightningOptimizer``) passes on
``clip_stats()``, ``tau`` and MuonClip's other attributes. docs/integrations.md has recipes for
DDP and ``ModelParallelStrategy``, run by the tests.

The callback logs, after every optimizer step, through ``pl_module.log_dict`` (``on_step=True``),
the figures of `muonclip.qkclip.step_metrics` with the prefix ``"muonclip/"``: ``max_logit``,
``clipped_heads``, ``clipped_fraction`` and ``update_rms`` (per layer with ``per_layer=True``).
They go to ``trainer.logger`` at its ``log_every_n_steps`` and to ``trainer.callback_metrics``.
Under FSDP2 each process measures its shard and the update RMS is summed over the optimizer's
process group (`muonclip.qkclip.step_metrics`), so every process logs the whole model's.

Validation, testing and prediction never count in a clip, with or without this callback, even
in the middle of an accumulation window: Lightning runs them in eval mode under
``torch.inference_mode()`` (or ``no_grad``), and only training forwards feed the clip
(`muonclip.attention.forward_rule`). To log a validation pass's max logits, use a
`muonclip.attention.MaxLogitMonitor`.
"""

from __future__ import annotations

from typing import Any

try:
    import lightning.pytorch as pl
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        "muonclip.integrations.lightning needs PyTorch Lightning: pip install 'muonclip[lightning]'"
    ) from e

from ..qkclip.step_metrics import StepMetrics


class MuonClipLightningCallback(pl.Callback):
    """Logs MuonClip's max logits, clipped-head counts and update RMS after every optimizer step.

    Args:
        update_rms: measure the update RMS (default True; keeps one copy of the hidden
            matrices during each optimizer step).
        per_layer: also log ``max_logit/<layer>`` and ``clipped_heads/<layer>`` (default False).
        prefix: key prefix (default ``"muonclip/"``).
        prog_bar: show the figures in the progress bar (default False).

    Attributes:
        metrics: the `StepMetrics` tracker; ``metrics.last`` holds the last step's figures.
    """

    def __init__(
        self, *, update_rms: bool = True, per_layer: bool = False, prefix: str = "muonclip/", prog_bar: bool = False
    ) -> None:
        super().__init__()
        self.metrics = StepMetrics(update_rms=update_rms, per_layer=per_layer, prefix=prefix)
        self.prog_bar = prog_bar

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.metrics.before_step(optimizer)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        figures = self.metrics.after_step()
        if figures:
            pl_module.log_dict(figures, on_step=True, on_epoch=False, prog_bar=self.prog_bar, batch_size=1)


__all__ = ["MuonClipLightningCallback"]
