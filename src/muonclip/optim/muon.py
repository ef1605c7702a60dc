"""`Muon`: the Muon optimizer for hidden matrices, with an AdamW branch, in one object.

Three layers (Keller Jordan's muon.py, without its copied loops): the orthogonaliser
(`muonclip.ortho`), the per-matrix update rules (`matrices`, `scale`, `adamw`), and this thin
`torch.optim.Optimizer` shell that validates, keeps state and batches same-shape matrices.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from ..distributed.context import resolve_group
from ..distributed.step import StepStats, muon_step
from ..ortho import METHODS, check_method, orthogonalize
from .adamw import adamw_update
from .matrices import check_matrix_options
from .nonfinite import ON_NONFINITE, MaskedStep, NonFiniteGradError, StepGate, nonfinite_indices
from .scale import SCALES, TORCH_ADJUST_LR_FN

ALGORITHMS = ("muon", "adamw")
_UNSET: Any = object()
# State kept in float32 (float64 for float64 parameters) whatever the parameter dtype; torch's
# loader would cast it to the parameter dtype.
_FP32_STATE = ("momentum_buffer", "exp_avg", "exp_avg_sq")


class Muon(torch.optim.Optimizer):
    r"""Muon (MomentUm Orthogonalized by Newton–Schulz) with an AdamW branch.

    For every parameter in a group with ``algorithm="muon"`` (hidden matrices), one step is::

        G = grad
        M = momentum * M + G                    # state "momentum_buffer", float32
        V = G + momentum * M   if nesterov  else  M
        O = orth(V)                             # per matrix; see muonclip.orthogonalize
        W = W * (1 - lr * weight_decay)         # decoupled weight decay, base lr
        W = W - lr * scale(A, B) * O

    Groups with ``algorithm="adamw"`` (embeddings, LM head, norms, biases: see
    `muonclip.param_groups`) get torch.optim.AdamW's update with ``betas`` and ``eps``
    (state "exp_avg", "exp_avg_sq", "step"), all in one ``step()``.

    Matrices of the same shape and orthogonalisation settings, across parameters and groups,
    are orthogonalised as one batch. A 2-D weight is one matrix; a 3-D weight ``(E, A, B)``
    (stacked MoE experts) is E matrices; ``flatten=True`` (set for convolutions by
    `param_groups`, implied for ndim >= 4) views ``(out, ...)`` as ``(out, prod(rest))``;
    ``split_sizes`` cuts the rows into blocks orthogonalised separately (fused QKV, fused
    gate/up, per-head blocks), ``split_groups`` makes those blocks interleaved (GPT-NeoX's
    per-head ``[q k v]``); ``transposed=True`` (set by `param_groups` for transformers'
    ``Conv1D`` and its ``is_transposed`` experts) says a weight is stored ``(in, out)`` (or
    ``(E, in, out)``), so scale and splits use its ``(out, in)`` transpose. Each block gets the
    update scale of its own shape. See `muonclip.optim.matrices`.

    Before anything is updated, every gradient of the step is checked for NaN/inf (one host
    sync). ``on_nonfinite="raise"`` (default) raises `NonFiniteGradError` naming the parameter
    and the step; ``"skip"`` skips the whole step for every parameter and counts it in
    ``steps_skipped``. ``"mask"`` does what ``"skip"`` does without the host sync (for GPUs:
    the step never waits for the device): the flag stays on the device, the gradients are
    zeroed where it is set, and the step is computed with its coefficients (Muon's momentum,
    AdamW's betas, the weight decay and lr factors) as 0-D device tensors that make it an
    exact no-op where the flag is set (`muonclip.optim.nonfinite.StepGate`: no copy of any
    parameter or state, no extra memory traffic; with float32 weights an unmasked step is
    bit-identical to the default mode's). In that mode ``steps_taken`` counts masked steps
    too, AdamW's bias-correction step number advances on them, the zeroed gradients stay
    zeroed, and reading ``steps_skipped`` syncs. Either way no weight and no buffer sees a
    non-finite value.

    In one process on CPU, two buffers the size of the largest Newton–Schulz bucket (its
    same-shape matrices in the compute dtype: 7 MB for 24 matrices of 384 x 384 in bf16), one
    for the input and one for the result, are kept between steps and reused by every bucket,
    and on CPU Newton–Schulz keeps its temporaries there too (two more of that size, S and P;
    it normalises the input in place and alternates between it and the result). Fresh
    buffers each step cost thousands of page faults a step (glibc gives them back to the OS),
    7–10% of the step on the benchmark GPT set. They are scratch, not state (not in
    ``state_dict``, not copied). On CPU the first step also times how to feed each bucket to
    the matrix units (`muonclip.ortho.chunks`: about 1.3 s once on the benchmark GPT set); the
    choice never changes a result.

    Args:
        params: parameters or param groups. A group may set any option below, plus
            ``algorithm`` ("muon" default, or "adamw") and ``param_names`` (used in errors).
        lr: learning rate (default 1e-3). With ``update_scale="rms"`` AdamW's lr carries over.
        momentum: Muon momentum coefficient mu in [0, 1) (default 0.95).
        nesterov: use the Nesterov form ``G + mu M`` (default True).
        weight_decay: decoupled weight decay, multiplied by the base lr (default 0.1).
        update_scale: ``"rms"`` = 0.2 sqrt(max(A, B)) (default), ``"shape"`` =
            sqrt(max(1, A/B)), ``"none"`` = 1. See `muonclip.optim.scale`.
        method: orthogonalisation method, ``"ns5"`` (default), ``"polar_express"``, ``"svd"``
            or any name in ``muonclip.ortho.METHODS``.
        steps: iterations of the method (default None: the method's default, 5).
        orth_dtype: compute dtype of the orthogonalisation (default torch.bfloat16; float32
            for accuracy, float64 for svd).
        split_sizes: row blocks orthogonalised separately, e.g. ``[d, d_kv, d_kv]`` for a fused
            QKV weight (default None). Usually set per group, as `param_groups` does.
        split_groups: the rows are this many equal groups, each cut by ``split_sizes``, and
            block i is part i of every group (default 1: contiguous blocks). GPT-NeoX's
            interleaved ``query_key_value`` ``[h0: q k v | h1: q k v | ...]`` is
            ``split_sizes=[d, d, d], split_groups=n_heads``.
        flatten: view ``(out, ...)`` weights as ``(out, prod(rest))`` (default False; 4-D and
            higher are always flattened).
        transposed: the weights are stored as ``(in, out)``, like transformers' ``Conv1D``
            in GPT-2, or as stacked ``(E, in, out)`` experts (default False). The update
            scale (``"shape"`` is asymmetric) and ``split_sizes`` then refer to the
            ``(out, in)`` matrix. Usually set per group, as `param_groups` does.
        betas: AdamW branch moment coefficients (default (0.9, 0.95)).
        adamw_eps: AdamW branch epsilon (default 1e-8); inside an ``adamw`` group the key
            ``eps`` means this.
        on_nonfinite: ``"raise"`` (default), ``"skip"`` or ``"mask"`` (sync-free skip); see
            above.
        process_group: the group the Muon matrices are shared over (design.md 1.4). None
            (default) is automatic: the device mesh of DTensor parameters (FSDP2
            ``fully_shard``, ``Shard(0)``), else the default group when torch.distributed is
            initialised with > 1 rank (DDP: parameters replicated), else none (one process).
            Each matrix is orthogonalised once in the group, whole, on an owner rank chosen
            by flops, and the result exchanged. ``"local"`` turns communication off.
            ``last_step_stats`` (`muonclip.distributed.step.StepStats`) reports this rank's
            share: matrices, Newton–Schulz flops, bytes sent.
        comm_dtype: wire dtype of those exchanges (default None: the momentum dtype,
            float32). ``torch.bfloat16`` halves the bytes; with ``orth_dtype=torch.bfloat16``
            it is lossless for the built-in methods.
        eps: torch.optim.Muon's name: added to the Frobenius norm before Newton–Schulz
            (default 1e-7).
        ns_coefficients: torch.optim.Muon's name: the quintic's (a, b, c) for the methods that
            run the quintic (``"ns5"``, ``"gram"``, ``"ns5_sym"``, ``"ns5_compiled"``; default
            None: (3.4445, -4.7750, 2.0315)); an error with any other method.
        ns_steps: torch.optim.Muon's name for ``steps``.
        adjust_lr_fn: torch.optim.Muon's name for the scale: None or ``"original"`` means
            ``update_scale="shape"``, ``"match_rms_adamw"`` means ``"rms"``. Give either this
            or ``update_scale``, not both.

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
        momentum: float = 0.95,
        nesterov: bool = True,
        weight_decay: float = 0.1,
        update_scale: str | None = None,
        method: str = "ns5",
        steps: int | None = None,
        orth_dtype: torch.dtype = torch.bfloat16,
        split_sizes: Sequence[int] | None = None,
        split_groups: int = 1,
        flatten: bool = False,
        transposed: bool = False,
        betas: tuple[float, float] = (0.9, 0.95),
        adamw_eps: float = 1e-8,
        on_nonfinite: str = "raise",
        process_group: Any = None,
        comm_dtype: torch.dtype | None = None,
        eps: float = 1e-7,
        ns_coefficients: tuple[float, float, float] | None = None,
        ns_steps: int | None = None,
        adjust_lr_fn: str | None = _UNSET,
    ) -> None:
        if adjust_lr_fn is not _UNSET:
            if update_scale is not None:
                raise ValueError("give update_scale or torch's adjust_lr_fn, not both")
            if adjust_lr_fn not in TORCH_ADJUST_LR_FN:
                raise ValueError(
                    f"adjust_lr_fn must be one of {list(TORCH_ADJUST_LR_FN)}, got {adjust_lr_fn!r}"
                )
            update_scale = TORCH_ADJUST_LR_FN[adjust_lr_fn]
        if ns_steps is not None:
            if steps is not None and steps != ns_steps:
                raise ValueError(f"steps={steps} and ns_steps={ns_steps} disagree; give one of them")
            steps = ns_steps
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        _check_positive("adamw_eps", adamw_eps)
        defaults = dict(
            algorithm="muon",
            lr=lr,
            momentum=momentum,
            nesterov=nesterov,
            weight_decay=weight_decay,
            update_scale="rms" if update_scale is None else update_scale,
            method=method,
            steps=steps,
            orth_dtype=orth_dtype,
            split_sizes=None if split_sizes is None else list(split_sizes),
            split_groups=split_groups,
            flatten=flatten,
            transposed=transposed,
            betas=tuple(betas),
            eps=eps,
            ns_coefficients=None if ns_coefficients is None else tuple(ns_coefficients),
        )
        _check_hyperparameters(defaults, "")  # even where every group sets its own
        self.adamw_eps = adamw_eps
        self.on_nonfinite = on_nonfinite
        self._workspace: dict[Any, Any] = {}  # step structure (cached) and, on CPU, bucket buffers reused between steps
        self.process_group = process_group
        self.comm_dtype = comm_dtype
        self.last_step_stats = StepStats()
        self.steps_taken = 0
        self.steps_skipped = 0
        # on_nonfinite="mask": the last step's device flag (True: masked), for what runs after it
        self.last_masked: Tensor | None = None
        super().__init__(params, defaults)

    # ----------------------------------------------------------------------------------------
    # validation
    # ----------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after validating it; see the class docstring for its keys."""
        algorithm = param_group.get("algorithm", self.defaults["algorithm"])
        if algorithm == "adamw" and "eps" not in param_group:
            param_group["eps"] = self.adamw_eps
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
        live = [
            (g, i, p) for g in self.param_groups for i, p in enumerate(g["params"]) if p.grad is not None
        ]
        for g, i, p in live:
            if p.grad.is_sparse:
                raise ValueError(
                    f"{_name(self, g, i)} has a sparse gradient; Muon and its AdamW branch need dense "
                    "gradients (build the embedding with sparse=False)"
                )
        # distributed: a clear error (no process group, mixed meshes, bad placement) before any collective
        resolve_group([p for _, _, p in live], lambda k: _name(self, live[k][0], live[k][1]), self.process_group)
        guard = None
        if self.on_nonfinite == "mask":  # sync-free: decided on the device, every update gated (no copies)
            guard = MaskedStep([p for _, _, p in live], [self.state[p] for _, _, p in live],
                               gated=[p for _, _, p in live])
        self.last_masked = None if guard is None else guard.found
        bad = [] if guard is not None else nonfinite_indices([p.grad for _, _, p in live])
        if bad:
            names = ", ".join(_name(self, live[k][0], live[k][1]) for k in bad[:5])
            if self.on_nonfinite == "skip":
                self.steps_skipped += 1
                return loss
            raise NonFiniteGradError(
                f"non-finite gradient (NaN or inf) in {names} at step {self.steps_taken + 1}; "
                "no parameter was updated. Check the loss and the learning rate, clip gradients, "
                "or pass on_nonfinite='skip' to skip such steps."
            )
        self.steps_taken += 1
        gate = None if guard is None else guard.gate
        self._muon_step(gate)  # on every rank, even one without grads: it runs collectives
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                self._adamw_group(group, gate)
        if guard is not None:
            guard.restore()
            self._count_masked(guard.found)
        return loss

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

    def _muon_step(self, gate: StepGate | None = None) -> None:
        """Momentum, orthogonalisation and update of every Muon parameter with a grad.

        One code path for one process, DDP and FSDP2: `muonclip.distributed.step.muon_step`
        (phases: agree across ranks, momentum on local rows, plan owners by flops, gather
        whole V to owners, one ``orthogonalize`` per bucket of same-shape blocks, exchange
        results, scale and apply). Every Muon parameter takes part, with or without a
        gradient, so that all ranks enter the same collectives. ``gate``: the masked step's
        `muonclip.optim.nonfinite.StepGate` (``on_nonfinite="mask"``).
        """
        params = [
            (g, p, partial(_name, self, g, i))  # the name is only formatted for an error
            for g in self.param_groups if g["algorithm"] == "muon"
            for i, p in enumerate(g["params"])
        ]
        self.last_step_stats = muon_step(
            params, self.state, _zeros_fp32, self.process_group, self.comm_dtype, orthogonalize=orthogonalize,
            workspace=self.__dict__.setdefault("_workspace", {}), gate=gate,
        )

    def _adamw_group(self, group: dict[str, Any], gate: StepGate | None = None) -> None:
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
                eps=group["eps"], weight_decay=group["weight_decay"], gate=gate,
            )

    # ----------------------------------------------------------------------------------------
    # state
    # ----------------------------------------------------------------------------------------

    def __getstate__(self) -> dict[str, Any]:
        # torch keeps only defaults/state/param_groups; keep our settings and counters too
        # (copy.deepcopy and pickle go through here). The step's scratch buffers are not state.
        return {**self.__dict__, "_workspace": {}}

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict plus ``"muonclip"``: step and skipped-step counters."""
        sd = super().state_dict()
        sd["muonclip"] = {"steps_taken": self.steps_taken, "steps_skipped": self.steps_skipped}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; float32 buffers stay float32 even for bf16 parameters.

        (torch's loader casts floating state to the parameter dtype, which would turn the
        float32 momentum into bf16 after a resume.)
        """
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
    """Raise a ValueError naming the first of lr, weight_decay, momentum, eps, betas that is not
    a finite number in its range (nan and +-inf never are: they would reach every weight)."""
    for key in ("lr", "weight_decay"):
        v = _number(key, options[key])
        if not (math.isfinite(v) and v >= 0.0):
            raise ValueError(f"{where}{key} must be a finite number >= 0, got {options[key]!r}")
    if not 0.0 <= _number("momentum", options["momentum"]) < 1.0:
        raise ValueError(f"{where}momentum must be in [0, 1), got {options['momentum']!r}")
    eps = "eps (adamw_eps)" if options.get("algorithm") == "adamw" else "eps"
    _check_positive(f"{where}{eps}", options["eps"])
    betas = options["betas"]
    if len(betas) != 2 or not all(0.0 <= _number("betas", b) < 1.0 for b in betas):
        raise ValueError(f"{where}betas must be two numbers in [0, 1), got {betas!r}")


def _validate_group(group: dict[str, Any]) -> None:
    """Raise a ValueError/TypeError naming the option or parameter that is wrong, and the fix."""
    algorithm = group["algorithm"]
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    _check_hyperparameters(group, "a param group's ")
    if group["update_scale"] not in SCALES:
        raise ValueError(f"unknown update_scale {group['update_scale']!r}; choose one of {sorted(SCALES)}")
    check_method(group["method"], group["steps"], group["orth_dtype"], group["ns_coefficients"])
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
            check_matrix_options(p.shape, group["flatten"], group["split_sizes"], group.get("transposed", False),
                                 group.get("split_groups", 1))


__all__ = ["Muon", "NonFiniteGradError", "METHODS"]
