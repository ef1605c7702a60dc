"""Run folders you can trust (muonclip.app.runfolder, muonclip.app.resume, muonclip.app.metrics): nothing
a user wrote is overwritten, one writer at a time, a kill never loses the history, a resume continues
the run's own config (or refuses), a damaged or foreign checkpoint is refused naming what is wrong."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from muonclip.app.checkpoints import load_file, read_checkpoint
from muonclip.app.main import main
from muonclip.app.metrics import JSONL, MetricsError, MetricsWriter, read_rows
from muonclip.app.runfolder import (
    RunLock,
    check_new_run_folder,
    inspect_folder,
    read_lock_token,
    recorded_tokens,
    remove_leftovers,
)
from muonclip.app.safe_files import OutputError, new_token, temporary_name

TINY = ["--preset", "tiny", "--quiet", "--threads", "1"]


@pytest.fixture(scope="module")
def run4(tmp_path_factory, text):
    """A finished muonclip run of 4 steps (checkpoint at step 4); tests copy it."""
    run = tmp_path_factory.mktemp("runs") / "run4"
    assert main(["train", *TINY, "--data", text, "--steps", "4", "--out", str(run)]) == 0
    return run


def copy_of(run, tmp_path, name="run"):
    dst = tmp_path / name
    shutil.copytree(run, dst)
    return dst


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def bad(capsys, argv, match, code=2):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == code, err
    assert "muonclip: error:" in err and match in err, err
    return err


# ------------------------------------------------------------------------------------------------
# nothing a user wrote is overwritten


def test_train_refuses_a_folder_that_is_not_one_of_its_runs(tmp_path, capsys, text):
    """On the old code `train` replaced a user's config.json and wrote into any folder (exit 0)."""
    user = tmp_path / "u"
    user.mkdir()
    (user / "config.json").write_text("precious")
    bad(capsys, ["train", *TINY, "--data", text, "--steps", "2", "--out", str(user)],
        "holds files that are not a muonclip run's ('config.json')")
    assert snapshot(user) == {"config.json": b"precious"}
    (user / "config.json").unlink()
    (user / "notes.txt").write_text("mine")
    bad(capsys, ["train", "--quiet", "--out", str(user), "--resume"],
        "holds files that are not a muonclip run's ('notes.txt')")
    assert snapshot(user) == {"notes.txt": b"mine"}
    with pytest.raises(OutputError, match="--out / holds files that are not a muonclip run's"):
        check_new_run_folder("/")  # read-only: what `train --out /` now says before writing anything


def test_a_run_whose_checkpoint_is_missing_is_never_restarted_over(tmp_path, capsys, text, run4):
    """A pointer naming a checkpoint that is gone, or no pointer in a run whose metrics go past its first
    checkpoint (so it had one): refused for a resume and for a new run, nothing modified. On the old code
    the next plain run into such a folder replaced its logged rows."""
    run = copy_of(run4, tmp_path)
    (run / "checkpoint-step4.pt").unlink()
    before = snapshot(run)
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume"],
        f"checkpoint file {run / 'checkpoint-step4.pt'} cannot be read (No such file or directory)")
    bad(capsys, ["train", *TINY, "--data", text, "--steps", "2", "--out", str(run)], "already holds a run")
    assert snapshot(run) == before
    lost = tmp_path / "lost"
    assert main(["train", *TINY, "--data", text, "--steps", "4", "--set", "checkpoint_every=2", "--out", str(lost)]) == 0
    (lost / "checkpoint.json").unlink()
    (lost / "checkpoint-step4.pt").unlink()
    before = snapshot(lost)
    bad(capsys, ["train", "--quiet", "--out", str(lost), "--resume"], "holds a run whose checkpoint (checkpoint.json) "
        "is missing: its metrics go to step 4, past its first checkpoint (step 2); it cannot be continued")
    bad(capsys, ["train", *TINY, "--data", text, "--steps", "2", "--out", str(lost)],
        "holds a run without a checkpoint (checkpoint.json), and a new run will not overwrite it")
    assert snapshot(lost) == before and len(read_rows(lost)) == 4


KILL_IN_REWRITE = """
import json, os, signal, sys
from muonclip.app import metrics

real, calls = json.dumps, {"n": 0}
def dumps(*args, **kwargs):  # the rewrite serialises one row per call: die at the k-th
    calls["n"] += 1
    if calls["n"] == int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*args, **kwargs)
json.dumps = dumps
metrics.MetricsWriter(sys.argv[1], 2, keep_until=int(sys.argv[2]))
"""


def test_a_kill_inside_the_metrics_rewrite_leaves_the_whole_old_history(tmp_path):
    """SIGKILL while a resume rewrites 3000 rows down to 2000: metrics.jsonl is the old file, byte
    for byte, and the next writer removes the temporary (on the old code, opened with "w": 499 rows)."""
    run = tmp_path / "run"
    run.mkdir()
    w = MetricsWriter(run, 2)
    for s in range(1, 3001):
        w.write({"step": s, "loss": 1.0 / s, "max_logits": [1.0, 2.0], "clipped": [0, 0]})
    w.close()
    before = (run / JSONL).read_bytes()
    proc = subprocess.run([sys.executable, "-c", KILL_IN_REWRITE, str(run), "2000", "500"], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()
    assert (run / JSONL).read_bytes() == before
    assert [p.name for p in run.iterdir() if p.name.startswith(".metrics.jsonl.muonclip-tmp-")]
    assert [r["step"] for r in read_rows(run)] == list(range(1, 3001))
    MetricsWriter(run, 2, keep_until=2000).close()
    assert [r["step"] for r in read_rows(run)] == list(range(1, 2001))


def test_torn_last_line_is_skipped_and_a_bad_line_names_the_file(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / JSONL).write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # a write cut by a kill
    assert [r["step"] for r in read_rows(run)] == [1, 2]
    (run / JSONL).write_text('{"step": 1}\nnot json\n{"step": 3}\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl, line 2, is not a metrics row"):
        read_rows(run)


def test_a_resume_after_a_kill_removes_what_the_kill_left(tmp_path, capsys, run4):
    """Temporaries named with the token of a writer that .lock records (the killed one), and checkpoints
    no pointer names: removed by the next writer."""
    run = copy_of(run4, tmp_path)
    token = read_lock_token(run)
    (run / f".checkpoint-step6.pt.muonclip-tmp-{token}").write_bytes(b"half")
    (run / f".checkpoint-step6.dcp.muonclip-tmp-{token}").mkdir()
    (run / f".checkpoint-step6.dcp.muonclip-tmp-{token}" / "__0_0.distcp").write_bytes(b"half")
    shutil.copy(run / "checkpoint-step4.pt", run / "checkpoint-step5.pt")  # renamed, pointer not yet written
    (run / f".metrics.jsonl.muonclip-tmp-{token}").write_text("{")
    assert inspect_folder(run).kind == "run"
    assert main(["train", "--quiet", "--out", str(run), "--resume", "--steps", "5"]) == 0
    assert sorted(p.name for p in run.iterdir()) == [".lock", "checkpoint-step5.pt", "checkpoint.json",
                                                     "config.json", "metrics.csv", "metrics.jsonl"]
    assert read_checkpoint(run).step == 5


# ------------------------------------------------------------------------------------------------
# one writer


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path, capsys, run4):
    """The lock is the kernel's (flock): held for the run's life, released when the holder ends.
    On the old code a second --resume wrote into the folder at the same time."""
    run = copy_of(run4, tmp_path)
    held = RunLock(run)
    held.stamp("t")
    before = snapshot(run)
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume", "--steps", "5"],
        f"is being written by another muonclip run (process {os.getpid()} on ")
    assert snapshot(run) == before
    held.release()
    assert main(["train", "--quiet", "--out", str(run), "--resume", "--steps", "5"]) == 0
    # a process that dies holding the lock releases it: the next writer goes on
    code = f"from muonclip.app.runfolder import RunLock; import os; RunLock({str(run)!r}); os._exit(9)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 9
    assert main(["train", "--quiet", "--out", str(run), "--resume", "--steps", "6"]) == 0


# ------------------------------------------------------------------------------------------------
# integrity


def test_a_flipped_byte_in_the_checkpoint_is_refused_and_nothing_is_modified(tmp_path, capsys, run4):
    """On the old code 8 flipped bytes inside tensor data resumed with exit 0."""
    run = copy_of(run4, tmp_path)
    path = run / "checkpoint-step4.pt"
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0x55
    path.write_bytes(bytes(data))
    before = snapshot(run)
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume", "--steps", "6"],
        f"checkpoint file {path} does not match its SHA-256 in checkpoint.json")
    assert snapshot(run) == before


def test_a_checkpoint_of_another_run_is_refused_naming_what_differs(tmp_path, capsys, text, run4):
    """Another run's checkpoint (3 layers, adamw, seed 7) copied in: refused with each difference.
    On the old code it was adopted and config.json rewritten to it."""
    other = tmp_path / "other"
    assert main(["train", *TINY, "--data", text, "--steps", "2", "--optimizer", "adamw", "--seed", "7",
                 "--set", "n_layer=3", "--out", str(other)]) == 0
    run = copy_of(run4, tmp_path)
    for p in run.glob("checkpoint*"):
        p.unlink()
    for p in other.glob("checkpoint*"):
        shutil.copy(p, run / p.name)
    before = snapshot(run)
    err = bad(capsys, ["train", "--quiet", "--out", str(run), "--resume", "--optimizer", "adamw"],
              "is not this folder's run: checkpoint vs config.json: run id")
    assert "optimizer 'adamw' vs 'muonclip'" in err and "n_layer 3 vs 2" in err and "seed 7 vs 0" in err
    assert snapshot(run) == before


# ------------------------------------------------------------------------------------------------
# resume = the run's own config


def test_resume_overrides_are_applied_to_the_optimizer_and_recorded(tmp_path, text, run4):
    """--tau, weight_decay and orth_dtype on resume act on the loaded optimizer (on the old code the
    checkpoint's values came back: tau 100 kept, weights bit-identical to a resume without them), and
    config.json and the pointer record them."""
    plain, changed = copy_of(run4, tmp_path, "plain"), copy_of(run4, tmp_path, "changed")
    assert main(["train", "--quiet", "--out", str(plain), "--resume", "--steps", "6"]) == 0
    assert main(["train", "--quiet", "--out", str(changed), "--resume", "--steps", "6", "--tau", "0.05",
                 "--set", "weight_decay=0.9", "--set", "orth_dtype=float32"]) == 0
    rows = read_rows(changed)
    assert all(r["clipped_heads"] == 0 for r in rows[:4]) and all(r["clipped_heads"] > 0 for r in rows[4:])
    assert all(r["clipped_heads"] == 0 for r in read_rows(plain))
    saved = load_file(read_checkpoint(changed).path)["optim"]
    assert all(g["tau"] == 0.05 for g in saved["param_groups"])  # optimizer-wide values: in every param group
    muon_groups = [g for g in saved["param_groups"] if g["algorithm"] == "muon"]
    assert muon_groups and all(g["weight_decay"] == 0.9 and g["orth_dtype"] == "torch.float32" for g in muon_groups)
    a = load_file(read_checkpoint(plain).path)["model"]
    b = load_file(read_checkpoint(changed).path)["model"]
    assert any(not torch.equal(a[k], b[k]) for k in a)
    config = json.loads((changed / "config.json").read_text())
    assert (config["tau"], config["weight_decay"], config["orth_dtype"]) == (0.05, 0.9, "float32")
    assert config["run"]["history"] == [{"step": 4, "changed": {
        "steps": [4, 6], "weight_decay": [0.1, 0.9], "tau": [100.0, 0.05], "orth_dtype": ["auto", "float32"]}}]
    assert read_checkpoint(changed).run.history == config["run"]["history"]


@pytest.mark.parametrize(("args", "field"), [
    (["--seed", "3"], "seed"),
    (["--set", "batch_size=4"], "batch_size"),
    (["--set", "n_head=4"], "n_head"),
    (["--set", "val_fraction=0.1"], "val_fraction"),
])
def test_resume_refuses_fields_that_make_another_run(tmp_path, capsys, run4, args, field):
    run = copy_of(run4, tmp_path)
    before = snapshot(run)
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume", *args], f"--resume cannot change {field} ")
    assert snapshot(run) == before


def test_resume_refuses_other_training_text(tmp_path, capsys, text, run4):
    """The same --data path with other text in it (its SHA-256 is in the checkpoint), or another path."""
    own = tmp_path / "own.txt"
    shutil.copy(text, own)
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", str(own), "--steps", "2", "--out", str(run)]) == 0
    own.write_text(own.read_text() + "one more line\n")
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume", "--steps", "3"],
        "the training text differs from the one")
    bad(capsys, ["train", "--quiet", "--out", str(copy_of(run4, tmp_path, "r4")), "--resume", "--data", str(own)],
        "--resume cannot change data")


# ------------------------------------------------------------------------------------------------
# no link followed out of the folder, nothing but plain files read


def tree(folder):
    """Every entry under folder, links as ("link", target) without following them, files by bytes."""
    out = {}
    for root, dirs, files in os.walk(folder):
        for name in (*dirs, *files):
            p = os.path.join(root, name)
            rel = os.path.relpath(p, folder)
            if os.path.islink(p):
                out[rel] = ("link", os.readlink(p))
            elif os.path.isfile(p):
                out[rel] = open(p, "rb").read()
            elif not os.path.isdir(p):
                out[rel] = "special"
    return out


@pytest.mark.parametrize("name", [".lock", "config.json", "metrics.jsonl", "metrics.csv", "checkpoint.json",
                                  "checkpoint-step4.pt"])
def test_no_link_is_followed_out_of_a_run_folder(tmp_path, capsys, run4, name):
    """Each of the run's files replaced by a link to a copy outside the folder: exit 2 naming it, the
    outside file and the folder untouched. On the old code ``.lock -> ~/notes.txt`` with --resume exited 0
    with notes.txt overwritten by "pid host token"."""
    run = copy_of(run4, tmp_path)
    outside = tmp_path / f"outside-{name}"
    shutil.copy(run / name, outside)
    (run / name).unlink()
    os.symlink(outside, run / name)
    before, kept = tree(run), outside.read_bytes()
    for argv in (["train", "--quiet", "--out", str(run), "--resume", "--steps", "5"],
                 ["train", *TINY, "--steps", "2", "--out", str(run)]):
        bad(capsys, argv, f"{name} is a symbolic link; a run folder holds plain files and folders only")
    assert tree(run) == before and outside.read_bytes() == kept


def test_a_lock_linking_to_a_missing_path_creates_nothing(tmp_path, capsys, run4):
    """On the old code the lock created the link's target (exit 0)."""
    run = copy_of(run4, tmp_path)
    (run / ".lock").unlink()
    os.symlink(tmp_path / "created", run / ".lock")
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume"], ".lock is a symbolic link")
    with pytest.raises(OutputError, match=r"\.lock is a symbolic link"):
        RunLock(run)
    assert not (tmp_path / "created").exists()


@pytest.fixture
def alarm():
    """A hang (a read from a FIFO or /dev/zero) becomes a failure after 60 s instead of a stuck suite."""
    def ring(signum, frame):
        raise TimeoutError("hung")

    old = signal.signal(signal.SIGALRM, ring)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("special", ["/dev/zero link", "fifo", "fifo config.json", "fifo .lock", "socket"])
def test_special_files_are_refused_before_anything_is_read(tmp_path, capsys, run4, alarm, special):
    """On the old code a checkpoint replaced by a link to /dev/zero, or by a FIFO, hung --resume (hashed
    forever, or blocked on open)."""
    run = copy_of(run4, tmp_path)
    name = special.split()[-1] if special.startswith("fifo ") else "checkpoint-step4.pt"
    (run / name).unlink()
    if special == "/dev/zero link":
        os.symlink("/dev/zero", run / name)
        what = "is a symbolic link"
    elif special == "socket":
        import socket

        sock = socket.socket(socket.AF_UNIX)
        sock.bind(str(run / name))
        what = "is a socket"
    else:
        os.mkfifo(run / name)
        what = "is a FIFO (named pipe)"
    before = tree(run)
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume", "--steps", "5"], f"{name} {what}")
    assert tree(run) == before


def test_a_link_inside_the_run_folders_own_folders_is_refused(tmp_path, capsys, run4):
    """Inside a sharded checkpoint's folder or the run's TensorBoard folder: named by its path."""
    run = copy_of(run4, tmp_path)
    (run / "tb").mkdir()
    os.symlink("/etc/hostname", run / "tb" / "events.out.tfevents.1.host.1.0")
    config = json.loads((run / "config.json").read_text())
    config["run"]["tensorboard"] = ["tb"]
    (run / "config.json").write_text(json.dumps(config))
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume"],
        "tb/events.out.tfevents.1.host.1.0 is a symbolic link")
    (run / "tb" / "events.out.tfevents.1.host.1.0").unlink()
    (run / "tb" / "inner").mkdir()
    os.mkfifo(run / "tb" / "inner" / "pipe")
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume"], "tb/inner/pipe is a FIFO")


# ------------------------------------------------------------------------------------------------
# only what muonclip wrote is deleted


def test_a_users_temporary_looking_files_are_never_deleted(tmp_path, capsys, text, run4):
    """On the old code: --out holding only .notes.tmp-2024 counted as empty and the file was removed (exit
    0); a user's folder .checkpoint-step5.dcp.tmp/ in a run was removed with everything in it. Now both make
    the folder foreign; so does a temporary in muonclip's own pattern whose token no writer of the folder
    recorded."""
    t = tmp_path / "t"
    t.mkdir()
    (t / ".notes.tmp-2024").write_text("mine")
    bad(capsys, ["train", *TINY, "--data", text, "--steps", "2", "--out", str(t)],
        "holds files that are not a muonclip run's ('.notes.tmp-2024')")
    assert snapshot(t) == {".notes.tmp-2024": b"mine"}
    run = copy_of(run4, tmp_path)
    (run / ".checkpoint-step5.dcp.tmp").mkdir()
    (run / ".checkpoint-step5.dcp.tmp" / "mine.txt").write_text("mine")
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume", "--steps", "5"],
        "holds files that are not a muonclip run's ('.checkpoint-step5.dcp.tmp')")
    assert (run / ".checkpoint-step5.dcp.tmp" / "mine.txt").read_text() == "mine"
    shutil.rmtree(run / ".checkpoint-step5.dcp.tmp")
    stranger = f".config.json.muonclip-tmp-{'0' * 32}"
    (run / stranger).write_text("mine")
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume", "--steps", "5"], f"('{stranger}')")
    assert (run / stranger).read_text() == "mine"
    assert remove_leftovers(run, keep="checkpoint-step4.pt") == [] and (run / stranger).exists()


def test_the_lock_records_the_writers_whose_temporaries_are_the_runs(tmp_path):
    """Each writer's token joins the record (the last 16 are kept); read_lock_token is the latest."""
    lock = RunLock(tmp_path)
    tokens = [new_token() for _ in range(20)]
    for t in tokens:
        lock.stamp(t)
    lock.release()
    assert recorded_tokens(tmp_path) == set(tokens[-16:]) and read_lock_token(tmp_path) == tokens[-1]
    (tmp_path / temporary_name("config.json", tokens[-1])).write_text("{")
    (tmp_path / temporary_name("config.json", tokens[0])).write_text("{")
    assert inspect_folder(tmp_path).foreign == (temporary_name("config.json", tokens[0]),)


# ------------------------------------------------------------------------------------------------
# a run that never checkpointed restarts from its start


def test_a_run_that_never_checkpointed_restarts_from_its_start_with_its_own_config(tmp_path, capsys, run4):
    """A run killed before its first checkpoint (config.json and 4 logged steps, a leftover checkpoint
    no pointer names, a temporary): on the old code both --resume and a new run were refused, the folder
    unusable. Now --resume says so on screen and runs the run again from step 0 with its own config and
    identity: the same run, bit for bit (the run is deterministic), metrics started again."""
    run = copy_of(run4, tmp_path)
    (run / "checkpoint.json").unlink()
    (run / f".checkpoint-step4.pt.muonclip-tmp-{read_lock_token(run)}").write_bytes(b"half")
    before_config = json.loads((run / "config.json").read_text())
    assert main(["train", "--quiet", "--out", str(run), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"--out {run} holds no checkpoint: the run stopped before its first one" in err
    assert "restarting it from step 0 with its own config (config.json)" in err
    assert sorted(p.name for p in run.iterdir()) == [".lock", "checkpoint-step4.pt", "checkpoint.json", "config.json",
                                                     "metrics.csv", "metrics.jsonl"]
    a, b = load_file(read_checkpoint(run).path), load_file(read_checkpoint(run4).path)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])
    assert [r["loss"] for r in read_rows(run)] == [r["loss"] for r in read_rows(run4)]
    assert json.loads((run / "config.json").read_text())["run"] == before_config["run"]


def test_a_run_that_died_in_its_first_step_restarts_with_a_changed_rate(tmp_path, capsys, text):
    """A non-finite loss at step 1 (exit 3, no checkpoint): --resume with a lower rate restarts it, the
    change recorded at step 0; a fixed field still cannot change."""
    run = tmp_path / "run"
    assert main(["train", *TINY, "--data", text, "--steps", "3", "--optimizer", "muon", "--set", "lr_muon=1e30",
                 "--set", "lr_adamw=1e30", "--out", str(run)]) == 3
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume", "--set", "n_layer=3"],
        "--resume cannot change n_layer")
    assert main(["train", "--quiet", "--out", str(run), "--resume", "--set", "lr_muon=0.02",
                 "--set", "lr_adamw=0.006"]) == 0
    history = json.loads((run / "config.json").read_text())["run"]["history"]
    assert history == [{"step": 0, "changed": {"lr_adamw": [1e30, 0.006], "lr_muon": [1e30, 0.02]}}]
    assert [r["step"] for r in read_rows(run)] == [1, 2, 3]


# ------------------------------------------------------------------------------------------------
# a TensorBoard folder the run wrote is the run's


@pytest.mark.parametrize("inside", ["tb", "."])
def test_a_tensorboard_folder_inside_the_run_is_its_own(tmp_path, capsys, text, inside):
    """train --out r --tensorboard r/tb (or r itself): on the old code every later --resume was refused
    ("holds files that are not a muonclip run's ('tb')"). Now config.json records it and a resume, with or
    without --tensorboard, continues; another folder put there is still foreign."""
    pytest.importorskip("tensorboard")
    run = tmp_path / "run"
    tb = run / inside
    assert main(["train", *TINY, "--data", text, "--steps", "2", "--out", str(run), "--tensorboard", str(tb)]) == 0
    assert json.loads((run / "config.json").read_text())["run"]["tensorboard"] == [inside]
    assert main(["train", "--quiet", "--out", str(run), "--resume", "--steps", "3"]) == 0
    assert main(["train", "--quiet", "--out", str(run), "--resume", "--steps", "4", "--tensorboard", str(tb)]) == 0
    assert [r["step"] for r in read_rows(run)] == [1, 2, 3, 4]
    (run / "other").mkdir()
    bad(capsys, ["train", "--quiet", "--out", str(run), "--resume", "--steps", "5"],
        "holds files that are not a muonclip run's ('other')")


# ------------------------------------------------------------------------------------------------
# nothing shared with a file outside the folder is written (issue 49)


@pytest.mark.parametrize("folder", ["new", "run"])
def test_a_lock_that_is_a_hard_link_is_refused_and_the_file_it_shares_untouched(tmp_path, capsys, text, run4,
                                                                               folder):
    """``ln outside.txt run/.lock``: on the old code both a new run into that folder and a --resume of a run
    exited 0 with outside.txt overwritten by the lock's "pid host token" (the lock was opened read-write
    without looking at its link count). Now exit 2 naming it, before a byte is written: the outside file
    and the folder byte for byte as they were."""
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"precious notes\n")
    if folder == "new":
        run = tmp_path / "new"
        run.mkdir()
        argv = ["train", *TINY, "--data", text, "--steps", "2", "--out", str(run)]
    else:
        run = copy_of(run4, tmp_path)
        (run / ".lock").unlink()
        argv = ["train", "--quiet", "--out", str(run), "--resume", "--steps", "5"]
    os.link(outside, run / ".lock")
    before = tree(run)
    bad(capsys, argv, f"--out {run}: .lock is a hard link (2 names share its file")
    with pytest.raises(OutputError, match=r"\.lock is a hard link"):
        RunLock(run)
    assert outside.read_bytes() == b"precious notes\n" and tree(run) == before
    (run / ".lock").unlink()  # as the message says: the outside file keeps its contents, the folder is usable
    assert main(argv) == 0 and outside.read_bytes() == b"precious notes\n"


# ------------------------------------------------------------------------------------------------
# --resume on a folder with nothing to resume starts the run (issue 49)

SMALL = ["--quiet", "--threads", "1", "--set", "batch_size=4", "--set", "block_size=32", "--set", "eval_batches=1",
         "--set", "checkpoint_every=2"]


@pytest.mark.parametrize("state", ["absent", "empty", "lock only"])
def test_resume_on_a_new_or_empty_folder_starts_the_run(tmp_path, capsys, text, state):
    """A job script that always passes --resume, killed before the folder was made (or after it made
    only the folder, or only the lock): on the old code refused ("holds no run to continue ...; start one
    without --resume", exit 2). Now it says so in one line and starts the run; the same command then
    continues it (no such line), and the run is the one a plain start makes, bit for bit."""
    run = tmp_path / "job" / "run"
    if state != "absent":
        run.mkdir(parents=True)
    if state == "lock only":
        RunLock(run).release()
    job = ["train", *SMALL, "--data", text, "--out", str(run), "--resume"]
    assert main([*job, "--steps", "2"]) == 0
    assert capsys.readouterr().err.count(f"muonclip: nothing to resume in {run}, starting a new run\n") == 1
    assert read_checkpoint(run).step == 2
    assert main([*job, "--steps", "4"]) == 0
    assert "nothing to resume" not in capsys.readouterr().err
    plain = tmp_path / "plain"
    assert main(["train", *SMALL, "--data", text, "--out", str(plain), "--steps", "4"]) == 0
    assert [r["loss"] for r in read_rows(run)] == [r["loss"] for r in read_rows(plain)]
    a, b = load_file(read_checkpoint(run).path), load_file(read_checkpoint(plain).path)
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in b["model"])


# ------------------------------------------------------------------------------------------------
# TensorBoard and --out never write into another run's folder (issue 49)


@pytest.mark.parametrize("where", ["other", "other/tb", "other/tb/deeper", "run/metrics.jsonl", "run/checkpoint.json",
                                   "run/checkpoint-step2.pt"])
def test_a_tensorboard_folder_that_would_break_a_run_folder_is_refused(tmp_path, capsys, text, run4, where):
    """--tensorboard in another run's folder (or deeper in it): on the old code its event files went there
    (exit 0) and that run could no longer be resumed ("holds files that are not a muonclip run's"). In this
    run's own folder under a name the run keeps for its files: the folder TensorBoard made stood where
    metrics.jsonl or a checkpoint goes. Now both exit 2 before anything is written, naming why."""
    other = copy_of(run4, tmp_path, "other")
    run = tmp_path / "run"
    before = tree(other)
    if where.startswith("other"):
        match = f"--tensorboard {tmp_path / where} lies in {other.resolve()}, the folder of another muonclip run"
    else:
        match = f"{where.split('/')[1]} is a name the run folder {run} keeps for its own files"
    bad(capsys, ["train", *TINY, "--data", text, "--steps", "2", "--out", str(run), "--tensorboard",
                 str(tmp_path / where)], match)
    assert tree(other) == before and not run.exists() and inspect_folder(other).kind == "run"


def test_a_new_run_inside_another_runs_folder_is_refused(tmp_path, capsys, text, run4):
    """``--out other/sub`` where ``other`` is a run: on the old code the run was written there and ``other``
    could no longer be resumed; a comparison there too. Now refused, nothing written."""
    other = copy_of(run4, tmp_path, "other")
    before = tree(other)
    bad(capsys, ["train", *TINY, "--data", text, "--steps", "2", "--out", str(other / "sub" / "run")],
        f"--out {other / 'sub' / 'run'} lies inside {other.resolve()}, the folder of another muonclip run")
    bad(capsys, ["compare", *TINY, "--data", text, "--steps", "2", "--out", str(other / "cmp")],
        f"lies inside {other.resolve()}, the folder of another muonclip run")
    assert tree(other) == before
    assert main(["train", "--quiet", "--out", str(other), "--resume", "--steps", "5"]) == 0
