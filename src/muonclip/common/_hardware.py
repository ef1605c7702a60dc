"""What the machine multiplies natively: the CPU's matrix instructions, a CUDA device's capability.

Read once from what the hardware declares, never by timing products:

* the CPU: on Linux the ``flags`` (x86) or ``Features`` (Arm) line of ``/proc/cpuinfo``; elsewhere
  (or where that file cannot be read) torch's own probes of the x86 ``cpuid`` bits
  (``torch.cpu._is_amx_tile_supported`` and its siblings, from the cpuinfo library torch is built
  with). `cpu_matrix_instructions` names what was found, e.g. ``("AMX-BF16", "AVX512-BF16",
  "AVX512F", "AVX2")``;
* a CUDA device: its compute capability (``torch.cuda.get_device_capability``).

`native_bf16` answers the one question the compute dtype ``"auto"`` asks (`muonclip.ortho`); the
benchmarks name the instructions in every row they measure.

**Overriding the CPU's answer.** The environment variable ``MUONCLIP_CPU_BF16`` (`CPU_BF16_ENV`)
makes `native_bf16` answer for every CPU device as told: ``1`` "native bfloat16" (``"auto"``
picks bfloat16), ``0`` "no bfloat16" (``"auto"`` picks float32); unset or empty, the CPU's own
flags decide. It is read at each call, so a test (or a process it starts) can run both of
``"auto"``'s decisions on any machine (``tests/conftest.py``: the ``bf16_answer`` fixture).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable

import torch

CPUINFO = "/proc/cpuinfo"

CPU_BF16_ENV = "MUONCLIP_CPU_BF16"
"""The environment variable that overrides the CPU's bfloat16 answer (module docstring)."""

CUDA_BF16_CAPABILITY = (8, 0)
"""The first CUDA compute capability with bfloat16 tensor cores (Ampere)."""

CPU_INSTRUCTIONS = (
    ("AMX-BF16", "amx_bf16"),
    ("AVX512-BF16", "avx512_bf16"),
    ("AMX-FP16", "amx_fp16"),
    ("AVX512F", "avx512f"),
    ("AVX2", "avx2"),
    ("SVE", "sve"),
    ("Arm BF16", "bf16"),
)
"""(name shown, ``/proc/cpuinfo`` flag) of the matrix and vector instructions `cpu_matrix_instructions`
reports, widest first."""

BF16_CPU_INSTRUCTIONS = ("AMX-BF16", "AVX512-BF16")
"""x86 instructions that multiply bfloat16 in hardware, which torch's CPU matrix products use
(oneDNN's AMX and AVX512-BF16 kernels). Without one of them torch's bfloat16 products are
emulated with float32 arithmetic plus conversions, slower than float32 itself."""

_TORCH_PROBES: tuple[tuple[str, str], ...] = (
    ("amx_bf16", "_is_amx_tile_supported"),  # every CPU with AMX tiles has AMX-BF16
    ("avx512_bf16", "_is_avx512_bf16_supported"),
    ("amx_fp16", "_is_amx_fp16_supported"),
    ("avx512f", "_is_avx512_supported"),
    ("avx2", "_is_avx2_supported"),
)


def _read_cpuinfo(path: str = CPUINFO) -> frozenset[str] | None:
    """The flags of the first processor in ``path`` (x86 ``flags``, Arm ``Features``), or None when
    the file cannot be read or holds no such line."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        return None
    return None


def _torch_probes(probes: Iterable[tuple[str, str]] = _TORCH_PROBES) -> frozenset[str]:
    """The flags torch's ``cpuid`` probes find (those this torch build has)."""
    found = set()
    for flag, name in probes:
        probe: Callable[[], bool] | None = getattr(torch.cpu, name, None)
        try:
            if probe is not None and probe():
                found.add(flag)
        except RuntimeError:  # a probe torch declares but cannot run on this build
            continue
    return frozenset(found)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags, in ``/proc/cpuinfo``'s spelling (``"amx_bf16"``,
    ``"avx512_bf16"``, ``"avx2"``...): ``/proc/cpuinfo`` where it can be read, else torch's
    ``cpuid`` probes. Read once per process."""
    flags = _read_cpuinfo()
    return flags if flags is not None else _torch_probes()


def cpu_matrix_instructions() -> tuple[str, ...]:
    """The names (`CPU_INSTRUCTIONS`) of the matrix and vector instructions this CPU has, widest
    first, e.g. ``("AMX-BF16", "AVX512-BF16", "AVX512F", "AVX2")``; ``()`` when none is known."""
    flags = cpu_flags()
    return tuple(name for name, flag in CPU_INSTRUCTIONS if flag in flags)


def cpu_bf16_instructions() -> tuple[str, ...]:
    """The CPU's instructions that multiply bfloat16 in hardware (`BF16_CPU_INSTRUCTIONS`), ``()``
    when it has none."""
    return tuple(name for name in cpu_matrix_instructions() if name in BF16_CPU_INSTRUCTIONS)


@functools.cache
def _cuda_capability(index: int) -> tuple[tuple[int, int], str]:
    return torch.cuda.get_device_capability(index), torch.cuda.get_device_name(index)


def cuda_capability(device: torch.device) -> tuple[tuple[int, int], str]:
    """``((major, minor), name)`` of the CUDA device ``device`` (its index, or the current device
    when it has none); read once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_capability(index)


def cpu_bf16_override() -> bool | None:
    """``MUONCLIP_CPU_BF16`` read now: True (``1``), False (``0``) or None (unset or empty).

    Raises:
        ValueError: any other value, naming the variable and the values it takes.
    """
    value = os.environ.get(CPU_BF16_ENV, "").strip()
    if value in ("", "1", "0"):
        return None if value == "" else value == "1"
    raise ValueError(f"{CPU_BF16_ENV}={value!r}: set it to 1 (the CPU multiplies bfloat16 natively), 0 (it does "
                     "not) or leave it unset (the CPU's own flags decide)")


def native_bf16(device: torch.device | str) -> tuple[bool, str]:
    """Whether ``device`` multiplies bfloat16 natively, and why (a phrase naming what was found).

    A CPU: one of `BF16_CPU_INSTRUCTIONS` (or `CPU_BF16_ENV`'s answer, when set); a CUDA device:
    compute capability 8.0 or more; any other device type: no.
    """
    device = torch.device(device)
    if device.type == "cpu":
        override = cpu_bf16_override()
        if override is not None:
            return override, f"{CPU_BF16_ENV}={int(override)} says the CPU {'has' if override else 'has no'} " \
                              "bfloat16 matrix instructions"
        found = cpu_bf16_instructions()
        if found:
            return True, f"the CPU has {' and '.join(found)}"
        return False, "the CPU has no bfloat16 matrix instructions (AMX-BF16, AVX512-BF16): bfloat16 is emulated"
    if device.type == "cuda":
        (major, minor), name = cuda_capability(device)
        if (major, minor) >= CUDA_BF16_CAPABILITY:
            return True, f"{name} (compute capability {major}.{minor}) has bfloat16 tensor cores"
        return False, f"{name} (compute capability {major}.{minor}) has no bfloat16 tensor cores (8.0 and later)"
    return False, f"bfloat16 products are not known to be native on {device.type}"
