"""Which forward passes feed QK-Clip, and `MaxLogitMonitor` for reading the ones that must not.

**The rule.** An attention call's per-head max logits go into its layer's `MaxLogitRecorder`,
and so into the next QK-Clip, if and only if the call belongs to a *training forward*::

    the calling module is in training mode      (module.training)
    and autograd is recording                   (torch.is_grad_enabled(): not under
                                                 torch.no_grad() or torch.inference_mode())

`is_training_forward` states it, and the one recording path (`muonclip.attention.record.attend`)
is where every entry point applies it: the drop-in `muonclip.scaled_dot_product_attention` (the
reference GPT, any model calling it), the Hugging Face ``"muonclip"`` attention function, the
torchtitan recorders; each is told the module's mode by its ``training`` argument
(``training=self.training``, as for ``F.dropout``). Hence:

* Evaluation (``model.eval()`` and ``no_grad``: the Hugging Face ``Trainer.evaluate`` /
  ``predict``, Lightning's validation, ``muonclip train``'s validation), generation
  (``model.generate()`` runs under ``no_grad`` in either mode) and any forward under
  ``no_grad`` or ``inference_mode`` never reach the clip. A run that evaluates every step trains
  exactly like the same run without evaluation, provided the evaluation draws no random numbers
  that training uses later (an eval-mode forward without dropout draws none).
* An eval-mode forward with grad enabled (an evaluation loop without ``no_grad``) does not
  feed the clip either. A model trained in eval mode (to switch dropout off) feeds nothing:
  `muonclip.MuonClip` warns at a step that found nothing recorded.

**Activation recomputation** (``torch.utils.checkpoint``, transformers'
``gradient_checkpointing_enable``) records every micro-batch, before the optimizer step:

* ``use_reentrant=False`` (torch's recommendation, transformers 5's default): the forward runs
  with grad enabled and records; the backward recomputes the checkpointed layers with grad
  enabled and records again. The recomputation repeats the forward's operations on the same
  inputs and weights, with the random state of the forward restored (``preserve_rng_state=True``,
  the default), so it computes the same maxima, and a running max does not change when a value
  is folded in twice.
* ``use_reentrant=True``: the forward runs under ``no_grad`` and records nothing; the backward
  recomputes with grad enabled and records, once.

* **Selective** recomputation (``create_selective_checkpoint_contexts``: torch's SAC, torchtitan's
  default) replays the forward's operations against what the forward saved, one by one, and
  fails on any operation the forward did not run. The recording's own operations (the max, the
  recorder's running max, which takes another path once something is recorded) therefore run
  outside checkpointing's dispatch modes (`unseen_by_selective_checkpointing`): checkpointing
  neither counts, saves nor replays them, and the maxima and the clips are those of the same
  run without checkpointing.

(With ``preserve_rng_state=False`` and dropout, the recomputation draws other dropout masks, so
the layers after a dropout see other inputs than in the forward: then the gradients and the
maxima describe two different passes.)

**Forwards that are not data** (`unrecorded_forward`): a block inside which no attention call
feeds anything, neither the clip nor a monitor, whatever the mode. torch's pipeline schedules
(``torch.distributed.pipelining``) run each stage once, before the first step and after each
switch between training and evaluation, on tensors of the right shapes and no defined values
(uninitialised memory), in training mode with grad enabled, to learn the shapes its stages
exchange: such a forward would record garbage, NaN or huge maxima, into the step's clip.
`muonclip.integrations.pipelining.unrecorded_shape_inference` runs that pass in this block.

**Monitoring.** `MaxLogitMonitor` reads the max logits of any forward (an evaluation pass, a
generation) for logging, into recorders of its own; the clip's recorders are never touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from ._recorder import MaxLogitRecorder

_active: list[MaxLogitMonitor] = []  # monitors inside their ``with`` block, process-wide
_unrecorded = [0]  # depth of `unrecorded_forward` blocks, process-wide


def is_training_forward(training: bool) -> bool:
    """Whether an attention call feeds the clip (see the module docstring).

    Args:
        training: the calling module's ``module.training``.

    Returns:
        ``training and torch.is_grad_enabled()``, and not inside `unrecorded_forward`.
    """
    return bool(training) and torch.is_grad_enabled() and not _unrecorded[0]


@contextlib.contextmanager
def unrecorded_forward() -> Iterator[None]:
    """Attention calls inside the block feed no recorder: not the clip's, not a monitor's (module
    docstring, "Forwards that are not data"). Process-wide while the block runs; blocks nest."""
    _unrecorded[0] += 1
    try:
        yield
    finally:
        _unrecorded[0] -= 1


def recorders_to_feed(recorder: MaxLogitRecorder | None, training: bool) -> list[MaxLogitRecorder]:
    """Every recorder one attention call of the layer owning ``recorder`` folds its maxima into:
    the layer's own (the clip's) on a training forward, and that of each active
    `MaxLogitMonitor` watching the layer. Empty: the call need not compute its maxima."""
    if recorder is None or _unrecorded[0]:
        return []
    out = [recorder] if is_training_forward(training) else []
    for monitor in _active:
        mine = monitor._watched.get(id(recorder))
        if mine is not None:
            out.append(mine)
    return out


@contextlib.contextmanager
def unseen_by_selective_checkpointing() -> Iterator[None]:
    """Run the block outside selective activation checkpointing's dispatch modes.

    Inside a region checkpointed with ``create_selective_checkpoint_contexts``, torch counts
    every operation of the forward and, in the recomputation, hands each one the output it
    saved at the same count: an operation run in only one of the two passes fails the backward
    ("invocation index ... not found in storage") or shifts what later operations receive. The
    max-logit recording (its max and the recorder's running max) is such an operation, so it
    runs here: when a selective-checkpointing mode is active (and not under ``torch.compile``,
    whose checkpointing does not replay by count), every dispatch mode active at that point is
    left for the block and restored after it. Elsewhere the block runs as is.
    """
    if not torch.compiler.is_compiling():
        from torch.utils import checkpoint
        from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

        modes = tuple(getattr(checkpoint, n) for n in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode")
                      if hasattr(checkpoint, n))
        if any(isinstance(m, modes) for m in _get_current_dispatch_mode_stack()):
            with _disable_current_modes():
                yield
            return
    yield


class MaxLogitMonitor:
    """Per-head max logits of the forward passes run inside ``with monitor:``, for logging only.

    While the block runs, every attention call of a watched layer, training or not (evaluation,
    ``model.generate()``), also folds its per-head maxima into a recorder of the monitor's own.
    The layers' recorders, which QK-Clip consumes, are neither read nor written by the monitor,
    so what the monitor sees never reaches the clip. Entering the block starts from nothing;
    the figures stay readable after it. Use::

        monitor = MaxLogitMonitor(opt.layers)          # a MuonClip's layers
        with monitor:
            metrics = trainer.evaluate()
        metrics.update(monitor.stats(prefix="eval_"))  # {"eval_max_logit": ..., "eval_max_logit/<layer>": ...}

    A monitor is active in every thread of the process while its block runs; its figures are
    this process's (under data parallelism, reduce them with MAX yourself if you need the
    global one). Watching costs the max-logit computation in forwards that would otherwise skip
    it (evaluation): about one more ``Q K^T`` product per attention call.

    Args:
        layers: the layers to watch: `muonclip.qkclip.AttentionLayer` objects (or anything with
            ``name`` and ``recorder``), e.g. ``MuonClip.layers``,
            ``muonclip.qkclip.discover_layers(model)`` or ``muonclip.integrations.hf.attach(model)``;
            or a mapping from layer name to the layer's `MaxLogitRecorder`.

    Raises:
        TypeError: an entry without a `MaxLogitRecorder`.
        ValueError: no layers, or two with the same name or recorder.
    """

    def __init__(self, layers: Iterable[Any] | Mapping[str, MaxLogitRecorder]) -> None:
        pairs = list(layers.items()) if isinstance(layers, Mapping) else [
            (getattr(layer, "name", None), getattr(layer, "recorder", None)) for layer in layers
        ]
        if not pairs:
            raise ValueError("MaxLogitMonitor needs at least one attention layer to watch")
        names: dict[str, MaxLogitRecorder] = {}
        self._watched: dict[int, MaxLogitRecorder] = {}
        for name, recorder in pairs:
            if not isinstance(recorder, MaxLogitRecorder) or not isinstance(name, str):
                raise TypeError(
                    "MaxLogitMonitor watches attention layers (objects with a str `name` and a MaxLogitRecorder "
                    f"`recorder`, e.g. MuonClip.layers) or a {{name: MaxLogitRecorder}} mapping; got {name!r}: "
                    f"{type(recorder).__name__}"
                )
            if name in names or id(recorder) in self._watched:
                raise ValueError(f"MaxLogitMonitor: layer {name!r} (or its recorder) is given twice")
            names[name] = MaxLogitRecorder(recorder.n_heads, heads=recorder.heads)
            self._watched[id(recorder)] = names[name]
        self._sources = [recorder for _, recorder in pairs]  # keeps the ids above valid
        self._mine = names

    def __enter__(self) -> MaxLogitMonitor:
        if any(m is self for m in _active):
            raise RuntimeError("this MaxLogitMonitor is already active; use one `with` block at a time")
        self.reset()
        _active.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        for i, m in enumerate(_active):
            if m is self:
                del _active[i]
                break

    @property
    def active(self) -> bool:
        """Whether the monitor is inside its ``with`` block."""
        return any(m is self for m in _active)

    @property
    def max_logits(self) -> dict[str, Tensor]:
        """Per layer name, the ``(n_heads,)`` float32 maxima seen (layers that saw nothing are absent)."""
        return {name: r.value for name, r in self._mine.items() if r.value is not None}

    def stats(self, prefix: str = "") -> dict[str, float]:
        """The figures for a logger (one host sync): ``<prefix>max_logit`` (over layers and heads)
        and ``<prefix>max_logit/<layer>`` per layer; empty when nothing was seen.

        Args:
            prefix: prepended to every key (default ``""``).
        """
        seen = self.max_logits
        if not seen:
            return {}
        maxes = torch.stack([v.max().cpu() for v in seen.values()]).tolist()
        out = {f"{prefix}max_logit": max(maxes)}
        out.update({f"{prefix}max_logit/{name}": m for name, m in zip(seen, maxes)})
        return out

    def reset(self) -> None:
        """Forget what was seen (entering the ``with`` block does it too)."""
        for r in self._mine.values():
            r.reset()

    def __repr__(self) -> str:
        return f"MaxLogitMonitor(layers={list(self._mine)}, active={self.active})"


__all__ = ["MaxLogitMonitor", "is_training_forward", "recorders_to_feed", "unseen_by_selective_checkpointing"]
