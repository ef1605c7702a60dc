"""The model and the optimizer of a run: the reference GPT of a `RunConfig`, and AdamW, Muon or MuonClip."""

from __future__ import annotations

import torch
from torch import nn

from ..common import defaults as D
from ..optim import param_groups
from ..optim._precision import explain_orth_dtype
from .config import MUON_VARIANTS, RunConfig, check_optimizer, model_config


def build_model(cfg: RunConfig) -> nn.Module:
    """The reference GPT of ``cfg`` (`muonclip.app.config.model_config`), initialised from
    ``torch.manual_seed(cfg.seed)``."""
    from ..models import GPT

    torch.manual_seed(cfg.seed)
    return GPT(model_config(cfg))


def build_optimizer(name: str, model: nn.Module, cfg: RunConfig) -> torch.optim.Optimizer:
    """The optimizer of a run.

    * ``adamw``: ``torch.optim.AdamW(lr=lr_adamw)`` with Muon's AdamW branch's betas and eps, weight decay on
      tensors with ndim >= 2 only.
    * ``muon``: ``muonclip.Muon`` over `muonclip.param_groups` — hidden matrices at
      ``lr_muon``, embeddings/head/norms by its AdamW branch at ``lr_adamw``.
    * ``muonclip``: ``muonclip.MuonClip``, the same plus QK-Clip at ``tau``, at ``lr_muonclip``.
    * ``normuon``, ``muon_cautious``, ``muon_8bit``: ``muonclip.Muon`` as for ``muon`` with one
      option on (`muonclip.app.config.MUON_VARIANTS`), at their own rate ``lr_<name>``.
    """
    check_optimizer(name)
    if name == "adamw":
        decay = [p for p in model.parameters() if p.ndim >= 2]
        no_decay = [p for p in model.parameters() if p.ndim < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr_adamw, betas=D.BETAS, eps=D.ADAMW_EPS,
        )
    groups = param_groups(model, adamw_lr=cfg.lr_adamw)
    orth_dtype = muon_orth_dtype(cfg)
    if name in MUON_VARIANTS:
        from ..optim import Muon

        return Muon(groups, lr=cfg.lr(name), weight_decay=cfg.weight_decay, orth_dtype=orth_dtype,
                    **MUON_VARIANTS[name])
    from .. import MuonClip

    return MuonClip(model, lr=cfg.lr_muonclip, tau=cfg.tau, groups=groups, weight_decay=cfg.weight_decay,
                    orth_dtype=orth_dtype)


def muon_orth_dtype(cfg: RunConfig) -> torch.dtype | str:
    """``cfg.orth_dtype`` as Muon's ``orth_dtype`` argument: ``"auto"``, or the torch dtype named."""
    return cfg.orth_dtype if cfg.orth_dtype == D.AUTO else getattr(torch, cfg.orth_dtype)


def orthogonalisation(cfg: RunConfig, device: torch.device | str = "cpu") -> str:
    """In words, the dtype Muon's orthogonalisation (ns5) runs in on ``device`` with ``cfg`` and
    why, e.g. ``"bfloat16 on cpu (auto: the CPU has AMX-BF16 and AVX512-BF16)"``
    (`muonclip.optim._precision.explain_orth_dtype`)."""
    return explain_orth_dtype(muon_orth_dtype(cfg), "ns5", device)


def hidden_matrices(model: nn.Module) -> list[torch.Tensor]:
    """The parameters `muonclip.param_groups` gives to Muon (the hidden matrices)."""
    return [p for g in param_groups(model) if g["algorithm"] == "muon" for p in g["params"]]


def parameter_count(cfg: RunConfig) -> int:
    """The parameters of the reference GPT of ``cfg`` (tied weights once), counted on the meta device."""
    state = torch.random.get_rng_state()  # build_model seeds the global generator
    try:
        with torch.device("meta"):
            return sum(p.numel() for p in build_model(cfg).parameters())
    finally:
        torch.random.set_rng_state(state)
