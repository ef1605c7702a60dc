"""MuonClip under torchtitan's pipeline parallelism on CPU: its stages as its trainer builds them (``pipelining_fn``:
split, parallelise each part with FSDP2 / tensor / expert parallelism, the schedule), stepped as its trainer steps
them (``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=..., loss_kwargs=...)``, then our
container), on gloo ranks, against one process.

Every run starts from one DCP checkpoint of the weights (q and k scaled so that tau = 1 clips some heads and not
others), loaded into each run as torchtitan loads it (``ModelWrapper`` over the run's model parts). Each data-parallel
rank's rows go through the pipeline in micro-batches of one row; the reference runs every row as one micro-batch in
one process, unparallelised. Figures: max |run - reference| over the weights Muon updates, relative to the largest
movement of any weight, <= 1e-5 (float32 Newton-Schulz; <= 1e-4 over every weight, AdamW's included:
tests/test_torchtitan.py, ADAMW_REL), and the same max logits and heads clipped at every step, the layers of every
stage merged.

Two launches: 2 ranks (PP=2: every schedule torchtitan offers, the interleaved and V ones with two model parts per
rank; a validation pass between steps; DCP save and resume; deepseek_v3 shrunk, MLA + MoE; the non-pipelined runs
the 4-rank launch loads or compares with) and 4 ranks (PP=2 x FSDP2=2 with 1F1B and Interleaved1F1B, PP=2 x TP=2,
deepseek_v3 PP=2 x EP=2, checkpoints across PP=2 and PP=1, and the groups that are refused).

* each rank's optimizer steps on its stage's ranks only: the Muon step's group is one rank under PP=2 and the two
  FSDP2 ranks of the stage under PP=2 x FSDP2=2; the two stages' Newton-Schulz flops add up to the whole model's,
  split between each stage's ranks (owners balanced per stage).
* deepseek_v3 with expert parallelism equals the same expert-parallel run without the pipeline (expert parallelism
  regroups the tokens of each expert, whose rounding Newton-Schulz amplifies on the experts' few-token gradients:
  7e-5 of the movement against one process, pipelined or not).
* a group that misses a rank holding a piece of the stage's weights, and the automatic group (the mesh, which spans
  both stages), are refused with the stage's group named.

One process: torch schedules without torchtitan's micro-batch call or the shape-inference hook are refused, and
zero-bubble schedules with selective activation checkpointing before anything is built; forwards inside
``unrecorded_forward`` feed no recorder.

Skipped when the torchtitan extra is not installed (CI installs it).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed (pip install 'muonclip[torchtitan]')")

sys.path.insert(0, os.path.dirname(__file__))
import torchtitan_harness as H  # noqa: E402
from test_distributed import _launch  # noqa: E402
from test_torchtitan import _assert_equal_one_process, _same_clips  # noqa: E402

from muonclip.integrations.torchtitan_pipeline import split_backward  # noqa: E402

SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
STEPS, SAVE_AT, TAU, ROWS = 2, 1, 1.0, 4
EVAL_BATCH = 99


def _llama(schedule="1F1B", dp=1, tp=1, name="MuonClip"):
    """llama shrunk (2 layers) under PP=2; zero-bubble schedules without activation checkpointing (refused with
    torchtitan's selective checkpointing)."""
    cfg = H.trainer_config(H.tiny_llama(), dp=dp, tp=tp, tau=TAU, name=name)
    return H.pipeline_config(cfg, schedule=schedule, rows=ROWS // dp, ac=not split_backward(schedule))


def _deepseek(dp=1, ep=1, pp=True):
    cfg = H.deepseek_config(H.tiny_deepseek(), dp=dp, tau=TAU)
    cfg.parallelism.expert_parallel_degree = ep
    return H.pipeline_config(cfg, rows=ROWS // dp) if pp else cfg


def _pipeline(cfg, world, start):
    pipe = H.build_pipeline(cfg, world)
    H.load_model(pipe.parts, start)
    return pipe, cfg.optimizer.build(model_parts=pipe.parts)


def _result(parts, opt, log, **more):
    params: dict = {}
    for p in parts:
        params.update(H.canonical_params(p))
    stats = opt.optimizers[0].last_step_stats
    return {"params": params, "log": log, "stats": (stats.world_size, stats.ns_flops, stats.total_ns_flops), **more}


def _validate(pipe):
    """A validation pass as torchtitan's validator runs one between steps: parts in eval mode, no grad,
    ``schedule.eval(...)``; the last stage's per-micro-batch summed losses."""
    x, y = H.batch(EVAL_BATCH)
    for m in pipe.parts:
        m.eval()
    losses = [] if pipe.last else None
    with torch.no_grad():
        pipe.schedule.eval(arg_mbs=[(xm,) for xm in x.split(1)] if pipe.first else None,
                           kwarg_mbs=[{} for _ in range(ROWS)], target_mbs=list(y.split(1)) if pipe.last else None,
                           losses=losses)
    for m in pipe.parts:
        m.train()
    return None if losses is None else torch.stack(losses).detach()


def _non_pipelined(cfg, world, start, steps, *, part, parts, path=None):
    """The run without pipelining (FSDP2 / TP / EP meshes), each rank's rows in micro-batches of one row; saved
    to ``path`` after ``steps`` steps."""
    model = H.build(cfg, world, "")
    H.load_model([model], start)
    opt = cfg.optimizer.build(model_parts=[model])
    log: list = []
    H.train(model, opt, steps, part=part, parts=parts, log=log, micro=ROWS // parts)
    if path is not None:
        H.save(path, [model], opt)
    return _result([model], opt, log)


def _worker2(rank, world, out_dir):
    os.environ.update(LOCAL_RANK=str(rank))
    llama, deepseek = os.path.join(out_dir, "start_llama"), os.path.join(out_dir, "start_deepseek")
    out: dict = {}
    for schedule in SCHEDULES:
        pipe, opt = _pipeline(_llama(schedule), world, llama)
        log: list = []
        if schedule == "1F1B":  # a checkpoint and a validation pass after the first step
            H.train_pipeline(pipe, opt, SAVE_AT, log=log)
            H.save(os.path.join(out_dir, "ckpt_pp2"), pipe.parts, opt)
            out["eval"] = _validate(pipe)
            H.train_pipeline(pipe, opt, STEPS - SAVE_AT, start=SAVE_AT, log=log)
        else:
            H.train_pipeline(pipe, opt, STEPS, log=log)
        out[schedule] = _result(pipe.parts, opt, log, stages=opt.stage.stages)
    cfg = _llama()  # resume from the checkpoint: a fresh model and optimizer
    pipe = H.build_pipeline(cfg, world)
    opt = cfg.optimizer.build(model_parts=pipe.parts)
    H.load(os.path.join(out_dir, "ckpt_pp2"), pipe.parts, opt)
    log = []
    H.train_pipeline(pipe, opt, STEPS - SAVE_AT, start=SAVE_AT, log=log)
    out["resumed"] = _result(pipe.parts, opt, log)
    out["fsdp"] = _non_pipelined(H.trainer_config(H.tiny_llama(), dp=2, tau=TAU), world, llama, SAVE_AT, part=rank,
                                 parts=2, path=os.path.join(out_dir, "ckpt_fsdp"))
    pipe, opt = _pipeline(_deepseek(), world, deepseek)
    log = []
    H.train_pipeline(pipe, opt, STEPS, log=log)
    out["deepseek"] = _result(pipe.parts, opt, log)
    out["deepseek_ep"] = _non_pipelined(_deepseek(dp=2, ep=2, pp=False), world, deepseek, STEPS, part=rank, parts=2)
    torch.save(out, os.path.join(out_dir, f"two{rank}.pt"))


def _refusals(world, llama):
    """A Muon over one stage's block matrices with a group that misses the stage's other FSDP2 rank, and with the
    automatic group (the mesh, over both stages): both refused, on every rank."""
    import torch.distributed as dist

    from muonclip import Muon

    pipe, _ = _pipeline(_llama(dp=2), world, llama)
    blocks = [p for part in pipe.parts for n, p in part.named_parameters() if ".attention." in n or ".feed_forward." in n]
    alone, _ = dist.new_subgroups_by_enumeration([[r] for r in range(world)])
    found = []
    for group in (alone, None):
        opt = Muon([{"params": blocks}], lr=0.02, process_group=group)
        for p in blocks:
            p.grad = torch.ones_like(p)
        try:
            opt.step()
            found.append(None)
        except ValueError as e:
            found.append(str(e))
    return found


def _worker4(rank, world, out_dir):
    os.environ.update(LOCAL_RANK=str(rank))
    llama, deepseek = os.path.join(out_dir, "start_llama"), os.path.join(out_dir, "start_deepseek")
    dp = rank % 2  # torchtitan's meshes put "pp" outermost: ranks 0, 1 hold stage 0, ranks 2, 3 stage 1
    out: dict = {}
    for schedule in ("1F1B", "Interleaved1F1B"):
        pipe, opt = _pipeline(_llama(schedule, dp=2), world, llama)
        log: list = []
        H.train_pipeline(pipe, opt, STEPS, part=dp, parts=2, log=log)
        out[f"fsdp_{schedule}"] = _result(pipe.parts, opt, log)
    pipe, opt = _pipeline(_llama(tp=2), world, llama)
    log = []
    H.train_pipeline(pipe, opt, STEPS, log=log)
    out["tp"] = _result(pipe.parts, opt, log)
    pipe, opt = _pipeline(_deepseek(dp=2, ep=2), world, deepseek)
    log = []
    H.train_pipeline(pipe, opt, STEPS, part=dp, parts=2, log=log)
    out["deepseek_ep"] = _result(pipe.parts, opt, log)
    # the PP=1 (FSDP2) checkpoint continued under PP=2 x FSDP2=2, the PP=2 one under PP=1 (FSDP2 x TP)
    cfg = _llama(dp=2)
    pipe = H.build_pipeline(cfg, world)
    opt = cfg.optimizer.build(model_parts=pipe.parts)
    H.load(os.path.join(out_dir, "ckpt_fsdp"), pipe.parts, opt)
    log = []
    H.train_pipeline(pipe, opt, STEPS - SAVE_AT, start=SAVE_AT, part=dp, parts=2, log=log)
    out["from_pp1"] = _result(pipe.parts, opt, log)
    cfg = H.trainer_config(H.tiny_llama(), dp=2, tp=2, tau=TAU)
    model = H.build(cfg, world, "")
    opt = cfg.optimizer.build(model_parts=[model])
    H.load(os.path.join(out_dir, "ckpt_pp2"), [model], opt)
    log = []
    H.train(model, opt, STEPS - SAVE_AT, start=SAVE_AT, part=rank // 2, parts=2, log=log, micro=2)
    out["from_pp2"] = _result([model], opt, log)
    out["refused"] = _refusals(world, llama)
    torch.save(out, os.path.join(out_dir, f"four{rank}.pt"))


def _reference(cfg, start, steps, *, evaluate=False):
    """One process, unparallelised, every row its own micro-batch; with ``evaluate`` the summed loss of each row
    of the validation batch after step `SAVE_AT`."""
    model = H.build(cfg, 1, "", parallel=False)
    H.load_model([model], start)
    opt = cfg.optimizer.build(model_parts=[model])
    log: list = []
    H.train(model, opt, SAVE_AT, log=log, micro=ROWS)
    out = {}
    if evaluate:
        x, y = H.batch(EVAL_BATCH)
        model.eval()
        with torch.no_grad():
            out["eval"] = torch.stack([torch.nn.functional.cross_entropy(model(xm).flatten(0, 1), ym.flatten(),
                                                                         reduction="sum") for xm, ym in
                                       zip(x.split(1), y.split(1))])
        model.train()
    H.train(model, opt, steps - SAVE_AT, start=SAVE_AT, log=log, micro=ROWS)
    return {"params": H.canonical_params(model), "log": log, **out}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("torchtitan_pipeline")
    ref: dict = {}
    for kind, cfg in (("llama", H.trainer_config(H.tiny_llama(), tau=TAU)),
                      ("deepseek", H.deepseek_config(H.tiny_deepseek(), tau=TAU))):
        start = H.reference_start(cfg)
        H.save_start(cfg, start, out_dir / f"start_{kind}")
        ref[kind] = {"start": start, **_reference(cfg, out_dir / f"start_{kind}", STEPS, evaluate=kind == "llama")}
    _launch(_worker2, str(out_dir), world=2, limit_s=400)
    _launch(_worker4, str(out_dir), world=4, limit_s=500)
    two = [torch.load(out_dir / f"two{r}.pt", weights_only=False) for r in range(2)]
    four = [torch.load(out_dir / f"four{r}.pt", weights_only=False) for r in range(4)]
    return ref, two, four


def _equal(run, ref, what, start=None):
    _assert_equal_one_process(run["params"], ref["params"], start if start is not None else ref["start"], what)
    _same_clips(run["log"], ref["log"][len(ref["log"]) - len(run["log"]):])


def test_every_schedule_equals_one_process_and_clips_the_same_heads(runs):
    ref, two, _ = runs
    llama = ref["llama"]
    clipped = [sum(int(c.sum()) for _, c in step.values()) for step in llama["log"]]
    assert all(clipped) and any(not c.all() for step in llama["log"] for _, c in step.values())
    for schedule in SCHEDULES:
        run = H.merged([r[schedule] for r in two])
        _equal(run, llama, f"PP=2 {schedule}")
        parts = 2 if schedule in ("1F1B", "GPipe") else 4
        assert sorted(s for r in two for s in r[schedule]["stages"]) == list(range(parts))
    # the interleaved and V schedules give each rank two model parts: one optimizer steps both
    assert [r["Interleaved1F1B"]["stages"] for r in two] == [(0, 2), (1, 3)]
    assert [r["ZBVZeroBubble"]["stages"] for r in two] == [(0, 3), (1, 2)]
    # torchtitan's validation between the steps: its losses are one process's, and the next step clips as if
    # it had not run (the schedule's second shape inference, on its switch back to training, is not recorded)
    torch.testing.assert_close(two[1]["eval"], llama["eval"], rtol=1e-5, atol=0)
    assert two[0]["eval"] is None


def test_fsdp2_and_tensor_parallel_stages_equal_one_process(runs):
    ref, _, four = runs
    for key in ("fsdp_1F1B", "fsdp_Interleaved1F1B", "tp"):
        _equal(H.merged([r[key] for r in four]), ref["llama"], f"PP=2 x {key}")


def test_each_stage_steps_on_its_own_ranks_with_owners_balanced_per_stage(runs):
    _, two, four = runs
    assert [r["1F1B"]["stats"][0] for r in two] == [1, 1]  # one rank per stage: no collective
    whole = two[0]["fsdp"]["stats"][2]  # the non-pipelined FSDP2 run's Newton-Schulz flops: the whole model
    stats = [r["fsdp_1F1B"]["stats"] for r in four]
    assert all(world == 2 for world, _, _ in stats)
    for stage in (stats[:2], stats[2:]):  # ranks 0, 1 and 2, 3: each stage's total split between its ranks
        assert stage[0][2] == stage[1][2] == stage[0][1] + stage[1][1] and min(stage[0][1], stage[1][1]) > 0
    assert stats[0][2] + stats[2][2] == whole
    for r in four:
        missing, automatic = r["refused"]
        assert "process_group holds" in missing and "the pieces on" in missing and "stage" in missing
        assert "lays out as holding the same piece" in automatic and "process_group=<the stage's" in automatic


def test_mla_moe_pipelined_equals_one_process_and_with_expert_parallel_the_same_run_unpipelined(runs):
    ref, two, four = runs
    deepseek = ref["deepseek"]
    assert any(c.any() for step in deepseek["log"] for _, c in step.values())
    _equal(H.merged([r["deepseek"] for r in two]), deepseek, "deepseek_v3 PP=2")
    unpipelined = dict(H.merged([r["deepseek_ep"] for r in two]), start=deepseek["start"])
    _equal(H.merged([r["deepseek_ep"] for r in four]), unpipelined, "deepseek_v3 PP=2 x EP=2 vs EP=2")


def test_dcp_resume_is_bit_identical_and_checkpoints_cross_between_pp2_and_pp1(runs):
    ref, two, four = runs
    whole, resumed = H.merged([r["1F1B"] for r in two]), H.merged([r["resumed"] for r in two])
    assert resumed["params"].keys() == whole["params"].keys()
    for k, v in whole["params"].items():
        assert torch.equal(resumed["params"][k], v), k
    _same_clips(resumed["log"], whole["log"][SAVE_AT:], tol=0)
    _equal(H.merged([r["from_pp1"] for r in four]), ref["llama"], "PP=1 checkpoint continued under PP=2 x FSDP2")
    _equal(H.merged([r["from_pp2"] for r in four]), ref["llama"], "PP=2 checkpoint continued under FSDP2 x TP")


# ------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------


class _WholeBatchSchedule:
    """A schedule of a torch whose step takes whole batches and which has no micro-batch loop or shape-inference hook."""

    def step(self, *args, target=None, losses=None, **kwargs):
        return None


def test_schedules_torchtitan_cannot_drive_or_keep_out_of_the_clip_are_refused():
    from muonclip.integrations.pipelining import unrecorded_shape_inference
    from muonclip.integrations.torchtitan_pipeline import MicrobatchSchedule, runnable

    with pytest.raises(ValueError, match=r"step\(arg_mbs=..., kwarg_mbs=...\).*_step_microbatches"):
        MicrobatchSchedule(_WholeBatchSchedule())
    with pytest.raises(ValueError, match="_initialize_pp_stages.*out of QK-Clip's max logits"):
        unrecorded_shape_inference(_WholeBatchSchedule())

    class Newer:  # a torch whose step takes torchtitan's micro-batch lists: used as it is
        def step(self, *, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None, loss_kwargs=None,
                 return_outputs=True):
            return None

    newer = Newer()
    assert runnable(newer) is newer


def test_zero_bubble_schedules_with_selective_checkpointing_are_refused_before_the_split():
    from torchtitan.config import ConfigManager

    cfg = ConfigManager().parse_args(["--module", "muonclip.integrations.torchtitan", "--config", "llama3_debugmodel",
                                      "--parallelism.pipeline_parallel_degree", "2",
                                      "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"])
    assert cfg.model_spec.pipelining_fn.muonclip_pipelining
    with pytest.raises(ValueError, match=r"ZBVZeroBubble splits each backward.*activation-checkpoint:full"):
        cfg.model_spec.pipelining_fn(None, parallel_dims=None, parallelism=cfg.parallelism,
                                     ac_config=cfg.activation_checkpoint)
    for name in ("InterleavedZeroBubble", "DualPipeV"):
        assert split_backward(name)
    assert not any(split_backward(n) for n in ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS"))


def test_forwards_inside_unrecorded_forward_feed_no_recorder():
    from muonclip.attention import MaxLogitMonitor, unrecorded_forward
    from muonclip.models import GPT, GPTConfig
    from muonclip.qkclip import discover_layers

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16)).train()
    layers = discover_layers(model)
    monitor = MaxLogitMonitor(layers)
    x = torch.randint(0, 32, (2, 8))
    with monitor, unrecorded_forward():
        model(x)
    assert layers[0].recorder.value is None and not monitor.max_logits
    model(x)
    assert layers[0].recorder.value is not None
