"""The cases `tests/test_deepspeed.py` runs under DeepSpeed (gloo, 2 CPU ranks, one start-up for all)
and the one-process references they are compared with.

A case trains the reference GPT with GQA (3 query heads of 8 rows over 1 key head, so heads and
matrices straddle partition boundaries) for `STEPS` steps on the same global batches (each rank
its half), with `muonclip.Muon` or `muonclip.MuonClip` passed to ``deepspeed.initialize``, and
returns every weight (DeepSpeed's float32 master, gathered), the low-precision copy the model
computes with, and the heads clipped at each step.
"""

from __future__ import annotations

import os

import torch

import muonclip
from muonclip.models import GPT, GPTConfig

CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=3, n_kv_head=1, n_embd=24)
OPT = dict(lr=0.02, weight_decay=0.1, orth_dtype=torch.float32)
TAU = 0.033
STEPS = 3
BATCH = 4


def model(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**CFG))


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, CFG["vocab_size"], (BATCH, CFG["block_size"] + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def optimizer(kind: str, m: torch.nn.Module, **kw):
    if kind == "muon-normuon":
        return muonclip.Muon(muonclip.param_groups(m), normuon=True, **OPT, **kw)
    if kind == "muonclip":
        return muonclip.MuonClip(m, tau=TAU, **OPT, **kw)
    return muonclip.Muon(muonclip.param_groups(m), **OPT, **kw)


def reference(kind: str, steps: int = STEPS, clip_norm: float = 0.0, world: int = 2) -> dict:
    """One plain process on the whole global batches: the weights and the heads clipped per step.

    Each step's gradient is accumulated over the ``world`` ranks' rows, one micro-batch each, every
    loss halved: the gradient of the global batch, summed in the order DeepSpeed's average sums it
    (float32 Newton–Schulz multiplies the noise of another order several hundredfold in a matrix's
    smallest singular directions)."""
    m = model()
    opt = optimizer(kind, m, process_group="local")
    clipped = []
    n = BATCH // world
    for s in range(steps):
        x, y = batch(s)
        for r in range(world):
            _, loss = m(x[r * n:(r + 1) * n], y[r * n:(r + 1) * n])
            (loss / world).backward()
        if clip_norm:
            torch.nn.utils.clip_grad_norm_(m.parameters(), clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        clipped.append({k: v.clone() for k, v in getattr(opt, "last_clipped", {}).items()})
    return {"weights": {n: p.detach().clone() for n, p in m.named_parameters()}, "clipped": clipped}


def ds_config(stage: int, dtype: str = "fp32", clipping: float | None = 0.0, **zero) -> dict:
    cfg = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH // 2,
           "zero_optimization": {"stage": stage, **zero}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**9}
    if clipping is not None:
        cfg["gradient_clipping"] = clipping
    if dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def full_weights(engine) -> tuple[dict, dict]:
    """Every weight: DeepSpeed's float32 master (gathered) and the copy the model computes with."""
    from deepspeed.utils import safe_get_full_fp32_param

    master, live = {}, {}
    stage = engine.zero_optimization_stage()
    for n, p in engine.module.named_parameters():
        master[n] = (safe_get_full_fp32_param(p) if stage > 0 else p.detach()).float().clone()
        if stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters([p]):
                live[n] = p.detach().clone()
        else:
            live[n] = p.detach().clone()
    return master, live


def run_case(rank: int, world: int, kind: str, cfg: dict, steps: int = STEPS) -> dict:
    """One DeepSpeed run of ``kind`` on ``cfg``; the weights and the heads clipped per step."""
    import deepspeed

    m = model()
    opt = optimizer(kind, m)
    engine, _, _, _ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
    n = BATCH // world
    clipped = []
    for s in range(steps):
        x, y = batch(s)
        _, loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
        clipped.append({k: v.clone() for k, v in getattr(opt, "last_clipped", {}).items()})
    master, live = full_weights(engine)
    return {"weights": master, "live": live, "clipped": clipped, "steps_taken": opt.steps_taken}


def run_resume(rank: int, world: int, kind: str, cfg: dict, folder: str) -> dict:
    """Two steps, ``engine.save_checkpoint``, one step more; then a fresh engine that loads the
    checkpoint and takes that step: both weights, optimizer counters and tau."""
    import deepspeed

    n = BATCH // world
    out = {}
    for phase in ("straight", "resumed"):
        m = model(seed=1 if phase == "resumed" else 0)  # the resumed run starts elsewhere: the load must restore
        opt = optimizer(kind, m)
        if phase == "resumed" and kind == "muonclip":
            opt.tau = 7.0
        engine, _, _, _ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
        start = 0
        if phase == "straight":
            for s in range(2):
                x, y = batch(s)
                _, loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
                engine.backward(loss)
                engine.step()
            engine.save_checkpoint(folder, tag="t2")
        else:
            engine.load_checkpoint(folder, tag="t2")
        start = 2
        x, y = batch(start)
        _, loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        engine.backward(loss)
        engine.step()
        master, live = full_weights(engine)
        out[phase] = {"weights": master, "live": live, "steps_taken": opt.steps_taken,
                      "tau": getattr(opt, "tau", None)}
    return out


def run_nonfinite(rank: int, world: int, kind: str, cfg: dict, on_nonfinite: str) -> dict:
    """One good step, then a step whose gradient is NaN in one element of the last param group's
    last weight only (the groups before it are clean): the error (if any), whether any master
    weight changed in that step, and the optimizer's counters."""
    import deepspeed

    m = model()
    opt = optimizer(kind, m, on_nonfinite=on_nonfinite)
    poisoned = opt.param_groups[-1]["params"][-1]
    engine, _, _, _ = deepspeed.initialize(model=m, optimizer=opt, config=cfg)
    n = BATCH // world
    error, before = None, None
    for s in range(2):
        x, y = batch(s)
        hook = poisoned.register_hook(lambda g: g.flatten().index_fill(0, torch.tensor([0]), float("nan"))
                                      .view_as(g)) if s == 1 else None
        _, loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
        engine.backward(loss)
        if hook is not None:
            hook.remove()
            before = full_weights(engine)[0]
        try:
            engine.step()
        except Exception as e:  # noqa: BLE001  (every rank meets the same verdict)
            error = f"{type(e).__name__}: {e}"
    after = full_weights(engine)[0]
    return {"error": None, "raised": error, "changed": sorted(k for k in after if not torch.equal(after[k], before[k])),
            "steps_taken": opt.steps_taken, "steps_skipped": opt.steps_skipped}


def run_unattached(rank: int, world: int) -> dict:
    """ZeRO-2: the optimizer stepped directly (not from DeepSpeed's ZeRO optimizer) while its
    groups hold DeepSpeed's partitions: the error; then `attach` and one step through the engine."""
    import deepspeed

    from muonclip.integrations.deepspeed import attach

    m = model()
    opt = optimizer("muon", m)
    engine, _, _, _ = deepspeed.initialize(model=m, optimizer=opt, config=ds_config(2))
    n = BATCH // world
    x, y = batch(0)
    _, loss = engine(x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n])
    engine.backward(loss)
    try:
        opt.step()
        error = None
    except ValueError as e:
        error = str(e)
    driver = attach(engine)
    engine.step()
    return {"raised": error, "attached": type(driver).__name__, "same": attach(engine) is driver,
            "steps_taken": opt.steps_taken}


def run_all(rank: int, world: int, cases: dict, resumes: dict, folder: str, out: str,
            nonfinite: dict | None = None, hf: list[str] | None = None) -> None:
    """`run_case` for every case, the docs' recipe, every resume case, every `run_nonfinite` case,
    `run_unattached` and the Hugging Face cases ``hf`` (``"trainer-<stage>"``,
    ``"accelerate-<stage>"``: `deepspeed_hf_worker`); rank 0 saves ``{"cases", "resumes",
    "nonfinite", "hf"}`` to ``out``."""
    results, resumed = {}, {}
    for name, (kind, cfg) in cases.items():
        try:
            results[name] = run_case(rank, world, kind, cfg)
        except Exception as e:  # noqa: BLE001  (the test reports it; every rank meets the same error)
            results[name] = {"error": f"{type(e).__name__}: {e}"}
    from doc_recipes import recipe

    n = BATCH // world
    batches = [tuple(t[rank * n:(rank + 1) * n] for t in batch(s)) for s in range(STEPS)]
    try:
        engine, opt = recipe("deepspeed")["train"](model(), batches, ds_config(2), tau=TAU, **OPT)
        master, live = full_weights(engine)
        results["recipe-2"] = {"weights": master, "live": live, "steps_taken": opt.steps_taken, "clipped": []}
    except Exception as e:  # noqa: BLE001
        results["recipe-2"] = {"error": f"{type(e).__name__}: {e}"}
    for name, (kind, cfg) in resumes.items():
        try:
            resumed[name] = run_resume(rank, world, kind, cfg, f"{folder}/{name}")
        except Exception as e:  # noqa: BLE001
            resumed[name] = {"error": f"{type(e).__name__}: {e}"}
    bad = {}
    for name, (kind, cfg, mode) in (nonfinite or {}).items():
        try:
            bad[name] = run_nonfinite(rank, world, kind, cfg, mode)
        except Exception as e:  # noqa: BLE001
            bad[name] = {"error": f"{type(e).__name__}: {e}"}
    try:
        bad["unattached"] = run_unattached(rank, world)
    except Exception as e:  # noqa: BLE001
        bad["unattached"] = {"error": f"{type(e).__name__}: {e}"}
    front = {}
    for name in hf or ():
        import deepspeed_hf_worker

        kind, stage = name.split("-")
        try:
            front[name] = (deepspeed_hf_worker.run_trainer(rank, world, int(stage), f"{folder}/{name}")
                           if kind == "trainer" else deepspeed_hf_worker.run_accelerate(rank, world, int(stage)))
        except Exception as e:  # noqa: BLE001
            front[name] = {"error": f"{type(e).__name__}: {e}"}
    if rank == 0:
        import deepspeed_harness

        buffers = [b.name for b in deepspeed_harness.shared_buffers(int(os.environ["MASTER_PORT"]))]
        torch.save({"cases": results, "resumes": resumed, "nonfinite": bad, "hf": front, "buffers": buffers}, out)
