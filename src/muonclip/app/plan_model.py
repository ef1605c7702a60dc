"""The model of ``muonclip plan``: built on the meta device (shapes only, no weights), routed by the optimizer.

A model is named by one of (`load_model`):

* a built-in shape, from its published configuration (`BUILTINS`): ``kimi-k2``, ``deepseek-v3``
  (transformers' ``DeepseekV3Config``), ``llama3-8b``, ``llama3-70b`` (``LlamaConfig``);
* ``preset:NAME``: the reference GPT of one of the app's presets (`muonclip.app.config.PRESETS`);
* ``torchtitan:NAME``: the model of one of torchtitan's config functions (``llama3_8b``,
  ``deepseek_v3_debugmodel``, ...);
* a path to a Hugging Face ``config.json`` (or a folder holding one).

The model is then routed exactly as a run routes it: ``MuonClip(model)`` (its param groups are
`muonclip.param_groups`' with every default of `muonclip.Muon` filled in, and its attention layers
are the ones the clip reduces over); a model the clip refuses is planned for Muon alone
(``Muon(param_groups(model))``), with the reason. Each weight (`Weight`) keeps its param group,
its transformer layer (for the pipeline split), whether it is a stack of routed experts, and its
tensor-parallel role: the model's own plan (transformers' ``base_model_tp_plan``) where it has
one, else Megatron's convention by name (`TP_ROLES`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..optim._matrices import MatrixSpec, matrix_spec

# Published configurations (the fields of transformers' config classes).
_MLA = dict(hidden_size=7168, num_hidden_layers=61, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432, moe_intermediate_size=2048,
            num_experts_per_tok=8, n_shared_experts=1)
BUILTINS: dict[str, tuple[str, dict[str, Any], str]] = {
    "kimi-k2": ("DeepseekV3Config", dict(_MLA, num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
                                         first_k_dense_replace=1, vocab_size=163840, n_group=1, topk_group=1),
                "Kimi K2 (moonshotai/Kimi-K2-Base config.json; arXiv 2507.20534)"),
    "deepseek-v3": ("DeepseekV3Config", dict(_MLA, num_attention_heads=128, num_key_value_heads=128,
                                             n_routed_experts=256, first_k_dense_replace=3, vocab_size=129280,
                                             n_group=8, topk_group=4),
                    "DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; arXiv 2412.19437)"),
    "llama3-8b": ("LlamaConfig", dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                      tie_word_embeddings=False),
                  "Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json)"),
    "llama3-70b": ("LlamaConfig", dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                                       num_key_value_heads=8, intermediate_size=28672, vocab_size=128256,
                                       tie_word_embeddings=False),
                   "Llama 3 70B (meta-llama/Meta-Llama-3-70B config.json)"),
}

TP_ROLES: tuple[tuple[str, str], ...] = (
    (r"(q|k|v|q_b|kv_b|gate|up|qkv|gate_up)_proj$|\.(c_fc|c_attn|w1|w3|wq|wk|wv|wkv_b|wqkv|query_key_value)$",
     "colwise"),
    (r"(o|down|out)_proj$|\.(c_proj|w2|wo|dense)$", "rowwise"),
)
"""Tensor-parallel roles by module name when the model has no plan of its own (Megatron's
convention, torchtitan's and the reference GPT's plans): column-parallel weights are split by
output rows (``Shard(0)``), row-parallel ones by input columns (``Shard(1)``); anything else is
replicated over the tensor-parallel ranks (MLA's down-projections, routers, norms, embeddings)."""

_LAYER = re.compile(r"(?:^|\.)(?:layers|blocks|h|layer)\.(\d+)\.")


class ModelError(ValueError):
    """A model that cannot be planned: a name that is none of the accepted forms, or a config
    that transformers or torchtitan cannot build."""


@dataclass(frozen=True)
class Weight:
    """One parameter as the plan sees it.

    Attributes:
        name: its name in the model.
        shape: its global shape.
        group: its param group in the optimizer (every option filled in).
        muon: orthogonalised (a Muon group) or element-wise (the AdamW branch).
        spec: its `muonclip.optim._matrices.MatrixSpec` (Muon weights only).
        layer: its transformer layer, or None (embeddings, final norm, head).
        after_layers: for ``layer`` None: it comes after the layers in the model (the head).
        expert: a stack of routed experts ``(E, ...)``.
        tp: ``"colwise"``, ``"rowwise"`` or ``"replicate"``.
    """

    name: str
    shape: tuple[int, ...]
    group: dict[str, Any] = field(repr=False, compare=False)
    muon: bool
    spec: MatrixSpec | None
    layer: int | None
    after_layers: bool
    expert: bool
    tp: str

    @property
    def numel(self) -> int:
        """Its elements."""
        return math.prod(self.shape)


@dataclass
class PlanModel:
    """A model routed for the plan.

    Attributes:
        name, source: what was asked and what it is (e.g. the published config it follows).
        weights: every parameter, Muon ones first in the optimizer's order (the order of its
            param groups, then of each group's parameters: the order the step plans in).
        n_layers: transformer layers.
        heads: ``(layer, heads)`` of every attention layer the clip reduces (None: the clip does
            not apply, ``clip_note`` says why).
        clip_note: why MuonClip is not planned, or "".
        active_params: parameters one token goes through (routed experts counted at
            ``experts_per_token / experts``; the input embedding left out unless tied).
        attention: ``(layers, heads, qk_dim, v_dim)`` of the attention products (None: unknown).
    """

    name: str
    source: str
    weights: list[Weight]
    n_layers: int
    heads: list[tuple[int, int]] | None
    clip_note: str
    active_params: int
    attention: tuple[int, int, int, int] | None

    @property
    def total_params(self) -> int:
        """Every parameter's elements."""
        return sum(w.numel for w in self.weights)


def _hf_model(cls_name: str, fields: dict[str, Any]) -> tuple[nn.Module, Any]:
    try:
        import transformers
    except ImportError:
        raise ModelError('this model needs transformers, which is not installed: pip install "muonclip[hf]"') from None
    cls = getattr(transformers, cls_name, None) if cls_name else None
    try:
        config = cls(**fields) if cls is not None else transformers.AutoConfig.for_model(**fields)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
    except (ValueError, TypeError, KeyError) as e:
        raise ModelError(f"transformers cannot build this config ({type(e).__name__}: {e})") from None
    return model, config


def _config_file(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise ModelError(f"{path}: no such config.json (give a Hugging Face config.json or the folder holding one)")
    try:
        fields = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelError(f"{file}: not a readable JSON config ({e})") from None
    if not isinstance(fields, dict) or "model_type" not in fields:
        raise ModelError(f"{file}: a Hugging Face config.json is a JSON object with a model_type")
    return fields


@dataclass(frozen=True)
class TorchtitanRun:
    """The trainer config of a torchtitan model as a run trains it (`with_muonclip`'s: recording
    attention, MuonClip's container): the plan builds its optimizer as that run's container does."""

    config: Any


def _torchtitan_model(name: str) -> tuple[nn.Module, TorchtitanRun]:
    try:
        from muonclip.integrations import torchtitan as tt
    except ImportError:
        raise ModelError('this model needs torchtitan, which is not installed: pip install "muonclip[torchtitan]"'
                         ) from None
    try:
        cfg = getattr(tt, name)()
    except AttributeError:
        raise ModelError(f"torchtitan has no config function {name!r} (e.g. torchtitan:llama3_8b, "
                         "torchtitan:deepseek_v3_debugmodel)") from None
    cfg = tt.with_muonclip(cfg, device_type="cuda")  # the attention a GPU run records with; built on meta
    model_config = cfg.model_spec.model
    model_config.update_from_config(config=cfg)
    with torch.device("meta"):
        return model_config.build(), TorchtitanRun(cfg)


def _preset_model(name: str, sets: list[str]) -> nn.Module:
    from ..models import GPT
    from .config import PRESETS, make_config, model_config

    if name not in PRESETS:
        raise ModelError(f"no preset {name!r}; the presets are {', '.join(sorted(PRESETS))}")
    cfg = make_config(name, None, sets)
    with torch.device("meta"):
        return GPT(model_config(cfg))


def build(name: str, sets: list[str] | None = None) -> tuple[nn.Module, str, Any]:
    """The model named ``name`` on the meta device, a line saying what it is, and its config
    (None for torchtitan's and the app's models). See the module docstring for the forms."""
    if name in BUILTINS:
        cls_name, fields, source = BUILTINS[name]
        model, config = _hf_model(cls_name, fields)
        return model, source, config
    if sets:
        if not name.startswith("preset:"):
            raise ModelError("--set changes a preset's model; use it with preset:NAME")
    if name.startswith("preset:"):
        return _preset_model(name[len("preset:"):], sets or []), f"the reference GPT of the {name[7:]} preset", None
    if name.startswith("torchtitan:"):
        model, run = _torchtitan_model(name[len("torchtitan:"):])
        return model, f"torchtitan's {name[11:]}", run
    path = Path(name)
    if not path.exists():
        raise ModelError(f"{name!r} is not a model: give a built-in ({', '.join(BUILTINS)}), preset:NAME, "
                         "torchtitan:NAME or the path of a Hugging Face config.json")
    fields = _config_file(path)
    model, config = _hf_model("", fields)
    return model, f"{fields['model_type']} from {path}", config


def _optimizer(model: nn.Module, config: Any) -> tuple[Any, list[tuple[int, int]] | None, str]:
    """The optimizer a run would build (MuonClip, else Muon), its attention layers and a note: for a
    torchtitan model (``config`` a `TorchtitanRun`) the run's container's (`MuonClipOptimizers`)."""
    from ..optim import Muon, param_groups
    from ..qkclip import MuonClip

    if isinstance(config, TorchtitanRun):
        from dataclasses import replace

        from ..integrations.torchtitan import MuonClipOptimizers

        def build(name: str) -> Any:
            return MuonClipOptimizers(replace(config.config.optimizer, name=name), model_parts=[model]).optimizers[0]
    else:
        def build(name: str) -> Any:
            return MuonClip(model) if name == "MuonClip" else Muon(param_groups(model))
    try:
        opt = build("MuonClip")
    except (ValueError, TypeError) as e:
        return build("Muon"), None, f"MuonClip does not apply to this model ({e})"
    heads = []
    for layer in opt.layers:
        m = _LAYER.search(layer.name + ".")
        heads.append((int(m.group(1)) if m else -1, layer.recorder.n_heads))
    return opt, heads, ""


def _tp_roles(config: Any) -> list[tuple[re.Pattern[str], str]]:
    plan = getattr(config, "base_model_tp_plan", None) or {}
    roles = []
    for pattern, style in plan.items():
        role = "colwise" if "colwise" in style else "rowwise" if "rowwise" in style else None
        if role is not None:
            rx = re.escape(pattern).replace(r"\*", r"\d+")
            roles.append((re.compile(rf"(?:^|\.){rx}(?:\.weight)?$"), role))
    return roles


def _role(name: str, plan: list[tuple[re.Pattern[str], str]]) -> str:
    if plan:
        return next((role for rx, role in plan if rx.search(name)), "replicate")
    module = name.rsplit(".", 1)[0] if name.endswith((".weight", ".bias")) else name
    return next((role for rx, role in TP_ROLES if re.search(rx, module)), "replicate")


def _experts_per_token(config: Any, model: nn.Module) -> int | None:
    for key in ("num_experts_per_tok", "n_expert_active", "top_k"):
        value = getattr(config, key, None) or getattr(getattr(model, "config", None), key, None)
        if isinstance(value, int):
            return value
    for m in model.modules():
        k = getattr(m, "top_k", None)
        if isinstance(k, int):
            return k
    return None


def _attention(config: Any, model: nn.Module, n_layers: int) -> tuple[int, int, int, int] | None:
    if isinstance(config, TorchtitanRun):  # heads are per layer in torchtitan's configs: read the first one
        from ..integrations.torchtitan_layouts import attention_modules, attention_sizes

        found = attention_modules(model)
        return (n_layers, *attention_sizes(found[0][1])) if found else None
    c = config if config is not None else getattr(model, "config", None)
    if c is None:
        return None
    heads = getattr(c, "num_attention_heads", None) or getattr(c, "n_head", None) or getattr(c, "n_heads", None)
    width = getattr(c, "hidden_size", None) or getattr(c, "n_embd", None) or getattr(c, "dim", None)
    if not isinstance(heads, int) or not isinstance(width, int):
        return None
    qk = getattr(c, "qk_head_dim", None) or getattr(c, "head_dim", None) or width // heads
    v = getattr(c, "v_head_dim", None) or getattr(c, "head_dim", None) or width // heads
    return n_layers, heads, int(qk), int(v)


def load_model(name: str, sets: list[str] | None = None) -> PlanModel:
    """The model ``name`` built on the meta device and routed by the optimizer a run builds.

    Raises:
        ModelError: a name of none of the accepted forms, or a config that cannot be built.
    """
    model, source, config = build(name, sets)
    return route(model, name, source, config)


def route(model: nn.Module, name: str = "model", source: str = "", config: Any = None) -> PlanModel:
    """``model`` (on any device; only shapes are read) routed by the optimizer a run builds
    (``MuonClip(model)``, else ``Muon(param_groups(model))``); ``config``: its transformers config
    (its tensor-parallel plan, experts per token, attention sizes), or the `TorchtitanRun` of a
    torchtitan model (its optimizer built as that run's container builds it), if any."""
    opt, heads, note = _optimizer(model, config)
    names = {id(p): n for n, p in model.named_parameters()}
    order = {n: i for i, n in enumerate(names.values())}
    first_layer = min((order[n] for n in order if _LAYER.search(n)), default=0)
    plan = _tp_roles(config)
    weights: list[Weight] = []
    for muon in (True, False):
        for g in opt.param_groups:
            if (g["algorithm"] == "muon") != muon:
                continue
            for p in g["params"]:
                n = names[id(p)]
                m = _LAYER.search(n)
                spec = matrix_spec(p.shape, g) if muon else None
                weights.append(Weight(n, tuple(p.shape), g, muon, spec, int(m.group(1)) if m else None,
                                      m is None and order[n] > first_layer, bool(spec and spec.experts),
                                      _role(n, plan)))
    n_experts = {w.shape[0] for w in weights if w.expert}
    if len(n_experts) == 1:  # the experts' per-expert vectors (biases) are split like the stacks
        e = n_experts.pop()
        weights = [w if w.expert or ".experts." not in f".{w.name}" or w.shape[:1] != (e,)
                   else Weight(w.name, w.shape, w.group, w.muon, w.spec, w.layer, w.after_layers, True, w.tp)
                   for w in weights]
    n_layers = 1 + max((w.layer for w in weights if w.layer is not None), default=-1)
    k = _experts_per_token(config, model)
    active = 0
    tied = sum(1 for _ in model.named_parameters(remove_duplicate=False)) > len(names)
    for w in weights:
        if w.expert:
            active += w.numel * (k or w.shape[0]) // w.shape[0]
        elif w.layer is None and not w.after_layers and len(w.shape) == 2 and not tied:
            continue  # the input embedding: a lookup, no product
        else:
            active += w.numel
    return PlanModel(name, source, weights, n_layers, heads, note, active, _attention(config, model, n_layers))
