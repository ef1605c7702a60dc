"""Per-rank figures of one optimizer step on a mesh (``muonclip plan``): counted from the step's own plan.

For every pipeline stage, the Muon weights go through `muonclip.distributed._plan.plan_held`, the
plan the distributed step makes when its structure is new (`muonclip.distributed._plan.plan_step`),
with what the ranks hold of each weight (`muonclip.app.plan_layout.stage_holdings`: each distinct
piece and its holders, so that the work is per piece, not per rank): its owners, Newton–Schulz
flops per rank and every piece that moves are the step's own. From them (`plan_costs`), per rank:

* **exact** (equal to what a real step counts, `tests/test_plan.py`): Newton–Schulz flops; bytes
  of the gather of V to the owners and of the scatter of results (sent, received; the wire dtype:
  ``comm_dtype``, else the momentum's float32); bytes of the step's agreement all-reduces (ring
  count, `muonclip.distributed._exchange.all_reduce_bytes`) and of the clip's packed max-logit
  all-reduce (MuonClip); the optimizer state: Muon's float32 momentum of each Muon piece and its
  AdamW branch's two float32 moments, against ``torch.optim.AdamW``'s two moments (the parameter's
  dtype, float32 here) and 4-byte step per parameter; under ZeRO-1 (DeepSpeed's), on each rank's
  partitions whole, their padding included, and torch's AdamW on one buffer of every weight (one
  step tensor);
* **modelled**: the step's peak working set (`working_set`).

Two alternatives are counted on the same units and pieces: without owners, every rank
orthogonalises, whole, every matrix it holds a piece of, after gathering the pieces it lacks, and
nothing is scattered (Moonlight's distributed Muon, arXiv 2502.16982: `replicated`); and owners
dealt round robin in the optimizer's order, unbalanced (Keller Jordan's distributed ``Muon``:
`round_robin`, flops only).
"""

from __future__ import annotations

import dataclasses
import gc
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..common._dtensor import is_empty, piece_shape
from ..distributed._exchange import FINGERPRINT_BYTES, all_reduce_bytes
from ..distributed._plan import Held, StepPlan, plan_held
from ..optim._buckets import STEP_CHUNK_BYTES
from ..optim._matrices import MatrixSpec
from ..ortho import resolve_orth_dtype
from .plan_layout import Mesh, stage_holdings, stage_of, stage_of_layers, zero1_flat, zero1_padding, zero1_size
from .plan_model import PlanModel, Weight

STATE_BYTES = 4
"""Bytes of one element of optimizer state: Muon's momentum and AdamW's moments are float32."""


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@dataclass
class Ranks:
    """Per-rank figures of one step (lists over every rank of the mesh, pipeline stages one after
    another: global rank ``stage * stage_size + r``).

    Attributes:
        ns_flops: Newton–Schulz flops (our owner plan).
        matrices: per rank, ``{(rows, cols): count}`` of the matrices it orthogonalises.
        gather_sent, gather_recv, scatter_sent, scatter_recv: bytes of the two all-to-alls.
        sent_to, recv_from: per rank, bytes it sends to / receives from each other rank, both
            all-to-alls (for the time model).
        checks: bytes of the agreement all-reduces every step (parameters and gradients present;
            non-finite flags when the parameters are DTensors); under ZeRO-1 without expert
            parallelism, DeepSpeed's driver's one finite-gradient flag per param group.
        first_checks: bytes of the replica check of the first step (plain parameters only).
        first_copies: bytes of the copies check of the first step (`muonclip.distributed._exchange.agree_copies`:
            one all-gather of a fingerprint of each DTensor Muon weight whose pieces several ranks hold).
        clip: bytes of MuonClip's max-logit all-reduce (0 without attention layers here).
        muon_state, adamw_state: optimizer state bytes: Muon (with its AdamW branch), and
            ``torch.optim.AdamW`` on every parameter.
        muon_elements, adamw_elements: elements of this rank's pieces of Muon's and of the AdamW
            branch's weights.
        muon_work, adamw_work: the step's peak working set, modelled (`working_set`).
        rep_flops, rep_recv, rep_sent: the replicated alternative (`replicated`).
        rr_flops: Newton–Schulz flops with owners dealt round robin (`round_robin`).
    """

    ns_flops: list[int]
    matrices: list[dict[tuple[int, int], int]]
    gather_sent: list[int]
    gather_recv: list[int]
    scatter_sent: list[int]
    scatter_recv: list[int]
    sent_to: list[dict[int, int]]
    recv_from: list[dict[int, int]]
    checks: list[int]
    first_checks: list[int]
    first_copies: list[int]
    clip: list[int]
    muon_state: list[int]
    adamw_state: list[int]
    muon_elements: list[int]
    adamw_elements: list[int]
    muon_work: list[int]
    adamw_work: list[int]
    rep_flops: list[int]
    rep_recv: list[int]
    rep_sent: list[int]
    rr_flops: list[int]
    stage_size: int = 1
    notes: list[str] = field(default_factory=list)

    @classmethod
    def zeros(cls, world: int, stage_size: int) -> Ranks:
        lists = {f.name: [0] * world for f in dataclasses.fields(cls)
                 if f.name not in ("matrices", "sent_to", "recv_from", "stage_size", "notes")}
        return cls(**lists, matrices=[defaultdict(int) for _ in range(world)],
                   sent_to=[defaultdict(int) for _ in range(world)], recv_from=[defaultdict(int) for _ in range(world)],
                   stage_size=stage_size)


def _plan_specs(weights: Sequence[Weight], shapes: Sequence[tuple[int, ...]]) -> list[MatrixSpec]:
    """Each Muon weight's spec, on the shape it is planned on (a flat ZeRO-1 weight: its flat view,
    whose flops are the matrix's)."""
    flat: dict[tuple, MatrixSpec] = {}  # equal specs on equal shapes: one replace
    out = []
    for w, s in zip(weights, shapes):
        if tuple(w.shape) == s:
            out.append(w.spec)
        else:
            key = (w.spec, s)
            if key not in flat:
                flat[key] = dataclasses.replace(w.spec, shape=s)
            out.append(flat[key])
    return out


def _move(out: Ranks, sp: StepPlan, base: int, wire: int) -> None:
    for kind, transfers in (("gather", sp.gather), ("scatter", sp.scatter)):
        sent, recv = getattr(out, f"{kind}_sent"), getattr(out, f"{kind}_recv")
        for t in transfers:
            b = t.numel * wire
            sent[base + t.src] += b
            recv[base + t.dst] += b
            out.sent_to[base + t.src][base + t.dst] += b
            out.recv_from[base + t.dst][base + t.src] += b


def replicated(out: Ranks, shapes: Sequence[tuple[int, ...]], held: Sequence[Held], sp: StepPlan, base: int,
               wire: int) -> None:
    """The alternative without owners, on the same units: every rank holding a piece of a unit
    orthogonalises it whole, after receiving the distinct pieces it lacks (each sent by one holder);
    an expert-parallel unit is held whole by its holders, so nothing moves for it."""
    for i, u in enumerate(sp.units):
        h = held[u.k]
        if u.piece != tuple(range(n) for n in shapes[u.k]):  # an expert-parallel piece
            for r in h[u.piece]:
                out.rep_flops[base + r] += u.spec.flops
            continue
        distinct = [(pc, _numel(piece_shape(pc))) for pc in h if not is_empty(pc)]
        total = sum(n for _, n in distinct)
        holding = sum(len(h[pc]) for pc, _ in distinct)
        for pc, n in distinct:
            owners = h[pc]
            for r in owners:
                out.rep_flops[base + r] += u.spec.flops
                out.rep_recv[base + r] += (total - n) * wire
            out.rep_sent[base + owners[i % len(owners)]] += n * wire * (holding - len(owners))


def _elements(held: Sequence[Held], first: Sequence[bool], world: int) -> tuple[list[int], list[int]]:
    """Per rank, the elements of its pieces of the weights ``first`` marks and of the others
    (weights sharing one `Held` counted together)."""
    shared: dict[int, list] = {}
    for h, f in zip(held, first):
        shared.setdefault(id(h), [h, 0, 0])[1 if f else 2] += 1
    ones, others = [0] * world, [0] * world
    for h, n1, n2 in shared.values():
        for pc, holders in h.items():
            n = _numel(piece_shape(pc))
            for r in holders:
                ones[r] += n1 * n
                others[r] += n2 * n
    return ones, others


def _repeated(held: Sequence[Held]) -> int:
    """How many weights have a non-empty piece several ranks hold (`muonclip.common._dtensor.repeated`)."""
    seen: dict[int, bool] = {}
    for h in held:
        if id(h) not in seen:
            seen[id(h)] = any(len(holders) > 1 for pc, holders in h.items() if not is_empty(pc))
    return sum(seen[id(h)] for h in held)


def compute_dtype(group: dict, device: str) -> torch.dtype:
    """The dtype a group's matrices are orthogonalised in on ``device``: this machine's answer for
    ``"cpu"``; on a GPU of the device table (Hopper, Blackwell: bfloat16 natively) ``"auto"`` is
    bfloat16."""
    if device == "cpu" or group["orth_dtype"] != "auto":
        return resolve_orth_dtype(group["orth_dtype"], group["method"], torch.device("cpu"))
    return torch.bfloat16


def round_robin(out: Ranks, shapes: Sequence[tuple[int, ...]], sp: StepPlan, base: int, world: int) -> None:
    """Owners dealt in turn, ``unit i -> rank i mod world``, in the optimizer's order (Keller Jordan's
    ``Muon``, which takes each ``world``-th parameter); an expert-parallel piece stays on its owner."""
    turn = 0
    for i, u in enumerate(sp.units):
        if u.piece != tuple(range(n) for n in shapes[u.k]):  # an expert-parallel piece
            out.rr_flops[base + sp.owners[i]] += u.spec.flops
            continue
        out.rr_flops[base + turn % world] += u.spec.flops
        turn += 1


def working_set(sp: StepPlan, owned: Sequence[int], compute: int, device: str, gather: int, scatter: int) -> int:
    """The peak of what one rank's Muon step allocates besides its state (modelled, not counted):
    the largest of the gather phase (the all-to-all's buffers and the assembled float32 V of the
    units it owns: ``owned``), the orthogonalisation (those V, every owned result in the compute
    dtype, and the largest call's V, result, S and P: a whole bucket on a GPU, a chunk of at most
    `muonclip.optim._buckets.STEP_CHUNK_BYTES` on a CPU) and the scatter (the results and the
    all-to-all's buffers)."""
    whole = sum(_numel(sp.units[i].shape) * STATE_BYTES for i in owned if not sp.units[i].direct)
    results = sum(_numel(sp.units[i].shape) * compute for i in owned)
    buckets: dict[tuple[int, int], int] = defaultdict(int)
    for i in owned:
        s = sp.units[i].spec
        for b in range(s.n_blocks):
            buckets[(s.block_rows(b), s.cols)] += s.batch
    largest = 0
    bound = STEP_CHUNK_BYTES.get(device)
    for (a, b), n in buckets.items():
        m = min(a, b)
        call = n * (2 * a * b + 2 * m * m) * compute
        if bound is not None:
            per = max(1, bound // (4 * a * b * compute))
            call = min(n, per) * (2 * a * b + 2 * m * m) * compute
        largest = max(largest, call)
    return max(gather + whole, whole + results + largest, results + scatter)


def plan_costs(model: PlanModel, mesh: Mesh, comm_dtype: torch.dtype | None = None,
               device: str = "cuda") -> Ranks:
    """Every rank's figures of one step of ``model`` on ``mesh`` (see the module docstring);
    ``device``: where the step runs (the compute dtype of ``orth_dtype="auto"``, the chunk bound).

    Python's cycle collector is paused meanwhile: the plan allocates millions of small acyclic
    records on a large model (tens of thousands of weights on hundreds of ranks), and its passes
    over them would take as long as the plan."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _plan_costs(model, mesh, comm_dtype, device)
    finally:
        if enabled:
            gc.enable()


def _plan_costs(model: PlanModel, mesh: Mesh, comm_dtype: torch.dtype | None, device: str) -> Ranks:
    mesh.check()
    S = mesh.stage_size
    out = Ranks.zeros(mesh.world, S)
    wire = (comm_dtype or torch.float32).itemsize
    stages = stage_of_layers(model.n_layers, mesh.pp)
    plain = mesh.dp_shard * mesh.cp * mesh.tp * mesh.ep == 1  # DDP or ZeRO-1: no DTensor
    for s in range(mesh.pp):
        base = s * S
        weights = [w for w in model.weights if stage_of(w, stages, mesh.pp) == s]
        muon = [w for w in weights if w.muon]
        nm = len(muon)
        shapes, held = stage_holdings(weights, mesh)
        mshapes, mheld = shapes[:nm], held[:nm]
        sp = plan_held([w.group for w in muon], mshapes, _plan_specs(muon, mshapes), mheld, S) if muon else None
        if S > 1 and muon:
            _move(out, sp, base, wire)
            replicated(out, mshapes, mheld, sp, base, wire)
            round_robin(out, mshapes, sp, base, S)
        elif sp is not None:
            out.rep_flops[base] += sum(sp.flops)
            out.rr_flops[base] += sum(sp.flops)
        muon_el, adamw_el = _elements(held, [k < nm for k in range(len(weights))], S)
        flat = [zero1_flat(w, mesh) for w in weights]
        if any(flat):  # DeepSpeed's partitions: the state covers their padding too
            for el, pad in zip((muon_el, adamw_el), zero1_padding(weights, mesh)):
                for r in range(S):
                    el[r] += pad[r]
            # torch's AdamW under ZeRO-1: its one param group is one buffer, one parameter (one step tensor)
            _, adamw_el_torch = _elements(held, flat, S)
            adamw_el_torch = [zero1_size(sum(w.numel for w, f in zip(weights, flat) if f), S) + n
                              for n in adamw_el_torch]
            adamw_steps = 1 + flat.count(False)
        else:
            adamw_el_torch = [m + a for m, a in zip(muon_el, adamw_el)]
            adamw_steps = len(weights)
        ds_checks = plain and any(flat)  # DeepSpeed's ZeRO-1 drives the step: its one finite check per step
        dtensor_flags = 0 if plain else all_reduce_bytes(4 * len(weights), S)
        copies = 0 if plain else _repeated(mheld)
        heads = [h for layer, h in (model.heads or []) if layer >= 0 and stages[layer] == s]
        owned: list[list[int]] = [[] for _ in range(S)]
        for i, o in enumerate(sp.owners if sp is not None else ()):
            owned[o].append(i)
        compute = compute_dtype(muon[0].group, device).itemsize if muon else 0
        for r in range(S):
            g = base + r
            if sp is not None:
                out.ns_flops[g] = sp.flops[r]
                for i in owned[r]:
                    spec = sp.units[i].spec
                    for b in range(spec.n_blocks):
                        out.matrices[g][(spec.block_rows(b), spec.cols)] += spec.batch
            out.muon_elements[g] = muon_el[r]
            out.adamw_elements[g] = adamw_el[r]
            out.muon_state[g] = STATE_BYTES * (out.muon_elements[g] + 2 * out.adamw_elements[g])
            out.adamw_state[g] = 2 * STATE_BYTES * adamw_el_torch[r] + 4 * adamw_steps
            if S > 1 and ds_checks:
                out.checks[g] = all_reduce_bytes(4 * len({id(w.group) for w in weights}), S)
            elif S > 1:
                out.checks[g] = (all_reduce_bytes(8 * (2 + 2 * nm), S) if muon else 0) + dtensor_flags
                out.first_checks[g] = all_reduce_bytes(8 * 4 * nm, S) if plain and muon else 0
            if S > 1:
                out.first_copies[g] = FINGERPRINT_BYTES * copies * (S - 1)
                out.clip[g] = all_reduce_bytes(4 * sum(2 * h + 1 for h in heads), S) if heads else 0
            if sp is not None:
                out.muon_work[g] = max(working_set(sp, owned[r], compute, device,
                                                   out.gather_sent[g] + out.gather_recv[g],
                                                   out.scatter_sent[g] + out.scatter_recv[g]),
                                       2 * STATE_BYTES * out.adamw_elements[g])
            out.adamw_work[g] = 2 * STATE_BYTES * adamw_el_torch[r]
    if model.heads is None:
        out.notes.append(model.clip_note)
    return out
