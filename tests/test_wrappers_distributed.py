"""MuonClip under the wrappers users put around it, on 2 CPU processes (gloo), in one torchrun launch.

`tests/wrappers_worker.py` runs every case once (a module fixture); each test here checks one
case's results against a one-process reference computed here from the same definitions, or
against the run it claims to equal:

* two independent models in one job (``process_group="local"``, and a one-rank group of its
  own): each rank trains, clips and logs as its model alone, and the clip, the step and the
  callback issue no collective;
* ``fully_shard`` after ``MuonClip`` trains and clips as ``MuonClip`` after ``fully_shard``;
* accelerate's own FSDP2 ``prepare`` (the docs' recipe, FSDP forced on CPU): the same against
  ``fully_shard`` + ``MuonClip``; ``save_state`` / ``load_state`` continue bit for bit; torch's
  ``get_optimizer_state_dict`` (full and sharded, ``cpu_offload``) takes the optimizer;
* accelerate DDP (the docs' recipe) against one process on the global batches;
* Lightning (the docs' recipe): DDP, and ``ModelParallelStrategy`` (FSDP2) with save and resume
  bit for bit, the callback's update RMS reduced over the ranks, param groups named;
* FSDP1 (both ``use_orig_params``) refused, naming FSDP1.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import muonclip
from muonclip import MuonClip
from muonclip.integrations import StepMetrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
import wrappers_worker as w  # noqa: E402

pytest.importorskip("accelerate")
pytest.importorskip("lightning")

WORLD = 2
TOL = 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    """Each rank's results of every case (one torchrun launch for the module)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this build")
    out = tmp_path_factory.mktemp("wrappers")
    src = Path(muonclip.__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
                           str(Path(w.__file__)), str(out)], capture_output=True, text=True, timeout=400, env=env)
    got = [out / f"rank{r}.pt" for r in range(WORLD)]
    assert proc.returncode == 0 and all(p.exists() for p in got), (
        f"torchrun exited {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}")
    return [torch.load(p, weights_only=False) for p in got]


def case(results, name: str) -> list:
    """Every rank's results of case ``name``; a case that raised fails here with its traceback."""
    per_rank = [r[name] for r in results]
    for rank, r in enumerate(per_rank):
        assert not (isinstance(r, dict) and "error" in r), f"rank {rank}: {name} raised\n{r['error']}"
    return per_rank


def max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key, v in a[name].items():
            if torch.is_tensor(v):
                assert v.dtype == b[name][key].dtype and torch.equal(v, b[name][key]), (name, key)
            else:
                assert v == b[name][key], (name, key)


def test_independent_models_in_one_job_each_train_as_alone_with_no_collective(results):
    """Each rank against its model trained in this process alone (no process group): same clip
    decisions, weights within 1e-6, the same update RMS; no collective in the steps."""
    got = case(results, "case_independent_models")
    for rank in range(WORLD):
        model = w.gpt(seed=10 + rank)
        opt = MuonClip(model, tau=w.TAU, **w.OPT)
        metrics = StepMetrics()
        ref = w.train(model, opt, [w.batch(s, offset=100 * rank) for s in range(4)], metrics)
        assert 0 < w.clipped_heads(ref)  # the test can tell: the clip fires
        for mode in ("local", "subgroup"):
            mine = got[rank][mode]
            assert mine["calls"] == [], (rank, mode, mine["calls"])
            assert len(mine["log"]) == len(ref)
            for step, step_ref in zip(mine["log"], ref):
                assert step.keys() == step_ref.keys()
                for name, (s, clipped) in step.items():
                    assert torch.equal(clipped, step_ref[name][1]), (rank, mode, name)
                    torch.testing.assert_close(s, step_ref[name][0], rtol=1e-5, atol=0)
            assert max_diff(mine["params"], w.params(model)) <= TOL, (rank, mode)
            assert mine["update_rms"] == pytest.approx(metrics.last["muonclip/update_rms"], rel=1e-5)


def test_fully_shard_after_muonclip_trains_and_clips_the_live_weights(results):
    for r in case(results, "case_late_fully_shard"):
        assert r["ref_clipped"] > 0
        assert r["late_clipped"] == r["ref_clipped"]
        assert max_diff(r["late"], r["ref"]) <= TOL


def test_accelerate_fsdp2_prepare_matches_fully_shard_then_muonclip(results):
    for r in case(results, "case_accelerate_fsdp2"):
        assert r["ref_clipped"] > 0
        assert r["last_clipped"].keys() == r["ref_last_clipped"].keys()
        assert all(torch.equal(r["last_clipped"][n], r["ref_last_clipped"][n]) for n in r["last_clipped"])
        assert max_diff(r["whole"], r["ref"]) <= TOL


def test_accelerate_fsdp2_save_state_and_load_state_continue_bit_for_bit(results):
    """3 steps, save_state, a fresh model (other weights) and optimizer, load_state, 3 steps ==
    6 steps: the same kernels on the same values in the same order."""
    for r in case(results, "case_accelerate_fsdp2"):
        assert r["resumed_steps"] == 6
        assert max_diff(r["resumed"], r["whole"]) == 0.0
        assert_same_state(r["resumed_state"], r["whole_state"])


def test_torch_get_optimizer_state_dict_full_and_sharded_with_cpu_offload(results):
    """The saved form: dtypes as strings, the counters and tau in every param group."""
    ranks = case(results, "case_accelerate_fsdp2")
    assert set(ranks[0]["saved"]) == {True, False} and set(ranks[1]["saved"]) == {False}  # full: rank 0 only
    for r in ranks:
        for saved in r["saved"].values():
            assert set(saved["orth_dtype"]) == {"torch.float32"}
            assert set(saved["steps_taken"]) == {6} and set(saved["tau"]) == {w.TAU}


def test_accelerate_ddp_recipe_matches_one_process_on_the_global_batches(results):
    """float32 orthogonalisation: DDP's gradient average and the one-process mean differ only by
    summation order (docs: about 1e-6 here; bfloat16 Newton–Schulz would amplify it to ~1e-2)."""
    ranks = case(results, "case_accelerate_ddp")
    model = w.gpt()
    w.train(model, MuonClip(model, tau=w.TAU, **w.OPT), [w.batch(s) for s in range(8)])
    assert max_diff(ranks[0]["params"], ranks[1]["params"]) == 0.0
    assert all(r["steps"] == 8 for r in ranks)
    assert max_diff(ranks[0]["params"], w.params(model)) <= 1e-5


def _lightning_reference() -> tuple[dict, float]:
    """One process on the Lightning runs' global batches (rows 4s..4s+3 at step s, 2 epochs)."""
    rows = w.lightning_rows()
    model = w.gpt()
    opt = MuonClip(model, tau=w.TAU, **w.OPT)
    metrics = StepMetrics()
    batches = [(rows[4 * s:4 * s + 4, :-1], rows[4 * s:4 * s + 4, 1:]) for s in range(2)] * 2
    w.train(model, opt, batches, metrics)
    return w.params(model), metrics.last["muonclip/update_rms"]


def test_lightning_model_parallel_save_and_resume_is_bit_identical(results):
    for r in case(results, "case_lightning"):
        assert r["resumed"]["steps"] == 4
        assert max_diff(r["resumed"]["params"], r["whole"]["params"]) == 0.0
        assert_same_state(r["resumed"]["state"], r["whole"]["state"])


def test_lightning_callback_update_rms_is_the_whole_models_and_groups_are_named(results):
    """FSDP2: each rank measures its shard; the logged figure is reduced over the group, the
    same on both ranks and the one-process figure. LearningRateMonitor shows group names."""
    ranks = case(results, "case_lightning")
    ref_params, ref_rms = _lightning_reference()
    for r in ranks:
        assert r["whole"]["last"]["muonclip/update_rms"] == ranks[0]["whole"]["last"]["muonclip/update_rms"]
        assert r["whole"]["last"]["muonclip/update_rms"] == pytest.approx(ref_rms, rel=1e-4)
        assert max_diff(r["whole"]["params"], ref_params) <= 1e-5
        for run in ("ddp", "whole"):
            assert r[run]["lr_names"] == ["lr-MuonClip/adamw", "lr-MuonClip/adamw_no_decay", "lr-MuonClip/muon"]
    assert max_diff(ranks[0]["ddp"]["params"], ranks[1]["ddp"]["params"]) == 0.0


def test_fsdp1_is_refused_naming_it_never_routed(results):
    for r in case(results, "case_fsdp1_refused"):
        for orig in (True, False):
            for what in ("param_groups", "MuonClip"):
                kind, message = r[(orig, what)]
                assert kind == "FlatParameterError", (orig, what, kind, message)
                assert "FSDP1" in message and "fully_shard" in message
