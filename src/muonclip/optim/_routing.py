"""`param_groups`: which parameters get Muon and which get AdamW.

Rules (docs/design.md, "Which matrices: fused projections, heads and routers"), first match wins:

1. ``adamw=`` / ``muon=`` name patterns given by the user (``fnmatch`` style).
2. Weights of ``nn.Embedding``/``nn.EmbeddingBag`` -> AdamW ("embedding").
3. The output head -> AdamW ("lm head"): the output layer the model states (the family table's
   ``output_layers``: transformers' ``get_output_embeddings()``), a
   module named ``lm_head``/``head``/``output``/``unembed``/``classifier``/``score``, or a
   Linear whose out_features equals an embedding's vocabulary size. A weight tied to an
   embedding is one parameter and is routed once, as an embedding.
4. 0-D and 1-D tensors (norm gains, biases, scalars), and the per-expert biases ``(E, n)`` of
   transformers' stacked experts -> AdamW with weight_decay 0 ("vector"). A 1-D tensor that is
   a flattened matrix (FSDP1's flat parameters, DeepSpeed ZeRO's partitions) is no vector: a
   model holding one is refused first (`muonclip.optim.flat`).
5. Adapters, by the names of their pieces (the family table's ``adapters``: peft's LoRA and
   DoRA layers, `muonclip.integrations.families`): LoRA's A / B matrices per ``lora=``
   (default ``"muon"``: both to Muon, "LoRA A" / "LoRA B"; ``"muon_b"``: B to Muon, A to AdamW;
   ``"adamw"``: both to AdamW), LoRA embedding factors -> AdamW ("LoRA embedding"), DoRA's
   magnitude vector -> AdamW with weight_decay 0 ("DoRA magnitude": a vector). A trainable copy
   (peft's ``modules_to_save``) is routed like the module it copies (its name read without the
   copy's parts: a copied ``lm_head`` is an lm head).
   Frozen parameters (``requires_grad=False``: a LoRA base, a quantized weight) are in no
   group; ``.report()`` counts them.
6. Everything else with ndim >= 2 -> Muon: attention projections, MLP, stacked experts
   (3-D), routers; convolution weights in a group with ``flatten=True`` ("conv"); the weights
   of a linear layer stored ``(in, out)`` (the family table's ``transposed``: transformers'
   ``Conv1D``, GPT-2) in a group with ``transposed=True`` ("conv1d (in, out)").

How each Muon weight is cut into matrices comes from `muonclip.optim.fused` (splits declared by
the model's family in the registered family table, checked against the weight): known fused
projections (GPT-2's ``c_attn``, ``qkv_proj``, ``query_key_value``, ``gate_up_proj``, stacked
experts, ...: `muonclip.integrations.families` lists them) are split
into their maps by default, so a fused model takes the steps of the same model stored unfused;
``per_head=True`` cuts q/k/v and MLA up-projections into one block per head; routers and MLA
weights stay one matrix; per-expert biases are vectors (AdamW). An explicit ``split=`` pattern
wins over all of it, and ``split_fused=False`` keeps fused weights whole. ``.report()`` shows
every split and why, and the dtype the Muon weights are orthogonalised in on their device and why
(`muonclip.optim._precision`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..common.defaults import AUTO, METHOD
from ..common.family_readers import adapter_role, copied_name, output_layer, stored_transposed
from ._precision import explain_orth_dtype
from .flat import refuse_flat_model
from .fused import WeightSplit, weight_splits

HEAD_NAMES = ("lm_head", "head", "output", "unembed", "classifier", "score")
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


@dataclass
class Route:
    """One parameter's routing decision."""

    name: str
    shape: tuple[int, ...]
    algorithm: str  # "muon" or "adamw"
    reason: str  # "hidden matrix", "conv", "conv1d (in, out)", "experts", "embedding", "lm head", "vector",
    #              "override", or a `muonclip.optim.fused.WeightSplit` reason ("fused qkv", "router", "per-head", ...)
    detail: str = ""  # how a Muon weight is cut into matrices, and from what (config sizes, split= pattern)


class ParamGroups(list):
    """A list of param groups (dicts for `muonclip.Muon`) that also keeps the routing.

    Attributes:
        routes: one `Route` per trainable parameter, in ``model.named_parameters()`` order.
        frozen: elements of the parameters with ``requires_grad=False`` (in no group).
    """

    def __init__(self, groups: Iterable[dict[str, Any]], routes: list[Route], frozen: int = 0) -> None:
        super().__init__(groups)
        self.routes = routes
        self.frozen = frozen

    def report(self) -> str:
        """A readable table of every parameter, its shape, its algorithm and why (for a Muon weight
        cut into several matrices, or kept whole on purpose, also how and from what)."""
        w = max([len(r.name) for r in self.routes] + [9])
        lines = [f"{'parameter':<{w}}  {'shape':<20} {'algorithm':<9} reason"]
        for r in self.routes:
            why = f"{r.reason}: {r.detail}" if r.detail else r.reason
            lines.append(f"{r.name:<{w}}  {str(r.shape):<20} {r.algorithm:<9} {why}")
        n_muon = sum(_numel(r.shape) for r in self.routes if r.algorithm == "muon")
        n_all = sum(_numel(r.shape) for r in self.routes)
        lines.append(f"Muon: {n_muon:,} of {n_all:,} trainable parameters ({100 * n_muon / max(n_all, 1):.1f}%)")
        lines.append(f"frozen: {self.frozen:,} parameters not optimized (requires_grad=False)")
        split = [g for g in self if g["algorithm"] == "muon" and "split_sizes" in g]
        if split:
            n = sum(len(g["params"]) for g in split)
            lines.append(f"Split into separate matrices: {n} weight{'s' * (n != 1)}")
        unknown = [r.name for r in self.routes if r.reason == "fused? layout unknown"]
        if unknown:
            lines.append(f"Fused, layout unknown (one matrix each; cut with split=): {', '.join(unknown)}")
        lines.extend(self._precision_lines())
        return "\n".join(lines)

    def _precision_lines(self) -> list[str]:
        """Where the Muon weights are orthogonalised in which dtype and why: a group's own
        ``orth_dtype``/``method``, else Muon's defaults (``"auto"``, ``"ns5"``;
        `muonclip.optim._precision`)."""
        seen = dict.fromkeys((g.get("orth_dtype", AUTO), g.get("method", METHOD), p.device)
                             for g in self if g["algorithm"] == "muon" for p in g["params"])
        default = "" if all("orth_dtype" in g for g in self if g["algorithm"] == "muon") else \
            " (Muon's default orth_dtype='auto'; orth_dtype=torch.float32 or torch.bfloat16 sets it)"
        return [f"Orthogonalisation{default}: " + "; ".join(explain_orth_dtype(*k) for k in seen)] if seen else []


_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)
"""Modules whose weight is an embedding table (AdamW)."""


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
    split: Mapping[str, Sequence[int] | Mapping[str, Any]] | None = None,
    split_fused: bool = True,
    per_head: bool = False,
    head_names: Sequence[str] = HEAD_NAMES,
    lora: str = "muon",
) -> ParamGroups:
    """Route every trainable parameter of ``model`` to Muon or AdamW, each exactly once.

    Args:
        model: the model.
        lr: learning rate set on the Muon groups (default None: the optimizer's ``lr``).
        weight_decay: weight decay on the Muon groups (default None: the optimizer's).
        adamw_lr: learning rate of the AdamW groups (default None: the optimizer's ``lr``,
            which is right with ``adjust_lr_fn="match_rms_adamw"``, the default).
        adamw_weight_decay: weight decay of the embedding/head AdamW group (default None: the
            optimizer's). 0-D/1-D tensors never get weight decay.
        adamw: name patterns forced to AdamW (e.g. ``["*.router.weight"]``).
        muon: name patterns forced to Muon (must be >= 2-D).
        split: name pattern -> row ``split_sizes`` for fused weights (default None), e.g.
            ``{"*.qkv.weight": [d, d, d]}``; for a ``Conv1D`` weight, rows of its ``(out, in)``
            transpose. A value may also be ``{"split_sizes": [...], "split_groups": G}`` for an
            interleaved layout (`muonclip.optim._matrices`). A match wins over the automatic
            splits below and keeps that weight exactly as given.
        split_fused: split the fused projections whose layout the family table states
            (default True; `muonclip.optim.fused`, `muonclip.integrations.families`): Phi-3's
            ``qkv_proj`` and ``gate_up_proj``, GPT-2's and GPTBigCode's ``c_attn``, GPT-NeoX's
            interleaved ``query_key_value``, CodeGen's partitioned ``qkv_proj``,
            ``nn.MultiheadAttention``'s ``in_proj_weight``, transformers' stacked experts'
            ``gate_up_proj`` (sizes from the module or its config, checked against the weight),
            into the same maps whose rows `muonclip.MuonClip` scales. False keeps each of them one
            matrix; the report still names them.
        per_head: orthogonalise each attention head's rows of q, k and v (separate or fused)
            and of the MLA up-projections as its own matrix, with its own update scale
            (default False; Kimi K3's per-head Muon, GLM's "Muon Split"; see the algorithm
            docs for when it helps).
        head_names: module names treated as the output head (default ``HEAD_NAMES``).
        lora: where a peft LoRA adapter's ``lora_A`` / ``lora_B`` matrices go (`LORA_ROUTES`):
            ``"muon"`` (default: both to Muon, the LoRA-Muon of Qu et al. 2026, arXiv 2605.10468,
            which matches or beats LoRA-Adam on Adam-pretrained models), ``"muon_b"`` (B to Muon,
            A to AdamW, as OneTrainer does) or ``"adamw"`` (both to AdamW). docs/design.md,
            "Routing adapters", states the evidence behind the default.

    Returns:
        `ParamGroups`: a list of dicts with ``params``, ``param_names``, ``algorithm`` and a
        unique ``name`` (``"muon"``, ``"adamw"``, ``"adamw_no_decay"``, ...: what loggers such
        as Lightning's LearningRateMonitor show) (and
        ``flatten``/``transposed``/``split_sizes``/``split_groups``/``lr``/``weight_decay`` where
        set), ready for ``muonclip.Muon(groups, lr=...)``; ``.report()`` prints the routing.

    Raises:
        ValueError: a ``muon=`` pattern names a 0-D/1-D tensor, a ``split=`` value is malformed,
            or a parameter would be routed twice or not at all.
        FlatParameterError: (a ValueError) the model holds flattened pieces of matrices (FSDP1,
            DeepSpeed ZeRO; `muonclip.optim.flat`), named with what to use instead.
    """
    if lora not in LORA_ROUTES:
        raise ValueError(f"lora must be one of {LORA_ROUTES}, got {lora!r}")
    # one walk of the tree: every path (a shared module under each of its names), and from it each module
    # once under its first name (what model.named_modules() gives) and the parameters in the same way
    every = list(model.named_modules(remove_duplicate=False))
    named = _first_of_each(every)
    refuse_flat_model(model, named=named)  # a flattened matrix is never routed as a vector
    split = {pat: _split_options(pat, v) for pat, v in (split or {}).items()}
    known = weight_splits(model, per_head=per_head, split_fused=split_fused, named=named)
    owner: dict[int, nn.Module] = {}
    params: list[tuple[str, nn.Parameter]] = []  # model.named_parameters()
    for mname, module in named:
        for attr, p in module._parameters.items():
            if p is not None and id(p) not in owner:
                owner[id(p)] = module
                params.append((f"{mname}.{attr}" if mname else attr, p))
    vocab = {m.num_embeddings for _, m in named if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    last_linear = next((m for _, m in reversed(named) if isinstance(m, nn.Linear)), None)
    head_ids: set[int] = set()
    out = output_layer(model)
    if out is not None:
        head_ids |= {id(p) for p in out.parameters() if p.ndim >= 2}
    # all aliases of each parameter (tied weights appear under several names): model.named_parameters(
    # remove_duplicate=False)
    aliases: dict[int, list[str]] = {}
    for mname, module in every:
        for attr, p in module._parameters.items():
            if p is None:
                continue
            name = f"{mname}.{attr}" if mname else attr
            known_names = aliases.setdefault(id(p), [])
            if not any(copied_name(name) == copied_name(a) for a in known_names):
                known_names.append(name)

    modules = dict(every)  # by name, once (not a lookup per parameter)
    routes: list[Route] = []
    buckets: dict[tuple, dict[str, Any]] = {}
    frozen = 0
    for name, p in params:
        if not p.requires_grad:
            frozen += p.numel()
            continue
        names = [copied_name(n) for n in aliases[id(p)]]
        adapter = adapter_role(name)
        module = owner.get(id(p))
        is_embedding = any(isinstance(modules.get(n.rpartition(".")[0]), _EMBEDDINGS) for n in aliases[id(p)])
        is_head = id(p) in head_ids or any(
            "." in n and n.rsplit(".", 2)[-2] in head_names for n in names
        ) or (
            isinstance(module, nn.Linear)
            and p is module.weight
            and module.out_features in vocab
            and module is last_linear
        )
        extra: dict[str, Any] = {}
        split_of: WeightSplit | None = known.get(id(p))
        transposed = p.ndim >= 2 and _stored_transposed(module, p)
        detail = ""
        if _matches(name, adamw):
            algo, reason = "adamw", "override"
        elif _matches(name, muon):
            if p.ndim < 2:
                raise ValueError(f"muon= pattern matched '{name}' of shape {tuple(p.shape)}; Muon needs >= 2-D tensors")
            algo, reason = "muon", "override"
        elif adapter is not None:
            reason = adapter
            if adapter == "LoRA A":
                algo = "muon" if lora == "muon" and p.ndim == 2 else "adamw"
            elif adapter == "LoRA B":
                algo = "muon" if lora in ("muon", "muon_b") and p.ndim == 2 else "adamw"
            else:  # DoRA magnitude (a vector), LoRA embedding factors
                algo = "adamw"
            if algo == "adamw" and adapter.startswith("LoRA ") and p.ndim == 2:
                detail = f"lora={lora!r}"
        elif is_embedding:
            algo, reason = "adamw", "embedding"
        elif is_head:
            algo, reason = "adamw", "lm head"
        elif p.ndim < 2:
            algo, reason = "adamw", "vector"
        elif split_of is not None and split_of.algorithm == "adamw":
            algo, reason, detail = "adamw", split_of.reason, split_of.detail
        elif isinstance(module, _CONV):
            algo, reason = "muon", "conv"
        elif transposed:
            algo, reason = "muon", "conv1d (in, out)"
        elif p.ndim == 3:
            algo, reason = "muon", "experts"
        else:
            algo, reason = "muon", "hidden matrix"
        if algo == "muon":
            if reason == "conv" or p.ndim >= 4:
                extra["flatten"] = True
            if transposed:
                extra["transposed"] = True
            pat = next((pat for pat in split if fnmatch.fnmatchcase(name, pat)), None)
            if pat is not None:
                extra.update(split[pat])
                if split_of is not None and split_of.transposed:
                    extra["transposed"] = True
                groups = f" x {split[pat]['split_groups']}, interleaved" if "split_groups" in split[pat] else ""
                detail = f"rows {split[pat]['split_sizes']}{groups}, as split={{{pat!r}: ...}} gives"
            elif split_of is not None:
                extra.update(split_of.options())
                reason, detail = (reason if reason == "override" else split_of.reason), split_of.detail
            if lr is not None:
                extra["lr"] = lr
            if weight_decay is not None:
                extra["weight_decay"] = weight_decay
        else:
            if adamw_lr is not None:
                extra["lr"] = adamw_lr
            if p.ndim < 2 or reason in ("vector", "DoRA magnitude"):
                extra["weight_decay"] = 0.0
            elif adamw_weight_decay is not None:
                extra["weight_decay"] = adamw_weight_decay
        routes.append(Route(name, tuple(p.shape), algo, reason, detail))
        key = (algo, tuple(sorted((k, str(v)) for k, v in extra.items())))
        group = buckets.setdefault(key, {"params": [], "param_names": [], "algorithm": algo, **extra})
        group["params"].append(p)
        group["param_names"].append(name)

    groups = list(buckets.values())
    _name_groups(groups)
    seen = [id(p) for g in groups for p in g["params"]]
    expected = {id(p) for _, p in params if p.requires_grad}
    if len(seen) != len(set(seen)) or set(seen) != expected:
        raise ValueError("internal routing error: a parameter is routed twice or not at all")
    return ParamGroups(groups, routes, frozen)


def _name_groups(groups: list[dict[str, Any]]) -> None:
    """Give every group a unique ``name`` (shown by loggers, e.g. Lightning's LearningRateMonitor):
    its algorithm, then what sets it apart: ``"muon"``, ``"muon_split"`` (fused weights cut into
    matrices), ``"muon_conv"`` (flattened), ``"muon_transposed"`` (``Conv1D``), ``"adamw"``,
    ``"adamw_no_decay"`` (vectors); a second group of the same name gets ``_2``, and so on."""
    seen: dict[str, int] = {}
    for g in groups:
        parts = [g["algorithm"]]
        if g.get("split_sizes") is not None:
            parts.append("split")
        if g.get("flatten"):
            parts.append("conv")
        if g.get("transposed"):
            parts.append("transposed")
        if g["algorithm"] == "adamw" and g.get("weight_decay") == 0.0:
            parts.append("no_decay")
        base = "_".join(parts)
        seen[base] = seen.get(base, 0) + 1
        g["name"] = base if seen[base] == 1 else f"{base}_{seen[base]}"


LORA_ROUTES = ("muon", "muon_b", "adamw")
"""Values of `param_groups`' ``lora=``: where LoRA's A and B matrices go."""

def _split_options(pattern: str, value: Sequence[int] | Mapping[str, Any]) -> dict[str, Any]:
    """The param-group keys of one ``split=`` value (sizes, or a dict with ``split_sizes`` and
    optionally ``split_groups``)."""
    if isinstance(value, Mapping):
        unknown = set(value) - {"split_sizes", "split_groups"}
        if "split_sizes" not in value or unknown:
            raise ValueError(
                f"split={{{pattern!r}: {dict(value)!r}}}: a dict value needs 'split_sizes' and may have "
                f"'split_groups'{f'; unknown keys {sorted(unknown)}' if unknown else ''}"
            )
        out = {"split_sizes": [int(s) for s in value["split_sizes"]]}
        if int(value.get("split_groups", 1)) != 1:
            out["split_groups"] = int(value["split_groups"])
        return out
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"split={{{pattern!r}: {value!r}}}: give row sizes, e.g. [d, d_kv, d_kv]")
    return {"split_sizes": [int(s) for s in value]}


def _first_of_each(every: list[tuple[str, nn.Module]]) -> list[tuple[str, nn.Module]]:
    """``model.named_modules()`` from ``model.named_modules(remove_duplicate=False)``: each module once, under
    the first of its names (the walk is the same, in the same order; a shared module's subtree is only
    walked again)."""
    seen: set[int] = set()
    out = []
    for name, module in every:
        if id(module) not in seen:
            seen.add(id(module))
            out.append((name, module))
    return out


def _stored_transposed(module: nn.Module | None, p: nn.Parameter) -> bool:
    """Is ``p`` the weight of a linear layer stored ``(in, out)``
    (`muonclip.common.family_readers.stored_transposed`)?"""
    return module is not None and p is getattr(module, "weight", None) and stored_transposed(module)

