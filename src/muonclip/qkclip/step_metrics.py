"""What the logging callbacks report about a `muonclip.Muon` / `muonclip.MuonClip` step — no framework needed.

Per optimizer step (keys with the default prefix ``"muonclip/"``):

* ``max_logit`` — the largest per-head max logit the clip used in this step (over layers and
  heads, over all micro-batches of the step): ``MuonClip.last_max_logits``. MuonClip only.
  ``max_logit_is_bound`` is 1 when that value is an upper bound from the attention kernel's
  log-sum-exp (MuonClip's gated capture records heads that stay at or below tau that way, at
  most ``log(keys)`` above their exact max), 0 when it is exact.
* ``clipped_heads`` — how many heads QK-Clip scaled in this step (``MuonClip.last_clipped``),
  and ``clipped_fraction`` — that over all heads. MuonClip only.
* ``max_logit/<layer>`` and ``clipped_heads/<layer>`` per attention layer, with
  ``per_layer=True``.
* ``update_rms`` — the RMS of the update Muon applied to the hidden matrices, per unit learning
  rate: over every element of every ``algorithm="muon"`` parameter updated in the step,

      U = (W_before * (1 - lr * weight_decay) - W_after) / lr        # = scale(A, B) * orth(V)
      update_rms = sqrt(mean(U ** 2))

  i.e. the orthogonalised update with its scale (``adjust_lr_fn``; weight decay removed exactly,
  as Muon applies it). With ``adjust_lr_fn="match_rms_adamw"`` (the default) it is about 0.2 (exactly 0.2 for full-rank
  matrices with ``method="svd"``; ns5's singular values in ~[0.68, 1.13] make it a little
  less), the RMS of a typical AdamW update — the quantity Moonlight matches. For `MuonClip`
  it is measured after the Muon update and before QK-Clip rescales any head (the clip is not
  an update of the optimizer; its effect is ``clipped_heads``). Computing it keeps one copy of
  the hidden matrices during the step (``update_rms=False`` to skip it). Parameters whose
  group has ``lr == 0`` are left out. With parameters sharded over several ranks (FSDP2,
  tensor parallel) each rank measures its piece and the callbacks sum the pieces over the
  optimizer's process group (`muonclip.distributed._context.collective_group`: every rank logs
  the figure of the whole model; ``process_group="local"``: each rank its own).

Steps that Muon skipped (``on_nonfinite="skip"``) report nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..common._dtensor import local, replicas
from ..distributed._context import collective_group
from ..optim import Muon
from ..optim._wrappers import wrapped_optimizer


def unwrap_optimizer(optimizer: Any) -> Muon | None:
    """The `muonclip.Muon` / `muonclip.MuonClip` inside a framework's optimizer wrapper, or None.

    Follows the wrapped-optimizer links (``.optimizer``; Lightning's ``._optimizer``) a few
    levels deep: accelerate's ``AcceleratedOptimizer`` (what ``Accelerator.prepare`` returns,
    also inside the HF Trainer), Lightning's ``LightningOptimizer`` (``self.optimizers()``), both
    made instances of the optimizer's class (`muonclip.optim._wrappers`) whose own attributes are
    not the optimizer's, another framework's wrapper, and the optimizer itself. Such wrappers
    pass the optimizer's attributes on; use it for the optimizer object itself, or under a
    wrapper that does not.
    """
    for _ in range(8):
        inner = wrapped_optimizer(optimizer, Muon)
        if inner is None and not isinstance(optimizer, Muon):
            inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            return optimizer if isinstance(optimizer, Muon) else None
        optimizer = inner
    return None


def optimizer_group(optimizer: torch.optim.Optimizer) -> Any:
    """The process group an optimizer's figures are reduced over; None: no reduction.

    A `muonclip.Muon`: its own group (`muonclip.distributed._context.collective_group` of its
    parameters and ``process_group``). Another optimizer: the group of its DTensor parameters'
    mesh, else the default group when ``torch.distributed`` runs more than one rank.
    """
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return collective_group(params, optimizer.process_group if isinstance(optimizer, Muon) else None)


def group_sum(group: Any) -> Callable[[list[float]], list[float]] | None:
    """A ``reduce`` for `UpdateRMS.after`: sums the numbers over ``group`` (one float64
    all-reduce, on the GPU for an NCCL group); None when ``group`` is None (nothing to sum)."""
    if group is None:
        return None

    def reduce(values: list[float]) -> list[float]:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
        t = torch.tensor(values, dtype=torch.float64, device=device)
        dist.all_reduce(t, group=group)
        return t.tolist()

    return reduce


class UpdateRMS:
    """Measures ``update_rms`` (module docstring) of one optimizer step: `before`, step, `after`.

    For a `MuonClip` (an optimizer with a ``clip()`` method called by ``step()``), `before`
    wraps ``optimizer.clip`` for the duration of the step so the update is measured just before
    the clip; `after` (or `discard`) restores it. Each parameter's ``lr`` and ``weight_decay``
    are read from its param group at `before`. Sharded parameters (DTensors: FSDP2, tensor
    parallel, HSDP) are measured on this rank's piece; `after` takes a ``reduce`` that sums over
    the ranks of the optimizer's process group (`group`; `group_sum` makes it). Each element's
    square and count are weighted by 1 / the number of ranks of that group holding it
    (`muonclip.common._dtensor.replicas`: 1 for a shard, the tensor-parallel size for a weight
    that tensor parallelism leaves whole, the group's size for a plain replicated tensor), so
    that sum counts every element of every matrix once.

    Args:
        optimizer: the optimizer that takes the step: a `muonclip.Muon` (or `MuonClip`), or any
            ``torch.optim.Optimizer`` when ``params`` is given (e.g. torch.optim.AdamW, whose
            decoupled weight decay has the same form, so the figure compares across optimizers).
        params: the parameters to measure (default None: every parameter of the Muon's
            ``algorithm="muon"`` groups); each must be in one of the optimizer's groups.

    Attributes:
        group: the optimizer's process group at the last `before` (`optimizer_group`; None:
            one process, or ``process_group="local"``).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: Sequence[Tensor] | None = None) -> None:
        if params is None and not isinstance(optimizer, Muon):
            raise TypeError(
                f"UpdateRMS measures a muonclip.Muon optimizer's hidden matrices, got {type(optimizer).__name__}; "
                "pass params=[...] to measure chosen parameters of another optimizer"
            )
        self.optimizer = optimizer
        self._params = None if params is None else list(params)
        if self._params is not None:
            known = {id(p) for g in optimizer.param_groups for p in g["params"]}
            missing = [i for i, p in enumerate(self._params) if id(p) not in known]
            if missing:
                raise ValueError(f"UpdateRMS: params {missing} are not in the optimizer's param groups")
        self._before: list[tuple[Tensor, Tensor, float, float]] = []
        self._measured: tuple[float, int] | None = None
        self._patched = False
        self._own_clip: Any = None
        self.group: Any = None

    def _targets(self) -> list[tuple[Tensor, float, float]]:
        """(parameter, lr, weight_decay) of every parameter to measure."""
        chosen = None if self._params is None else {id(p) for p in self._params}
        out = []
        for group in self.optimizer.param_groups:
            if chosen is None and group["algorithm"] != "muon":
                continue
            lr, wd = float(group["lr"]), float(group.get("weight_decay", 0.0))
            out += [(p, lr, wd) for p in group["params"] if chosen is None or id(p) in chosen]
        return out

    @torch.no_grad()
    def before(self) -> None:
        """Copy the matrices that will be updated (those with a gradient and lr > 0): call it
        after the backward pass, just before ``optimizer.step()``."""
        self._restore()
        self._before, self._measured = [], None
        self.group = optimizer_group(self.optimizer)
        for p, lr, wd in self._targets():
            if lr != 0.0 and p.grad is not None:
                self._before.append((p, local(p.detach()).clone(), lr, wd))
        clip = getattr(self.optimizer, "clip", None)
        if self._before and callable(clip):
            self._own_clip = self.optimizer.__dict__.get("clip")  # an instance attribute already there, if any

            def measured_clip(*args: Any, **kwargs: Any) -> Any:
                self._measured = self._measure()
                return clip(*args, **kwargs)

            self.optimizer.clip = measured_clip
            self._patched = True

    @torch.no_grad()
    def _measure(self) -> tuple[float, float]:
        """(sum of U^2, element count) over this rank's piece of the copied parameters, each
        element weighted by 1 / the number of ranks of `group` holding it
        (`muonclip.common._dtensor.replicas`)."""
        sums, count = [], 0.0
        world = dist.get_world_size(self.group) if self.group is not None else 1
        for p, w0, lr, wd in self._before:
            u = (w0.mul(1.0 - lr * wd) - local(p.detach())).double() / lr  # same rounding as p.mul_(1 - lr*wd)
            copies = replicas(p, world)
            sums.append(u.pow(2).sum().div(copies).to(sums[0].device if sums else u.device))
            count += u.numel() / copies
        return (float(torch.stack(sums).sum()) if sums else 0.0), count  # one host read for all parameters

    def after(self, reduce: Callable[[list[float]], list[float]] | None = None) -> float | None:
        """RMS of the update since `before` (None if nothing was measured); forgets the copies.

        Args:
            reduce: sums ``[sum of squares, count]`` over the ranks of `group`
                (``group_sum(rms.group)``; default None: this process's figures). Called on
                every rank whenever `before` was, so a collective inside it is safe.
        """
        self._restore()
        sq, n = self._measured if self._measured is not None else self._measure()
        self._before, self._measured = [], None
        if reduce is not None:
            sq, n = reduce([sq, float(n)])
        return math.sqrt(sq / n) if n > 0 else None

    def discard(self) -> None:
        """Forget the copies (a skipped step)."""
        self._restore()
        self._before, self._measured = [], None

    def _restore(self) -> None:
        if not self._patched:
            return
        if self._own_clip is None:
            del self.optimizer.clip
        else:
            self.optimizer.clip = self._own_clip
        self._patched, self._own_clip = False, None


def step_metrics(
    optimizer: Muon, update_rms: float | None = None, *, per_layer: bool = False, prefix: str = "muonclip/"
) -> dict[str, float]:
    """The metrics of the optimizer's last step (module docstring), keys prefixed with ``prefix``.

    Args:
        optimizer: a `muonclip.Muon`; clip figures come from ``clip_stats()`` when it is a `MuonClip`.
        update_rms: the measured update RMS (default None: left out).
        per_layer: include ``max_logit/<layer>`` and ``clipped_heads/<layer>`` (default False).
        prefix: prepended to every key (default ``"muonclip/"``).
    """
    out: dict[str, float] = {}
    clip_stats = getattr(optimizer, "clip_stats", None)
    if callable(clip_stats):
        for k, v in clip_stats().items():
            if (per_layer or "/" not in k) and not math.isnan(v):  # NaN: nothing recorded, nothing to log
                out[prefix + k] = float(v)
    if update_rms is not None:
        out[prefix + "update_rms"] = float(update_rms)
    return out


class StepMetrics:
    """Follows one optimizer through its steps for a logging callback.

    Call `before_step` just before ``optimizer.step()`` and `after_step` just after; `after_step`
    returns the step's metrics (None for a skipped step or one not bracketed by `before_step`).
    `pop_interval` returns, once per new step, the last step's metrics plus
    ``<prefix>max_logit_peak``, the largest ``max_logit`` of all steps since the previous
    `pop_interval` (loggers that write every N steps would otherwise miss peaks in between),
    and ``<prefix>max_logit_peak_is_bound`` (1 when that peak is an LSE upper bound).

    Args:
        update_rms: measure ``update_rms`` (default True; one copy of the hidden matrices per step).
        per_layer: per-layer max logits and clipped-head counts (default False).
        prefix: key prefix (default ``"muonclip/"``).
    """

    def __init__(self, *, update_rms: bool = True, per_layer: bool = False, prefix: str = "muonclip/") -> None:
        self.update_rms = update_rms
        self.per_layer = per_layer
        self.prefix = prefix
        self.optimizer: Muon | None = None
        self.last: dict[str, float] = {}
        self._rms: UpdateRMS | None = None
        self._steps_before: int | None = None
        self._peak = -math.inf
        self._peak_bound = 0.0
        self._pending = False

    def bind(self, optimizer: Any) -> Muon:
        """Follow ``optimizer`` (a `muonclip.Muon`, or a framework wrapper around one); returns the Muon."""
        opt = unwrap_optimizer(optimizer)
        if opt is None:
            raise TypeError(
                f"the muonclip logging callbacks need a muonclip.Muon or muonclip.MuonClip optimizer, got "
                f"{type(optimizer).__name__}; pass optimizers=(MuonClip(model, ...), None) to the HF Trainer, or "
                "return MuonClip from configure_optimizers in Lightning"
            )
        if opt is not self.optimizer:
            self.optimizer = opt
            self._rms = UpdateRMS(opt) if self.update_rms else None
        return opt

    def before_step(self, optimizer: Any) -> None:
        """Note the step counter (and copy the hidden matrices for ``update_rms``)."""
        opt = self.bind(optimizer)
        self._steps_before = opt.steps_taken
        if self._rms is not None:
            self._rms.before()

    def after_step(self) -> dict[str, float] | None:
        """The metrics of the step just taken, or None (skipped step / no `before_step`)."""
        opt, before = self.optimizer, self._steps_before
        self._steps_before = None
        if opt is None or before is None or opt.steps_taken == before:
            if self._rms is not None:
                self._rms.discard()
            return None
        rms = self._rms.after(reduce=group_sum(self._rms.group)) if self._rms is not None else None
        self.last = step_metrics(opt, rms, per_layer=self.per_layer, prefix=self.prefix)
        m = self.last.get(self.prefix + "max_logit")
        if m is not None and m > self._peak:
            self._peak = m
            self._peak_bound = self.last.get(self.prefix + "max_logit_is_bound", 0.0)
        self._pending = True
        return self.last

    def pop_interval(self) -> dict[str, float]:
        """Last step's metrics and the peak max logit since the previous call; {} if no new step."""
        if not self._pending:
            return {}
        out = dict(self.last)
        if self._peak > -math.inf:
            out[self.prefix + "max_logit_peak"] = self._peak
            out[self.prefix + "max_logit_peak_is_bound"] = self._peak_bound
        self._pending, self._peak, self._peak_bound = False, -math.inf, 0.0
        return out


__all__ = ["StepMetrics", "UpdateRMS", "group_sum", "optimizer_group", "step_metrics", "unwrap_optimizer"]
