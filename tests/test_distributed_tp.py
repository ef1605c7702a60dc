"""Muon / MuonClip on 2-D meshes and general placements: tensor parallel, FSDP2 x TP, HSDP, expert
parallel, uneven shards; DCP checkpoints across layouts. 4 gloo ranks on CPU, ONE launch for all
multi-rank checks (the suite's time budget), each compared with one process.

Parity: max |distributed - one process| relative to the largest movement of any weight
<= 1e-5 with float32 orthogonalisation (other reduction orders of the gradients and of
DTensor's sums; the orthogonalisation of each matrix runs once, whole, so nothing else differs).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from test_distributed import _launch, _max_diff, _params, _spy
from test_distributed import _train as _train_dp

from muonclip import Muon, param_groups
from muonclip.distributed import checkpoint
from muonclip.models import GPT, GPTConfig
from muonclip.optim._matrices import matrix_spec
from muonclip.qkclip import MuonClip

WORLD = 4
OPT = dict(lr=0.02, weight_decay=0.1, orth_dtype=torch.float32)
REL = 1e-5
# AdamW divides each entry by its own gradient RMS, so an entry whose gradient is a near-cancelling sum
# carries the reduction-order rounding of a sharded model into its update unscaled: on CPUs whose float32
# kernels are AVX2 (ATEN_CPU_CAPABILITY=avx2 with MKL and oneDNN held to AVX2), one process at 2 threads
# against 1 moves the embedding by up to 8.7e-6 of the largest movement, and 4 TP ranks by 1.3e-5; Muon's
# matrices stay within REL (as in tests/test_torchtitan.py).
ADAMW_REL = 1e-4
STEPS = 3
TAU = 0.8
GQA = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=32)
MLA = dict(vocab_size=64, block_size=16, n_layer=1, n_head=4, n_embd=32, attention="mla", q_lora_rank=16,
           kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
# Hugging Face Llama, TP over the 4 ranks by its own plan: 8 query heads (2 per rank), 4 key heads (GQA)
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, head_dim=4, max_position_embeddings=32, tie_word_embeddings=False)


def _rel(a: dict, b: dict, start: dict, keys=None) -> float:
    """max |a - b| over ``keys`` (default all) relative to the largest movement of any weight."""
    move = max((b[k].double() - start[k].double()).abs().max().item() for k in b)
    return _max_diff({k: a[k] for k in keys or a}, {k: b[k] for k in keys or b}) / move


def _like_one_process(got: dict, want: dict, start: dict, model, what: str) -> None:
    """Muon's weights within REL of one process, AdamW's (embedding, head, norms) within ADAMW_REL."""
    muon = [n for g in param_groups(model) if g["algorithm"] == "muon" for n in g["param_names"]]
    rel, rel_all = _rel(got, want, start, muon), _rel(got, want, start)
    print(f"{what}: max diff / max movement = {rel:.2g} (Muon weights), {rel_all:.2g} (all)")
    assert muon and rel <= REL and rel_all <= ADAMW_REL


# ------------------------------------------------------------------------------------------
# placements: a bag of weights on a 2x2 mesh and a 1-D mesh of 4, against one process
# ------------------------------------------------------------------------------------------


def _bag_specs():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {  # name: (shape, placements on the (2, 2) mesh)
        "rows_cols_uneven": ((11, 7), (Shard(0), Shard(1))),
        "hsdp_uneven": ((9, 5), (Replicate(), Shard(0))),
        "fsdp_x_colwise": ((12, 6), (_StridedShard(0, split_factor=2), Shard(0))),
        "fsdp_x_rowwise": ((10, 12), (Shard(0), Shard(1))),
        "rowwise_replicated": ((7, 12), (Replicate(), Shard(1))),
        "experts_ep_x_replicas": ((5, 4, 6), (Shard(0), Replicate())),
        "experts_ep_2d": ((4, 4, 6), (Shard(0), Shard(0))),
        "experts_cut_inside": ((3, 4, 6), (Shard(1), Replicate())),
    }


def _bag_grads(shapes, step):
    g = torch.Generator().manual_seed(77 + step)
    return [torch.randn(s, generator=g) for s in shapes]


def _bag_run(tensors, steps, grads_of, **kw):
    opt = Muon(tensors, **{**OPT, **kw})
    for s in range(steps):
        for p, g in zip(tensors, grads_of(s)):
            p.grad = g
        opt.step()
    return opt


def _bag_reference(specs, steps):
    torch.manual_seed(5)
    full = [torch.randn(shape) for shape, _ in specs.values()]
    start = [t.clone() for t in full]
    params = [torch.nn.Parameter(t.clone()) for t in full]
    _bag_run(params, steps, lambda s: _bag_grads([p.shape for p in params], s), process_group="local")
    return start, [p.detach() for p in params]


def _bag_worker_part(rank, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    specs = _bag_specs()
    start, _ = _bag_reference(specs, 0)
    params = [torch.nn.Parameter(distribute_tensor(t.clone(), mesh2, pl)) for t, (_, pl) in zip(start, specs.values())]
    # each rank's local piece is exactly what the layout module says (checked against the values)
    from muonclip.common._dtensor import piece_of, take

    for t, p in zip(start, params):
        piece = piece_of(p.shape, mesh2.shape, mesh2.get_coordinate(), p.placements)
        assert torch.equal(take(t, piece), p._local_tensor), p.placements
    calls, collectives = [], []
    undo = _spy(collectives, calls)
    try:
        opt = _bag_run(params, STEPS, lambda s: [distribute_tensor(g, mesh2, p.placements)
                                                 for g, p in zip(_bag_grads([p.shape for p in params], s), params)])
    finally:
        undo()
    out["bag"] = {"params": [p.full_tensor() for p in params], "calls": calls, "collectives": collectives,
                  "comm": opt.last_step_stats.comm.calls, "matrices": opt.last_step_stats.matrices}
    # expert parallel on a 1-D mesh of 4, uneven (6 experts: 2, 2, 2, 0): no data moves at all
    mesh1 = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(6)
    e_full = torch.randn(6, 4, 5)
    e = torch.nn.Parameter(distribute_tensor(e_full.clone(), mesh1, [Shard(0)]))
    calls, collectives = [], []
    undo = _spy(collectives, calls)
    try:
        opt = _bag_run([e], STEPS, lambda s: [distribute_tensor(_bag_grads([(6, 4, 5)], s)[0], mesh1, [Shard(0)])])
    finally:
        undo()
    out["ep"] = {"param": e.full_tensor(), "start": e_full, "calls": calls, "collectives": collectives,
                 "comm": opt.last_step_stats.comm.calls, "bytes": opt.last_step_stats.comm.bytes_sent}


# ------------------------------------------------------------------------------------------
# meshes built as torchtitan builds them: unflattened from a 1-D ("world",) mesh, sliced, flattened
# ------------------------------------------------------------------------------------------


def _unflattened_specs():
    """name: (shape, mesh key, placements); the meshes are `_unflattened_meshes`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    return {
        "fsdp_x_colwise": ((12, 6), "fsdp_tp", (_StridedShard(0, split_factor=2), Shard(0))),
        "fsdp_x_rowwise": ((10, 12), "fsdp_tp", (Shard(0), Shard(1))),
        "fsdp_sliced": ((9, 5), "fsdp", (Shard(0),)),
        "tp_sliced": ((7, 12), "tp", (Shard(1),)),
        "flattened": ((11, 7), "flat", (Shard(0),)),
        "other_unflatten_inner": ((6, 10), "y", (Shard(0),)),
        "experts": ((3, 4, 6), "fsdp_tp", (Shard(0), Replicate())),
    }


def _unflattened_meshes():
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
    m = world._unflatten(0, (2, 2), ("fsdp", "tp"))
    other = world._unflatten(0, (2, 2), ("x", "y"))
    return {"fsdp_tp": m, "fsdp": m["fsdp"], "tp": m["tp"], "flat": m._flatten("fsdp_tp_flat"), "y": other["y"]}


def _unflattened_worker_part(rank, out):
    """One Muon over parameters on several meshes unflattened from one 1-D mesh (none sliced from a
    mesh with the same dimension names); the error, if any, is kept for the test."""
    from torch.distributed.tensor import distribute_tensor

    try:
        meshes = _unflattened_meshes()
        specs = _unflattened_specs()
        torch.manual_seed(8)
        start = [torch.randn(shape) for shape, _, _ in specs.values()]
        where = [(meshes[key], pl) for _, key, pl in specs.values()]
        params = [torch.nn.Parameter(distribute_tensor(t.clone(), m, pl)) for t, (m, pl) in zip(start, where)]
        _bag_run(params, STEPS, lambda s: [distribute_tensor(g, m, pl) for g, (m, pl)
                                           in zip(_bag_grads([p.shape for p in params], s), where)])
        out["unflattened"] = {"params": [p.full_tensor() for p in params]}
    except Exception as e:  # noqa: BLE001 - reported by the test, not by the whole launch
        out["unflattened"] = {"error": f"{type(e).__name__}: {e}"}


# ------------------------------------------------------------------------------------------
# models: FSDP2 x TP with MuonClip (GQA), HSDP, TP-only MLA with MuonClip; DCP 2x2 -> 4x1
# ------------------------------------------------------------------------------------------


def _gpt(cfg, seed=0, scale_qk=True):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**cfg))
    if scale_qk:  # logits above TAU in some heads, below in others
        with torch.no_grad():
            for block in model.blocks:
                attn = block.attn
                q = attn.q_proj.weight if hasattr(attn, "q_proj") else attn._q_weight_bias()[0]
                rows = q.shape[0]
                q.mul_(torch.linspace(2.0, 12.0, rows)[:, None])
                (attn.k_proj.weight if hasattr(attn, "k_proj") else attn.kv_b_proj.weight).mul_(4.0)
    return model


def _train(model, opt, steps, *, part=0, parts=1, log=None):
    """`test_distributed._train` on this data-parallel part; ``log`` gets each step's maxima and clipped heads."""
    def record(_):
        log.append({k: (opt.last_max_logits[k].clone(), opt.last_clipped[k].clone()) for k in opt.last_max_logits})

    _train_dp(model, opt, steps, rank=part, world=parts, after_step=record if log is not None else None)


def _fsdp_tp(cfg, mesh2):
    from torch.distributed.fsdp import fully_shard

    from muonclip.models.parallel import tensor_parallel

    model = tensor_parallel(_gpt(cfg), mesh2["tp"])
    for block in model.blocks:
        fully_shard(block, mesh=mesh2["dp"])
    return fully_shard(model, mesh=mesh2["dp"])


def _models_worker_part(rank, out, out_dir):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from muonclip.models.parallel import tensor_parallel

    mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh2["dp"].get_local_rank()
    # FSDP2 x TP, GQA, MuonClip: q/k/v weights are (_StridedShard, Shard(0)) on the 2-D mesh
    net = _fsdp_tp(GQA, mesh2)
    assert isinstance(net.blocks[0].attn.q_proj.weight.placements[0], _StridedShard)
    opt = MuonClip(net, tau=TAU, **OPT)
    calls, collectives = [], []
    undo = _spy(collectives, calls)
    log: list = []
    try:
        _train(net, opt, STEPS, part=dp, parts=2, log=log)
    finally:
        undo()
    out["fsdp_tp"] = {"params": _params(net), "log": log, "calls": calls, "collectives": collectives}
    checkpoint.save(os.path.join(out_dir, "ckpt_2x2"), net, opt, extra={"step": STEPS})
    out["fsdp_tp"]["saved"] = _state(net, opt)
    # the same checkpoint on a 4x1 mesh (FSDP2 over 4 ranks, no TP): identical state
    mesh4 = init_device_mesh("cpu", (WORLD,))
    net4 = _gpt(GQA, seed=123, scale_qk=False)
    for block in net4.blocks:
        fully_shard(block, mesh=mesh4)
    fully_shard(net4, mesh=mesh4)
    opt4 = MuonClip(net4, tau=TAU, **OPT)
    checkpoint.load(os.path.join(out_dir, "ckpt_2x2"), net4, opt4)
    out["fsdp_tp"]["loaded_4x1"] = _state(net4, opt4)
    # HSDP: replicate over dim 0, shard over dim 1 of the 2x2 mesh; each rank a quarter of the batch
    model = _gpt(GQA, scale_qk=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh2)
    fully_shard(model, mesh=mesh2)
    opt = Muon(param_groups(model), **OPT)
    _train(model, opt, STEPS, part=rank, parts=WORLD)
    out["hsdp"] = {"params": _params(model)}
    # tensor parallel only, 4 ranks, MLA, MuonClip: every rank sees the whole batch
    mla = tensor_parallel(_gpt(MLA), init_device_mesh("cpu", (WORLD,)))
    opt = MuonClip(mla, tau=TAU, **OPT)
    log = []
    _train(mla, opt, STEPS, log=log)
    out["tp_mla"] = {"params": _params(mla), "log": log, "heads": list(mla.blocks[0].attn.recorder.heads)}


# ------------------------------------------------------------------------------------------
# Hugging Face Llama loaded with its own TP plan (transformers' DistributedConfig(tp_plan="auto"))
# ------------------------------------------------------------------------------------------


def _save_llama(path) -> None:
    """A tiny Llama, q/k scaled so that some heads' logits exceed TAU and others do not, saved for loading."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA))
    with torch.no_grad():
        for layer in model.model.layers:
            q = layer.self_attn.q_proj.weight
            q.mul_(torch.linspace(4.0, 30.0, q.shape[0])[:, None])
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.save_pretrained(path)


def _load_llama(path, tp: int):
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    kw = {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=tp)} if tp > 1 else {}
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)


def _train_llama(model, opt, steps, log=None):
    """``steps`` steps, the same whole batch on every rank (tensor parallel only)."""
    model.train()
    for s in range(steps):
        x = torch.randint(0, LLAMA["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(2000 + s))
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if log is not None:
            log.append({k: (opt.last_max_logits[k].clone(), opt.last_clipped[k].clone()) for k in opt.last_max_logits})


def _hf_worker_part(rank, out, path):
    if not os.path.isdir(path):  # transformers not installed: the test skips
        return
    model = _load_llama(path, WORLD)
    opt = Muon(param_groups(model), **OPT)
    calls, collectives = [], []
    undo = _spy(collectives, calls)
    try:
        _train_llama(model, opt, STEPS)
    finally:
        undo()
    out["hf_muon"] = _params(model)
    out["hf_calls"] = calls
    model = _load_llama(path, WORLD)
    opt = MuonClip(model, tau=TAU, **OPT)
    log: list = []
    _train_llama(model, opt, STEPS, log)
    placements = {n: tuple(p.placements) for n, p in model.named_parameters() if hasattr(p, "placements")}
    out["hf_clip"] = {"params": _params(model), "log": log, "heads": [list(ly.recorder.heads) for ly in opt.layers],
                      "placements": placements}


def _state(net, opt):
    from torch.distributed.tensor import DTensor

    state = {}
    for g in opt.param_groups:
        for name, p in zip(g["param_names"], g["params"]):
            state[name] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone()
                           for k, v in opt.state[p].items() if torch.is_tensor(v)}
    return {"params": _params(net), "state": state, "steps_taken": opt.steps_taken}


def _worker(rank, world, out_dir):
    out: dict = {}
    _bag_worker_part(rank, out)
    _unflattened_worker_part(rank, out)
    _models_worker_part(rank, out, out_dir)
    _hf_worker_part(rank, out, os.path.join(out_dir, "llama"))
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("tp")
    try:
        _save_llama(out_dir / "llama")
    except ImportError:  # the hf extra is not installed: only the HF Llama test skips
        pass
    _launch(_worker, str(out_dir), world=WORLD, limit_s=300)
    return out_dir, [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def _whole_matrix_shapes(shapes):
    out = set()
    for s in shapes:
        spec = matrix_spec(s, {"flatten": False, "split_sizes": None, "split_groups": 1, "transposed": False,
                               "adjust_lr_fn": "original", "method": "ns5", "ns_steps": None})
        out |= {(spec.block_rows(b), spec.cols) for b in range(spec.n_blocks)}
    return out


def test_every_placement_matches_one_process_with_ns_once_per_whole_matrix(ranks):
    """Shard/Shard, HSDP, FSDP2 x colwise (strided shard), FSDP2 x rowwise, rowwise TP, uneven splits, expert
    stacks (EP with replicas, EP on both mesh dims, experts cut inside: gathered to an owner): every rank's
    result equals one process's to REL; every matrix orthogonalised once per step on the whole mesh, on its
    whole shape; the same collectives on every rank. Ranks agree exactly: each result is computed once and
    copied."""
    _, rk = ranks
    specs = _bag_specs()
    start, ref = _bag_reference(specs, STEPS)
    a = {str(i): t for i, t in enumerate(ref)}
    s0 = {str(i): t for i, t in enumerate(start)}
    for r in rk:
        got = {str(i): t for i, t in enumerate(r["bag"]["params"])}
        print(f"placements bag: max diff / max movement = {_rel(got, a, s0):.2g}")
        assert _rel(got, a, s0) <= REL
    for r in rk[1:]:
        assert all(torch.equal(x, y) for x, y in zip(r["bag"]["params"], rk[0]["bag"]["params"]))
        assert r["bag"]["collectives"] == rk[0]["bag"]["collectives"]
    shapes = [s for s, _ in specs.values()]
    n_matrices = sum(s[0] if len(s) == 3 else 1 for s in shapes)
    assert sum(sum(c[0] for c in r["bag"]["calls"]) for r in rk) == STEPS * n_matrices
    whole = _whole_matrix_shapes(shapes)
    for r in rk:
        assert {c[1:] for c in r["bag"]["calls"]} <= whole  # never a shard
    assert sum(r["bag"]["matrices"] for r in rk) == n_matrices


def test_meshes_unflattened_from_a_world_mesh_map_by_rank_layout(ranks):
    """torchtitan's meshes: a 1-D ("world",) mesh unflattened to ("fsdp", "tp"), the 2-D mesh, its slices, its
    flattening and a slice of a second unflattening, all in one optimizer: placements are mapped by each
    mesh's rank layout, and every rank's result equals one process's to REL."""
    _, rk = ranks
    specs = _unflattened_specs()
    torch.manual_seed(8)
    start = [torch.randn(shape) for shape, _, _ in specs.values()]
    params = [torch.nn.Parameter(t.clone()) for t in start]
    _bag_run(params, STEPS, lambda s: _bag_grads([p.shape for p in params], s), process_group="local")
    a = {n: p.detach() for n, p in zip(specs, params)}
    s0 = dict(zip(specs, start))
    for r in rk:
        assert "error" not in r["unflattened"], r["unflattened"].get("error")
        got = dict(zip(specs, r["unflattened"]["params"]))
        print(f"unflattened meshes: max diff / max movement = {_rel(got, a, s0):.2g}")
        assert _rel(got, a, s0) <= REL


class _MeshWithoutLayout:
    """A device mesh as torch without ``DeviceMesh._layout`` has it: its own ranks, names, its root."""

    def __init__(self, mesh, names, root=None):
        self.mesh, self.mesh_dim_names, self._root = torch.as_tensor(mesh), names, root
        self.shape, self.ndim = tuple(self.mesh.shape), self.mesh.ndim

    def _get_root_mesh(self):
        return self._root or self


def test_mesh_grid_without_rank_layouts_maps_by_root_names_and_refuses_other_names():
    """Older torch: a submesh sliced by name maps to its root's copies; a name its root lacks is refused."""
    from muonclip.common._dtensor import mesh_grid

    root = _MeshWithoutLayout([[0, 1, 2], [3, 4, 5]], ("dp", "tp"))
    grid, where = mesh_grid(_MeshWithoutLayout([1, 4], ("dp",), root))
    assert grid == (3, 2) and where[4] == (1, 1) and where[2] == (2, 0) and len(where) == 6
    grid, where = mesh_grid(root)
    assert grid == (1, 2, 3) and where[5] == (0, 1, 2)
    with pytest.raises(ValueError, match="slice submeshes by name"):
        mesh_grid(_MeshWithoutLayout([0, 1, 2, 3, 4, 5], ("flat",), root))


def test_expert_parallel_orthogonalises_locally_with_no_data_moved(ranks):
    """6 experts Shard(0) over 4 ranks (2, 2, 2, 0): each rank orthogonalises its own experts in one call;
    the only collective is the agreement check (no all-to-all, zero bytes of matrices)."""
    _, rk = ranks
    e_full = rk[0]["ep"]["start"]
    p = torch.nn.Parameter(e_full.clone())
    _bag_run([p], STEPS, lambda s: _bag_grads([(6, 4, 5)], s), process_group="local")
    for r, out in enumerate(rk):
        ep = out["ep"]
        print(f"EP: max diff / max movement = {_rel({'e': ep['param']}, {'e': p.detach()}, {'e': e_full}):.2g}")
        assert _rel({"e": ep["param"]}, {"e": p.detach()}, {"e": e_full}) <= REL
        assert set(ep["collectives"]) == {"all_reduce"}
        assert "all_to_all" not in ep["comm"]
        assert [c for c in ep["calls"]] == ([(2, 4, 5)] * STEPS if r < 3 else [])


def _reference_model(cfg, steps, clip, scale_qk=True):
    model = _gpt(cfg, scale_qk=scale_qk)
    start = _params(model)
    opt = (MuonClip(model, tau=TAU, process_group="local", **OPT) if clip
           else Muon(param_groups(model), process_group="local", **OPT))
    log: list = []
    _train(model, opt, steps, log=log if clip else None)
    return start, model, opt, log


def _assert_same_clips(log, ref):
    n_clipped = sum(int(c.sum()) for step in ref for _, c in step.values())
    assert 0 < n_clipped < sum(c.numel() for step in ref for _, c in step.values())  # the test can tell
    assert len(log) == len(ref)
    for mine, theirs in zip(log, ref):
        assert mine.keys() == theirs.keys()
        for name, (s, clipped) in mine.items():
            s_ref, clipped_ref = theirs[name]
            assert ((s_ref - TAU).abs() > 1e-3 * TAU).all()  # no head near the threshold: same heads anywhere
            assert torch.equal(clipped, clipped_ref), name
            torch.testing.assert_close((TAU / s).clamp(max=1), (TAU / s_ref).clamp(max=1), rtol=1e-5, atol=0)


def test_fsdp2_x_tp_muonclip_matches_one_process_and_clips_the_same_heads(ranks):
    """FSDP2 x TP on a 2x2 mesh (GQA: heads split over TP ranks, q/k/v strided-sharded by FSDP2): the same
    params (`_like_one_process`) and, every step, the same heads clipped with the same factors as one process; NS once per
    matrix per step over the mesh, on whole shapes only."""
    _, rk = ranks
    start, model, _, ref = _reference_model(GQA, STEPS, clip=True)
    want = _params(model)
    for r in rk:
        _like_one_process(r["fsdp_tp"]["params"], want, start, model, "FSDP2 x TP + MuonClip")
        _assert_same_clips(r["fsdp_tp"]["log"], ref)
    matrices = [tuple(p.shape) for g in param_groups(model) if g["algorithm"] == "muon" for p in g["params"]]
    assert sum(sum(c[0] for c in r["fsdp_tp"]["calls"]) for r in rk) == STEPS * len(matrices)
    for r in rk:
        assert {c[1:] for c in r["fsdp_tp"]["calls"]} <= set(matrices)
        assert r["fsdp_tp"]["collectives"] == rk[0]["fsdp_tp"]["collectives"]


def test_hsdp_matches_one_process(ranks):
    """HSDP (replicate x shard, 2x2), 4 data-parallel ranks: the same params as one process (`_like_one_process`)."""
    _, rk = ranks
    start, model, _, _ = _reference_model(GQA, STEPS, clip=False, scale_qk=False)
    for r in rk:
        _like_one_process(r["hsdp"]["params"], _params(model), start, model, "HSDP")


def test_tp_mla_muonclip_records_its_own_heads_and_clips_like_one_process(ranks):
    """TP over 4 ranks on MLA: rank r records head r only, and the all-reduced maxima, the clipped heads,
    the factors and the params equal one process's."""
    _, rk = ranks
    start, model, _, ref = _reference_model(MLA, STEPS, clip=True)
    for i, r in enumerate(rk):
        assert r["tp_mla"]["heads"] == [i]
        _like_one_process(r["tp_mla"]["params"], _params(model), start, model, "TP MLA + MuonClip")
        _assert_same_clips(r["tp_mla"]["log"], ref)


def test_checkpoint_saved_on_2x2_loads_on_4x1_and_on_one_process(ranks):
    """DCP save on the FSDP2 x TP 2x2 mesh; load on FSDP2 over 4 ranks and on one process: the same params
    and optimizer state, bit for bit (DCP copies bytes)."""
    out_dir, rk = ranks
    saved = rk[0]["fsdp_tp"]["saved"]
    for got in (rk[0]["fsdp_tp"]["loaded_4x1"], _load_one_process(out_dir)):
        assert got["steps_taken"] == saved["steps_taken"] == STEPS
        assert _max_diff(got["params"], saved["params"]) == 0.0
        assert got["state"].keys() == saved["state"].keys()
        for name, st in saved["state"].items():
            assert st.keys() == got["state"][name].keys(), name
            for k, v in st.items():
                assert torch.equal(v, got["state"][name][k]), (name, k)


def _load_one_process(out_dir):
    model = _gpt(GQA, seed=123, scale_qk=False)
    opt = MuonClip(model, tau=TAU, process_group="local", **OPT)
    extra = checkpoint.load(out_dir / "ckpt_2x2", model, opt)
    assert extra == {"step": STEPS}
    return _state(model, opt)


def test_hf_llama_with_its_own_tp_plan_matches_one_process_and_clips_the_same_heads(ranks):
    """A Hugging Face Llama (GQA, 8 query / 4 key heads) loaded on 4 ranks with transformers' own TP plan
    (``DistributedConfig(tp_plan="auto")``: q/k/v/gate/up colwise ``Shard(0)``, o/down rowwise ``Shard(1)``,
    embedding and LM head sharded on the vocabulary): Muon gives the same params as one process
    (`_like_one_process`), each
    matrix orthogonalised once per step over the 4 ranks, whole; with
    MuonClip (layers found by `muonclip.integrations.hf`, the "muonclip" attention function) rank r's recorders
    hold heads 2r, 2r+1 only, and every step the same heads are clipped with the same factors as one process."""
    out_dir, rk = ranks
    if "hf_muon" not in rk[0]:
        pytest.skip("transformers (the hf extra) is not installed")
    path = out_dir / "llama"
    model = _load_llama(path, 1)
    start = _params(model)
    _train_llama(model, Muon(param_groups(model), process_group="local", **OPT), STEPS)
    want = _params(model)
    matrices = [tuple(p.shape) for g in param_groups(model) if g["algorithm"] == "muon" for p in g["params"]]
    assert sum(sum(c[0] for c in r["hf_calls"]) for r in rk) == STEPS * len(matrices)  # once per matrix, mesh-wide
    assert {c[1:] for r in rk for c in r["hf_calls"]} <= set(matrices)  # whole matrices only, never a shard
    model = _load_llama(path, 1)
    opt = MuonClip(model, tau=TAU, process_group="local", **OPT)
    ref: list = []
    _train_llama(model, opt, STEPS, ref)
    want_clip = _params(model)
    from torch.distributed.tensor import Shard

    for i, r in enumerate(rk):
        placements = r["hf_clip"]["placements"]
        assert placements["model.layers.0.self_attn.q_proj.weight"] == (Shard(0),)
        assert placements["model.layers.0.self_attn.o_proj.weight"] == (Shard(1),)
        assert placements["model.embed_tokens.weight"] == placements["lm_head.weight"] == (Shard(0),)
        _like_one_process(r["hf_muon"], want, start, model, "HF Llama TP + Muon")
        assert r["hf_clip"]["heads"] == [[2 * i, 2 * i + 1]] * LLAMA["num_hidden_layers"]
        _like_one_process(r["hf_clip"]["params"], want_clip, start, model, "HF Llama TP + MuonClip")
        _assert_same_clips(r["hf_clip"]["log"], ref)
