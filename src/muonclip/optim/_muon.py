"""`Muon`: the Muon optimizer for hidden matrices, with an AdamW branch, in one object.

A thin ``torch.optim.Optimizer`` shell (Keller Jordan's three layers: orthogonaliser, per-matrix
update, thin class). This module is its public face: the spec (the class docstring), the
constructor, param groups, repr and state dicts (their forms and conversions:
`muonclip.optim._state_dicts`, `muonclip.optim._torch_state_dicts`; their checks:
`muonclip.optim._state_validation`). What a ``step()`` runs, the counters it keeps and each
weight's state are its base class's, `muonclip.optim._stepping.MuonStepping`: every Muon weight
handed to the one step body (`muonclip.optim.functional.muon_step`: momentum, V written into
same-shape buckets, one orthogonalisation per bucket, the update), the AdamW groups to
`muonclip.optim._adamw`. What it accepts is checked by `muonclip.optim._validation`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ..common import defaults as D
from . import _state_dicts as state_dicts
from . import _state_validation as state_validation
from . import _torch_state_dicts as torch_state_dicts
from ._buckets import StructureCache
from ._matrices import matrix_spec
from ._precision import orth_dtype_choice, orth_dtype_name
from ._scale import scale_name
from ._stepping import MuonStepping, second_moment_state
from ._unrouted import refuse_model, refuse_unrouted
from ._validation import (
    ON_NONFINITE,
    check_group,
    check_hyperparameters,
)
from ._wrappers import run_build_hooks, wrapped_optimizer
from .multiprocess import StepStats
from .workspace import Workspace, make_workspace


class Muon(MuonStepping):
    r"""Muon (MomentUm Orthogonalized by Newton–Schulz) with an AdamW branch.

    For every parameter in a group with ``algorithm="muon"`` (hidden matrices), one step is
    (`muonclip.optim.functional.muon_step`, the one step body)::

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
    `muonclip.param_groups` sets from the model (`muonclip.optim._matrices`): ``flatten``
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
    gradients and is undone where the flag is set (`muonclip.optim._nonfinite_mask`: a copy of the
    parameters and the optimizer state per step; a finite step is exactly the default mode's).
    In that mode ``steps_taken`` counts masked steps too, AdamW's bias-correction step number
    advances on them, the zeroed gradients stay zeroed, and reading ``steps_skipped`` syncs.
    Either way no weight and no buffer sees a non-finite value.

    The first nine arguments (``params`` to ``adjust_lr_fn``) are torch.optim.Muon's, with
    torch's meaning (``adjust_lr_fn``'s default excepted, see below), so the class drops in for
    it; the rest are ours.

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
        adjust_lr_fn: the update scale (`muonclip.optim._scale`): ``"match_rms_adamw"`` =
            0.2 sqrt(max(A, B)) (default; update RMS 0.2, like AdamW's), ``"original"`` or None
            = sqrt(max(1, A/B)) (torch.optim.Muon's default, Keller Jordan's), ``"unscaled"`` = 1.
        method: orthogonalisation method, ``"ns5"`` (default), ``"polar_express"``, ``"gram"``,
            ``"svd"`` or any name in ``muonclip.ortho.METHODS``.
        orth_dtype: compute dtype of the orthogonalisation (default ``"auto"``: bfloat16 where
            the parameters' device multiplies it natively — a CUDA GPU of compute capability 8.0
            or more, a CPU with AMX-BF16 or AVX512-BF16 — and float32 elsewhere, resolved per
            device when the step builds its buckets, `muonclip.ortho._precision`; the method's
            own default for one without bfloat16, ``"svd"``: float64). A dtype
            (``torch.bfloat16``, ``torch.float32`` for accuracy, ``torch.float64`` for svd) is
            used on every device. The two differ by rounding only; the optimizer's repr names
            the dtype each device gets and why.
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
            ``"local"`` turns communication off. A ``ProcessGroup`` is the group itself: under
            pipeline parallelism, the ranks of this rank's stage (its data, tensor and
            expert-parallel ranks; ``"local"`` when a stage is one rank), since a stage's
            parameters are not replicated on the other stages' ranks, which the mesh or the
            default group would include (docs/design.md, "Pipeline parallelism"). ``last_step_stats``
            (`muonclip.optim.multiprocess.StepStats`) reports this rank's share.
        comm_dtype: wire dtype of those exchanges (default None: the momentum dtype,
            float32). ``torch.bfloat16`` halves the bytes; where the orthogonalisation runs in
            bfloat16 it is lossless for the built-in methods.
        workspace: where buckets live and how they are orthogonalised
            (`muonclip.optim.workspace`): ``"auto"`` (default: ``"buffered"`` for CPU parameters,
            buffers reused through a step and freed when it ends, measured faster there,
            docs/benchmarks.md; ``"core"`` elsewhere), ``"core"`` (the pure functions, fresh
            tensors each step), ``"buffered"``, or a workspace object such as
            ``muonclip.fast.BufferedWorkspace(chunk="cache")``. Never changes what is computed.
        normuon: NorMuon (Li et al., arXiv 2510.05491, as microsoft/dion's ``NorMuon``
            defines it; the formulas: `muonclip.optim.functional`): after orthogonalisation
            each row of each matrix (an output neuron) is divided by the root of an EMA of its
            mean square (state ``neuron_second_moment``, float32), and the matrix rescaled to
            the Frobenius norm it had, so ``adjust_lr_fn`` still sets the update's size
            (default False). Each matrix that is orthogonalised (a fused split's block, a
            stack's expert) is normalised alone, over its whole rows, also when the weight is
            sharded (the owner rank does it).
        normuon_beta2: NorMuon's EMA coefficient in [0, 1) (default 0.95, dion's and the
            paper's).
        cautious_weight_decay: decay only the elements where the update that is subtracted
            and the weight agree in sign, ``O_ij W_ij >= 0`` (modded-nanogpt's record 43 and
            dion's ``cautious_wd``, after Chen et al., arXiv 2510.12402; default False).
        momentum_8bit: keep the momentum as int8 with a float32 absmax scale per block of at
            most 256 elements of a row (state ``momentum_int8``, ``momentum_scale`` instead of
            ``momentum_buffer``; about 1 byte per element instead of 4), dequantised for the
            step (`muonclip.optim._quantized`: the blocks, and why they never cross a row, a
            matrix of a stack or fused split, or a shard; default False).

    Every number above (``lr``, ``momentum``, ``weight_decay``, ``betas``, ``adamw_eps``,
    ``eps``, ``ns_coefficients``), given here, in a group (``add_param_group`` too) or in a
    loaded state dict, must be a number (an int or a float; not a string or a bool), finite and
    in its range, and small enough that what the step computes from it fits the parameters'
    dtype (``lr * scale`` of each matrix, ``lr * weight_decay``, AdamW's ``lr / (1 - beta1)``:
    ``lr=1e39`` overflows float32): a ValueError names the one that is not and the largest value
    that fits (nan or inf would reach every weight; `muonclip.optim._validation`); so does a
    ``betas`` that is not two numbers. The flags (``nesterov``, ``normuon``,
    ``cautious_weight_decay``, ``momentum_8bit``) must be True or False. ``lr`` (and
    ``weight_decay``) may be a one-element tensor of any shape (``()``, ``(1,)``, ``(1, 1)``),
    as in torch.optim: the step reads its value each time (on a GPU, one host sync per group
    and step). Complex parameters are refused when added (TypeError): the orthogonalisation and
    the update scale are defined for real matrices. Everything after ``lr`` is keyword-only,
    because torch.optim.Muon's positional order differs: a positional call could silently mean
    other settings.

    A step is all or nothing: before it changes any parameter, buffer or counter it checks again
    what the groups hold now (``lr`` and ``weight_decay`` every step, as a scheduler may set
    them; every other setting when one changed; a parameter on the meta device, which has no
    data, is refused with a ValueError naming it; the optimizer-wide counters, which their setters
    check too), so a value set between steps that the step could not run with raises there, and
    the optimizer is as it was. torch's step hooks (global and per instance) run once per step.

    NorMuon, cautious weight decay and 8-bit momentum are per group too (keys ``normuon``,
    ``normuon_beta2``, ``cautious_weight_decay``, ``momentum_8bit``), all off by default; the
    whole update with them: `muonclip.optim.functional`.

    State: per parameter ``momentum_buffer`` (Muon; ``momentum_int8`` and ``momentum_scale``
    with ``momentum_8bit``; plus ``neuron_second_moment`` with ``normuon``) or ``step``,
    ``exp_avg``, ``exp_avg_sq`` (AdamW); the optimizer-wide ``steps_taken`` (steps applied)
    and ``steps_skipped`` are attributes, copied into every param group (so a parameter swapped
    by a wrapper, or a state dict flattened per parameter, keeps them;
    `muonclip.optim._state_dicts`). A state dict that has taken steps holds every entry's whole
    state (`muonclip.optim._state_validation`). ``state_dict()`` writes dtypes (``orth_dtype``) as strings,
    so any checkpointer can save it; ``orth_dtype="auto"`` is saved as ``"auto"``, so a state
    loaded on another kind of machine resolves it there. `load_state_dict` also takes torch.optim.Muon's state dict
    (momentum converted: torch keeps an average, we keep a sum); `torch_state_dict` gives one
    torch.optim.Muon or torch.optim.AdamW continues; `load_torch_state_dicts` takes torch's
    Muon + AdamW pair into this one optimizer (docs/migrating.md).

    References:
        K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024).
        J. Liu et al., "Muon is Scalable for LLM Training" (Moonlight), arXiv 2502.16982.
        Kimi Team, "Kimi K2: Open Agentic Intelligence", arXiv 2507.20534.
    """


    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float | Tensor = D.LR,
        *,
        weight_decay: float = D.WEIGHT_DECAY,
        momentum: float = D.MOMENTUM,
        nesterov: bool = D.NESTEROV,
        ns_coefficients: tuple[float, float, float] | None = D.NS_COEFFICIENTS,
        eps: float = D.EPS,
        ns_steps: int | None = D.NS_STEPS,
        adjust_lr_fn: str | None = D.ADJUST_LR_FN,
        method: str = D.METHOD,
        orth_dtype: torch.dtype | str | None = D.ORTH_DTYPE,
        betas: tuple[float, float] = D.BETAS,
        adamw_eps: float = D.ADAMW_EPS,
        on_nonfinite: str = "raise",
        process_group: Any = None,
        comm_dtype: torch.dtype | None = None,
        workspace: str | Workspace = "auto",
        normuon: bool = False,
        normuon_beta2: float = D.NORMUON_BETA2,
        cautious_weight_decay: bool = False,
        momentum_8bit: bool = False,
    ) -> None:
        refuse_model(type(self).__name__, params)
        run_build_hooks()  # the layers' (muonclip.optim._wrappers): e.g. accelerate's wrapper passing attributes on
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {ON_NONFINITE}, got {on_nonfinite!r}")
        defaults = dict(
            algorithm="muon",
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=tuple(ns_coefficients) if isinstance(ns_coefficients, list) else ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=scale_name(adjust_lr_fn),
            method=method,
            orth_dtype=orth_dtype,
            betas=tuple(betas) if isinstance(betas, list) else betas,
            adamw_eps=adamw_eps,
            split_sizes=None,
            split_groups=1,
            flatten=False,
            transposed=False,
            normuon=normuon,
            normuon_beta2=normuon_beta2,
            cautious_weight_decay=cautious_weight_decay,
            momentum_8bit=momentum_8bit,
        )
        check_hyperparameters(defaults)  # even where every group sets its own
        self.on_nonfinite = on_nonfinite
        self.process_group = process_group
        self.comm_dtype = comm_dtype
        self.workspace = make_workspace(workspace)
        self.last_step_stats = StepStats()
        self._checked: dict[int, tuple[Any, ...]] = {}  # per group: what the last full check of a step saw
        self.steps_taken = 0
        self.steps_skipped = 0
        # on_nonfinite="mask": the last step's device flag (True: masked), for what runs after it
        self.last_masked: Tensor | None = None
        self._structures = StructureCache()  # the step's structure (buckets, plan), by shapes and options
        self._mask_copies: list[Tensor] = []  # on_nonfinite="mask": the snapshot, reused between steps
        super().__init__(params, defaults)  # add_param_group copies the counters into each group

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after validating it (`muonclip.optim._validation.check_group`); see the class
        docstring for its keys. A group that fails is not added."""
        if param_group.get("algorithm", "muon") == "adamw" and "eps" in param_group:
            raise ValueError("in an algorithm='adamw' group AdamW's epsilon is 'adamw_eps' ('eps' is Newton–Schulz's)")
        if "adjust_lr_fn" in param_group:
            param_group["adjust_lr_fn"] = scale_name(param_group["adjust_lr_fn"])
        refuse_unrouted(type(self).__name__, param_group)
        super().add_param_group(param_group)
        try:
            check_group(self.param_groups[-1])
        except (ValueError, TypeError):
            self.param_groups.pop()
            raise
        self._record_wide_state()

    def __repr__(self) -> str:
        """torch's optimizer repr, where a Muon group's ``orth_dtype: auto`` also names the dtype
        it resolves to on each device of the group's parameters, and why
        (`muonclip.optim._precision`), e.g. ``orth_dtype: auto -> bfloat16 on cpu (the CPU has
        AMX-BF16 and AVX512-BF16)``."""
        lines = [f"{type(self).__name__} ("]
        for i, group in enumerate(self.param_groups):
            lines.append(f"Parameter Group {i}")
            for key in sorted(group):
                if key == "params":
                    continue
                value = group[key]
                if key == "orth_dtype" and value == D.AUTO and group["algorithm"] == "muon":
                    devices = dict.fromkeys(p.device for p in group["params"]) or [torch.device("cpu")]
                    value = "auto -> " + "; ".join(
                        f"{orth_dtype_name(choice[0])} on {d} ({choice[1]})"
                        for d, choice in ((d, orth_dtype_choice(D.AUTO, group["method"], d)) for d in devices))
                lines.append(f"    {key}: {value}")
        return "\n".join(lines) + "\n)"

    def _kept_for_load(self) -> dict[str, Any]:
        """What `load_state_dict` puts back when a load fails after torch replaced the state: the
        objects a load replaces (the state, the param groups, the step check's record) and the
        counters."""
        keys = ("state", "param_groups", "_checked", "_taken", "_skipped_host", "_masked_count")
        return {k: self.__dict__[k] for k in keys if k in self.__dict__}

    def _put_back(self, kept: dict[str, Any]) -> None:
        """Undo a failed load with what `_kept_for_load` returned."""
        self.__dict__.update(kept)

    # ----------------------------------------------------------------------------------------
    # state
    # ----------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        """An attribute this object lacks, from the optimizer it wraps: a framework's wrapper made
        an instance of this class (Lightning's ``LightningOptimizer``, ``self.optimizers()``;
        accelerate's ``AcceleratedOptimizer``, `muonclip.integrations.accelerate`) holds the
        optimizer and none of its attributes, so ``clip_stats()``, ``tau``, ``steps_taken``,
        ``last_max_logits`` ... read through it are the optimizer's (`muonclip.optim._wrappers`).
        Anything else: AttributeError."""
        inner = wrapped_optimizer(self, Muon)
        if inner is not None:
            return getattr(inner, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __getstate__(self) -> dict[str, Any]:
        # torch keeps only defaults/state/param_groups (its hooks are not copied); keep our
        # settings and counters too (copy.deepcopy and pickle go through here). The cached
        # structure and copies are not state.
        kept = {k: v for k, v in self.__dict__.items() if not k.startswith("_optimizer_")}
        return {**kept, "_structures": StructureCache(), "_mask_copies": [], "_checked": {}, "_wide_stepped": None}

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer state dict in its saved form (`muonclip.optim._state_dicts.saved_form`:
        dtypes as strings); every param group holds the optimizer-wide values (``steps_taken``,
        ``steps_skipped``)."""
        self._flat_driver(force=True)  # a wrapper stepping flat partitions (DeepSpeed ZeRO) binds here if not yet
        self.steps_skipped  # noqa: B018  (folds a masked count kept on the device into the groups)
        self._whole_state()
        self._record_wide_state()
        return state_dicts.saved_form(super().state_dict())

    def _whole_state(self) -> None:
        """Make the state whole before it is saved (`muonclip.optim._state_validation`: a state that
        has taken steps holds every entry's state): an empty entry (a weight looked up in
        ``state`` that never had a gradient) holds nothing and is dropped; a stepped Muon weight of
        a group whose ``normuon`` was switched on since its last step gets the zero second moment
        its next step would create (`second_moment_state`)."""
        for p in [p for p, entry in self.state.items() if not entry]:
            del self.state[p]
        for g in self.param_groups:
            if g["algorithm"] == "muon" and g["normuon"]:
                for p in g["params"]:
                    entry = self.state.get(p)
                    if entry and "neuron_second_moment" not in entry:
                        second_moment_state(entry, p, g, matrix_spec(tuple(p.shape), g))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict of this optimizer or of torch.optim.Muon.

        What is recognised and how it is converted: `muonclip.optim._state_dicts`. Every group is
        validated as the constructor validates its arguments, and every state tensor and counter
        against its parameter (`muonclip.optim._state_validation`: shape, dtype, finite values,
        ``exp_avg_sq >= 0``, whole step counts >= 0), before anything is loaded: a ValueError names
        the group or parameter and the entry, and the optimizer is left as it was. A state that
        has taken steps must hold every entry's whole state (a Muon weight's momentum, ...), and
        no tensor may be on the meta device. A load that fails later (a tensor that cannot be
        copied to its parameter's device, a post-hook that raises) puts the state, the param
        groups and the counters back as they were before raising. Momentum
        and AdamW moments stay float32 (float64 for float64 parameters) whatever the parameter
        dtype. torch's load_state_dict hooks run as for any optimizer: pre-hooks see (and may
        replace) the dict as given, post-hooks see the loaded state. The dict passed in is not
        modified.
        """
        self._flat_driver(force=True)  # bound to a wrapper's flat partitions (DeepSpeed ZeRO): they pass the checks
        kept: dict[Any, dict[str, Tensor]] = {}
        saved_groups: list[dict[str, Any]] = []

        def prepare(opt: Muon, sd: dict[str, Any]) -> dict[str, Any]:  # after every user pre-hook
            sd = state_dicts.prepare(sd, opt.param_groups, tuple(opt._wide_state()))
            state_validation.check_loaded_state(sd, opt.param_groups)
            sd, stashed = state_dicts.split_fp32_state(sd)
            kept.update(stashed)
            saved_groups.extend(sd["param_groups"])
            return sd

        def finish(opt: Muon) -> None:  # before every user post-hook
            state_dicts.restore_fp32_state(opt.state, opt.param_groups, saved_groups, kept)
            opt._load_wide_state(dict(opt.param_groups[0]) if opt.param_groups else {})
            opt._structures.clear()
            opt._checked = {}

        pre = self.register_load_state_dict_pre_hook(prepare)
        post = self.register_load_state_dict_post_hook(finish, prepend=True)
        kept = self._kept_for_load()
        try:
            super().load_state_dict(state_dict)
        except BaseException:
            self._put_back(kept)
            raise
        finally:
            pre.remove()
            post.remove()

    def torch_state_dict(self, algorithm: str = "muon") -> dict[str, Any]:
        """A state dict that torch.optim.Muon (``algorithm="muon"``) or torch.optim.AdamW
        (``"adamw"``) continues exactly: the groups of that algorithm, in order, parameters
        numbered from 0 in that order.

        For Muon: torch's momentum convention (``buf = (1 - mu) M``, the average torch keeps),
        concrete ``ns_steps`` and ``ns_coefficients``. Only groups whose settings torch can
        express: ``method`` ns5 (or ``ns5_sym``/``ns5_compiled``, the same quintic),
        ``orth_dtype`` bfloat16 or ``"auto"``, ``adjust_lr_fn`` "original" or "match_rms_adamw", 2-D weights
        orthogonalised whole; anything else raises a ValueError that names it. For AdamW: the
        moments, ``step`` as a float32 tensor, ``eps`` = our ``adamw_eps``. Build the torch
        optimizer with those groups' parameters, in the same groups and order, then
        ``load_state_dict`` this (docs/migrating.md).
        """
        return torch_state_dicts.torch_state_dict(self.state_dict(), self.param_groups, algorithm)

    def load_torch_state_dicts(self, muon: dict[str, Any], adamw: dict[str, Any] | None = None, *,
                               muon_params: Sequence[Tensor] | None = None,
                               adamw_params: Sequence[Tensor] | None = None) -> None:
        """Load torch's pair, a torch.optim.Muon and a torch.optim.AdamW state dict, into this one optimizer.

        Each parameter takes its state from the torch optimizer that held it (Muon's momentum
        converted to our sum, ``M = buf / (1 - mu)``; AdamW's moments and step as they are) and
        its group takes the settings of the torch group(s) its parameters come from (they must
        agree). Parameters are matched by ``muon_params``/``adamw_params`` (the tensors, in the
        order torch's optimizers were given them) or, without them, by name (torch's groups have
        ``param_names`` when built from ``model.named_parameters()``; ours from
        ``muonclip.param_groups(model)``). ``steps_taken`` becomes AdamW's largest step. Raises
        ValueError for a parameter found in neither dict or in the wrong algorithm's, and for
        anything `load_state_dict` refuses (docs/migrating.md).
        """
        self.load_state_dict(torch_state_dicts.from_torch(self.state_dict(), self.param_groups, muon, adamw,
                                                    muon_params=muon_params, adamw_params=adamw_params))
