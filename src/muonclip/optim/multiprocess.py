"""The extension point for a step that needs several processes, and what a step reports.

The core optimizer runs a step in one process by itself. When the parameters are DTensors
(FSDP2's ``fully_shard``), or ``torch.distributed`` is initialised with more than one rank (DDP),
or a process group is given, the step needs a distribution layer: the core asks for the
registered `Engine` (`muonclip.optim._stepping.engine_for`), which `muonclip.distributed` registers when it is imported
(``import muonclip`` imports it). The core never imports that layer. The engine resolves the
group and checks the layouts (`Engine.context`); a group of one rank then runs the core's step
on the rank-local tensors (`Engine.local`). Over a larger group the core runs the same step
body (`muonclip.optim.functional.muon_step`) with the engine's `Exchange` for that step: the
owner of each unit of work (`Exchange.plan`, once per step structure), the gather of V to the
owners before orthogonalisation and the scatter of the results after (`Exchange.gather`,
`Exchange.scatter`). The engine has no update of its own. If distribution is needed and no
engine is registered, the step raises: a sharded weight must never be orthogonalised shard by
shard (a different optimizer, silently).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from torch import Tensor

if TYPE_CHECKING:
    from ._buckets import Place, Unit
    from ._matrices import MatrixSpec

LOCAL = "local"  # the value of Muon(process_group=...) that turns communication off


@dataclass
class CommStats:
    """What this rank sent in the last step: bytes (ring-algorithm count) and collective calls."""

    bytes_sent: int = 0
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, nbytes: int) -> None:
        """Count one ``op`` call that sent ``nbytes``."""
        self.bytes_sent += int(nbytes)
        self.calls[op] = self.calls.get(op, 0) + 1


@dataclass
class StepStats:
    """What this rank did in the last Muon step.

    Attributes:
        world_size: ranks in the group (1 without communication).
        matrices: matrices this rank orthogonalised (stacked experts count E each).
        ns_flops: Newton–Schulz flops of those matrices.
        total_ns_flops: the same summed over every rank's share (``ns_flops`` in one process).
        comm: bytes sent and collective calls.
    """

    world_size: int = 1
    matrices: int = 0
    ns_flops: int = 0
    total_ns_flops: int = 0
    comm: CommStats = field(default_factory=CommStats)


class Routes(Protocol):
    """What `Exchange.plan` returns: the core reads these attributes to build its
    `muonclip.optim._buckets.StepStructure`; the rest is the engine's own (what moves where)."""

    units: Sequence[Unit]  # every unit of work of the group (a weight, or an expert-parallel piece)
    owned: Sequence[int]  # the units this rank orthogonalises
    places: Sequence[Place]  # per weight, where this rank's piece of its result applies
    flops: int  # Newton–Schulz flops of the owned units
    total_flops: int  # of every unit


class Exchange(Protocol):
    """The exchanges of one step over several ranks, which `muonclip.optim.functional.muon_step`
    calls around its phases (`Engine.exchange` makes one per step; every rank calls each method,
    in the same order)."""

    def key(self, params: Sequence[Tensor]) -> Hashable:
        """What, beyond shapes, options and devices, decides the step's structure: the group, the
        rank and the parameters' placements and meshes."""
        ...

    def plan(self, live: Sequence[tuple[dict[str, Any], Tensor]], names: Sequence[Callable[[], str]],
             specs: Sequence[MatrixSpec]) -> Routes:
        """The units, their owners and what moves where, for the weights with a gradient (``live``,
        as ``(group, parameter)``; ``names[k]()`` names one in an error): the same on every rank.
        Called when the step's structure is new; may run a collective check."""
        ...

    def gather(self, routes: Routes, weights: Sequence[Any], v_of: Callable[[int], Tensor]) -> dict[int, Tensor]:
        """Before orthogonalisation: the whole V of every owned unit that is not `Unit.direct`, by
        unit; ``weights`` are the step's (`muonclip.optim.functional.MuonWeight`), ``v_of(k)``
        gives this rank's piece of weight k's V (after its momentum)."""
        ...

    def scatter(self, routes: Routes, results: dict[int, Tensor],
                weights: Sequence[Any]) -> Iterable[tuple[int, Tensor]]:
        """After orthogonalisation: from ``results`` (the owned units' results, by unit), this rank's
        piece of each weight's result, as ``(weight, update)``; NorMuon's second moments made the
        same on every rank first."""
        ...


class Engine(Protocol):
    """What the core asks of a distribution layer (`muonclip.distributed._engine`)."""

    def context(self, params: Sequence[Tensor], name_of: Callable[[int], str], process_group: Any) -> Any:
        """Validate the Muon parameters' layouts (a clear error before any collective) and
        return the step's group context (with ``world_size``)."""
        ...

    def local(self, t: Tensor) -> Tensor:
        """The rank-local part of ``t`` (an alias: writes go through)."""
        ...

    def all_finite(self, tensors: Sequence[Tensor], finite: Tensor, ctx: Any = None) -> Tensor:
        """``finite`` (per tensor, computed on local parts) AND-ed over the ranks that share them,
        within the group of ``ctx`` (the step's `context`)."""
        ...

    def exchange(self, items: Sequence[tuple[dict[str, Any], Tensor, Callable[[], str]]], ctx: Any,
                 comm_dtype: Any, stats: StepStats) -> Exchange:
        """The `Exchange` of this step over the group of ``ctx`` (more than one rank), after checking
        that every rank has the same Muon parameters (``items``: every one, with or without a
        gradient, in optimizer order, as ``(group, parameter, name)``) and the same gradients
        present; collectives are counted in ``stats``."""
        ...


_ENGINES: list[Engine] = []


def register_engine(engine: Engine) -> None:
    """Make ``engine`` the one the core asks when a step needs several processes."""
    _ENGINES[:] = [engine]


def registered_engine() -> Engine:
    """The engine `register_engine` made the one the core asks (a step that needs several
    processes asks it: `muonclip.optim._stepping.engine_for`).

    Raises RuntimeError when none is registered.
    """
    if not _ENGINES:
        raise RuntimeError(
            "this step needs the distributed layer (DTensor parameters, a process group, or torch.distributed "
            "initialised with several ranks) but none is registered: import muonclip.distributed (import muonclip "
            "does), or pass process_group='local' for replicated parameters that each process optimises alone"
        )
    return _ENGINES[0]


__all__ = ["LOCAL", "CommStats", "Engine", "Exchange", "Routes", "StepStats", "register_engine",
           "registered_engine"]
