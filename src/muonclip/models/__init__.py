"""Reference models: a small GPT with MHA, GQA/MQA and MLA attention."""

from .gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
