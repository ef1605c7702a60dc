"""The time model of ``muonclip plan``: a roofline over published peaks, or this CPU's measured rates.

A step's time on a rank is modelled as the sum, with no overlap, of

* **Newton–Schulz**: its flops at the device's matmul rate (a published dense bfloat16 peak; on
  ``--device cpu`` the rate this machine measures for batched products of each size, `calibrate`);
* **element-wise work**: the bytes its element-wise kernels move (`MUON_BYTES`, `ADAMW_BYTES` per
  element of its pieces) at the memory bandwidth;
* **communication**: the bytes it sends or receives (the larger) to ranks of its own NVLink domain at
  the NVLink rate, and to others at the inter-node rate; the all-reduces at the slower of the two
  when the group spans domains.

The step takes the slowest rank's time (every rank meets the others in the step's collectives).
This is a model, labelled as one everywhere it is printed: the flops, bytes and memory it starts
from are exact, the rates are peaks (a real step reaches less of them) or this machine's.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .plan_cost import Ranks

MUON_BYTES = 40
"""Bytes one element of a Muon weight moves through memory in the step's element-wise kernels
(`muonclip.optim.functional`): momentum ``M = mu M + G`` (read M, G; write M: 12), Nesterov's
``V = G + mu M`` written in the compute dtype (read G, M; write V: 10), decay and the scaled update
of the weight (read and write W twice, read O: 18)."""

ADAMW_BYTES = 92
"""Bytes one element of an AdamW weight moves in its ``_foreach`` kernels (`muonclip.optim._adamw`,
as torch's AdamW): the two moments (read and write each, G read twice: 28), decay (8), the
denominator's square root, division and epsilon (24), the update (read m and the denominator,
write it: 12; read W and it, write W: 12), 4 bytes each."""


@dataclass(frozen=True)
class Device:
    """A device's rates.

    Attributes:
        name: how it is printed.
        flops: dense bfloat16 matmul rate, FLOP/s (a published peak, or measured).
        mem_bw: memory bandwidth, bytes/s.
        link_bw: per-GPU NVLink bandwidth, bytes/s (one direction).
        net_bw: per-GPU bandwidth between NVLink domains, bytes/s.
        domain: GPUs per NVLink domain.
        measured: ``(size, FLOP/s)`` of batched products by matrix size (`calibrate`), else ().
        source: where the figures come from.
    """

    name: str
    flops: float
    mem_bw: float
    link_bw: float
    net_bw: float
    domain: int
    measured: tuple[tuple[int, float], ...] = ()
    source: str = ""

    def rate(self, rows: int, cols: int) -> float:
        """The matmul rate for Newton–Schulz on ``rows x cols`` matrices: the measured rate at the
        nearest measured sizes of the smaller side (log-linear between them), else the peak."""
        if not self.measured:
            return self.flops
        m = min(rows, cols)
        sizes = [s for s, _ in self.measured]
        i = bisect.bisect_left(sizes, m)
        if i == 0:
            return self.measured[0][1]
        if i == len(sizes):
            return self.measured[-1][1]
        (s0, r0), (s1, r1) = self.measured[i - 1], self.measured[i]
        t = (math.log(m) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0)))


_NV = "NVIDIA datasheet, published peak (dense bfloat16, no sparsity)"
DEVICES: dict[str, Device] = {
    "h100": Device("H100 SXM", 989e12, 3.35e12, 450e9, 50e9, 8, source=f"{_NV}; 400 Gb/s InfiniBand per GPU"),
    "h800": Device("H800 SXM", 989e12, 3.35e12, 200e9, 50e9, 8,
                   source=f"{_NV}: H100's compute and memory, NVLink 400 GB/s; 400 Gb/s network per GPU"),
    "h200": Device("H200 SXM", 989e12, 4.8e12, 450e9, 50e9, 8, source=f"{_NV}; 400 Gb/s InfiniBand per GPU"),
    "b200": Device("B200", 2.25e15, 8e12, 900e9, 50e9, 8, source=f"{_NV}; 400 Gb/s InfiniBand per GPU"),
    "gb300": Device("GB300 NVL72", 2.5e15, 8e12, 900e9, 100e9, 72,
                    source=f"{_NV}; 800 Gb/s ConnectX-8 per GPU between racks"),
}
"""The device table (``--device``). NVLink is quoted as a total of both directions (900 GB/s on
Hopper, 1.8 TB/s on Blackwell): one direction is half."""


def _best_seconds(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def calibrate(dtype: torch.dtype, sizes: Sequence[int] = (64, 128, 256, 512, 1024), repeat: int = 5) -> Device:
    """This CPU's own rates (``--device cpu``): batched ``m x m`` products in ``dtype`` (the step's
    compute dtype here) at each size of ``sizes``, and a 64 MiB float32 copy (read and write
    counted) for memory; each the fastest of ``repeat`` runs after a warm-up (the least disturbed
    by other processes). There is no link
    between processes to measure here: the communication time is left out unless ``--link-bw``
    gives one. Under other processes' load the rates drop with it; with more torch threads than
    free cores they drop far more (threads wait for each other), so measure on a quiet machine."""
    measured = []
    for m in sizes:
        batch = max(1, (2**27) // (m * m * 4))
        a = torch.randn(batch, m, m).to(dtype)
        measured.append((m, 2 * batch * m**3 / _best_seconds(lambda a=a: torch.bmm(a, a), repeat)))
    src = torch.empty(2**24)
    dst = torch.empty_like(src)
    mem = 2 * src.numel() * 4 / _best_seconds(lambda: dst.copy_(src), repeat)
    return Device(f"this CPU ({dtype})", max(r for _, r in measured), mem, 0.0, 0.0, 1, tuple(measured),
                  f"measured here: batched {dtype} products of {sizes[0]}-{sizes[-1]}, a 64 MiB copy")


def override(device: Device, peak: float | None, mem: float | None, link: float | None) -> Device:
    """``device`` with ``--peak-flops``, ``--mem-bw``, ``--link-bw`` (link: both the NVLink and the
    inter-node rate) where given; a given peak replaces measured rates."""
    if peak is not None:
        device = replace(device, flops=peak, measured=())
    if mem is not None:
        device = replace(device, mem_bw=mem)
    if link is not None:
        device = replace(device, link_bw=link, net_bw=link)
    return device


@dataclass
class Times:
    """Modelled seconds per rank of one step.

    Attributes:
        ns, elementwise, comm: Muon's Newton–Schulz, element-wise and communication parts.
        clip: MuonClip's max-logit all-reduce.
        adamw: ``torch.optim.AdamW``'s step.
        comm_known: False when the device has no link rate (this CPU without ``--link-bw``).
    """

    ns: list[float]
    elementwise: list[float]
    comm: list[float]
    clip: list[float]
    adamw: list[float]
    comm_known: bool

    def muon(self) -> list[float]:
        """Muon's step per rank."""
        return [a + b + c for a, b, c in zip(self.ns, self.elementwise, self.comm)]

    def muonclip(self) -> list[float]:
        """MuonClip's step per rank."""
        return [m + c for m, c in zip(self.muon(), self.clip)]


def _link_time(by_peer: dict[int, int], me: int, device: Device) -> tuple[float, float]:
    """Bytes to (or from) ranks of ``me``'s NVLink domain, and to others."""
    near = sum(b for p, b in by_peer.items() if p // device.domain == me // device.domain)
    return near, sum(by_peer.values()) - near


def ns_seconds(matrices: dict[tuple[int, int], int], flops: int, device: Device) -> float:
    """Seconds of ``flops`` Newton–Schulz flops on ``matrices`` (``{(rows, cols): count}``): each
    shape's share at the device's rate for it (`Device.rate`)."""
    one = {ab: 4 * min(ab) ** 2 * max(ab) + 2 * min(ab) ** 3 for ab in matrices}
    unit = sum(count * one[ab] for ab, count in matrices.items())
    if not unit:
        return 0.0
    return flops / unit * sum(count * one[ab] / device.rate(*ab) for ab, count in matrices.items())


def model_times(r: Ranks, device: Device) -> Times:
    """The modelled time of every rank's step (module docstring)."""
    known = device.link_bw > 0 and device.net_bw > 0
    t = Times([], [], [], [], [], known)
    for g in range(len(r.ns_flops)):
        t.ns.append(ns_seconds(r.matrices[g], r.ns_flops[g], device))
        t.elementwise.append((r.muon_elements[g] * MUON_BYTES + r.adamw_elements[g] * ADAMW_BYTES) / device.mem_bw)
        t.adamw.append((r.muon_elements[g] + r.adamw_elements[g]) * ADAMW_BYTES / device.mem_bw)
        if not known:
            t.comm.append(0.0)
            t.clip.append(0.0)
            continue
        stage = g // r.stage_size
        spans = (stage * r.stage_size) // device.domain != ((stage + 1) * r.stage_size - 1) // device.domain
        reduce_bw = device.net_bw if spans else device.link_bw
        (sn, sf), (rn, rf) = _link_time(r.sent_to[g], g, device), _link_time(r.recv_from[g], g, device)
        t.comm.append(max(sn, rn) / device.link_bw + max(sf, rf) / device.net_bw + r.checks[g] / reduce_bw)
        t.clip.append(r.clip[g] / reduce_bw)
    return t


def training_step(active_params: int, attention: tuple[int, int, int, int] | None, tokens: int, seq_len: int,
                  world: int, mfu: float, device: Device) -> tuple[float, float]:
    """``(model flops per token, seconds)`` of one training step's forward and backward on each GPU:
    ``6 N`` per token (N: parameters a token goes through) plus causal attention's ``3 L H S
    (d_qk + d_v)`` at sequence length S, for ``tokens`` tokens over ``world`` GPUs at ``mfu`` of the
    device's peak."""
    per_token = 6 * active_params
    if attention is not None:
        layers, heads, qk, v = attention
        per_token += 3 * layers * heads * seq_len * (qk + v)
    return per_token, per_token * tokens / world / (mfu * device.flops)
