"""Which rows of a weight are which linear map: fused projections, heads, experts, routers.

`muonclip.param_groups` calls `matrix_layouts` to learn, for each weight, how Muon should see it.
Every layout is declared by the model — a module class whose storage is known, transformers'
experts attributes, the head counts and sizes in its config — and checked against the
weight's shape; nothing is guessed from a shape alone. A weight whose name says it is fused
(``qkv_proj``, ``query_key_value``, ``gate_up_proj``, ...) but whose layout is not known here
is reported as such and left whole (pass ``split=`` to cut it).

Fused projections, split by default (``split_fused=True``): orthogonalising a stack is not
orthogonalising its parts (``orth([A; B]) != [orth(A); orth(B)]``, and the update scale would
be computed from the stacked shape), so each part is its own matrix, exactly as if the model
stored the maps as separate ``nn.Linear`` layers:

* ``qkv_proj`` of Phi-3 style attention (``Phi3Attention``, ``Phi4MultimodalAttention``):
  rows ``[q | k | v]`` = ``[n_heads * d, n_kv_heads * d, n_kv_heads * d]``.
* GPT-2's ``c_attn`` (``GPT2Attention``; a ``Conv1D`` stored ``(in, out)``): ``[q | k | v]``,
  ``hidden_size`` each (a cross-attention layer: ``[k | v]``, queries in ``q_attn``).
* GPT-NeoX's ``query_key_value`` (``GPTNeoXAttention``): interleaved per head,
  ``[h0: q k v | h1: q k v | ...]``: ``split_sizes=[d, d, d], split_groups=n_heads``.
* ``torch.nn.MultiheadAttention``'s ``in_proj_weight``: ``[q | k | v]``, ``embed_dim`` each.
* A ``gate_up_proj`` linear layer (transformers' fused gated MLP, Phi-3, GLM, ...; every one
  in transformers 5 splits its output with ``chunk(2)``): two halves of ``intermediate_size``.
* Stacked experts declared by transformers' ``use_experts_implementation`` (Mixtral,
  DeepSeek-V3, Qwen2-MoE, gpt-oss, ...): ``gate_up_proj`` ``(E, 2I, H)`` is ``[gate | up]``
  per expert (``is_concatenated``) or rows alternating gate/up (``is_concatenated=False``:
  ``split_sizes=[1, 1], split_groups=I``); ``is_transposed`` experts are stored
  ``(E, in, out)`` and get ``transposed=True``. Per-expert biases ``(E, n)`` are vectors
  (AdamW), not matrices.

Kept whole, and said so in the report:

* MoE routers (``mlp.gate.weight``/``mlp.router.weight``, ``E x H``): Muon, one matrix —
  what Moonlight (Muon for every matrix but the embedding and head), Megatron-LM (every 2-D
  non-embedding weight) and torchtitan's Kimi K2.5/Moonlight Muon recipes do.
* MLA (DeepSeek-V3): ``kv_a_proj_with_mqa`` ``[c_kv | shared rotary key]``, and
  ``q_b_proj``/``kv_b_proj`` (per head ``[nope | rope]`` / ``[k_nope | v]``) are one matrix
  each, as DeepSeek-V3, Moonlight and Kimi K2 store and train them.

Per-head orthogonalisation (``per_head=True``, off by default): each attention head's rows of
q, k and v (separate or fused projections) and of the MLA up-projections ``q_b_proj`` (or
``q_proj``) and ``kv_b_proj`` are their own matrix, with their own update scale (Kimi K3's
per-head Muon, GLM-5's "Muon Split"). Output projections (heads along columns) are not split.
The algorithm page of the documentation says when it helps.

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

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

FUSED_NAMES = ("qkv_proj", "qkv", "Wqkv", "wqkv", "query_key_value", "c_attn", "in_proj", "in_proj_weight",
               "gate_up_proj", "gate_up", "w13", "kv_proj")
"""Attribute names that say a weight stacks several maps; one whose layout is unknown is reported."""

SECTIONED_QKV = ("Phi3Attention", "Phi4MultimodalAttention")
"""Attention classes whose ``qkv_proj`` rows are ``[q | k | v]`` (read off their forward)."""

ROUTER_NAMES = ("gate", "router")


@dataclass(frozen=True)
class MatrixLayout:
    """How `param_groups` sees one weight, and why.

    Attributes:
        reason: short label for the report (``"fused qkv"``, ``"experts, fused gate|up"``,
            ``"router"``, ``"per-head"``, ``"fused? layout unknown"``, ...).
        detail: what the blocks are and where their sizes come from.
        split_sizes: row blocks (None: one matrix).
        split_groups: interleaved groups of ``split_sizes`` (see `muonclip.optim.matrices`).
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
        """The param-group keys this layout sets (``split_sizes``, ``split_groups``, ``transposed``)."""
        out: dict[str, Any] = {}
        if self.split_sizes is not None:
            out["split_sizes"] = list(self.split_sizes)
            if self.split_groups != 1:
                out["split_groups"] = self.split_groups
        if self.transposed:
            out["transposed"] = True
        return out


def matrix_layouts(model: nn.Module, *, per_head: bool = False, split_fused: bool = True) -> dict[int, MatrixLayout]:
    """The `MatrixLayout` of every weight of ``model`` that is not a plain matrix, keyed by ``id(param)``.

    Args:
        model: the model (any ``nn.Module``; transformers models are recognised by their module
            classes and configs, without importing transformers).
        per_head: one block per attention head for q/k/v and MLA up-projections (default False).
        split_fused: split known fused projections into their maps (default True). False keeps
            every fused weight whole (the layout is still reported), per-head blocks included.

    Returns:
        ``{id(param): MatrixLayout}``; weights not in it are plain matrices (or not matrices).
    """
    root_config = getattr(model, "config", None)
    found: dict[int, MatrixLayout] = {}
    for module in model.modules():
        config = getattr(module, "config", None) or root_config
        names = {c.__name__ for c in type(module).__mro__}
        for p, layout in _module_layouts(module, names, config, per_head, split_fused):
            found.setdefault(id(p), layout)
    for mname, module in model.named_modules():  # fused by name, layout not known: say so
        for attr, p in _named_weights(module):
            if attr in FUSED_NAMES and id(p) not in found and p.ndim >= 2:
                where = f"{mname}.{attr}" if mname else attr
                found[id(p)] = MatrixLayout(
                    "fused? layout unknown",
                    f"{type(module).__name__}.{attr} looks fused but muonclip does not know how it stacks its maps: "
                    f"one matrix (cut it with split={{'{where}*': [...]}})",
                )
    return found


# ------------------------------------------------------------------------------------------------
# the rules
# ------------------------------------------------------------------------------------------------


def _module_layouts(module: nn.Module, names: set[str], config: Any, per_head: bool,
                    split_fused: bool) -> Iterable[tuple[Tensor, MatrixLayout]]:
    if names & set(SECTIONED_QKV):
        yield from _sectioned_qkv(module, config, per_head, split_fused)
    elif "GPT2Attention" in names:
        yield from _gpt2_attention(module, config, per_head, split_fused)
    elif "GPTNeoXAttention" in names:
        yield from _neox_attention(module, config, per_head, split_fused)
    elif isinstance(module, nn.MultiheadAttention):
        yield from _torch_mha(module, per_head, split_fused)
    elif _weight(module, "kv_b_proj") is not None:
        yield from _mla(module, config, per_head)
    elif per_head and _weight(module, "q_proj") is not None and _weight(module, "k_proj") is not None:
        yield from _separate_qkv(module, config)
    gate_up = _weight(module, "gate_up_proj")
    if gate_up is not None:
        yield from _gated_mlp(module, gate_up, config, split_fused)
    if isinstance(getattr(module, "gate_up_proj", None), Tensor) or hasattr(module, "is_transposed"):
        yield from _experts(module, config, split_fused)
    experts = getattr(module, "experts", None)
    if isinstance(experts, nn.Module):
        yield from _router(module, experts, config)


def _sections(rows: dict[str, int]) -> str:
    return " | ".join(f"{k} {v}" for k, v in rows.items())


def _fused(p: Tensor, reason: str, parts: dict[str, int], why: str, split_fused: bool, *,
           groups: int = 1, transposed: bool = False, per_head: tuple[int, ...] | None = None) -> MatrixLayout:
    """The layout of a fused weight with ``parts`` (row counts per group, in order): split, per
    head, or kept whole, after checking the parts against the weight's matrix rows."""
    rows = p.shape[-1] if transposed else p.shape[1] if p.ndim == 3 else p.shape[0]
    sizes = tuple(parts.values())
    text = f"[{_sections(parts)}] x {groups}, interleaved" if groups > 1 else _sections(parts)
    if sum(sizes) * groups != rows:
        return MatrixLayout("fused? layout unknown", f"{rows} rows, not {text} ({why}): one matrix",
                            transposed=transposed)
    text += f" ({why})"
    if not split_fused:
        return MatrixLayout(reason, text + "; kept whole: split_fused=False", transposed=transposed)
    if per_head is not None:
        return MatrixLayout("per-head", f"{len(per_head)} blocks of {per_head[0]} rows; {text}", per_head,
                      transposed=transposed)
    return MatrixLayout(reason, text, sizes, groups, transposed=transposed)


def _with_heads(module: nn.Module, attr: str, config: Any) -> tuple[Tensor, tuple[int, int, int]] | None:
    """The weight of child ``attr`` and the module's (heads, key/value heads, head dim), or None."""
    p, heads = _weight(module, attr), _heads(module, config)
    return None if p is None or heads is None else (p, heads)


def _sectioned_qkv(module: nn.Module, config: Any, per_head: bool, split_fused: bool) -> Iterable[tuple]:
    if (found := _with_heads(module, "qkv_proj", config)) is None:
        return
    p, (nh, nkv, d) = found
    yield p, _fused(p, "fused qkv", {"q": nh * d, "k": nkv * d, "v": nkv * d},
                    f"num_attention_heads={nh}, num_key_value_heads={nkv}, head_dim={d}", split_fused,
                    per_head=(d,) * (nh + 2 * nkv) if per_head else None)


def _gpt2_attention(module: nn.Module, config: Any, per_head: bool, split_fused: bool) -> Iterable[tuple]:
    if (found := _with_heads(module, "c_attn", config)) is None:
        return
    p, (nh, _, d) = found
    transposed = _is_conv1d(module.c_attn)
    why = f"n_head={nh}, head_dim={d}" + ("; stored (in, out)" if transposed else "")
    if getattr(module, "is_cross_attention", False):  # c_attn = [k | v]; queries in q_attn
        parts, n = {"k": nh * d, "v": nh * d}, 2 * nh
        q = _weight(module, "q_attn")
        if per_head and q is not None:
            yield q, _fused(q, "per-head", {"q": nh * d}, why, split_fused, transposed=_is_conv1d(module.q_attn),
                            per_head=(d,) * nh)
    else:
        parts, n = {"q": nh * d, "k": nh * d, "v": nh * d}, 3 * nh
    yield p, _fused(p, "fused qkv", parts, why, split_fused, transposed=transposed,
                    per_head=(d,) * n if per_head else None)


def _neox_attention(module: nn.Module, config: Any, per_head: bool, split_fused: bool) -> Iterable[tuple]:
    if (found := _with_heads(module, "query_key_value", config)) is None:
        return
    p, (nh, _, d) = found
    yield p, _fused(p, "fused qkv", {"q": d, "k": d, "v": d}, f"num_attention_heads={nh}, head_size={d}",
                    split_fused, groups=nh, per_head=(d,) * (3 * nh) if per_head else None)


def _torch_mha(module: nn.MultiheadAttention, per_head: bool, split_fused: bool) -> Iterable[tuple]:
    p = module.in_proj_weight
    if not isinstance(p, Tensor):  # kdim/vdim differ: separate q/k/v_proj_weight, plain matrices
        return
    e, nh = module.embed_dim, module.num_heads
    yield p, _fused(p, "fused qkv", {"q": e, "k": e, "v": e}, f"nn.MultiheadAttention embed_dim={e}", split_fused,
                    per_head=(e // nh,) * (3 * nh) if per_head else None)


def _gated_mlp(module: nn.Module, p: Tensor, config: Any, split_fused: bool) -> Iterable[tuple]:
    inter = _first_int(module, ("intermediate_size",), config, ("intermediate_size",))
    if inter is None:
        return  # reported by name as a fused weight of unknown layout
    yield p, _fused(p, "fused gate|up", {"gate": inter, "up": inter}, f"intermediate_size={inter}", split_fused)


def _experts(module: nn.Module, config: Any, split_fused: bool) -> Iterable[tuple]:
    """transformers' stacked experts: layout declared by ``use_experts_implementation``."""
    declared = all(hasattr(module, a) for a in ("is_transposed", "is_concatenated", "has_gate"))
    if not declared:
        return
    transposed = bool(module.is_transposed)
    stored = "(E, in, out)" if transposed else "(E, out, in)"
    for attr, p in _named_weights(module):
        if p.ndim == 2 and attr.endswith("_bias"):
            yield p, MatrixLayout("vector", f"per-expert biases (E={p.shape[0]}) x {p.shape[1]}: vectors",
                                  algorithm="adamw")
        elif p.ndim != 3:
            continue
        elif attr == "gate_up_proj" and module.has_gate:
            inter = _first_int(module, ("intermediate_dim", "intermediate_size", "moe_intermediate_size"), config,
                               ("moe_intermediate_size", "intermediate_size"))
            if inter is None:
                yield p, MatrixLayout("fused? layout unknown",
                                      "experts' intermediate size not found: one matrix per expert",
                                      transposed=transposed)
                continue
            if module.is_concatenated:
                why = f"E={p.shape[0]} experts, intermediate_dim={inter}, stored {stored}"
                yield p, _fused(p, "experts, fused gate|up", {"gate": inter, "up": inter}, why, split_fused,
                                transposed=transposed)
            else:
                why = f"E={p.shape[0]} experts, rows alternate gate/up (is_concatenated=False), stored {stored}"
                yield p, _fused(p, "experts, fused gate|up", {"gate": 1, "up": 1}, why, split_fused, groups=inter,
                                transposed=transposed)
        elif transposed:
            yield p, MatrixLayout("experts", f"E={p.shape[0]} matrices, stored {stored}", transposed=True)


def _router(module: nn.Module, experts: nn.Module, config: Any) -> Iterable[tuple]:
    n = _n_experts(experts, config)
    for attr in ROUTER_NAMES:
        child = getattr(module, attr, None)
        p = getattr(child, "weight", None) if isinstance(child, nn.Module) else None
        if isinstance(p, Tensor) and p.ndim == 2 and n is not None and p.shape[0] == n:
            yield p, MatrixLayout(
                "router",
                f"E={n} x {p.shape[1]}, one matrix on Muon, as Moonlight/Kimi K2, Megatron-LM and torchtitan train "
                f"routers (adamw=['*.{attr}.weight'] moves it)",
            )


def _mla(module: nn.Module, config: Any, per_head: bool) -> Iterable[tuple]:
    nh = _n_heads(module, config)
    nope = _first_int(module, ("qk_nope_head_dim", "nope"), config, ("qk_nope_head_dim",))
    rope = _first_int(module, ("qk_rope_head_dim", "rope"), config, ("qk_rope_head_dim",))
    v = _first_int(module, ("v_head_dim", "v_dim"), config, ("v_head_dim",))
    if None in (nh, nope, rope, v):
        return
    kv_a = _weight(module, "kv_a_proj_with_mqa")
    if kv_a is not None:
        yield kv_a, MatrixLayout("MLA", f"[c_kv {kv_a.shape[0] - rope} | shared rotary key {rope}]: one matrix, as "
                                  "DeepSeek-V3, Moonlight and Kimi K2 train it (split= cuts it)")
    q = _weight(module, "q_b_proj")
    if q is None:
        q = _weight(module, "q_proj")
    for p, parts in ((q, f"q_nope {nope} | q_rope {rope}"), (_weight(module, "kv_b_proj"), f"k_nope {nope} | v {v}")):
        if p is None:
            continue
        d = p.shape[0] // nh
        if per_head and d * nh == p.shape[0]:
            yield p, MatrixLayout("per-head", f"{nh} blocks of {d} rows, one per head [{parts}]", (d,) * nh)
        else:
            yield p, MatrixLayout("MLA", f"{nh} heads x [{parts}]: one matrix, as DeepSeek-V3, Moonlight and Kimi K2 "
                                         "train it (per_head=True: one block per head)")


def _separate_qkv(module: nn.Module, config: Any) -> Iterable[tuple]:
    heads = _heads(module, config)
    if heads is None:
        return
    nh, nkv, _ = heads
    for attr, n in (("q_proj", nh), ("k_proj", nkv), ("v_proj", nkv)):
        p = _weight(module, attr)
        if p is None:
            continue
        if p.shape[0] % n:
            yield p, MatrixLayout("hidden matrix",
                                  f"per_head: {p.shape[0]} rows do not split into {n} heads: one matrix")
        else:
            d = p.shape[0] // n
            yield p, MatrixLayout("per-head", f"{n} blocks of {d} rows, one per head", (d,) * n)


# ------------------------------------------------------------------------------------------------
# reading modules and configs
# ------------------------------------------------------------------------------------------------


def _weight(module: nn.Module, attr: str) -> Tensor | None:
    """The weight of child ``attr`` (a Linear/Conv1D-like layer with a 2-D weight), or None."""
    child = getattr(module, attr, None)
    p = getattr(child, "weight", None) if isinstance(child, nn.Module) else None
    return p if isinstance(p, Tensor) and p.ndim == 2 else None


def _named_weights(module: nn.Module) -> Iterable[tuple[str, Tensor]]:
    """``(attr, param)`` of ``module``'s own parameters, and of its children's ``weight`` under
    the child's name (``qkv_proj`` for ``qkv_proj.weight``)."""
    for attr, p in module.named_parameters(recurse=False):
        yield attr, p
    for attr, child in module.named_children():
        p = getattr(child, "weight", None)
        if isinstance(p, nn.Parameter):
            yield attr, p


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D"


def _first_int(module: nn.Module, attrs: tuple[str, ...], config: Any, keys: tuple[str, ...]) -> int | None:
    for a in attrs:
        v = getattr(module, a, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    for k in keys:
        v = getattr(config, k, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _n_heads(module: nn.Module, config: Any) -> int | None:
    return _first_int(module, ("num_heads", "n_head", "num_attention_heads"), config, ("num_attention_heads",))


def _heads(module: nn.Module, config: Any) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head dim) from the module's attributes or its config."""
    nh = _n_heads(module, config)
    if nh is None:
        return None
    nkv = _first_int(module, ("num_key_value_heads", "n_kv_head"), config, ("num_key_value_heads",)) or nh
    d = _first_int(module, ("head_dim", "head_size"), config, ("head_dim",))
    if d is None:
        hidden = getattr(config, "hidden_size", None)
        if not isinstance(hidden, int) or hidden % nh:
            return None
        d = hidden // nh
    return nh, nkv, d


def _n_experts(experts: nn.Module, config: Any) -> int | None:
    if isinstance(experts, nn.ModuleList):
        return len(experts)
    n = _first_int(experts, ("num_experts",), config, ("num_local_experts", "num_experts", "n_routed_experts"))
    if n is None and isinstance(getattr(experts, "gate_up_proj", None), Tensor):
        n = experts.gate_up_proj.shape[0]
    return n


__all__ = ["FUSED_NAMES", "SECTIONED_QKV", "MatrixLayout", "matrix_layouts"]
