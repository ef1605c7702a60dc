"""`param_groups`: which parameters get Muon and which get AdamW.

Rules (design.md 1.1), first match wins:

1. ``adamw=`` / ``muon=`` name patterns given by the user (``fnmatch`` style).
2. Weights of ``nn.Embedding``/``nn.EmbeddingBag`` -> AdamW ("embedding").
3. The output head -> AdamW ("lm head"): ``model.get_output_embeddings()`` (Hugging Face), a
   module named ``lm_head``/``head``/``output``/``unembed``/``classifier``/``score``, or a
   Linear whose out_features equals an embedding's vocabulary size. A weight tied to an
   embedding is one parameter and is routed once, as an embedding.
4. 0-D and 1-D tensors (norm gains, biases, scalars) -> AdamW with weight_decay 0 ("vector").
5. Everything else with ndim >= 2 -> Muon: attention projections, MLP, stacked experts
   (3-D), routers; convolution weights in a group with ``flatten=True`` ("conv"); the weights
   of transformers' ``Conv1D`` (GPT-2; a linear layer stored ``(in, out)``, recognised by its
   class name so transformers is not imported) in a group with ``transposed=True``
   ("conv1d (in, out)").
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

HEAD_NAMES = ("lm_head", "head", "output", "unembed", "classifier", "score")
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class Route:
    """One parameter's routing decision."""

    name: str
    shape: tuple[int, ...]
    algorithm: str  # "muon" or "adamw"
    reason: str  # "hidden matrix", "conv", "conv1d (in, out)", "experts", "embedding", "lm head", "vector", "override"


class ParamGroups(list):
    """A list of param groups (dicts for `muonclip.Muon`) that also keeps the routing.

    Attributes:
        routes: one `Route` per parameter, in ``model.named_parameters()`` order.
    """

    def __init__(self, groups: Iterable[dict[str, Any]], routes: list[Route]) -> None:
        super().__init__(groups)
        self.routes = routes

    def report(self) -> str:
        """A readable table of every parameter, its shape, its algorithm and why."""
        w = max([len(r.name) for r in self.routes] + [9])
        lines = [f"{'parameter':<{w}}  {'shape':<20} {'algorithm':<9} reason"]
        for r in self.routes:
            lines.append(f"{r.name:<{w}}  {str(r.shape):<20} {r.algorithm:<9} {r.reason}")
        n_muon = sum(_numel(r.shape) for r in self.routes if r.algorithm == "muon")
        n_all = sum(_numel(r.shape) for r in self.routes)
        lines.append(f"Muon: {n_muon:,} of {n_all:,} parameters ({100 * n_muon / max(n_all, 1):.1f}%)")
        return "\n".join(lines)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, pat) for pat in patterns)


def param_groups(
    model: nn.Module,
    *,
    lr: float | None = None,
    weight_decay: float | None = None,
    adamw_lr: float | None = None,
    adamw_weight_decay: float | None = None,
    adamw: Sequence[str] = (),
    muon: Sequence[str] = (),
    split: Mapping[str, Sequence[int]] | None = None,
    head_names: Sequence[str] = HEAD_NAMES,
) -> ParamGroups:
    """Route every trainable parameter of ``model`` to Muon or AdamW, each exactly once.

    Args:
        model: the model.
        lr: learning rate set on the Muon groups (default None: the optimizer's ``lr``).
        weight_decay: weight decay on the Muon groups (default None: the optimizer's).
        adamw_lr: learning rate of the AdamW groups (default None: the optimizer's ``lr``,
            which is right with ``update_scale="rms"``).
        adamw_weight_decay: weight decay of the embedding/head AdamW group (default None: the
            optimizer's). 0-D/1-D tensors never get weight decay.
        adamw: name patterns forced to AdamW (e.g. ``["*.router.weight"]``).
        muon: name patterns forced to Muon (must be >= 2-D).
        split: name pattern -> row ``split_sizes`` for fused weights (e.g.
            ``{"*.qkv.weight": [d, d, d]}``; for a ``Conv1D`` weight, rows of its ``(out, in)``
            transpose, e.g. ``{"*.c_attn.weight": [d, d, d]}`` for GPT-2).
        head_names: module names treated as the output head (default ``HEAD_NAMES``).

    Returns:
        `ParamGroups`: a list of dicts with ``params``, ``param_names`` and ``algorithm`` (and
        ``flatten``/``transposed``/``split_sizes``/``lr``/``weight_decay`` where set), ready for
        ``muonclip.Muon(groups, lr=...)``; ``.report()`` prints the routing.

    Raises:
        ValueError: a ``muon=`` pattern names a 0-D/1-D tensor, or a parameter would be routed
            twice or not at all.
    """
    split = dict(split or {})
    owner: dict[int, nn.Module] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owner.setdefault(id(p), module)
    vocab = {m.num_embeddings for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    head_ids: set[int] = set()
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        out = get_out()
        if isinstance(out, nn.Module):
            head_ids |= {id(p) for p in out.parameters() if p.ndim >= 2}
    # all aliases of each parameter (tied weights appear under several names)
    aliases: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(name)

    routes: list[Route] = []
    buckets: dict[tuple, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        names = aliases[id(p)]
        module = owner.get(id(p))
        is_embedding = any(_owned_by_embedding(model, n) for n in names)
        is_head = id(p) in head_ids or any(
            "." in n and n.rsplit(".", 2)[-2] in head_names for n in names
        ) or (
            isinstance(module, nn.Linear)
            and p is module.weight
            and module.out_features in vocab
            and _is_last_linear(model, module)
        )
        extra: dict[str, Any] = {}
        if _matches(name, adamw):
            algo, reason = "adamw", "override"
        elif _matches(name, muon):
            if p.ndim < 2:
                raise ValueError(f"muon= pattern matched '{name}' of shape {tuple(p.shape)}; Muon needs >= 2-D tensors")
            algo, reason = "muon", "override"
        elif is_embedding:
            algo, reason = "adamw", "embedding"
        elif is_head:
            algo, reason = "adamw", "lm head"
        elif p.ndim < 2:
            algo, reason = "adamw", "vector"
        elif isinstance(module, _CONV):
            algo, reason = "muon", "conv"
        elif _is_hf_conv1d(module, p):
            algo, reason = "muon", "conv1d (in, out)"
        elif p.ndim == 3:
            algo, reason = "muon", "experts"
        else:
            algo, reason = "muon", "hidden matrix"
        if algo == "muon":
            if reason == "conv" or p.ndim >= 4:
                extra["flatten"] = True
            if _is_hf_conv1d(module, p):
                extra["transposed"] = True
            for pat, sizes in split.items():
                if fnmatch.fnmatchcase(name, pat):
                    extra["split_sizes"] = list(sizes)
                    break
            if lr is not None:
                extra["lr"] = lr
            if weight_decay is not None:
                extra["weight_decay"] = weight_decay
        else:
            if adamw_lr is not None:
                extra["lr"] = adamw_lr
            if p.ndim < 2:
                extra["weight_decay"] = 0.0
            elif adamw_weight_decay is not None:
                extra["weight_decay"] = adamw_weight_decay
        routes.append(Route(name, tuple(p.shape), algo, reason))
        key = (algo, tuple(sorted((k, str(v)) for k, v in extra.items())))
        group = buckets.setdefault(key, {"params": [], "param_names": [], "algorithm": algo, **extra})
        group["params"].append(p)
        group["param_names"].append(name)

    groups = list(buckets.values())
    seen = [id(p) for g in groups for p in g["params"]]
    expected = {id(p) for p in model.parameters() if p.requires_grad}
    if len(seen) != len(set(seen)) or set(seen) != expected:
        raise ValueError("internal routing error: a parameter is routed twice or not at all")
    return ParamGroups(groups, routes)


def _is_hf_conv1d(module: nn.Module | None, p: nn.Parameter) -> bool:
    """Is ``p`` the 2-D weight of a transformers ``Conv1D`` (a linear layer stored ``(in, out)``)?"""
    return (
        module is not None
        and type(module).__name__ == "Conv1D"
        and p is getattr(module, "weight", None)
        and p.ndim == 2
        and getattr(module, "nf", p.shape[1]) == p.shape[1]
    )


def _owned_by_embedding(model: nn.Module, pname: str) -> bool:
    mname = pname.rsplit(".", 1)[0] if "." in pname else ""
    try:
        module = model.get_submodule(mname)
    except AttributeError:
        return False
    return isinstance(module, (nn.Embedding, nn.EmbeddingBag))


def _is_last_linear(model: nn.Module, module: nn.Module) -> bool:
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return bool(linears) and linears[-1] is module


__all__ = ["param_groups", "ParamGroups", "Route", "HEAD_NAMES"]
