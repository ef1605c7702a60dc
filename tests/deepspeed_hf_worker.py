"""The Hugging Face cases `tests/test_deepspeed.py` runs under DeepSpeed: the Trainer with
``TrainingArguments(deepspeed=...)`` and accelerate's ``DeepSpeedPlugin``, each through its recipe
in docs/integrations.md, on a tiny Llama built from a config (GQA: 3 query heads of 8 rows over
1 key-value head).

Each case records the batches it fed (every rank's, in rank order: the global batch of each
step), so `reference` replays them in one plain process, whatever order the Trainer's sampler
chose.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

VOCAB, T, STEPS, MICRO = 64, 12, 3, 2
LR, WD, TAU = 0.02, 0.1, 0.9  # exact max logits 0.7-1.2: 4, 4 and 1 of the 6 heads clip at the 3 steps
OPT = {"orth_dtype": torch.float32}


def llama(seed: int = 0):
    """A 2-layer Llama, q/k scaled up so that some heads clip and some do not."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=3, num_key_value_heads=1, head_dim=8, pad_token_id=0,
                      attention_dropout=0.0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(6.0)
    return model


def dataset(world: int) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, VOCAB, (STEPS * MICRO * world, T), generator=g)
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def ds_config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9}


class _Recorder:
    """Every forward's ``input_ids`` (a forward pre-hook) and the heads clipped after every step."""

    def __init__(self, model) -> None:
        self.inputs: list[torch.Tensor] = []
        model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.inputs.append((kwargs.get("input_ids") if "input_ids" in kwargs else args[0]).detach().clone())


def _global_batches(inputs: list[torch.Tensor], world: int) -> list[torch.Tensor]:
    gathered = [None] * world
    dist.all_gather_object(gathered, inputs)
    return [torch.cat([gathered[r][s] for r in range(world)]) for s in range(len(inputs))]


def fresh_state() -> None:
    """Forget the accelerate state and the Trainer's DeepSpeed config a previous case of this
    process left (accelerate keeps one state per process; the test runs several cases in one)."""
    from accelerate.state import AcceleratorState, GradientState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    unset_hf_deepspeed_config()


def _weights(engine) -> dict:
    import deepspeed_worker

    return deepspeed_worker.full_weights(engine)[0]


def run_trainer(rank: int, world: int, stage: int, folder: str) -> dict:
    """The docs' Trainer recipe (``deepspeed_trainer``) with MuonClip at ZeRO-``stage``."""
    from doc_recipes import recipe

    from muonclip.integrations import unwrap_optimizer

    fresh_state()
    model = llama()
    rec = _Recorder(model)
    trainer = recipe("deepspeed_trainer")["train"](
        model, dataset(world), ds_config(stage), tau=TAU, muonclip_kwargs=OPT, output_dir=folder, max_steps=STEPS,
        per_device_train_batch_size=MICRO, learning_rate=LR, weight_decay=WD, max_grad_norm=0.0,
        lr_scheduler_type="constant", report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
        dataloader_num_workers=0)
    opt = unwrap_optimizer(trainer.optimizer)
    return {"weights": _weights(trainer.model_wrapped), "batches": _global_batches(rec.inputs, world),
            "steps_taken": opt.steps_taken, "kind": type(opt).__name__,
            "last_clipped": {k: v.clone() for k, v in opt.last_clipped.items()}}


def run_accelerate(rank: int, world: int, stage: int) -> dict:
    """The docs' accelerate recipe (``deepspeed_accelerate``) with MuonClip at ZeRO-``stage``."""
    from doc_recipes import recipe

    from muonclip.integrations import unwrap_optimizer

    fresh_state()
    model = llama()
    rec = _Recorder(model)
    data = dataset(world)
    mine = [data[(s * world + rank) * MICRO:(s * world + rank + 1) * MICRO] for s in range(STEPS)]
    batches = [{k: torch.stack([row[k] for row in b]) for k in b[0]} for b in mine]
    engine, opt = recipe("deepspeed_accelerate")["train"](model, batches, ds_config(stage), lr=LR,
                                                           weight_decay=WD, tau=TAU, **OPT)
    opt = unwrap_optimizer(opt)
    return {"weights": _weights(engine), "batches": _global_batches(rec.inputs, world),
            "steps_taken": opt.steps_taken, "kind": type(opt).__name__,
            "last_clipped": {k: v.clone() for k, v in opt.last_clipped.items()}}


def reference(batches: list[torch.Tensor], world: int = 2) -> dict:
    """One plain process, MuonClip, on the global batches (each rank's rows one micro-batch, as
    `deepspeed_worker.reference`): the weights, the heads clipped per step, the start."""
    from muonclip import MuonClip

    model = llama()
    opt = MuonClip(model, lr=LR, weight_decay=WD, tau=TAU, process_group="local", **OPT)
    clipped = []
    for ids in batches:
        for rows in ids.chunk(world):
            (model(input_ids=rows, labels=rows).loss / world).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        clipped.append(sum(int(v.sum()) for v in opt.last_clipped.values()))
    return {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "clipped": clipped,
            "last_clipped": {k: v.clone() for k, v in opt.last_clipped.items()},
            "start": {n: p.detach().clone() for n, p in llama().named_parameters()}}
