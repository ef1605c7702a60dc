"""Model families: what a model's modules hold, registered by the layers above the core.

`muonclip.param_groups` cuts a fused projection into its maps and `muonclip.MuonClip` scales
each head's rows of it; both need the same facts about a model family: which child holds which
maps in what order, where its head counts are read, which layers store their weight
``(in, out)``, which attention classes normalise q and k, what an adapter's parameters are
called. Those facts name frameworks' classes and attributes, so the core (`muonclip.optim`,
`muonclip.qkclip`, `muonclip.attention`, `muonclip.ortho`) states none of them: a layer above
describes its families in a `FamilyTable` and registers it with `register_families` (as
`muonclip.qkclip.discovery.register_discoverer` registers layer finders). The table of torch's,
transformers', peft's and muonclip's own models is `muonclip.integrations.families`, registered
when ``muonclip`` is imported.

The readers here turn the registered tables (`families`: every table, merged in registration
order) into what routing and the clip use, each fact read by one function:

* `query_heads`, `heads_of` — a module's head counts (`HeadCounts`: the module's own attributes
  first, layers of one model may differ; then its config).
* `fused_qkv` — the rows of q, k and v in a fused projection (`QKVRows`). `param_groups`' split
  of the weight (`QKVRows.sizes`, `QKVRows.groups`, `QKVRows.per_head`) and the clip's rows of
  q and k (`QKVRows.rows`) are both derived from it, so they cannot disagree.
* `latent_attention`, `separate_projections` — multi-head latent attention (`LatentAttention`)
  and separate q/k/v projections (`Projections`).
* `stored_transposed` — a linear layer that stores its weight ``(in, out)`` (`TransposedLinear`).
* `adapter_role`, `copied_name`, `under_adapter_base` — adapter parameters by the names of
  their pieces (`Adapters`).
* `normalises_qk` — attention classes that always normalise q/k after the projections.
* `output_layer` — a model's own statement of its output layer.

Fused MLPs, stacked experts and routers (`FusedMLP`, `StackedExperts`, `Router`) and the names
that say a weight is fused are read by `muonclip.optim.fused` from `families()`.

A class is matched by its name or the name of a class it derives from, so the core imports no
framework; a family registered earlier wins where two describe one module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import cache
from typing import Any

from torch import Tensor, nn

QKV = ("q", "k", "v")
"""The maps of an attention projection, as `FusedQKV.order` names them."""

ADAPTER_ROLES = ("LoRA A", "LoRA B", "LoRA embedding", "DoRA magnitude")
"""What an adapter parameter can be (`Adapters.roles`); `muonclip.param_groups` routes by role."""


# ------------------------------------------------------------------------------------------------
# the table's records
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Read:
    """Where one positive integer of a module is read: the first of the module's attributes
    ``module`` that holds one, else the first of its config's keys ``config``."""

    module: tuple[str, ...] = ()
    config: tuple[str, ...] = ()

    def read(self, module: nn.Module | None, config: Any) -> tuple[int, str] | None:
        """``(value, "name=value")``, or None when no attribute and no key holds a positive int."""
        for owner, names in ((module, self.module), (config, self.config)):
            for name in names:
                v = getattr(owner, name, None)
                if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                    return v, f"{name}={v}"
        return None


@dataclass(frozen=True)
class HeadCounts:
    """Where an attention module's head counts are read (`heads_of`).

    Attributes:
        heads: query heads.
        kv_heads: key/value heads; its module attributes are read first, then ``kv_groups``,
            then its config keys; none found: as many as query heads.
        kv_groups: module attributes holding query heads per key/value head.
        head_dim: rows of one head.
        width: config keys of the model width: ``head_dim = width // heads`` when no head
            dimension is stated.
    """

    heads: Read = Read()
    kv_heads: Read = Read()
    kv_groups: tuple[str, ...] = ()
    head_dim: Read = Read()
    width: tuple[str, ...] = ()


@dataclass(frozen=True)
class FusedQKV:
    """A fused projection of an attention class: which child holds q, k and v rows, in what order.

    The rows of the projection's ``(out, in)`` matrix are ``G`` equal consecutive groups, each
    the maps of ``order`` one after another: q with ``n_heads * head_dim / G`` rows, k and v with
    ``n_kv_heads * head_dim / G`` each (`QKVRows`).

    Attributes:
        classes: the attention classes (a class deriving from one matches too).
        attr: the child layer holding the rows (``weight``/``bias``), or the prefix of the
            module's own ``{attr}_weight``/``{attr}_bias`` parameters.
        order: the maps in one group (`QKV` names; a map not there, q, comes from ``query``).
        per_kv_head: one group per key/value head (``G = n_kv_heads``: q, k, v interleaved per
            head, or per key/value group); else ``groups``, else one group.
        groups: the module attribute holding ``G`` (model-parallel partitions), or None.
        query: the child layer holding q when ``order`` has no q (a cross-attention's queries).
        when: ``(attribute, value)`` pairs: the entry applies to a module whose attributes are
            truthy (True) or falsy/absent (False) as stated.
        config: head counts may come from the model's config where the module holds none
            (default True); False for a module that holds them all (a layer the model's config
            does not describe, e.g. ``nn.MultiheadAttention`` inside a vision tower).
    """

    classes: tuple[str, ...]
    attr: str
    order: tuple[str, ...] = QKV
    per_kv_head: bool = False
    groups: str | None = None
    query: str | None = None
    when: tuple[tuple[str, bool], ...] = ()
    config: bool = True

    def __post_init__(self) -> None:
        order = tuple(self.order)
        if not set(order) <= set(QKV) or len(set(order)) != len(order) or "k" not in order \
                or ("q" not in order) == (self.query is None):
            raise ValueError(
                f"FusedQKV({self.attr!r}): order {order} must hold k and distinct maps of {QKV}, with q in it or "
                f"from query= (got query={self.query!r})"
            )
        if self.per_kv_head and self.groups is not None:
            raise ValueError(f"FusedQKV({self.attr!r}): per_kv_head=True and groups={self.groups!r}: give one")


@dataclass(frozen=True)
class Projections:
    """Names of separate query, key and value projections (children of an attention module)."""

    q: str
    k: str
    v: str


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (DeepSeek-V3 style): which children and sizes it has.

    Attributes:
        kv_up: the key/value up-projection (rows ``[k_nope | v]`` per head); a module with this
            child is latent attention.
        q_up: the query projection (rows ``[nope | rope]`` per head): the first child present.
        kv_down: the key/value down-projection ``[c_kv | shared rotary key]``, or None.
        nope, rope, v: rows per head of the non-rotary q/k part, the rotary part, and v.
        input_norms: children normalising the latents that feed the up-projections (they act
            before the rows the clip scales).
    """

    kv_up: str
    q_up: tuple[str, ...]
    kv_down: str | None = None
    nope: Read = Read()
    rope: Read = Read()
    v: Read = Read()
    input_norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class FusedMLP:
    """A fused MLP projection (a child layer): ``order`` maps of ``size`` rows each, stacked."""

    attr: str
    order: tuple[str, ...]
    size: Read = Read()


@dataclass(frozen=True)
class StackedExperts:
    """Experts stored as 3-D stacks ``(E, out, in)`` whose module declares its layout.

    Attributes:
        transposed: flag attribute: stored ``(E, in, out)``.
        concatenated: flag attribute: the fused stack is ``[gate | up]`` per expert (else rows
            alternate gate/up).
        gated: flag attribute: the experts have a gate (``gate_up`` holds gate and up).
        gate_up: the module's parameter holding gate and up.
        bias_suffix: suffix of per-expert bias parameters ``(E, n)`` (vectors).
        size: rows of the gate (and of the up) map per expert.
    """

    transposed: str
    concatenated: str
    gated: str
    gate_up: str
    bias_suffix: str
    size: Read = Read()


@dataclass(frozen=True)
class Router:
    """A mixture-of-experts router: a child in ``attrs`` beside an ``experts`` child, with one row per expert."""

    attrs: tuple[str, ...]
    experts: str
    count: Read = Read()


@dataclass(frozen=True)
class TransposedLinear:
    """Linear layer classes storing their weight ``(in, out)``; ``out_features``: the attribute
    holding the output width (checked against the weight's columns), or None."""

    classes: tuple[str, ...]
    out_features: str | None = None


@dataclass(frozen=True)
class Adapters:
    """Adapter parameters, by the names of their pieces in a parameter's dotted name.

    Attributes:
        roles: ``(name part, role)``: a parameter whose name has the part is that role of
            `ADAPTER_ROLES`.
        copies: name parts holding trainable copies of a module, followed by the adapter's
            name (``<module>.<copies>.<adapter>.weight``).
        bases: name parts under which an additive adapter keeps the weight it wraps.
    """

    roles: tuple[tuple[str, str], ...] = ()
    copies: tuple[str, ...] = ()
    bases: tuple[str, ...] = ()


@dataclass(frozen=True)
class FamilyTable:
    """What the core knows of model families (module docstring); every field is optional.

    Attributes:
        heads: where head counts are read.
        fused_qkv: fused attention projections, per class (first matching entry wins).
        projections: separate q/k/v projection names.
        latent: multi-head latent attention.
        fused_mlp: fused MLP projections.
        experts: stacked experts that declare their layout.
        routers: mixture-of-experts routers.
        fused_names: names that say a weight stacks several maps (one of unknown layout is
            reported, left whole).
        transposed: linear layers stored ``(in, out)``.
        qk_norm_classes: attention classes that always normalise q/k after the projections.
        adapters: adapter parameters.
        output_layers: methods of a model that return its output layer.
    """

    heads: HeadCounts = HeadCounts()
    fused_qkv: tuple[FusedQKV, ...] = ()
    projections: tuple[Projections, ...] = ()
    latent: tuple[LatentAttention, ...] = ()
    fused_mlp: tuple[FusedMLP, ...] = ()
    experts: tuple[StackedExperts, ...] = ()
    routers: tuple[Router, ...] = ()
    fused_names: tuple[str, ...] = ()
    transposed: tuple[TransposedLinear, ...] = ()
    qk_norm_classes: tuple[str, ...] = ()
    adapters: Adapters = Adapters()
    output_layers: tuple[str, ...] = ()


# ------------------------------------------------------------------------------------------------
# the registry
# ------------------------------------------------------------------------------------------------

TABLES: list[FamilyTable] = []
"""The registered tables, in registration order."""


def register_families(table: FamilyTable) -> None:
    """Add ``table`` to what the core knows (registering it again is a no-op).

    Raises:
        TypeError: ``table`` is not a `FamilyTable`.
    """
    if not isinstance(table, FamilyTable):
        raise TypeError(f"register_families takes a FamilyTable, got {type(table).__name__}")
    if not any(t is table for t in TABLES):
        TABLES.append(table)


_MERGED: list[Any] = [[], FamilyTable()]  # the tables last merged, and their merge


def families() -> FamilyTable:
    """Every registered table merged into one: tuples concatenated in registration order
    (duplicates dropped), so an earlier table's entry is found first."""
    if _MERGED[0] != TABLES:  # the same tables compare by identity first: a C-level check
        merged = FamilyTable()
        for table in TABLES:
            merged = _merge(merged, table)
        _MERGED[:] = [list(TABLES), merged]
    return _MERGED[1]


def _merge(a: Any, b: Any) -> Any:
    if isinstance(a, tuple):
        return a + tuple(x for x in b if x not in a)
    return type(a)(**{f.name: _merge(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)})


# ------------------------------------------------------------------------------------------------
# the readers
# ------------------------------------------------------------------------------------------------


def class_names(module: object) -> frozenset[str]:
    """Names of ``module``'s class and of every class it derives from."""
    return _mro_names(type(module))


@cache
def _mro_names(cls: type) -> frozenset[str]:
    return frozenset(c.__name__ for c in cls.__mro__)


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
    w = getattr(module, "weight", None)
    if not isinstance(w, Tensor) or w.ndim != 2:
        return False
    names = class_names(module)
    return any(
        not names.isdisjoint(t.classes) and (t.out_features is None or getattr(module, t.out_features, w.shape[1])
                                             == w.shape[1])
        for t in families().transposed
    )


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
    """``(query heads, "name=value")`` of an attention module (`HeadCounts.heads`), or None."""
    return families().heads.heads.read(module, config)


def heads_of(module: nn.Module, config: Any) -> Heads | None:
    """The head counts of an attention module, read as `HeadCounts` states: the module's own
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
            kv = n // groups[0], groups[1]
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
    roles = dict(families().adapters.roles)
    return next((roles[part] for part in name.split(".") if part in roles), None)


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
    "ADAPTER_ROLES", "QKV", "TABLES", "Adapters", "FamilyTable", "FusedMLP", "FusedQKV", "HeadCounts", "Heads",
    "LatentAttention", "Projections", "QKVRows", "Read", "Router", "StackedExperts", "TransposedLinear",
    "adapter_role", "child_weight", "class_names", "copied_name", "families", "fused_qkv", "has_projection",
    "heads_of", "latent_attention", "normalises_qk", "output_layer", "projection", "query_heads",
    "register_families", "separate_projections", "stored_transposed", "under_adapter_base",
]
