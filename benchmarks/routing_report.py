"""Print ``muonclip.param_groups(model).report()`` for tiny transformers models built from configs.

Not a benchmark and not a test: a record of how each model's weights are routed and cut into
matrices (Phi-3, Mixtral, DeepSeek-V3, Qwen2-MoE, GPT-2, GPT-NeoX, gpt-oss, Llama; nothing
downloaded).
It uses only ``param_groups(model)`` and ``.report()``, so it runs against older versions of the
library too (to compare routings before and after a change); ``--per-head`` adds the reports
with ``per_head=True`` where the installed version has that option.

    python benchmarks/routing_report.py [--per-head] [--models phi3,gpt_neox]
"""

from __future__ import annotations

import argparse
import inspect
import warnings

import muonclip


def configs() -> dict:
    import transformers as T

    return {
        "phi3": T.Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0),
        "mixtral": T.MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                   num_experts_per_tok=2),
        "deepseek_v3": T.DeepseekV3Config(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                          num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
                                          num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
                                          num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=24,
                                          kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8),
        "qwen2_moe": T.Qwen2MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24, num_hidden_layers=1, num_attention_heads=4,
                                      num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
        "gpt2": T.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, n_positions=16),
        "gpt_neox": T.GPTNeoXConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4),
        "gpt_oss": T.GptOssConfig(vocab_size=64, hidden_size=24, intermediate_size=12, num_hidden_layers=1,
                                  num_attention_heads=3, num_key_value_heads=1, head_dim=8, num_local_experts=3,
                                  num_experts_per_tok=2),
        "llama": T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=4, num_key_value_heads=2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-head", action="store_true", help="also print the reports with per_head=True")
    parser.add_argument("--models", default="", help="comma-separated subset of the models (default: all)")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    cfgs = configs()
    wanted = [m for m in args.models.split(",") if m] or list(cfgs)
    per_head = args.per_head and "per_head" in inspect.signature(muonclip.param_groups).parameters
    print(f"muonclip {muonclip.__version__} from {muonclip.__file__}; transformers {transformers.__version__}")
    for name in wanted:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfgs[name])
        print(f"\n### {name} ({type(model).__name__})\n\n```\n{muonclip.param_groups(model).report()}\n```")
        if per_head:
            report = muonclip.param_groups(model, per_head=True).report()
            print(f"\nwith per_head=True:\n\n```\n{report}\n```")


if __name__ == "__main__":
    main()
