"""The extension point for a step that needs several processes, and what a step reports.

The core optimizer runs a step in one process by itself. When the parameters are DTensors
(FSDP2's ``fully_shard``), or ``torch.distributed`` is initialised with more than one rank (DDP),
or a process group is given, the step needs a distribution layer: the core asks for the
registered `Engine` (`engine_for`), which `muonclip.distributed` registers when it is imported
(``import muonclip`` imports it). The core never imports that layer. The engine resolves the
group and checks the layouts (`Engine.context`); a group of one rank then runs the core's own
step on the rank-local tensors (`Engine.local`), a larger one the engine's (`Engine.muon_step`:
the exchanges around the core's phases). If distribution is needed and no engine is
registered, the step raises: a sharded weight must never be orthogonalised shard by shard (a
different optimizer, silently).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist
from torch import Tensor

from ..common.dtensor import is_dtensor

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
        ns_flops: Newton–Schulz flops of those matrices (0 in one process: nothing to balance).
        total_ns_flops: the same summed over every rank's share (0 in one process).
        comm: bytes sent and collective calls.
    """

    world_size: int = 1
    matrices: int = 0
    ns_flops: int = 0
    total_ns_flops: int = 0
    comm: CommStats = field(default_factory=CommStats)


class Engine(Protocol):
    """What the core asks of a distribution layer (`muonclip.distributed.engine`)."""

    def context(self, params: Sequence[Tensor], name_of: Callable[[int], str], process_group: Any) -> Any:
        """Validate the Muon parameters' layouts (a clear error before any collective) and
        return the step's group context (with ``world_size``)."""
        ...

    def local(self, t: Tensor) -> Tensor:
        """The rank-local part of ``t`` (an alias: writes go through)."""
        ...

    def all_finite(self, tensors: Sequence[Tensor], finite: Tensor) -> Tensor:
        """``finite`` (per tensor, computed on local parts) AND-ed over the ranks that share them."""
        ...

    def muon_step(self, items: Sequence[tuple[dict[str, Any], Tensor, Callable[[], str]]],
                  state: dict[Tensor, dict[str, Any]], ctx: Any, *, backend: Any,
                  new_buffer: Callable[[Tensor], Tensor], comm_dtype: Any) -> StepStats:
        """The Muon update of ``items`` (every Muon parameter, with or without a gradient, in
        optimizer order) over the group of ``ctx`` (more than one rank), built from
        `muonclip.optim.functional`'s phases."""
        ...


_ENGINES: list[Engine] = []


def register_engine(engine: Engine) -> None:
    """Make ``engine`` the one the core asks when a step needs several processes."""
    _ENGINES[:] = [engine]


def needs_engine(params: Sequence[Tensor], process_group: Any = None) -> bool:
    """Whether a step over ``params`` needs the distribution layer: a DTensor parameter, a
    ``process_group`` other than None and ``"local"``, or, with None, ``torch.distributed``
    initialised with more than one rank."""
    if any(is_dtensor(p) for p in params):
        return True
    if process_group == LOCAL:
        return False
    if process_group is not None:
        return True
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def engine_for(params: Sequence[Tensor], process_group: Any = None) -> Engine | None:
    """The registered engine when `needs_engine`, else None (the core runs the step alone).

    Raises RuntimeError when distribution is needed and no engine is registered.
    """
    if not needs_engine(params, process_group):
        return None
    if not _ENGINES:
        raise RuntimeError(
            "this step needs the distributed layer (DTensor parameters, a process group, or torch.distributed "
            "initialised with several ranks) but none is registered: import muonclip.distributed (import muonclip "
            "does), or pass process_group='local' for replicated parameters that each process optimises alone"
        )
    return _ENGINES[0]


__all__ = ["LOCAL", "CommStats", "Engine", "StepStats", "engine_for", "needs_engine", "register_engine"]
