"""The cores the app sizes its runs and threads by (`muonclip.app.cores`)."""

from __future__ import annotations

import os

from muonclip.app import cores


def test_usable_cores_follow_the_affinity_and_the_cgroup_quota(tmp_path, monkeypatch):
    """The app sizes its runs and threads by the cores this process may use: the affinity mask and
    every cgroup level's CPU quota (v2 and v1), rounded up, never the machine's CPU count."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    v2 = tmp_path / "v2"
    (v2 / "proc/self").mkdir(parents=True)
    (v2 / "proc/self/cgroup").write_text("0::/job/step\n")
    (v2 / "sys/fs/cgroup/job/step").mkdir(parents=True)
    (v2 / "sys/fs/cgroup/cpu.max").write_text("max 100000\n")
    (v2 / "sys/fs/cgroup/job/cpu.max").write_text("150000 100000\n")  # 1.5 CPUs at the level above
    (v2 / "sys/fs/cgroup/job/step/cpu.max").write_text("max 100000\n")
    assert cores.cgroup_cpus(v2) == 1.5 and cores.usable_cores(v2) == 2
    v1 = tmp_path / "v1"
    (v1 / "proc/self").mkdir(parents=True)
    (v1 / "proc/self/cgroup").write_text("12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    (v1 / "sys/fs/cgroup/cpu,cpuacct/docker/abc").mkdir(parents=True)
    (v1 / "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("300000\n")
    (v1 / "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us").write_text("100000\n")
    assert cores.cgroup_cpus(v1) == 3.0 and cores.usable_cores(v1) == 3
    (v1 / "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1\n")  # no limit
    assert cores.cgroup_cpus(v1) is None and cores.usable_cores(v1) == 8
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {3})  # taskset -c 3
    assert cores.usable_cores(tmp_path / "none") == 1
