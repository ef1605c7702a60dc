"""NorMuon, cautious weight decay and 8-bit momentum over 2 gloo ranks take the steps of one process.

DTensor parameters on a 2-rank mesh, each layout the engine handles differently: rows sharded
(FSDP2's ``Shard(0)``), a fused split whose shard boundary falls inside a block (row 8 of
``[6 | 5 | 5]``), stacked experts sharded by whole experts (expert parallel: each rank
orthogonalises its own) and a column shard (``Shard(1)``, tensor parallel's row-parallel
layout). NorMuon's row statistics must be those of the whole matrix's rows (the owner's), every
rank must end with the same second moments, and 8-bit momentum must refuse a column shard.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_distributed import WORLD, _launch

import muonclip

SHAPES = {"rows": (12, 20), "fused": (16, 10), "experts": (4, 8, 10), "columns": (12, 20)}
KEYS = {"rows": {}, "fused": {"split_sizes": [6, 5, 5]}, "experts": {}, "columns": {"momentum_8bit": False}}
OPT = dict(lr=0.05, weight_decay=0.5, orth_dtype=torch.float32, normuon=True, cautious_weight_decay=True,
           momentum_8bit=True)
STEPS = 4
TOL = 1e-5


def _init():
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def _grad(step, W):
    g = torch.Generator().manual_seed(100 + step)
    return 0.5 * W + torch.randn(W.shape, generator=g)


def _run(params, full):
    """STEPS steps; ``full(p)`` is the whole tensor of ``p``; returns the optimizer."""
    opt = muonclip.Muon([{"params": [p], "param_names": [n], **KEYS[n]} for n, p in params.items()], **OPT)
    for s in range(STEPS):
        for p in params.values():
            p.grad = _like(p, _grad(s, full(p.detach())))
        opt.step()
    return opt


def _like(p, t):
    from torch.distributed.tensor import DTensor, distribute_tensor

    return distribute_tensor(t, p.device_mesh, p.placements) if isinstance(p, DTensor) else t


def _worker(rank, world, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    place = {"rows": Shard(0), "fused": Shard(0), "experts": Shard(0), "columns": Shard(1)}
    params = {n: torch.nn.Parameter(distribute_tensor(t, mesh, [place[n]])) for n, t in _init().items()}
    opt = _run(params, lambda t: t.full_tensor())
    out = {n: p.detach().full_tensor() for n, p in params.items()}
    out.update({(n, "v"): opt.state[p]["neuron_second_moment"].clone() for n, p in params.items()})
    # 8-bit momentum on a column shard cuts rows: refused on every rank, with a message
    bad = torch.nn.Parameter(distribute_tensor(torch.randn(12, 20), mesh, [Shard(1)]))
    opt = muonclip.Muon([{"params": [bad], "param_names": ["tp.weight"]}], momentum_8bit=True)
    bad.grad = distribute_tensor(torch.ones(12, 20), mesh, [Shard(1)])
    try:
        opt.step()
        out["refused"] = ""
    except ValueError as e:
        out["refused"] = str(e)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_normuon_cautious_8bit_under_fsdp_tp_ep_shards_match_one_process(tmp_path):
    _launch(_worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    params = {n: torch.nn.Parameter(t) for n, t in _init().items()}
    opt = _run(params, lambda t: t)
    plain = {n: torch.nn.Parameter(t) for n, t in _init().items()}
    opts = {k: v for k, v in OPT.items() if k not in ("normuon",)}
    muonclip_plain = muonclip.Muon([{"params": [p], **KEYS[n]} for n, p in plain.items()], **opts)
    for s in range(STEPS):
        for p in plain.values():
            p.grad = _grad(s, p.detach())
        muonclip_plain.step()
    for n, p in params.items():
        for r in range(1, WORLD):
            assert torch.equal(ranks[r][n], ranks[0][n]) and torch.equal(ranks[r][n, "v"], ranks[0][n, "v"]), n
        diff = (ranks[0][n] - p.detach()).abs().max().item()
        assert diff <= TOL, (n, diff)
        torch.testing.assert_close(ranks[0][n, "v"], opt.state[p]["neuron_second_moment"], rtol=1e-4, atol=1e-7)
        assert (plain[n].detach() - p.detach()).abs().max().item() > 100 * TOL, n  # NorMuon changed the steps
    msg = ranks[0]["refused"]
    assert "tp.weight" in msg and "momentum_8bit" in msg and "dimension 1" in msg, msg
    assert ranks[1]["refused"] == msg


pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
