"""Distributed Muon: the layer on top of the core for DDP, FSDP2, TP, HSDP and EP (docs/design.md, "Distributed Muon").

Importing this package registers `DistributedEngine` with the core
(`muonclip.optim.multiprocess`), which hands it every step whose parameters are DTensors or live in a
multi-rank process group; ``import muonclip`` imports it.

* `checkpoint` (public) — save/load through ``torch.distributed.checkpoint``, reshardable N -> M
  ranks.
* `_engine` — the multi-rank step: the exchanges around the core's update phases, one owner
  rank per matrix.
* `_context` — which process group a step runs on (every rank of the parameters' mesh).
* `_plan` — which rank orthogonalises which matrix, balanced by Newton–Schulz flops.
* `_exchange` — the batched collectives: one all-to-all moves pieces of V to owners, one moves
  pieces of results back, and the cross-rank agreement check.

Which global indices each rank's local tensor holds is the ground floor's
(`muonclip.common._dtensor`), shared with QK-Clip (`muonclip.qkclip.tensor_parallel`).
"""

from ._context import GroupContext, resolve_group
from ._engine import DistributedEngine
from ._exchange import CommStats
from ._plan import Plan, assign_owners

__all__ = ["CommStats", "DistributedEngine", "GroupContext", "Plan", "assign_owners", "resolve_group"]
