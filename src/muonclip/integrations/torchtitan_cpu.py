"""torchtitan on CPU with gloo: the set-up `muonclip.integrations.torchtitan` applies where there is no CUDA.

torchtitan 0.3.0 targets GPUs: it takes its device type from ``torch._utils`` with ``"cuda"``
as the fallback, asks the device module for memory statistics, captures CUDA graphs by
default, casts parameters to bfloat16 for FSDP2 and defaults to FlexAttention, which has no CPU
backward. This module makes the same trainer run on CPU processes (``torchrun`` with gloo; one
process works too), for development and for the CPU test suite:

* `use_cpu`: torchtitan's device type becomes ``"cpu"`` and its device module a CPU stand-in
  (`CpuDeviceModule`: one device, memory statistics from the process's peak resident set), in
  ``torchtitan.tools.utils`` and in every torchtitan module that imported them by name; the
  process group backend follows (gloo, torchtitan's own choice for ``"cpu"``). On a torch
  without ``torch.distributed.set_timeout`` (2.13), which torchtitan calls after the first step,
  its ``set_pg_timeouts`` is replaced by `set_pg_timeouts`.
* `cpu_config`: on a ``Trainer.Config``: ``parallelism.spmd_backend = "partial_dtensor"``
  (DTensors for the model-parallel axes only, the backend whose FSDP2 path gloo runs),
  float32 everywhere (``training.dtype``, ``mixed_precision_param``: gloo reduces float32),
  ``training.disable_cuda_graphs``, no ``torch.compile``, FSDP2 reducing with SUM
  (`sum_reductions`), and `use_cpu`. The attention is the
  recording `RecordingSDPA` (set by `with_muonclip`), causal over the packed sequence.

Gradients are reduced with SUM over gloo: torchtitan normalises the loss by the global token
count and sets FSDP2's gradient divide factor to 1, which FSDP2 would send as a PREMUL_SUM
(gloo has neither that nor AVG).
"""

from __future__ import annotations

import functools
import resource
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn


class CpuDeviceModule(types.SimpleNamespace):
    """The part of ``torch.cuda``'s interface torchtitan calls, for the CPU: one device (index
    0), no-op synchronisation and caches, memory statistics from the peak resident set size of
    the process (``resource.getrusage``), the machine's memory as capacity."""

    def __init__(self) -> None:
        super().__init__()

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device: Any) -> None:
        return None

    @staticmethod
    def synchronize(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=total)

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak, "num_alloc_retries": 0,
                "num_ooms": 0}

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)


def use_cpu() -> None:
    """Point torchtitan at the CPU: ``device_type = "cpu"`` and `CpuDeviceModule` in
    ``torchtitan.tools.utils`` and in each loaded torchtitan module that imported them by name
    (call it before building a ``Trainer``; `with_muonclip` does on a machine without CUDA)."""
    import torchtitan.components.metrics  # noqa: F401  (loaded now so their names are patched)
    import torchtitan.distributed.parallel_dims  # noqa: F401
    import torchtitan.distributed.utils
    import torchtitan.tools.utils as tutils

    cpu = CpuDeviceModule()
    old_type, old_module = tutils.device_type, tutils.device_module
    for name, mod in list(sys.modules.items()):
        if not (name == "torchtitan" or name.startswith("torchtitan.")) or mod is None:
            continue
        if getattr(mod, "device_type", None) is old_type and isinstance(old_type, str):
            mod.device_type = "cpu"
        if getattr(mod, "device_module", None) is old_module:
            mod.device_module = cpu
    tutils.device_type, tutils.device_module = "cpu", cpu
    if not hasattr(torch.distributed, "set_timeout"):
        torchtitan.distributed.utils.set_pg_timeouts = set_pg_timeouts


def set_pg_timeouts(timeout: Any, parallel_dims: Any) -> None:
    """torchtitan's ``set_pg_timeouts`` (called after the first step) for a torch without
    ``torch.distributed.set_timeout`` (torch 2.13): a barrier, then ``ProcessGroup.set_timeout``
    on every 1-D mesh's group and the default group."""
    import torch.distributed as dist

    dist.barrier()
    groups = [mesh.get_group() for mesh in parallel_dims.get_all_one_dimensional_meshes().values()]
    for group in groups + [dist.distributed_c10d._get_default_group()]:
        group.set_timeout(timeout)


def cpu_config(config: Any) -> Any:
    """Set ``config`` (a torchtitan ``Trainer.Config``) up for CPU processes and gloo, in place
    (module docstring), and call `use_cpu`; returns ``config``."""
    config.parallelism.spmd_backend = "partial_dtensor"
    config.training.dtype = "float32"
    config.training.mixed_precision_param = "float32"
    config.training.disable_cuda_graphs = True
    config.compile.enable = False
    if config.model_spec is not None and not getattr(config.model_spec.parallelize_fn, "sum_reductions", False):
        config.model_spec.parallelize_fn = sum_reductions(config.model_spec.parallelize_fn)
    use_cpu()
    return config


def sum_reductions(parallelize_fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``parallelize_fn`` followed by ``set_force_sum_reduction_for_comms(True)`` on every FSDP2
    module of the result: gloo has no AVG and no PREMUL_SUM (what FSDP2 uses for torchtitan's
    gradient divide factor 1), so FSDP2 reduces with SUM and scales separately."""

    @functools.wraps(parallelize_fn)
    def parallelize(model: nn.Module, **kwargs: Any) -> nn.Module:
        from torch.distributed.fsdp import FSDPModule

        model = parallelize_fn(model, **kwargs)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
        return model

    parallelize.sum_reductions = True  # type: ignore[attr-defined]
    return parallelize


__all__ = ["CpuDeviceModule", "cpu_config", "set_pg_timeouts", "sum_reductions", "use_cpu"]
