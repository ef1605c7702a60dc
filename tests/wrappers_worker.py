"""The multi-process cases of tests/test_wrappers_distributed.py, run by one ``torchrun`` launch.

``python -m torch.distributed.run --standalone --nproc_per_node=2 tests/wrappers_worker.py OUT``
runs every case of `CASES` on 2 gloo ranks, one after the other, and writes each rank's results
to ``OUT/rank<r>.pt`` (a case that raises records its traceback instead). The models, batches
and hyperparameters are defined here so that the test computes its one-process references
from the same definitions.

accelerate enables FSDP only with accelerators; `forced_fsdp_on_cpu` makes an ``Accelerator``
given an FSDP plugin take its FSDP path on CPU processes too (the state it would have on GPUs),
so that accelerate's own FSDP2 ``prepare``, ``save_state`` and ``load_state`` run here.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
import time
import traceback
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)
OPT = dict(lr=0.02, weight_decay=0.1, orth_dtype=torch.float32)
TAU = 0.7  # with the scaled q/k of `gpt`, several heads pass it in the first steps
BATCH = 4  # rows of a global batch


# ----------------------------------------------------------------------------------------------
# shared with the test (one-process references)
# ----------------------------------------------------------------------------------------------


def gpt(seed: int = 0) -> torch.nn.Module:
    """The tiny GPT, q/k scaled so that QK-Clip fires at `TAU`."""
    from muonclip.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG))
    with torch.no_grad():
        for attn in model.attention_modules():
            attn.q_proj.weight.mul_(6.0)
            attn.k_proj.weight.mul_(4.0)
    return model


def batch(step: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch ``step`` (another stream per ``offset``)."""
    g = torch.Generator().manual_seed(1000 + offset + step)
    x = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def shard(b: tuple[torch.Tensor, torch.Tensor], rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's equal share of a global batch."""
    n = b[0].shape[0] // world
    return b[0][rank * n:(rank + 1) * n], b[1][rank * n:(rank + 1) * n]


def lightning_rows() -> torch.Tensor:
    """The 8 rows the Lightning runs train on (4 per rank, 2 steps per epoch)."""
    return torch.randint(0, CFG["vocab_size"], (8, CFG["block_size"] + 1), generator=torch.Generator().manual_seed(2))


def train(model, opt, batches, metrics=None) -> list[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A plain loop; returns, per step, each layer's (max logits, clipped) of the clip."""
    from muonclip.integrations import unwrap_optimizer

    log = []
    for x, y in batches:
        _, loss = model(x, y)
        loss.backward()
        if metrics is not None:
            metrics.before_step(opt)
        opt.step()
        if metrics is not None:
            metrics.after_step()
        opt.zero_grad(set_to_none=True)
        inner = unwrap_optimizer(opt)
        log.append({n: (inner.last_max_logits[n].clone(), inner.last_clipped[n].clone()) for n in inner.last_max_logits})
    return log


def full(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def params(model) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)
    return {n: full(p) for n, p in model.named_parameters()}


def opt_state(opt) -> dict[str, dict[str, Any]]:
    from muonclip.integrations import unwrap_optimizer

    opt = unwrap_optimizer(opt)
    return {name: {k: full(v) if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
            for g in opt.param_groups for name, p in zip(g["param_names"], g["params"])}


def clipped_heads(log) -> int:
    return sum(int(c.sum()) for step in log for _, c in step.values())


# ----------------------------------------------------------------------------------------------
# harness
# ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def forced_fsdp_on_cpu() -> Iterator[None]:
    """An ``Accelerator(fsdp_plugin=...)`` built inside takes accelerate's FSDP path on CPU ranks:
    accelerate sets ``DistributedType.FSDP`` only for accelerator devices, so it is set here
    right after accelerate's state is built (and accelerate's shared state is cleared on exit)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState().distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = init
    try:
        yield
    finally:
        AcceleratorState.__init__ = original
        reset_accelerate()


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state (the next Accelerator builds it afresh)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
                "all_to_all", "broadcast", "barrier", "all_gather_object")


@contextlib.contextmanager
def counted_collectives() -> Iterator[list[str]]:
    """The names of the torch.distributed collectives called inside (as they are called)."""
    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in _COLLECTIVES}

    def spy(name):
        def call(*args, **kwargs):
            calls.append(name)
            return saved[name](*args, **kwargs)
        return call

    for name in _COLLECTIVES:
        setattr(dist, name, spy(name))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model


# ----------------------------------------------------------------------------------------------
# cases
# ----------------------------------------------------------------------------------------------


def case_independent_models(rank: int, world: int, out: Path) -> dict[str, Any]:
    """Each rank its own model and MuonClip (seed 10 + rank, its own batches), once with
    process_group="local" and once with a one-rank group of its own; the collectives of the
    step, the clip and the logging callback's figures are counted."""
    from muonclip import MuonClip
    from muonclip.integrations import StepMetrics

    own_group, _ = dist.new_subgroups(group_size=1)
    results = {}
    for mode, group in (("local", "local"), ("subgroup", own_group)):
        model = gpt(seed=10 + rank)
        opt = MuonClip(model, tau=TAU, process_group=group, **OPT)
        metrics = StepMetrics()
        with counted_collectives() as calls:
            log = train(model, opt, [batch(s, offset=100 * rank) for s in range(4)], metrics)
        results[mode] = {"params": params(model), "log": log, "calls": list(calls),
                         "update_rms": metrics.last["muonclip/update_rms"]}
    return results


def case_late_fully_shard(rank: int, world: int, out: Path) -> dict[str, Any]:
    """MuonClip built, then fully_shard; against fully_shard, then MuonClip."""
    from muonclip import MuonClip

    late = gpt()
    opt = MuonClip(late, tau=TAU, **OPT)
    fsdp2(late)
    late_log = train(late, opt, [shard(batch(s), rank, world) for s in range(6)])
    ref = fsdp2(gpt())
    ref_log = train(ref, MuonClip(ref, tau=TAU, **OPT), [shard(batch(s), rank, world) for s in range(6)])
    return {"late": params(late), "ref": params(ref), "late_clipped": clipped_heads(late_log),
            "ref_clipped": clipped_heads(ref_log)}


def case_accelerate_fsdp2(rank: int, world: int, out: Path) -> dict[str, Any]:
    """The accelerate FSDP2 recipe: 6 steps against fully_shard + MuonClip; 3 steps, save_state,
    then a fresh model and optimizer, load_state and 3 steps, against the 6 steps; the optimizer's
    state dict through torch's get_optimizer_state_dict (full and sharded, cpu_offload)."""
    from doc_recipes import recipe
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    from muonclip import MuonClip
    from muonclip.integrations import unwrap_optimizer

    train_fsdp2 = recipe("accelerate_fsdp2")["train_fsdp2"]
    shards = [shard(batch(s), rank, world) for s in range(6)]
    ckpt = out / "accelerate_ckpt"
    with forced_fsdp_on_cpu():
        model, opt = train_fsdp2(gpt(), shards, tau=TAU, **OPT)
        whole, whole_state = params(model), opt_state(opt)
        inner = unwrap_optimizer(opt)
        last_clipped = dict(inner.last_clipped)
        saved = {}
        for full_sd in (True, False):
            sd = get_optimizer_state_dict(model, inner, options=StateDictOptions(full_state_dict=full_sd,
                                                                                 cpu_offload=True))
            if sd:  # full_state_dict with cpu_offload: rank 0 only
                saved[full_sd] = {key: [g[key] for g in sd["param_groups"]]
                                  for key in ("orth_dtype", "steps_taken", "tau")}
    with forced_fsdp_on_cpu():
        train_fsdp2(gpt(), shards[:3], tau=TAU, save_to=str(ckpt), **OPT)
    with forced_fsdp_on_cpu():
        model2, opt2 = train_fsdp2(gpt(seed=5), shards[3:], tau=TAU, resume_from=str(ckpt), **OPT)
        resumed, resumed_state = params(model2), opt_state(opt2)
        resumed_steps = unwrap_optimizer(opt2).steps_taken
    ref = fsdp2(gpt())
    ref_opt = MuonClip(ref, tau=TAU, **OPT)
    ref_log = train(ref, ref_opt, shards)
    return {"whole": whole, "whole_state": whole_state, "resumed": resumed, "resumed_state": resumed_state,
            "resumed_steps": resumed_steps, "ref": params(ref), "ref_clipped": clipped_heads(ref_log),
            "last_clipped": last_clipped, "ref_last_clipped": dict(ref_opt.last_clipped), "saved": saved}


def case_accelerate_ddp(rank: int, world: int, out: Path) -> dict[str, Any]:
    """The accelerate recipe on 2 processes (DDP), 8 steps on this rank's share of each batch."""
    from doc_recipes import recipe

    train_fn = recipe("accelerate")["train"]
    try:
        model, opt = train_fn(gpt(), [shard(batch(s), rank, world) for s in range(8)], tau=TAU, **OPT)
    finally:
        reset_accelerate()
    return {"params": params(model), "steps": opt.optimizer.steps_taken}


def case_lightning(rank: int, world: int, out: Path) -> dict[str, Any]:
    """The Lightning recipe: DDP for one epoch; FSDP2 (ModelParallelStrategy) for 2 epochs, and for
    1 epoch, its checkpoint, then resumed to 2 epochs from a fresh model."""
    from doc_recipes import recipe

    fit = recipe("lightning")["fit"]
    rows = lightning_rows()
    dataset = torch.utils.data.TensorDataset(rows[:, :-1], rows[:, 1:])

    def loader():  # rank r takes rows r, r + 2, ...: global batch s is rows 4s..4s+3, each epoch
        sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
        return torch.utils.data.DataLoader(dataset, batch_size=2, sampler=sampler)

    def figures(trainer):
        callback = next(c for c in trainer.callbacks if type(c).__name__ == "MuonClipLightningCallback")
        monitor = next(c for c in trainer.callbacks if type(c).__name__ == "LearningRateMonitor")
        return {"last": dict(callback.metrics.last), "lr_names": sorted(monitor.lrs)}

    here = os.getcwd()
    os.chdir(out)  # Lightning's logs and checkpoints
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ddp = fit(gpt(), loader(), 1, tau=TAU, **OPT)
            whole = fit(gpt(), loader(), 2, fsdp2=True, tau=TAU, **OPT)
            first = fit(gpt(), loader(), 1, fsdp2=True, tau=TAU, **OPT)
            ckpt = first.checkpoint_callback.best_model_path
            resumed = fit(gpt(seed=5), loader(), 2, fsdp2=True, ckpt_path=ckpt, tau=TAU, **OPT)
    finally:
        os.chdir(here)
    return {
        "ddp": {**figures(ddp), "params": params(ddp.lightning_module.model)},
        "whole": {**figures(whole), "params": params(whole.lightning_module.model),
                  "state": opt_state(whole.optimizers[0])},
        "resumed": {"params": params(resumed.lightning_module.model), "state": opt_state(resumed.optimizers[0]),
                    "steps": resumed.optimizers[0].steps_taken},
    }


def case_fsdp1_refused(rank: int, world: int, out: Path) -> dict[str, Any]:
    """FSDP1 (FullyShardedDataParallel) with use_orig_params True and False: what param_groups and
    MuonClip say."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    from muonclip import MuonClip, param_groups

    messages = {}
    for orig in (True, False):
        model = FullyShardedDataParallel(gpt(), use_orig_params=orig, device_id=torch.device("cpu"))
        for what, build in (("param_groups", lambda m: param_groups(m)), ("MuonClip", lambda m: MuonClip(m))):
            try:
                got = build(model)
                routes = getattr(got, "routes", None)
                messages[(orig, what)] = ("accepted", [(r.name, r.algorithm, r.reason) for r in routes or []])
            except Exception as e:  # noqa: BLE001 - the message is the result
                messages[(orig, what)] = (type(e).__name__, str(e))
    return messages


CASES = [case_independent_models, case_late_fully_shard, case_accelerate_fsdp2, case_accelerate_ddp, case_lightning,
         case_fsdp1_refused]


def main(out: Path) -> None:
    torch.set_num_threads(1)
    os.environ["ACCELERATE_USE_CPU"] = "true"  # what `accelerate launch --cpu` sets: CPU processes, gloo
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    import muonclip  # noqa: F401  (registers the distributed engine)

    chosen = os.environ.get("WRAPPERS_CASES", "").split(",")
    results: dict[str, Any] = {}
    for case in CASES:
        if chosen != [""] and case.__name__ not in chosen:
            continue
        start = time.perf_counter()
        try:
            results[case.__name__] = case(rank, world, out)
        except Exception:  # noqa: BLE001 - reported by the test, with the traceback
            results[case.__name__] = {"error": traceback.format_exc()}
            print(f"rank {rank}: {case.__name__} failed\n{results[case.__name__]['error']}", file=sys.stderr, flush=True)
        print(f"rank {rank}: {case.__name__} {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        dist.barrier()
    torch.save(results, out / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
