"""Text data for the command-line tool: the built-in Shakespeare corpus (or the user's text),
a byte-level tokenizer, a fixed train/validation split, and deterministic batches."""

from .batches import MAX_EPOCHS, check_fits, corpus_warnings, step_seed, train_batch, val_batches
from .corpus import (
    CONTROL_SHARE,
    VOCAB_SIZE,
    Corpus,
    DataError,
    builtin_corpus_dir,
    corpus_size,
    decode,
    encode,
    list_documents,
    load_corpus,
    read_document,
    strip_markdown,
)

__all__ = [
    "CONTROL_SHARE",
    "MAX_EPOCHS",
    "VOCAB_SIZE",
    "Corpus",
    "DataError",
    "builtin_corpus_dir",
    "check_fits",
    "corpus_size",
    "corpus_warnings",
    "decode",
    "encode",
    "list_documents",
    "load_corpus",
    "read_document",
    "step_seed",
    "strip_markdown",
    "train_batch",
    "val_batches",
]
