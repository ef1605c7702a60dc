"""Muon and MuonClip as torchtitan optimizers: a container on its meshes, configured from its command line.

``pip install 'muonclip[torchtitan]'`` (torchtitan 0.3.0). torchtitan trains its models through
``torchtitan.train`` with a ``Trainer.Config`` picked by ``--module``/``--config``; this module
is such a ``--module``. Every config function of torchtitan's own models is reachable under its
name, with MuonClip as the optimizer and a recording attention::

    torchrun --nproc-per-node 2 -m torchtitan.train \\
        --module muonclip.integrations.torchtitan --config llama3_debugmodel \\
        --optimizer.name MuonClip --optimizer.lr 0.02 --optimizer.tau 100 --optimizer.per_head

``--config llama3_quickstart`` (`llama3_quickstart`) is llama3's debug model sized for a few
minutes on CPU, on the assets ``muonclip torchtitan-assets`` makes from the built-in plays.

What ``--config NAME`` gives (`with_muonclip` applied to torchtitan's ``NAME()``):

* ``optimizer``: a `MuonClipOptimizers.Config`, whose fields (``--optimizer.<field>``) are
  ours: ``name`` (``MuonClip``, ``Muon``, or ``AdamW``: the baseline, torch's AdamW with
  torchtitan's ``default_adamw`` settings), ``lr``, ``weight_decay``, ``adamw_lr``,
  ``adamw_weight_decay``, ``momentum``, ``nesterov``, ``adjust_lr_fn``, ``method``,
  ``orth_dtype``, ``per_head``, ``tau``, ``gqa_policy``, ``on_ineffective_clip``. torchtitan's
  own ``param_groups``/``implementation``/``optimizer_factory_kwargs_by_name`` are not used
  (`muonclip.param_groups` routes every parameter: embeddings, ``lm_head`` and vectors to
  AdamW, the rest to Muon; the fused ``wqkv`` seen as its q, k, v maps: `muon_splits`): they
  are hidden from the command line and refused when set.
* ``metrics``: torchtitan's metrics processor with the clip in its logs
  (`muonclip.integrations.torchtitan_metrics`: console, TensorBoard, W&B).
* every attention's inner attention replaced by a recording one
  (`muonclip.integrations.torchtitan_attention`): `RecordingFlexAttention` on CUDA
  (`RecordingVarlen` for torchtitan's varlen backend), `RecordingSDPA` elsewhere.
* pipeline parallelism (``--parallelism.pipeline_parallel_degree``): torchtitan's ``pipelining_fn``
  wrapped by `muonclip.integrations.torchtitan_pipeline.pipelining` (each stage's group on its
  model parts, a schedule step this torch runs, the refusals).
* on a machine without CUDA, the CPU/gloo set-up of `muonclip.integrations.torchtitan_cpu`.

The container (`MuonClipOptimizers`) builds one `muonclip.MuonClip` (or `muonclip.Muon`) on
the parallelised model: DTensor parameters on torchtitan's meshes (FSDP2, HSDP, tensor parallel,
both: meshes unflattened from its 1-D world mesh, which Muon maps by rank layout), QK-Clip
layers from `muonclip.integrations.torchtitan_layouts` (fused ``wqkv`` per key/value group, MLA
by K2's rule, tensor-parallel head ranges), param names in torchtitan's canonical checkpoint
form so its flat, FQN-keyed optimizer state dict (DCP, resharding) keys our state like its own.
torchtitan materialises optimizer state before saving or loading a checkpoint with a
zero-gradient, zero-lr step; the container runs that step with MuonClip's "nothing recorded"
warning silenced (it is not a training step). It logs a start-up line (optimizer, rates, tau,
the clipped and the refused attention layers: `muonclip.integrations.torchtitan_metrics.startup_line`).

**Pipeline parallelism.** torchtitan's pipeline gives each rank one model part (a stage) or
several; their parameters' meshes span every stage. The container builds one optimizer over all
of the rank's parts, with ``process_group=`` the group of the ranks of its stages (the
`muonclip.integrations.torchtitan_pipeline.Stage` the parts carry): Muon's owners, its checks and
QK-Clip's max-logit reduction stay within the stage, never across stages (docs/design.md,
"Pipeline parallelism"). A rank whose stages hold no attention layer steps a `muonclip.Muon`.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import warnings
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import torch
import tyro
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.components.optimizer.utils import init_optim_state
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from ..common import defaults as D
from ..optim import Muon, param_groups
from ..qkclip._muonclip import MuonClip
from .torchtitan_attention import recording_attention_config
from .torchtitan_layouts import attention_layers, canonical_name, muon_splits
from .torchtitan_metrics import MuonClipMetricsProcessor, metrics_config, startup_line
from .torchtitan_pipeline import pipelining, stage_of

_DTYPES = {"auto": D.AUTO, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ADAMW_DEFAULTS = {"betas": D.BETAS, "eps": D.ADAMW_EPS}
"""torchtitan's ``default_adamw`` settings besides lr and weight decay (``--optimizer.name AdamW``)."""


RATE_WARNING = (
    "optimizer.lr {lr:g} is the AdamW rate of torchtitan's config, carried over to {name}'s Muon and AdamW groups "
    "(with adjust_lr_fn match_rms_adamw, the Moonlight recipe). Measured on llama3's debug model over 300 steps "
    "(validation loss): at torchtitan's 8e-4 MuonClip ended 0.10 nats behind AdamW at the same rate; at AdamW's best "
    "rate, 3e-3, level with it; at its own best, 1e-2, 0.12 ahead of AdamW's best (docs/integrations.md, "
    "torchtitan, Rates). Choose the rate with --optimizer.lr (and --optimizer.adamw_lr "
    "for the embeddings, the output head and the vectors)"
)
"""Logged when the Muon rate is the one carried over from torchtitan's AdamW config (`with_muonclip`)."""


def _check_config(config: Any) -> None:
    """Refuse values a `MuonClipOptimizers.Config` cannot use, with what to do."""
    if config.name not in ("MuonClip", "Muon", "AdamW"):
        raise ValueError(f"optimizer.name must be 'MuonClip', 'Muon' or 'AdamW', got {config.name!r}")
    if config.orth_dtype not in _DTYPES:
        raise ValueError(f"optimizer.orth_dtype must be one of {sorted(_DTYPES)}, got {config.orth_dtype!r}")
    given = (("param_groups", config.param_groups), ("implementation", config.implementation != "fused"),
             ("optimizer_factory_kwargs_by_name", config.optimizer_factory_kwargs_by_name))
    unused = [f for f, v in given if v]
    if unused:
        raise ValueError(
            f"MuonClipOptimizers does not use torchtitan's optimizer.{', optimizer.'.join(unused)}: "
            "muonclip.param_groups routes every parameter (matrices to Muon, embeddings, the output head and vectors "
            "to AdamW). Set the rates with optimizer.lr / optimizer.adamw_lr and leave those fields at their defaults"
        )


class MuonClipOptimizers(OptimizersContainer):
    """torchtitan's optimizer container holding a `muonclip.MuonClip`, a `muonclip.Muon` or the AdamW baseline.

    Built by torchtitan's trainer as ``config.optimizer.build(model_parts=...)`` after the model
    is parallelised, on its model parts (one; several under pipeline parallelism): one optimizer
    over all of them, `muonclip.param_groups` of each part (with `muon_splits`), its
    ``param_names`` in torchtitan's canonical form, then ``MuonClip(part, layers=attention_layers(...),
    groups=...)`` (a ``ModuleList`` of the parts when there are several) or ``Muon(groups)``, with ``process_group`` the
    parts' pipeline stage group (`muonclip.integrations.torchtitan_pipeline.stage_of`; the
    automatic group without a pipeline); with ``name`` ``"AdamW"``, ``torch.optim.AdamW`` on every
    parameter with torchtitan's ``default_adamw`` settings (`ADAMW_DEFAULTS`, ``lr``,
    ``weight_decay``). ``step``, ``zero_grad``, the flat state dict and
    the LR schedulers are torchtitan's, over these optimizers. The start-up line
    (`muonclip.integrations.torchtitan_metrics.startup_line`) goes to torchtitan's log and is
    kept in ``startup_line``.

    Args:
        config: a `MuonClipOptimizers.Config`.
        model_parts: the (parallelised) model: one part, or a pipeline rank's parts (tagged with
            their stage by `muonclip.integrations.torchtitan_pipeline.pipelining`).

    Attributes:
        stage: the parts' `muonclip.integrations.torchtitan_pipeline.Stage` (None: no pipeline).
        name, tau: the config's.

    Raises:
        ValueError: several model parts without their stage, torchtitan's unused optimizer fields
            set, a bad ``name`` or ``orth_dtype``, or a layer QK-Clip refuses
            (`muonclip.integrations.torchtitan_layouts.attention_layers`).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        # torchtitan's own fields, unused here (muonclip.param_groups routes every parameter): hidden from
        # the command line, refused when set (`MuonClipOptimizers`)
        param_groups: Annotated[list[ParamGroupConfig], tyro.conf.Suppress] = field(default_factory=list)
        implementation: Annotated[str, tyro.conf.Suppress] = "fused"
        optimizer_factory_kwargs_by_name: Annotated[dict[str, dict[str, Any]], tyro.conf.Suppress] = field(
            default_factory=dict)
        # the AdamW rate of the torchtitan config `with_muonclip` was given (None: none carried over); while
        # ``lr`` equals it, the container logs `RATE_WARNING`
        carried_lr: Annotated[float | None, tyro.conf.Suppress] = None
        name: Literal["MuonClip", "Muon", "AdamW"] = "MuonClip"
        """``MuonClip`` (Muon + AdamW + QK-Clip), ``Muon`` (Muon + AdamW, no clip) or ``AdamW`` (the
        baseline: torch's AdamW on every parameter with torchtitan's ``default_adamw`` settings)."""
        lr: float = 0.02
        """Learning rate of the Muon and AdamW groups (torchtitan's LR schedule scales it)."""
        weight_decay: float = D.WEIGHT_DECAY
        """Decoupled weight decay (Muon and the embedding/head AdamW group; vectors get none)."""
        adamw_lr: float | None = None
        """Learning rate of the AdamW groups (None: ``lr``, right with ``adjust_lr_fn`` match_rms_adamw)."""
        adamw_weight_decay: float | None = None
        """Weight decay of the embedding/head AdamW group (None: ``weight_decay``)."""
        momentum: float = D.MOMENTUM
        """Muon's momentum."""
        nesterov: bool = D.NESTEROV
        """Nesterov momentum for Muon."""
        adjust_lr_fn: Literal["match_rms_adamw", "original", "unscaled"] = D.ADJUST_LR_FN
        """Muon's update scale: Moonlight/K2's ``0.2 * sqrt(max(rows, cols))`` (AdamW's RMS),
        Keller Jordan's ``sqrt(max(1, rows/cols))``, or none."""
        method: str = D.METHOD
        """Orthogonalisation method (``muonclip.ortho``: ns5, polar_express, ...)."""
        orth_dtype: Literal["auto", "float32", "bfloat16", "float16"] = D.ORTH_DTYPE
        """dtype of the orthogonalisation: ``auto`` (bfloat16 where the device multiplies it
        natively, else float32; `muonclip.Muon`'s default), or one dtype on every device."""
        per_head: bool = False
        """Orthogonalise each attention head's rows of q, k, v and of MLA's up-projections alone."""
        tau: float = D.TAU
        """QK-Clip threshold on the max logit (MuonClip only; K2 uses 100, small models 30-50)."""
        gqa_policy: Literal["per_head", "balanced", "group"] = "per_head"
        """How grouped-query attention is clipped (`muonclip.qkclip.GQALayout`)."""
        on_ineffective_clip: Literal["warn", "raise", "ignore"] = "warn"
        """What MuonClip does when a clip does not act on the logits (`muonclip.MuonClip`)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        _check_config(config)
        self.stage = stage_of(model_parts)
        self.model_parts = model_parts
        self.name, self.tau = config.name, config.tau
        kwargs = dict(weight_decay=config.weight_decay, momentum=config.momentum, nesterov=config.nesterov,
                      adjust_lr_fn=config.adjust_lr_fn, method=config.method, orth_dtype=_DTYPES[config.orth_dtype])
        if self.stage is not None:
            kwargs["process_group"] = self.stage.group
        if config.name == "AdamW":
            named = [(n, p) for part in model_parts for n, p in part.named_parameters() if p.requires_grad]
            groups = [{"params": [p for _, p in named], "param_names": [canonical_name(n) for n, _ in named]}]
            opt: torch.optim.Optimizer = torch.optim.AdamW(groups, lr=config.lr, **ADAMW_DEFAULTS,
                                                           weight_decay=config.weight_decay)
        else:
            groups = _param_groups(model_parts, config)
            layers = [layer for part in model_parts for layer in attention_layers(part, gqa_policy=config.gqa_policy)
                      ] if config.name == "MuonClip" else []
            if config.name == "MuonClip" and (layers or self.stage is None):
                model = model_parts[0] if len(model_parts) == 1 else nn.ModuleList(model_parts)
                opt = MuonClip(model, lr=config.lr, tau=config.tau, groups=groups, layers=layers,
                               on_ineffective_clip=config.on_ineffective_clip, **kwargs)
            else:  # Muon, or a pipeline rank whose stages hold no attention layer (nothing to clip)
                opt = Muon(groups, lr=config.lr, **kwargs)
        self.optimizers = [opt]
        all_params = [p for g in groups for p in g["params"]]
        self._validate_params(all_params)
        self._post_init(all_params)
        self.startup_line = startup_line(config, model_parts, self.optimizers,
                                         stage=None if self.stage is None else self.stage.describe())
        logger.info(self.startup_line)
        self.rate_warning = None
        if config.name != "AdamW" and config.carried_lr is not None and config.lr == config.carried_lr:
            self.rate_warning = RATE_WARNING.format(lr=config.lr, name=config.name)
            logger.warning(self.rate_warning)

    def clipping(self) -> list[MuonClip]:
        """The `muonclip.MuonClip` optimizers (one, over every model part; none with ``name`` Muon or AdamW, or
        on a pipeline rank whose stages hold no attention layer)."""
        return [o for o in self.optimizers if isinstance(o, MuonClip)]

    def record_exact(self, exact: bool) -> None:
        """``True``: the next training forwards record every head's exact max logit (each layer's
        recorder without a threshold, so no LSE bound is recorded); ``False``: the LSE gate again
        (each recorder's threshold back to its optimizer's tau). The clip's decisions are the same
        either way; torchtitan's metrics processor (`muonclip.integrations.torchtitan_metrics`)
        asks for exact maxima on the steps it logs."""
        for opt in self.clipping():
            for layer in opt.layers:
                layer.recorder.threshold = None if exact else opt.tau

    def state_dict(self) -> dict[str, Any]:
        """torchtitan's flat, FQN-keyed state dict of every optimizer (state materialised first)."""
        self._materialise()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torchtitan's flat state dict into every optimizer (state materialised first)."""
        self._materialise()
        super().load_state_dict(state_dict)

    def _materialise(self) -> None:
        """torchtitan's zero-gradient, zero-lr step that creates the optimizer state, without
        MuonClip's "nothing recorded" warning (it is not a training step)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="MuonClip.step: no attention max logit was recorded")
            for optim in self.optimizers:
                init_optim_state(optim)


def _param_groups(model_parts: list[nn.Module], config: MuonClipOptimizers.Config) -> list[dict[str, Any]]:
    """`muonclip.param_groups` of every model part (with `muon_splits`), names in torchtitan's
    canonical form, groups with the same options merged across parts (one optimizer per rank)."""
    merged: dict[tuple, dict[str, Any]] = {}
    for part in model_parts:
        for g in param_groups(part, adamw_lr=config.adamw_lr, adamw_weight_decay=config.adamw_weight_decay,
                              split=muon_splits(part, per_head=config.per_head), per_head=config.per_head):
            key = tuple(sorted((k, repr(v)) for k, v in g.items() if k not in ("params", "param_names")))
            names = [canonical_name(n) for n in g["param_names"]]
            if key in merged:
                merged[key]["params"].extend(g["params"])
                merged[key]["param_names"].extend(names)
            else:
                merged[key] = {**g, "params": list(g["params"]), "param_names": names}
    return list(merged.values())


def with_muonclip(config: Trainer.Config, *, device_type: str | None = None) -> Trainer.Config:
    """``config`` (a torchtitan ``Trainer.Config``) with MuonClip as its optimizer and a recording attention.

    Returns a new config whose ``optimizer`` is a `MuonClipOptimizers.Config` (its class
    declares the field as such, so ``--optimizer.<field>`` parses our fields) with
    torchtitan's ``lr`` and ``weight_decay`` carried over when the original optimizer had
    one param group (the container logs `RATE_WARNING` while ``lr`` is that carried-over AdamW
    rate); whose ``metrics`` is a `muonclip.integrations.torchtitan_metrics.MuonClipMetricsProcessor.Config`
    (the clip in the run's logs); whose model's ``pipelining_fn`` is torchtitan's wrapped by
    `muonclip.integrations.torchtitan_pipeline.pipelining`; every ``inner_attention`` of the model
    config is the recording one for ``device_type`` (default: ``"cuda"`` when available, else ``"cpu"``), and on CPU the
    set-up of `muonclip.integrations.torchtitan_cpu.cpu_config` is applied and the
    orthogonalisation runs in float32 (``--optimizer.orth_dtype`` still overrides it).
    """
    from . import torchtitan_cpu

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    opt = MuonClipOptimizers.Config()
    if len(config.optimizer.param_groups) == 1:
        given = config.optimizer.param_groups[0].optimizer_kwargs
        opt = dataclasses.replace(opt, **{k: given[k] for k in ("lr", "weight_decay") if k in given})
        opt.carried_lr = given.get("lr")
    config = copy.deepcopy(config)  # the given config is left as it was
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields["optimizer"] = opt
    fields["metrics"] = metrics_config(config.metrics)
    out = MuonClipTrainerConfig(**fields)
    if out.model_spec is not None:
        if out.model_spec.pipelining_fn is not None:
            out.model_spec.pipelining_fn = pipelining(out.model_spec.pipelining_fn)
        from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

        for kind in (FlexAttention.Config, VarlenAttention.Config, ScaledDotProductAttention.Config):
            for _, found, parent, attr in list(out.model_spec.model.traverse(kind)):
                if parent is not None and attr == "inner_attention":
                    varlen = found if isinstance(found, VarlenAttention.Config) else None
                    setattr(parent, attr, recording_attention_config(device_type, varlen))
    if device_type == "cpu":
        out.optimizer.orth_dtype = "float32"  # bfloat16 matmuls are emulated (slow) on most CPUs
        torchtitan_cpu.cpu_config(out)
    return out


@dataclass(kw_only=True, slots=True)
class MuonClipTrainerConfig(Trainer.Config):
    """torchtitan's ``Trainer.Config`` whose ``optimizer`` field is a `MuonClipOptimizers.Config`
    (so that ``--optimizer.tau`` and the other fields of ours parse on the command line)."""

    optimizer: MuonClipOptimizers.Config = dataclasses.field(default_factory=MuonClipOptimizers.Config)
    metrics: MuonClipMetricsProcessor.Config = dataclasses.field(default_factory=MuonClipMetricsProcessor.Config)


QUICKSTART_ASSETS = "./torchtitan_assets"
"""Where ``muonclip torchtitan-assets`` writes by default and where `llama3_quickstart` reads."""


def llama3_quickstart() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel`` with MuonClip, sized to train in minutes on 2 CPU cores.

    The assets are those ``muonclip torchtitan-assets`` makes from the built-in plays
    (`muonclip.app.torchtitan_assets`), read from `QUICKSTART_ASSETS` (``--hf_assets_path`` and
    ``--dataloader.dataset_path`` change it). Sizes: sequences of 256 tokens, 4 per rank, 200
    steps, 20 of linear warm-up then torchtitan's schedule (constant, then a linear decay over the
    last 80%); the metrics every 10 steps with TensorBoard on (``<dump_folder>/tb``); validation
    and checkpoints off. Optimizer: MuonClip at ``lr`` 0.02 and ``tau`` 30 (near the best rate
    measured, 0.01, and the debug model's max logits pass 30 after about 45 steps at 0.02, so the
    log shows the clip act);
    ``--optimizer.name AdamW --optimizer.lr 3e-3`` is the AdamW baseline on the same model and data
    (its best measured rate there; docs/integrations.md, torchtitan, Rates).
    """
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    cfg = with_muonclip(llama3_debugmodel())
    cfg.hf_assets_path = QUICKSTART_ASSETS
    cfg.dataloader.dataset = "c4_test"
    cfg.dataloader.dataset_path = f"{QUICKSTART_ASSETS}/train"
    cfg.training.seq_len, cfg.training.local_batch_size, cfg.training.steps = 256, 4, 200
    cfg.lr_scheduler.warmup_steps = 20
    cfg.metrics.log_freq, cfg.metrics.enable_tensorboard = 10, True
    cfg.validator.enable = False
    cfg.checkpoint.enable = False
    cfg.optimizer.lr, cfg.optimizer.tau = 0.02, 30.0
    return cfg


def __getattr__(name: str) -> Any:
    """``--config NAME`` for ``--module muonclip.integrations.torchtitan``: torchtitan's config function
    ``NAME`` of any of its models (``llama3_debugmodel``, ``deepseek_v3_debugmodel``, ...), wrapped
    by `with_muonclip`."""
    if name.startswith("_"):
        raise AttributeError(name)
    from torchtitan.models import _supported_models

    for model in sorted(_supported_models):
        try:
            registry = importlib.import_module(f"torchtitan.models.{model}.config_registry")
        except ImportError:
            continue
        fn = getattr(registry, name, None)
        if callable(fn):
            def config(fn: Any = fn) -> Trainer.Config:
                return with_muonclip(fn())

            config.__name__ = name
            config.__doc__ = f"torchtitan's {model} config {name!r} with MuonClip (muonclip.integrations.torchtitan)."
            return config
    raise AttributeError(f"no torchtitan model registers a config function {name!r}")


__all__ = ["ADAMW_DEFAULTS", "MuonClipOptimizers", "MuonClipTrainerConfig", "QUICKSTART_ASSETS", "RATE_WARNING",
           "llama3_quickstart", "with_muonclip"]
