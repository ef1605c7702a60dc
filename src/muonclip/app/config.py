"""The typed configuration of a run, its presets, and command-line overrides.

One `RunConfig` describes the model, the data, the optimisation and the bookkeeping of a
`muonclip train` run; `muonclip compare` runs it once per optimizer. Presets:

* ``default`` — what ``muonclip compare`` (``make compare``) runs: a 4-layer, 128-wide GPT
  on the built-in Shakespeare corpus, all three optimizers in about 5 minutes on 2 CPU cores.
* ``tiny`` — a 2-layer, 32-wide GPT for tests: seconds.
* ``logit-growth`` — the instability QK-Clip exists for: no weight decay, a constant high
  learning rate for the hidden matrices (0.05) and ``tau = 30`` (K2's small-model setting),
  200 steps. Plain Muon's max logit climbs from ~0.3 to the hundreds (~900 here, measured);
  MuonClip holds it at ``tau``.

Learning rates are per optimizer (``lr_adamw``, ``lr_muon``, ``lr_muonclip``): the
embeddings, LM head and norm gains are trained by AdamW at ``lr_adamw`` in all three runs, so a
comparison isolates what Muon does to the hidden matrices. ``muonclip compare --sweep`` tunes
the three by trying multiples of them.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, get_args, get_type_hints

OPTIMIZERS = ("adamw", "muon", "muonclip")
ATTENTIONS = ("mha", "mla")
ORTH_DTYPES = ("bfloat16", "float32")
# Fields that fix the model's shape: a checkpoint only resumes into the same ones.
MODEL_FIELDS = ("block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "attention", "qk_norm")


@dataclass
class RunConfig:
    """Everything that defines a run. Defaults are the ``default`` preset.

    Model (the reference GPT, `muonclip.models.GPT`; byte vocabulary of 256):
        block_size: context length in tokens (default 128).
        n_layer: transformer blocks (default 4).
        n_head: query heads per layer (default 4).
        n_kv_head: key/value heads, for GQA/MQA (default None: = n_head, plain MHA).
        n_embd: model width (default 128).
        attention: ``"mha"`` (covers GQA/MQA with n_kv_head) or ``"mla"`` (default "mha").
        qk_norm: RMSNorm on q and k after the projections (default False; QK-Clip cannot
            clip such heads and says so).

    Data:
        data: a text file or folder of .txt/.md files (default None: the built-in plays).
        val_fraction: share of each document's end held out for validation (default 0.05).
        batch_size: sequences per step (default 16).

    Optimisation:
        steps: optimizer steps (default 500).
        lr_adamw, lr_muon, lr_muonclip: peak learning rate of each optimizer (defaults 1.5e-3,
            1e-2, 1e-2: the best of ``muonclip compare --sweep 0.5,1,2,4`` around 3e-3 / 1e-2
            on the default preset, see benchmarks/RESULTS.md); the AdamW branch of
            Muon/MuonClip uses lr_adamw.
        weight_decay: decoupled weight decay on matrices (default 0.1; never on vectors).
        warmup_steps: linear warm-up steps (default 20).
        min_lr_ratio: cosine decay from the peak down to peak * min_lr_ratio (default 0.1).
        tau: QK-Clip threshold on the max logit, also drawn on the plots (default 100, K2's).
        orth_dtype: compute dtype of Muon's orthogonalisation, ``"bfloat16"`` (default, the
            paper's) or ``"float32"`` (slower; for exact comparisons, e.g. a torchrun run
            against one process).

    Bookkeeping:
        seed: model initialisation and batch order (default 0).
        eval_every: steps between validation passes (default 25; the last step always).
        eval_batches: validation batches per pass (default 8).
        checkpoint_every: steps between checkpoints (default 100; the last step always).
        threads: torch CPU threads (default 0: every core).
    """

    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    n_embd: int = 128
    attention: str = "mha"
    qk_norm: bool = False
    data: str | None = None
    val_fraction: float = 0.05
    batch_size: int = 16
    steps: int = 500
    lr_adamw: float = 1.5e-3
    lr_muon: float = 1e-2
    lr_muonclip: float = 1e-2
    weight_decay: float = 0.1
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    tau: float = 100.0
    orth_dtype: str = "bfloat16"
    seed: int = 0
    eval_every: int = 25
    eval_batches: int = 8
    checkpoint_every: int = 100
    threads: int = 0
    preset: str = field(default="default", metadata={"doc": "the preset this config started from"})

    def lr(self, optimizer: str) -> float:
        """The peak learning rate of ``optimizer`` ("adamw", "muon" or "muonclip")."""
        check_optimizer(optimizer)
        return float(getattr(self, f"lr_{optimizer}"))

    def validate(self) -> RunConfig:
        """Raise ValueError naming the field and the fix if any value is out of range (nan and
        +-inf are out of every range); return self."""
        positive = ("block_size", "n_layer", "n_head", "n_embd", "batch_size", "steps", "eval_every",
                    "eval_batches", "checkpoint_every")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for f in dataclasses.fields(self):  # nan and inf are never a setting: they end as NaN weights
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                raise ValueError(f"{f.name} must be a finite number, got {v!r}")
        for name in ("lr_adamw", "lr_muon", "lr_muonclip", "tau"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.warmup_steps < 0 or self.threads < 0:
            raise ValueError("warmup_steps and threads must be >= 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 0.0 < self.val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {self.val_fraction}")
        if self.orth_dtype not in ORTH_DTYPES:
            raise ValueError(f"orth_dtype must be one of {ORTH_DTYPES}, got {self.orth_dtype!r}")
        if self.attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}, got {self.attention!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise ValueError(f"n_kv_head ({self.n_kv_head}) must divide n_head ({self.n_head})")
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown config fields {sorted(unknown)}")
        return cls(**d)


PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "tiny": dict(
        block_size=32, n_layer=2, n_head=2, n_embd=32, batch_size=8, steps=30, warmup_steps=3,
        eval_every=10, eval_batches=2, checkpoint_every=10,
    ),
    "logit-growth": dict(
        steps=200, weight_decay=0.0, lr_adamw=3e-3, lr_muon=0.05, lr_muonclip=0.05, tau=30.0,
        warmup_steps=10, min_lr_ratio=1.0,
    ),
}


def check_optimizer(name: str) -> str:
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {list(OPTIMIZERS)}, got {name!r}")
    return name


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_value(name: str, raw: str) -> Any:
    """``raw`` (the text of ``--set name=raw``) as a value of `RunConfig` field ``name``'s type.

    The type is the field's own annotation (``typing.get_type_hints``): ``int``, ``float``,
    ``bool`` (``1/true/yes/on``, ``0/false/no/off``), ``str``, each optionally ``| None``
    (``none``, ``null`` or an empty value give None).

    Raises:
        ValueError: ``raw`` is not a value of that type; the message names the field and the type.
    """
    hint = get_type_hints(RunConfig)[name]
    args = get_args(hint)
    optional = type(None) in args
    (base,) = [a for a in args if a is not type(None)] or [hint]
    text = raw.strip()
    if optional and text.lower() in ("none", "null", ""):
        return None
    expected = base.__name__ + (" | None" if optional else "")
    try:
        if base is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError(raw)
            return text.lower() in _TRUE
        return base(text) if base in (int, float) else raw
    except ValueError:
        raise ValueError(f"--set {name}={raw}: expected {expected}") from None


def make_config(preset: str = "default", overrides: dict[str, Any] | None = None,
                sets: list[str] | None = None) -> RunConfig:
    """Build a validated `RunConfig` from a preset, typed overrides and ``key=value`` strings.

    Args:
        preset: a name in `PRESETS` (default "default").
        overrides: field -> value, applied after the preset (None values are ignored, so
            unset command-line flags can be passed straight through).
        sets: ``"key=value"`` strings (``--set``), applied last, parsed by the field's type
            (``none`` for optional fields).

    Raises:
        ValueError: unknown preset or field, unparsable value, or an invalid config.
    """
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {list(PRESETS)}")
    return apply_overrides(RunConfig(**{**PRESETS[preset], "preset": preset}), overrides, sets)


def apply_overrides(cfg: RunConfig, overrides: dict[str, Any] | None = None,
                    sets: list[str] | None = None) -> RunConfig:
    """A validated copy of ``cfg`` with ``overrides`` (None values ignored) and then ``sets`` applied."""
    values = cfg.to_dict()
    names = {f.name for f in dataclasses.fields(RunConfig)}
    for k, v in (overrides or {}).items():
        if k not in names:
            raise ValueError(f"unknown config field {k!r}; fields: {sorted(names)}")
        if v is not None:
            values[k] = v
    for item in sets or []:
        if "=" not in item:
            raise ValueError(f"--set expects key=value, got {item!r}")
        k, raw = item.split("=", 1)
        k = k.strip().replace("-", "_")
        if k not in names or k == "preset":
            raise ValueError(f"--set {item}: unknown field {k!r}; fields: {sorted(names - {'preset'})}")
        values[k] = parse_value(k, raw)
    return RunConfig(**values).validate()


__all__ = [
    "ATTENTIONS", "MODEL_FIELDS", "OPTIMIZERS", "ORTH_DTYPES", "PRESETS", "RunConfig", "apply_overrides",
    "check_optimizer", "make_config", "parse_value",
]
