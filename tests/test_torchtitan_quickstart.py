"""The torchtitan quick start end to end, and the clip in the run's own logs.

* ``muonclip torchtitan-assets`` writes a tokenizer torchtitan reads and the plays as its dataset; a folder
  that holds files is refused, nothing written.
* The documented command (``commands()``, what ``muonclip torchtitan-assets`` prints), launched as printed
  with torchrun on 2 gloo ranks (small: 4 steps of 64 tokens, tau low enough that heads clip): the log has
  the start-up line (optimizer, tau, clipped and refused layers) and a ``muonclip step:`` line per logged
  step; TensorBoard's event file holds the same figures under ``muonclip/`` (max logit, clipped heads and
  layers, each layer's first clip) at the same steps; a step with clipped heads is one whose max logit
  passes tau. One launch for both.
* The same command pipelined over its 2 ranks (``--parallelism.pipeline_parallel_degree 2``, torchtitan's default
  Interleaved1F1B: two stages per rank): the log and TensorBoard, written by the last stage's rank, cover the layers
  of every stage, exact (each layer's max logit and clipped heads logged; their max and sum are the totals).
* The AdamW baseline command builds torchtitan's default AdamW on the same model.
* In one process (`ClipLog` and `MuonClipOptimizers.record_exact`, what the metrics processor calls): a
  logged step's max logit equals the exact maxima of the chunked backend on the same weights and batch,
  though the LSE gate records bounds on other steps, where the value is labelled an upper bound; clipped
  heads and layers, head clips between logs, the peak and the first clip of each layer agree with the
  optimizer's own per-step records.

Skipped without the torchtitan extra.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchtitan", reason="the torchtitan extra is not installed (pip install 'muonclip[torchtitan]')")

sys.path.insert(0, os.path.dirname(__file__))
import torchtitan_harness as H  # noqa: E402

import muonclip  # noqa: E402
from muonclip.app.main import main  # noqa: E402
from muonclip.app.torchtitan_assets import FILES, commands  # noqa: E402

SRC = os.path.dirname(os.path.dirname(muonclip.__file__))
TAU = 0.25  # the debug model's heads start around 0.3-0.7: some clip at once


def _scalars(log_dir):
    from muonclip.integrations.tensorboard import read_scalars

    return read_scalars(log_dir)


def _run(assets, tmp, *extra):
    """The documented MuonClip command, launched as printed with torchrun on 2 gloo ranks, small (4 steps of 64
    tokens, 2 rows per rank, logged at steps 1, 2 and 4), with ``extra`` arguments; its output folder and log."""
    cmd = commands(assets)["MuonClip"].split()
    assert cmd[0] == "torchrun"
    cmd = [sys.executable, "-m", "torch.distributed.run", *cmd[1:], "--training.steps", "4", "--training.seq_len",
           "64", "--training.local_batch_size", "2", "--metrics.log_freq", "2", "--optimizer.tau", str(TAU),
           "--dump_folder", str(tmp / "out"), "--metrics.disable_color_printing", *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=400)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    return tmp / "out", log


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The assets (1 play) and one 2-rank run of the documented MuonClip command, small."""
    tmp = tmp_path_factory.mktemp("quickstart")
    assets = tmp / "assets"
    assert main(["torchtitan-assets", str(assets), "--plays", "1", "--vocab-size", "512"]) == 0
    return (assets, *_run(assets, tmp))


@pytest.fixture(scope="module")
def pipelined(quickstart, tmp_path_factory):
    """The same command pipelined over its 2 ranks with torchtitan's default schedule (Interleaved1F1B: 4 stages,
    two per rank), each layer's figures logged."""
    assets, _, _ = quickstart
    return _run(assets, tmp_path_factory.mktemp("pipelined"), "--parallelism.pipeline_parallel_degree", "2",
                "--metrics.clip_per_layer")


def test_the_assets_are_a_tokenizer_and_a_dataset_torchtitan_reads(quickstart, tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    assets, _, _ = quickstart
    assert all((assets / f).is_file() for f in FILES)
    tok = HuggingFaceTokenizer(HuggingFaceTokenizer.Config(), tokenizer_path=str(assets))
    text = "O, what a noble mind is here o'erthrown!"
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.get_vocab_size() == 512
    assert tok.decode(ids[1:-1]) == text
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "mine.txt").write_text("keep")
    assert main(["torchtitan-assets", str(busy), "--plays", "1"]) == 2
    assert [p.name for p in busy.iterdir()] == ["mine.txt"] and not any(tmp_path.glob(".busy*"))


def _line_figures(log):
    """step -> (max logit, clipped heads, clipped layers) from the log's ``muonclip step:`` lines (rank 0's
    and rank 1's lines are the same figures: the maxima are all-reduced)."""
    out = {}
    for m in re.finditer(r"muonclip step:\s+(\d+)\s+max logit: ([\d.]+) \(tau ([\d.]+)\)\s+clipped: (\d+) heads in "
                         r"(\d+) layers", log):
        step, fig = int(m.group(1)), (float(m.group(2)), int(m.group(4)), int(m.group(5)))
        assert out.setdefault(step, fig) == fig
        assert float(m.group(3)) == TAU
    return out


def test_the_quick_start_log_and_tensorboard_show_the_clip(quickstart):
    _, out, log = quickstart
    start = [ln for ln in log.splitlines() if "QK-Clip tau" in ln]
    assert start and "MuonClip: Muon on" in start[0] and "on 6 of 6 attention layers: layers.{0..5}.attention; " \
        "refused: none" in start[0]
    lines = _line_figures(log)
    assert sorted(lines) == [1, 2, 4]  # step 1 and every --metrics.log_freq 2
    tb = _scalars(next((out / "tb").iterdir()))
    for step, (top, heads, layers) in lines.items():
        got = {k: dict(v)[step] for k, v in tb.items() if k.startswith("muonclip/") and step in dict(v)}
        assert got["muonclip/max_logit"] == pytest.approx(top, abs=0.006)
        assert (got["muonclip/clipped_heads"], got["muonclip/clipped_layers"]) == (heads, layers)
        assert got["muonclip/tau"] == pytest.approx(TAU)
        assert (heads > 0) == (got["muonclip/max_logit"] > TAU)  # the clip acts exactly where the max passes tau
        assert "muonclip/max_logit_upper_bound" not in got  # logged steps are exact
    assert lines[1][1] > 0  # heads clipped at step 1
    firsts = {k.split("/", 2)[2]: v for k, v in tb.items() if k.startswith("muonclip/first_clip_step/")}
    assert firsts and all(len(v) == 1 for v in firsts.values())  # each layer's first clip logged once
    assert firsts and set(firsts) <= {f"layers.{i}.attention" for i in range(6)}
    for name, [(when, first)] in firsts.items():
        assert f"{name} at step {int(first)}" in log and when >= first
    # the layers that clipped at step 1 are those whose first clip is step 1
    assert sum(first == 1.0 for [(_, first)] in firsts.values()) == lines[1][2]
    # torchtitan's own line is still there, with the loss
    assert re.search(r"step:\s+4\s+loss:\s+[\d.]+", log)


def test_a_pipelined_run_logs_the_clip_of_every_stage_from_the_last_stage(pipelined):
    """torchtitan writes TensorBoard from the last stage's first rank (rank 1 here), whose stages hold layers 1, 2
    and 5; the figures cover the six layers of both ranks' stages, the same on both ranks' console lines, exact
    (the maxima are those of the layers, the clipped heads their sum, the clip acts where the max passes tau)."""
    out, log = pipelined
    starts = sorted(ln.split("; ")[-1] for ln in log.splitlines() if "QK-Clip tau" in ln)
    assert starts == ["pipeline stages 0, 2 of 4 (rank 0)", "pipeline stages 1, 3 of 4 (rank 1)"]
    assert [ln for ln in log.splitlines() if "QK-Clip tau" in ln and "layers.0.attention, layers.3.attention" in ln]
    lines = _line_figures(log)  # both ranks' lines: the same figures
    assert sorted(lines) == [1, 2, 4]
    assert all(log.count(f"muonclip step: {s:2} ") == 2 for s in lines)  # one line per rank
    tb = _scalars(next((out / "tb").iterdir()))
    layers = [f"layers.{i}.attention" for i in range(6)]
    for step, (top, heads, n_layers) in lines.items():
        got = {k: dict(v)[step] for k, v in tb.items() if k.startswith("muonclip/") and step in dict(v)}
        per_layer = [got[f"muonclip/max_logit/{n}"] for n in layers]
        clipped = [got[f"muonclip/clipped_heads/{n}"] for n in layers]
        assert got["muonclip/max_logit"] == max(per_layer) == pytest.approx(top, abs=0.006)
        assert got["muonclip/clipped_heads"] == sum(clipped) == heads
        assert got["muonclip/clipped_layers"] == sum(c > 0 for c in clipped) == n_layers
        assert all((c > 0) == (m > TAU) for c, m in zip(clipped, per_layer))
    firsts = {k.split("/", 2)[2] for k in tb if k.startswith("muonclip/first_clip_step/")}
    assert {"layers.0.attention", "layers.3.attention", "layers.4.attention"} <= firsts <= set(layers)
    assert re.search(r"step:\s+4\s+loss:\s+[\d.]+", log)  # the last stage's loss


def test_the_adamw_baseline_command_builds_torchtitans_default_adamw(quickstart):
    from torchtitan.config import ConfigManager

    assets, _, _ = quickstart
    args = commands(assets)["AdamW (baseline)"].split()
    args = args[args.index("--module"):]
    cfg = ConfigManager().parse_args(args)
    assert (cfg.optimizer.name, cfg.optimizer.lr, cfg.hf_assets_path) == ("AdamW", 3e-3, str(assets))
    model = H.build(H.trainer_config(H.tiny_llama()), 1, "", parallel=False)  # a small model of the same kind
    opt = cfg.optimizer.build(model_parts=[model])
    [adamw] = opt.optimizers
    assert type(adamw) is torch.optim.AdamW and len(adamw.param_groups) == 1
    g = adamw.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (3e-3, (0.9, 0.95), 1e-8, 0.1)
    assert len(g["params"]) == len(list(model.parameters())) and opt.clipping() == []
    assert all(getattr(m, "muonclip_recorder", None) is None for m in model.modules())  # plain attention


# ------------------------------------------------------------------------------------------
# one process: what the metrics processor reports on a logged step
# ------------------------------------------------------------------------------------------


def _exact_maxima(cfg, params, step):
    """Per layer, the exact max logits of batch ``step`` on ``params`` (the chunked backend)."""
    from muonclip.attention.record import set_max_logit_backend

    model = H.build(cfg, 1, "", parallel=False)
    H.load_params(model, params)
    opt = cfg.optimizer.build(model_parts=[model]).optimizers[0]
    set_max_logit_backend("chunked")
    try:
        model(H.batch(step)[0])
    finally:
        set_max_logit_backend("gated")
    return {layer.name: layer.recorder.value.clone() for layer in opt.layers}


def test_a_logged_step_reports_exact_maxima_and_other_steps_label_bounds():
    from muonclip.integrations.torchtitan_metrics import ClipLog

    tau = 100.0  # nothing clips: the LSE gate records bounds unless the step is announced
    cfg = H.trainer_config(H.tiny_llama(), tau=tau)
    start = H.reference_start(cfg)
    model = H.build(cfg, 1, "", parallel=False)
    H.load_params(model, start)
    opt = cfg.optimizer.build(model_parts=[model])
    log = ClipLog()
    want = max(v.max().item() for v in _exact_maxima(cfg, start, 0).values())
    opt.record_exact(True)
    H.train(model, opt, 1)
    rep = log.report(opt.clipping(), 1, tau)
    assert rep.metrics["muonclip/max_logit"] == pytest.approx(want, rel=1e-6, abs=0)
    assert not any(b.any() for b in opt.optimizers[0].last_bounded.values())
    assert f"max logit: {want:.2f} (tau 100)" in rep.line
    after = H.canonical_params(model)
    opt.record_exact(False)  # back to the gate: recorded values are bounds
    H.train(model, opt, 1, start=1)
    rep = log.report(opt.clipping(), 2, tau)
    exact = max(v.max().item() for v in _exact_maxima(cfg, after, 1).values())
    assert "muonclip/max_logit" not in rep.metrics
    assert exact < rep.metrics["muonclip/max_logit_upper_bound"] <= tau
    assert "an LSE upper bound, not exact" in rep.line
    assert all(layer.recorder.threshold == tau for layer in opt.optimizers[0].layers)


def test_clip_counts_between_logs_the_peak_and_first_clips_follow_the_optimizer():
    from muonclip.integrations.torchtitan_metrics import ClipLog

    tau = 1.0
    cfg = H.trainer_config(H.tiny_llama(), tau=tau)
    start = H.reference_start(cfg)
    model = H.build(cfg, 1, "", parallel=False)
    H.load_params(model, start)
    opt = cfg.optimizer.build(model_parts=[model])
    log, steps = ClipLog(per_layer=True), []
    ref = _exact_maxima(cfg, start, 0)
    opt.record_exact(True)
    H.train(model, opt, 1, log=steps)
    rep = log.report(opt.clipping(), 1, tau).metrics
    assert rep["muonclip/max_logit"] == pytest.approx(max(v.max().item() for v in ref.values()), rel=1e-6)
    assert rep["muonclip/clipped_heads"] == sum(int((v > tau).sum()) for v in ref.values()) > 0
    assert rep["muonclip/clipped_layers"] == sum(int((v > tau).any()) for v in ref.values())
    for name, v in ref.items():
        assert rep[f"muonclip/max_logit/{name}"] == pytest.approx(v.max().item(), rel=1e-6)
        assert (f"muonclip/first_clip_step/{name}" in rep) == bool((v > tau).any())
    opt.record_exact(False)
    for s in (2, 3):  # two steps, the second logged: counts over both
        H.train(model, opt, 1, start=s - 1, log=steps)
        log.observe(opt.clipping(), s)
    rep = log.report(opt.clipping(), 3, tau).metrics
    clipped = [sum(int(c.sum()) for _, c in step.values()) for step in steps[1:]]
    assert rep["muonclip/head_clips"] == sum(clipped)
    assert rep["muonclip/clipped_steps"] == sum(n > 0 for n in clipped)
    peak = max((v[c].max().item() for step in steps[1:] for v, c in step.values() if c.any()), default=None)
    assert rep.get("muonclip/clipped_max_logit_peak") == (None if peak is None else pytest.approx(peak))
    # each layer's first clip is reported once: here only layers that first clipped at step 2 or 3
    first = {}
    for s, step in enumerate(steps, start=1):
        for name, (_, c) in step.items():
            if c.any():
                first.setdefault(name, s)
    assert {k: v for k, v in rep.items() if k.startswith("muonclip/first_clip_step/")} == {
        f"muonclip/first_clip_step/{n}": float(s) for n, s in first.items() if s > 1}


def test_the_startup_line_names_what_muon_leaves_unclipped_and_why():
    from torchtitan.models.qwen3.config_registry import qwen3_debugmodel

    from muonclip.integrations.torchtitan import with_muonclip
    from muonclip.integrations.torchtitan_metrics import layer_names, startup_line

    cfg = with_muonclip(qwen3_debugmodel(), device_type="cpu")
    cfg.optimizer.name = "Muon"
    model = H.build(cfg, 1, "", parallel=False)
    opt = cfg.optimizer.build(model_parts=[model])
    line = startup_line(cfg.optimizer, [model], opt.optimizers)
    assert "QK-Clip off (--optimizer.name Muon)" in line and "would be refused" in line and "q_norm/k_norm" in line
    assert opt.startup_line == line
    assert layer_names(["layers.2.attention", "layers.3.attention"]) == "layers.{2..3}.attention"
    assert layer_names(["a.attention", "layers.3.attention"]) == "a.attention, layers.3.attention"
