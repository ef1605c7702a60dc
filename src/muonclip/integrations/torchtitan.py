"""Muon and MuonClip as torchtitan optimizers: a container on its meshes, configured from its command line.

``pip install 'muonclip[torchtitan]'`` (torchtitan 0.3.0). torchtitan trains its models through
``torchtitan.train`` with a ``Trainer.Config`` picked by ``--module``/``--config``; this module
is such a ``--module``. Every config function of torchtitan's own models is reachable under its
name, with MuonClip as the optimizer and a recording attention::

    torchrun --nproc-per-node 2 -m torchtitan.train \\
        --module muonclip.integrations.torchtitan --config llama3_debugmodel \\
        --optimizer.name MuonClip --optimizer.lr 0.02 --optimizer.tau 100 --optimizer.per_head

What ``--config NAME`` gives (`with_muonclip` applied to torchtitan's ``NAME()``):

* ``optimizer``: a `MuonClipOptimizers.Config`, whose fields (``--optimizer.<field>``) are
  ours: ``name`` (``MuonClip`` or ``Muon``), ``lr``, ``weight_decay``, ``adamw_lr``,
  ``adamw_weight_decay``, ``momentum``, ``nesterov``, ``adjust_lr_fn``, ``method``,
  ``orth_dtype``, ``per_head``, ``tau``, ``gqa_policy``, ``on_ineffective_clip``. The
  inherited ``param_groups``/``implementation`` fields of torchtitan's container are not used:
  `muonclip.param_groups` routes every parameter (embeddings, ``lm_head`` and vectors to AdamW,
  the rest to Muon; the fused ``wqkv`` seen as its q, k, v maps: `muon_splits`).
* every attention's inner attention replaced by a recording one
  (`muonclip.integrations.torchtitan_attention`): `RecordingFlexAttention` on CUDA,
  `RecordingSDPA` elsewhere.
* on a machine without CUDA, the CPU/gloo set-up of `muonclip.integrations.torchtitan_cpu`.

The container (`MuonClipOptimizers`) builds one `muonclip.MuonClip` (or `muonclip.Muon`) per
model part (pipeline stage) on the parallelised model: DTensor parameters on torchtitan's
meshes (FSDP2, tensor parallel, both: meshes unflattened from its 1-D world mesh, which Muon
maps by rank layout), QK-Clip layers from `muonclip.integrations.torchtitan_layouts` (fused
``wqkv`` per key/value group, MLA by K2's rule, tensor-parallel head ranges), param names in
torchtitan's canonical checkpoint form so its flat, FQN-keyed optimizer state dict (DCP,
resharding) keys our state like its own. torchtitan materialises optimizer state before saving
or loading a checkpoint with a zero-gradient, zero-lr step; the container runs that step with
MuonClip's "nothing recorded" warning silenced (it is not a training step).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.utils import init_optim_state
from torchtitan.trainer import Trainer

from ..optim import Muon, param_groups
from ..qkclip._muonclip import MuonClip
from .torchtitan_attention import recording_attention_config
from .torchtitan_layouts import attention_layers, canonical_name, muon_splits

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MuonClipOptimizers(OptimizersContainer):
    """torchtitan's optimizer container holding one `muonclip.MuonClip` (or `muonclip.Muon`) per model part.

    Built by torchtitan's trainer as ``config.optimizer.build(model_parts=...)`` after the model
    is parallelised. For each model part: `muonclip.param_groups` (with `muon_splits`), its
    ``param_names`` in torchtitan's canonical form, then ``MuonClip(part, layers=
    attention_layers(part), groups=...)`` or ``Muon(groups)``. ``step``, ``zero_grad``, the
    flat state dict and the LR schedulers are torchtitan's, over these optimizers.

    Args:
        config: a `MuonClipOptimizers.Config`.
        model_parts: the (parallelised) model parts.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        name: Literal["MuonClip", "Muon"] = "MuonClip"
        """``MuonClip`` (Muon + AdamW + QK-Clip) or ``Muon`` (Muon + AdamW, no clip)."""
        lr: float = 0.02
        """Learning rate of the Muon and AdamW groups (torchtitan's LR schedule scales it)."""
        weight_decay: float = 0.1
        """Decoupled weight decay (Muon and the embedding/head AdamW group; vectors get none)."""
        adamw_lr: float | None = None
        """Learning rate of the AdamW groups (None: ``lr``, right with ``adjust_lr_fn`` match_rms_adamw)."""
        adamw_weight_decay: float | None = None
        """Weight decay of the embedding/head AdamW group (None: ``weight_decay``)."""
        momentum: float = 0.95
        """Muon's momentum."""
        nesterov: bool = True
        """Nesterov momentum for Muon."""
        adjust_lr_fn: Literal["match_rms_adamw", "original", "unscaled"] = "match_rms_adamw"
        """Muon's update scale: Moonlight/K2's ``0.2 * sqrt(max(rows, cols))`` (AdamW's RMS),
        Keller Jordan's ``sqrt(max(1, rows/cols))``, or none."""
        method: str = "ns5"
        """Orthogonalisation method (``muonclip.ortho``: ns5, polar_express, ...)."""
        orth_dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
        """dtype of the orthogonalisation (float32 for bit-level comparisons on CPU)."""
        per_head: bool = False
        """Orthogonalise each attention head's rows of q, k, v and of MLA's up-projections alone."""
        tau: float = 100.0
        """QK-Clip threshold on the max logit (MuonClip only; K2 uses 100, small models 30-50)."""
        gqa_policy: Literal["per_head", "balanced", "group"] = "per_head"
        """How grouped-query attention is clipped (`muonclip.qkclip.GQALayout`)."""
        on_ineffective_clip: Literal["warn", "raise", "ignore"] = "warn"
        """What MuonClip does when a clip does not act on the logits (`muonclip.MuonClip`)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.name not in ("MuonClip", "Muon"):
            raise ValueError(f"optimizer.name must be 'MuonClip' or 'Muon', got {config.name!r}")
        if config.orth_dtype not in _DTYPES:
            raise ValueError(f"optimizer.orth_dtype must be one of {sorted(_DTYPES)}, got {config.orth_dtype!r}")
        self.model_parts = model_parts
        self.optimizers = []
        all_params: list[nn.Parameter] = []
        kwargs = dict(weight_decay=config.weight_decay, momentum=config.momentum, nesterov=config.nesterov,
                      adjust_lr_fn=config.adjust_lr_fn, method=config.method, orth_dtype=_DTYPES[config.orth_dtype])
        for part in model_parts:
            groups = param_groups(part, adamw_lr=config.adamw_lr, adamw_weight_decay=config.adamw_weight_decay,
                                  split=muon_splits(part, per_head=config.per_head), per_head=config.per_head)
            for g in groups:
                g["param_names"] = [canonical_name(n) for n in g["param_names"]]
            if config.name == "MuonClip":
                opt: Muon = MuonClip(part, lr=config.lr, tau=config.tau, groups=groups,
                                     layers=attention_layers(part, gqa_policy=config.gqa_policy),
                                     on_ineffective_clip=config.on_ineffective_clip, **kwargs)
            else:
                opt = Muon(groups, lr=config.lr, **kwargs)
            self.optimizers.append(opt)
            all_params.extend(p for g in groups for p in g["params"])
        self._validate_params(all_params)
        self._post_init(all_params)

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


def with_muonclip(config: Trainer.Config, *, device_type: str | None = None) -> Trainer.Config:
    """``config`` (a torchtitan ``Trainer.Config``) with MuonClip as its optimizer and a recording attention.

    Returns a new config whose ``optimizer`` is a `MuonClipOptimizers.Config` (its class
    declares the field as such, so ``--optimizer.<field>`` parses our fields) with
    torchtitan's ``lr`` and ``weight_decay`` carried over when the original optimizer had
    one param group; every ``inner_attention`` of the model config is the recording one for
    ``device_type`` (default: ``"cuda"`` when available, else ``"cpu"``), and on CPU the
    set-up of `muonclip.integrations.torchtitan_cpu.cpu_config` is applied and the
    orthogonalisation runs in float32 (``--optimizer.orth_dtype`` still overrides it).
    """
    from . import torchtitan_cpu

    device_type = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    opt = MuonClipOptimizers.Config()
    if len(config.optimizer.param_groups) == 1:
        given = config.optimizer.param_groups[0].optimizer_kwargs
        opt = dataclasses.replace(opt, **{k: given[k] for k in ("lr", "weight_decay") if k in given})
    config = copy.deepcopy(config)  # the given config is left as it was
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    fields["optimizer"] = opt
    out = MuonClipTrainerConfig(**fields)
    if out.model_spec is not None:
        from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention, VarlenAttention

        swap = recording_attention_config(device_type)
        for kind in (FlexAttention.Config, VarlenAttention.Config, ScaledDotProductAttention.Config):
            for _, _, parent, attr in list(out.model_spec.model.traverse(kind)):
                if parent is not None and attr == "inner_attention":
                    setattr(parent, attr, dataclasses.replace(swap))
    if device_type == "cpu":
        out.optimizer.orth_dtype = "float32"  # bfloat16 matmuls are emulated (slow) on most CPUs
        torchtitan_cpu.cpu_config(out)
    return out


@dataclass(kw_only=True, slots=True)
class MuonClipTrainerConfig(Trainer.Config):
    """torchtitan's ``Trainer.Config`` whose ``optimizer`` field is a `MuonClipOptimizers.Config`
    (so that ``--optimizer.tau`` and the other fields of ours parse on the command line)."""

    optimizer: MuonClipOptimizers.Config = dataclasses.field(default_factory=MuonClipOptimizers.Config)


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


__all__ = ["MuonClipOptimizers", "MuonClipTrainerConfig", "with_muonclip"]
