"""The Muon update, in one place: its phases and `muon_step`, their one composition (what
`muonclip.Muon.step` runs, in one process and over several); `muon_update` is its call for one
weight.

For one weight matrix W (or a batch of them, ``(E, A, B)``), with gradient G and momentum
buffer M (docs/design.md, "Muon")::

    M = dequantize(M8)                       momentum_8bit only: int8 + a scale per block
    M = mu M + G                             momentum_
    M8 = quantize(M)                         momentum_8bit only (`muonclip.optim._quantized`)
    V = G + mu M   (nesterov)   or   V = M   muon_input
    O = orth(V)                              muonclip.orthogonalize, in the compute dtype
    O = normuon(O)                           normuon only: normalize_neurons_, per row
    mask = sign(O) sign(W) >= 0              cautious_weight_decay only (else mask = 1)
    W = W - lr wd mask W                     apply_update_: decoupled weight decay, base lr,
    W = W - lr scale(A, B) O                 then the scaled update

The three optional lines (each off by default, each a `muonclip.Muon` argument):

* **NorMuon** (Li et al., arXiv 2510.05491; microsoft/dion ``dion/normuon.py``): per matrix
  and per row i of O (an output neuron), ``v_i = beta2 v_i + (1 - beta2) mean_j O_ij^2``
  (state ``neuron_second_moment``, float32, zeros at first), ``O_ij = O_ij / (sqrt(v_i) +
  1e-8)``, then O is rescaled to the Frobenius norm it had before (``* |O|_F / max(|O'|_F,
  1e-8)``), so the update keeps Muon's size and the scale rule still applies. Per block of a
  fused split, per expert of a stack: each matrix that is orthogonalised is normalised alone.
* **Cautious weight decay** (modded-nanogpt, record 43, after Chen et al., arXiv
  2510.12402): the decay applies only to the elements where the update that is
  subtracted (O) and the weight have the same sign, ``O_ij W_ij >= 0`` (zeros included), as
  modded-nanogpt's ``mask = (v_chunk * param_chunk) >= 0`` and dion's ``cautious_wd``; the mask
  is taken from W before this step's decay.
* **8-bit momentum**: M stored as int8 with a float32 absmax scale per block of at most 256
  elements of a row (`muonclip.optim._quantized`); dequantised for the step, V formed from the
  float32 M, M quantised back.

`muon_step` runs these lines for every Muon weight of a step, with the blocks of equal shape
batched into one ``orthogonalize`` call (`muonclip.optim._buckets`): that is the step
`muonclip.Muon` runs, in one process and over several ranks, where the distribution layer
supplies only the exchanges around the same phases (`muonclip.optim.multiprocess.Exchange`:
the owner of each matrix, the gather of V before orthogonalisation, the scatter of the result
after). `muon_update` is `muon_step` on one weight (its momentum a float32 buffer).
`adamw_update` (`muonclip.optim._adamw`) is the AdamW branch's.

References:
    K. Jordan et al., "Muon: An optimizer for hidden layers in neural networks" (2024).
    torch.optim.Muon (``torch/optim/_muon.py``), whose update this is with the scale
    ``adjust_lr_fn`` names.
    Z. Li et al., "NorMuon: Making Muon more efficient and scalable", arXiv 2510.05491.
    L. Chen et al., arXiv 2510.12402 (cautious weight decay).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from ..common import defaults as D
from ..ortho import check_method
from ._buckets import Bucket, Chunk, Place, Results, StepStructure, Unit, stack_runs, weight_structure
from ._quantized import QuantBlocks, dequantize, quantize_
from ._scale import scale_name
from .workspace import CoreWorkspace

if TYPE_CHECKING:
    from .multiprocess import Exchange

NORMUON_EPS = 1e-8
"""NorMuon's epsilon, added to ``sqrt(v)`` and the floor of the rescale's norm (dion's value)."""


def momentum_(momentum_buffer: Tensor, grad: Tensor, momentum: float) -> Tensor:
    """``M = momentum * M + G`` in place (one pass); returns ``M``."""
    return torch.add(grad, momentum_buffer, alpha=momentum, out=momentum_buffer)


def muon_input(grad: Tensor, momentum_buffer: Tensor, momentum: float, nesterov: bool,
               out: Tensor | None = None) -> Tensor:
    """The matrix Muon orthogonalises: ``V = G + momentum * M`` (Nesterov) or ``V = M``.

    Written into ``out`` when given (any dtype, e.g. a bfloat16 slot of a bucket: the sum is
    rounded once, into it), else a new tensor (or ``M`` itself without Nesterov).
    """
    if not nesterov:
        return momentum_buffer if out is None else out.copy_(momentum_buffer)
    return torch.add(grad, momentum_buffer, alpha=momentum, out=out)


def normalize_neurons_(O: Tensor, second_moment: Tensor, beta2: float) -> None:
    """NorMuon's normalisation of orthogonalised matrices, in place (module docstring).

    ``O``: ``(E, A, B)``, E matrices whose rows are output neurons (any float dtype; the
    arithmetic is in ``second_moment``'s dtype and the result rounded into ``O`` once).
    ``second_moment``: ``(E, A)``, the rows' EMA of ``mean_j O_ij^2``, updated in place.
    """
    U = O.to(second_moment.dtype)
    norm = torch.linalg.vector_norm(U, dim=(-2, -1), keepdim=True)
    second_moment.lerp_(U.square().mean(dim=-1), 1.0 - beta2)
    N = U / (second_moment.sqrt() + NORMUON_EPS).unsqueeze(-1)
    N.mul_(norm / torch.linalg.vector_norm(N, dim=(-2, -1), keepdim=True).clamp_min(NORMUON_EPS))
    O.copy_(N)


def apply_update_(param: Tensor, update: Tensor, *, lr: float, weight_decay: float, scale: float,
                  cautious: bool = False) -> None:
    """``W = W (1 - lr wd)`` (cautious: only where ``sign(O) sign(W) >= 0``) then
    ``W = W - lr * scale * O``, in place.

    ``update`` (``O``) is added as it is (e.g. bfloat16 into a float32 weight, as
    torch.optim.Muon does), with ``-lr * scale`` as the one coefficient: no scaled copy.
    """
    if weight_decay != 0.0:
        if cautious:
            same_sign = (update.sign() * param.sign()) >= 0
            param.sub_(param * same_sign, alpha=lr * weight_decay)
        else:
            param.mul_(1.0 - lr * weight_decay)
    param.add_(update, alpha=-lr * scale)


def muon_update(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor,
    *,
    lr: float,
    weight_decay: float = D.WEIGHT_DECAY,
    momentum: float = D.MOMENTUM,
    nesterov: bool = D.NESTEROV,
    method: str = D.METHOD,
    steps: int | None = D.NS_STEPS,
    dtype: torch.dtype | str | None = D.ORTH_DTYPE,
    eps: float = D.EPS,
    coefficients: Sequence[float] | None = D.NS_COEFFICIENTS,
    adjust_lr_fn: str | None = D.ADJUST_LR_FN,
    scale: float | None = None,
    second_moment: Tensor | None = None,
    normuon_beta2: float = D.NORMUON_BETA2,
    cautious: bool = False,
) -> None:
    """One Muon step of one weight, in place: `muon_step` (the body `muonclip.Muon` runs) on a
    step of this one weight, with the core workspace (fresh tensors).

    The weight is seen as `muonclip.Muon` sees it without group keys: a 2-D ``(A, B)`` weight is
    one matrix, a 3-D ``(E, A, B)`` one a batch of E, one of 4 or more dimensions the matrix
    ``(out, prod(rest))``. Every default is `muonclip.Muon`'s (`muonclip.common.defaults`): with
    the same ``lr``, the same update bit for bit on any machine.

    Args:
        param: the weight W (float32, bfloat16 or float64).
        grad: its gradient G, W's shape.
        momentum_buffer: M, W's shape (float32 or wider), updated in place.
        lr: learning rate.
        weight_decay: decoupled weight decay, multiplied by ``lr`` (default 0.1).
        momentum: mu in [0, 1) (default 0.95).
        nesterov: orthogonalise ``G + mu M`` instead of ``M`` (default True).
        method, steps, eps, coefficients: of `muonclip.orthogonalize` (defaults: ns5, its 5
            steps, 1e-7, its coefficients).
        dtype: compute dtype of the orthogonalisation; V is rounded into it once (default
            ``"auto"``: bfloat16 where ``param``'s device multiplies it natively, else float32;
            `muonclip.Muon`'s ``orth_dtype``).
        adjust_lr_fn: the update scale rule for the matrix shape (`muonclip.optim.update_scale`;
            default ``"match_rms_adamw"``, 0.2 sqrt(max(A, B))).
        scale: the update scale as a number, instead of ``adjust_lr_fn``'s (default None).
        second_moment: NorMuon's per-row buffer ``(A,)`` or ``(E, A)`` (float32, updated in
            place); None (default): no NorMuon.
        normuon_beta2: NorMuon's EMA coefficient (default 0.95).
        cautious: cautious weight decay (default False).
    """
    check_method(method, steps, dtype, coefficients)
    st = weight_structure(param, CoreWorkspace(), method=method, ns_steps=steps, orth_dtype=dtype, eps=eps,
                          ns_coefficients=coefficients, adjust_lr_fn=scale_name(adjust_lr_fn), scale=scale)
    spec = st.specs[0]
    moment = None if second_moment is None else second_moment.view(spec.batch, spec.rows)
    muon_step([MuonWeight(param, grad, momentum_buffer, lr, weight_decay, momentum, nesterov, moment, normuon_beta2,
                          cautious)], st)


def step_momentum(grad: Tensor, momentum: float, buffer: Tensor | None = None,
                  quantized: tuple[Tensor, Tensor, QuantBlocks] | None = None) -> Tensor:
    """The momentum phase of one weight: ``M = mu M + G`` on its float32 ``buffer``, or, with
    ``quantized = (int8 codes, scales, blocks)`` (8-bit momentum), on ``M`` dequantised into a
    new float32 tensor, quantised back after the update. Returns the float32 ``M`` of this step
    (what V is formed from)."""
    if quantized is None:
        return momentum_(buffer, grad, momentum)
    q, s, lay = quantized
    M = dequantize(q, s, lay, s.dtype)
    momentum_(M, grad, momentum)
    quantize_(M, q, s, lay)
    return M


class MuonWeight(NamedTuple):
    """One Muon weight in a step: its tensors (this process's, in their stored layout) and its
    group's settings for this step.

    ``momentum_buffer`` is the float32 M, or None with ``quantized`` (8-bit momentum:
    `step_momentum`). ``second_moment`` is NorMuon's ``(batch, rows)`` buffer, the rows of
    each block after those of the blocks before it (`MatrixSpec.block_offset`), or None.
    """

    param: Tensor
    grad: Tensor
    momentum_buffer: Tensor | None
    lr: float
    weight_decay: float
    momentum: float
    nesterov: bool
    second_moment: Tensor | None = None
    normuon_beta2: float = 0.95
    cautious: bool = False
    quantized: tuple[Tensor, Tensor, QuantBlocks] | None = None


class StepMomenta:
    """Each weight's momentum through one `muon_step`: when it is updated, what is live, when it
    is released.

    A weight's ``M = mu M + G`` (`step_momentum`) runs once, when its momentum is first asked
    for: for the first V formed from it, or at the end (`update_rest`) for a weight whose V this
    process neither orthogonalises nor sends. Its float32 M of this step (for 8-bit momentum a
    dequantised copy) stays live while a bucket slot still forms V from it (`write_v`), and is
    released after the last one: only the weights in flight hold a float32 copy.
    """

    def __init__(self, weights: Sequence[MuonWeight], slots: Sequence[int]) -> None:
        """``slots[k]``: the bucket slots whose V this process forms from weight k's momentum
        (`StepStructure.direct_blocks`)."""
        self._weights = weights
        self._slots_left = list(slots)
        self._pending = set(range(len(weights)))  # not updated yet this step
        self._live: dict[int, Tensor] = {}  # this step's M, by weight, while a slot needs it
        self._sent: dict[int, Tensor] = {}  # this process's V, by weight, while the gather runs

    def of(self, k: int) -> Tensor:
        """Weight k's M of this step, updated now if it was not yet."""
        if k in self._pending:
            self._pending.discard(k)
            w = self._weights[k]
            self._live[k] = (momentum_(w.momentum_buffer, w.grad, w.momentum) if w.quantized is None
                             else step_momentum(w.grad, w.momentum, quantized=w.quantized))
        return self._live[k]

    def v(self, k: int) -> Tensor:
        """This process's piece of weight k's V, for the gather (formed once: the gather may ask
        for it again until `gathered`)."""
        if k not in self._sent:
            w = self._weights[k]
            self._sent[k] = muon_input(w.grad, self.of(k), w.momentum, w.nesterov)
        return self._sent[k]

    def gathered(self) -> None:
        """The gather is over: release its V pieces and every momentum no slot still needs."""
        self._sent.clear()
        for k in [k for k in self._live if not self._slots_left[k]]:
            del self._live[k]

    def write_v(self, unit: Unit, b: int, experts: slice | None, slot: Tensor) -> None:
        """V of block ``b`` of ``unit`` (or of its ``experts``, a part of a stack cut by a chunk)
        written into ``slot``; the weight's M is released after its last slot is whole."""
        k, spec = unit.k, unit.spec
        w = self._weights[k]
        G, M = w.grad, self.of(k)
        if experts is not None:
            G, M = G[experts], M[experts]
        elif spec.n_blocks > 1:
            G, M = spec.block(G, b), spec.block(M, b)
        muon_input(G, M, w.momentum, w.nesterov, out=slot)
        if experts is None or experts.stop == spec.batch:  # the slot is whole
            self._slots_left[k] -= 1
            if not self._slots_left[k]:
                del self._live[k]

    def write_plain(self, units: Sequence[Unit], V: Tensor, gathered: Sequence[Tensor | None]) -> None:
        """V of each matrix of ``V``, a chunk of a plain bucket (``units``: a whole 2-D weight per
        matrix; ``gathered``: its V assembled by the gather, or None), as `write_v` would write it,
        with the passes of each run of weights whose settings and dtypes agree done once over
        stacks of at most `STACK_BYTES`: ``M`` and ``V`` of the run in one call each, the momenta
        copied back to their buffers."""
        ks, ws, pending = [u.k for u in units], self._weights, self._pending
        keys = [(w.momentum, w.nesterov, w.grad.dtype, w.momentum_buffer.dtype)  # what a run shares
                if t is None and w.quantized is None and k in pending else None  # else: alone
                for k, t, w in zip(ks, gathered, [ws[k] for k in ks])]
        for lo, hi in stack_runs(keys, V[0].numel()):
            if hi - lo > 1:
                run = [ws[k] for k in ks[lo:hi]]
                G, buffers, w = torch.stack([w.grad for w in run]), [w.momentum_buffer for w in run], run[0]
                M = momentum_(torch.stack(buffers), G, w.momentum)
                torch._foreach_copy_(buffers, M.unbind(0))
                muon_input(G, M, w.momentum, w.nesterov, out=V[lo:hi])
                self._pending.difference_update(ks[lo:hi])
            elif gathered[lo] is not None:
                V[lo].copy_(gathered[lo])
            else:
                self.write_v(units[lo], 0, None, V[lo])

    def update_rest(self) -> None:
        """The momentum of every weight not asked for in this step (this process neither
        orthogonalises nor sends its V), updated."""
        for k in sorted(self._pending):
            w = self._weights[k]
            step_momentum(w.grad, w.momentum, w.momentum_buffer, w.quantized)
        self._pending.clear()


def muon_step(weights: Sequence[MuonWeight], structure: StepStructure, exchange: Exchange | None = None) -> int:
    """The Muon update of every weight of a step, the one composition of the phases (module
    docstring), in one process and over several ranks; returns the matrices orthogonalised here.

    ``structure`` (`muonclip.optim._buckets.StepStructure`): the units of work this process
    orthogonalises, their buckets of same-shape blocks, where each weight's result applies.
    ``exchange`` (`muonclip.optim.multiprocess.Exchange`; None in one process): the gather of V
    to the owners before orthogonalisation, the scatter of the results after. Each weight's
    momentum is updated just before its V is first formed and released after its last slot
    (`StepMomenta`), the passes of small whole weights with the same settings once per stack of
    them (`StepMomenta.write_plain`, `apply_plain`); each bucket is written in chunks
    (`StepStructure.chunks`) in the compute dtype, each orthogonalised in one call by its
    workspace; a result is applied once its weight (or the stack's experts a chunk cut) is
    complete (the workspace may then reuse it), or scattered.
    """
    units, momenta, one_process = structure.units, StepMomenta(weights, structure.direct_blocks), exchange is None
    whole = {} if one_process else exchange.gather(structure.routes, weights, momenta.v)  # V formed elsewhere
    momenta.gathered()
    results, done = Results([u.spec for u in units], reuse_result=one_process), {}
    normuon = any(w.second_moment is not None for w in weights)
    for bucket, chunk in structure.chunks():
        V = bucket.empty(chunk)  # 1-2. momentum, V written into the bucket's slots
        items = bucket.items(chunk) if bucket.plain else None  # a whole 2-D weight per matrix
        if items is not None:  # small ones in stacks
            momenta.write_plain([units[u] for u in items], V, [whole.get(u) for u in items])
        else:
            for u, b, experts, slot in bucket.slots(V, chunk):
                if u in whole:
                    slot.copy_(units[u].spec.block(whole[u], b))
                else:
                    momenta.write_v(units[u], b, experts, slot)
        O = bucket.orthogonalize(V, reuse_result=one_process)  # 3. one call per chunk, then NorMuon
        if normuon:
            normuon_bucket_(bucket, O, lambda u, b: neuron_moment(weights[units[u].k], units[u], b), chunk)
        if items is not None and one_process:  # 4. the update, small weights in stacks
            apply_plain([weights[units[u].k] for u in items], [structure.places[units[u].k] for u in items], O)
            continue
        for u, experts, O_u in results.of(bucket, O, chunk):  # 4. the update, or kept for the scatter
            if one_process:
                _apply(weights[units[u].k], O_u, structure.places[units[u].k], experts)
            else:
                done[u] = O_u
    momenta.update_rest()
    for k, O_k in () if one_process else exchange.scatter(structure.routes, done, weights):
        _apply(weights[k], O_k, structure.places[k])
    return sum(bucket.shape[0] for bucket in structure.buckets)


def _apply(w: MuonWeight, update: Tensor, place: Place, experts: slice | None = None) -> None:
    """`apply_blocks_` of ``update`` to weight ``w``'s rows at ``place`` (of its ``experts`` only:
    the result of a chunk's part of a stack); `apply_flat_` where the place is a `FlatPlace`."""
    axis, ranges, offset = place
    if offset == 0 and experts is None and len(ranges) == 1 and update.shape == w.param.shape:  # one scale, all rows
        apply_update_(w.param, update, lr=w.lr, weight_decay=w.weight_decay, scale=ranges[0][2], cautious=w.cautious)
        return
    if isinstance(offset, FlatPlace):
        apply_flat_(w.param, update, lr=w.lr, weight_decay=w.weight_decay, axis=axis, ranges=ranges, place=offset,
                    cautious=w.cautious)
        return
    apply_blocks_(w.param if experts is None else w.param[experts], update, lr=w.lr, weight_decay=w.weight_decay,
                  axis=axis, ranges=ranges, offset=offset, cautious=w.cautious)


def apply_plain(ws: Sequence[MuonWeight], places: Sequence[Place], O: Tensor) -> None:
    """`_apply` of each matrix of ``O`` to its weight (``ws``: a whole 2-D weight each, at
    ``places``), with each run of weights whose settings, scale and dtype agree stacked (at most
    `STACK_BYTES`): the decay and the update run once over the stack, copied back to the weights."""
    shape = O.shape[1:]
    keys = [(w.lr, w.weight_decay, w.cautious, ranges[0][2], w.param.dtype)
            if offset == 0 and len(ranges) == 1 and w.param.shape == shape else None
            for w, (_, ranges, offset) in zip(ws, places)]
    for lo, hi in stack_runs(keys, O[0].numel()):
        if hi - lo == 1:
            _apply(ws[lo], O[lo], places[lo])
            continue
        params, w = [w.param for w in ws[lo:hi]], ws[lo]
        W = torch.stack(params)
        apply_update_(W, O[lo:hi], lr=w.lr, weight_decay=w.weight_decay, scale=keys[lo][3], cautious=w.cautious)
        torch._foreach_copy_(params, W.unbind(0))


def neuron_moment(w: MuonWeight, unit: Unit, b: int) -> tuple[Tensor, float] | None:
    """NorMuon's second-moment rows of block ``b`` of ``unit`` (of weight ``w``): its columns of the
    ``(batch, rows)`` buffer, the rows of the unit's experts, and beta2; None without NorMuon."""
    if w.second_moment is None:
        return None
    rows = w.second_moment[unit.experts].narrow(1, unit.spec.block_offset(b), unit.spec.block_rows(b))
    return rows, w.normuon_beta2


def normuon_bucket_(bucket: Bucket, O: Tensor,
                    moment_of: Callable[[int, int], tuple[Tensor, float] | None], chunk: Chunk | None = None) -> None:
    """`normalize_neurons_` of every slot of the orthogonalised bucket ``O`` (or ``chunk`` of it)
    whose item has NorMuon: ``moment_of(item, block)`` gives its second-moment rows ``(E, rows_b)``
    and beta2 (the rows of a chunk's expert range, for a part of a stack)."""
    parts = (chunk or bucket.whole()).parts
    for (j, lo, hi), r in zip(parts, O.split([hi - lo for _, lo, hi in parts])):
        k, b = bucket.entries[j]
        moment = moment_of(k, b)
        if moment is not None:
            rows, beta2 = moment
            normalize_neurons_(r, rows if hi - lo == len(rows) else rows[lo:hi], beta2)


def apply_blocks_(param: Tensor, update: Tensor, *, lr: float, weight_decay: float, axis: int,
                  ranges: Sequence[tuple[int, int, float]], offset: int = 0, cautious: bool = False) -> None:
    """`apply_update_` for a weight cut into matrix blocks, each with its own scale.

    ``ranges``: ``(a, b, scale)`` for the rows ``[a, b)`` along ``axis``
    (`muonclip.optim._matrices.MatrixSpec.ranges`). ``param`` and ``update`` hold the rows
    ``[offset, offset + n)`` along ``axis``, ``n = update.shape[axis]`` (all of them unless the
    weight is a shard of a larger one: a row shard, or a column shard of a transposed weight).
    The decay applies to all of ``param`` (``cautious``: elementwise, where ``update`` and
    ``param`` agree in sign), each range's update once.
    """
    if weight_decay != 0.0 and not cautious:
        param.mul_(1.0 - lr * weight_decay)
        weight_decay = 0.0
    for dst, src, scale in _pieces(param, update, axis, ranges, offset):
        apply_update_(dst, src, lr=lr, weight_decay=weight_decay, scale=scale, cautious=cautious)


class FlatPlace(NamedTuple):
    """Where a 1-D piece of a weight lies: elements ``[start, start + n)`` of the weight of
    ``shape`` flattened in row-major order (a partition of a flattening wrapper, DeepSpeed ZeRO;
    `muonclip.common._dtensor.FlatRange`). The third entry of a step's place for such a piece."""

    start: int
    shape: tuple[int, ...]


def apply_flat_(param: Tensor, update: Tensor, *, lr: float, weight_decay: float, axis: int,
                ranges: Sequence[tuple[int, int, float]], place: FlatPlace, cautious: bool = False) -> None:
    """`apply_blocks_` for a 1-D ``param`` that is the elements at ``place`` of a weight (``update``
    the same elements of its orthogonalised update): the decay on every element, each element's
    update scaled by the range ``(a, b, scale)`` its index along ``axis`` falls in (one scale for
    the piece when every range has the same)."""
    if weight_decay != 0.0 and not cautious:
        param.mul_(1.0 - lr * weight_decay)
        weight_decay = 0.0
    if len({s for _, _, s in ranges}) == 1:
        apply_update_(param, update, lr=lr, weight_decay=weight_decay, scale=ranges[0][2], cautious=cautious)
        return
    inner = 1
    for n in place.shape[axis + 1:]:
        inner *= n
    per_index = torch.empty(place.shape[axis], dtype=update.dtype, device=update.device)
    for a, b, s in ranges:
        per_index[a:b] = s
    index = torch.arange(place.start, place.start + param.numel(), device=update.device) // inner % place.shape[axis]
    apply_update_(param, update * per_index[index], lr=lr, weight_decay=weight_decay, scale=1.0, cautious=cautious)


def _pieces(param: Tensor, update: Tensor, axis: int, ranges: Sequence[tuple[int, int, float]],
            offset: int) -> list[tuple[Tensor, Tensor, float]]:
    """``(param rows, update rows, scale)`` of each range present here (whole tensors when one
    range covers everything: no views)."""
    n = update.shape[axis]
    if len(ranges) == 1 and offset == 0 and ranges[0][:2] == (0, n) and n == param.shape[axis]:
        return [(param, update, ranges[0][2])]  # the usual case: one block, all rows here
    out = []
    for a, b, s in ranges:
        lo, hi = max(a, offset), min(b, offset + n)
        if lo < hi:
            out.append((param.narrow(axis, lo - offset, hi - lo), update.narrow(axis, lo - offset, hi - lo), s))
    return out


__all__ = ["NORMUON_EPS", "FlatPlace", "MuonWeight", "StepMomenta", "apply_blocks_", "apply_flat_", "apply_plain",
           "apply_update_", "momentum_", "muon_input", "muon_step", "muon_update", "neuron_moment",
           "normalize_neurons_", "normuon_bucket_", "step_momentum"]
