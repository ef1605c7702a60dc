"""muonclip.integrations.torchtitan on CPU: torchtitan's llama3 and deepseek_v3 (shrunk), built as its
trainer builds them (meta init, its parallelize function with FSDP2 / tensor parallel / selective
activation checkpointing, our container from its config), on gloo ranks, against one process.

Two launches, one per mesh shape (the suite's time budget): 2 ranks (FSDP2) and 4 ranks (FSDP2 x TP,
2 x 2). The reference runs in the test process, unparallelised, from the same weights and batches.

* FSDP2 and FSDP2 x TP, Muon and MuonClip: max |distributed - one process| relative to the largest
  movement of any weight <= 1e-5 for the weights Muon updates (float32 Newton-Schulz), <= 1e-4 for
  AdamW's (see ADAMW_REL); the same max logits and the same heads clipped. The reference runs each
  rank's rows as one micro-batch (every token meets the kernels it meets on its rank): FSDP2 alone
  then matches it bit for bit here.
* The exact clip on the fused ``wqkv`` (GQA, one process): clipped heads' max logits land on tau, every
  other row of ``wqkv`` (unclipped heads' q, every k and v) bit-identical.
* deepseek_v3 (MLA + MoE) under FSDP2 with MuonClip: the same as one process; the MLA clip by K2's rule
  (one process): clipped heads land on tau, V and the shared rotary key untouched.
* DCP through torchtitan's flat optimizer state dict: resuming on 2 ranks is bit-identical to not
  stopping; the 2-rank checkpoint loaded on 4 ranks (FSDP2 x TP) continues like one process.

* One process: model parts without their pipeline stage and torchtitan's unused optimizer fields refused (the
  latter not on the command line); a Muon rate carried over from torchtitan's AdamW config is logged with what was
  measured, a chosen one is not.

Skipped when the torchtitan extra is not installed (CI installs it).
"""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed (pip install 'muonclip[torchtitan]')")

sys.path.insert(0, os.path.dirname(__file__))
import torchtitan_harness as H  # noqa: E402
from test_distributed import _launch  # noqa: E402

REL = 1e-5
# AdamW divides each entry by its own gradient RMS, so an entry whose gradient is a near-cancelling
# sum carries the reduction-order rounding of tensor parallelism (the norms' gradients are summed
# over the sequence shards of the TP ranks) into its update unscaled: up to 1.7e-5 measured on
# FSDP2 x TP (llama, 2 steps); Muon's matrices stay within REL.
ADAMW_REL = 1e-4
STEPS = 2
SAVE_AT = 1  # the checkpoint: after this step; the runs go on to STEPS
TAU = 1.0


def _rel(got: dict, ref: dict, start: dict, keys=None) -> float:
    """max |got - ref| over ``keys`` (default all) relative to the largest movement of any weight."""
    move = max((ref[k] - start[k]).abs().max().item() for k in ref)
    return max((got[k] - ref[k]).abs().max().item() for k in (keys or ref)) / move


def _muon_keys(params: dict) -> list[str]:
    """The weights Muon updates (matrices and expert stacks, not the embedding and the head)."""
    return [k for k, v in params.items() if v.ndim >= 2 and not k.startswith(("tok_embeddings", "lm_head"))]


def _assert_equal_one_process(got: dict, ref: dict, start: dict, what: str) -> None:
    """Muon's weights within REL of one process; AdamW's (embedding, head, norms) within ADAMW_REL."""
    rel, rel_all = _rel(got, ref, start, _muon_keys(ref)), _rel(got, ref, start)
    print(f"{what}: max diff / max movement = {rel:.2g} (Muon weights), {rel_all:.2g} (all)")
    assert rel <= REL and rel_all <= ADAMW_REL


def _same_clips(log, ref, tol=1e-5):
    assert len(log) == len(ref)
    for got, want in zip(log, ref):
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name][0], want[name][0], rtol=tol, atol=0)
            assert torch.equal(got[name][1], want[name][1]), name


def _save(path, model, opt):
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    dcp.save({"model": ModelWrapper(model).state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=path)


def _load(path, model, opt):
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    wrapper = ModelWrapper(model)
    state = {"model": wrapper.state_dict(), "optimizer": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    wrapper.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def _run(cfg, world, start, steps, *, part, parts, log=None, begin=0, model_opt=None):
    model, opt = model_opt or (None, None)
    if model is None:
        model = H.build(cfg, world, "")
        H.load_params(model, start)
        opt = cfg.optimizer.build(model_parts=[model])
    H.train(model, opt, steps, part=part, parts=parts, start=begin, log=log)
    return model, opt


def _worker2(rank, world, out_dir, starts):
    os.environ.update(LOCAL_RANK=str(rank))
    out = {}
    llama, deepseek = starts["llama"], starts["deepseek"]
    _, opt = m_o = _run(H.trainer_config(H.tiny_llama(), dp=2, name="Muon"), world, llama, STEPS, part=rank, parts=2)
    out["muon"] = H.canonical_params(m_o[0])
    cfg = H.trainer_config(H.tiny_llama(), dp=2, tau=TAU)
    log: list = []
    model, opt = _run(cfg, world, llama, SAVE_AT, part=rank, parts=2, log=log)
    _save(os.path.join(out_dir, "ckpt"), model, opt)
    _run(cfg, world, llama, STEPS - SAVE_AT, part=rank, parts=2, log=log, begin=SAVE_AT, model_opt=(model, opt))
    out["clip"] = {"params": H.canonical_params(model), "log": log}
    # resume on 2 ranks from the checkpoint: a fresh model (other weights) and optimizer
    cfg = H.trainer_config(H.tiny_llama(), dp=2, tau=TAU)
    model = H.build(cfg, world, "")
    opt = cfg.optimizer.build(model_parts=[model])
    with warnings.catch_warnings(record=True) as caught:  # torchtitan's zero-gradient warm-up runs here
        warnings.simplefilter("always")
        _load(os.path.join(out_dir, "ckpt"), model, opt)
    log = []
    H.train(model, opt, STEPS - SAVE_AT, part=rank, parts=2, start=SAVE_AT, log=log)
    out["resumed"] = {"params": H.canonical_params(model), "log": log,
                      "warnings": [str(w.message) for w in caught if "MuonClip" in str(w.message)]}
    log = []
    model, _ = _run(H.deepseek_config(H.tiny_deepseek(), dp=2, tau=TAU), world, deepseek, STEPS, part=rank, parts=2,
                    log=log)
    out["deepseek"] = {"params": H.canonical_params(model), "log": log}
    torch.save(out, os.path.join(out_dir, f"two{rank}.pt"))


def _worker4(rank, world, out_dir, starts):
    os.environ.update(LOCAL_RANK=str(rank))
    out = {}
    llama = starts["llama"]
    dp = rank // 2
    model, _ = _run(H.trainer_config(H.tiny_llama(), dp=2, tp=2, name="Muon"), world, llama, STEPS, part=dp, parts=2)
    out["muon"] = H.canonical_params(model)
    log: list = []
    cfg = H.trainer_config(H.tiny_llama(), dp=2, tp=2, tau=TAU)
    model, opt = _run(cfg, world, llama, STEPS, part=dp, parts=2, log=log)
    out["clip"] = {"params": H.canonical_params(model), "log": log,
                   "heads": [(m.muonclip_recorder.heads.start, m.muonclip_recorder.heads.stop) for m in model.modules()
                             if hasattr(m, "muonclip_recorder")]}
    # the 2-rank FSDP2 checkpoint, resharded onto FSDP2 x TP, continues
    cfg = H.trainer_config(H.tiny_llama(), dp=2, tp=2, tau=TAU)
    model = H.build(cfg, world, "")
    opt = cfg.optimizer.build(model_parts=[model])
    _load(os.path.join(out_dir, "ckpt"), model, opt)
    log = []
    H.train(model, opt, STEPS - SAVE_AT, part=dp, parts=2, start=SAVE_AT, log=log)
    out["resharded"] = {"params": H.canonical_params(model), "log": log}
    torch.save(out, os.path.join(out_dir, f"four{rank}.pt"))


def _reference(cfg, start, steps, log=None, begin=0):
    """One process, unparallelised, each data-parallel rank's rows as one micro-batch."""
    model = H.build(cfg, 1, "", parallel=False)
    H.load_params(model, start)
    opt = cfg.optimizer.build(model_parts=[model])
    H.train(model, opt, steps, start=begin, log=log, micro=2)
    return model, opt


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("torchtitan")
    starts = {"llama": H.reference_start(H.trainer_config(H.tiny_llama())),
              "deepseek": H.reference_start(H.deepseek_config(H.tiny_deepseek()))}
    ref: dict = {"start": starts}
    model, _ = _reference(H.trainer_config(H.tiny_llama(), name="Muon"), starts["llama"], STEPS)
    ref["muon"] = H.canonical_params(model)
    log: list = []
    model, _ = _reference(H.trainer_config(H.tiny_llama(), tau=TAU), starts["llama"], STEPS, log)
    ref["clip"] = {"params": H.canonical_params(model), "log": log}
    log = []
    model, _ = _reference(H.deepseek_config(H.tiny_deepseek(), tau=TAU), starts["deepseek"], STEPS, log)
    ref["deepseek"] = {"params": H.canonical_params(model), "log": log}
    _launch(_worker2, str(out_dir), starts, world=2, limit_s=400)
    _launch(_worker4, str(out_dir), starts, world=4, limit_s=400)
    two = [torch.load(out_dir / f"two{r}.pt", weights_only=False) for r in range(2)]
    four = [torch.load(out_dir / f"four{r}.pt", weights_only=False) for r in range(4)]
    return ref, two, four


def test_fsdp2_and_fsdp2_x_tp_muon_equal_one_process(runs):
    ref, two, four = runs
    for r in two + four:
        _assert_equal_one_process(r["muon"], ref["muon"], ref["start"]["llama"], "Muon")


def test_fsdp2_and_fsdp2_x_tp_muonclip_equal_one_process_and_clip_the_same_heads(runs):
    ref, two, four = runs
    n_clipped = [sum(int(c.sum()) for _, c in step.values()) for step in ref["clip"]["log"]]
    assert sum(n_clipped) > 0 and any(not c.all() for step in ref["clip"]["log"] for _, c in step.values())
    for r in two + four:
        _assert_equal_one_process(r["clip"]["params"], ref["clip"]["params"], ref["start"]["llama"], "MuonClip")
        _same_clips(r["clip"]["log"], ref["clip"]["log"])
    # tensor parallel: each rank records the two heads of its key/value group (4 heads, 2 groups, tp 2)
    for rank, r in enumerate(four):
        assert r["clip"]["heads"] == [(2 * (rank % 2), 2 * (rank % 2) + 2)] * 2


def test_deepseek_v3_mla_moe_under_fsdp2_equals_one_process(runs):
    ref, two, _ = runs
    assert any(c.any() for step in ref["deepseek"]["log"] for _, c in step.values())
    for r in two:
        _assert_equal_one_process(r["deepseek"]["params"], ref["deepseek"]["params"], ref["start"]["deepseek"],
                                  "deepseek_v3")
        _same_clips(r["deepseek"]["log"], ref["deepseek"]["log"])


def test_dcp_resume_is_bit_identical_and_resharding_2_to_4_ranks_continues(runs):
    ref, two, four = runs
    for r in two:
        assert r["resumed"]["warnings"] == []
        assert r["resumed"]["params"].keys() == r["clip"]["params"].keys()
        for k, v in r["clip"]["params"].items():
            assert torch.equal(r["resumed"]["params"][k], v), k
        _same_clips(r["resumed"]["log"], r["clip"]["log"][SAVE_AT:], tol=0)
    for r in four:
        _assert_equal_one_process(r["resharded"]["params"], ref["clip"]["params"], ref["start"]["llama"],
                                  "resharded 2 -> 4 ranks")
        _same_clips(r["resharded"]["log"], ref["clip"]["log"][SAVE_AT:])


# ------------------------------------------------------------------------------------------
# one process: the exact clip on the fused wqkv (GQA) and on MLA, the layouts' refusals
# ------------------------------------------------------------------------------------------


def _record(model, x):
    for m in model.modules():
        if getattr(m, "muonclip_recorder", None) is not None:
            m.muonclip_recorder.reset()
    model(x)
    return {m: m.muonclip_recorder.value.clone() for m in model.modules() if getattr(m, "muonclip_recorder", None)}


def _exact_clip(cfg, start):
    """Record on a batch, clip alone (no update), record again on the same batch."""
    from muonclip.attention import set_max_logit_backend

    model = H.build(cfg, 1, "", parallel=False)
    H.load_params(model, start)
    opt = cfg.optimizer.build(model_parts=[model]).optimizers[0]
    x, _ = H.batch(0)
    set_max_logit_backend("chunked")  # exact maxima for every head, below tau too
    try:
        before = _record(model, x)
        opt.clip()
        clipped = {k: v.clone() for k, v in opt.last_clipped.items()}
        after = _record(model, x)
    finally:
        set_max_logit_backend("gated")
    return model, before, after, clipped


def _first_layer_lands_on_tau(before, after, clipped):
    """Layer 0's maxima after the clip, on the same batch: tau for clipped heads, unchanged for the
    others (later layers' inputs change with the clip of the layers before them)."""
    b, a, c = next(iter(before.values())), next(iter(after.values())), next(iter(clipped.values()))
    assert c.any() and not c.all()
    torch.testing.assert_close(a[c], torch.full_like(a[c], TAU), rtol=2e-6, atol=0)
    assert torch.equal(a[~c], b[~c])


def test_the_clip_on_fused_wqkv_lands_clipped_heads_on_tau_and_leaves_the_rest_bit_identical():
    cfg = H.trainer_config(H.tiny_llama(), tau=TAU)
    start = H.reference_start(cfg)
    model, before, after, clipped = _exact_clip(cfg, start)
    assert sum(int(c.sum()) for c in clipped.values()) > 0 and not all(c.all() for c in clipped.values())
    _first_layer_lands_on_tau(before, after, clipped)
    end = H.canonical_params(model)
    hd, hq, hkv = 8, 4, 2
    for layer, name in enumerate(clipped):
        w0 = start[f"layers.{layer}.attention.qkv_linear.wqkv.weight"].view(hkv, hq // hkv + 2, hd, -1)
        w1 = end[f"layers.{layer}.attention.qkv_linear.wqkv.weight"].view(hkv, hq // hkv + 2, hd, -1)
        c = clipped[name].view(hkv, hq // hkv)
        assert torch.equal(w1[:, 2:], w0[:, 2:])  # every k and v row
        assert torch.equal(w1[:, :2][~c], w0[:, :2][~c])  # unclipped heads' q rows
        assert not torch.equal(w1[:, :2][c], w0[:, :2][c])
    for k in end:
        if "wqkv" not in k:
            assert torch.equal(end[k], start[k]), k


def test_the_mla_clip_follows_k2s_rule():
    cfg = H.deepseek_config(H.tiny_deepseek(), tau=TAU)
    start = H.reference_start(cfg)
    model, before, after, clipped = _exact_clip(cfg, start)
    assert sum(int(c.sum()) for c in clipped.values()) > 0
    _first_layer_lands_on_tau(before, after, clipped)
    end = H.canonical_params(model)
    nope, rope, v = 8, 4, 8
    for layer, name in enumerate(clipped):
        kv0 = start[f"layers.{layer}.attention.wkv_b.weight"].view(4, nope + v, -1)
        kv1 = end[f"layers.{layer}.attention.wkv_b.weight"].view(4, nope + v, -1)
        assert torch.equal(kv1[:, nope:], kv0[:, nope:])  # V rows
        q0 = start[f"layers.{layer}.attention.wq.weight"].view(4, nope + rope, -1)
        q1 = end[f"layers.{layer}.attention.wq.weight"].view(4, nope + rope, -1)
        c = clipped[name]
        gamma = (q1[c, nope:] / q0[c, nope:]).flatten(1).median(dim=1).values  # q^R scaled by gamma
        root = (q1[c, :nope] / q0[c, :nope]).flatten(1).median(dim=1).values  # q^C by sqrt(gamma)
        torch.testing.assert_close(root, gamma.sqrt(), rtol=1e-5, atol=0)
        assert torch.equal(q1[~c], q0[~c])
    assert torch.equal(end["layers.0.attention.wkv_a.weight"], start["layers.0.attention.wkv_a.weight"])  # k^R


def test_torchtitans_zero_gradient_warm_up_does_not_make_muonclip_warn():
    """torchtitan (like torch.distributed.checkpoint, under Lightning and accelerate) materialises
    optimizer state with a zero-gradient, zero-lr step before a checkpoint is read or written; that
    step records nothing, and a step with every lr 0 does not warn. The container's state dict neither."""
    from torchtitan.components.optimizer.utils import init_optim_state

    cfg = H.trainer_config(H.tiny_llama(), tau=TAU)

    def fresh():
        return cfg.optimizer.build(model_parts=[H.build(cfg, 1, "", parallel=False)])

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="MuonClip")
        init_optim_state(fresh().optimizers[0])  # what torchtitan's own container runs
        sd = fresh().state_dict()
    assert any(k.startswith("state.layers.0.attention.qkv_linear.wqkv.weight.") for k in sd)  # canonical keys
    assert not any("_checkpoint_wrapped_module" in k for k in sd)


def test_muon_sees_the_fused_wqkv_as_its_maps_and_per_head_as_its_heads():
    """`muon_splits` cuts llama's fused wqkv per key/value group into [q heads | k | v] (per head: each head its
    own block) and, per head, MLA's wq and wkv_b; the container builds and steps with either."""
    from muonclip.integrations.torchtitan_layouts import muon_splits

    for per_head in (False, True):
        cfg = H.trainer_config(H.tiny_llama(), per_head=per_head)
        model = H.build(cfg, 1, "", parallel=False)
        splits = muon_splits(model, per_head=per_head)
        want = [8, 8, 8, 8] if per_head else [16, 8, 8]  # 2 query heads per group of head_dim 8, then k, v
        assert splits["layers.0.attention.qkv_linear.wqkv.weight"] == {"split_sizes": want, "split_groups": 2}
        opt = cfg.optimizer.build(model_parts=[model])
        groups = [g for g in opt.optimizers[0].param_groups if "layers.0.attention.qkv_linear.wqkv.weight"
                  in g["param_names"]]
        assert len(groups) == 1 and list(groups[0]["split_sizes"]) == want and groups[0]["split_groups"] == 2
        H.train(model, opt, 1)
    cfg = H.deepseek_config(H.tiny_deepseek())
    model = H.build(cfg, 1, "", parallel=False)
    splits = muon_splits(model, per_head=True)
    assert splits["layers.0.attention.wq.weight"] == {"split_sizes": [12], "split_groups": 4}
    assert splits["layers.0.attention.wkv_b.weight"] == {"split_sizes": [16], "split_groups": 4}
    assert muon_splits(model) == {}


def test_qwen3_q_k_norm_is_refused_with_what_to_do():
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    from muonclip.integrations.torchtitan import with_muonclip

    cfg = with_muonclip(qwen3_debugmodel(), device_type="cpu")
    model = H.build(cfg, 1, "", parallel=False)
    with pytest.raises(ValueError, match=r"q_norm/k_norm.*--optimizer.name Muon"):
        cfg.optimizer.build(model_parts=[model])
    cfg.optimizer.name = "Muon"
    assert len(cfg.optimizer.build(model_parts=[model]).optimizers) == 1


def test_the_command_line_selects_our_optimizer_and_its_fields():
    from torchtitan.config import ConfigManager

    from muonclip.integrations.torchtitan import MuonClipOptimizers
    from muonclip.integrations.torchtitan_attention import RecordingSDPA

    cfg = ConfigManager().parse_args([
        "--module", "muonclip.integrations.torchtitan", "--config", "llama3_debugmodel", "--optimizer.tau", "42",
        "--optimizer.lr", "0.01", "--optimizer.per_head", "--optimizer.orth_dtype", "float32",
        "--optimizer.name", "Muon"])
    assert isinstance(cfg.optimizer, MuonClipOptimizers.Config)
    o = cfg.optimizer
    assert (o.tau, o.lr, o.per_head, o.orth_dtype, o.name) == (42.0, 0.01, True, "float32", "Muon")
    inner = [c for _, c, _, _ in cfg.model_spec.model.traverse(RecordingSDPA.Config)]
    assert len(inner) == 6  # the debug model's 6 layers record
    assert cfg.parallelism.spmd_backend == "partial_dtensor" and cfg.training.mixed_precision_param == "float32"
    with pytest.raises(ValueError, match="no_such_config"):
        ConfigManager().parse_args(["--module", "muonclip.integrations.torchtitan", "--config", "no_such_config"])


def test_model_parts_without_their_stage_and_torchtitans_unused_optimizer_fields_are_refused():
    """Several model parts are a pipeline's: the container refuses them without the stage the pipelining function
    tags them with (tests/test_torchtitan_pipeline.py trains pipelines); torchtitan's own optimizer fields, which
    the container does not use, are not on the command line and are refused when set in Python."""
    from torchtitan.config import ConfigManager

    from muonclip.integrations.torchtitan import MuonClipOptimizers

    cfg = H.trainer_config(H.tiny_llama())
    parts = [H.build(cfg, 1, "", parallel=False) for _ in range(2)]
    with pytest.raises(ValueError, match=r"got 2 model parts without their pipeline stage.*with_muonclip"):
        cfg.optimizer.build(model_parts=parts)
    for field, value in (("param_groups", [object()]), ("implementation", "foreach"),
                         ("optimizer_factory_kwargs_by_name", {"AdamW": {}})):
        bad = MuonClipOptimizers.Config(**{field: value})
        with pytest.raises(ValueError, match=rf"does not use torchtitan's optimizer.{field}"):
            bad.build(model_parts=parts[:1])
    for flag in ("--optimizer.implementation", "--optimizer.param_groups"):
        with pytest.raises(SystemExit):
            ConfigManager().parse_args(["--module", "muonclip.integrations.torchtitan", "--config",
                                        "llama3_debugmodel", flag, "foreach"])


def test_a_rate_carried_over_from_torchtitans_adamw_is_warned_about_and_a_chosen_one_is_not():
    from torchtitan.config import ConfigManager

    model = H.build(H.trainer_config(H.tiny_llama()), 1, "", parallel=False)
    base = ["--module", "muonclip.integrations.torchtitan", "--config", "llama3_debugmodel"]
    for extra, warned in (([], True), (["--optimizer.lr", "0.02"], False), (["--optimizer.name", "AdamW"], False),
                          (["--optimizer.name", "Muon"], True)):
        cfg = ConfigManager().parse_args(base + extra)
        opt = cfg.optimizer.build(model_parts=[model])
        assert (opt.rate_warning is not None) == warned, extra
        if warned:
            assert "optimizer.lr 0.0008 is the AdamW rate of torchtitan's config" in opt.rate_warning
    quick = ConfigManager().parse_args(["--module", "muonclip.integrations.torchtitan", "--config", "llama3_quickstart"])
    assert quick.optimizer.build(model_parts=[model]).rate_warning is None
