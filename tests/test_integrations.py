"""HF Trainer and PyTorch Lightning with MuonClip (tiny models built from configs, offline).

* HF Trainer, ``gradient_accumulation_steps=2``: the max logits the clip used equal the max over
  both micro-batches of an independent reference (q, k recomputed from each attention call's
  inputs with transformers' own RoPE, ``scaling * q.k`` explicit and causally masked); the
  callback's logged figures equal MuonClip's record; evaluation does not leak into the clip.
* Evaluation and generation never change training: a Trainer run evaluating after every step
  (on rows 6x longer, whose max logits exceed the next step's), or calling ``model.generate()``
  after every step, ends bit-identical to the same run without them, and the clip fires in
  both; the same for Lightning with validation after every micro-batch.
* Lightning, ``accumulate_grad_batches=2``: the clip uses the max of both micro-batches; the
  callback's figures equal the record; train 1 epoch, checkpoint, resume to 2 epochs ==
  2 epochs uninterrupted, bit for bit (same CPU kernels in the same order; data not shuffled).
* ``update_rms`` against a known result: with exact orthogonalisation (``method="svd"``) and
  ``adjust_lr_fn="match_rms_adamw"`` (the default) the update of a full-rank matrix has RMS exactly 0.2.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch import nn

import muonclip
from muonclip import MuonClip
from muonclip.models import GPT, GPTConfig
from muonclip.qkclip.step_metrics import StepMetrics, UpdateRMS, unwrap_optimizer

# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _spy_clips(opt: MuonClip) -> list[tuple[dict, dict]]:
    """Record (last_max_logits, last_clipped) after every clip of ``opt``."""
    clips: list[tuple[dict, dict]] = []
    clip = opt.clip

    def spy(*args, **kwargs) -> None:
        clip(*args, **kwargs)
        clips.append(({k: v.clone() for k, v in opt.last_max_logits.items()},
                      {k: v.clone() for k, v in opt.last_clipped.items()}))

    opt.clip = spy
    return clips


def _would_change_a_clip(seen: list[tuple[int, dict]], clips: list[tuple[dict, dict]], tau: float) -> bool:
    """Whether some side pass (``(index of the next clip, its maxima per layer)``) had a head above
    tau and above that clip's maximum: had it fed the clip, that head's gamma would differ."""
    return any(
        bool(((m > clips[i][0][name]) & (m > tau)).any())
        for i, maxima in seen if i < len(clips) for name, m in maxima.items()
    )


def _assert_same_training(clips_a: list, clips_b: list, model_a: nn.Module, model_b: nn.Module) -> None:
    """Every clip's maxima and clipped heads, and every weight, equal bit for bit; the clip fired."""
    assert len(clips_a) == len(clips_b) > 0
    for (m_a, c_a), (m_b, c_b) in zip(clips_a, clips_b):
        assert m_a.keys() == m_b.keys()
        for name in m_a:
            assert torch.equal(m_a[name], m_b[name]) and torch.equal(c_a[name], c_b[name]), name
    assert sum(int(c.sum()) for _, clipped in clips_a for c in clipped.values()) > 0, "the clip never fired"
    for (name, p), q in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(p, q), name


def _figures(max_logits: dict, clipped: dict) -> tuple[float, float]:
    return (max(float(v.max()) for v in max_logits.values()), float(sum(int(c.sum()) for c in clipped.values())))


# ----------------------------------------------------------------------------------------------
# update RMS: known result
# ----------------------------------------------------------------------------------------------


def test_update_rms_is_0_2_for_exact_orthogonalisation_with_rms_scale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24, bias=False), nn.Linear(24, 8, bias=False))
    opt = muonclip.Muon(model.parameters(), lr=0.01, weight_decay=0.1, adjust_lr_fn="match_rms_adamw", method="svd",
                        orth_dtype=torch.float64)
    meter = UpdateRMS(opt)
    for _ in range(2):
        model(torch.randn(32, 16)).square().mean().backward()
        meter.before()
        opt.step()
        opt.zero_grad()
        # every U = 0.2 sqrt(max(A, B)) * (orthogonal A x B), so mean(U^2) = 0.04 max(A,B) min(A,B) / (A B)
        assert meter.after() == pytest.approx(0.2, rel=1e-4)
    # "shape" scale sqrt(max(1, A/B)): RMS = sqrt(sum_i scale_i^2 min_i / sum_i A_i B_i) — a different, known value
    opt2 = muonclip.Muon(model.parameters(), lr=0.01, adjust_lr_fn="original", method="svd", orth_dtype=torch.float64)
    meter2 = UpdateRMS(opt2)
    model(torch.randn(32, 16)).square().mean().backward()
    meter2.before()
    opt2.step()
    # weights (24, 16): scale^2 = 1.5, 16 unit singular values; (8, 24): scale^2 = 1, 8 of them
    expected = math.sqrt((1.5 * 16 + 1.0 * 8) / (24 * 16 + 8 * 24))
    assert meter2.after() == pytest.approx(expected, rel=1e-4)


def test_update_rms_of_chosen_params_of_adamw_and_the_rank_reduction():
    """Any optimizer with ``params=``: AdamW's first update is m_hat / (sqrt(v_hat) + eps) = sign(g), RMS 1
    (weight decay removed exactly); ``reduce`` pools [sum of squares, count] over ranks."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 24), nn.Linear(24, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.5)
    hidden = [model[0].weight, model[1].weight]
    meter = UpdateRMS(opt, params=hidden)
    model(torch.randn(32, 16)).square().mean().backward()
    meter.before()
    opt.step()
    assert meter.after() == pytest.approx(1.0, abs=1e-4)
    # another "rank" holding 100 elements whose squared updates sum to 400 (RMS 2)
    model(torch.randn(32, 16)).square().mean().backward()
    meter.before()
    opt.step()
    sq, count = meter._measure()  # this process's figures
    assert count == 24 * 16 + 8 * 24
    got = meter.after(reduce=lambda v: [v[0] + 400.0, v[1] + 100.0])
    assert got == pytest.approx(math.sqrt((sq + 400.0) / (count + 100)), rel=1e-12)
    with pytest.raises(TypeError, match="params="):
        UpdateRMS(opt)
    with pytest.raises(ValueError, match=r"params \[0\] are not in the optimizer"):
        UpdateRMS(opt, params=[nn.Parameter(torch.zeros(2, 2))])


def test_step_metrics_refuses_a_foreign_optimizer_and_unwraps_wrappers():
    p = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(TypeError, match="muonclip.Muon"):
        StepMetrics().before_step(torch.optim.SGD([p], lr=0.1))

    class Wrapper:
        def __init__(self, optimizer):
            self.optimizer = optimizer

    opt = muonclip.Muon([p])
    assert unwrap_optimizer(Wrapper(Wrapper(opt))) is opt


def test_import_muonclip_needs_no_framework():
    import subprocess
    import sys

    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('transformers', 'lightning', 'pytorch_lightning', 'tensorboard'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import muonclip, muonclip.integrations\n"
        "from muonclip.integrations import step_metrics\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_muonclip_on_a_transformers_model_does_not_import_the_trainer():
    """Attaching to a model needs transformers' attention interface, not its Trainer machinery
    (``transformers.trainer``, seconds to import): that comes with `MuonClipTrainerCallback`
    only, on first access."""
    pytest.importorskip("transformers")
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "import muonclip\n"
        "cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,\n"
        "                  num_attention_heads=2, num_key_value_heads=2)\n"
        "opt = muonclip.MuonClip(LlamaForCausalLM(cfg))\n"
        "assert len(opt.layers) == 1, opt.layers\n"
        "print(sorted(m for m in sys.modules if m.startswith(('transformers.trainer', 'transformers.integrations.int'))))\n"
        "from muonclip.integrations.hf import MuonClipTrainerCallback\n"
        "print('transformers.trainer' in sys.modules, MuonClipTrainerCallback.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == ["[]", "True MuonClipTrainerCallback"]


# ----------------------------------------------------------------------------------------------
# Hugging Face Trainer
# ----------------------------------------------------------------------------------------------


def _eager_max_logits(attn: nn.Module, hidden: torch.Tensor, position_embeddings) -> torch.Tensor:
    """Per-head max of scaling * q.k over causal pairs, from the attention module's inputs."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    B, T, _ = hidden.shape
    hd = attn.head_dim
    q = attn.q_proj(hidden).view(B, T, -1, hd).transpose(1, 2)  # (B, nh, T, hd)
    k = attn.k_proj(hidden).view(B, T, -1, hd).transpose(1, 2)  # (B, nkv, T, hd)
    cos, sin = position_embeddings
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, nh, T, hd)
    s = (q.double() @ k.double().transpose(-1, -2)) * attn.scaling  # (B, nh, T, T)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return s.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3)).float()  # (nh,)


def test_hf_trainer_grad_accumulation_clip_sees_both_micro_batches_and_callback_logs_the_record(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from muonclip.integrations.hf import MuonClipTrainerCallback

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.25,
                      max_position_embeddings=64, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    tau = 2.0
    opt = MuonClip(model, lr=0.02, tau=tau)
    clips = _spy_clips(opt)

    # independent per-micro-batch reference, training forwards only
    refs: dict[str, list[torch.Tensor]] = {}
    names = {}
    for name, module in model.named_modules():
        if type(module).__name__ == "LlamaAttention":
            names[module] = name

            def hook(module, args, kwargs, _name=name):
                if module.training:
                    hidden = args[0] if args else kwargs["hidden_states"]
                    with torch.no_grad():
                        refs.setdefault(_name, []).append(_eager_max_logits(module, hidden, kwargs["position_embeddings"]))

            module.register_forward_pre_hook(hook, with_kwargs=True)
    assert len(names) == 2

    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, 64, (12,), generator=g) for _ in range(8)]
    train = [{"input_ids": r, "labels": r.clone()} for r in rows]
    evals = [{"input_ids": r, "labels": r.clone()} for r in rows[:2]]

    class Reporter(TrainerCallback):  # stands for TensorBoard / W&B: a reporter that runs after ours
        def __init__(self):
            self.logs = []

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logs.append(dict(logs))

    reporter = Reporter()
    args = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=2,
        gradient_accumulation_steps=2, max_steps=2, logging_steps=1, eval_strategy="steps", eval_steps=1,
        report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals, optimizers=(opt, None),
                      callbacks=[reporter])
    callback = MuonClipTrainerCallback().install(trainer)
    assert trainer.callback_handler.callbacks[0] is callback
    trainer.train()

    # two optimizer steps, each after two training micro-batches (eval forwards are not in refs)
    assert opt.steps_taken == 2 and len(clips) == 2
    mixed = 0
    for step, (max_logits, clipped) in enumerate(clips):
        assert set(max_logits) == set(refs)
        for name in refs:
            a, b = refs[name][2 * step], refs[name][2 * step + 1]
            expected = torch.maximum(a, b)
            torch.testing.assert_close(max_logits[name], expected, rtol=1e-4, atol=1e-5)
            # no head within 1e-3 of tau (the data), so maxima that agree to 1e-4 are on the same
            # side of it on any machine: the clipped heads are exactly those of the reference
            assert ((expected - tau).abs() > 1e-3 * tau).all()
            assert torch.equal(clipped[name], expected > tau)
            mixed += int(((a > b).any() & (b > a).any()).item())
    assert mixed > 0, "the data never made both micro-batches hold a head's max: the test could not tell them apart"
    n_clipped = [int(sum(c.sum() for c in clipped.values())) for _, clipped in clips]
    assert 0 < sum(n_clipped) < 2 * 2 * 4, f"tau should clip some heads but not all, got {n_clipped}"

    # the callback's figures == MuonClip's record, in log_history and in the reporter that runs after it
    train_logs = [h for h in trainer.state.log_history if "loss" in h and "eval_loss" not in h]
    seen = [h for h in reporter.logs if "loss" in h]
    assert [h["step"] for h in train_logs] == [1, 2] and len(seen) == 2
    for (max_logits, clipped), hist, rep in zip(clips, train_logs, seen):
        m, c = _figures(max_logits, clipped)
        for logs in (hist, rep):
            assert logs["muonclip/max_logit"] == pytest.approx(m, rel=1e-6)
            assert logs["muonclip/max_logit_peak"] == pytest.approx(m, rel=1e-6)
            assert logs["muonclip/max_logit_peak_is_bound"] == logs["muonclip/max_logit_is_bound"]
            assert c == 0 or logs["muonclip/max_logit_is_bound"] == 0.0  # a clipped head's max is exact
            assert logs["muonclip/clipped_heads"] == c
            assert logs["muonclip/clipped_fraction"] == pytest.approx(c / 8)
            assert 0.05 < logs["muonclip/update_rms"] < 0.25  # rms scale: ~0.2 times ns5's singular values
    assert not any(k.startswith("muonclip/") for h in trainer.state.log_history if "eval_loss" in h for k in h)


def _hf_trainer_run(tmp_path, side: str | None):
    """Three optimizer steps (gradient accumulation 2, one epoch) of a tiny Llama under the HF
    Trainer. ``side``: None; ``"evaluate"``, an evaluation after every step on 48-token rows (the
    training rows have 8); ``"generate"``, ``model.generate()`` on a 24-token prompt after every
    step, the model left in training mode. Returns (model, clips, what a `MaxLogitMonitor` saw of
    each side pass as (index of the next clip, maxima))."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from muonclip.attention import MaxLogitMonitor

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, initializer_range=0.25,
                      max_position_embeddings=64, pad_token_id=0)
    model = LlamaForCausalLM(cfg)
    opt = MuonClip(model, lr=0.02, tau=HF_TAU)
    clips = _spy_clips(opt)
    g = torch.Generator().manual_seed(1)
    train = [{"input_ids": r, "labels": r.clone()} for r in (torch.randint(1, 64, (8,), generator=g) for _ in range(12))]
    evals = [{"input_ids": r, "labels": r.clone()} for r in (torch.randint(1, 64, (48,), generator=g) for _ in range(4))]
    prompt = torch.randint(1, 64, (2, 24), generator=g)
    seen: list[tuple[int, dict]] = []
    monitor = MaxLogitMonitor(opt.layers)

    class SidePass(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if side == "generate":
                assert model.training
                with monitor:
                    model.generate(prompt, max_new_tokens=2, do_sample=False)
                seen.append((len(clips), monitor.max_logits))
            else:
                monitor.__enter__()  # the evaluation runs next, before on_evaluate

        def on_evaluate(self, args, state, control, **kwargs):
            monitor.__exit__(None, None, None)
            seen.append((len(clips), monitor.max_logits))

    args = TrainingArguments(
        output_dir=str(tmp_path / str(side)), per_device_train_batch_size=2, per_device_eval_batch_size=2,
        gradient_accumulation_steps=2, max_steps=3, eval_strategy="steps" if side == "evaluate" else "no",
        eval_steps=1, logging_strategy="no", report_to="none", save_strategy="no", use_cpu=True, disable_tqdm=True,
        dataloader_num_workers=0, seed=0,
    )
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evals if side == "evaluate" else None,
                      optimizers=(opt, None), callbacks=[SidePass()] if side else [])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # generate() in training mode, generation-config notes
        trainer.train()
    assert opt.steps_taken == 3
    return model, clips, seen


HF_TAU = 1.5  # this tiny Llama's training max logits are ~1.3-3: some heads clip at every step


@pytest.mark.parametrize("side", ["evaluate", "generate"])
def test_hf_trainer_evaluation_and_generation_do_not_change_training(tmp_path, side):
    """With ``eval_strategy="steps", eval_steps=1`` (or ``model.generate()`` after every step) the
    run ends bit-identical to the same run without: the same clips, the same weights. Guaranteed
    by the code because the side passes feed no recorder and training draws no random numbers
    after them (no dropout; the one epoch's order is drawn before the first evaluation, which
    itself draws a DataLoader seed). The side passes' max logits do exceed the next step's, above
    tau, so had they fed the clip, a gamma would differ."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    model_a, clips_a, _ = _hf_trainer_run(tmp_path, None)
    model_b, clips_b, seen = _hf_trainer_run(tmp_path, side)
    assert len(seen) == 3
    assert _would_change_a_clip(seen, clips_a, HF_TAU), "the side passes' logits never exceeded training's"
    _assert_same_training(clips_a, clips_b, model_a, model_b)


# ----------------------------------------------------------------------------------------------
# PyTorch Lightning
# ----------------------------------------------------------------------------------------------

GPT_CFG = dict(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)


def _lightning_module(tau: float):
    import lightning.pytorch as pl

    class LitGPT(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.model = GPT(GPTConfig(**GPT_CFG))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return self.model(x, y)[1]

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val_loss", self.model(x, y)[1])

        def configure_optimizers(self):
            opt = MuonClip(self.model, lr=0.02, tau=tau)
            self.clips = _spy_clips(opt)
            return opt

    return LitGPT()


def _loader():
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, 64, (8, 17), generator=g)
    ds = torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:])
    return torch.utils.data.DataLoader(ds, batch_size=2, shuffle=False)


def _trainer(max_epochs: int, callbacks, **kwargs):
    import lightning.pytorch as pl

    return pl.Trainer(
        max_epochs=max_epochs, accumulate_grad_batches=2, accelerator="cpu", devices=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        **kwargs,
    )


def test_lightning_accumulation_callback_and_resume_is_identical(tmp_path):
    """Exact on any machine: the recorder folds micro-batches with torch.maximum (exact), and the resumed
    run is the same process running the same ops on the same values (Lightning's checkpoint holds
    exact copies; no dropout, data not shuffled; the CPU chunk choice only takes chunkings equal to
    the whole batch)."""
    pytest.importorskip("lightning")
    from muonclip.integrations.lightning import MuonClipLightningCallback

    tau = 0.05  # this tiny GPT's max logits are ~0.05-0.07 per step: some heads clip, some do not
    # uninterrupted: 2 epochs x 4 batches / accumulate 2 = 4 optimizer steps
    full = _lightning_module(tau)
    updates: dict[int, list[torch.Tensor]] = {}
    for i, attn in enumerate(full.model.attention_modules()):
        rec = attn.recorder
        orig = rec.update

        def update(per_head_max, is_bound=None, _i=i, _orig=orig):
            updates.setdefault(_i, []).append(per_head_max.detach().clone())
            _orig(per_head_max, is_bound)

        rec.update = update
    callback = MuonClipLightningCallback()
    trainer = _trainer(2, [callback])
    trainer.fit(full, _loader())
    opt = unwrap_optimizer(trainer.optimizers[0])
    assert isinstance(opt, MuonClip) and opt.steps_taken == 4
    # the last clip used the max over the last two micro-batches
    for i in range(2):
        expected = torch.maximum(updates[i][-2], updates[i][-1])
        assert torch.equal(opt.last_max_logits[f"blocks.{i}.attn"], expected)
    m, c = _figures(opt.last_max_logits, opt.last_clipped)
    assert float(trainer.callback_metrics["muonclip/max_logit"]) == pytest.approx(m, rel=1e-6)
    assert float(trainer.callback_metrics["muonclip/clipped_heads"]) == c
    assert "muonclip/update_rms" in trainer.callback_metrics

    # interrupted: 1 epoch, checkpoint, resume to 2 epochs in a fresh module and trainer
    first = _lightning_module(tau)
    t1 = _trainer(1, [MuonClipLightningCallback()])
    t1.fit(first, _loader())
    ckpt = tmp_path / "epoch1.ckpt"
    t1.save_checkpoint(ckpt)
    resumed = _lightning_module(tau)
    t2 = _trainer(2, [MuonClipLightningCallback()])
    t2.fit(resumed, _loader(), ckpt_path=str(ckpt))
    opt2 = unwrap_optimizer(t2.optimizers[0])
    assert opt2.steps_taken == 4 and t2.global_step == trainer.global_step == 4
    for (name, a), b in zip(full.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), f"{name} differs after resume"
    for p_full, p_res in zip(full.parameters(), resumed.parameters()):
        for key in opt.state[p_full]:
            sa, sb = opt.state[p_full][key], opt2.state[p_res][key]
            assert torch.equal(torch.as_tensor(sa), torch.as_tensor(sb)), key
    n_clipped = [sum(int(c.sum()) for c in clipped.values()) for _, clipped in full.clips]
    assert len(n_clipped) == 4 and 0 < sum(n_clipped) < 4 * 8, f"tau should clip some heads, not all: {n_clipped}"
    assert sum(n_clipped[:2]) > 0, "the checkpointed epoch should include clipped steps"


def test_lightning_validation_does_not_change_training():
    """Validation after every training batch (so inside accumulation windows, plus the sanity
    check before training), on 8-row batches whose max logits exceed the next clip's above tau:
    the run ends bit-identical to the same run without validation (same clips, same weights),
    with the callback installed in both. Guaranteed by the code: validation runs in eval mode
    under inference_mode, feeds no recorder, and training draws no random numbers (no dropout,
    no shuffling)."""
    pytest.importorskip("lightning")
    import lightning.pytorch as pl

    from muonclip.attention import MaxLogitMonitor
    from muonclip.integrations.lightning import MuonClipLightningCallback

    tau = 0.05
    plain = _lightning_module(tau)
    _trainer(2, [MuonClipLightningCallback()]).fit(plain, _loader())

    seen: list[tuple[int, dict]] = []

    class Watch(pl.Callback):
        def on_validation_start(self, trainer, pl_module):
            self.monitor = MaxLogitMonitor(unwrap_optimizer(trainer.optimizers[0]).layers).__enter__()

        def on_validation_end(self, trainer, pl_module):
            self.monitor.__exit__(None, None, None)
            seen.append((len(pl_module.clips), self.monitor.max_logits))

    g = torch.Generator().manual_seed(3)
    val = torch.randint(0, 64, (16, 17), generator=g)
    val_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(val[:, :-1], val[:, 1:]), batch_size=8)
    validated = _lightning_module(tau)
    _trainer(2, [MuonClipLightningCallback(), Watch()], val_check_interval=1).fit(validated, _loader(), val_loader)
    # sanity check, then after each of the 8 training batches: after an odd one, inside an accumulation window
    assert [i for i, _ in seen] == [0, 0, 1, 1, 2, 2, 3, 3, 4]  # clips done before each validation
    assert _would_change_a_clip(seen, plain.clips, tau), "validation logits never exceeded training's"
    _assert_same_training(plain.clips, validated.clips, plain, validated)


# ----------------------------------------------------------------------------------------------
# TensorBoard writer
# ----------------------------------------------------------------------------------------------


def test_tensorboard_writer_round_trip_and_purge_on_resume(tmp_path):
    pytest.importorskip("tensorboard")
    from muonclip.integrations.tensorboard import TensorBoardWriter, read_scalars, scalars

    row = {"step": 1, "loss": 2.5, "val_loss": None, "lr": 1e-3, "max_logits": [1.5, float("nan")], "clipped": [0, 2],
           "max_logit": float("inf"), "optimizer": "muonclip", "flag": True}
    assert scalars(row) == {"loss": 2.5, "lr": 1e-3, "max_logits/0": 1.5, "clipped/0": 0.0, "clipped/1": 2.0}

    with TensorBoardWriter(tmp_path) as tb:
        for step in (1, 2, 3):
            tb.write({"step": step, "loss": 10.0 - step, "max_logits": [float(step), 2.0 * step]})
    got = read_scalars(tmp_path)
    assert got["loss"] == [(1, 9.0), (2, 8.0), (3, 7.0)]
    assert got["max_logits/1"] == [(1, 2.0), (2, 4.0), (3, 6.0)]
    # resume from a checkpoint at step 2: step 3 is written again and the old step 3 is purged
    with TensorBoardWriter(tmp_path, purge_step=3) as tb:
        tb.write({"step": 3, "loss": 0.5})
    assert read_scalars(tmp_path)["loss"] == [(1, 9.0), (2, 8.0), (3, 0.5)]
    with pytest.raises(ValueError, match="step"):
        TensorBoardWriter(tmp_path / "x").write({"loss": 1.0})


def test_cli_train_tensorboard_matches_the_jsonl_metrics_and_resume_purges(tmp_path):
    pytest.importorskip("tensorboard")
    from muonclip.app.data import builtin_corpus_dir, read_document
    from muonclip.app.main import main
    from muonclip.app.metrics import read_rows
    from muonclip.integrations.tensorboard import read_scalars

    text = tmp_path / "macbeth.txt"
    text.write_text(read_document(builtin_corpus_dir() / "tragedies" / "macbeth.md"))
    run, tb = tmp_path / "run", tmp_path / "tb"
    common = ["--quiet", "--out", str(run), "--tensorboard", str(tb)]
    assert main(["train", "--preset", "tiny", "--threads", "1", "--data", str(text), "--tau", "0.05",
                 "--steps", "2", *common]) == 0
    saved = {name: (run / name).read_bytes() for name in ("checkpoint.json", "checkpoint-step2.pt")}
    assert main(["train", "--resume", "--steps", "3", *common]) == 0
    # a crash after step 3, before its checkpoint: resuming from step 2 rewrites step 3, once
    for name, data in saved.items():
        (run / name).write_bytes(data)
    assert main(["train", "--resume", "--steps", "4", *common]) == 0
    rows = read_rows(run)
    got = read_scalars(tb)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [s for s, _ in got["loss"]] == [1, 2, 3, 4]
    for key in ("loss", "max_logit", "clipped_heads", "update_rms", "lr"):
        assert [v for _, v in got[key]] == pytest.approx([r[key] for r in rows], rel=1e-6), key
    assert [v for _, v in got["max_logits/0"]] == pytest.approx([r["max_logits"][0] for r in rows], rel=1e-6)
