"""Fused weights split by default under DDP and FSDP2 (2 gloo ranks on CPU) take the steps of the
twin model that stores the maps as separate ``nn.Linear`` layers, trained in one process.

FSDP2 shards every weight by rows, so a shard boundary falls inside a matrix block: in Phi-3's
``qkv_proj`` (48 rows ``[q 32 | k 8 | v 8]``: rows 0-23 and 24-47, inside q, and q and k/v have
different update scales) and in GPT-NeoX's interleaved ``query_key_value`` (72 rows, boundary at
36: inside head 1's k). The owner of each weight gathers it whole, cuts the blocks, and every
rank applies its rows of the result with each block's scale.
"""

from __future__ import annotations

import os

import pytest
import torch
from probes import shard_rows
from test_distributed import WORLD, _full, _launch
from test_fused import TOL, batch, max_diff, tiny
from toy_models import unfuse

import muonclip
from muonclip.optim._matrices import matrix_spec

pytest.importorskip("transformers")

KINDS = ("phi3", "neox", "mixtral")  # GPT-2 (in, out) splits: test_distributed.py
OPT = dict(lr=0.02, weight_decay=0.1, orth_dtype=torch.float32)
STEPS = 3


def _groups(model, kind):
    # k biases have an exactly-zero true gradient: AdamW at lr 0 there (see test_fused)
    return muonclip.param_groups(model, **({"adamw_lr": 0.0} if kind in ("gpt2", "neox") else {}))


def _train(net, groups, rank=0, world=1):
    opt = muonclip.Muon(groups, **OPT)
    for s in range(STEPS):
        x = batch(s)
        n = x.shape[0] // world
        mine = x[rank * n:(rank + 1) * n]
        net(input_ids=mine, labels=mine).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def _wrap(model, mode):
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model)
    from torch.distributed.fsdp import fully_shard

    layers = next(m for m in model.modules() if isinstance(m, torch.nn.ModuleList))
    for layer in layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _worker(rank, world, out_dir):
    torch.manual_seed(0)
    out = {}
    for mode in ("ddp", "fsdp"):
        for kind in KINDS:
            model = tiny(kind)
            net = _wrap(model, mode)
            _train(net, _groups(model, kind), rank, world)
            out[mode, kind] = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def test_shard_boundaries_fall_inside_blocks():
    """The sizes above put a row-shard boundary inside a block (what the parity test relies on)."""
    (start, _) = shard_rows(48, WORLD, 1)
    assert start == 24 and 0 < start < 32  # inside Phi-3's q block [0, 32)
    (start, _) = shard_rows(72, WORLD, 1)
    neox = matrix_spec((72, 16), {"flatten": False, "split_sizes": [8, 8, 8], "split_groups": 3, "transposed": False,
                                  "adjust_lr_fn": "original", "method": "ns5", "ns_steps": None})
    k_rows = neox.blocks[1]  # GPT-NeoX k: rows 8-16, 32-40, 56-64
    assert start == 36 and any(a < start < b for a, b in k_rows)


def test_fused_weights_under_ddp_and_fsdp2_step_as_separate_maps_in_one_process(tmp_path):
    _launch(_worker, str(tmp_path), limit_s=300)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    for kind in KINDS:
        twin = tiny(kind)
        fused_view = unfuse(twin)
        _train(twin, _groups(twin, kind))
        ref = fused_view()
        whole = tiny(kind)
        _train(whole, muonclip.param_groups(whole, split_fused=False,
                                            **({"adamw_lr": 0.0} if kind in ("gpt2", "neox") else {})))
        assert max_diff({n: p.detach() for n, p in whole.named_parameters()}, ref) > 100 * TOL  # it can tell
        for mode in ("ddp", "fsdp"):
            got = [r[mode, kind] for r in ranks]
            assert max_diff(got[0], got[1]) == 0.0, (mode, kind)  # replicas agree exactly
            diff = max_diff(got[0], ref)
            print(f"{mode} {kind}: max |fused param - separate-maps param| after {STEPS} steps = {diff:.3g}")
            assert diff <= TOL, (mode, kind, diff)
