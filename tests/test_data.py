"""The text corpus, tokenizer, split and deterministic batches of the command-line tool."""

from __future__ import annotations

import pytest
import torch

from muonclip.app.data import (
    CONTROL_SHARE,
    MAX_EPOCHS,
    DataError,
    builtin_corpus_dir,
    check_fits,
    corpus_warnings,
    decode,
    encode,
    list_documents,
    load_corpus,
    read_document,
    strip_markdown,
    train_batch,
    val_batches,
)


def test_strip_markdown_exact():
    md = (
        "# Hamlet\n\n## ACT I\n\n### SCENE I. Elsinore.\n\n_FRANCISCO at his post_\n\n"
        "**BERNARDO**  \nWho's there?  \nStand\\[ho\\]!\n\n\n\n__\\[Aside]_  \nNay.\n"
    )
    assert strip_markdown(md) == (
        "Hamlet\n\nACT I\n\nSCENE I. Elsinore.\n\nFRANCISCO at his post\n\n"
        "BERNARDO\nWho's there?\nStand[ho]!\n\n[Aside]\nNay.\n"
    )


def test_byte_tokenizer_roundtrip():
    text = "O Romeo, Romeo! — wherefore art thou? ñ 日本"
    t = encode(text)
    assert t.dtype == torch.uint8 and t.numel() == len(text.encode("utf-8"))
    assert decode(t) == text
    assert encode("").numel() == 0


def test_builtin_corpus_is_the_38_plays_as_plain_text():
    files = list_documents(None)
    assert len(files) == 38 and all(f.suffix == ".md" for f in files)
    assert files[0].is_relative_to(builtin_corpus_dir())
    hamlet = read_document(builtin_corpus_dir() / "tragedies" / "hamlet.md")
    assert hamlet.startswith("Hamlet\n\nACT I\n\nSCENE I. Elsinore.")
    assert "BERNARDO\nWho's there?\n" in hamlet
    assert not set("*_#\\") & set(hamlet)


def test_split_rule_is_each_documents_tail(tmp_path):
    (tmp_path / "a.txt").write_text("a" * 80 + "b" * 20)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("**X** " + "c" * 94)  # .md is stripped: "X " + 94 c's
    (tmp_path / "ignored.bin").write_bytes(b"\x00\x01")
    corpus = load_corpus(tmp_path, val_fraction=0.2)
    c_doc = "X " + "c" * 94 + "\n"  # 97 chars: cut at round(97 * 0.8) = 78
    assert decode(corpus.train) == "a" * 80 + "\n\n" + c_doc[:78]
    assert decode(corpus.val) == "b" * 20 + "\n\n" + c_doc[78:]
    assert corpus.n_documents == 2


def test_builtin_split_is_fixed_and_about_five_percent():
    """Exact: the split is byte indexing of the same files."""
    c1, c2 = load_corpus(), load_corpus()
    assert torch.equal(c1.train, c2.train) and torch.equal(c1.val, c2.val)
    frac = c1.val.numel() / (c1.val.numel() + c1.train.numel())
    assert 0.045 < frac < 0.055


def test_batches_are_a_function_of_seed_and_step(tmp_path):
    """Exact on any machine: torch.Generator's CPU generator (mt19937) is the same algorithm everywhere,
    and windows are slices of the stream."""
    (tmp_path / "t.txt").write_text("".join(chr(97 + i % 26) for i in range(5000)))
    c = load_corpus(tmp_path / "t.txt")
    x1, y1 = train_batch(c, 7, batch_size=4, block_size=16, seed=3)
    x2, y2 = train_batch(c, 7, batch_size=4, block_size=16, seed=3)
    x3, _ = train_batch(c, 8, batch_size=4, block_size=16, seed=3)
    x4, _ = train_batch(c, 7, batch_size=4, block_size=16, seed=4)
    assert x1.shape == y1.shape == (4, 16) and x1.dtype == torch.long
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3) and not torch.equal(x1, x4)
    assert torch.equal(x1[:, 1:], y1[:, :-1])  # targets are inputs shifted by one
    # the windows are real slices of the training stream
    for row_x, row_y in zip(x1, y1):
        seq = torch.cat([row_x, row_y[-1:]]).to(torch.uint8)
        starts = [i for i in range(c.train.numel() - 16) if torch.equal(c.train[i : i + 17], seq)]
        assert starts


def test_val_batches_fixed_and_cover_the_stream(tmp_path):
    """Exact: windows are slices of the stream at fixed offsets (linspace's end points are exact)."""
    (tmp_path / "t.txt").write_text("x" * 4000 + "".join(chr(97 + i % 26) for i in range(1000)))
    c = load_corpus(tmp_path / "t.txt", val_fraction=0.2)
    vb = val_batches(c, n_batches=3, batch_size=2, block_size=8)
    assert len(vb) == 3 and all(x.shape == (2, 8) for x, _ in vb)
    first, last = vb[0][0][0], vb[-1][1][-1]
    assert torch.equal(first, c.val[:8].long())  # first window starts at 0
    assert torch.equal(last, c.val[-8:].long())  # last window ends at the end
    assert all(torch.equal(a[0], b[0]) for a, b in zip(vb, val_batches(c, n_batches=3, batch_size=2, block_size=8)))


@pytest.mark.parametrize("make", ["missing", "empty_file", "empty_folder", "whitespace"])
def test_bad_data_paths_raise_clear_errors(tmp_path, make):
    path = tmp_path / "data"
    if make == "empty_file":
        path.write_text("")
    elif make == "empty_folder":
        path.mkdir()
    elif make == "whitespace":
        path.write_text("  \n\n ")
    with pytest.raises(DataError, match=r"no such file|holds no|is empty"):
        load_corpus(path)


def test_corpus_smaller_than_one_batch(tmp_path):
    (tmp_path / "t.txt").write_text("To be, or not to be: that is the question." * 10)
    c = load_corpus(tmp_path / "t.txt")
    with pytest.raises(DataError, match="fewer than one batch"):
        check_fits(c, batch_size=8, block_size=64)
    check_fits(c, batch_size=2, block_size=8)  # small enough: no error


def test_files_that_are_not_text_are_refused(tmp_path):
    """Not UTF-8 (random bytes, Latin-1) or more than a tenth control characters (UTF-16 text,
    a NUL every other byte; control bytes): a DataError naming the file. Whitespace controls,
    a few escape sequences and exactly a tenth of control characters are still text."""
    g = torch.Generator().manual_seed(0)
    cases = {
        "random.bin": (bytes(torch.randint(0, 256, (5000,), generator=g).tolist()), "is not UTF-8 text"),
        "latin1.txt": ("Ça, c'est déjà l'été.\n".encode("latin-1") * 20, "byte 0xc7 at offset 0"),
        "utf16.txt": ("Is this a dagger which I see before me?\n".encode("utf-16-le") * 20, "is not text: 50%"),
        "controls.txt": (bytes(torch.randint(0, 32, (400,), generator=g).tolist()) + b"words " * 100, "is not text"),
    }
    for name, (data, match) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=match) as e:
            load_corpus(tmp_path / name)
        assert str(tmp_path / name) in str(e.value)
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.txt").write_text("The raven himself is hoarse.\n" * 20)
    (folder / "b.txt").write_bytes(cases["utf16.txt"][0])
    with pytest.raises(DataError, match="b.txt is not text"):  # the one bad file of a folder is named
        load_corpus(folder)
    share = CONTROL_SHARE
    text = "\t\x1b[1mBold\x1b[0m words\r\n\f" * 50  # whitespace and 2 ESC in 26 characters
    ok = "x" * int(100 * (1 - share)) + "\x00" * int(100 * share)  # exactly the limit
    for i, body in enumerate((text, ok)):
        (tmp_path / f"fine{i}.txt").write_text(body)
        assert load_corpus(tmp_path / f"fine{i}.txt").train.numel() > 0
    (tmp_path / "over.txt").write_text(ok + "\x00")
    with pytest.raises(DataError, match="is not text"):
        load_corpus(tmp_path / "over.txt")


def test_corpus_warnings_name_what_is_doubtful(tmp_path):
    """More than MAX_EPOCHS passes over the training bytes, or a validation split smaller than
    one batch: a warning each (not an error); neither for a corpus large enough."""
    (tmp_path / "t.txt").write_text("".join(chr(97 + i % 26) for i in range(10_000)))
    c = load_corpus(tmp_path / "t.txt", val_fraction=0.1)  # 9,000 training bytes, 1,000 validation
    assert c.train.numel() == 9000 and c.val.numel() == 1000
    at_limit = MAX_EPOCHS * 9000 // (4 * 16)
    assert corpus_warnings(c, steps=at_limit, batch_size=4, block_size=16) == []
    (over,) = corpus_warnings(c, steps=at_limit + 1, batch_size=4, block_size=16)
    assert "about 10 times" in over and "9,000 training bytes" in over
    (val,) = corpus_warnings(c, steps=1, batch_size=8, block_size=125)  # 8 x 125 + 1 = 1,001 > 1,000
    assert "validation split holds 1,000 bytes" in val and "val_fraction" in val
    assert corpus_warnings(c, steps=1, batch_size=8, block_size=124) == []
