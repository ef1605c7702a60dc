"""Which rows of a weight are which linear map: fused projections, heads, experts, routers.

`muonclip.param_groups` calls `weight_splits` to learn, for each weight, how Muon should see it.
Every layout is declared by the model's family, as the registered family table states it
(`muonclip.common.families`; the table itself, with every family it knows, is
`muonclip.integrations.families`): a module class whose storage is known, declared experts,
the head counts and sizes the module or its config holds, checked against the weight's shape;
nothing is guessed from a shape alone. A weight whose name says it is fused (the table's
``fused_names``: ``qkv_proj``, ``query_key_value``, ``gate_up_proj``, ...) but whose layout is
not known is reported as such and left whole (pass ``split=`` to cut it).

Fused projections, split by default (``split_fused=True``): orthogonalising a stack is not
orthogonalising its parts (``orth([A; B]) != [orth(A); orth(B)]``, and the update scale would
be computed from the stacked shape), so each part is its own matrix, exactly as if the model
stored the maps as separate linear layers:

* A fused attention projection (`muonclip.common.family_readers.fused_qkv`): its q, k and v maps,
  ``split_sizes`` the rows of each map in one group and ``split_groups`` the groups (q, k, v
  interleaved per head or per partition), ``transposed`` for a layer stored ``(in, out)``.
  The clip's rows of q and k (`muonclip.integrations.hf_layouts`) come from the same
  `muonclip.common.family_readers.QKVRows`, so a map the clip scales is one matrix here.
* A fused MLP projection (`muonclip.common.families.FusedMLP`): ``[gate | up]``.
* Stacked experts that declare their layout (`muonclip.common.families.StackedExperts`):
  ``gate_up`` ``(E, 2I, H)`` is ``[gate | up]`` per expert, or rows alternating gate/up
  (``split_sizes=[1, 1], split_groups=I``); experts stored ``(E, in, out)`` get
  ``transposed=True``. Per-expert biases ``(E, n)`` are vectors (AdamW), not matrices.

Kept whole, and said so in the report:

* MoE routers (`muonclip.common.families.Router`, ``E x H``): Muon, one matrix — what Moonlight
  (Muon for every matrix but the embedding and head), Megatron-LM (every 2-D non-embedding
  weight) and torchtitan's Kimi K2.5/Moonlight Muon recipes do.
* Multi-head latent attention (`muonclip.common.families.LatentAttention`): the key/value
  down-projection ``[c_kv | shared rotary key]`` and the up-projections (per head ``[nope |
  rope]`` / ``[k_nope | v]``) are one matrix each, as DeepSeek-V3, Moonlight and Kimi K2 store
  and train them.

Per-head orthogonalisation (``per_head=True``, off by default): each attention head's rows of
q, k and v (separate or fused projections) and of the latent attention's up-projections are
their own matrix, with their own update scale (Kimi K3's per-head Muon, GLM-5's "Muon Split").
Output projections (heads along columns) are not split. The algorithm page of the
documentation says when it helps.

References:
    Megatron-LM ``megatron/core/optimizer`` (Muon splits fused QKV by default,
    ``--muon-split-qkv``; every 2-D non-embedding weight, the router included, on Muon).
    microsoft/dion (``split_sizes``; per-head ``num_heads``). pytorch/torchtitan
    ``torchtitan/models/kimi_k2_7/config_registry.py`` (Moonlight/Kimi K2.5 Muon recipes:
    per-head MLA up-projections, router on Muon). MoonshotAI/Moonlight
    ``examples/toy_train.py``. Kimi K3, arXiv 2607.24653, section 2.5 (per-head Muon). GLM-5,
    arXiv 2602.15763 (Muon Split).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

from ..common.families import FamilyTable, LatentAttention, Read, families
from ..common.family_readers import (
    QKVRows,
    child_weight,
    class_names,
    fused_qkv,
    heads_of,
    lacks,
    latent_attention,
    projection,
    query_heads,
    separate_projections,
)


@dataclass(frozen=True)
class WeightSplit:
    """How `param_groups` sees one weight, and why.

    Attributes:
        reason: short label for the report (``"fused qkv"``, ``"experts, fused gate|up"``,
            ``"router"``, ``"per-head"``, ``"fused? layout unknown"``, ...).
        detail: what the blocks are and where their sizes come from.
        split_sizes: row blocks (None: one matrix).
        split_groups: interleaved groups of ``split_sizes`` (see `muonclip.optim._matrices`).
        transposed: stored ``(in, out)`` / ``(E, in, out)``.
        algorithm: ``"adamw"`` to send the weight to AdamW (per-expert biases); None: the
            usual rule (Muon for a matrix).
    """

    reason: str
    detail: str = ""
    split_sizes: tuple[int, ...] | None = None
    split_groups: int = 1
    transposed: bool = False
    algorithm: str | None = None

    def options(self) -> dict[str, Any]:
        """The param-group keys this split sets (``split_sizes``, ``split_groups``, ``transposed``)."""
        out: dict[str, Any] = {}
        if self.split_sizes is not None:
            out["split_sizes"] = list(self.split_sizes)
            if self.split_groups != 1:
                out["split_groups"] = self.split_groups
        if self.transposed:
            out["transposed"] = True
        return out


def weight_splits(model: nn.Module, *, per_head: bool = False, split_fused: bool = True,
                  named: Sequence[tuple[str, nn.Module]] | None = None) -> dict[int, WeightSplit]:
    """The `WeightSplit` of every weight of ``model`` that is not a plain matrix, keyed by ``id(param)``.

    Args:
        model: the model (any ``nn.Module``; its families are recognised by the registered family
            table, `muonclip.common.families`, by class names and attributes: no framework is
            imported).
        per_head: one block per attention head for q/k/v and latent-attention up-projections
            (default False).
        split_fused: split known fused projections into their maps (default True). False keeps
            every fused weight whole (the split is still reported), per-head blocks included.
        named: ``model.named_modules()``, when the caller has walked it already (default None:
            walked here).

    Returns:
        ``{id(param): WeightSplit}``; weights not in it are plain matrices (or not matrices).
    """
    named = list(model.named_modules()) if named is None else named
    root_config = getattr(model, "config", None)
    table = families()
    fused_classes = frozenset(c for f in table.fused_qkv for c in f.classes)
    gates = _gates(table)
    found: dict[int, WeightSplit] = {}
    for _, module in named:
        qkv = not class_names(module).isdisjoint(fused_classes)  # fused_qkv matches by class first
        if not qkv and lacks(module, gates):
            continue
        config = getattr(module, "config", None) or root_config
        for p, split in _module_splits(module, config, per_head, split_fused, qkv):
            found.setdefault(id(p), split)
    fused_names = frozenset(table.fused_names)
    for mname, module in named:  # fused by name, layout not known: say so
        if fused_names.isdisjoint(module._parameters) and fused_names.isdisjoint(module._modules):
            continue  # _named_weights names only these
        for attr, p in _named_weights(module):
            if attr in fused_names and id(p) not in found and p.ndim >= 2:
                where = f"{mname}.{attr}" if mname else attr
                found[id(p)] = WeightSplit(
                    "fused? layout unknown",
                    f"{type(module).__name__}.{attr} looks fused but muonclip does not know how it stacks its maps: "
                    f"one matrix (cut it with split={{'{where}*': [...]}})",
                )
    return found


# ------------------------------------------------------------------------------------------------
# the rules
# ------------------------------------------------------------------------------------------------


def _module_splits(module: nn.Module, config: Any, per_head: bool, split_fused: bool,
                   qkv: bool = True) -> Iterable[tuple[Tensor, WeightSplit]]:
    """The rules, on one module (``qkv``: False when its class is none `fused_qkv` knows)."""
    rows = fused_qkv(module, config) if qkv else None
    latent = latent_attention(module)
    if rows is not None:
        yield from _fused_attention(module, rows, per_head, split_fused)
    elif latent is not None:
        yield from _mla(module, latent, config, per_head)
    elif per_head:
        yield from _separate_qkv(module, config)
    yield from _gated_mlp(module, config, split_fused)
    yield from _experts(module, config, split_fused)
    yield from _router(module, config)


def _gates(table: FamilyTable) -> frozenset[str]:
    """The attributes the rules other than `fused_qkv` look up first, one of which a module must have
    for any of them to match: `_mla`'s key/value up-projection, `_separate_qkv`'s q and k, `_gated_mlp`'s
    fused projection, `_experts`' flags, `_router`'s experts. `weight_splits` skips a module that `lacks`
    them all: a rule that tests another attribute first adds it here."""
    return frozenset([*(m.kv_up for m in table.latent), *(n for p in table.projections for n in (p.q, p.k)),
                      *(m.attr for m in table.fused_mlp),
                      *(n for e in table.experts for n in (e.transposed, e.concatenated, e.gated)),
                      *(r.experts for r in table.routers)])


def _sections(rows: dict[str, int]) -> str:
    return " | ".join(f"{k} {v}" for k, v in rows.items())


def _fused(p: Tensor, reason: str, parts: dict[str, int], why: str, split_fused: bool, *,
           groups: int = 1, transposed: bool = False, per_head: tuple[int, ...] | None = None) -> WeightSplit:
    """The split of a fused weight with ``parts`` (row counts per group, in order): split, per
    head, or kept whole, after checking the parts against the weight's matrix rows."""
    rows = p.shape[-1] if transposed else p.shape[1] if p.ndim == 3 else p.shape[0]
    sizes = tuple(parts.values())
    text = f"[{_sections(parts)}] x {groups}, interleaved" if groups > 1 else _sections(parts)
    if sum(sizes) * groups != rows:
        return WeightSplit("fused? layout unknown", f"{rows} rows, not {text} ({why}): one matrix",
                            transposed=transposed)
    text += f" ({why})"
    if not split_fused:
        return WeightSplit(reason, text + "; kept whole: split_fused=False", transposed=transposed)
    if per_head is not None:
        return WeightSplit("per-head", f"{len(per_head)} blocks of {per_head[0]} rows; {text}", per_head,
                            transposed=transposed)
    return WeightSplit(reason, text, sizes, groups, transposed=transposed)


def _fused_attention(module: nn.Module, rows: QKVRows, per_head: bool, split_fused: bool) -> Iterable[tuple]:
    """A fused attention projection: its maps as `rows` states them (the clip's rows of q and k
    come from the same `QKVRows`)."""
    fused = rows.fused
    found = projection(module, fused.attr)
    if found is None:
        return
    p, _, transposed = found
    stored = "; stored (in, out)" if transposed else ""
    problem = rows.error(p.shape[1] if transposed else p.shape[0])
    if problem is not None:
        yield p, WeightSplit("fused? layout unknown",
                              f"{type(module).__name__}.{fused.attr} {problem}{stored}: one matrix",
                              transposed=transposed)
        return
    heads = rows.heads
    why = heads.source + stored
    blocks = rows.per_head() if per_head else None
    yield p, _fused(p, "fused qkv", dict(zip(fused.order, rows.sizes)), why, split_fused, groups=rows.groups,
                    transposed=transposed, per_head=blocks)
    query = projection(module, fused.query) if fused.query is not None and per_head else None
    if query is not None:  # a cross-attention's separate queries
        q, _, q_transposed = query
        yield q, _fused(q, "per-head", {"q": heads.n_heads * heads.head_dim}, why, split_fused,
                        transposed=q_transposed, per_head=(heads.head_dim,) * heads.n_heads)


def _gated_mlp(module: nn.Module, config: Any, split_fused: bool) -> Iterable[tuple]:
    for mlp in families().fused_mlp:
        p = child_weight(module, mlp.attr)
        if p is None:
            continue
        size = mlp.size.read(module, config)
        if size is None:
            return  # reported by name as a fused weight of unknown layout
        yield p, _fused(p, "fused " + "|".join(mlp.order), dict.fromkeys(mlp.order, size[0]), size[1], split_fused)
        return


def _experts(module: nn.Module, config: Any, split_fused: bool) -> Iterable[tuple]:
    """Stacked experts whose module declares their layout (`muonclip.common.families.StackedExperts`)."""
    for spec in families().experts:
        if not all(hasattr(module, a) for a in (spec.transposed, spec.concatenated, spec.gated)):
            continue
        transposed = bool(getattr(module, spec.transposed))
        stored = "(E, in, out)" if transposed else "(E, out, in)"
        for attr, p in _named_weights(module):
            if p.ndim == 2 and attr.endswith(spec.bias_suffix):
                yield p, WeightSplit("vector", f"per-expert biases (E={p.shape[0]}) x {p.shape[1]}: vectors",
                                      algorithm="adamw")
            elif p.ndim != 3:
                continue
            elif attr == spec.gate_up and getattr(module, spec.gated):
                size = spec.size.read(module, config)
                if size is None:
                    yield p, WeightSplit("fused? layout unknown",
                                          "experts' intermediate size not found: one matrix per expert",
                                          transposed=transposed)
                    continue
                inter = size[0]
                if getattr(module, spec.concatenated):
                    why = f"E={p.shape[0]} experts, {size[1]}, stored {stored}"
                    yield p, _fused(p, "experts, fused gate|up", {"gate": inter, "up": inter}, why, split_fused,
                                    transposed=transposed)
                else:
                    why = f"E={p.shape[0]} experts, rows alternate gate/up ({spec.concatenated}=False), stored {stored}"
                    yield p, _fused(p, "experts, fused gate|up", {"gate": 1, "up": 1}, why, split_fused,
                                    groups=inter, transposed=transposed)
            elif transposed:
                yield p, WeightSplit("experts", f"E={p.shape[0]} matrices, stored {stored}", transposed=True)
        return


def _router(module: nn.Module, config: Any) -> Iterable[tuple]:
    for spec in families().routers:
        experts = getattr(module, spec.experts, None)
        if not isinstance(experts, nn.Module):
            continue
        n = _n_experts(experts, spec.count, config)
        for attr in spec.attrs:
            p = child_weight(module, attr)
            if p is not None and n is not None and p.shape[0] == n:
                yield p, WeightSplit(
                    "router",
                    f"E={n} x {p.shape[1]}, one matrix on Muon, as Moonlight/Kimi K2, Megatron-LM and torchtitan "
                    f"train routers (adamw=['*.{attr}.weight'] moves it)",
                )
        return


def _mla(module: nn.Module, latent: LatentAttention, config: Any, per_head: bool) -> Iterable[tuple]:
    found = query_heads(module, config)
    sizes = [r.read(module, config) for r in (latent.nope, latent.rope, latent.v)]
    if found is None or None in sizes:
        return
    nh = found[0]
    nope, rope, v = (s[0] for s in sizes)
    kv_a = child_weight(module, latent.kv_down) if latent.kv_down is not None else None
    if kv_a is not None:
        yield kv_a, WeightSplit("MLA", f"[c_kv {kv_a.shape[0] - rope} | shared rotary key {rope}]: one matrix, as "
                                  "DeepSeek-V3, Moonlight and Kimi K2 train it (split= cuts it)")
    q = next((w for w in (child_weight(module, a) for a in latent.q_up) if w is not None), None)
    kv = child_weight(module, latent.kv_up)
    for p, parts in ((q, f"q_nope {nope} | q_rope {rope}"), (kv, f"k_nope {nope} | v {v}")):
        if p is None:
            continue
        d = p.shape[0] // nh
        if per_head and d * nh == p.shape[0]:
            yield p, WeightSplit("per-head", f"{nh} blocks of {d} rows, one per head [{parts}]", (d,) * nh)
        else:
            yield p, WeightSplit("MLA", f"{nh} heads x [{parts}]: one matrix, as DeepSeek-V3, Moonlight and Kimi K2 "
                                         "train it (per_head=True: one block per head)")


def _separate_qkv(module: nn.Module, config: Any) -> Iterable[tuple]:
    names = separate_projections(module)
    if names is None or child_weight(module, names.q) is None or child_weight(module, names.k) is None:
        return
    heads = heads_of(module, config)
    if heads is None:
        return
    for attr, n in ((names.q, heads.n_heads), (names.k, heads.n_kv_heads), (names.v, heads.n_kv_heads)):
        p = child_weight(module, attr)
        if p is None:
            continue
        if p.shape[0] % n:
            yield p, WeightSplit("hidden matrix",
                                  f"per_head: {p.shape[0]} rows do not split into {n} heads: one matrix")
        else:
            d = p.shape[0] // n
            yield p, WeightSplit("per-head", f"{n} blocks of {d} rows, one per head", (d,) * n)


# ------------------------------------------------------------------------------------------------
# reading modules
# ------------------------------------------------------------------------------------------------


def _named_weights(module: nn.Module) -> Iterable[tuple[str, Tensor]]:
    """``(attr, param)`` of ``module``'s own parameters, and of its children's ``weight`` under
    the child's name (``qkv_proj`` for ``qkv_proj.weight``)."""
    seen: set[int] = set()
    for attr, p in module._parameters.items():  # what named_parameters(recurse=False) gives
        if p is not None and id(p) not in seen:
            seen.add(id(p))
            yield attr, p
    for attr, child in module._modules.items():  # what named_children() gives
        if child is None or id(child) in seen:
            continue
        seen.add(id(child))
        p = getattr(child, "weight", None)
        if isinstance(p, nn.Parameter):
            yield attr, p


def _n_experts(experts: nn.Module, count: Read, config: Any) -> int | None:
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    found = count.read(experts, config)
    if found is not None:
        return found[0]
    for spec in families().experts:
        stack = getattr(experts, spec.gate_up, None)
        if isinstance(stack, Tensor):
            return stack.shape[0]
    return None


__all__ = ["WeightSplit", "weight_splits"]
