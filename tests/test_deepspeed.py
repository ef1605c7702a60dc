"""MuonClip and Muon as DeepSpeed's optimizer, ZeRO stages 0-3, against one plain process.

One launch of 2 gloo ranks on the CPU (``DS_ACCELERATOR=cpu``; `deepspeed_harness`) runs every
case of `deepspeed_worker` in turn; the tests below read its results (docs/integrations.md,
"DeepSpeed"), the Hugging Face Trainer and accelerate cases of `deepspeed_hf_worker` included.
The reference is one process on the same global batches with the same initial weights
(`deepspeed_worker.reference`, `deepspeed_hf_worker.reference`), Newton–Schulz in float32.

Tolerances, relative to the largest movement of any weight: `TOL` (1e-5) for the matrices Muon
updates; `ADAMW_TOL` (1e-4, as tests/test_torchtitan.py) for AdamW's weights (embedding, head,
norms), whose near-cancelling gradients carry the float32 noise of a different reduction order
(each rank's half batch, then DeepSpeed's average). Every comparison prints both deviations.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch

if importlib.util.find_spec("deepspeed") is None:  # not imported here: it stays in the ranks' processes
    pytest.skip("deepspeed is not installed (pip install 'muonclip[deepspeed]')", allow_module_level=True)

import deepspeed_harness  # noqa: E402
import deepspeed_hf_worker as H  # noqa: E402
import deepspeed_worker as W  # noqa: E402

import muonclip  # noqa: E402

TOL = 1e-5  # Muon's matrices, of the largest weight movement
ADAMW_TOL = 1e-4  # AdamW's weights (module docstring)
STAGES = (0, 1, 2, 3)
CASES = {
    **{f"{k}-{s}": (k, W.ds_config(s)) for k in ("muon", "muonclip") for s in STAGES},
    # DeepSpeed's default gradient_clipping is 1.0: the one process clips the gradient norm to 1.0 too
    "muonclip-0-default-clipping": ("muonclip", W.ds_config(0, clipping=None)),
    "muonclip-2-default-clipping": ("muonclip", W.ds_config(2, clipping=None)),
    **{f"muonclip-{s}-bf16": ("muonclip", W.ds_config(s, "bf16")) for s in (1, 2, 3)},
    "muonclip-2-fp16": ("muonclip", W.ds_config(2, "fp16")),
    "refused-offload": ("muonclip", {**W.ds_config(2, offload_optimizer={"device": "cpu"}),
                                                       "zero_force_ds_cpu_optimizer": False}),
    "refused-normuon": ("muon-normuon", W.ds_config(1)),
}
RESUMES = {f"muonclip-{s}": ("muonclip", W.ds_config(s)) for s in (1, 2, 3)}
# compute_grad_norm false: DeepSpeed's own overflow check (its gradient norm) is off, the NaN reaches the optimizer
NONFINITE = {f"{kind}-{s}-{mode}": (kind, W.ds_config(s, compute_grad_norm=False), mode)
             for kind, s, mode in (("muonclip", 1, "raise"), ("muon", 2, "skip"))}
HF = [f"{front}-{s}" for front in ("trainer", "accelerate") for s in (2, 3)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("deepspeed")
    out = folder / "results.pt"
    port = deepspeed_harness.launch(W.run_all, CASES, RESUMES, str(folder), str(out), NONFINITE, HF, limit_s=600)
    return {**torch.load(out, weights_only=False), "port": port}


@pytest.fixture(scope="module")
def references():
    return {"muon": W.reference("muon"), "muonclip": W.reference("muonclip"),
            "muonclip-clipnorm": W.reference("muonclip", clip_norm=1.0)}


def _muon_names(model: torch.nn.Module) -> list[str]:
    return [n for g in muonclip.param_groups(model) if g["algorithm"] == "muon" for n in g["param_names"]]


@functools.cache
def _gpt() -> tuple[dict, list[str]]:
    """The GPT's initial weights and the names of Muon's matrices (built when first asked, not at import)."""
    model = W.model()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, _muon_names(model)


def _deviation(got: dict, ref: dict, start: dict | None = None, names: list[str] | None = None) -> float:
    """max |got - ref| over the weights ``names`` (default all), relative to the largest movement of
    any weight from ``start`` (default: the GPT's)."""
    start = start or _gpt()[0]
    move = max((ref["weights"][n] - start[n]).abs().max().item() for n in start)
    return max((got["weights"][n] - ref["weights"][n]).abs().max().item() for n in (names or start)) / move


def _assert_one_process(got: dict, ref: dict, what: str, start: dict | None = None, muon: list[str] | None = None,
                        tol: float = TOL, adamw_tol: float = ADAMW_TOL) -> None:
    """Muon's matrices within ``tol`` of the largest movement, every weight within ``adamw_tol``
    (default ``start`` and ``muon``: the GPT's)."""
    start, muon = start or _gpt()[0], muon or _gpt()[1]
    m, a = _deviation(got, ref, start, muon), _deviation(got, ref, start)
    print(f"{what}: max |diff| / max movement = {m:.2g} (Muon's matrices), {a:.2g} (all weights)")
    assert m <= tol and a <= adamw_tol, (m, a)


def _same_clips(got: dict, ref: dict) -> bool:
    return len(got["clipped"]) == len(ref["clipped"]) and all(
        a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a) for a, b in zip(got["clipped"], ref["clipped"]))


def _deepspeed_cpu_fp16() -> bool:
    """DeepSpeed's CPU accelerator's own test for fp16 (oneDNN's fp16 support on this CPU)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):
        return False


def _case(runs, name):
    got = runs["cases"][name]
    assert "error" not in got, got.get("error")
    return got


@pytest.mark.parametrize("kind", ["muon", "muonclip"])
@pytest.mark.parametrize("stage", STAGES)
def test_zero_stage_equals_one_process(runs, references, kind, stage):
    """Float32: ZeRO-``stage`` on 2 ranks ends within 1e-5 of the largest movement of one process,
    clipping the same heads at every step; the model computes with the master weights."""
    got, ref = _case(runs, f"{kind}-{stage}"), references[kind]
    _assert_one_process(got, ref, f"{kind} ZeRO-{stage}")
    assert got["steps_taken"] == W.STEPS
    for n, w in got["weights"].items():
        assert torch.equal(got["live"][n], w), n
    if kind == "muonclip":
        assert _same_clips(got, ref)
        clipped = [sum(int(v.sum()) for v in step.values()) for step in ref["clipped"]]
        assert all(0 < c < 6 for c in clipped), clipped  # some heads clip, some do not, at every step


@pytest.mark.parametrize("stage", (0, 2))
def test_default_gradient_clipping_is_deepspeeds_norm_clip(runs, references, stage):
    """Stage 0's 5e-3 was DeepSpeed's default ``gradient_clipping`` (1.0), a global-norm clip of the
    gradients before the step: one process that clips its gradient norm to 1.0 is matched exactly,
    and the one that does not is not."""
    got = _case(runs, f"muonclip-{stage}-default-clipping")
    clipped, plain = references["muonclip-clipnorm"], references["muonclip"]
    _assert_one_process(got, clipped, f"muonclip ZeRO-{stage} default clipping vs a norm-clipped process")
    assert _deviation(got, plain, names=_gpt()[1]) > 100 * ADAMW_TOL
    assert _same_clips(got, clipped)


@pytest.mark.parametrize("name", ["muonclip-1-bf16", "muonclip-2-bf16", "muonclip-3-bf16", "muonclip-2-fp16"])
def test_mixed_precision_master_weights(runs, references, name):
    """bf16 / fp16 (loss scaling): the weights the model computes with are DeepSpeed's float32 master
    weights rounded, bit for bit, after the clip scaled the master; the same heads clip as in float32;
    and every bf16 stage takes the same steps (the algorithm is the same on the same gradients)."""
    if name.endswith("fp16") and not _deepspeed_cpu_fp16():
        assert runs["cases"][name]["error"] == "ValueError: Type fp16 is not supported on your device."
        pytest.skip("DeepSpeed's CPU accelerator refuses fp16 on this CPU (oneDNN has no fp16 kernels for it)")
    got = _case(runs, name)
    dtype = torch.bfloat16 if "bf16" in name else torch.float16
    for n, w in got["weights"].items():
        assert got["live"][n].dtype == dtype
        assert torch.equal(got["live"][n], w.to(dtype)), n
    ref = references["muonclip"]
    assert _same_clips(got, ref)
    assert _deviation(got, ref) <= 0.25  # low-precision gradients, the same run
    if "bf16" in name:
        _assert_one_process(got, _case(runs, "muonclip-2-bf16"), f"{name} vs muonclip-2-bf16")


def test_refused_at_first_step_naming_deepspeed(runs):
    """What cannot be exact is refused, naming DeepSpeed, the option and what to do instead."""
    off = runs["cases"]["refused-offload"]["error"]
    assert "DeepSpeed ZeRO-2 with offload_optimizer" in off and "remove zero_optimization.offload_optimizer" in off
    assert "DeepSpeed ZeRO-1 with normuon" in runs["cases"]["refused-normuon"]["error"]


@pytest.mark.parametrize("name", sorted(RESUMES))
def test_checkpoint_resumes_bit_identically(runs, name):
    """``engine.save_checkpoint`` / ``load_checkpoint``: the resumed step equals the straight one bit
    for bit (weights, momentum, AdamW moments, step counters, tau), MuonClip at ZeRO-1, 2, 3 and Muon
    (whose load binds to DeepSpeed before its group checks) at ZeRO-2."""
    got = runs["resumes"][name]
    assert "error" not in got, got.get("error")
    a, b = got["straight"], got["resumed"]
    for n in a["weights"]:
        assert torch.equal(a["weights"][n], b["weights"][n]), n
        assert torch.equal(a["live"][n], b["live"][n]), n
    assert a["steps_taken"] == b["steps_taken"] == 3
    assert a["tau"] == b["tau"] == (W.TAU if name.startswith("muonclip") else None)


@pytest.mark.parametrize("name", sorted(NONFINITE))
def test_nonfinite_gradient_changes_no_group(runs, name):
    """ZeRO-1/2 hand the optimizer one param group per call; a NaN in the last group's gradient is
    found before the first group steps: ``"raise"`` raises naming that group and ``"skip"`` skips
    the whole step, and no weight of any group changes in that step."""
    got = runs["nonfinite"][name]
    assert got["error"] is None, got["error"]
    assert got["changed"] == []
    assert got["steps_taken"] == 1
    if name.endswith("raise"):
        assert got["raised"] is not None and got["raised"].startswith("NonFiniteGradError"), got["raised"]
        assert "param group(s) 2 " in got["raised"] and "no weight was updated" in got["raised"]
        assert got["steps_skipped"] == 0
    else:
        assert got["raised"] is None and got["steps_skipped"] == 1


def test_partitions_stepped_outside_deepspeed_are_refused(runs):
    """The optimizer's groups hold DeepSpeed's flat partitions but the step does not come from
    DeepSpeed's ZeRO optimizer: a ValueError naming DeepSpeed and `attach`, never a step that takes
    a partition for a weight; `attach(engine)` then binds it (once) and the engine steps it."""
    got = runs["nonfinite"]["unattached"]
    assert "error" not in got, got.get("error")
    assert "DeepSpeed ZeRO's partition" in got["raised"] and "attach(engine)" in got["raised"], got["raised"]
    assert got["attached"] == "DeepSpeedDriver" and got["same"] and got["steps_taken"] == 1


def test_stale_build_lock_is_cleared():
    """A lock file a killed build left in the extensions folder does not make the next start wait forever."""
    import subprocess
    import sys

    deepspeed_harness.extensions_ready_elsewhere()
    stale = next(deepspeed_harness.EXTENSIONS.rglob("deepspeed_shm_comm.so")).parent / "lock"
    stale.write_text("")
    code = "import sys; sys.path.insert(0, 'tests'); import deepspeed_harness as h; h.extensions_ready()"
    subprocess.run([sys.executable, "-c", code], cwd=deepspeed_harness.ROOT, timeout=120, check=True)
    assert not stale.exists()


def test_the_docs_recipe_trains_as_one_process(runs, references):
    """docs/integrations.md's DeepSpeed recipe, run as it stands (ZeRO-2, MuonClip), equals one process."""
    _assert_one_process(_case(runs, "recipe-2"), references["muonclip"], "docs recipe, ZeRO-2")


@pytest.mark.parametrize("name", HF)
def test_hugging_face_trainer_and_accelerate_equal_one_process(runs, name):
    """docs/integrations.md's recipes, as they stand: the Trainer with ``TrainingArguments(deepspeed=...)``
    and ``trainer_optimizer(MuonClip, args=args)``, and accelerate's ``DeepSpeedPlugin``, ZeRO-2 and
    ZeRO-3, on a tiny Llama: the weights of one plain process on the batches they fed (every rank's),
    heads clipped at every step and the same ones at the last."""
    got = runs["hf"][name]
    assert "error" not in got, got.get("error")
    assert got["kind"] == "MuonClip" and got["steps_taken"] == H.STEPS and len(got["batches"]) == H.STEPS
    ref = H.reference(got["batches"])
    assert all(0 < c < 6 for c in ref["clipped"]), ref["clipped"]
    model = H.llama()
    _assert_one_process(got, ref, name, start=ref["start"], muon=_muon_names(model))
    assert got["last_clipped"].keys() == ref["last_clipped"].keys()
    assert all(torch.equal(got["last_clipped"][k], ref["last_clipped"][k]) for k in ref["last_clipped"])


def test_the_launch_leaves_no_shared_memory_behind(runs):
    """DeepSpeed's CPU allreduce made its shared-memory buffers during the run (66 MB a rank, never
    unlinked by DeepSpeed); the launch removed them."""
    assert len(runs["buffers"]) == 2, runs["buffers"]
    assert deepspeed_harness.shared_buffers(runs["port"]) == []
