"""The step of `muonclip.Muon`: what one ``step()`` runs, and the optimizer-wide counters it keeps.

`MuonStepping` is the base class of `muonclip.Muon` (whose docstring is the spec; its
constructor, param groups and state dicts are in `muonclip.optim._muon`). A step checks what
the groups hold (`muonclip.optim._validation`) and the gradients, makes each Muon weight's
state (`momentum_state`, `second_moment_state`), hands every Muon weight to the one step body
(`muonclip.optim.functional.muon_step`) with the step's cached structure
(`muonclip.optim._buckets.StepStructure`) and the AdamW groups to `muonclip.optim._adamw`; over
several processes the same body runs with the distribution layer's exchanges
(`muonclip.optim.multiprocess.Exchange`), and a step in one process never enters that layer.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Sequence
from functools import partial
from operator import itemgetter
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..common._dtensor import is_dtensor
from . import _state_validation as state_validation
from ._adamw import adamw_step
from ._buckets import StepStructure, options_key, step_structure
from ._matrices import MatrixSpec, matrix_spec
from ._nonfinite_mask import MaskedStep
from ._quantized import dequantize, quant_blocks, quantize_, scale_like
from ._state_dicts import state_dtype
from ._validation import (
    GROUP_KEYS,
    NonFiniteGradError,
    check_group,
    check_step_params,
    finite_per_tensor,
    nonfinite_indices,
    step_numbers,
)
from ._wrappers import wrapped_optimizer
from .flat import ATTACHED, FlatDriver, flat_driver
from .functional import MuonWeight, muon_step
from .multiprocess import LOCAL, Engine, Exchange, StepStats, registered_engine

_SETTINGS = itemgetter(*(k for k in GROUP_KEYS if k not in ("lr", "weight_decay")))
"""A group's settings other than lr and weight decay (a step re-validates the group when they change)."""


class MuonStepping(torch.optim.Optimizer):
    """The step and the counters of `muonclip.Muon` (its base class: see `muonclip.Muon` for what
    they do; the attributes they use are set by `muonclip.Muon.__init__`)."""

    # ----------------------------------------------------------------------------------------
    # the step
    # ----------------------------------------------------------------------------------------

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Perform one optimisation step (all groups); ``closure`` re-evaluates the loss.

        torch's optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_pre_hook``
        and ``..._post_hook``, and this optimizer's ``register_step_pre_hook`` /
        ``register_step_post_hook``) run once around it. torch wraps the ``step`` of each
        optimizer class it builds in the code that runs them, so the body is `_muon_step`, which
        a subclass's own ``step`` calls (`muonclip.MuonClip` does) rather than a second wrapped
        ``step``. Stepped by a wrapper on flat partitions (DeepSpeed ZeRO), the step is its
        `muonclip.optim.flat.FlatDriver`'s.
        """
        driver = self._flat_driver()
        if driver is not None:
            return driver.step(closure)
        return self._muon_step(closure)

    @torch.no_grad()
    def _muon_step(self, closure: Callable[[], float] | None) -> float | None:
        """The step's body (see `step`): checks, the update of every group, the counters."""
        if self._wide_state() != self.__dict__.get("_wide_stepped"):  # set since the last step, or from a pickle
            state_validation.check_counters(self._wide_state(), f"{type(self).__name__}.")
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        collecting = gc.isenabled()
        gc.disable()  # restored below (`_checked_update` says why)
        try:
            self._checked_update()
        finally:
            if collecting:
                gc.enable()
        return loss

    def _checked_update(self) -> None:
        """What `_muon_step` runs after the closure: the checks, the update of every group (or
        none: a skipped step), the counters. Python's cycle collector is paused meanwhile (as it
        was, restored after): a step makes a few records per weight, all freed when it ends, and
        with tens of thousands of weights a collection they set off would walk every object of
        the process (a model of that many modules: seconds)."""
        numbers = self._check_groups()  # before anything changes: a step runs whole or not at all
        live = [(g, i, p, p.grad) for g in self.param_groups for i, p in enumerate(g["params"])]
        live = [t for t in live if t[3] is not None]  # (group, index, parameter, gradient) of each with one
        for g, i, _, grad in live:
            if grad.is_sparse:
                raise ValueError(
                    f"{_name(self, g, i)} has a sparse gradient; Muon and its AdamW branch need dense "
                    "gradients (build the embedding with sparse=False)"
                )
        params = [p for g in self.param_groups for p in g["params"]]
        engine = engine_for(params, self.process_group)
        ctx = None
        if engine is not None:  # a clear error (no process group, mixed meshes, bad placement) before any collective
            named = [(g, i) for g in self.param_groups for i in range(len(g["params"]))]
            ctx = engine.context(params, lambda k: _name(self, *named[k]), self.process_group)
        local = engine.local if engine is not None else _same
        grads = [t[3] for t in live]
        finite = finite_per_tensor(grads if engine is None else [local(g) for g in grads])
        if engine is not None:
            finite = engine.all_finite(grads, finite, ctx)
        if self.on_nonfinite == "mask":  # sync-free: decided on the device, undone there
            found = ~finite.all()
            guard = MaskedStep([t[2] for t in live], [self.state[t[2]] for t in live], found, local,
                               cache=self._mask_copies)
            self.last_masked = found
            self._update(engine, ctx, local, numbers, live)
            guard.restore()
            self._count_masked(found)
            self._end_step()
            return
        bad = nonfinite_indices(finite)
        if bad:
            if self.on_nonfinite == "skip":
                self._skipped_host += 1
                self._end_step()
                return
            names = ", ".join(_name(self, live[k][0], live[k][1]) for k in bad[:5])
            raise NonFiniteGradError(
                f"non-finite gradient (NaN or inf, or beyond 2^100) in {names} at step {self.steps_taken + 1}; "
                "no parameter was updated. Check the loss and the learning rate, clip gradients, "
                "or pass on_nonfinite='skip' to skip such steps."
            )
        self._update(engine, ctx, local, numbers, live)
        self._end_step()

    def _end_step(self) -> None:
        """Copy the optimizer-wide values a step leaves into the groups, and note them: the next
        step checks them again only if they changed since (a setter checks what it sets; a pickle
        restores them unchecked)."""
        self._record_wide_state()
        self._wide_stepped = self._wide_state()

    def _flat_driver(self, force: bool = False) -> FlatDriver | None:
        """The `muonclip.optim.flat.FlatDriver` stepping this optimizer on a wrapper's flat partitions
        (DeepSpeed ZeRO): the one attached, else the one a registered finder attaches now -- asked
        when the param groups changed since `_check_groups` last validated them (a wrapper swaps its
        partitions in; a plain step's groups stay as they were, so it asks once), or ``force``."""
        driver = self.__dict__.get(ATTACHED)
        if driver is not None:
            return driver
        checked = self.__dict__.get("_checked", {})
        changed = len(checked) != len(self.param_groups) or any(
            (seen := checked.get(id(g))) is None or seen[0] is not g["params"] or seen[1] != len(g["params"])
            for g in self.param_groups)
        return flat_driver(self) if force or changed else None

    def _check_groups(self) -> dict[int, tuple[float, float]]:
        """Every group's ``(lr, weight_decay)`` for this step, by ``id(group)``, after checking that
        the step can run on what the groups hold now (`muonclip.optim._validation.step_numbers`):
        a group whose other settings (or parameters) changed since the last step is validated
        whole again (`check_group`, and no parameter on the meta device). Raises ValueError
        (TypeError for a complex parameter) naming the group and value; nothing has changed then."""
        numbers, checked = {}, self.__dict__.setdefault("_checked", {})
        for gi, g in enumerate(self.param_groups):
            where = f"param group {gi}'s "
            settings, params = _SETTINGS(g), g["params"]
            seen = checked.get(id(g))
            if seen is None or seen[0] is not params or seen[1] != len(params) or seen[2] != settings:
                limits = check_group(g, where, f"param group {gi}: ")
                check_step_params(g, f"param group {gi}")
                seen = (params, len(params), settings, limits)
                checked[id(g)] = seen
            numbers[id(g)] = step_numbers(g, seen[3], where)
        return numbers

    def _update(self, engine: Engine | None, ctx: Any, local: Callable[[Tensor], Tensor],
                numbers: dict[int, tuple[float, float]], live: list[tuple[dict[str, Any], int, Tensor, Tensor]]
                ) -> None:
        """The Muon update of every Muon parameter with a gradient (``live``: ``(group, index,
        parameter, gradient)`` of every parameter with one; `muonclip.optim.functional.muon_step`, with the
        engine's exchanges over several ranks), then the AdamW groups', with each group's checked
        ``(lr, weight_decay)`` (`_check_groups`); ``steps_taken`` counts it once done."""
        stats = StepStats()
        exchange = None
        muon = [g for g in self.param_groups if g["algorithm"] == "muon"]
        if engine is not None and ctx.world_size > 1:  # on every rank, even one without grads: it runs collectives
            stats.world_size = ctx.world_size
            items = [(g, p, partial(_name, self, g, i))  # the name is only formatted for an error
                     for g in muon for i, p in enumerate(g["params"])]
            exchange = engine.exchange(items, ctx, self.comm_dtype, stats)
        live = [t for t in live if t[0]["algorithm"] == "muon"]
        if live:
            st = self._structure_of(live, local, exchange)
            settings = {id(g): (*numbers[id(g)], g["momentum"], g["nesterov"]) for g in muon}  # once per group
            tails = {id(g): (g["normuon_beta2"], g["cautious_weight_decay"]) for g in muon}
            weights = []
            for (g, _, p, grad), spec in zip(live, st.specs):
                state = self.state[p]
                buffer, quantized = momentum_state(state, p, g, spec, local)
                moment = second_moment_state(state, p, g, spec) if g["normuon"] else None
                weights.append(MuonWeight(local(p), local(grad), buffer, *settings[id(g)], moment, *tails[id(g)],
                                          quantized))
            try:
                stats.matrices = muon_step(weights, st, exchange)
            finally:  # what the workspaces kept for this step's buckets is not kept under the next forward
                st.end_step()
            stats.ns_flops, stats.total_ns_flops = st.flops, st.total_flops
        self.last_step_stats = stats
        for group in self.param_groups:
            if group["algorithm"] == "adamw":
                lr, wd = numbers[id(group)]
                adamw_step(group["params"], self.state, lr=lr, betas=group["betas"], eps=group["adamw_eps"],
                           weight_decay=wd, new_buffer=_zeros_fp32)
        self._taken += 1

    def _structure_of(self, live: list[tuple[dict[str, Any], int, Tensor, Tensor]],
                      local: Callable[[Tensor], Tensor], exchange: Exchange | None) -> StepStructure:
        """The step's structure (`muonclip.optim._buckets.StepStructure`), rebuilt only when a shape, a
        device, a structural option (`muonclip.optim._buckets.STRUCTURAL_OPTIONS`), the workspace or,
        over several ranks, the layout (`Exchange.key`) changed; a new one over several ranks is
        planned by the exchange (`Exchange.plan`)."""
        options: dict[int, tuple] = {}  # per group, once
        for g, *_ in live:
            if id(g) not in options:
                options[id(g)] = options_key(g)
        params = [t[2] for t in live]
        key = (self.workspace, None if exchange is None else exchange.key(params),
               tuple([options[id(t[0])] for t in live]), tuple([p.shape for p in params]),
               tuple([p.device for p in params]))
        st = self._structures.get(key)
        if st is None:
            pairs = [(g, p) for g, _, p, _ in live]
            plan = None
            if exchange is not None:
                names = [partial(_name, self, g, i) for g, i, *_ in live]
                plan = exchange.plan(pairs, names, [matrix_spec(p.shape, g) for g, p in pairs])
            st = step_structure(pairs, [local(p).device for p in params], self.workspace, plan)
            self._structures.put(key, st)
        return st

    # ----------------------------------------------------------------------------------------
    # counters: optimizer-wide, copied into every param group (state_dicts.WIDE_KEYS)
    # ----------------------------------------------------------------------------------------

    @property
    def steps_taken(self) -> int:
        """Steps applied (``"mask"`` mode: masked steps too). Setting it takes a whole number >= 0
        (else a ValueError, and the count is kept)."""
        return self._taken

    @steps_taken.setter
    def steps_taken(self, value: int) -> None:
        inner = wrapped_optimizer(self, MuonStepping)
        if inner is not None:  # set through a framework's wrapper (muonclip.optim._wrappers)
            inner.steps_taken = value
            return
        self._taken = state_validation.counter(value, "steps_taken", f"{type(self).__name__}.")
        self._record_wide_state()

    @property
    def steps_skipped(self) -> int:
        """Steps skipped for a non-finite gradient (reading it syncs in ``"mask"`` mode, where
        the count is kept on the device). Setting it takes a whole number >= 0."""
        inner = wrapped_optimizer(self, MuonStepping)
        if inner is not None:
            return inner.steps_skipped
        device_count = self.__dict__.get("_masked_count")
        if device_count is not None:  # fold the device count in (one sync)
            self._skipped_host += int(device_count)
            self._masked_count = None
            self._record_wide_state()
        return self._skipped_host

    @steps_skipped.setter
    def steps_skipped(self, value: int) -> None:
        inner = wrapped_optimizer(self, MuonStepping)
        if inner is not None:
            inner.steps_skipped = value
            return
        self._skipped_host = state_validation.counter(value, "steps_skipped", f"{type(self).__name__}.")
        self._masked_count = None
        self._record_wide_state()

    def _count_masked(self, found: Tensor) -> None:
        if self._masked_count is None:
            self._masked_count = torch.zeros((), dtype=torch.int64, device=found.device)
        self._masked_count.add_(found)

    def _wide_state(self) -> dict[str, Any]:
        """The optimizer-wide values every param group carries: ``steps_taken`` and
        ``steps_skipped`` (``steps_skipped`` without the masked steps not yet read in ``"mask"``
        mode; `state_dict` reads them)."""
        return {"steps_taken": self.steps_taken, "steps_skipped": self._skipped_host}

    def _load_wide_state(self, values: dict[str, Any]) -> None:
        """Set the optimizer-wide values from a loaded state (missing ones: 0)."""
        self.steps_taken = values.get("steps_taken", 0)
        self.steps_skipped = values.get("steps_skipped", 0)

    def _record_wide_state(self) -> None:
        """Copy `_wide_state` into every param group (once there are groups), so that a state
        dict, even one flattened per parameter, carries it, and no parameter swap can lose it."""
        groups = self.__dict__.get("param_groups")
        if not groups:
            return
        values = self._wide_state()
        for group in groups:
            group.update(values)


def needs_engine(params: Sequence[Tensor], process_group: Any = None) -> bool:
    """Whether a step over ``params`` needs the distribution layer: a DTensor parameter, a
    ``process_group`` other than None and ``"local"``, or, with None, ``torch.distributed``
    initialised with more than one rank. Asked by every step; in one process the answer is no and
    nothing of that layer (nor its registry, `muonclip.optim.multiprocess`) is entered."""
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is loaded (is_dtensor)
    if dtensor is not None and any(isinstance(p, dtensor.DTensor) for p in params):
        return True
    if process_group == LOCAL:
        return False
    if process_group is not None:
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def engine_for(params: Sequence[Tensor], process_group: Any = None) -> Engine | None:
    """The registered engine (`muonclip.optim.multiprocess.registered_engine`) when `needs_engine`,
    else None (the core runs the step alone). Raises RuntimeError when distribution is needed and
    no engine is registered."""
    return registered_engine() if needs_engine(params, process_group) else None


def momentum_state(state: dict[str, Any], p: Tensor, group: dict[str, Any], spec: MatrixSpec,
                   local: Callable[[Tensor], Tensor]) -> tuple[Tensor | None, Any]:
    """A Muon weight's momentum for `muonclip.optim.functional.step_momentum`, created at its first
    step (zeros) and converted when the group's ``momentum_8bit`` changed since it was made:
    ``(local float32 buffer, None)``, or ``(None, (local codes, local scales, blocks))``.

    * ``momentum_buffer``: float32 (float64 for float64 weights), the weight's shape (a DTensor
      for a DTensor weight, so checkpoints reshard).
    * ``momentum_int8`` + ``momentum_scale`` (``momentum_8bit``): int8 codes, the weight's shape,
      and float32 scales ``(*leading dims, blocks per row)`` (`muonclip.optim._quantized`); for a
      DTensor weight both are DTensors with its placements.
    """
    if group["momentum_8bit"]:
        lay = quant_blocks(p.shape, spec)
        if "momentum_int8" not in state:
            buffer = state.pop("momentum_buffer", None)
            q = _zeros_fp32(p).to(torch.int8)
            state["momentum_scale"] = scale_like(p, lay)
            state["momentum_int8"] = q
            if buffer is not None:  # a float32 momentum from before: kept, quantised
                quantize_(local(buffer), local(q), local(state["momentum_scale"]), lay)
        return None, (local(state["momentum_int8"]), local(state["momentum_scale"]), lay)
    if "momentum_buffer" not in state:
        state["momentum_buffer"] = _zeros_fp32(p)
        if "momentum_int8" in state:  # an 8-bit momentum from before: kept, dequantised
            q, s = state.pop("momentum_int8"), state.pop("momentum_scale")
            local(state["momentum_buffer"]).copy_(dequantize(local(q), local(s), quant_blocks(p.shape, spec),
                                                             local(s).dtype))
    return local(state["momentum_buffer"]), None


def second_moment_state(state: dict[str, Any], p: Tensor, group: dict[str, Any], spec: MatrixSpec) -> Tensor | None:
    """NorMuon's ``neuron_second_moment`` of a Muon weight: float32 ``(batch, rows)`` (E experts or
    1; the rows of the ``(out, in)`` matrix, block after block:
    `muonclip.optim._matrices.MatrixSpec.block_offset`), zeros at its first step, the whole
    weight's on every rank (a plain tensor, small, that every rank updates the same way); None
    without NorMuon."""
    if not group["normuon"]:
        return None
    if "neuron_second_moment" not in state:
        device = p.device_mesh.device_type if is_dtensor(p) else p.device
        state["neuron_second_moment"] = torch.zeros(spec.batch, spec.rows, dtype=state_dtype(p), device=device)
    return state["neuron_second_moment"]


def _same(t: Tensor) -> Tensor:
    return t


def _zeros_fp32(p: Tensor) -> Tensor:
    return torch.zeros_like(p, dtype=state_dtype(p), memory_format=torch.contiguous_format)


def _name(opt: MuonStepping, group: dict[str, Any], i: int) -> str:
    names = group.get("param_names")
    if names:
        return f"parameter '{names[i]}'"
    gi = next(k for k, g in enumerate(opt.param_groups) if g is group)
    return f"parameter {i} of param group {gi} (shape {tuple(group['params'][i].shape)})"
