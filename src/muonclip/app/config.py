"""The typed configuration of a run, its presets, and command-line overrides.

One `RunConfig` describes the model, the data, the optimisation and the bookkeeping of a
`muonclip train` run, and the protocol of a `muonclip compare` (seeds, token budgets, the
stability segment). Presets:

* ``default`` — what ``muonclip compare`` (``make compare``) runs: a 2-layer, 64-wide GPT on
  the built-in Shakespeare corpus; token efficiency (AdamW at 1x–3x the tokens against Muon)
  and stability (Muon against MuonClip, at an excessive rate and at Muon's tuned rate), 3 seeds
  each, in a few minutes on 2 idle CPU cores (docs/compare.md has the timings). Its
  learning rates and warm-ups are the tuned values of ``muonclip compare --sweep``.
* ``tiny`` — a 2-layer, 32-wide GPT, 2 seeds, 2 budgets, for tests: seconds.
* ``k2-mini`` — a mini Kimi K2: MLA attention with decoupled RoPE and a mixture-of-experts
  feed-forward (8 routed experts stored as one 3-D stack, top-2, one shared expert, the
  load-balancing loss), 1 seed, a few minutes on 2 cores; the report shows MuonClip's clips per
  layer, the factors applied to each part of a clipped MLA head, and each expert's update RMS.
  Its rates are not tuned (6e-3 for AdamW, 2e-2 for Muon and MuonClip, chosen by hand; it shows
  the clip and the experts, not a token ratio), and its one seed is 0 (``--set seeds=3`` for more).
* ``guards`` — the guards of the attention logits side by side on the ``default`` model
  (`muonclip.app.guards`): Muon with none, QK-Clip, QK-Norm or soft-capping (c =
  ``attn_softcap``, 30), AdamW with and without QK-Norm, at the excessive rate and at Muon's tuned
  rate, 3 seeds. ``guards-mla``: the same on ``k2-mini``'s MLA model (Muon's arms only).
* ``ladder`` — the budget-matched ratio at three widths of the ``default`` model, 1x, 1.5x and 2x
  ``n_embd`` and ``n_head`` (`muonclip.app.ladder`), every rate re-bracketed at each width, the
  same tokens per parameter; 3 seeds at the two smaller widths, one at the largest (its runs cost
  about 14 times the first width's).
* ``finetune`` — fine-tuning an AdamW-pretrained model (`muonclip.app.finetune`).

Optimizers: ``adamw``, ``muon``, ``muonclip`` and three variants of Muon with one option on
(`MUON_VARIANTS`): ``normuon`` (NorMuon), ``muon_cautious`` (cautious weight decay) and
``muon_8bit`` (8-bit momentum). Learning rates are per optimizer (``lr_<optimizer>``): the
embeddings, LM head and norm gains are trained by AdamW at ``lr_adamw`` in every run, so a
comparison isolates what Muon does to the hidden matrices.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin, get_type_hints

from ..common import defaults as D

OPTIMIZERS = ("adamw", "muon", "muonclip", "normuon", "muon_cautious", "muon_8bit")
MUON_VARIANTS = {"muon": {}, "normuon": {"normuon": True}, "muon_cautious": {"cautious_weight_decay": True},
                 "muon_8bit": {"momentum_8bit": True}}
"""The optimizers that are `muonclip.Muon` with one option on (`muonclip.Muon`'s arguments)."""
STABILITY_SEGMENTS = ("excessive", "tuned")
TUNED_PRESETS = ("default", "guards")
"""Presets whose learning rates and warm-ups are the tuned values of ``muonclip compare --sweep``
(docs/compare.md: ``guards`` has the ``default`` preset's); the others' are not tuned (``ladder``
tunes its own at each size)."""
ATTENTIONS = ("mha", "mla")
ORTH_DTYPES = (D.AUTO, "bfloat16", "float32")
SEED_LIMIT = 2**62  # seeds are 0 <= seed < SEED_LIMIT: torch.manual_seed takes 64-bit values, compare adds offsets
INT_LIMIT = 2**62
"""The largest value of any whole-number setting (steps, sizes, counts): step counters and tensor
sizes are 64-bit. Sizes are bounded far below this by the memory estimate
(`muonclip.app.memory.check_memory`)."""
FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: the weights' dtype, so every coefficient a step computes from a setting
(a learning rate times its update scale, weight decay or AdamW's bias correction) must fit it."""


def _model(default: Any, *, shape: bool = True) -> Any:
    """A field of the model (`muonclip.models.GPTConfig` takes it by the same name): ``shape``
    when it fixes the shape of a weight, else a field of the training objective."""
    return field(default=default, metadata={"model": "shape" if shape else "objective"})


@dataclass
class RunConfig:
    """Everything that defines a run, and the protocol of a comparison. Defaults are the ``default`` preset.

    Model (the reference GPT, `muonclip.models.GPT`; byte vocabulary of 256):
        block_size: context length in tokens (default 128).
        n_layer: transformer blocks (default 2).
        n_head: query heads per layer (default 2).
        n_kv_head: key/value heads, for GQA/MQA (default None: = n_head, plain MHA).
        n_embd: model width (default 64).
        attention: ``"mha"`` (covers GQA/MQA with n_kv_head) or ``"mla"`` (default "mha").
        qk_norm: RMSNorm on q and k after the projections (default False; MLA: on the
            non-rotary parts q^C and k^C only; QK-Clip cannot clip such heads and says so).
        attn_softcap: Gemma 2's attention logit soft-capping ``c``, the softmax over
            ``c * tanh(s / c)`` (default 0.0: none; QK-Clip refuses it; `muonclip.models.GPTConfig`).
        n_expert: routed experts of a mixture-of-experts feed-forward, stored as one 3-D stack
            (default 0: a dense MLP); see `muonclip.models.GPTConfig`.
        n_expert_active: experts per token, top-k (default 2).
        n_shared_expert: always-on shared experts (default 1).
        expert_hidden: hidden width of each expert (default 0: 4 * n_embd / (n_expert_active +
            n_shared_expert), the dense MLP's active width).
        aux_loss_weight: weight of the load-balancing loss added to the training loss (default 0.01).

    Data:
        data: a text file or folder of .txt/.md files (default None: the built-in plays).
        val_fraction: share of each document's end held out for validation (default 0.05).
        batch_size: sequences per step (default 16).

    Optimisation:
        steps: optimizer steps (default 400).
        lr_adamw, lr_muon, lr_muonclip: peak learning rate of each optimizer (defaults 0.03394,
            0.04, 0.04: the tuned values of ``muonclip compare --sweep`` on the default preset,
            every one strictly inside its grid, see docs/compare.md; ``k2-mini`` uses 6e-3, 2e-2,
            2e-2, untuned, and so does ``tiny``); the AdamW branch of Muon/MuonClip uses lr_adamw.
        lr_normuon, lr_muon_cautious, lr_muon_8bit: the same for Muon's variants (`MUON_VARIANTS`;
            defaults 0.04, 0.02828, 0.02828: tuned by benchmarks/tune_muon_variants.py, the
            ``--sweep`` protocol at Muon's warm-up, every one strictly inside its grid, see
            docs/compare.md; the other presets use lr_muon's value).
        weight_decay: decoupled weight decay on matrices (default 0.1; never on vectors).
        grad_clip: the gradients of all parameters are scaled so that their global L2 norm is at
            most this, before every optimizer's step (``torch.nn.utils.clip_grad_norm_``; default
            1.0; 0 turns it off). A non-finite norm stops the run (exit 3) before the step.
        warmup_steps: linear warm-up steps (default 20), for every optimizer whose own is None.
        warmup_adamw, warmup_muon, warmup_muonclip: the optimizer's own warm-up; None:
            warmup_steps (defaults 200, 20, 20: tuned by ``--sweep`` on the default preset; the
            ``tiny`` and ``k2-mini`` presets use warmup_steps).
        warmup_normuon, warmup_muon_cautious, warmup_muon_8bit: the same for Muon's variants
            (default 20, Muon's tuned warm-up, held fixed while their rates were tuned).
        min_lr_ratio: cosine decay from the peak down to peak * min_lr_ratio (default 0.1).
        tau: QK-Clip threshold on the max logit, also drawn on the plots (default 100, K2's).
        orth_dtype: compute dtype of Muon's orthogonalisation: ``"auto"`` (default: bfloat16
            where the device multiplies it natively, a CPU with AMX-BF16 or AVX512-BF16 or a
            CUDA GPU of compute capability 8.0+, else float32; `muonclip.ortho._precision`; the
            report names what it picked and why), ``"bfloat16"`` (the paper's) or
            ``"float32"`` (for exact comparisons, e.g. a torchrun run against one process).

    Comparison (``muonclip compare`` only; see `muonclip.app.compare`):
        seeds: seeds per setting, ``seed``, ``seed + 1``, ... (default 3).
        budgets: AdamW's token budgets, in multiples of ``steps`` (default 1, 1.5, 2, 3).
        lr_adamw_budgets: AdamW's peak rate at each budget (default 0.03394, 0.03394, 0.03394, 0.03394: tuned at each
            budget by ``--sweep``; (): lr_adamw at every one).
        stability_steps: steps of the stability segment, Muon against MuonClip with no weight
            decay, a constant rate after warm-up and ``stability_tau`` (default 300; 0: none).
        stability_lr: peak rate of Muon and MuonClip in that segment (default 0.1, 2.5 times Muon's
            tuned rate: plain Muon's max logit then passes 3 tau within the segment on every seed).
        stability_tau: tau of that segment (default 30, K2's small-model setting).
        stability_segments: which stability segments run (default both): ``"excessive"``, the
            rescue at ``stability_lr``, and ``"tuned"``, the same segment at Muon's tuned rate
            ``lr_muon`` with ``tau = stability_tuned_tau``, which asks whether the clip costs
            anything where a tuned run would use it (``k2-mini``, whose rates are not tuned: the
            first only).
        stability_tuned_tau: tau of the tuned-rate segment (default 30: at lr_muon 0.04 plain
            Muon's max logit passes it, so the clip fires).

    Bookkeeping:
        seed: model initialisation and batch order (default 0).
        eval_every: steps between validation passes (default 50; the last step always).
        eval_batches: validation batches per pass (default 16).
        checkpoint_every: steps between checkpoints (default 100; the last step always).
        threads: torch CPU threads (default 0: every core; ``compare`` with several jobs: the
            cores shared between them).
    """

    block_size: int = _model(128)
    n_layer: int = _model(2)
    n_head: int = _model(2)
    n_kv_head: int | None = _model(None)
    n_embd: int = _model(64)
    attention: str = _model("mha")
    qk_norm: bool = _model(False)
    attn_softcap: float = _model(0.0, shape=False)
    n_expert: int = _model(0)
    n_expert_active: int = _model(2)
    n_shared_expert: int = _model(1)
    expert_hidden: int = _model(0)
    aux_loss_weight: float = _model(0.01, shape=False)
    data: str | None = None
    val_fraction: float = 0.05
    batch_size: int = 16
    steps: int = 400
    lr_adamw: float = 0.03394
    lr_muon: float = 0.04
    lr_muonclip: float = 0.04
    lr_normuon: float = 0.04
    lr_muon_cautious: float = 0.02828
    lr_muon_8bit: float = 0.02828
    weight_decay: float = D.WEIGHT_DECAY
    grad_clip: float = 1.0
    warmup_steps: int = 20
    warmup_adamw: int | None = 200
    warmup_muon: int | None = 20
    warmup_muonclip: int | None = 20
    warmup_normuon: int | None = 20
    warmup_muon_cautious: int | None = 20
    warmup_muon_8bit: int | None = 20
    min_lr_ratio: float = 0.1
    tau: float = D.TAU
    orth_dtype: str = D.ORTH_DTYPE
    seeds: int = 3
    budgets: tuple[float, ...] = (1.0, 1.5, 2.0, 3.0)
    lr_adamw_budgets: tuple[float, ...] = (0.03394, 0.03394, 0.03394, 0.03394)
    stability_steps: int = 300
    stability_lr: float = 0.1
    stability_tau: float = 30.0
    stability_segments: tuple[str, ...] = ("excessive", "tuned")
    stability_tuned_tau: float = 30.0
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 16
    checkpoint_every: int = 100
    threads: int = 0
    preset: str = field(default="default", metadata={"doc": "the preset this config started from"})

    def warmup(self, optimizer: str) -> int:
        """The warm-up steps of ``optimizer``: its own field, else ``warmup_steps``."""
        check_optimizer(optimizer)
        own = getattr(self, f"warmup_{optimizer}")
        return self.warmup_steps if own is None else int(own)

    def lr(self, optimizer: str) -> float:
        """The peak learning rate of ``optimizer`` (one of `OPTIMIZERS`)."""
        check_optimizer(optimizer)
        return float(getattr(self, f"lr_{optimizer}"))

    def validate(self) -> RunConfig:
        """Raise ValueError naming the field and the fix if any value is not of its field's type
        (`check_types`) or is out of range (nan and +-inf are out of every range; whole numbers
        above `INT_LIMIT`; a learning rate whose step coefficients overflow float32,
        `check_rates`); return self."""
        self.check_types()
        positive = ("block_size", "n_layer", "n_head", "n_embd", "batch_size", "steps", "eval_every",
                    "eval_batches", "checkpoint_every")
        for name in positive:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        for f in dataclasses.fields(self):  # nan and inf are never a setting: they end as NaN weights
            v = getattr(self, f.name)
            for x in v if isinstance(v, (tuple, list)) else [v]:
                if isinstance(x, float) and not math.isfinite(x):
                    raise ValueError(f"{f.name} must be a finite number, got {v!r}")
        for name in (*(f"lr_{o}" for o in OPTIMIZERS), "tau", "stability_lr", "stability_tau", "stability_tuned_tau"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        for name in (f"warmup_{o}" for o in OPTIMIZERS):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {getattr(self, name)!r}")
        if not set(self.stability_segments) <= set(STABILITY_SEGMENTS):
            raise ValueError(f"stability_segments must be among {list(STABILITY_SEGMENTS)}, got "
                             f"{list(self.stability_segments)}")
        if self.seeds < 1 or self.stability_steps < 0:
            raise ValueError(f"seeds must be >= 1 and stability_steps >= 0, got {self.seeds}, {self.stability_steps}")
        budgets = list(self.budgets)
        if 1.0 not in budgets or any(not b > 0 for b in budgets) or len(set(budgets)) != len(budgets) \
                or budgets != sorted(budgets):
            raise ValueError(f"budgets must be increasing multiples > 0 of steps, one of them 1, got {self.budgets}")
        if self.lr_adamw_budgets and (len(self.lr_adamw_budgets) != len(self.budgets)
                                      or any(not v > 0 for v in self.lr_adamw_budgets)):
            raise ValueError(f"lr_adamw_budgets must be empty or one rate > 0 per budget {self.budgets}, "
                             f"got {self.lr_adamw_budgets}; set both (--set lr_adamw_budgets= for lr_adamw at "
                             "every budget)")
        if self.n_expert < 0 or self.n_shared_expert < 0 or self.expert_hidden < 0 or self.aux_loss_weight < 0:
            raise ValueError("n_expert, n_shared_expert, expert_hidden and aux_loss_weight must be >= 0")
        if self.n_expert and not 1 <= self.n_expert_active <= self.n_expert:
            raise ValueError(f"n_expert_active ({self.n_expert_active}) must be between 1 and n_expert "
                             f"({self.n_expert})")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.attn_softcap < 0:
            raise ValueError(f"attn_softcap must be >= 0 (0: no soft-capping), got {self.attn_softcap}")
        if self.grad_clip < 0:
            raise ValueError(f"grad_clip must be >= 0 (0 turns clipping off), got {self.grad_clip}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"seed (--seed) must be a whole number from 0 to 2**62 - 1, got {self.seed!r}")
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
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, int) and not isinstance(v, bool) and abs(v) > INT_LIMIT:
                raise ValueError(f"{f.name} must be at most {INT_LIMIT} (2**62), got {v}")
        if self.aux_loss_weight > FLOAT32_MAX:
            raise ValueError(f"aux_loss_weight must be at most {FLOAT32_MAX:.4g} (it scales a float32 loss), got "
                             f"{self.aux_loss_weight!r}")
        self.check_rates()
        return self

    def check_types(self) -> None:
        """Raise ValueError naming the first field whose value is not of its type (the field's
        annotation: an int is a whole number and not a bool; a float may be given as an int; a
        str, a bool, None where optional, a tuple of the item type). A config read from a file
        (`from_dict`) can hold anything."""
        hints = get_type_hints(RunConfig)
        for f in dataclasses.fields(self):
            v, hint = getattr(self, f.name), hints[f.name]
            if get_origin(hint) is tuple:
                item = get_args(hint)[0]
                if not isinstance(v, (tuple, list)) or not all(_of_type(x, item) for x in v):
                    raise ValueError(f"{f.name} must be a list of {_TYPE_NAMES[item]}s, got {v!r:.200}")
                continue
            args = [a for a in get_args(hint) if a is not type(None)] or [hint]
            optional = type(None) in get_args(hint)
            if not ((optional and v is None) or _of_type(v, args[0])):
                expected = _TYPE_NAMES[args[0]] + (" or none" if optional else "")
                raise ValueError(f"{f.name} must be {expected}, got {v!r:.200}")

    def check_rates(self) -> None:
        """Raise ValueError naming the first learning rate (``lr_<optimizer>``, ``stability_lr``,
        ``lr_adamw_budgets``) for which a step's coefficients overflow float32: Muon's ``lr *
        0.2 sqrt(max(A, B))`` for the largest hidden matrix (A x B, counted from the config:
        `muonclip.app.shapes.hidden_extent`) and ``lr * weight_decay``; AdamW's ``lr / (1 -
        beta1)`` (its first step's bias correction) and ``lr * weight_decay`` — the check that
        ``muonclip.Muon`` makes of its own groups (`muonclip.optim._validation.check_step_scalars`)."""
        from ..optim._validation import StepLimits, check_step_scalars
        from .shapes import hidden_extent

        limits = StepLimits(0.2 * math.sqrt(hidden_extent(model_config(self))), FLOAT32_MAX, FLOAT32_MAX)
        muon = [(f"lr_{o}", getattr(self, f"lr_{o}")) for o in OPTIMIZERS if o != "adamw"]
        adamw = [("lr_adamw", self.lr_adamw)] + [("lr_adamw_budgets", v) for v in self.lr_adamw_budgets]
        for algorithm, rates in (("muon", [*muon, ("stability_lr", self.stability_lr)]), ("adamw", adamw)):
            for name, lr in rates:
                group = {"algorithm": algorithm, "lr": lr, "weight_decay": self.weight_decay,
                         "betas": D.BETAS, "adamw_eps": D.ADAMW_EPS}
                try:
                    check_step_scalars(group, limits)
                except ValueError as e:
                    raise ValueError(f"{name}: {e} (float32, the weights' dtype)") from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunConfig:
        """The config of a dict of its fields (as `to_dict` gives, JSON lists for tuples); fields
        absent take their defaults. Not validated (call `validate`).

        Raises:
            ValueError: ``d`` is not a dict, or holds a name that is not a field.
        """
        if not isinstance(d, dict):
            raise ValueError(f"a config is a JSON object of its fields, got {d!r:.100}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown config fields {sorted(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})  # JSON lists: tuples


_TYPE_NAMES = {int: "a whole number", float: "a number", str: "a string", bool: "true or false"}


def _of_type(value: Any, kind: type) -> bool:
    """``value`` is a ``kind`` (int: not a bool; float: an int or a float, not a bool)."""
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is float:
        return isinstance(value, (int, float))
    return isinstance(value, kind)


MODEL_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunConfig) if "model" in f.metadata)
"""The `RunConfig` fields that `muonclip.models.GPTConfig` takes (`model_config`)."""
SHAPE_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RunConfig)
                                      if f.metadata.get("model") == "shape")
"""The fields that fix the shape of the model's weights: a checkpoint resumes only into the same ones."""


def model_config(cfg: RunConfig) -> Any:
    """The `muonclip.models.GPTConfig` of ``cfg``: its `MODEL_FIELDS` and the byte vocabulary (256)."""
    from ..models import GPTConfig

    return GPTConfig(vocab_size=256, **{k: getattr(cfg, k) for k in MODEL_FIELDS})


_K2_MODEL: dict[str, Any] = dict(attention="mla", n_head=4, n_expert=8, n_expert_active=2, n_shared_expert=1,
                                 expert_hidden=64, block_size=64)
_K2_RATES: dict[str, Any] = dict(
    lr_adamw=6e-3, lr_muon=2e-2, lr_muonclip=2e-2, warmup_adamw=None, warmup_muon=None, warmup_muonclip=None,
    lr_normuon=2e-2, lr_muon_cautious=2e-2, lr_muon_8bit=2e-2, warmup_normuon=None, warmup_muon_cautious=None,
    warmup_muon_8bit=None)  # set by hand, not tuned

PRESETS: dict[str, dict[str, Any]] = {
    "default": {},
    "tiny": dict(
        block_size=32, n_layer=2, n_head=2, n_embd=32, batch_size=8, steps=30, warmup_steps=3,
        lr_adamw=6e-3, lr_muon=2e-2, lr_muonclip=2e-2, warmup_adamw=None, warmup_muon=None, warmup_muonclip=None,
        lr_normuon=2e-2, lr_muon_cautious=2e-2, lr_muon_8bit=2e-2, warmup_normuon=None, warmup_muon_cautious=None,
        warmup_muon_8bit=None,
        eval_every=10, eval_batches=2, checkpoint_every=10, seeds=2, budgets=(1.0, 2.0), lr_adamw_budgets=(),
        stability_steps=10,
    ),
    # `muonclip compare --preset finetune` (muonclip.app.finetune): the default model pre-trained with AdamW
    # for `steps` without the histories, then fine-tuned on them for steps // 8 (float32 orthogonalisation:
    # a CPU without bf16 units runs it faster)
    "finetune": dict(steps=200, eval_batches=8, orth_dtype="float32", budgets=(1.0,), lr_adamw_budgets=(),
                     stability_steps=0),
    "k2-mini": dict(
        **_K2_MODEL, steps=300, seeds=1, budgets=(1.0,), lr_adamw_budgets=(), stability_steps=300,
        stability_segments=("excessive",),  # no tuned rate to test the clip at
        **_K2_RATES,
    ),
    # `muonclip compare --preset guards` (muonclip.app.guards): the default model's stability segments (the
    # excessive rate, Muon's tuned rate) with each guard of the attention logits; attn_softcap is the soft-capping
    # arm's c (= tau, so both guards hold what the softmax sees to the same level), the other arms run without
    "guards": dict(attn_softcap=30.0, budgets=(1.0,), lr_adamw_budgets=()),
    # the same on k2-mini's MLA + MoE model, at its rates (set by hand, not tuned)
    "guards-mla": dict(**_K2_MODEL, **_K2_RATES, attn_softcap=30.0, budgets=(1.0,), lr_adamw_budgets=()),
    # `muonclip compare --preset ladder` (muonclip.app.ladder): the budget-matched ratio at three widths, every
    # rate re-bracketed at each; AdamW at its 1x rate at every budget
    "ladder": dict(stability_steps=0, lr_adamw_budgets=()),
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
    (``none``, ``null`` or an empty value give None), or a tuple (comma-separated).

    Raises:
        ValueError: ``raw`` is not a value of that type; the message names the field and the type.
    """
    hint = get_type_hints(RunConfig)[name]
    if get_origin(hint) is tuple:  # tuple[float, ...]: comma-separated, empty for ()
        (item, _) = get_args(hint)
        try:
            return tuple(item(x.strip()) for x in raw.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--set {name}={raw}: expected comma-separated {item.__name__}s") from None
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
