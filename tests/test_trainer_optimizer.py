"""MuonClip / Muon in the Hugging Face Trainer and TRL's SFTTrainer through `trainer_optimizer`: the same
weights as optimizers=(MuonClip(model, ...), None) after N steps; the class handed a list raises a
TypeError saying what to pass; TrainingArguments that disagree with the optimizer warn."""

from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from muonclip import Muon, MuonClip, param_groups  # noqa: E402
from muonclip.integrations.hf import MuonClipTrainerCallback, TrainerArgumentsWarning, trainer_optimizer  # noqa: E402

VOCAB, T, STEPS = 260, 16, 3
LR, WD, TAU = 2e-2, 0.05, 5.0


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0, attention_dropout=0.0)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():  # larger q/k: some heads above tau, so the clip acts during the steps
        for name, p in model.named_parameters():
            if ("q_proj" in name or "k_proj" in name) and p.ndim == 2:
                p.mul_(8.0)
    return model


def _dataset(n: int = 12):
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, VOCAB, (n, T), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _args(tmp_path, **kw) -> TrainingArguments:
    base = dict(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=4, learning_rate=LR,
                weight_decay=WD, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, seed=0,
                lr_scheduler_type="linear", warmup_steps=1, dataloader_num_workers=0, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=n)


def test_trainer_optimizer_gives_the_weights_of_the_optimizer_passed_in(tmp_path):
    args = _args(tmp_path)
    ref_model = _model()
    ref_opt = MuonClip(ref_model, lr=LR, weight_decay=WD, tau=TAU)
    Trainer(ref_model, args, train_dataset=_dataset(), optimizers=(ref_opt, None)).train()
    assert any(bool(c.any()) for c in ref_opt.last_clipped.values()) or ref_opt.last_max_logits

    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainerArgumentsWarning)  # lr and weight_decay come from args: no warning
        pair = trainer_optimizer(MuonClip, args=args, tau=TAU)
    trainer = Trainer(model, args, train_dataset=_dataset(), optimizer_cls_and_kwargs=pair)
    trainer.train()
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, MuonClip) and opt.defaults["lr"] == LR and opt.defaults["weight_decay"] == WD
    assert opt.steps_taken == STEPS
    _assert_same_weights(model, ref_model)


def test_trainer_with_muon_through_trainer_optimizer_routes_the_model(tmp_path):
    args = _args(tmp_path, max_steps=2)
    ref_model = _model()
    Trainer(ref_model, args, train_dataset=_dataset(),
            optimizers=(Muon(param_groups(ref_model), lr=LR, weight_decay=WD), None)).train()
    model = _model()
    Trainer(model, args, train_dataset=_dataset(), optimizer_cls_and_kwargs=trainer_optimizer(Muon, args=args)).train()
    _assert_same_weights(model, ref_model)


def test_the_class_handed_a_list_says_what_to_pass(tmp_path):
    args = _args(tmp_path)
    for cls in (MuonClip, Muon):
        trainer = Trainer(_model(), args, train_dataset=_dataset(), optimizer_cls_and_kwargs=(cls, {"lr": LR}))
        with pytest.raises(TypeError, match=r"trainer_optimizer\(" + cls.__name__):
            trainer.create_optimizer()
    with pytest.raises(TypeError, match="takes parameters or param groups, got the model"):
        Muon(_model())
    model = _model()  # the Trainer hands a "model" entry of the kwargs to the class in place of the groups
    trainer = Trainer(model, args, train_dataset=_dataset(),
                      optimizer_cls_and_kwargs=(MuonClip, {"model": model, "lr": LR, "tau": TAU}))
    assert isinstance(trainer.create_optimizer(), MuonClip)


def test_disagreeing_training_arguments_warn(tmp_path):
    args = _args(tmp_path)
    with pytest.warns(TrainerArgumentsWarning, match=r"learning_rate=0.02 but the optimizer's lr=0.001"):
        _, kwargs = trainer_optimizer(MuonClip, args=args, lr=1e-3)
    assert kwargs == {"lr": 1e-3, "weight_decay": WD}
    opt = MuonClip(_model(), lr=1e-3, weight_decay=WD, tau=TAU)
    callback = MuonClipTrainerCallback()
    with pytest.warns(TrainerArgumentsWarning, match="learning_rate=0.02 but the optimizer's lr=0.001"):
        callback.on_train_begin(args, None, None, optimizer=opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainerArgumentsWarning)
        callback.on_train_begin(args, None, None, optimizer=MuonClip(_model(), lr=LR, weight_decay=WD, tau=TAU))
    with pytest.raises(TypeError, match="builds muonclip.MuonClip or muonclip.Muon"):
        trainer_optimizer(torch.optim.AdamW)


def _byte_tokenizer():
    """A byte-level tokenizer made locally with `tokenizers` (256 byte symbols, <eos>, <pad>): nothing downloaded."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["<eos>"], vocab["<pad>"] = len(vocab), len(vocab) + 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def test_trl_sft_trainer_with_trainer_optimizer(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    tokenizer = _byte_tokenizer()
    assert len(tokenizer) <= VOCAB
    lines = ["To be, or not to be", "All the world's a stage", "Now is the winter of our discontent",
             "If music be the food of love, play on", "Friends, Romans, countrymen", "A horse! a horse!"] * 2
    data = datasets.Dataset.from_dict({"text": lines})
    cfg = trl.SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, learning_rate=LR,
                        weight_decay=WD, report_to=[], use_cpu=True, save_strategy="no", seed=0, max_length=T,
                        packing=False, dataloader_num_workers=0, disable_tqdm=True, logging_steps=1)

    ref_model = _model()
    ref_model.config.pad_token_id = tokenizer.pad_token_id
    ref_opt = MuonClip(ref_model, lr=LR, weight_decay=WD, tau=TAU)
    trl.SFTTrainer(model=ref_model, args=cfg, train_dataset=data, processing_class=tokenizer,
                   optimizers=(ref_opt, None)).train()

    model = _model()
    model.config.pad_token_id = tokenizer.pad_token_id
    trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=data, processing_class=tokenizer,
                             optimizer_cls_and_kwargs=trainer_optimizer(MuonClip, args=cfg, tau=TAU))
    trainer.train()
    assert ref_opt.steps_taken == 2
    _assert_same_weights(model, ref_model)
