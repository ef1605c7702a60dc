"""`trainer_optimizer`: `muonclip.MuonClip` / `muonclip.Muon` in the Hugging Face Trainer (and TRL) in one line.

The Trainer builds its optimizer in ``create_optimizer``: an optimizer *class* in
``optimizer_cls_and_kwargs`` is called with a list of param groups (``cls(groups, **kwargs)``),
which is not what `MuonClip` needs (the model: its attention layers and the routing of its
parameters; given a list it raises a TypeError saying what to pass). Anything else in that
place is a *factory*: the Trainer calls ``factory()(model, **kwargs)`` with the model it trains
(transformers >= 5). `trainer_optimizer` returns such a pair::

    from muonclip import MuonClip
    from muonclip.integrations.hf import trainer_optimizer

    trainer = Trainer(model, args, train_dataset=ds,
                      optimizer_cls_and_kwargs=trainer_optimizer(MuonClip, args=args, tau=100.0))

TRL's ``SFTTrainer`` (a Trainer) takes the same argument. ``optimizers=(MuonClip(model, ...),
None)`` works too; so does ``optimizer_cls_and_kwargs=(MuonClip, {"model": model, ...})``
(the Trainer hands a ``"model"`` entry to the class in place of the groups).

**Learning rate and weight decay.** With an optimizer built this way the Trainer's schedule
(warm-up, decay) multiplies the *optimizer's* ``lr``; ``TrainingArguments.learning_rate`` and
``weight_decay`` are not read. With ``args=`` given, `trainer_optimizer` uses them for the ``lr``
and ``weight_decay`` not passed explicitly, and warns (`TrainerArgumentsWarning`) when an
explicit value disagrees; `muonclip.integrations.hf.MuonClipTrainerCallback` warns at the start
of training when the optimizer the Trainer holds disagrees with its arguments, however it was
built.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from ..optim import Muon, param_groups
from ..qkclip._muonclip import MuonClip

ARGUMENTS = (("learning_rate", "lr"), ("weight_decay", "weight_decay"))
"""``(TrainingArguments field, optimizer keyword)`` pairs that `trainer_optimizer` and the callback compare."""


class TrainerArgumentsWarning(UserWarning):
    """``TrainingArguments.learning_rate`` / ``weight_decay`` differ from the optimizer's own values
    (which are the ones the Trainer's schedule uses)."""


def disagreements(args: Any, values: dict[str, float]) -> list[str]:
    """``"TrainingArguments.<field>=a but the optimizer's <key>=b"`` for each pair of `ARGUMENTS`
    whose values differ (relative tolerance 1e-9); ``values`` holds the optimizer's."""
    out = []
    for field, key in ARGUMENTS:
        a, b = getattr(args, field, None), values.get(key)
        if a is None or b is None:
            continue
        if not math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0):
            out.append(f"TrainingArguments.{field}={a:g} but the optimizer's {key}={float(b):g}")
    return out


def warn_disagreements(args: Any, values: dict[str, float], stacklevel: int = 3) -> None:
    """Warn (`TrainerArgumentsWarning`) when `disagreements` finds any."""
    found = disagreements(args, values)
    if found:
        warnings.warn(
            "; ".join(found) + ". The Trainer schedules the optimizer's own values and does not read these "
            "TrainingArguments when the optimizer is passed in: set them equal (or pass args= to "
            "muonclip.integrations.hf.trainer_optimizer, which takes the missing ones from them).",
            TrainerArgumentsWarning,
            stacklevel=stacklevel,
        )


class TrainerOptimizerFactory:
    """The factory the Trainer calls: ``factory()`` returns `build`, which the Trainer calls as
    ``build(model, **kwargs)``.

    Args:
        optimizer_cls: `muonclip.MuonClip` or `muonclip.Muon` (or a subclass).
    """

    def __init__(self, optimizer_cls: type[Muon]) -> None:
        self.optimizer_cls = optimizer_cls

    def __call__(self) -> Callable[..., Muon]:
        return self.build

    def build(self, model: nn.Module, **kwargs: Any) -> Muon:
        """``MuonClip(model, **kwargs)``; for a `Muon` that is not a `MuonClip`,
        ``Muon(kwargs.pop("groups", None) or param_groups(model), **kwargs)``."""
        if issubclass(self.optimizer_cls, MuonClip):
            return self.optimizer_cls(model, **kwargs)
        groups = kwargs.pop("groups", None)
        return self.optimizer_cls(param_groups(model) if groups is None else groups, **kwargs)

    def __repr__(self) -> str:
        return f"TrainerOptimizerFactory({self.optimizer_cls.__name__})"


def trainer_optimizer(
    optimizer_cls: type[Muon] = MuonClip, *, args: Any = None, **kwargs: Any
) -> tuple[TrainerOptimizerFactory, dict[str, Any]]:
    """The ``optimizer_cls_and_kwargs`` pair that builds ``optimizer_cls`` on the model the Trainer trains.

    Args:
        optimizer_cls: `muonclip.MuonClip` (default) or `muonclip.Muon` (or a subclass). A
            `Muon` gets `muonclip.param_groups` of the model unless ``groups=`` is given.
        args: the ``TrainingArguments`` (default None): their ``learning_rate`` and
            ``weight_decay`` fill ``lr`` and ``weight_decay`` when those are not given; an
            explicit value that disagrees warns (`TrainerArgumentsWarning`).
        **kwargs: the optimizer's keywords (``lr``, ``tau``, ``weight_decay``, ``groups``, ...).

    Returns:
        ``(factory, kwargs)`` for ``Trainer(..., optimizer_cls_and_kwargs=...)`` (and TRL's
        trainers); the Trainer calls ``factory()(model, **kwargs)``.

    Raises:
        TypeError: ``optimizer_cls`` is not a subclass of `muonclip.Muon`.
    """
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, Muon)):
        raise TypeError(
            f"trainer_optimizer builds muonclip.MuonClip or muonclip.Muon (or a subclass), got {optimizer_cls!r}; "
            "another optimizer class goes straight into optimizer_cls_and_kwargs=(cls, {...})"
        )
    kwargs = dict(kwargs)
    if args is not None:
        warn_disagreements(args, kwargs)
        for field, key in ARGUMENTS:
            if key not in kwargs and getattr(args, field, None) is not None:
                kwargs[key] = float(getattr(args, field))
    return TrainerOptimizerFactory(optimizer_cls), kwargs


__all__ = ["ARGUMENTS", "TrainerArgumentsWarning", "TrainerOptimizerFactory", "disagreements", "trainer_optimizer",
           "warn_disagreements"]
