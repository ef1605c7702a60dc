"""``muonclip plan``: exact where it says exact.

On CPU meshes of 4 gloo processes (ONE launch for every case, `plan_worker`: DDP, FSDP2 with uneven
shards, FSDP2 x TP, HSDP, expert parallel, 2 pipeline stages x FSDP2 or x DDP), the plan of
`muonclip.app.plan_cost` equals, per rank and per step, what a real step counts: every rank's piece
of every Muon weight, the Newton–Schulz flops,
the bytes of the gather and of the scatter (sent and received), of the agreement all-reduces and of
MuonClip's max-logit reduction, and the optimizer state Muon, MuonClip and torch's AdamW allocate.
ZeRO-1 the same on a DeepSpeed run (`plan_worker.zero1_worker`, a second launch of 2 ranks through
`deepspeed_harness`): DeepSpeed's partition of every Muon weight, the flops, the bytes and the state,
padding included. The time model is checked by `benchmarks/bench_plan_time.py` (a benchmark, never a
timed test).
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from plan_worker import DENSE, MOE, PP, STEPS, WORLD, ZERO1, ZERO1_WORLD, flat_range, plain, worker, zero1_worker
from test_distributed import _launch

from muonclip.app.plan_cost import plan_costs
from muonclip.app.plan_layout import Mesh, MeshError, stage_of, stage_of_layers, stage_pieces
from muonclip.app.plan_model import load_model, route
from muonclip.distributed import Plan
from muonclip.models import GPT, GPTConfig
from muonclip.ortho._newton_schulz import ns_flops

MESHES = {"ddp": Mesh(dp_replicate=4), "fsdp": Mesh(dp_shard=4), "fsdp_tp": Mesh(dp_shard=2, tp=2),
          "hsdp": Mesh(dp_replicate=2, dp_shard=2), "ep": Mesh(dp_shard=4, ep=2),
          "pp": Mesh(pp=2, dp_shard=2), "pp_ddp": Mesh(pp=2, dp_replicate=2)}
CONFIGS = {"ep": MOE, "pp": PP, "pp_ddp": PP}


@pytest.fixture(scope="module")
def counted(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    _launch(worker, str(out), world=WORLD, limit_s=400)
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def _planned(case):
    with torch.device("meta"):
        model = GPT(GPTConfig(**CONFIGS.get(case, DENSE)))
    pm = route(model)
    return pm, plan_costs(pm, MESHES[case], device="cpu")


@pytest.mark.parametrize("case", list(MESHES))
def test_planned_flops_bytes_and_state_equal_a_real_step(counted, case):
    pm, plan = _planned(case)
    mesh = MESHES[case]
    stages = stage_of_layers(pm.n_layers, mesh.pp)
    pieces = [plain(stage_pieces([w for w in pm.weights if w.muon and stage_of(w, stages, mesh.pp) == s], mesh)[1])
              for s in range(mesh.pp)]  # each stage's Muon weights over its own ranks
    rows = []
    for r, got in enumerate(counted):
        got = got[case]
        assert "error" not in got, got.get("error")
        assert got["pieces"] == pieces[r // mesh.stage_size]  # what every rank holds, as the step sees it
        for name in ("muon", "muonclip"):
            if name not in got:
                continue
            for s, step in enumerate(got[name]["steps"]):
                reduce = plan.checks[r] + (plan.first_checks[r] if s == 0 else 0) + \
                    (plan.clip[r] if name == "muonclip" else 0)
                copies = plan.first_copies[r] if s == 0 else 0  # the copies check: one all-gather, first step
                want = {"flops": plan.ns_flops[r], "gather_sent": plan.gather_sent[r],
                        "gather_recv": plan.gather_recv[r], "scatter_sent": plan.scatter_sent[r],
                        "scatter_recv": plan.scatter_recv[r], "reduce": reduce,
                        "other": ["all_gather"] if copies else [], "gathered": copies}
                assert step == want, (name, r, s)
            assert got[name]["state"] == plan.muon_state[r], (name, r)
        assert got["adamw"]["state"] == plan.adamw_state[r]
        assert all(step["other"] == [] and step["reduce"] == 0 and step["flops"] == 0 and step["gathered"] == 0
                   for step in got["adamw"]["steps"])  # torch's AdamW: no collective, no Newton-Schulz
        rows.append((r, plan.ns_flops[r], plan.gather_sent[r] + plan.scatter_sent[r], plan.clip[r],
                     plan.muon_state[r], plan.adamw_state[r]))
    print(f"{case} ({MESHES[case].describe()}): planned = counted on every rank, {STEPS} steps; "
          "(rank, NS flops, bytes sent by all-to-alls, clip bytes, Muon state, AdamW state):", rows)
    if case != "ddp":  # the comparison can tell: the work is shared, not replicated
        assert max(plan.ns_flops) < sum(plan.ns_flops)


@pytest.fixture(scope="module")
def zero1_counted(tmp_path_factory):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed (pip install 'muonclip[deepspeed]')")
    import deepspeed_harness

    out = tmp_path_factory.mktemp("zero1")
    deepspeed_harness.launch(zero1_worker, str(out), world=ZERO1_WORLD, limit_s=300)
    return [torch.load(out / f"zero1-rank{r}.pt") for r in range(ZERO1_WORLD)]


def test_zero1_planned_equals_a_deepspeed_zero1_run(zero1_counted):
    """``--zero1`` is DeepSpeed's ZeRO-1: every rank's range of every Muon weight is DeepSpeed's (its
    buffers padded to a multiple of twice the ranks), and the flops, the bytes gathered and scattered,
    the all-reduces (DeepSpeed's one finite check a step, the clip's) and the state (every partition
    whole, padding included; torch's AdamW on one buffer) are those of a DeepSpeed step, every rank."""
    with torch.device("meta"):
        pm = route(GPT(GPTConfig(**ZERO1)))
    mesh = Mesh(dp_replicate=ZERO1_WORLD, zero1=True)
    plan = plan_costs(pm, mesh, device="cpu")
    muon = [w for w in pm.weights if w.muon]
    pieces = [[flat_range(pc, w.shape) for pc in ranks] for w, ranks in zip(muon, stage_pieces(muon, mesh)[1])]
    rows = []
    for r, got in enumerate(zero1_counted):
        assert got["pieces"] == pieces  # DeepSpeed's partition, as its driver hands it to the step
        for name in ("muon", "muonclip"):
            want = {"flops": plan.ns_flops[r], "gather_sent": plan.gather_sent[r], "gather_recv": plan.gather_recv[r],
                    "scatter_sent": plan.scatter_sent[r], "scatter_recv": plan.scatter_recv[r],
                    "reduce": plan.checks[r] + (plan.clip[r] if name == "muonclip" else 0), "other": [],
                    "gathered": 0}
            assert plan.first_checks[r] == plan.first_copies[r] == 0
            assert got[name]["steps"] == [want] * STEPS, (name, r)
            assert got[name]["state"] == plan.muon_state[r], (name, r)
        assert got["adamw"]["state"] == plan.adamw_state[r]
        rows.append((r, plan.ns_flops[r], plan.gather_sent[r], plan.scatter_sent[r], plan.checks[r], plan.clip[r],
                     plan.muon_state[r], plan.adamw_state[r]))
    print(f"zero1 ({mesh.describe()}, DeepSpeed): planned = counted on every rank, {STEPS} steps; (rank, NS flops, "
          "gathered sent, scattered sent, checks, clip, Muon state, AdamW state):", rows)


def test_the_plan_is_the_steps_own_balance_and_every_matrix_once():
    """The owner plan's flops over all ranks are every matrix's once (an independent count from
    the shapes), and no rank gets more than the longest-first bound (the mean plus one matrix)."""
    for case in MESHES:
        pm, plan = _planned(case)
        total = sum(ns_flops([(w.shape[0] if w.expert else 1, *w.spec.matrix(torch.empty(w.shape, device="meta")
                                                                           ).shape[-2:])], 5)
                    for w in pm.weights if w.muon)
        assert sum(plan.ns_flops) == total and sum(plan.rr_flops) == total, case  # round robin: the same work
        assert sum(plan.rep_flops) >= total  # without owners: at least every matrix once
        biggest = max(w.spec.flops for w in pm.weights if w.muon)
        assert max(plan.ns_flops) <= sum(plan.ns_flops) / len(plan.ns_flops) + biggest


def test_the_plan_per_distinct_piece_is_the_plan_per_rank():
    """What the planner computes once per distinct piece (`stage_holdings`, `plan_held`) is what the step
    computes from every rank's piece (`stage_pieces`, `plan_step`): the same pieces, the same plan (owners,
    flops, every transfer, each rank's own sources), on meshes with strided shards, uneven ZeRO-1 ranges and
    expert pieces; and the owners' heap picks the rank a scan of every rank picks."""
    import random

    from muonclip.app.plan_cost import _plan_specs
    from muonclip.app.plan_layout import stage_holdings
    from muonclip.common._dtensor import is_empty
    from muonclip.distributed._plan import assign_owners, holdings, plan_held, plan_step

    for cfg, mesh in ((DENSE, Mesh(dp_replicate=2, dp_shard=3, tp=2)), (DENSE, Mesh(dp_replicate=3, zero1=True)),
                      (ZERO1, Mesh(dp_replicate=5, zero1=True)), (MOE, Mesh(dp_replicate=2, dp_shard=4, ep=2)),
                      (MOE, Mesh(dp_replicate=4, ep=2, zero1=True))):
        with torch.device("meta"):
            pm = route(GPT(GPTConfig(**cfg)))
        shapes, pieces = stage_pieces(pm.weights, mesh)
        assert stage_holdings(pm.weights, mesh)[0] == shapes
        held = stage_holdings(pm.weights, mesh)[1]
        for k, ranks in enumerate(pieces):
            assert ({pc: h for pc, h in holdings(ranks).items() if not is_empty(pc)} ==
                    {pc: list(h) for pc, h in held[k].items() if not is_empty(pc)}), (mesh, pm.weights[k].name)
        muon = [w for w in pm.weights if w.muon]
        n, specs = len(muon), _plan_specs(muon, shapes[:len(muon)])
        for me in (0, mesh.stage_size - 1):
            per_rank = plan_step([w.group for w in muon], shapes[:n], specs, pieces[:n], mesh.stage_size, me)
            assert plan_held([w.group for w in muon], shapes[:n], specs, held[:n], mesh.stage_size, me) == per_rank

    rng = random.Random(0)
    for world in (1, 3, 8):
        costs = [rng.choice((0, 1, 5, 5, 9, 40)) for _ in range(60)]
        allowed = [rng.sample(range(world), rng.randint(1, world)) if rng.random() < 0.3 else None for _ in costs]
        for allow in (None, allowed):
            load, owners = [0] * world, [0] * len(costs)
            for i in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):  # every rank scanned
                owners[i] = min((allow[i] if allow else None) or range(world), key=lambda q: (load[q], q))
                load[owners[i]] += costs[i]
            assert assign_owners(costs, world, allow) == Plan(tuple(owners), tuple(load))


def test_pipeline_split_is_torchtitans_and_stages_plan_alone():
    """torchtitan's default split (embedding and head as one layer each); a stage's ranks hold only its
    layers, and the stages' flops add up to the whole model's."""
    assert stage_of_layers(61, 16).count(0) == 3 and stage_of_layers(61, 16).count(15) == 2
    assert [stage_of_layers(61, 4).count(s) for s in range(4)] == [15, 16, 16, 14]
    with pytest.raises(MeshError, match="without a layer"):
        stage_of_layers(2, 4)
    with torch.device("meta"):
        pm = route(GPT(GPTConfig(**dict(DENSE, n_layer=4))))
    one = plan_costs(pm, Mesh(dp_shard=2), device="cpu")
    two = plan_costs(pm, Mesh(dp_shard=2, pp=2), device="cpu")
    assert len(two.ns_flops) == 4 and sum(two.ns_flops) == sum(one.ns_flops)
    assert sum(two.muon_state) == sum(one.muon_state)


def test_a_torchtitan_model_is_planned_with_the_optimizer_its_run_builds():
    """``torchtitan:NAME`` is routed by torchtitan's MuonClip container as a run builds it (recording
    attention, `muon_splits`): each of llama3_debugmodel's 6 layers clipped (16 heads), its fused
    ``wqkv`` cut into q, k and v per key/value head (16 groups of 16 + 16 + 16 rows); Qwen3's q/k
    norms refuse the clip, and the plan says why. The attention's sizes come from the model's
    attention modules (torchtitan's configs set heads per layer)."""
    pm = load_model("torchtitan:llama3_debugmodel")
    assert pm.heads == [(layer, 16) for layer in range(6)] and pm.clip_note == ""
    assert pm.attention == (6, 16, 16, 16)  # the attention products' sizes, for the training step's flops
    wqkv = next(w for w in pm.weights if w.name == "layers.0.attention.qkv_linear.wqkv.weight")
    assert wqkv.shape == (768, 256) and (wqkv.group["split_sizes"], wqkv.group["split_groups"]) == ([16, 16, 16], 16)
    mla = load_model("torchtitan:deepseek_v3_debugmodel")  # MLA: q/k heads of nope + rope dims, v its own
    assert mla.attention == (6, 16, 128 + 64, 128) and mla.heads == [(layer, 16) for layer in range(6)]
    qwen = load_model("torchtitan:qwen3_debugmodel")
    assert qwen.heads is None and "q_norm" in qwen.clip_note


def test_zero1_partitions_the_state_flat_and_every_rank_holds_its_share():
    with torch.device("meta"):
        pm = route(GPT(GPTConfig(**DENSE)))
    ddp = plan_costs(pm, Mesh(dp_replicate=4), device="cpu")
    z1 = plan_costs(pm, Mesh(dp_replicate=4, zero1=True), device="cpu")
    assert sum(z1.muon_state) == ddp.muon_state[0]  # the replicas' state, dealt out once
    assert max(z1.muon_state) - min(z1.muon_state) <= 2 * 4 * 4  # equal ranges, but for each group's padding
    assert sum(z1.ns_flops) == sum(ddp.ns_flops)
    assert sum(z1.gather_recv) == sum(z1.gather_sent) > 0


def _k2_matrices():
    """Kimi K2's Muon matrices from its published configuration, counted by hand."""
    h, L, heads, experts = 7168, 61, 64, 384
    attn = [(1536, h), (heads * 192, 1536), (576, h), (heads * 256, 512), (h, heads * 128)]
    dense = [(18432, h), (18432, h), (h, 18432)]
    moe = [(2048, h), (2048, h), (h, 2048)]  # one expert (gate, up, down), and the shared expert
    out = []
    for layer in range(L):
        out += attn
        if layer == 0:
            out += dense
        else:
            out += moe * (experts + 1) + [(experts, h)]  # routed, shared, the router
    return out


def test_kimi_k2_on_nvidias_layout_counts_every_published_matrix(capsys):
    """`muonclip plan kimi-k2` on NVIDIA's 256-GPU layout (PP4 x DP64 x EP64, ZeRO-1): the flops over all
    ranks are those of K2's published matrices counted by hand; each rank orthogonalises its 6 experts of
    every MoE layer of its stage where they live; the state of all ranks is K2's Muon weights' once."""
    from muonclip.app.main import main

    assert main(["plan", "kimi-k2", "--pp", "4", "--dp-replicate", "64", "--ep", "64", "--zero1", "--device",
                 "gb300", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    flops, matrices = plan["ranks"]["ns_flops"], _k2_matrices()
    assert len(flops) == 256 and sum(flops) == sum(ns_flops([(1, a, b)], 5) for a, b in matrices)
    muon = sum(a * b for a, b in matrices)
    adamw = 2 * 163840 * 7168 + 61 * (2 * 7168 + 1536 + 512) + 7168  # embedding, head, norms
    assert plan["model"]["parameters"] == muon + adamw
    assert sum(plan["ranks"]["muon_state"]) == 4 * muon + 8 * adamw  # ZeRO-1 and EP: every element once
    assert 1.0 <= plan["summary"]["ns_flops"]["imbalance"] < 1.2


def test_cli_plan_table_json_plot_and_bad_input(tmp_path, capsys):
    """The table names what is exact and what is modelled; --plot writes the figure; bad input is exit 2
    with the reason, never a traceback."""
    from muonclip.app.main import main

    assert main(["plan", "preset:tiny", "--dp-shard", "2", "--device", "cpu", "--plot", str(tmp_path / "w.png")]) == 0
    out = capsys.readouterr().out
    assert "Newton-Schulz flops, owner plan" in out and "roofline model" in out and "modelled" in out
    assert "measured" in out and (tmp_path / "w.png").stat().st_size > 0
    for args, message in ((["no-such-model"], "is not a model"),
                          (["preset:tiny", "--dp-shard", "2", "--ep", "2"], "no stacked"),
                          (["preset:tiny", "--tp", "2", "--zero1", "--dp-replicate", "2"], "--zero1"),
                          (["preset:tiny", "--dp-shard", "0"], "must be >= 1"),
                          (["preset:tiny", "--ep", "3", "--dp-shard", "2"], "must divide"),
                          (["preset:tiny", "--mfu", "2"], "--mfu"),
                          (["preset:nope"], "no preset"),
                          (["torchtitan:nope"], "no config function"),
                          ([str(tmp_path / "w.png")], "not a readable JSON")):
        assert main(["plan", *args]) == 2, args
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, (args, err)
