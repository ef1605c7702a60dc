"""Ctrl-C of the ``muonclip`` command, with real signals to a real process: the first one stops it
with exit code 130 (a run first saves a checkpoint of its last step), a second one at any moment
ends it with 130 too, never with a traceback, and never leaves a checkpoint half-written.

Each test runs the command (its console-script entry, `muonclip.app.main.main` without argv) in a
process whose code is patched only to print a marker at a chosen moment and wait there until a
SIGINT has been handled; the test sends SIGINT when it reads the marker, so nothing rests on
timing."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from muonclip.app.checkpoints import read_checkpoint, verify
from muonclip.app.main import main
from muonclip.app.metrics import read_rows
from muonclip.app.train import ABORTED

DRIVER = r"""
import signal, sys, time
import torch
import muonclip.app.train as train_mod
import muonclip.app.train_setup as train_setup
from muonclip.app.main import main

scenario, out, data = sys.argv[1:4]


def wait_for_sigint(marker):
    # print the marker, then wait until a SIGINT has been handled by the handler in place (which
    # may raise: then the wait ends with its exception, where the command's code stood)
    seen, handler = [], signal.getsignal(signal.SIGINT)

    def spy(signum, frame):
        seen.append(signum)
        signal.signal(signal.SIGINT, handler)
        handler(signum, frame)

    signal.signal(signal.SIGINT, spy)
    print(marker, flush=True)
    deadline = time.monotonic() + 300
    while not seen and time.monotonic() < deadline:
        time.sleep(0.005)


class WaitAfter:
    # stderr that waits for a SIGINT once the command has written `text`
    def __init__(self, stream, text, marker):
        self.stream, self.text, self.marker = stream, text, marker

    def write(self, s):
        n = self.stream.write(s)
        self.stream.flush()
        if self.text is not None and self.text in s:
            self.text = None
            wait_for_sigint(self.marker)
        return n

    def __getattr__(self, name):
        return getattr(self.stream, name)


def at_call(owner, name, n, marker):
    # the n-th call of owner.name (training forwards only, for forward_loss) waits for a SIGINT first
    real, calls = getattr(owner, name), [0]

    def patched(*args, **kwargs):
        if name != "forward_loss" or args[0].training:
            calls[0] += 1
            if calls[0] == n:
                wait_for_sigint(marker)
        return real(*args, **kwargs)

    setattr(owner, name, patched)


if scenario == "start-up":  # before the corpus is read; the second Ctrl-C while the command reports the first
    at_call(train_setup, "load_corpus", 1, "STARTING")
    sys.stderr = WaitAfter(sys.stderr, "aborted", "REPORTING")
elif scenario == "reporting":  # at step 2; the second while the command reports the saved checkpoint
    at_call(train_mod, "forward_loss", 2, "TRAINING")
    sys.stderr = WaitAfter(sys.stderr, "checkpoint saved", "REPORTING")
else:  # "saving": at step 2; the second while step 2's checkpoint is being written (step 1's is there)
    at_call(train_mod, "forward_loss", 2, "TRAINING")
    at_call(torch, "save", 2, "SAVING")
sys.argv = ["muonclip", "train", "--preset", "tiny", "--quiet", "--threads", "1", "--steps", "3", "--set",
            "checkpoint_every=1", "--data", data, "--out", out]
sys.exit(main())
"""


def interrupt(tmp_path, text, scenario, markers):
    """Run the command under ``scenario`` (`DRIVER`), send SIGINT at each of ``markers`` (in order);
    return its exit code and stderr."""
    err_path = tmp_path / "stderr.txt"
    with open(err_path, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", DRIVER, scenario, str(tmp_path / "run"), text],
                                stdout=subprocess.PIPE, stderr=err, text=True)
        try:
            for marker in markers:
                while (line := proc.stdout.readline()) and line.strip() != marker:
                    pass
                assert line, f"ended before {marker}: {err_path.read_text()}"
                proc.send_signal(signal.SIGINT)
            proc.wait(timeout=300)
        finally:
            proc.kill()
            proc.stdout.close()
    return proc.returncode, err_path.read_text()


def test_a_second_ctrl_c_at_start_up_exits_130_without_a_traceback(tmp_path, text):
    """Ctrl-C while the run starts (its checks done, its corpus not read yet), then again while the
    command says so: on the old code the second one escaped the command, a KeyboardInterrupt
    traceback and exit -2. Now 130, the abort said, nothing written (the folder is made after the
    start-up's checks)."""
    rc, err = interrupt(tmp_path, text, "start-up", ["STARTING", "REPORTING"])
    assert rc == 130 and "Traceback" not in err and err.count(ABORTED) == 2, err
    assert not (tmp_path / "run").exists()


def test_a_second_ctrl_c_after_the_checkpoint_is_saved_exits_130(tmp_path, text):
    """Ctrl-C at step 2 (the step finishes, its checkpoint is written), then again while the command
    reports it: on the old code a KeyboardInterrupt traceback, exit 1 here (-2 from the console script:
    the run had put Python's own handler back). Now 130, and the checkpoint of step 2 is whole."""
    rc, err = interrupt(tmp_path, text, "reporting", ["TRAINING", "REPORTING"])
    assert rc == 130 and "Traceback" not in err, err
    assert "interrupted after step 2; checkpoint saved to" in err and ABORTED in err
    found = read_checkpoint(tmp_path / "run")
    verify(found)
    assert found.step == 2


def test_a_second_ctrl_c_while_the_checkpoint_is_written_leaves_the_last_one_whole(tmp_path, text):
    """Ctrl-C at step 2, then again while step 2's checkpoint is being written: the command ends at once
    with 130, without unwinding (on the old code a KeyboardInterrupt unwound the save); the folder holds
    step 1's checkpoint, whole (step 2's file never took its name), and a --resume continues from it,
    removing the temporary step 2's write left."""
    run = tmp_path / "run"
    rc, err = interrupt(tmp_path, text, "saving", ["TRAINING", "SAVING"])
    assert rc == 130 and "Traceback" not in err and ABORTED in err, err
    found = read_checkpoint(run)
    verify(found)
    assert found.step == 1 and not (run / "checkpoint-step2.pt").exists()
    assert [p.name for p in run.iterdir() if p.name.startswith(".checkpoint-step2.pt.muonclip-tmp-")]
    assert main(["train", "--quiet", "--threads", "1", "--out", str(run), "--resume"]) == 0
    assert read_checkpoint(run).step == 3 and [r["step"] for r in read_rows(run)] == [1, 2, 3]
    assert not [p.name for p in run.iterdir() if "muonclip-tmp" in p.name]


ABORT_WITH_A_WORKER = """
import multiprocessing, sys, time
from muonclip.app.train import abort

worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))
worker.start()
print(worker.pid, flush=True)
abort()
"""


def test_abort_ends_the_worker_processes_too(tmp_path):
    """`abort` (a second Ctrl-C of the command) ends the process with 130 and kills the worker
    processes it started (`muonclip compare`'s runs): without that, a comparison's workers went on
    training, orphaned, after the command had ended."""
    proc = subprocess.run([sys.executable, "-c", ABORT_WITH_A_WORKER], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 130 and ABORTED in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    stat = Path(f"/proc/{int(proc.stdout.split()[0])}/stat")

    def alive():  # neither gone nor a zombie
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 300  # SIGKILL was sent before the command exited: only its landing is awaited
    while alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not alive()
