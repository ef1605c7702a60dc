"""`MuonClipTrainerCallback`: MuonClip's figures in the Hugging Face Trainer's logs.

``Trainer(..., optimizers=(MuonClip(model, ...), scheduler))`` works without it: the Trainer
calls ``optimizer.step()`` once per optimizer step, after every micro-batch of gradient
accumulation has run its forward pass, so the clip sees the max logits of all of them
(``scheduler=None`` lets the Trainer build its usual schedule on top of our optimizer). The
callback adds, on every training log (every ``logging_steps``), the figures of
`muonclip.qkclip.step_metrics` with the prefix ``"muonclip/"``: ``max_logit``,
``clipped_heads``, ``clipped_fraction`` and ``update_rms`` of the last optimizer step, and
``max_logit_peak`` since the previous log; per layer with ``per_layer=True``. At the start of
training it warns when ``TrainingArguments.learning_rate`` / ``weight_decay`` differ from the
optimizer's (the values the schedule uses). They land in
``trainer.state.log_history`` and in every reporting integration (TensorBoard, W&B, ...,
``report_to``) that runs after the callback — which is why `MuonClipTrainerCallback.install`
puts it first: the Trainer calls its callbacks in order and the reporting ones come before
those passed as ``callbacks=[...]``. Passed that way, the figures still reach ``log_history``
and the console. Use::

    from muonclip import MuonClip
    from muonclip.integrations.hf import MuonClipTrainerCallback

    opt = MuonClip(model, lr=1e-3, tau=100.0)        # also switches the model to the "muonclip" attention
    trainer = Trainer(model, args, train_dataset=ds, optimizers=(opt, None))
    MuonClipTrainerCallback().install(trainer)        # ahead of the reporting callbacks
    trainer.train()

Evaluation (``eval_strategy``, ``Trainer.evaluate`` / ``predict``) and ``model.generate()``
never count in a clip, with or without the callback: they run under ``torch.no_grad()``, and
only training forwards feed the clip (`muonclip.attention.forward_rule`). To log an evaluation's
max logits, run it inside a `muonclip.attention.MaxLogitMonitor`.
"""

from __future__ import annotations

from typing import Any

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from ..qkclip.step_metrics import StepMetrics, unwrap_optimizer
from .hf_trainer import warn_disagreements

_NOT_TRAINING_LOGS = ("eval_", "test_", "train_runtime")


class MuonClipTrainerCallback(TrainerCallback):
    """Logs MuonClip's max logits, clipped-head counts and update RMS to the Trainer's loggers.

    Args:
        update_rms: measure the update RMS (default True; keeps one copy of the hidden
            matrices during each optimizer step).
        per_layer: also log ``max_logit/<layer>`` and ``clipped_heads/<layer>`` (default False).
        prefix: key prefix (default ``"muonclip/"``).

    Attributes:
        metrics: the `StepMetrics` tracker; ``metrics.last`` holds the last step's figures.
    """

    def __init__(self, *, update_rms: bool = True, per_layer: bool = False, prefix: str = "muonclip/") -> None:
        self.metrics = StepMetrics(update_rms=update_rms, per_layer=per_layer, prefix=prefix)

    def install(self, trainer: Trainer) -> MuonClipTrainerCallback:
        """Put this callback first in ``trainer``'s callbacks (so every reporter sees its figures); returns it."""
        callbacks = trainer.callback_handler.callbacks
        if self in callbacks:
            callbacks.remove(self)
        callbacks.insert(0, self)
        return self

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Warn (`muonclip.integrations.hf_trainer.TrainerArgumentsWarning`) when ``args.learning_rate``
        or ``args.weight_decay`` differ from the optimizer's own ``lr`` / ``weight_decay``, which
        are the values the Trainer's schedule uses."""
        opt = unwrap_optimizer(kwargs.get("optimizer"))
        if opt is not None:
            warn_disagreements(args, opt.defaults, stacklevel=2)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.metrics.before_step(kwargs.get("optimizer"))

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.metrics.after_step()

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs is None or any(k.startswith(_NOT_TRAINING_LOGS) for k in logs):
            return
        figures = self.metrics.pop_interval()
        if not figures:
            return
        logs.update(figures)
        # Trainer.log appended a copy of ``logs`` to the history just before calling us.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(figures)


__all__ = ["MuonClipTrainerCallback"]
