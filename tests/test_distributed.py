"""Distributed Muon / MuonClip on torch.distributed: DDP and FSDP2, gloo on CPU, 2 processes.

Every multi-rank check runs in processes started by ``torch.multiprocessing`` (a free port,
gloo, a 60 s collective timeout, a wall-clock limit so that a hang fails instead of stalling)
and compares against the single-process run of the same model on the same data, computed in
the same process with ``process_group="local"`` (docs/design.md, "Distributed Muon").
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from probes import shard_rows

import muonclip
from muonclip import Muon, param_groups
from muonclip.common._dtensor import local_rows
from muonclip.distributed import assign_owners, checkpoint
from muonclip.models import GPT, GPTConfig
from muonclip.optim import _buckets as buckets
from muonclip.optim._buckets import Bucket
from muonclip.optim._matrices import matrix_spec
from muonclip.ortho._newton_schulz import ns_flops
from muonclip.qkclip import MuonClip

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=3, n_embd=24)  # 3 heads of 8 rows: head 1 straddles 2 ranks
OPT = dict(lr=0.02, weight_decay=0.1, orth_dtype=torch.float32)
STEPS = 10
TOL = 1e-5
WORLD = 2


# ------------------------------------------------------------------------------------------
# harness
# ------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
        # leave together: a rank that tears its gloo group down while another still talks to it
        # can abort the other ("terminate called without an active exception"), seen under load
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _launch(fn, *args, world=WORLD, limit_s=150):
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; fail (not hang) after ``limit_s``."""
    ctx = mp.start_processes(_entry, args=(world, _free_port(), fn, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + limit_s
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"{fn.__name__} did not finish in {limit_s} s on {world} ranks (a hang?)")


def _model(seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**CFG, **kw}))


def _batch(step, B=4, T=16):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG["vocab_size"], (B, T + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _train(model, opt, steps, *, start=0, rank=0, world=1, after_step=None):
    """``steps`` steps on the global batches ``start..``; each rank takes its equal share of the batch."""
    for s in range(start, start + steps):
        x, y = _batch(s)
        n = x.shape[0] // world
        _, loss = model(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(s)


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _params(model) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)
    return {n: _full(p.detach()).clone() for n, p in model.named_parameters()}


def _opt_state(opt) -> dict[str, dict]:
    out = {}
    for g in opt.param_groups:
        for name, p in zip(g["param_names"], g["params"]):
            out[name] = {k: _full(v).clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
    return out


def _fsdp(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _reference(steps=STEPS, **opt_kw):
    model = _model()
    opt = Muon(param_groups(model), process_group="local", **{**OPT, **opt_kw})
    _train(model, opt, steps)
    return model, opt


def _muon_matrices(model) -> list[tuple[int, int]]:
    return [tuple(p.shape) for g in param_groups(model) if g["algorithm"] == "muon" for p in g["params"]]


# ------------------------------------------------------------------------------------------
# parity: DDP and FSDP2 match one process; NS once per matrix per step across the group
# ------------------------------------------------------------------------------------------


def _spy(collectives, calls):
    """Wrap the collectives and `Bucket.orthogonalize` (every bucket of a Muon step goes through it,
    whatever the backend); return an undo function."""
    real_orth = Bucket.orthogonalize

    def counting(self, V, *a, **k):
        calls.append(tuple(V.shape))
        return real_orth(self, V, *a, **k)

    wrapped = {}
    for op in ("all_reduce", "all_gather_into_tensor", "all_to_all_single"):
        real = wrapped[op] = getattr(dist, op)

        def spy(*a, _op=op, _real=real, **k):
            collectives.append(_op)
            return _real(*a, **k)

        setattr(dist, op, spy)
    Bucket.orthogonalize = counting

    def undo():
        Bucket.orthogonalize = real_orth
        for op, real in wrapped.items():
            setattr(dist, op, real)

    return undo


def _net(mode):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = _model()
    if mode == "ddp":
        return DDP(model), param_groups(model)
    net = _fsdp(model)
    return net, param_groups(net)


def _parity_worker(rank, world, out_dir, mode):
    calls: list[tuple[int, ...]] = []
    collectives: list[str] = []
    undo = _spy(collectives, calls)
    try:
        net, groups = _net(mode)
        opt = Muon(groups, **OPT)
        flops = []
        _train(net, opt, STEPS, rank=rank, world=world,
               after_step=lambda s: flops.append((opt.last_step_stats.ns_flops, opt.last_step_stats.total_ns_flops)))
    finally:
        undo()
    # bf16 on the wire is lossless when the orthogonalisation itself runs in bf16
    wire = []
    for comm_dtype in (None, torch.bfloat16):
        net16, groups16 = _net(mode)
        _train(net16, Muon(groups16, comm_dtype=comm_dtype, **{**OPT, "orth_dtype": torch.bfloat16}), 3,
               rank=rank, world=world)
        wire.append(_params(net16))
    result = {"params": _params(net), "calls": calls, "collectives": collectives, "flops": flops,
              "bf16_wire_diff": _max_diff(*wire)}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@functools.cache
def _reference_params():
    return _params(_reference()[0])


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_parity_ns_once_per_whole_matrix_and_same_collectives_on_every_rank(mode, tmp_path, record_property):
    """10 steps with DDP / FSDP2 on 2 ranks vs one process; NS counted; collective sequences compared.

    Against one process: TOL (another reduction order of the gradients). Between the two ranks:
    exactly equal on any machine, since every matrix's update is computed once, on its owner, and
    sent to the other rank, and AdamW's elementwise update runs on identical all-reduced gradients
    with the same kernels. bf16 on the wire is exactly lossless: the orthogonalisation casts its
    input to bf16 first and a bf16 value survives float32 and back."""
    _launch(_parity_worker, str(tmp_path), mode)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    # parity with one process (fp32 orthogonalisation)
    diff = max(_max_diff(r["params"], _reference_params()) for r in ranks)
    record_property(f"max_abs_diff_{mode}", diff)
    print(f"{mode}: max |param - single-process param| after {STEPS} steps = {diff:.3g}")
    assert diff <= TOL
    assert _max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0  # replicas agree exactly
    # Newton-Schulz: every matrix exactly once per step group-wide, on whole matrices, work shared
    matrices = _muon_matrices(_model())
    per_rank = [sum(c[0] for c in r["calls"]) for r in ranks]
    assert sum(per_rank) == STEPS * len(matrices)
    assert all(n > 0 for n in per_rank)
    for r in ranks:
        assert {c[1:] for c in r["calls"]} <= set(matrices)  # never a shard: only whole-matrix shapes
        mine, total = r["flops"][-1]
        assert total == sum(ns_flops([(1, a, b)], 5) for a, b in matrices)
        assert mine <= 0.6 * total  # balanced: about 1/2 each
    # the same collectives, in the same order, on every rank
    assert ranks[0]["collectives"] == ranks[1]["collectives"] and len(ranks[0]["collectives"]) >= STEPS
    # comm_dtype=bf16 with orth_dtype=bf16 changes nothing
    assert all(r["bf16_wire_diff"] == 0.0 for r in ranks)


def _conv1d_run(net, groups, rank=0, world=1, mode="local", **kw):
    bound = buckets.STEP_CHUNK_BYTES.get("cpu")
    if mode == "ddp":  # every bucket cut into chunks of one slot (the bound under one matrix's bytes)
        buckets.STEP_CHUNK_BYTES["cpu"] = 1
    try:
        opt = Muon(groups, **{**OPT, **kw})
        for s in range(4):
            g = torch.Generator().manual_seed(2000 + s)
            x = torch.randn(4, 6, generator=g)
            n = x.shape[0] // world
            net(x[rank * n:(rank + 1) * n]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        buckets.STEP_CHUNK_BYTES["cpu"] = bound
    return _params(net)


def _conv1d_net(mode):
    from toy_models import Conv1DNet

    torch.manual_seed(0)
    model = Conv1DNet(d=8)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model), param_groups(model, split={"*.c_attn.weight": [8, 8, 8]})
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    return model, param_groups(model, split={"*.c_attn.weight": [8, 8, 8]})


def _conv1d_worker(rank, world, out_dir, mode):
    torch.save(_conv1d_run(*_conv1d_net(mode), rank=rank, world=world, mode=mode),
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_transposed_conv1d_weights_with_splits_match_one_process(mode, tmp_path):
    """Weights stored (in, out) (transformers' Conv1D), one split in three column blocks: FSDP2
    shards their *input* dimension, so every matrix block is spread over both ranks. Under DDP
    every bucket is orthogonalised one slot at a time (`STEP_CHUNK_BYTES` below one matrix), on
    the ranks and in the one-process reference: chunks over several ranks, the same update."""
    _launch(_conv1d_worker, str(tmp_path), mode)
    ref = _conv1d_run(*_conv1d_net("local"), process_group="local", mode=mode)
    for r in range(WORLD):
        assert _max_diff(torch.load(tmp_path / f"rank{r}.pt"), ref) <= TOL


def _nonfinite_run(net, groups, policy, rank=0, world=1, bad_rank=None, **kw):
    """4 steps; at step 1 rank ``bad_rank`` (None: the single process) gets a NaN in its local
    gradient of one Muon matrix. Returns the parameters after each step and the skip count."""
    opt = Muon(groups, on_nonfinite=policy, **{**OPT, **kw})
    target = groups[0]["params"][0]
    snaps = []
    for s in range(4):
        x, y = _batch(s)
        n = x.shape[0] // world
        net(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])[1].backward()
        if s == 1 and (bad_rank is None or rank == bad_rank):
            local_rows(target.grad)[0].view(-1)[0] = float("nan")
        opt.step()
        opt.zero_grad(set_to_none=True)
        snaps.append(_params(net))
    return {"snaps": snaps, "skipped": int(opt.steps_skipped)}


def _nonfinite_worker(rank, world, out_dir, policy):
    net, groups = _net("fsdp")
    torch.save(_nonfinite_run(net, groups, policy, rank=rank, world=world, bad_rank=1),
               os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.mark.parametrize("policy", ["skip", "mask"])
def test_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(policy, tmp_path):
    """FSDP2: a NaN in rank 1's shard only. Every rank skips that step for every parameter (the
    flag is reduced over the group) and the run goes on as the single process skipping it does.

    Nothing moves, exactly, on any machine: a skipped step writes nothing, and a masked one
    multiplies by exactly 1 and adds exactly 0 (IEEE)."""
    _launch(_nonfinite_worker, str(tmp_path), policy)
    model = _model()
    ref = _nonfinite_run(model, param_groups(model), policy, process_group="local")
    assert ref["skipped"] == 1
    assert _max_diff(ref["snaps"][1], ref["snaps"][0]) == 0.0  # the single process skipped step 1
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert got["skipped"] == 1
        assert _max_diff(got["snaps"][1], got["snaps"][0]) == 0.0  # nothing moved on any rank
        for a, b in zip(got["snaps"], ref["snaps"]):
            assert _max_diff(a, b) <= TOL


# ------------------------------------------------------------------------------------------
# MuonClip under FSDP2 clips the same heads with the same factors
# ------------------------------------------------------------------------------------------

TAU = 0.7


def _clip_model():
    model = _model()
    with torch.no_grad():
        for attn in model.attention_modules():  # large q/k so that some heads pass tau
            attn.q_proj.weight.mul_(torch.tensor([4.0] * 8 + [8.0] * 8 + [1.0] * 8)[:, None])
            attn.k_proj.weight.mul_(4.0)
    return model


def _clip_run(model, opt, rank=0, world=1):
    log = []

    def record(step):
        log.append({n: (opt.last_max_logits[n].clone(), opt.last_clipped[n].clone()) for n in opt.last_max_logits})

    _train(model, opt, 4, rank=rank, world=world, after_step=record)
    return log


def _clip_worker(rank, world, out_dir):
    net = _fsdp(_clip_model())
    opt = MuonClip(net, tau=TAU, **OPT)
    log = _clip_run(net, opt, rank, world)
    torch.save({"log": log, "params": _params(net)}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_muonclip_fsdp2_clips_the_same_heads_with_the_same_factors(tmp_path):
    _launch(_clip_worker, str(tmp_path))
    model = _clip_model()
    opt = MuonClip(model, tau=TAU, process_group="local", **OPT)
    ref = _clip_run(model, opt)
    n_clipped = sum(int(c.sum()) for step in ref for _, c in step.values())
    assert 0 < n_clipped < sum(c.numel() for step in ref for _, c in step.values())  # the test can tell
    # every head's max is at least 1e-3 tau from tau, so maxima that agree to 1e-5 (the gamma
    # check below; 2 ranks reduce in another order) clip the same heads on any machine
    assert all(((s - TAU).abs() > 1e-3 * TAU).all() for step in ref for s, _ in step.values())
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        assert len(got["log"]) == len(ref)
        for mine, theirs in zip(got["log"], ref):
            assert mine.keys() == theirs.keys()
            for name, (s, clipped) in mine.items():
                s_ref, clipped_ref = theirs[name]
                assert torch.equal(clipped, clipped_ref), name
                gamma, gamma_ref = (TAU / s).clamp(max=1), (TAU / s_ref).clamp(max=1)
                torch.testing.assert_close(gamma, gamma_ref, rtol=1e-5, atol=0)
        assert _max_diff(got["params"], _params(model)) <= TOL


def _gpt2(shard: bool):
    """Tiny HF GPT-2: fused c_attn stored (in, out) = (24, 72); its bias (72,) split 36/36 by FSDP2,
    so k head 1 (bias entries 32..40) straddles the two ranks."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=CFG["vocab_size"], n_embd=24, n_layer=2, n_head=3, n_positions=16,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2)
    model = transformers.GPT2LMHeadModel(cfg)
    with torch.no_grad():
        for block in model.transformer.h:  # large q/k columns so that some heads pass tau
            block.attn.c_attn.weight[:, :48].mul_(torch.tensor([4.0] * 8 + [12.0] * 8 + [1.0] * 8 + [6.0] * 24))
            block.attn.c_attn.bias[:48].normal_(0.0, 0.5)
    return _shard_hf(model, model.transformer.h) if shard else model


def _shard_hf(model, blocks):
    from torch.distributed.fsdp import fully_shard

    for block in blocks:
        fully_shard(block)
    fully_shard(model)
    return model


def _hf_step(net, opt, s, rank=0, world=1):
    """One optimizer step of a Hugging Face causal LM on this rank's share of global batch ``s``."""
    x, y = _batch(s)
    n = x.shape[0] // world
    logits = net(input_ids=x[rank * n:(rank + 1) * n]).logits
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), y[rank * n:(rank + 1) * n].flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _gpt2_run(net, opt, rank=0, world=1, maxima=None):
    log = []
    for s in range(4):
        _hf_step(net, opt, s, rank, world)
        log.append({k: v.clone() for k, v in opt.last_clipped.items()})
        if maxima is not None:
            maxima.append({k: v.clone() for k, v in opt.last_max_logits.items()})
    return log


def _gpt2_clip_worker(rank, world, out_dir):
    net = _gpt2(shard=True)
    opt = MuonClip(net, tau=TAU_GPT2, groups=param_groups(net, adamw_lr=0.0), **OPT)
    log = _gpt2_run(net, opt, rank, world)
    torch.save({"log": log, "params": _params(net)}, os.path.join(out_dir, f"rank{rank}.pt"))


TAU_GPT2 = 1.2  # every recorded max stays >= 7e-2 tau from tau (measured), clipping 5 heads in 4 steps


def test_muonclip_fsdp2_fused_transposed_qkv_of_hf_gpt2(tmp_path):
    """QK-Clip on column ranges of a sharded (in, out) weight and on a bias whose head straddles
    the ranks: the same heads clipped and the same parameters as one process.

    The clipped flags are compared exactly: the reference's maxima all lie at least 1e-3 tau from
    tau (asserted), far more than the round-off between 1 and 2 ranks."""
    pytest.importorskip("transformers")
    _launch(_gpt2_clip_worker, str(tmp_path))
    # AdamW at lr 0: the k bias has an exactly-zero true gradient (q . b_k is the same for every
    # key), so AdamW would step on the sign of round-off, which differs between 1 and 2 ranks;
    # biases then change only through the clip, which is what this test is about
    model = _gpt2(shard=False)
    opt = MuonClip(model, tau=TAU_GPT2, groups=param_groups(model, adamw_lr=0.0), process_group="local", **OPT)
    maxima = []
    ref = _gpt2_run(model, opt, maxima=maxima)
    n_clipped = sum(int(c.sum()) for step in ref for c in step.values())
    assert 0 < n_clipped < sum(c.numel() for step in ref for c in step.values())  # the test can tell
    # every head's max is at least 1e-3 tau from tau, so the 2-rank run, whose weights agree to
    # TOL, clips the same heads on any machine (the flags are compared exactly below)
    assert all(((s - TAU_GPT2).abs() > 1e-3 * TAU_GPT2).all() for step in maxima for s in step.values())
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for mine, theirs in zip(got["log"], ref):
            assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
        assert _max_diff(got["params"], _params(model)) <= TOL


def _neox(shard: bool):
    """Tiny HF GPT-NeoX, rotary on half of each head: query_key_value (72, 24) holds [q k v] per
    head of 8 rows, and FSDP2 splits its rows (and its bias) 36/36, so head 1's k rows 32..40
    straddle the two ranks."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPTNeoXConfig(vocab_size=CFG["vocab_size"], hidden_size=24, intermediate_size=48,
                                     num_hidden_layers=2, num_attention_heads=3, rotary_pct=0.5,
                                     max_position_embeddings=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = transformers.GPTNeoXForCausalLM(cfg).train()
    with torch.no_grad():
        for layer in model.gpt_neox.layers:  # q and k rows of head h times 6, 20, 1: some heads pass tau
            f = layer.attention.query_key_value
            f.weight.view(3, 3, 8, 24)[:, :2].mul_(torch.tensor([6.0, 20.0, 1.0]).view(3, 1, 1, 1))
            f.bias.normal_(0.0, 0.5)
    return _shard_hf(model, model.gpt_neox.layers) if shard else model


def _neox_run(net, opt, rank=0, world=1):
    """Step 0 at lr 0 (only the clip changes weights; the full weights after it are returned), then
    3 steps at OPT's lr. Logs (max logits, clipped) of every step."""
    lrs = [g["lr"] for g in opt.param_groups]
    log, after0 = [], None
    for s in range(4):
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = 0.0 if s == 0 else lr
        _hf_step(net, opt, s, rank, world)
        log.append({k: (opt.last_max_logits[k].clone(), c.clone()) for k, c in opt.last_clipped.items()})
        if s == 0:
            after0 = _params(net)
    return log, after0


TAU_NEOX = 1.0


def _neox_clip_worker(rank, world, out_dir):
    net = _neox(shard=True)
    opt = MuonClip(net, tau=TAU_NEOX, groups=param_groups(net, adamw_lr=0.0), **OPT)
    log, after0 = _neox_run(net, opt, rank, world)
    torch.save({"log": log, "after0": after0, "params": _params(net)}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_muonclip_fsdp2_gpt_neox_per_head_interleaved_qkv(tmp_path):
    """QK-Clip on StridedRows of a row-sharded weight and bias whose heads straddle the ranks: at lr 0
    every clipped head's max logit (independent probe) lands on tau and every other element (other
    heads, V rows, other weights) is bit-identical; then the same heads, factors and parameters as
    one process."""
    pytest.importorskip("transformers")
    from hf_probe import assert_only_clipped_rows_changed, replay_max, save_attention_inputs

    from muonclip.integrations.hf import attach

    _launch(_neox_clip_worker, str(tmp_path))
    model = _neox(shard=False)
    w0 = _params(model)
    x, _ = _batch(0)
    saved, hooks = save_attention_inputs(model)  # each attention's inputs under the initial weights
    with torch.no_grad():
        model(input_ids=x, use_cache=False)
    for h in hooks:
        h.remove()
    opt = MuonClip(model, tau=TAU_NEOX, groups=param_groups(model, adamw_lr=0.0), process_group="local", **OPT)
    s0 = replay_max(model, saved)  # the probe's max logits under the initial weights
    ref, ref_after0 = _neox_run(model, opt)
    for k, (s, _) in ref[0].items():
        torch.testing.assert_close(s, s0[k], rtol=1e-5, atol=1e-6)
    n_clipped = sum(int(c.sum()) for step in ref for _, c in step.values())
    assert 0 < n_clipped < sum(c.numel() for step in ref for _, c in step.values())  # the test can tell
    assert any(c[1] for _, c in ref[0].values())  # head 1 (whose k rows straddle the ranks) is clipped at lr 0

    probe = _neox(shard=False)
    layers = attach(probe)
    for r in range(WORLD):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for mine, theirs in zip(got["log"], ref):
            assert mine.keys() == theirs.keys()
            for k in mine:
                assert torch.equal(mine[k][1], theirs[k][1]), k
                torch.testing.assert_close(mine[k][0], theirs[k][0], rtol=1e-5, atol=1e-6)
        with torch.no_grad():  # the weights after the lr-0 step, unsharded
            for n, p in probe.named_parameters():
                p.copy_(got["after0"][n])
        clipped0 = {k: c for k, (_, c) in got["log"][0].items()}
        assert_only_clipped_rows_changed(probe, layers, clipped0, w0)
        after = replay_max(probe, saved)
        for k, s in s0.items():
            torch.testing.assert_close(after[k], torch.clamp(s, max=TAU_NEOX), rtol=1e-5, atol=1e-6)
        assert _max_diff(got["after0"], ref_after0) <= TOL
        assert _max_diff(got["params"], _params(model)) <= TOL


# ------------------------------------------------------------------------------------------
# checkpoints: 2 ranks -> 1 process and 1 process -> 2 ranks
# ------------------------------------------------------------------------------------------


VARIANTS = {"plain": {}, "variants": dict(normuon=True, cautious_weight_decay=True, momentum_8bit=True)}
"""Optimizer options of the checkpoint tests: plain Muon, and NorMuon + cautious weight decay + 8-bit
momentum, whose state adds per-row second moments (a plain tensor on every rank) and int8 codes with
float32 block scales (DTensors with their weight's row shards)."""


def _continued_within(got: dict, ref: dict, options: dict, start: dict) -> None:
    """The continued runs agree: to TOL, or, with 8-bit momentum, within the bound its test states
    (tests/test_muon_variants.py: 2% of the distance the weights moved), since a rank's reduction order
    can move a momentum value across a rounding boundary of its int8 code (one code step, 1/127 of the
    block's largest value), which no tolerance on the float weights can absorb."""
    if not options.get("momentum_8bit"):
        assert _max_diff(got, ref) <= TOL
        return
    moved = _max_diff(ref, start)
    assert moved > 0 and _max_diff(got, ref) <= 0.02 * moved


def _ckpt_save_worker(rank, world, out_dir, options):
    net = _fsdp(_model())
    opt = Muon(param_groups(net), **OPT, **options)
    _train(net, opt, 3, rank=rank, world=world)
    checkpoint.save(os.path.join(out_dir, "ckpt2"), net, opt, extra={"step": 3})
    saved = {"params": _params(net), "state": _opt_state(opt), "steps_taken": opt.steps_taken}
    _train(net, opt, 3, start=3, rank=rank, world=world)
    final = _params(net)  # full_tensor() is a collective: every rank calls it
    if rank == 0:
        torch.save({"saved": saved, "final": final}, os.path.join(out_dir, "from2.pt"))


def _ckpt_load_worker(rank, world, out_dir, options):
    net = _fsdp(_model(seed=123))  # different init: everything must come from the checkpoint
    opt = Muon(param_groups(net), **OPT, **options)
    extra = checkpoint.load(os.path.join(out_dir, "ckpt1"), net, opt)
    loaded = {"params": _params(net), "state": _opt_state(opt), "steps_taken": opt.steps_taken, "extra": extra}
    _train(net, opt, 3, start=3, rank=rank, world=world)
    final = _params(net)
    if rank == 0:
        torch.save({"loaded": loaded, "final": final}, os.path.join(out_dir, "on2.pt"))


def _assert_same_state(a, b):
    assert a["steps_taken"] == b["steps_taken"]
    assert _max_diff(a["params"], b["params"]) == 0.0
    assert a["state"].keys() == b["state"].keys()
    for name in a["state"]:
        sa, sb = a["state"][name], b["state"][name]
        assert sa.keys() == sb.keys(), name
        for k in sa:
            if torch.is_tensor(sa[k]):
                assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), (name, k)
            else:
                assert sa[k] == sb[k], (name, k)


@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_checkpoint_saved_on_2_ranks_loads_on_1_and_continues(tmp_path, options):
    """The loaded state equals the saved one exactly (copies of bytes); the continued run agrees
    (`_continued_within`)."""
    _launch(_ckpt_save_worker, str(tmp_path), options)
    got = torch.load(tmp_path / "from2.pt")
    model = _model(seed=123)
    opt = Muon(param_groups(model), process_group="local", **OPT, **options)
    extra = checkpoint.load(tmp_path / "ckpt2", model, opt)
    assert extra == {"step": 3}
    loaded = _opt_state(opt)
    _assert_same_state({"params": _params(model), "state": loaded, "steps_taken": opt.steps_taken}, got["saved"])
    for key in ("neuron_second_moment", "momentum_int8", "momentum_scale"):  # the test can tell
        assert any(key in s for s in loaded.values()) == bool(options), key
    _train(model, opt, 3, start=3)
    _continued_within(_params(model), got["final"], options, got["saved"]["params"])


@pytest.mark.parametrize("options", VARIANTS.values(), ids=VARIANTS.keys())
def test_checkpoint_saved_on_1_process_loads_on_2_ranks_and_continues(tmp_path, options):
    """The loaded state equals the saved one exactly (copies of bytes); the continued run agrees
    (`_continued_within`)."""
    model = _model()
    opt = Muon(param_groups(model), process_group="local", **OPT, **options)
    _train(model, opt, 3)
    checkpoint.save(tmp_path / "ckpt1", model, opt, extra={"step": 3})
    saved = {"params": _params(model), "state": _opt_state(opt), "steps_taken": opt.steps_taken}
    _train(model, opt, 3, start=3)
    _launch(_ckpt_load_worker, str(tmp_path), options)
    got = torch.load(tmp_path / "on2.pt")
    assert got["loaded"]["extra"] == {"step": 3}
    _assert_same_state(got["loaded"], saved)
    _continued_within(got["final"], _params(model), options, saved["params"])


# ------------------------------------------------------------------------------------------
# bad input: clear errors on every rank, never a hang
# ------------------------------------------------------------------------------------------


def _expect(exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


def _errors_worker(rank, world, out_dir):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    # a gradient on rank 0 only: both ranks raise, nobody waits in a collective (a and b: replicas)
    a, b = (torch.nn.Parameter(torch.randn(6, 4, generator=torch.Generator().manual_seed(i))) for i in (0, 1))
    opt = Muon([a, b], lr=0.1)
    a.grad = torch.ones_like(a)
    if rank == 0:
        b.grad = torch.ones_like(b)
    _expect(ValueError, "some ranks but not on others", opt.step)
    # a rank with no Muon gradient at all still enters the same collectives
    a.grad = torch.ones_like(a) if rank == 1 else None
    b.grad = None
    _expect(ValueError, "some ranks but not on others", opt.step)
    # parameters that differ across ranks (shapes)
    c = torch.nn.Parameter(torch.randn(6, 4 + rank))
    c.grad = torch.ones_like(c)
    _expect(ValueError, "differ across ranks", Muon([c], lr=0.1).step)
    # a plain tensor that holds different values on each rank (a shard passed as a local tensor) is refused
    shard = torch.nn.Parameter(torch.full((6, 4), float(rank)))
    shard.grad = torch.ones_like(shard)
    _expect(ValueError, "plain tensor with different values on different ranks", Muon([shard], lr=0.1).step)
    # ... by every optimizer, every step: a refused plan is never kept for a later step
    _expect(ValueError, "plain tensor with different values on different ranks", Muon([shard], lr=0.1).step)
    # parameters present on every rank without a gradient anywhere are skipped, consistently
    a.grad, b.grad = torch.ones_like(a), None
    before = b.detach().clone()
    opt.step()
    assert torch.equal(b.detach(), before)
    # the lr walk of a step over the two ranks (benchmarks/step_trace.py), kept for the test
    from step_trace_loader import step_trace

    walked = step_trace.optimizer("core", experts=False)
    walked.step()
    walk = step_trace.trace_walk(walked)
    with open(os.path.join(out_dir, f"walk{rank}.json"), "w") as f:
        json.dump(walk, f)
    # a clip without effect is reported from the all-reduced maxima: every rank raises at the same clip,
    # although on rank 1 alone the maxima came down
    from muonclip.attention import MaxLogitRecorder
    from muonclip.qkclip import AttentionLayer, MHALayout, QKClipIneffectiveError

    rec = MaxLogitRecorder(2)
    holder = torch.nn.Module()  # the clip writes only weights its optimizer trains
    holder.q, holder.k = torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(8, 4))
    layer = AttentionLayer("attn", MHALayout(holder.q, holder.k, 2, 4), rec)
    clip_opt = MuonClip(holder, tau=1.0, layers=[layer], on_ineffective_clip="raise")
    for step in range(3):
        rec.update(torch.tensor([4.0, 0.5]) if rank == 0 or step == 0 else torch.tensor([0.5, 0.5]))
        if step < 2:
            clip_opt.clip()
        else:
            _expect(QKClipIneffectiveError, "attention layer 'attn': head 0", clip_opt.clip)
    dist.barrier()
    # mixed meshes
    mesh_a, mesh_b = DeviceMesh("cpu", [0, 1]), DeviceMesh("cpu", [1, 0])
    d1 = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh_a, [Shard(0)]))
    d2 = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh_b, [Shard(0)]))
    for d in (d1, d2):
        d.grad = torch.ones_like(d)
    _expect(ValueError, "mixed meshes", Muon([d1, d2], lr=0.1).step)
    # a placement whose values are not there (a pending reduction) is refused
    from torch.distributed.tensor import DTensor, Partial

    d3 = torch.nn.Parameter(DTensor.from_local(torch.randn(6, 4), mesh_a, [Partial()]))
    d3.grad = torch.ones_like(d3)
    _expect(ValueError, "Partial placement", Muon([d3], lr=0.1).step)
    # a local shard that is not what its placements say (rank 0 claims 4 of 6 rows): refused before any data moves
    d4 = torch.nn.Parameter(DTensor.from_local(torch.randn(4 - 2 * rank, 4), mesh_a, [Shard(0)], run_check=False,
                                               shape=torch.Size([6, 4]), stride=(4, 1)))
    d4.grad = torch.ones_like(d4)
    _expect(ValueError, "differ from what the DTensor says", Muon([d4], lr=0.1).step)
    # a DTensor parameter after the process group is gone
    opt = Muon([d1], lr=0.1)
    dist.barrier()  # no rank tears the group down while the other is still in distribute_tensor's scatter
    dist.destroy_process_group()
    _expect(RuntimeError, "not initialised", opt.step)
    with open(os.path.join(out_dir, f"ok{rank}"), "w") as f:
        json.dump(True, f)


def test_bad_input_gives_the_same_clear_error_on_every_rank(tmp_path):
    """And the lr walk of a two-rank step (`benchmarks/step_trace.py`: 18 weights in a Muon group,
    one AdamW group): the lr is read once per group and passed down to the apply, never returned
    per weight (21 returns when the distributed engine read each weight's lr from its group)."""
    _launch(_errors_worker, str(tmp_path))
    assert all((tmp_path / f"ok{r}").exists() for r in range(WORLD))
    for r in range(WORLD):
        walk = json.loads((tmp_path / f"walk{r}.json").read_text())
        assert walk["stays"] and "apply_update_" in walk["stays"]  # the walk reaches the apply
        assert len(walk["returns"]) <= 10, walk["returns"]


# ------------------------------------------------------------------------------------------
# single-process pieces
# ------------------------------------------------------------------------------------------


def test_plan_is_balanced_deterministic_and_total():
    costs = [ns_flops([(1, a, b)], 5) for a, b in [(64, 64)] * 6 + [(256, 64)] * 4 + [(8, 8)]]
    for world in (1, 2, 3, 4):
        plan = assign_owners(costs, world)
        assert plan == assign_owners(list(costs), world)
        assert sorted(plan.owners) == sorted(plan.owners) and len(plan.owners) == len(costs)
        assert sum(plan.flops) == sum(costs)
        assert max(plan.flops) <= sum(costs) / world + max(costs)  # LPT bound
    assert ns_flops([(3, 16, 32)], 5) == 3 * 5 * (4 * 16 * 16 * 32 + 2 * 16**3)


@pytest.mark.parametrize(("shape", "opts"), [
    ((6, 4), {}), ((6, 4), {"split_sizes": [2, 4]}), ((4, 6), {"transposed": True}),
    ((6, 4), {"transposed": True, "split_sizes": [1, 3]}), ((3, 6, 4), {}), ((3, 6, 4), {"split_sizes": [5, 1]}),
    ((5, 2, 3, 3), {}), ((5, 2, 3), {"flatten": True}), ((8, 2, 3), {"flatten": True, "split_sizes": [3, 5]}),
    ((12, 4), {"split_sizes": [1, 2, 1], "split_groups": 3}),  # interleaved per group: [a b b c | a b b c | ...]
    ((3, 4, 6), {"transposed": True, "split_sizes": [1, 1], "split_groups": 3}),  # gpt-oss experts (E, in, out)
])
def test_matrix_spec_states_the_shapes_of_its_blocks(shape, opts):
    """The step buckets by a weight's `MatrixSpec` (no tensor made); its rows must describe
    exactly the blocks it cuts from a tensor (their shapes, and their rows along ``axis``, in
    group order)."""
    group = {"flatten": False, "split_sizes": None, "split_groups": 1, "transposed": False,
             "adjust_lr_fn": "original", "method": "ns5", "ns_steps": None, **opts}
    spec = matrix_spec(shape, group)
    t = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    blocks = spec.blocks_of(t)
    assert [tuple(b.shape) for b in blocks] == [(spec.batch, sum(r1 - r0 for r0, r1 in segs), spec.cols)
                                                for segs in spec.blocks]
    whole_spec = matrix_spec(shape, {**group, "split_sizes": None, "split_groups": 1})
    whole = whole_spec.blocks_of(t)[0]
    for b, segs in zip(blocks, spec.blocks):
        assert torch.equal(b, torch.cat([whole[:, r0:r1] for r0, r1 in segs], dim=1))
        stored = torch.cat([t.narrow(spec.axis, r0, r1 - r0) for r0, r1 in segs], dim=spec.axis)  # the rows, stored
        assert torch.equal(matrix_spec(stored.shape, {**group, "split_sizes": None, "split_groups": 1})
                           .blocks_of(stored)[0], b)


@pytest.mark.parametrize("rows, world", [(24, 2), (7, 2), (5, 4), (3, 4)])
def test_shard_rows_match_torch_chunk(rows, world):
    chunks = torch.arange(rows).chunk(world)
    for r in range(world):
        offset, n = shard_rows(rows, world, r)
        expect = chunks[r] if r < len(chunks) else torch.empty(0)
        assert n == expect.numel() and (n == 0 or offset == int(expect[0]))


def test_local_rows_of_a_plain_tensor_is_the_tensor():
    w = torch.nn.Parameter(torch.randn(4, 3))
    t, offset = local_rows(w)
    assert offset == 0 and t.data_ptr() == w.data_ptr()


def test_one_process_without_a_group_needs_no_distributed_setup():
    assert not dist.is_initialized()
    model, opt = _reference(steps=2)
    assert opt.last_step_stats.world_size == 1 and opt.last_step_stats.comm.bytes_sent == 0
    assert opt.last_step_stats.matrices == len(_muon_matrices(model))
    assert muonclip.Muon is Muon
