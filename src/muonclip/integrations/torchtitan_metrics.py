"""The clip in a torchtitan run's own logs: its console, TensorBoard and W&B, through its metrics processor.

`muonclip.integrations.torchtitan.with_muonclip` makes the run's ``metrics`` a
`MuonClipMetricsProcessor.Config`: torchtitan's ``MetricsProcessor`` (same fields, same console
line, same TensorBoard and W&B loggers), which on every step torchtitan logs (``step 1`` and
every ``--metrics.log_freq`` steps) adds, from the `muonclip.MuonClip` optimizers of the run's
`MuonClipOptimizers`:

* ``muonclip/max_logit``: the largest per-head max logit of the logged step, over every layer,
  head, micro-batch and rank (what the clip compared with tau), and ``muonclip/tau``. Exact:
  the processor asks the optimizers for exact maxima before that step's forwards
  (`MuonClipOptimizers.record_exact`; the clip's decisions are the same as with the LSE gate,
  which the other steps use). Should a value still be an LSE upper bound (a step that was not
  announced), it is logged as ``muonclip/max_logit_upper_bound`` instead, never as a maximum.
* ``muonclip/clipped_heads`` and ``muonclip/clipped_layers``: heads QK-Clip scaled in that step,
  and layers with at least one.
* over the steps since the previous log (that step included): ``muonclip/head_clips`` (clipped
  heads summed over the steps), ``muonclip/clipped_steps`` (steps that clipped) and, when a
  head clipped, ``muonclip/clipped_max_logit_peak``: the largest max logit a clipped head had
  before its clip (exact: a head above tau is always computed exactly).
* ``muonclip/layers_ever_clipped`` and, once per layer, ``muonclip/first_clip_step/<layer>``:
  the first step of this process at which the layer clipped (followed on every step, not only
  logged ones; no host sync between logs).
* with ``--metrics.clip_per_layer``: ``muonclip/max_logit/<layer>`` and
  ``muonclip/clipped_heads/<layer>`` of the logged step.

The console gets one more line after torchtitan's, e.g.::

    muonclip step: 60  max logit: 36.15 (tau 30)  clipped: 3 heads in 3 layers  since step 51: 28 head
    clips in 10 steps, peak 52.12  first clip: layers.4.attention at step 51, layers.2.attention at step 54

The numbers are the same on every rank (the maxima are all-reduced before the clip); torchtitan
writes TensorBoard and W&B from one rank (rank 0 without pipeline parallelism, the last stage's
first rank with it). Under pipeline parallelism each rank's optimizer clips its own stages'
layers, and on a logged step the processor gathers every stage's figures over torchtitan's
``"pp"`` group (`ClipLog.report`'s ``gather``, one object all-gather: the only collective the clip
makes across stages), so every rank logs the layers of the whole model. The start-up
line naming the optimizer, tau, the clipped and the refused layers is `startup_line`'s, logged
when the optimizer container is built.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger

from ..qkclip._muonclip import MuonClip
from .torchtitan_layouts import attention_modules, refusal

PREFIX = "muonclip/"


def layer_names(names: list[str]) -> str:
    """A short form of a list of layer names: ``layers.{0..5}.attention`` for names that differ only
    in one run of consecutive numbers, else the names joined with commas (``none`` when empty)."""
    if not names:
        return "none"
    parts = [re.fullmatch(r"(.*?)(\d+)(.*)", n) for n in names]
    if len(names) > 1 and all(parts):
        heads = {(m.group(1), m.group(3)) for m in parts}
        nums = [int(m.group(2)) for m in parts]
        if len(heads) == 1 and nums == list(range(nums[0], nums[0] + len(nums))):
            pre, post = heads.pop()
            return f"{pre}{{{nums[0]}..{nums[-1]}}}{post}"
    return ", ".join(names)


def startup_line(config: Any, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer],
                 stage: str | None = None) -> str:
    """One line for the log at start-up: the optimizer and its rates, and for QK-Clip its tau and
    which attention layers it clips and which it refuses (with why); under pipeline parallelism
    the layers of this rank's stages, and which stages on which ranks (``stage``).

    Args:
        config: the `MuonClipOptimizers.Config` the container was built from.
        model_parts: the container's model parts.
        optimizers: the container's optimizers.
        stage: this rank's pipeline stages (`muonclip.integrations.torchtitan_pipeline.Stage.describe`;
            default None: no pipeline).
    """
    line = _startup_line(config, model_parts, optimizers)
    return line if stage is None else f"{line}; {stage}"


def _startup_line(config: Any, model_parts: list[nn.Module], optimizers: list[torch.optim.Optimizer]) -> str:
    found = [(n, m) for part in model_parts for n, m in attention_modules(part)]
    if config.name == "AdamW":
        n = sum(len(g["params"]) for o in optimizers for g in o.param_groups)
        return (f"AdamW (baseline, torchtitan's default_adamw): lr {config.lr:g}, betas (0.9, 0.95), eps 1e-08, "
                f"weight decay {config.weight_decay:g} on {n} tensors; no QK-Clip ({len(found)} attention layers)")
    muon = sum(len(g["params"]) for o in optimizers for g in o.param_groups if g.get("algorithm") == "muon")
    adamw = sum(len(g["params"]) for o in optimizers for g in o.param_groups if g.get("algorithm") != "muon")
    adamw_lr = config.lr if config.adamw_lr is None else config.adamw_lr
    head = (f"{config.name}: Muon on {muon} matrices, AdamW on {adamw} tensors; lr {config.lr:g} (AdamW groups "
            f"{adamw_lr:g}), weight decay {config.weight_decay:g}, {config.adjust_lr_fn}, {config.method} "
            f"{config.orth_dtype}")
    refused = {n: why for n, m in found if (why := refusal(m)) is not None}
    if config.name == "Muon":
        why = "" if not refused else f"; {len(refused)} of them would be refused: {next(iter(refused.values()))}"
        return f"{head}; QK-Clip off (--optimizer.name Muon): {len(found)} attention layers not clipped{why}"
    clipped = [layer.name for o in optimizers if isinstance(o, MuonClip) for layer in o.layers]
    names = {n for n, _ in found}
    others = sorted(names - set(clipped))
    return (f"{head}; QK-Clip tau {config.tau:g} (GQA policy {config.gqa_policy}) on {len(clipped)} of {len(found)} "
            f"attention layers: {layer_names(clipped)}; refused: {layer_names(others)}; the logged steps record "
            "exact max logits")


@dataclass
class ClipReport:
    """One logged step's clip figures: ``metrics`` (keys under ``muonclip/``) and the console ``line``."""

    metrics: dict[str, float]
    line: str


class ClipLog:
    """Follows the clips of `muonclip.MuonClip` optimizers step by step, on the device (no host
    sync), and reports them on the logged steps (module docstring).

    Call `observe` after each optimizer step (any time before the next one), `report` after the
    step of a logged step (it observes that step first; one host read). Under pipeline
    parallelism each rank follows its own stages' layers and `report` gathers every stage's
    figures (``gather``), so every rank reports the whole model.

    Args:
        per_layer: also report each layer's max logit and clipped heads (default False).
    """

    def __init__(self, *, per_layer: bool = False) -> None:
        self.per_layer = per_layer
        self._observed: int | None = None
        self._since: int | None = None
        self._state: dict[int, dict[str, Any]] = {}
        self._first_reported: set[str] = set()

    def _stacked(self, opt: MuonClip) -> tuple[list[str], Tensor, Tensor, Tensor] | None:
        """``(names, values (L, H), bounded (L, H), clipped (L, H))`` of the last clip over every
        layer of ``opt`` (a layer that recorded nothing: ``-inf``, False), padded likewise where
        layers have fewer heads; None when no layer recorded anything."""
        if not opt.last_max_logits:
            return None
        dev = next(iter(opt.last_max_logits.values())).device
        names, vs, bs, cs = [], [], [], []
        for layer in opt.layers:
            n, h = layer.name, layer.recorder.n_heads
            no = torch.zeros(h, dtype=torch.bool, device=dev)
            names.append(n)
            vs.append(opt.last_max_logits[n].float() if n in opt.last_max_logits
                      else torch.full((h,), -math.inf, device=dev))
            bs.append(opt.last_bounded[n].to(dev) if n in opt.last_bounded else no)
            cs.append(opt.last_clipped[n].to(dev) if n in opt.last_clipped else no)
        return (names, pad_sequence(vs, batch_first=True, padding_value=-math.inf),
                pad_sequence(bs, batch_first=True, padding_value=False),
                pad_sequence(cs, batch_first=True, padding_value=False))

    def observe(self, optimizers: list[MuonClip], step: int) -> None:
        """Fold the last clip of every optimizer in, as step ``step`` (once per step; repeated calls
        for a step already observed do nothing)."""
        if step < 1 or (self._observed is not None and step <= self._observed):
            return
        self._observed = step
        if self._since is None:
            self._since = step
        for i, opt in enumerate(optimizers):
            got = self._stacked(opt)
            if got is None:
                continue
            names, v, _, c = got
            per_layer = c.sum(dim=1)
            st = self._state.get(i)
            if st is None:
                dev = v.device
                st = self._state[i] = {"names": names, "clips": torch.zeros(len(names), dtype=torch.int64, device=dev),
                                       "clipped": {}, "peak": torch.full((), -math.inf, device=dev),
                                       "first": torch.full((len(names),), -1, dtype=torch.int64, device=dev)}
            st["clips"] += per_layer
            st["clipped"][step] = per_layer.sum() > 0
            st["peak"] = torch.maximum(st["peak"], v.masked_fill(~c, -math.inf).amax())
            st["first"] = torch.where((st["first"] < 0) & (per_layer > 0), step, st["first"])

    def figures(self, optimizers: list[MuonClip]) -> dict[str, Any]:
        """This process's figures since the last call, from its optimizers' last clips and what
        `observe` followed (one host read); what `report` gathers across pipeline stages:
        ``{"layers": {name: (max logit, exact max logit, clipped heads, first clip step or -1,
        head clips since the last report)}, "clipped": {step: whether a head clipped}, "peak":
        float}``. The counts since the last report start again."""
        rows, meta = [], []
        for i, opt in enumerate(optimizers):
            got, st = self._stacked(opt), self._state.get(i)
            if got is None or st is None:
                continue
            names, v, b, c = got
            steps = sorted(st["clipped"])
            flags = [st["clipped"][s] for s in steps]
            rows.append(torch.cat([st["peak"].float().view(1), st["first"].float(), v.amax(dim=1),
                                   v.masked_fill(b, -math.inf).amax(dim=1), c.sum(dim=1).float(), st["clips"].float(),
                                   torch.stack(flags).float() if flags else v.new_zeros(0)]).cpu())
            meta.append((names, steps))
            st["clips"].zero_()
            st["clipped"] = {}
            st["peak"].fill_(-math.inf)
        out: dict[str, Any] = {"layers": {}, "clipped": {}, "peak": -math.inf}
        for row, (names, steps) in zip(rows, meta):  # one host read above: every row went to the CPU at once
            vals, n = row.tolist(), len(names)
            out["peak"] = max(out["peak"], vals[0])
            cols = [vals[1 + k * n: 1 + (k + 1) * n] for k in range(5)]
            for j, name in enumerate(names):
                first, top, exact, now, since = (col[j] for col in cols)
                out["layers"][name] = (top, exact, int(now), int(first), int(since))
            for s, flag in zip(steps, vals[1 + 5 * n:]):
                out["clipped"][s] = out["clipped"].get(s, False) or flag > 0
        return out

    def report(self, optimizers: list[MuonClip], step: int, tau: float,
               gather: Callable[[dict[str, Any]], list[dict[str, Any]]] | None = None) -> ClipReport | None:
        """The figures of step ``step`` (just taken) and of the steps since the last report; None
        when no optimizer recorded anything in this step. ``gather`` (under pipeline parallelism:
        every rank of the pipeline calls it) takes this process's `figures` and returns every
        stage's: the report covers their layers."""
        self.observe(optimizers, step)
        since, self._since = self._since, None
        mine = self.figures(optimizers)
        found = [mine] if gather is None else gather(mine)
        layers: dict[str, tuple[float, float, int, int, int]] = {}
        clipped: dict[int, bool] = {}
        peak = -math.inf
        for f in found:
            layers.update(f["layers"])
            for s, flag in f["clipped"].items():
                clipped[s] = clipped.get(s, False) or flag
            peak = max(peak, f["peak"])
        if not layers:
            return None
        top = max(e for _, e, _, _, _ in layers.values())
        bound_top = max(m for m, _, _, _, _ in layers.values())
        heads = sum(h for _, _, h, _, _ in layers.values())
        n_layers = sum(h > 0 for _, _, h, _, _ in layers.values())
        clips = sum(c for _, _, _, _, c in layers.values())
        steps = sum(clipped.values())
        firsts = {n: f for n, (_, _, _, f, _) in layers.items() if f >= 0}
        out: dict[str, float] = {PREFIX + "tau": float(tau), PREFIX + "clipped_heads": float(heads),
                                 PREFIX + "clipped_layers": float(n_layers), PREFIX + "head_clips": float(clips),
                                 PREFIX + "clipped_steps": float(steps),
                                 PREFIX + "layers_ever_clipped": float(len(firsts))}
        if bound_top > top:  # the largest value is an LSE bound (an unannounced step): labelled as such
            out[PREFIX + "max_logit_upper_bound"] = bound_top
            shown = f"<= {bound_top:.2f} (an LSE upper bound, not exact)"
        else:
            out[PREFIX + "max_logit"] = top
            shown = f"{top:.2f}"
        if peak > -math.inf:
            out[PREFIX + "clipped_max_logit_peak"] = peak
        new = {n: s for n, s in firsts.items() if n not in self._first_reported}
        for n, s in new.items():
            out[f"{PREFIX}first_clip_step/{n}"] = float(s)
        self._first_reported |= set(new)
        if self.per_layer:
            for n, (mx, _, ch, _, _) in layers.items():
                out[f"{PREFIX}max_logit/{n}"] = mx
                out[f"{PREFIX}clipped_heads/{n}"] = float(ch)
        line = (f"muonclip step: {step:2}  max logit: {shown} (tau {tau:g})  clipped: {heads} heads in {n_layers} "
                "layers")
        if since is not None and since < step:
            line += f"  since step {since}: " + (f"{clips} head clips in {steps} steps, peak {peak:.2f}" if clips else
                                                  "no clip")
        if new:
            line += "  first clip: " + ", ".join(f"{n} at step {s}" for n, s in sorted(new.items(), key=lambda x: x[1]))
        return ClipReport(out, line)


class MuonClipMetricsProcessor(MetricsProcessor):
    """torchtitan's ``MetricsProcessor`` with MuonClip's clip figures in its logs (module docstring).

    Its ``should_log`` (called by torchtitan's trainer at the start of every step) also observes
    the previous step's clip and, on a logged step, asks the optimizers for exact max logits for
    that step (`MuonClipOptimizers.record_exact`); its ``log`` adds the clip figures to
    torchtitan's metrics (console, TensorBoard, W&B) and one console line. With an optimizer
    container without MuonClip (``--optimizer.name Muon`` / ``AdamW``, or torchtitan's own) it is
    torchtitan's processor.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        clip_per_layer: bool = False
        """Also log each attention layer's max logit and clipped heads (muonclip/max_logit/<layer>, ...)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        self.clip_log = ClipLog(per_layer=config.clip_per_layer)

    def _clipping(self) -> list[MuonClip]:
        clipping = getattr(self.optimizers, "clipping", None)
        return clipping() if callable(clipping) else []

    def should_log(self, step: int) -> bool:
        logged = MetricsProcessor.should_log(self, step)
        optimizers = self._clipping()
        if optimizers:
            self.clip_log.observe(optimizers, step - 1)
            self.optimizers.record_exact(logged)
        return logged

    def _pipeline_gather(self) -> Callable[[dict[str, Any]], list[dict[str, Any]]] | None:
        """Under pipeline parallelism, every pipeline rank's `ClipLog.figures` (one object
        all-gather over torchtitan's ``"pp"`` group, on logged steps only); else None."""
        dims = getattr(self, "parallel_dims", None)
        if dims is None or not dims.pp_enabled:
            return None
        import torch.distributed as dist

        group = dims.get_mesh("pp").get_group()

        def gather(mine: dict[str, Any]) -> list[dict[str, Any]]:
            found: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(found, mine, group=group)
            return found

        return gather

    def log(self, step: int, global_avg_loss: float, global_max_loss: float, grad_norm: float,
            extra_metrics: dict[str, Any] | None = None) -> None:
        optimizers = self._clipping()
        report = None
        if getattr(self.optimizers, "name", None) == "MuonClip":  # on every pipeline rank, clipping or not
            tau = optimizers[0].tau if optimizers else self.optimizers.tau
            report = self.clip_log.report(optimizers, step, tau, gather=self._pipeline_gather())
        if report is not None:
            extra_metrics = {**(extra_metrics or {}), **report.metrics}
        MetricsProcessor.log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=extra_metrics)
        if report is not None:
            logger.info(report.line)


def metrics_config(config: MetricsProcessor.Config) -> MuonClipMetricsProcessor.Config:
    """``config`` (torchtitan's metrics config) as a `MuonClipMetricsProcessor.Config` with the same fields."""
    if isinstance(config, MuonClipMetricsProcessor.Config):
        return config
    from dataclasses import fields

    return MuonClipMetricsProcessor.Config(**{f.name: getattr(config, f.name) for f in fields(config) if f.init})


__all__ = ["ClipLog", "ClipReport", "MuonClipMetricsProcessor", "PREFIX", "layer_names", "metrics_config",
           "startup_line"]
