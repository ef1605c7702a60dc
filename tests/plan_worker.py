"""The rank side of tests/test_plan.py: real optimizer steps on gloo meshes, every cost counted.

Each case builds the model as a user would (DDP, ``fully_shard``, the reference GPT's tensor-parallel
plan then ``fully_shard``, HSDP; expert parallelism as DTensors placed like torchtitan's FSDP2 x EP),
runs two steps of Muon, of MuonClip (a real forward and backward first) and of torch's AdamW, and
counts, independently of the planner: Newton–Schulz flops from the shapes every orthogonalisation
call receives (`Bucket.orthogonalize`), the bytes of every collective (each ``torch.distributed``
call wrapped; DTensor's functional collectives seen by a dispatch mode), the gather's and the
scatter's all-to-alls apart, and the optimizer state the optimizers allocated. Each rank also
records every rank's piece of every Muon weight as the step sees it (`GroupContext.pieces`).

The pipeline cases (`pp_case`) cut the GPT in two stages as ``examples/torchrun_pipeline.py`` does,
each stage ``fully_shard``-ed over its 2 ranks (or replicated, gradients averaged as DDP does), a
real ``torch.distributed.pipelining`` schedule, and each rank's optimizers over its stage's module with
``process_group=`` the stage's ranks.

ZeRO-1 runs apart (`zero1_worker`, launched by `deepspeed_harness`: DeepSpeed initialises its own
communication): DeepSpeed's ZeRO-1 driving the optimizers, counted the same way inside their
``step()``, and DeepSpeed's partition of every Muon weight as its driver hands it to the step.
"""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from muonclip import Muon, param_groups
from muonclip.common._dtensor import FlatRange
from muonclip.distributed import _engine
from muonclip.distributed._context import resolve_group
from muonclip.distributed._exchange import all_reduce_bytes
from muonclip.models import GPT, GPTConfig
from muonclip.optim._buckets import Bucket
from muonclip.ortho._newton_schulz import ns_flops
from muonclip.qkclip import MuonClip

WORLD = 4
DENSE = dict(vocab_size=63, block_size=16, n_layer=2, n_head=4, n_kv_head=2, n_embd=24)  # uneven FSDP shards
MOE = dict(DENSE, n_expert=6, expert_hidden=8)
PP = dict(DENSE, tie_embeddings=False)  # a tied head cannot live on the other stage than the embedding
# MLA whose param groups' sizes are not multiples of twice the ranks: DeepSpeed pads every partition
ZERO1 = dict(DENSE, n_embd=18, n_head=3, n_kv_head=None, attention="mla", kv_lora_rank=7, qk_nope_head_dim=4,
             qk_rope_head_dim=4, v_head_dim=3)
ZERO1_WORLD = 2
OPT = dict(lr=0.02, weight_decay=0.1, orth_dtype=torch.float32)
STEPS = 2
OTHER_OPS = ("broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "barrier", "send", "recv")


class Count(TorchDispatchMode):
    """Everything one step does that the plan predicts, counted as it happens."""

    def __init__(self) -> None:
        super().__init__()
        self.phase, self.flops, self.reduce, self.other, self.gathered = None, 0, 0, [], 0
        self.moved = {"gather": [0, 0], "scatter": [0, 0]}  # [sent, received]
        self._undo = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and not func.__name__.startswith("wait_tensor"):
            self.other.append(func.__name__)
        return func(*args, **(kwargs or {}))

    def _patch(self, owner, name, wrapper):
        real = getattr(owner, name)
        setattr(owner, name, wrapper(real))
        self._undo.append((owner, name, real))

    def install(self) -> Count:
        def orth(real):
            def f(bucket, V, *a, **k):
                self.flops += ns_flops([tuple(V.shape)], bucket.steps or 5)
                return real(bucket, V, *a, **k)
            return f

        def phase(kind):
            def wrap(real):
                def f(*a, **k):
                    self.phase = kind
                    try:
                        return real(*a, **k)
                    finally:
                        self.phase = None
                return f
            return wrap

        def a2a(real):
            def f(out, inp, *a, **k):
                self.moved[self.phase][0] += inp.numel() * inp.element_size()
                self.moved[self.phase][1] += out.numel() * out.element_size()
                return real(out, inp, *a, **k)
            return f

        def reduce(real):
            def f(t, *a, group=None, **k):
                self.reduce += all_reduce_bytes(t.numel() * t.element_size(), dist.get_world_size(group))
                return real(t, *a, group=group, **k)
            return f

        def other(name):
            def wrap(real):
                def f(*a, **k):
                    self.other.append(name)
                    if name == "all_gather":  # all_gather(tensor_list, tensor): every other rank's copy comes in
                        self.gathered += a[1].numel() * a[1].element_size() * (len(a[0]) - 1)
                    return real(*a, **k)
                return f
            return wrap

        self._patch(Bucket, "orthogonalize", orth)
        self._patch(_engine.StepExchange, "gather", phase("gather"))
        self._patch(_engine.StepExchange, "scatter", phase("scatter"))
        self._patch(dist, "all_to_all_single", a2a)
        self._patch(dist, "all_reduce", reduce)
        for name in OTHER_OPS:
            self._patch(dist, name, other(name))
        return self

    def remove(self) -> None:
        for owner, name, real in reversed(self._undo):
            setattr(owner, name, real)

    def figures(self) -> dict:
        return {"flops": self.flops, "gather_sent": self.moved["gather"][0], "gather_recv": self.moved["gather"][1],
                "scatter_sent": self.moved["scatter"][0], "scatter_recv": self.moved["scatter"][1],
                "reduce": self.reduce, "other": list(self.other), "gathered": self.gathered}


def state_bytes(opt) -> int:
    """Bytes of every tensor of the optimizer's state on this rank (a DTensor's local piece)."""
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                v = getattr(v, "_local_tensor", v)
                total += v.numel() * v.element_size()
    return total


def _batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, DENSE["vocab_size"], (rows, 9), generator=g)
    return x[:, :-1], x[:, 1:]


def _steps(net, opt, synthetic=None):
    per_step = []
    for s in range(STEPS):
        if synthetic is None:
            x, y = _batch(s, 2)
            _, loss = net(x, y)
            loss.backward()
        else:
            synthetic(s)
        count = Count().install()
        try:
            with count:
                opt.step()
        finally:
            count.remove()
        opt.zero_grad(set_to_none=True)
        per_step.append(count.figures())
    return per_step


def _gpt(cfg):
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg))


def _dense_net(case):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from muonclip.models.parallel import tensor_parallel

    model = _gpt(DENSE)
    if case == "ddp":
        return DDP(model), model
    if case == "fsdp":
        mesh = init_device_mesh("cpu", (WORLD,))
    elif case == "fsdp_tp":
        mesh2 = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        tensor_parallel(model, mesh2["tp"])
        mesh = mesh2["dp"]
    else:  # hsdp: replicate x shard
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, model


def plain(pieces):
    """Pieces (per weight, per rank) as tuples of ints: ``(start, stop, step)`` for a range."""
    return [[tuple((i.start, i.stop, i.step) if isinstance(i, range) else tuple(i) for i in pc) for pc in ranks]
            for ranks in pieces]


def _pieces(groups, process_group=None):
    params = [p for g in groups if g["algorithm"] == "muon" for p in g["params"]]
    ctx = resolve_group(params, lambda i: str(i), process_group)
    return plain([ctx.pieces(p) for p in params])


def dense_case(case, rank):
    out = {}
    for name in ("muon", "muonclip", "adamw"):
        net, model = _dense_net(case)
        if name == "adamw":
            opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        else:
            groups = param_groups(model)
            opt = Muon(groups, **OPT) if name == "muon" else MuonClip(model, tau=1.0, groups=groups, **OPT)
            out["pieces"] = _pieces(opt.param_groups)
        out[name] = {"steps": _steps(net, opt), "state": state_bytes(opt)}
    return out


def ep_case(rank):
    """The MoE GPT's parameters as DTensors placed like torchtitan's FSDP2 (4 ranks) x EP (2): the
    dense ones ``Shard(0)`` over the 4 ranks, each stack of 6 experts ``Shard(0)`` over ``ep`` and
    dealt over the 2 ``efsdp`` ranks (FSDP2's strided shard), on meshes unflattened from one 1-D mesh;
    synthetic gradients with the parameters' placements (the step is what is measured)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    world = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (WORLD,), ("fsdp",))
    sparse = world._unflatten(0, (2, 2), ("efsdp", "ep"))
    out = {}
    for name in ("muon", "adamw"):
        model = _gpt(MOE)
        full = dict(model.named_parameters())
        where = {n: ((sparse, (_StridedShard(0, split_factor=2), Shard(0))) if ".experts." in n
                     else (dense, (Shard(0),))) for n in full}
        params = {n: torch.nn.Parameter(distribute_tensor(t.detach().clone(), *where[n], src_data_rank=None))
                  for n, t in full.items()}  # every rank holds the same values: split locally

        def grads(step, params=params, full=full, where=where):
            g = torch.Generator().manual_seed(300 + step)
            for n, p in params.items():
                p.grad = distribute_tensor(torch.randn(full[n].shape, generator=g), *where[n], src_data_rank=None)

        if name == "adamw":
            opt = torch.optim.AdamW(list(params.values()), lr=1e-3)
        else:
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [params[n] for n in g["param_names"]]}
                      for g in param_groups(model)]
            opt = Muon(groups, **OPT)
            out["pieces"] = _pieces(opt.param_groups)
        out[name] = {"steps": _steps(None, opt, synthetic=grads), "state": state_bytes(opt)}
    return out


class Stage(torch.nn.Module):
    """Stage ``stage`` of 2 of the untied GPT (``examples/torchrun_pipeline.py``'s cut): the embedding
    and the first half of the blocks, or the other half, the final norm and the head; parameters
    named as in the whole GPT (``blocks.1.attn...``)."""

    def __init__(self, gpt, stage):
        super().__init__()
        half = gpt.config.n_layer // 2
        self.first = stage == 0
        if self.first:
            self.wte = gpt.wte
        self.blocks = torch.nn.ModuleDict({str(i): gpt.blocks[i] for i in (range(half) if self.first else
                                                                            range(half, gpt.config.n_layer))})
        if not self.first:
            self.ln_f, self.lm_head = gpt.ln_f, gpt.lm_head

    def forward(self, x):
        if self.first:
            x = self.wte(x)
        for block in self.blocks.values():
            x = block(x)
        return x if self.first else self.lm_head(self.ln_f(x))


def pp_case(rank, shard):
    """2 pipeline stages, each over 2 ranks (a ``("pp", "dp")`` mesh): FSDP2 (``shard``) or replicas
    (their gradients averaged as DDP does); GPipe over 2 micro-batches; Muon, MuonClip and AdamW
    over the stage's module, Muon's with ``process_group=mesh["dp"]``'s group."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    from muonclip.integrations.pipelining import unrecorded_shape_inference

    mesh = init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("pp", "dp"))
    stage_index = mesh.get_coordinate()[0]
    group = mesh["dp"].get_group()
    out = {}
    for name in ("muon", "muonclip", "adamw"):
        module = Stage(_gpt(PP), stage_index)
        if shard:
            for block in module.blocks.values():
                fully_shard(block, mesh=mesh["dp"])
            fully_shard(module, mesh=mesh["dp"])
        stage = PipelineStage(module, stage_index, 2, torch.device("cpu"), group=mesh["pp"].get_group())
        schedule = unrecorded_shape_inference(ScheduleGPipe(
            stage, n_microbatches=2, loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten())))
        if name == "adamw":
            opt = torch.optim.AdamW(module.parameters(), lr=1e-3)
        else:
            groups = param_groups(module)
            opt = (Muon(groups, process_group=group, **OPT) if name == "muon"
                   else MuonClip(module, tau=1.0, groups=groups, process_group=group, **OPT))
            out["pieces"] = _pieces(opt.param_groups, group)

        def forward_backward(step, schedule=schedule, module=module):
            x, y = _batch(step, 2)
            if stage_index == 0:
                schedule.step(x)
            else:
                schedule.step(target=y)
            if not shard:  # the replicas' mean gradient, as DDP makes it
                for p in module.parameters():
                    dist.all_reduce(p.grad, group=group)
                    p.grad /= 2

        out[name] = {"steps": _steps(None, opt, synthetic=forward_backward), "state": state_bytes(opt)}
    return out


def flat_range(piece, shape):
    """A rank's piece of a weight as ``(start, stop)`` of its flattened elements (None: nothing): DeepSpeed's
    `FlatRange` or whole weight, the planner's ``(range,)`` of the flat view."""
    if isinstance(piece, FlatRange):
        return (piece.start, piece.stop) if len(piece) else None
    if len(piece) == 1 and len(shape) != 1:  # the planner's range of the flattened weight
        return (piece[0].start, piece[0].stop) if len(piece[0]) else None
    return (0, math.prod(shape))


def zero1_worker(rank, world, out_dir):
    """DeepSpeed ZeRO-1 in float32 on ``world`` gloo ranks (`deepspeed_harness.launch`): the MLA GPT
    `ZERO1` stepped by Muon, MuonClip and torch's AdamW as DeepSpeed's optimizer, `STEPS` steps of
    ``engine.step()``, each counted inside the optimizer's ``step()`` calls (DeepSpeed calls it once
    per param group; its own reduction of gradients and gathering of weights are not the optimizer's);
    DeepSpeed's partition of every Muon weight (`muonclip.integrations.deepspeed_zero`) recorded."""
    import deepspeed

    from muonclip.integrations.deepspeed import attach

    cfg = {"train_batch_size": 2 * world, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1},
           "zero_allow_untested_optimizer": True, "gradient_clipping": 0.0, "steps_per_print": 10**9}
    out = {}
    for name in ("muon", "muonclip", "adamw"):
        model = _gpt(ZERO1)
        if name == "adamw":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            groups = param_groups(model)
            opt = Muon(groups, **OPT) if name == "muon" else MuonClip(model, tau=1.0, groups=groups, **OPT)
        engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        if name != "adamw":
            out["pieces"] = [[flat_range(pc, m.shape) for pc in m.pieces] for part in attach(engine).parts
                             if opt.param_groups[part.index]["algorithm"] == "muon" for m in part.members]
        counts: list[Count] = []  # one per engine.step()

        def counted_step(*a, real=opt.step, counts=counts, **k):
            counts[-1].install()
            try:
                with counts[-1]:
                    return real(*a, **k)
            finally:
                counts[-1].remove()

        opt.step = counted_step  # what DeepSpeed's ZeRO optimizer calls
        for s in range(STEPS):
            x, y = _batch(world * s + rank, 2)
            _, loss = engine(x, y)
            engine.backward(loss)
            counts.append(Count())
            engine.step()
        per_step = [c.figures() for c in counts]
        out[name] = {"steps": per_step, "state": state_bytes(opt)}
    torch.save(out, os.path.join(out_dir, f"zero1-rank{rank}.pt"))


CASES = {"ddp": lambda r: dense_case("ddp", r), "fsdp": lambda r: dense_case("fsdp", r),
         "fsdp_tp": lambda r: dense_case("fsdp_tp", r), "hsdp": lambda r: dense_case("hsdp", r), "ep": ep_case,
         "pp": lambda r: pp_case(r, shard=True), "pp_ddp": lambda r: pp_case(r, shard=False)}
"""Each case: the mesh it runs on is the test's `MESHES` entry of the same name."""


def worker(rank, world, out_dir):
    torch.set_num_threads(1)
    results = {}
    for case, run in CASES.items():
        try:
            results[case] = run(rank)
        except Exception as e:  # noqa: BLE001 - reported by the test of this case, not by the whole launch
            results[case] = {"error": f"{type(e).__name__}: {e}"}
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
