"""Hugging Face Trainer: a tiny Llama (built from a LlamaConfig, nothing downloaded) trained with MuonClip.

    python examples/hf_trainer_llama.py --steps 10

``MuonClip(model)`` finds the Llama's attention layers, switches the model to the
``"muonclip"`` attention (SDPA that also records per-head max logits) and returns one
optimizer for the whole model; the Trainer takes it as ``optimizers=(opt, None)`` (None: the
Trainer's usual schedule). With ``gradient_accumulation_steps=2`` the Trainer calls
``opt.step()`` once per two micro-batches, so the clip sees the max over both.
`MuonClipTrainerCallback` adds ``muonclip/max_logit``, ``muonclip/clipped_heads`` and
``muonclip/update_rms`` to every training log (console, ``log_history``, ``report_to``).

``muonclip.Muon``/``MuonClip`` need torch alone; the text (the app's built-in corpus) needs
``pip install "muonclip[cli]"``, and ``transformers``/``accelerate`` ``pip install "muonclip[hf]"``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from muonclip import MuonClip
from muonclip.app.data import load_corpus
from muonclip.integrations.hf import MuonClipTrainerCallback


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10, help="optimizer steps (default 10)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--tau", type=float, default=30.0, help="QK-Clip threshold (default 30; Kimi K2: 100)")
    ap.add_argument("--out", default=None, help="Trainer output_dir (default: a temporary folder)")
    args = ap.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=args.block_size, pad_token_id=0,
    )
    model = LlamaForCausalLM(config)  # GQA: 4 query heads share 2 key/value heads

    corpus = load_corpus()  # built-in Shakespeare, byte tokens
    T = args.block_size
    n = min(corpus.train.numel() // T, 4 * args.steps * 2 + 8)
    chunks = corpus.train[: n * T].long().view(n, T)
    dataset = [{"input_ids": c, "labels": c.clone()} for c in chunks]

    opt = MuonClip(model, lr=args.lr, tau=args.tau)
    with tempfile.TemporaryDirectory() as tmp:
        targs = TrainingArguments(
            output_dir=args.out or tmp, max_steps=args.steps, per_device_train_batch_size=4,
            gradient_accumulation_steps=2, logging_steps=1, report_to="none", save_strategy="no",
            use_cpu=True, disable_tqdm=True, seed=0,
        )
        trainer = Trainer(model=model, args=targs, train_dataset=dataset, optimizers=(opt, None))
        MuonClipTrainerCallback().install(trainer)
        trainer.train()
    logs = [h for h in trainer.state.log_history if "muonclip/max_logit" in h]
    first, last = logs[0], logs[-1]
    print(f"trained {trainer.state.global_step} steps: loss {first['loss']:.3f} -> {last['loss']:.3f}, "
          f"peak max logit {max(h['muonclip/max_logit'] for h in logs):.3f}, "
          f"clipped heads in total {int(sum(h['muonclip/clipped_heads'] for h in logs))}")


if __name__ == "__main__":
    main()
