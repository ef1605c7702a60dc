"""DeepSpeed: `muonclip.Muon` and `muonclip.MuonClip` as the optimizer of DeepSpeed's ZeRO stages 0-3.

The user's code is DeepSpeed's own (docs/integrations.md, "DeepSpeed")::

    opt = muonclip.MuonClip(model, lr=..., tau=...)           # on the model as it is defined
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=opt,
                                             config={..., "zero_allow_untested_optimizer": True})

**Stage 0** hands the optimizer the model's parameters (replicated): the step is the distributed
engine's DDP case. **ZeRO-1, ZeRO-2 and ZeRO-3** replace every param group's parameters by this
rank's flat float32 partition of them and call ``step()`` once per group (ZeRO-3: per sub-group;
ZeRO-1 in bfloat16, ``BF16_Optimizer``: once for all), after DeepSpeed has reduced, unscaled
(fp16 loss scaling) and clipped (``gradient_clipping``) the gradients. DeepSpeed gives the client
optimizer no hook at ``deepspeed.initialize``; at its first call (a step, or a checkpoint's
``state_dict``/``load_state_dict``), `find_driver` (registered with the core's
`muonclip.optim.flat.register_flat_driver` when ``muonclip`` is imported) finds the DeepSpeed
optimizer that holds this one as ``.optimizer`` among its callers, refuses what cannot be exact
(`refuse_unsupported`), and from then on `DeepSpeedDriver` runs every step:

* **Muon groups**: every weight's element range in each rank's partition
  (`muonclip.integrations.deepspeed_zero`) is a `muonclip.common._dtensor.FlatRange` piece for
  the distributed engine (`muonclip.distributed`): the core's one step body
  (`muonclip.optim.functional.muon_step`) forms V on each rank's elements, one all-to-all
  gathers whole V's to their owner ranks (balanced by flops over the data-parallel group), each
  matrix is orthogonalised once, whole, and a second all-to-all returns each rank its elements
  of the update, applied to the float32 master partition. Momentum lives on the partition
  (state ``momentum_buffer`` of the partition's shape, DeepSpeed's layout, so its checkpoints,
  universal ones included, carry it element by element).
* **AdamW groups**: AdamW on the partition, element by element, as DeepSpeed's own optimizers.
* **QK-Clip** (`muonclip.MuonClip`), after the last group: the max logits reduced over the
  data-parallel group, the clip's per-row factors computed by the layouts themselves (on
  stand-ins of one column), each rank's master elements scaled by their row's factor, and the
  low-precision copy DeepSpeed trains written from them (ZeRO-1/2: the rank's bit16 partition,
  all-gathered by DeepSpeed after the step; ZeRO-3: the parameters' partitions ``ds_tensor``;
  no whole matrix is gathered).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed._engine import StepExchange
from ..optim._adamw import adamw_step
from ..optim._buckets import options_key, step_structure
from ..optim._matrices import matrix_spec
from ..optim._validation import NonFiniteGradError, check_group, finite_per_tensor, nonfinite_indices, step_numbers
from ..optim.flat import ATTACHED, mark_partition, register_flat_driver
from ..optim.functional import MuonWeight, muon_step
from ..optim.multiprocess import StepStats
from ..qkclip._layouts import AttentionLayer
from ..qkclip._rows import Magnitudes, Rows, StridedRows
from .deepspeed_zero import Member, Part, pending_gradients, zero_parts

_LOW_PRECISION_STAGE_0 = ("FP16_Optimizer", "FP16_UnfusedOptimizer")
_UNFOUND = (
    "Step it through DeepSpeed's engine (engine.step(), which calls the optimizer from DeepSpeed's ZeRO "
    "optimizer), or attach it to the engine first: muonclip.integrations.deepspeed.attach(engine) "
    "(docs/integrations.md, \"DeepSpeed\")"
)


def _classes() -> tuple[type, type, type]:
    """DeepSpeed's optimizer-wrapper base, its ZeRO optimizers' base and its engine class."""
    from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedOptimizer, ZeROOptimizer, DeepSpeedEngine


def _holder(opt: Any) -> Any:
    """The nearest DeepSpeed object up the call stack that drives ``opt``: an optimizer wrapper
    (ZeRO's, or stage 0's fp16 one) that holds it as ``.optimizer``, else the wrapper of an engine
    whose ``basic_optimizer`` it is (the engine itself at stage 0), else None."""
    wrapper_t, _, engine_t = _classes()
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, wrapper_t) and getattr(owner, "optimizer", None) is opt:
            return owner
        if isinstance(owner, engine_t) and getattr(owner, "basic_optimizer", None) is opt:
            return owner.optimizer if isinstance(owner.optimizer, wrapper_t) else owner
        frame = frame.f_back
    return None


def _partition_in_muon_group(opt: Any) -> Tensor | None:
    """A tensor in one of ``opt``'s Muon groups that can only be a flattening wrapper's partition:
    1-D and not a parameter of a model (DeepSpeed ZeRO's float32 master partitions), else None."""
    for g in opt.param_groups:
        if g.get("algorithm", "muon") == "muon":
            for p in g["params"]:
                if p.ndim < 2 and not isinstance(p, torch.nn.Parameter):
                    return p
    return None


def find_driver(opt: Any) -> DeepSpeedDriver | None:
    """The `DeepSpeedDriver` of ``opt`` (a `muonclip.Muon`): the one attached, else one attached now
    when a DeepSpeed ZeRO optimizer drives it (`attach`), else None (not under DeepSpeed, or
    DeepSpeed's stage 0 in float32, which hands the optimizer the model's own parameters).

    Raises ValueError, never steps a partition as a weight: for stage 0 in fp16/bf16 (DeepSpeed's
    ``FP16_Optimizer``), for a DeepSpeed wrapper muonclip does not know, and when ``opt``'s Muon
    groups hold flat partitions but no DeepSpeed ZeRO optimizer is driving the call. Cheap when
    DeepSpeed is not imported."""
    driver = opt.__dict__.get(ATTACHED)
    if driver is not None or "deepspeed.runtime.engine" not in sys.modules:
        return driver
    holder = _holder(opt)
    if holder is not None and type(holder).__name__ in _LOW_PRECISION_STAGE_0:
        raise _low_precision_stage_0(opt, holder)
    if holder is not None and isinstance(holder, _classes()[0]):
        return attach_to(opt, holder)
    flat = _partition_in_muon_group(opt)
    if flat is not None:
        raise ValueError(
            f"{type(opt).__name__}'s Muon param group holds a flat tensor of shape {tuple(flat.shape)}, DeepSpeed "
            "ZeRO's partition of a whole param group, but no DeepSpeed ZeRO optimizer is driving this call, so "
            f"muonclip cannot tell which weights it holds (stepped as it is, each matrix would be cut). {_UNFOUND}"
        )
    return None


def attach(engine: Any) -> DeepSpeedDriver | None:
    """Attach the muonclip optimizer of a DeepSpeed ``engine`` (from ``deepspeed.initialize``) to its
    ZeRO optimizer now, instead of at the first step (what `find_driver` does by itself): the
    refusals (`refuse_unsupported`) are raised here. Returns the `DeepSpeedDriver`, or None at
    stage 0 in float32 (the optimizer steps the model's parameters itself).

    Raises TypeError when the engine's optimizer is not a `muonclip.Muon`, ValueError for what
    `find_driver` refuses."""
    from ..optim import Muon

    opt, wrapper = getattr(engine, "basic_optimizer", None), getattr(engine, "optimizer", None)
    if not isinstance(opt, Muon):
        raise TypeError(f"the engine's optimizer is {type(opt).__name__}, not a muonclip.Muon or muonclip.MuonClip: "
                        "pass one as deepspeed.initialize(model=..., optimizer=...)")
    if opt.__dict__.get(ATTACHED) is not None:
        return opt.__dict__[ATTACHED]
    if wrapper is None or wrapper is opt:  # stage 0 in float32
        return None
    if type(wrapper).__name__ in _LOW_PRECISION_STAGE_0:
        raise _low_precision_stage_0(opt, wrapper)
    return attach_to(opt, wrapper)


def _low_precision_stage_0(opt: Any, wrapper: Any) -> ValueError:
    return ValueError(
        f"DeepSpeed wraps {type(opt).__name__} in {type(wrapper).__name__} (ZeRO stage 0 with fp16 or bf16), "
        "whose fp32 master copies muonclip does not step. Use ZeRO-1 or ZeRO-2 for mixed precision "
        "(zero_optimization.stage 1 or 2; the same update, exact), or stage 0 in float32"
    )


def attach_to(opt: Any, wrapper: Any) -> DeepSpeedDriver:
    """Attach ``opt`` to the DeepSpeed optimizer ``wrapper`` that holds it: refuse what cannot be
    exact (`refuse_unsupported`; a wrapper muonclip does not know included), then the
    `DeepSpeedDriver` runs its every step."""
    refuse_unsupported(wrapper, opt)
    if not isinstance(wrapper, _classes()[1]) or type(wrapper).__name__ not in _KNOWN:
        raise ValueError(
            f"DeepSpeed drives {type(opt).__name__} through {type(wrapper).__name__}, whose partitions muonclip does "
            f"not know (it knows {', '.join(_KNOWN)}: ZeRO-1, 2 and 3 and bf16 ZeRO-1, without MiCS, ZenFlow or "
            "SuperOffload); use one of those ZeRO stages"
        )
    driver = DeepSpeedDriver(opt, wrapper)
    opt.__dict__[ATTACHED] = driver
    return driver


_KNOWN = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3", "BF16_Optimizer")


def refuse_unsupported(wrapper: Any, opt: Any) -> None:
    """ValueError for a DeepSpeed option muonclip cannot make exact, naming it and what to use instead.

    Refused: optimizer or parameter offload (the step runs where DeepSpeed's partitions live),
    ZeRO++ quantized weights and gradients and hierarchical partitioning (hpZ), MiCS, ZenFlow,
    SuperOffload, MoE expert groups, and, of `muonclip.Muon`'s options, ``on_nonfinite="mask"``,
    ``normuon`` and ``momentum_8bit``.
    """
    kind, stage = type(wrapper).__name__, _stage(wrapper)
    checks = [
        (getattr(wrapper, "cpu_offload", False) or getattr(wrapper, "offload_optimizer", False),
         "offload_optimizer", "keep the optimizer on the device (remove zero_optimization.offload_optimizer)"),
        (getattr(wrapper, "offload_param", False), "offload_param", "remove zero_optimization.offload_param"),
        (getattr(wrapper, "zenflow", False), "ZenFlow", "remove zero_optimization.zenflow"),
        (getattr(wrapper, "has_moe_layers", False), "MoE expert parallelism",
         "train without DeepSpeed MoE layers, or use FSDP2 with expert parallelism (muonclip.distributed)"),
        (getattr(wrapper, "zero_quantized_weights", False) or getattr(wrapper, "zero_quantized_gradients", False),
         "ZeRO++ quantized weights/gradients", "set zero_quantized_weights and zero_quantized_gradients to false"),
        ((getattr(wrapper, "zero_hpz_partition_size", 1) or 1) > 1, "ZeRO++ hpZ (zero_hpz_partition_size > 1)",
         "set zero_hpz_partition_size to 1"),
        ("MiCS" in kind or "SuperOffload" in kind, kind, "use ZeRO-3 without MiCS/SuperOffload"),
        (any(getattr(p, "use_muon", False) for g in getattr(wrapper, "bit16_groups", ()) for p in g),
         "parameters tagged use_muon", "remove the use_muon attribute from the model's parameters (ZeRO-1/2 would "
         "orthogonalise their gradients with DeepSpeed's own Muon before muonclip's step)"),
        (getattr(opt, "on_nonfinite", "raise") == "mask", "on_nonfinite='mask'",
         "use on_nonfinite='raise' or 'skip' (DeepSpeed skips fp16 overflow steps itself)"),
    ]
    for g in (opt.defaults, *opt.param_groups):
        checks += _group_checks(g)
    _refuse(stage, checks)
    for layer in getattr(opt, "layers", ()):
        if not dataclasses.is_dataclass(layer.layout):
            raise ValueError(
                f"DeepSpeed {stage}: attention layer '{layer.name}' has a layout ({type(layer.layout).__name__}) "
                "that is not a dataclass; QK-Clip on DeepSpeed's partitions computes its row factors on stand-ins, "
                "which only a dataclass layout (MHALayout, GQALayout, MLALayout) can be pointed at"
            )


def _stage(wrapper: Any) -> str:
    kind = type(wrapper).__name__
    return {"DeepSpeedZeroOptimizer": "ZeRO-2" if getattr(wrapper, "partition_gradients", False) else "ZeRO-1",
            "BF16_Optimizer": "ZeRO-1 (bf16)"}.get(kind, "ZeRO-3")


def _group_checks(group: Any) -> list[tuple[bool, str, str]]:
    """A param group's options muonclip does not run on DeepSpeed's partitions."""
    return [(bool(group.get("normuon", False)), "normuon", "set normuon=False"),
            (bool(group.get("momentum_8bit", False)), "momentum_8bit", "set momentum_8bit=False")]


def _refuse(stage: str, checks: list[tuple[bool, str, str]]) -> None:
    for bad, what, instead in checks:
        if bad:
            raise ValueError(
                f"DeepSpeed {stage} with {what}: muonclip cannot step it exactly (every Muon matrix must be "
                f"orthogonalised whole, once, from the float32 master elements its partitions hold). {instead}"
            )


@dataclasses.dataclass
class _Context:
    """The distributed engine's view of a partition's group: every rank's piece of every weight."""

    group: Any
    rank: int
    world_size: int
    by_id: dict[int, list[Any]]
    plain_replicas: bool = False  # plain (flat) pieces are partitions, not replicas
    mesh_shape: tuple[int, ...] = ()
    coords: tuple[tuple[int, ...], ...] = ()

    def pieces(self, p: Tensor, name: str = "a parameter") -> list[Any]:
        return self.by_id[id(p)]


class DeepSpeedDriver:
    """Steps a `muonclip.Muon` (or `muonclip.MuonClip`) on a DeepSpeed ZeRO optimizer's partitions
    (module docstring); `muonclip.optim.flat.FlatDriver`."""

    def __init__(self, opt: Any, wrapper: Any) -> None:
        self.opt, self.wrapper = opt, wrapper
        self.kind, self.parts = zero_parts(wrapper)
        self.by_flat = {id(part.flat): part for part in self.parts}
        for part in self.parts:
            mark_partition(part.flat)
        self.member_of: dict[int, tuple[Part, Member]] = {
            id(m.param): (part, m) for part in self.parts for m in part.members}
        self.contexts = {part.index: _Context(part.group, part.rank, part.world,
                                              {id(m.meta): m.pieces for m in part.members},
                                              mesh_shape=(part.world,))
                         for part in self.parts}
        self.parts_by_index = {part.index: part for part in self.parts}
        self.structures: dict[Any, Any] = {}
        self.checked: dict[int, tuple[Any, Any]] = {}
        self.groups: dict[int, dict[str, Any]] = {}  # the param group DeepSpeed hands over with each part
        self.skipping: bool | None = None  # within a step: skip its remaining calls; None between steps

    def active(self) -> bool:
        """Always, once attached: DeepSpeed keeps its partitions in the param groups."""
        return True

    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One call of DeepSpeed's: the parts whose partitions the param groups hold now (ZeRO-1/2:
        one group; ZeRO-3: one sub-group; BF16_Optimizer: all); after the last part of the step,
        QK-Clip (`muonclip.MuonClip`) and the step count.

        At the step's first call, before any part changes: every group seen so far validated, and
        every part's gradients checked (`_all_finite`: those handed over and those DeepSpeed still
        holds), so a non-finite gradient anywhere raises `NonFiniteGradError` (or, with
        ``on_nonfinite="skip"``, skips every part of the step) with no weight changed."""
        if closure is not None:
            raise ValueError("DeepSpeed calls the optimizer's step() without a closure; a closure cannot run here")
        opt = self.opt
        todo = [(g, self.by_flat[id(p)]) for g in opt.param_groups for p in g["params"] if id(p) in self.by_flat]
        if not todo:
            return None
        for group, part in todo:
            self.groups[part.index] = group
        if todo[0][1].index == self.parts[0].index or self.skipping is None:  # the step's first call
            numbers = {i: self._numbers(g, self.parts_by_index[i]) for i, g in self.groups.items()}
            self.skipping = not self._all_finite(todo)
        else:
            numbers = {part.index: self._numbers(group, part) for group, part in todo}
        last = todo[-1][1].index == self.parts[-1].index
        if not self.skipping:
            for group, part in todo:
                self._step_part(group, part, numbers[part.index])
            if last:
                if hasattr(opt, "layers"):
                    self.clip()
                opt.steps_taken += 1
        if last:
            self.skipping = None
        return None

    def _all_finite(self, todo: list[tuple[dict[str, Any], Part]]) -> bool:
        """True when every gradient of every part is finite on every rank (one all-reduce); False
        with ``on_nonfinite="skip"`` (the step counted in ``steps_skipped``); else
        `NonFiniteGradError` naming the param groups."""
        here = {part.index for _, part in todo}
        grads = [[part.flat.grad] if part.flat.grad is not None else [] for _, part in todo] + [
            pending_gradients(self.wrapper, self.kind, part.index) for part in self.parts if part.index not in here]
        order = [part.index for _, part in todo] + [part.index for part in self.parts if part.index not in here]
        finite = torch.stack([finite_per_tensor(g).all() for g in grads]).to(torch.int32)
        if self.parts[0].world > 1:
            dist.all_reduce(finite, op=dist.ReduceOp.MIN, group=self.parts[0].group)
        bad = sorted(order[k] for k in nonfinite_indices(finite.bool()))
        if not bad:
            return True
        if self.opt.on_nonfinite == "skip":
            self.opt.steps_skipped += 1
            return False
        raise NonFiniteGradError(
            f"non-finite gradient (NaN or inf, or beyond 2^100) in DeepSpeed's partitions of param group(s) "
            f"{', '.join(map(str, bad))} ({_stage(self.wrapper)}) at step {self.opt.steps_taken + 1}; no weight was "
            "updated. Check the loss and the learning rate, clip gradients (gradient_clipping), keep DeepSpeed's "
            "overflow check on (bf16.check_grad_overflow, zero_optimization.compute_grad_norm), or pass "
            "on_nonfinite='skip' to skip such steps"
        )

    def _numbers(self, group: dict[str, Any], part: Part) -> tuple[float, float]:
        """The group's checked ``(lr, weight_decay)`` for this step (`muonclip.optim._validation`), the
        group validated whole, on its weights' shapes, when its settings changed."""
        where = f"param group {part.index}'s "
        settings = tuple((k, repr(v)) for k, v in sorted(group.items()) if k not in ("params", "lr", "weight_decay"))
        seen = self.checked.get(part.index)
        if seen is None or seen[0] != settings:
            _refuse(_stage(self.wrapper), _group_checks(group))
            limits = check_group(dict(group, params=[m.meta for m in part.members],
                                      param_names=[m.name for m in part.members]), where, f"param group {part.index}: ")
            seen = (settings, limits)
            self.checked[part.index] = seen
        return step_numbers(group, seen[1], where)

    def _step_part(self, group: dict[str, Any], part: Part, numbers: tuple[float, float]) -> None:
        flat = part.flat
        if flat.grad is None:
            return
        lr, wd = numbers
        if group["algorithm"] == "adamw":
            adamw_step([flat], self.opt.state, lr=lr, betas=group["betas"], eps=group["adamw_eps"], weight_decay=wd,
                       new_buffer=lambda p: torch.zeros_like(p, dtype=torch.float32))
            return
        self._muon(group, part, lr, wd)

    def _muon(self, group: dict[str, Any], part: Part, lr: float, wd: float) -> None:
        opt, flat, members = self.opt, part.flat, part.members
        state = opt.state[flat]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(flat, dtype=torch.float32)
        momentum = state["momentum_buffer"]
        ctx = self.contexts[part.index]
        stats = StepStats(world_size=part.world)
        exchange = StepExchange(ctx, opt.comm_dtype, stats)
        key = (part.index, options_key(group), opt.workspace)
        st = self.structures.get(key)
        pairs = [(group, m.meta) for m in members]
        if st is None:
            names = [lambda m=m: f"parameter '{m.name}'" for m in members]
            plan = exchange.plan(pairs, names, [matrix_spec(m.shape, group) for m in members])
            st = step_structure(pairs, [flat.device] * len(members), opt.workspace, plan)
            self.structures[key] = st
        weights = [MuonWeight(m.view(flat, part.rank), m.view(flat.grad, part.rank), m.view(momentum, part.rank), lr,
                              wd, group["momentum"], group["nesterov"], None, group["normuon_beta2"],
                              group["cautious_weight_decay"], None) for m in members]
        try:
            stats.matrices = muon_step(weights, st, exchange)
        finally:
            st.end_step()
        stats.ns_flops, stats.total_ns_flops = st.flops, st.total_flops
        opt.last_step_stats = stats

    # ------------------------------------------------------------------------------------------

    @torch.no_grad()
    def clip(self) -> None:
        """QK-Clip on the partitions: `muonclip.MuonClip.clip` on stand-in layouts (one entry per row
        of every tensor the clip scales), then each rank's master elements times their row's
        factor, and the low-precision copy written from them."""
        opt = self.opt
        stand_ins: list[tuple[Tensor, Tensor]] = []
        real = [layer.layout for layer in opt.layers]
        try:
            for layer in opt.layers:
                layer.layout = _stand_in(layer, stand_ins)
            opt.clip()
        finally:
            for layer, layout in zip(opt.layers, real):
                layer.layout = layout
        for tensor, factor in stand_ins:
            if bool((factor != 1).any()):
                self._scale(tensor, factor)

    def _scale(self, tensor: Tensor, factor: Tensor) -> None:
        part, m = self.member_of[id(tensor)]
        if m.hi <= m.lo:
            return
        piece = m.pieces[part.rank]
        start = piece.start if hasattr(piece, "start") else 0
        index = torch.arange(start, start + m.hi - m.lo, device=factor.device)
        dim = next((d for d, n in enumerate(factor.shape) if n != 1), 0)
        inner = 1
        for n in m.shape[dim + 1:]:
            inner *= n
        master = part.flat[m.lo:m.hi]
        master.mul_(factor.reshape(-1)[index // inner % m.shape[dim]].to(master.device))
        if m.lp is not None:
            m.lp().copy_(master)


def _stand_in(layer: AttentionLayer, out: list[tuple[Tensor, Tensor]]) -> Any:
    """A copy of ``layer``'s layout whose weights are ones of one column (one entry per row the
    clip may scale), recorded in ``out`` with the tensor each stands for."""
    changes = {}
    for f in dataclasses.fields(layer.layout):
        value = getattr(layer.layout, f.name)
        if isinstance(value, Tensor):
            changes[f.name] = _ones(value, False, out)
        elif isinstance(value, (Rows, StridedRows, Magnitudes)):
            changes[f.name] = dataclasses.replace(value, tensor=_ones(value.tensor, getattr(value, "transposed", False),
                                                                    out))
    return dataclasses.replace(layer.layout, **changes)


def _ones(t: Tensor, transposed: bool, out: list[tuple[Tensor, Tensor]]) -> Tensor:
    shape = tuple(getattr(t, "ds_shape", None) or t.shape)
    if len(shape) == 1:
        stand = torch.ones(shape, dtype=torch.float32)
    elif transposed:
        stand = torch.ones((1, *shape[1:]), dtype=torch.float32)
    else:
        stand = torch.ones((shape[0], *[1] * (len(shape) - 1)), dtype=torch.float32)
    out.append((t, stand))
    return stand


register_flat_driver(find_driver)

__all__ = ["DeepSpeedDriver", "attach", "attach_to", "find_driver", "refuse_unsupported"]
