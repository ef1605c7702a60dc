"""Model families: the table format the layers above the core fill in, and its registry.

`muonclip.param_groups` cuts a fused projection into its maps and `muonclip.MuonClip` scales
each head's rows of it; both need the same facts about a model family: which child holds which
maps in what order, where its head counts are read, which layers store their weight
``(in, out)``, which attention classes normalise q and k, what an adapter's parameters are
called. Those facts name frameworks' classes and attributes, so the core (`muonclip.optim`,
`muonclip.qkclip`, `muonclip.attention`, `muonclip.ortho`) states none of them: a layer above
describes its families in a `FamilyTable` and registers it with `register_families` (as
`muonclip.qkclip.register_discoverer` registers layer finders). The table of torch's,
transformers', peft's and muonclip's own models is `muonclip.integrations.families`, registered
when ``muonclip`` is imported. `families` merges every registered table (in registration order:
a family registered earlier wins where two describe one module), and
`muonclip.common.family_readers` turns it into what routing and the clip use, each fact read by
one function.

A class is matched by its name or the name of a class it derives from, so the core imports no
framework.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from torch import nn

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
class HeadSources:
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

    heads: HeadSources = HeadSources()
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


__all__ = [
    "ADAPTER_ROLES", "QKV", "TABLES", "Adapters", "FamilyTable", "FusedMLP", "FusedQKV", "HeadSources",
    "LatentAttention", "Projections", "Read", "Router", "StackedExperts", "TransposedLinear", "families",
    "register_families",
]
