"""The CPU cores this process may use: what the app sizes its parallel runs and threads by; and the
CPU's name, which the reports print (`cpu_name`).

``os.cpu_count()`` counts the machine's CPUs, not those a container, a job scheduler or ``taskset``
gives the process: more threads or runs at a time than the process may use only queue up, and
torch's thread pool then spins waiting for threads that are not running. `usable_cores` is the
smallest of the CPUs in the process's affinity mask (``os.sched_getaffinity``, where the OS has
it) and the CPU quota of every level of its cgroup (v2 ``cpu.max``; v1 ``cpu.cfs_quota_us`` over
``cpu.cfs_period_us``), rounded up, and at least 1.
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path


def _quota(text: str) -> float | None:
    """CPUs a v2 ``cpu.max`` (``"<quota> <period>"`` or ``"max <period>"``) allows; None: no limit."""
    parts = text.split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_cpus(root: str | Path = "/") -> float | None:
    """The CPUs this process's cgroups allow (the smallest quota of its own cgroup and the levels
    above it), or None where no quota is set or none can be read. ``root``: a folder to read
    ``proc/`` and ``sys/`` under (``"/"``; tests give a copy)."""
    root = Path(root)
    own = _read(root / "proc/self/cgroup") or ""
    found: list[float] = []
    for line in own.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        rel = rel.strip().lstrip("/")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            base, files = root / "sys/fs/cgroup", ("cpu.max",)
        elif "cpu" in controllers.split(","):  # cgroup v1
            base = next((root / "sys/fs/cgroup" / name for name in (controllers, "cpu,cpuacct", "cpu")
                         if (root / "sys/fs/cgroup" / name).is_dir()), None)
            if base is None:
                continue
            files = ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        folder = base / rel
        while True:
            texts = [_read(folder / f) for f in files]
            if all(t is not None for t in texts):
                cpus = _quota(texts[0] if len(texts) == 1 else f"{texts[0].strip()} {texts[1].strip()}")
                if cpus is not None:
                    found.append(cpus)
            if folder == base or base not in folder.parents:
                break
            folder = folder.parent
    return min(found) if found else None


def usable_cores(root: str | Path = "/") -> int:
    """The cores this process may use: the affinity mask's CPUs and the cgroup quota, the smaller,
    rounded up (a quota of 1.5 CPUs lets two threads run), at least 1 (module docstring)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpus(root)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; elsewhere `platform.processor`)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
