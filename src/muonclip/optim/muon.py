"""`Muon`: the Muon optimizer for hidden matrices, with an AdamW branch, in one object.

A thin ``torch.optim.Optimizer`` shell (Keller Jordan's three layers: orthogonaliser, per-matrix
update, thin class): it validates, keeps state, batches same-shape matrices into one
orthogonalisation per bucket (`muonclip.optim.buckets`) and runs the update's phases
(`muonclip.optim.functional`) and the AdamW branch (`muonclip.optim.adamw`). A step that needs
several processes is handed to the distribution layer (`muonclip.optim.engine`); a step in one
process never enters it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ..ortho import check_method
from .adamw import adamw_update
from .backend import Backend, make_backend
from .buckets import item_flops, item_scales, make_buckets, matrix_options, options_key, orthogonalize_buckets
from .engine import Engine, StepStats, engine_for
from .functional import apply_blocks_, momentum_, muon_input
from .masked import MaskedStep
from .matrices import block_views, check_matrix_options
from .nonfinite import ON_NONFINITE, NonFiniteGradError, finite_per_tensor, nonfinite_indices
from .scale import scale_name

ALGORITHMS = ("muon", "adamw")
# State kept in float32 (float64 for float64 parameters) whatever the parameter dtype; torch's
# loader would cast it to the parameter dtype.
_FP32_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq")
# Group keys of earlier versions, and what replaced them (docs/changelog.md).
_RENAMED = {"update_scale": "adjust_lr_fn", "steps": "ns_steps"}


class Muon(torch.optim.Optimizer):
    r"""Muon (MomentUm Orthogonalized by Newton–Schulz) with an AdamW branch.

    For every parameter in a group with ``algorithm="muon"`` (hidden matrices), one step is
    (`muonclip.optim.functional.muon_update`)::

        G = grad
        M = momentum * M + G                    # state "momentum_buffer", float32
        V = G + momentum * M   if nesterov  else  M
        O = orth(V)                             # per matrix; see muonclip.orthogonalize
        W = W * (1 - lr * weight_decay)         # decoupled weight decay, base lr
        W = W - lr * scale(A, B) * O            # scale: adjust_lr_fn

    Groups with ``algorithm="adamw"`` (embeddings, LM head, norms, biases: see
    `muonclip.param_groups`) get torch.optim.AdamW's update with ``betas`` and ``adamw_eps``
    (state "exp_avg", "exp_avg_sq", "step"), all in one ``step()``.

    Matrices of the same shape and orthogonalisation settings, across parameters and groups,
    are orthogonalised as one batch. A 2-D weight is one matrix; a 3-D weight ``(E, A, B)``
    (stacked MoE experts) is E matrices; 4-D and higher (convolutions) are ``(out, prod(rest))``.
    How else a weight is seen as matrices is said per param group, by keys that
    `muonclip.param_groups` sets from the model (`muonclip.optim.matrices`): ``flatten``
    (``(out, ...)`` as ``(out, prod(rest))``, for 3-D convolutions), ``split_sizes`` (row
    blocks orthogonalised separately: fused QKV, fused gate/up, per-head blocks),
    ``split_groups`` (those blocks interleaved, as in GPT-NeoX's per-head ``[q k v]``) and
    ``transposed`` (stored ``(in, out)``, like transformers' ``Conv1D``, so scale and splits
    use the ``(out, in)`` matrix). Each block gets the update scale of its own shape.

    Before anything is updated, every gradient of the step is checked for NaN/inf (one host
    sync). ``on_nonfinite="raise"`` (default) raises `NonFiniteGradError` naming the parameter
    and the step; ``"skip"`` skips the whole step for every parameter and counts it in
    ``steps_skipped``. ``"mask"`` does what ``"skip"`` does without the host sync (for GPUs: the
    step never waits for the device): the flag stays on the device, the step runs on zeroed
    gradients and is undone where the flag is set (`muonclip.optim.masked`: a copy of the
    parameters and the optimizer state per step; a finite step is exactly the default mode's).
    In that mode ``steps_taken`` counts masked steps too, AdamW's bias-correction step number
    advances on them, the zeroed gradients stay zeroed, and reading ``steps_skipped`` syncs.
    Either way no weight and no buffer sees a non-finite value.

    The first ten arguments are torch.optim.Muon's, with torch's meaning (``adjust_lr_fn``'s
    default excepted, see below), so the class drops in for it; the rest are ours.

    Args:
        params: parameters or param groups. A group may set any option below, plus
            ``algorithm`` ("muon" default, or "adamw"), ``param_names`` (used in errors) and
            the matrix keys above.
        lr: learning rate (default 1e-3). With ``adjust_lr_fn="match_rms_adamw"`` AdamW's lr
            carries over.
        weight_decay: decoupled weight decay, multiplied by the base lr (default 0.1).
        momentum: Muon momentum coefficient mu in [0, 1) (default 0.95).
        nesterov: use the Nesterov form ``G + mu M`` (default True).
        ns_coefficients: the quintic's (a, b, c) for the methods that run it (``"ns5"``,
            ``"gram"``, ``"ns5_sym"``, ``"ns5_compiled"``; default None: (3.4445, -4.7750,
            2.0315)); an error with any other method.
        eps: added to the Frobenius norm before Newton–Schulz (default 1e-7).
        ns_steps: iterations of the method (default None: the method's default, 5).
        adjust_lr_fn: the update scale (`muonclip.optim.scale`): ``"match_rms_adamw"`` =
            0.2 sqrt(max(A, B)) (default; update RMS 0.2, like AdamW's), ``"original"`` or None
            = sqrt(max(1, A/B)) (torch.optim.Muon's default, Keller Jordan's), ``"unscaled"`` = 1.
        method: orthogonalisation method, ``"ns5"`` (default), ``"polar_express"``, ``"gram"``,
            ``"svd"`` or any name in ``muonclip.ortho.METHODS``.
        orth_dtype: compute dtype of the orthogonalisation (default torch.bfloat16; float32
            for accuracy, float64 for svd).
        betas: AdamW branch moment coefficients (default (0.9, 0.95)).
        adamw_eps: AdamW branch epsilon (default 1e-8); a group key too (``eps`` is always
            Newton–Schulz's).
        on_nonfinite: ``"raise"`` (default), ``"skip"`` or ``"mask"`` (sync-free skip); see
            above.
        process_group: the group the Muon matrices are shared over (docs/design.md,
            "Distributed Muon"). None (default) is automatic: the device mesh of DTensor
            parameters (FSDP2 ``fully_shard``, ``Shard(0)``), else the default group when
            torch.distributed is initialised with > 1 rank (DDP: parameters replicated), else
            none (one process). Each matrix is orthogonalised once in the group, whole, on an
            owner rank chosen by flops, and the result exchanged (`muonclip.distributed`).
            ``"local"`` turns communication off. ``last_step_stats``
            (`muonclip.optim.engine.StepStats`) reports this rank's share.
        comm_dtype: wire dtype of those exchanges (default None: the momentum dtype,
            float32). ``torch.bfloat16`` halves the bytes; with ``orth_dtype=torch.bfloat16``
            it is lossless for the built-in methods.
        backend: where buckets live and how they are orthogonalised
            (`muonclip.optim.backend`): ``"auto"`` (default: ``"buffered"`` for CPU parameters,
            buffers kept between steps, measured faster there, docs/benchmarks.md; ``"core"``
            elsewhere), ``"core"`` (the pure functions, fresh tensors each step),
            ``"buffered"``, or a backend object such as
            ``muonclip.fast.BufferedBackend(chunk="cache")``. Never changes what is computed.

    Every number above (``lr``, ``momentum``, ``weight_decay``, ``betas``, ``adamw_eps``,
    ``eps``, ``ns_coefficients``), given here or in a group (``add_param_group`` too), must be
    finite and in its range: a ValueError names the one that is not (nan or inf would reach
    every weight). ``lr`` may be a 0-D tensor; it is read once, when the group is added.

    Everything after ``lr`` is keyword-only, because torch.optim.Muon's positional order
    differs: a positional call could silently mean other settings.

    References:
        K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024).
        J. Liu et al., "Muon is Scalable for LLM Training" (Moonlight), arXiv 2502.16982.
        Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534.
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        *,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] | None = None,
        eps: float = 1e-7,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = "match_rms_adamw",
        method: str = "ns5",
        orth_dtype: torch.dtype = torch.bfloat16,
        betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        on_nonfinite: str = "raise",
        process_group: Any = None,
        comm_dtype: torch.dtype | None = None,
        backend: str | Backend = "auto",
    ) -> None:
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        defaults = dict(
            algorithm="muon",
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=None if ns_coefficients is None else tuple(ns_coefficients),
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=scale_name(adjust_lr_fn),
            method=method,
            orth_dtype=orth_dtype,
            betas=tuple(betas),
            adamw_eps=adamw_eps,
            split_sizes=None,
            split_groups=1,
            flatten=False,
            transposed=False,
        )
        _check_hyperparameters(defaults, "")  # even where every group sets its own
        self.on_nonfinite = on_nonfinite
        self.process_group = process_group
        self.comm_dtype = comm_dtype
        self.backend = make_backend(backend)
        self.last_step_stats = StepStats()
        self.steps_taken = 0
        self.steps_skipped = 0
        # on_nonfinite="mask": the last step's device flag (True: masked), for what runs after it
        self.last_masked: Tensor | None = None
        self._structure: tuple[Any, _Structure] | None = None  # the one-process step's buckets, cached
        self._mask_copies: list[Tensor] = []  # on_nonfinite="mask": the snapshot, reused between steps
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------------------
    # validation
    # ----------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after validating it; see the class docstring for its keys."""
        for old, new in _RENAMED.items():
            if old in param_group:
                raise ValueError(f"param group key {old!r} is now {new!r} (torch.optim.Muon's name; docs/changelog.md)")
        if param_group.get("algorithm", "muon") == "adamw" and "eps" in param_group:
            raise ValueError("in an algorithm='adamw' group AdamW's epsilon is 'adamw_eps' ('eps' is Newton–Schulz's)")
        if "adjust_lr_fn" in param_group:
            param_group["adjust_lr_fn"] = scale_name(param_group["adjust_lr_fn"])
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            _validate_group(group)
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise

    # ----------------------------------------------------------------------------------------
    # the step
    # ----------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimisation step (all groups); ``closure`` re-evaluates the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        named = [(g, i, p) for g in self.param_groups for i, p in enumerate(g["params"])]
        live = [(g, i, p) for g, i, p in named if p.grad is not None]
        for g, i, p in live:
            if p.grad.is_sparse:
                raise ValueError(
                    f"{_name(self, g, i)} has a sparse gradient; Muon and its AdamW branch need dense "
                    "gradients (build the embedding with sparse=False)"
                )
        engine = engine_for([p for _, _, p in named], self.process_group)
        ctx = None
        if engine is not None:  # a clear error (no process group, mixed meshes, bad placement) before any collective
            ctx = engine.context([p for _, _, p in named], lambda k: _name(self, named[k][0], named[k][1]),
                                 self.process_group)
        local = engine.local if engine is not None else _same
        grads = [p.grad for _, _, p in live]
        finite = finite_per_tensor([local(g) for g in grads])
        if engine is not None:
            finite = engine.all_finite(grads, finite)
        if self.on_nonfinite == "mask":  # sync-free: decided on the device, undone there
            found = ~finite.all()
            guard = MaskedStep([p for _, _, p in live], [self.state[p] for _, _, p in live], found, local,
                               cache=self._mask_copies)
            self.last_masked = found
            self._update(engine, ctx)
            guard.restore()
            self._count_masked(found)
            return loss
        bad = nonfinite_indices(finite)
        if bad:
            if self.on_nonfinite == "skip":
                self.steps_skipped += 1
                return loss
            names = ", ".join(_name(self, live[k][0], live[k][1]) for k in bad[:5])
            raise NonFiniteGradError(
                f"non-finite gradient (NaN or inf, or beyond 2^100) in {names} at step {self.steps_taken + 1}; "
                "no parameter was updated. Check the loss and the learning rate, clip gradients, "
                "or pass on_nonfinite='skip' to skip such steps."
            )
        self._update(engine, ctx)
        return loss

    def _update(self, engine: Engine | None, ctx: Any) -> None:
        """The Muon update of every Muon parameter with a gradient, then the AdamW groups'."""
        self.steps_taken += 1
        items = [
            (g, p, partial(_name, self, g, i))  # the name is only formatted for an error
            for g in self.param_groups if g["algorithm"] == "muon"
            for i, p in enumerate(g["params"])
        ]
        if engine is None:
            self.last_step_stats = self._muon_step([(g, p) for g, p, _ in items if p.grad is not None])
        else:  # on every rank, even one without grads: it runs collectives
            self.last_step_stats = engine.muon_step(items, self.state, ctx, backend=self.backend,
                                                    new_buffer=_zeros_fp32, comm_dtype=self.comm_dtype)
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_group(group)

    def _muon_step(self, live: list[tuple[dict[str, Any], Tensor]]) -> StepStats:
        """One process: momentum, V into the buckets, one orthogonalisation per bucket, and
        each weight updated as soon as its result is complete (still in cache)."""
        stats = StepStats()
        if not live:
            return stats
        st = self._cached_structure(live)
        bufs = [self._momentum_buffer(p) for _, p in live]
        pending = set(range(len(live)))

        def write(k: int, b: int, dst: Tensor) -> None:
            g, p = live[k]
            M, G = bufs[k], p.grad
            if k in pending:  # once per weight, just before its first V block (G and M in cache)
                pending.discard(k)
                momentum_(M, G, g["momentum"])
            if st.n_blocks[k] > 1:
                G, M = (block_views(t, **matrix_options(g))[b] for t in (G, M))
            muon_input(G, M, g["momentum"], g["nesterov"], out=dst)

        def done(k: int, O: Tensor) -> None:
            g, p = live[k]
            axis, ranges = st.scales[k]
            apply_blocks_(p, O, lr=g["lr"], weight_decay=g["weight_decay"], axis=axis, ranges=ranges)

        groups, shapes = [g for g, _ in live], [p.shape for _, p in live]
        stats.matrices = orthogonalize_buckets(st.buckets, st.n_blocks, groups, shapes, write, done, self.backend,
                                               reuse_result=True)
        stats.ns_flops = stats.total_ns_flops = st.flops
        return stats

    def _cached_structure(self, live: list[tuple[dict[str, Any], Tensor]]) -> _Structure:
        """The buckets and scales of ``live``, rebuilt only when a shape, a device or a
        structural option (`muonclip.optim.buckets.STRUCTURAL_OPTIONS`) changed."""
        options: dict[int, tuple] = {}  # per group, once
        for g, _ in live:
            if id(g) not in options:
                options[id(g)] = options_key(g)
        key = tuple((options[id(g)], tuple(p.shape), p.device) for g, p in live)
        if self._structure is not None and self._structure[0] == key:
            return self._structure[1]
        items = [(g, p.shape, p.device) for g, p in live]
        buckets, n_blocks = make_buckets(items, range(len(live)))
        st = _Structure(buckets, n_blocks, [item_scales(g, p.shape) for g, p in live],
                        sum(item_flops(g, p.shape) for g, p in live))
        self._structure = (key, st)
        return st

    def _momentum_buffer(self, p: Tensor) -> Tensor:
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = _zeros_fp32(p)
        return state["momentum_buffer"]

    def _adamw_group(self, group: dict[str, Any]) -> None:
        params, grads, avgs, sqs = [], [], [], []
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = 0
                state["exp_avg"] = _zeros_fp32(p)
                state["exp_avg_sq"] = _zeros_fp32(p)
            state["step"] += 1
            params.append(p)
            grads.append(p.grad)
            avgs.append(state["exp_avg"])
            sqs.append(state["exp_avg_sq"])
        # Parameters of one group can have different step counts (a param without a grad at
        # some step), so update each step count as its own sub-batch.
        by_step: dict[int, list[int]] = defaultdict(list)
        for k, p in enumerate(params):
            by_step[self.state[p]["step"]].append(k)
        for step, idx in by_step.items():
            adamw_update(
                [params[k] for k in idx], [grads[k] for k in idx], [avgs[k] for k in idx],
                [sqs[k] for k in idx], step, lr=group["lr"], betas=group["betas"],
                eps=group["adamw_eps"], weight_decay=group["weight_decay"],
            )

    # Skipped-step counter: a host int plus, in on_nonfinite="mask" mode, a device counter that
    # is only read (one sync) when someone asks for the number.
    @property
    def steps_skipped(self) -> int:
        """Steps skipped for a non-finite gradient (reading it syncs in ``"mask"`` mode)."""
        device_count = self.__dict__.get("_masked_count")
        return self._skipped_host + (0 if device_count is None else int(device_count))

    @steps_skipped.setter
    def steps_skipped(self, value: int) -> None:
        self._skipped_host = int(value)
        self._masked_count = None

    def _count_masked(self, found: Tensor) -> None:
        if self._masked_count is None:
            self._masked_count = torch.zeros((), dtype=torch.int64, device=found.device)
        self._masked_count.add_(found)

    # ----------------------------------------------------------------------------------------
    # state
    # ----------------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # torch keeps only defaults/state/param_groups; keep our settings and counters too
        # (copy.deepcopy and pickle go through here). Cached structure and copies are not state.
        return {**self.__dict__, "_structure": None, "_mask_copies": []}

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus ``"muonclip"``: step and skipped-step counters."""
        sd = super().state_dict()
        sd["muonclip"] = {"steps_taken": self.steps_taken, "steps_skipped": self.steps_skipped}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; float32 buffers stay float32 even for bf16 parameters.

        (torch's loader casts floating state to the parameter dtype, which would turn the
        float32 momentum into bf16 after a resume.)

        A state dict saved by muonclip 0.1 before the redesign is upgraded (docs/changelog.md):
        ``update_scale`` "rms"/"shape"/"none" becomes ``adjust_lr_fn``
        "match_rms_adamw"/"original"/"unscaled", ``steps`` becomes ``ns_steps``, an adamw
        group's ``eps`` becomes ``adamw_eps``; a group key added since takes the value of the
        optimizer being loaded into. The dict passed in is not modified.
        """
        if len(state_dict.get("param_groups", ())) != len(self.param_groups):
            raise ValueError(
                f"the state dict has {len(state_dict.get('param_groups', ()))} param groups, this optimizer "
                f"{len(self.param_groups)}: build the optimizer with the same param_groups(...) as when it was saved")
        groups = zip(state_dict["param_groups"], self.param_groups)
        state_dict = {**state_dict, "param_groups": [_upgrade_group(s, g, self.defaults) for s, g in groups]}
        super().load_state_dict(state_dict)
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(ids, params):
            saved = state_dict["state"].get(pid, {})
            for k in _FP32_STATE:
                if k in saved:
                    self.state[p][k] = saved[k].detach().to(device=p.device, dtype=_state_dtype(p)).clone()
        extra = state_dict.get("muonclip", {})
        self.steps_taken = int(extra.get("steps_taken", 0))
        self.steps_skipped = int(extra.get("steps_skipped", 0))


_OLD_SCALES = {"rms": "match_rms_adamw", "shape": "original", "none": "unscaled"}


def _upgrade_group(saved: dict[str, Any], own: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """A saved param group in this version's keys (see `Muon.load_state_dict`); a new dict."""
    group = dict(saved)
    if "update_scale" in group:
        old = group.pop("update_scale")
        if old not in _OLD_SCALES:
            raise ValueError(f"saved param group has update_scale={old!r}; expected one of {sorted(_OLD_SCALES)}")
        group["adjust_lr_fn"] = _OLD_SCALES[old]
    if "steps" in group and "ns_steps" not in group:
        group["ns_steps"] = group.pop("steps")
    if "adamw_eps" not in group and group.get("algorithm", "muon") == "adamw" and "eps" in group:
        group["adamw_eps"], group["eps"] = group["eps"], defaults["eps"]
    for key, value in own.items():
        group.setdefault(key, value)
    return group


@dataclass
class _Structure:
    """What a one-process step does that depends only on shapes, devices and structural options.

    Attributes:
        buckets, n_blocks: `muonclip.optim.buckets.make_buckets` of every item.
        scales: per item ``(axis, ranges)`` (`muonclip.optim.buckets.item_scales`).
        flops: Newton–Schulz flops of the step.
    """

    buckets: list
    n_blocks: dict[int, int]
    scales: list[tuple[int, list[tuple[int, int, float]]]]
    flops: int


def _same(t: Tensor) -> Tensor:
    return t


def _state_dtype(p: Tensor) -> torch.dtype:
    """Buffers are float32, or the parameter's dtype when that is wider (float64)."""
    return torch.promote_types(p.dtype, torch.float32)


def _zeros_fp32(p: Tensor) -> Tensor:
    return torch.zeros_like(p, dtype=_state_dtype(p), memory_format=torch.contiguous_format)


def _name(opt: Muon, group: dict[str, Any], i: int) -> str:
    names = group.get("param_names")
    if names:
        return f"parameter '{names[i]}'"
    gi = next(k for k, g in enumerate(opt.param_groups) if g is group)
    return f"parameter {i} of param group {gi} (shape {tuple(group['params'][i].shape)})"


def _number(name: str, value: Any) -> float:
    """``value`` as a float (a one-element tensor is read once, here: a sync on a GPU, never in a step)."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None


def _check_positive(name: str, value: Any) -> None:
    v = _number(name, value)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_hyperparameters(options: dict[str, Any], where: str) -> None:
    """Raise a ValueError naming the first of lr, weight_decay, momentum, eps, adamw_eps, betas
    that is not a finite number in its range (nan and +-inf never are: they would reach every weight)."""
    for key in ("lr", "weight_decay"):
        v = _number(key, options[key])
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{where}{key} must be a finite number >= 0, got {options[key]!r}")
    if not 0.0 <= _number("momentum", options["momentum"]) < 1.0:
        raise ValueError(f"{where}momentum must be in [0, 1), got {options['momentum']!r}")
    _check_positive(f"{where}eps", options["eps"])
    _check_positive(f"{where}adamw_eps", options["adamw_eps"])
    betas = options["betas"]
    if len(betas) != 2 or not all(0.0 <= _number("betas", b) < 1.0 for b in betas):
        raise ValueError(f"{where}betas must be two numbers in [0, 1), got {betas!r}")


def _validate_group(group: dict[str, Any]) -> None:
    """Raise a ValueError/TypeError naming the option or parameter that is wrong, and the fix."""
    algorithm = group["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    _check_hyperparameters(group, "a param group's ")
    check_method(group["method"], group["ns_steps"], group["orth_dtype"], group["ns_coefficients"])
    names = group.get("param_names") or [None] * len(group["params"])
    for i, (p, name) in enumerate(zip(group["params"], names)):
        label = f"parameter '{name}'" if name else f"parameter {i} (shape {tuple(p.shape)})"
        if p.is_complex():
            raise TypeError(f"{label} is complex; muonclip.Muon supports real parameters only")
        if algorithm == "muon":
            if p.ndim < 2:
                raise ValueError(
                    f"{label} has shape {tuple(p.shape)}: Muon orthogonalises matrices, so 0-D/1-D "
                    "tensors (biases, norm gains, scalars) must go in an algorithm='adamw' group; "
                    "muonclip.param_groups(model) routes them for you"
                )
            check_matrix_options(p.shape, group["flatten"], group["split_sizes"], group["transposed"],
                                 group["split_groups"])


__all__ = ["Muon", "NonFiniteGradError"]
