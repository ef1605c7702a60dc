"""Reference models: a small GPT with MHA, GQA/MQA and MLA attention."""

from ._gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
