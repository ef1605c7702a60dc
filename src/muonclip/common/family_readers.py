"""Reading the registered family table: each fact about a model's modules read by one function.

The records and the registry are `muonclip.common.families`; the readers here are what routing
(`muonclip.optim.fused`, `muonclip.optim._routing`) and the clip (`muonclip.qkclip`,
`muonclip.integrations.hf_layouts`) call:

* `lacks` — a module without any of some attributes, told without a failed lookup.
* `query_heads`, `heads_of` — a module's head counts (`muonclip.common.families.HeadSources`:
  the module's own attributes first, layers of one model may differ; then its config).
* `fused_qkv` — the rows of q, k and v in a fused projection (`QKVRows`). `param_groups`' split
  of the weight (`QKVRows.sizes`, `QKVRows.groups`, `QKVRows.per_head`) and the clip's rows of
  q and k (`QKVRows.rows`) are both derived from it, so they cannot disagree.
* `latent_attention`, `separate_projections` — multi-head latent attention and separate
  q/k/v projections.
* `stored_transposed` — a linear layer that stores its weight ``(in, out)``.
* `adapter_role`, `copied_name`, `under_adapter_base` — adapter parameters by the names of
  their pieces.
* `normalises_qk` — attention classes that always normalise q/k after the projections.
* `output_layer` — a model's own statement of its output layer.

Fused MLPs, stacked experts and routers, and the names that say a weight is fused, are read by
`muonclip.optim.fused` from `muonclip.common.families.families`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any

from torch import Tensor, nn

from .families import FusedQKV, LatentAttention, Projections, Read, families


def class_names(module: object) -> frozenset[str]:
    """Names of ``module``'s class and of every class it derives from."""
    return _mro_names(type(module))


@cache
def _mro_names(cls: type) -> frozenset[str]:
    return frozenset(c.__name__ for c in cls.__mro__)


def lacks(module: nn.Module, names: frozenset[str]) -> bool:
    """Whether ``module`` has none of ``names`` as an attribute, told from what torch stores without a
    failed lookup: its class (one that does not change attribute lookup), its ``__dict__``, its
    parameters, buffers and children. False also when it cannot be told so (a class with its own
    ``__getattr__``): ask ``hasattr`` then."""
    return (_class_lacks(type(module), names) and names.isdisjoint(module.__dict__)
            and names.isdisjoint(module._modules) and names.isdisjoint(module._parameters)
            and names.isdisjoint(module._buffers))


@cache
def _class_lacks(cls: type, names: frozenset[str]) -> bool:
    plain = cls.__getattr__ is nn.Module.__getattr__ and cls.__getattribute__ is object.__getattribute__
    return plain and names.isdisjoint(dir(cls))


def child_weight(module: nn.Module, attr: str) -> Tensor | None:
    """The 2-D ``weight`` of child layer ``attr`` of ``module``, or None."""
    child = getattr(module, attr, None)
    p = getattr(child, "weight", None) if isinstance(child, nn.Module) else None
    return p if isinstance(p, Tensor) and p.ndim == 2 else None


def projection(module: nn.Module, attr: str) -> tuple[Tensor, Tensor | None, bool] | None:
    """``(weight, bias, transposed)`` of projection ``attr`` of ``module``: child layer ``attr``
    (``transposed``: `stored_transposed`), or the module's own ``{attr}_weight`` / ``{attr}_bias``
    parameters; None when it has no 2-D weight."""
    child = getattr(module, attr, None)
    if isinstance(child, nn.Module):
        w = child_weight(module, attr)
        return None if w is None else (w, getattr(child, "bias", None), stored_transposed(child))
    w = getattr(module, f"{attr}_weight", None)
    if isinstance(w, Tensor) and w.ndim == 2:
        b = getattr(module, f"{attr}_bias", None)
        return w, b if isinstance(b, Tensor) else None, False
    return None


def has_projection(module: nn.Module, attr: str) -> bool:
    """Whether ``module`` has a child layer ``attr`` or a parameter ``{attr}_weight``."""
    return isinstance(getattr(module, attr, None), nn.Module) or isinstance(getattr(module, f"{attr}_weight", None),
                                                                            Tensor)


def stored_transposed(module: nn.Module | None) -> bool:
    """Whether ``module`` is a linear layer storing its 2-D weight ``(in, out)`` (a registered
    `TransposedLinear` class whose output width, where it states one, is the weight's columns)."""
    if module is None:
        return False
    names = class_names(module)
    entries = [t for t in families().transposed if not names.isdisjoint(t.classes)]  # by class first: cheap
    if not entries:
        return False
    w = getattr(module, "weight", None)
    if not isinstance(w, Tensor) or w.ndim != 2:
        return False
    return any(t.out_features is None or getattr(module, t.out_features, w.shape[1]) == w.shape[1] for t in entries)


@dataclass(frozen=True)
class Heads:
    """An attention module's head counts (`heads_of`).

    Attributes:
        n_heads, n_kv_heads, head_dim: query heads, key/value heads, rows of one head.
        source: where they were read (``"num_heads=4, num_key_value_groups=4, head_dim=16"``).
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    source: str


def query_heads(module: nn.Module, config: Any) -> tuple[int, str] | None:
    """``(query heads, "name=value")`` of an attention module (`HeadSources.heads`), or None."""
    return families().heads.heads.read(module, config)


def heads_of(module: nn.Module, config: Any) -> Heads | None:
    """The head counts of an attention module, read as `HeadSources` states: the module's own
    attributes first (layers of one model may differ), then ``config`` (may be None); None
    when the query heads or the head dimension are not found."""
    spec = families().heads
    found = query_heads(module, config)
    if found is None:
        return None
    n, source = found
    sources = [source]
    kv = Read(spec.kv_heads.module).read(module, None)
    if kv is None:
        groups = Read(spec.kv_groups).read(module, None)
        if groups is not None and n % groups[0] == 0:
            kv = n // groups[0], f"{groups[1]} ({n // groups[0]} key/value heads)"
    if kv is None:
        kv = Read((), spec.kv_heads.config).read(None, config)
    if kv is not None:
        sources.append(kv[1])
    d = spec.head_dim.read(module, config)
    if d is None:
        width = Read((), spec.width).read(None, config)
        if width is None or width[0] % n:
            return None
        d = width[0] // n, f"{width[1]} / {n} heads"
    sources.append(d[1])
    return Heads(n, n if kv is None else kv[0], d[0], ", ".join(sources))


@dataclass(frozen=True)
class QKVRows:
    """Where a fused projection holds q, k and v (`fused_qkv`): the rows of its ``(out, in)``
    matrix are ``groups`` equal consecutive groups, each the maps of ``fused.order`` with
    ``sizes`` rows.

    Attributes:
        fused: the table's entry.
        heads: the module's head counts (None: not found).
        groups: groups of the rows.
        sizes: rows of each map of ``fused.order`` in one group (empty: not stated, `problem`).
        problem: why the rows cannot be stated (heads or groups not found, heads that do not
            divide into the groups), else None.
    """

    fused: FusedQKV
    heads: Heads | None
    groups: int
    sizes: tuple[int, ...]
    problem: str | None = None

    @property
    def n_rows(self) -> int:
        """Rows of the whole fused matrix."""
        return sum(self.sizes) * self.groups

    def rows(self, part: str) -> tuple[int, int, int, int]:
        """Map ``part``'s rows as ``(start, block, stride, count)``: ``count`` blocks of
        ``block`` rows, block i from row ``start + i * stride`` (`muonclip.qkclip.StridedRows`'
        arguments; one block when ``groups`` is 1)."""
        i = self.fused.order.index(part)
        return sum(self.sizes[:i]), self.sizes[i], sum(self.sizes), self.groups

    def error(self, n_rows: int) -> str | None:
        """Why these rows do not fit a fused matrix of ``n_rows`` rows, or None when they do."""
        if self.problem is not None:
            return self.problem
        if self.n_rows != n_rows:
            return f"has {n_rows} rows, not {self.describe()}"
        return None

    def per_head(self) -> tuple[int, ...] | None:
        """One block of ``head_dim`` rows per head of every map (each group's maps are whole
        heads), or None when a head straddles two maps' rows."""
        d = self.heads.head_dim
        return (d,) * (self.n_rows // d) if all(s % d == 0 for s in self.sizes) else None

    def describe(self) -> str:
        """The rows and where their sizes come from: ``"[q 32 | k 8 | v 8] (num_heads=4, ...)"``."""
        parts = " | ".join(f"{m} {s}" for m, s in zip(self.fused.order, self.sizes))
        text = f"[{parts}] x {self.groups}, interleaved" if self.groups > 1 else f"[{parts}]"
        return f"{text} ({self.heads.source})"


def fused_qkv(module: nn.Module, config: Any) -> QKVRows | None:
    """The q/k/v rows of ``module``'s fused projection: the first `FusedQKV` entry of its class
    whose projection it has and whose conditions hold, with the head counts of `heads_of`;
    None when no entry applies."""
    names = class_names(module)
    for fused in families().fused_qkv:
        if names.isdisjoint(fused.classes) or not has_projection(module, fused.attr):
            continue
        if not all(bool(getattr(module, a, False)) is v for a, v in fused.when):
            continue
        heads = heads_of(module, config if fused.config else None)
        if heads is None:
            return QKVRows(fused, None, 1, (), "head counts not found (module attributes or config)")
        if fused.per_kv_head:
            groups = heads.n_kv_heads, f"one group per key/value head ({heads.n_kv_heads})"
        elif fused.groups is not None:
            groups = Read((fused.groups,)).read(module, None)
            if groups is None:
                return QKVRows(fused, heads, 1, (), f"no positive {fused.groups} on the module")
        else:
            groups = 1, ""
        heads = dataclasses.replace(heads, source=", ".join(s for s in (heads.source, groups[1]) if s))
        counts = {"q": heads.n_heads, "k": heads.n_kv_heads, "v": heads.n_kv_heads}
        rows = [counts[m] * heads.head_dim for m in fused.order]
        if any(r % groups[0] for r in rows):
            return QKVRows(fused, heads, groups[0], (), f"rows {rows} do not divide into {groups[0]} groups "
                                                          f"({heads.source})")
        return QKVRows(fused, heads, groups[0], tuple(r // groups[0] for r in rows))
    return None


def separate_projections(module: nn.Module) -> Projections | None:
    """The first `Projections` entry whose query and key children ``module`` has, else None."""
    return next((p for p in families().projections
                 if isinstance(getattr(module, p.q, None), nn.Module)
                 and isinstance(getattr(module, p.k, None), nn.Module)), None)


def latent_attention(module: nn.Module) -> LatentAttention | None:
    """The first `LatentAttention` entry whose key/value up-projection child ``module`` has, else None."""
    return next((m for m in families().latent if isinstance(getattr(module, m.kv_up, None), nn.Module)), None)


def normalises_qk(module: nn.Module) -> bool:
    """Whether ``module``'s class (or one it derives from) always normalises q/k after the projections."""
    return not class_names(module).isdisjoint(families().qk_norm_classes)


def adapter_role(name: str) -> str | None:
    """The `ADAPTER_ROLES` role of parameter ``name`` (by the parts of its dotted name), else None."""
    roles = _roles(families().adapters.roles)
    return next((roles[part] for part in name.split(".") if part in roles), None)


@cache
def _roles(roles: tuple[tuple[str, str], ...]) -> dict[str, str]:
    return dict(roles)


def copied_name(name: str) -> str:
    """``name`` with a trainable copy's ``<copies>.<adapter>`` taken out: the name of the module
    it copies (``lm_head.modules_to_save.default.weight`` -> ``lm_head.weight``)."""
    parts = name.split(".")
    copies = families().adapters.copies
    for i in range(len(parts) - 2):
        if parts[i] in copies:
            return ".".join(parts[:i] + parts[i + 2:])
    return name


def under_adapter_base(name: str) -> bool:
    """Whether parameter ``name`` is the weight an additive adapter wraps (under one of `Adapters.bases`)."""
    return not set(name.split(".")).isdisjoint(families().adapters.bases)


def output_layer(model: nn.Module) -> nn.Module | None:
    """The output layer ``model`` states (the first of `FamilyTable.output_layers` it has that
    returns a module), else None."""
    for method in families().output_layers:
        get = getattr(model, method, None)
        if callable(get):
            out = get()
            if isinstance(out, nn.Module):
                return out
    return None


__all__ = [
    "Heads", "QKVRows", "adapter_role", "child_weight", "class_names", "copied_name", "fused_qkv", "has_projection",
    "heads_of", "lacks", "latent_attention", "normalises_qk", "output_layer", "projection", "query_heads",
    "separate_projections", "stored_transposed", "under_adapter_base",
]
