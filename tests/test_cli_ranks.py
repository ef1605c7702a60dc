"""`muonclip train` under torchrun (2 CPU processes, gloo) when the ranks or the launcher misbehave: ranks
launched with different settings stop on every rank before any work, a stopped rank ends the job after
--timeout, and the workers die with their launcher."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

TINY = ["--preset", "tiny", "--quiet", "--set", "checkpoint_every=1000"]
pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="finds the workers in Linux's /proc")

# torchrun runs one command on every rank; this one adds per-rank arguments from MUONCLIP_TEST_RANK<r>
# and gives rank r a machine of MUONCLIP_TEST_CORES<r> cores
PER_RANK = """
import os, shlex, sys
from muonclip.app.main import main
extra = shlex.split(os.environ.get("MUONCLIP_TEST_RANK" + os.environ["RANK"], ""))
cores = os.environ.get("MUONCLIP_TEST_CORES" + os.environ["RANK"])
if cores:
    os.sched_getaffinity = lambda pid: set(range(int(cores)))
sys.exit(main(sys.argv[1:] + extra))
"""


def launch(tmp_path, args, env=None, shutdown=2, **popen):
    """Start ``muonclip <args>`` on 2 gloo ranks with torchrun (its own process group); return the Popen."""
    script = tmp_path / "per_rank.py"
    script.write_text(PER_RANK)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           f"--shutdown-timeout={shutdown}", str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **popen)


def workers(pid):
    """The child processes of ``pid`` (torchrun's workers), with their RANK."""
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids += [int(c) for c in (task / "children").read_text().split()]
    ranks = {}
    for k in kids:
        env = Path(f"/proc/{k}/environ").read_bytes().split(b"\0")
        rank = [e.split(b"=", 1)[1] for e in env if e.startswith(b"RANK=")]
        if rank:
            ranks[int(rank[0])] = k
    return ranks


def alive(pid):
    """True while ``pid`` exists and is not a zombie."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def wait_for_rows(run, proc, limit=240):
    """Poll until the run has logged a step (the ranks are training), for at most ``limit`` seconds."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        jsonl = run / "metrics.jsonl"
        if jsonl.exists() and jsonl.read_text().count("\n") >= 1:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    pytest.fail("the run logged no step")


def stop(proc):
    """Kill torchrun's whole process group (whatever is left of it); return its stderr."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return proc.communicate()[1]


def test_ranks_launched_with_different_settings_stop_before_any_work(tmp_path, text):
    """Rank 1 with another --lr and another --out: every rank exits with 2, rank 0 names both
    differences, nothing is written (on the old code both ran to exit 0)."""
    out, other = tmp_path / "run", tmp_path / "elsewhere"
    proc = launch(tmp_path, ["train", *TINY, "--data", text, "--steps", "2", "--lr", "0.02"],
                  env={"MUONCLIP_TEST_RANK0": f"--out {out}", "MUONCLIP_TEST_RANK1": f"--out {other} --lr 0.03"})
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        stop(proc)
    assert proc.returncode != 0
    assert err.count("muonclip: error: the ranks were launched with different settings") == 1  # rank 0 only
    assert "rank 1 has lr_muonclip=0.03 where rank 0 has 0.02" in err
    assert f"rank 1 has out='{other}' where rank 0 has '{out}'" in err
    assert "exitcode  : 2" in err and "exitcode  : 1" not in err  # every rank: bad input
    assert not out.exists() and not other.exists()


def test_a_check_that_fails_on_one_rank_only_stops_every_rank(tmp_path, text):
    """The same settings everywhere, but rank 1's machine has 1 core and --threads is 2: every rank
    exits with 2, rank 0 printing rank 1's message, nothing written. (On the old code rank 0 went on
    alone and its next collective failed: "rank 0: another rank stopped answering or died".)"""
    out = tmp_path / "run"
    proc = launch(tmp_path, ["train", *TINY, "--data", text, "--steps", "2", "--out", str(out), "--threads", "2",
                             "--timeout", "60"], env={"MUONCLIP_TEST_CORES0": "2", "MUONCLIP_TEST_CORES1": "1"})
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        stop(proc)
    assert "muonclip: error: rank 1: --threads 2: this machine has 1 cores for this process" in err, err
    assert "exitcode  : 2" in err and "exitcode  : 1" not in err and "exitcode  : 4" not in err
    assert not out.exists()


def test_a_stopped_rank_ends_the_job_after_the_timeout(tmp_path, text):
    """SIGSTOP of rank 1 while training: rank 0 gives up after --timeout 5 with a clear message (and
    exit code 4; torchrun then kills the stopped rank after its shutdown timeout, 30 s, and exits).
    On the old code rank 0 waited the default 30 minutes."""
    out = tmp_path / "run"
    proc = launch(tmp_path, ["train", *TINY, "--data", text, "--steps", "100000", "--out", str(out),
                             "--timeout", "5"])
    try:
        wait_for_rows(out, proc)
        ranks = workers(proc.pid)
        os.kill(ranks[1], signal.SIGSTOP)
        end = time.monotonic() + 120  # --timeout 5 s; the bound leaves room for a loaded machine
        while alive(ranks[0]) and time.monotonic() < end:
            time.sleep(0.2)
        assert not alive(ranks[0])
    finally:
        err = stop(proc)
    assert "muonclip: error: rank 0: another rank stopped answering or died (a collective operation failed" in err, err


def test_workers_die_with_their_launcher(tmp_path, text):
    """SIGKILL of torchrun itself: its workers get SIGKILL from the kernel (PR_SET_PDEATHSIG). On the
    old code they trained on, orphaned (4 -> 189 rows in 30 s)."""
    out = tmp_path / "run"
    proc = launch(tmp_path, ["train", *TINY, "--data", text, "--steps", "100000", "--out", str(out)])
    try:
        wait_for_rows(out, proc)
        ranks = workers(proc.pid)
        assert sorted(ranks) == [0, 1]
        os.kill(proc.pid, signal.SIGKILL)
        end = time.monotonic() + 60  # the kernel delivers at once; 60 s is a bound for a loaded machine
        while any(alive(p) for p in ranks.values()) and time.monotonic() < end:
            time.sleep(0.2)
        assert not any(alive(p) for p in ranks.values())
    finally:
        stop(proc)
