"""Backends: where a Muon step's buckets live and how they are orthogonalised.

`muonclip.Muon` writes the V of same-shape matrices into one bucket (``backend.empty``) and
orthogonalises it with one call (``backend.orthogonalize``). A backend changes where those
tensors live and how the products run, never what they compute: each is tested against the
core's result.

* ``"core"`` (`CoreBackend`): a new tensor for every bucket and the pure `muonclip.orthogonalize`.
* ``"buffered"`` (`muonclip.fast.BufferedBackend`, registered by `muonclip.fast`): buffers kept
  between steps on CPU.
* ``"auto"`` (`AutoBackend`, Muon's default): per device type, the backend registered for it
  with ``auto_for`` (``"buffered"`` for CPU), else ``"core"``.

A backend is any object with the two methods of `Backend`; `register_backend` gives one a name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..ortho import run_method


@runtime_checkable
class Backend(Protocol):
    """What `muonclip.Muon` asks of a backend."""

    def empty(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised tensor for ``role`` (``"input"``: a bucket's V, handed to
        `orthogonalize` and not read again)."""
        ...

    def orthogonalize(self, V: Tensor, method: str, steps: int | None = None, dtype: torch.dtype | None = None, *,
                      eps: float = 1e-7, coefficients: Sequence[float] | None = None,
                      reuse_result: bool = False) -> Tensor:
        """`muonclip.orthogonalize` of the batch ``V`` (which it may overwrite), in ``V``'s dtype.
        ``reuse_result``: the result may be overwritten by the next call (the caller has used
        it by then)."""
        ...


class CoreBackend:
    """The core: a new tensor for every bucket, the pure `muonclip.orthogonalize`."""

    name = "core"

    def empty(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A new uninitialised tensor (``role`` is ignored)."""
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def orthogonalize(self, V: Tensor, method: str, steps: int | None = None, dtype: torch.dtype | None = None, *,
                      eps: float = 1e-7, coefficients: Sequence[float] | None = None,
                      reuse_result: bool = False) -> Tensor:
        """`muonclip.orthogonalize` (``V`` is not written; ``reuse_result`` is ignored), as
        `muonclip.ortho.run_method`: the step has checked its gradients, no pass over V for it."""
        return run_method(V, method, steps, dtype, eps=eps, coefficients=coefficients)

    def __repr__(self) -> str:
        return "CoreBackend()"


BACKENDS: dict[str, Callable[[], Any]] = {"core": CoreBackend}
"""Backend name -> factory (a class, or any callable returning a backend)."""

_AUTO: dict[str, str] = {}  # device type -> the name "auto" picks there


def register_backend(name: str, factory: Callable[[], Any], auto_for: Collection[str] = ()) -> None:
    """Name a backend (``Muon(backend=name)``); with ``auto_for``, the device types for which
    ``backend="auto"`` picks it."""
    BACKENDS[name] = factory
    for device_type in auto_for:
        _AUTO[device_type] = name


class AutoBackend:
    """Per device type, the backend registered for it (``auto_for``), else the core; one
    instance of each, made on first use."""

    name = "auto"

    def __init__(self) -> None:
        self.by_device: dict[str, Any] = {}

    def for_device(self, device: torch.device) -> Any:
        """The backend used for tensors on ``device``."""
        backend = self.by_device.get(device.type)
        if backend is None:
            backend = self.by_device[device.type] = BACKENDS[_AUTO.get(device.type, "core")]()
        return backend

    def empty(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """``empty`` of ``device``'s backend."""
        return self.for_device(device).empty(role, shape, dtype, device)

    def orthogonalize(self, V: Tensor, method: str, steps: int | None = None, dtype: torch.dtype | None = None, *,
                      eps: float = 1e-7, coefficients: Sequence[float] | None = None,
                      reuse_result: bool = False) -> Tensor:
        """``orthogonalize`` of ``V.device``'s backend."""
        return self.for_device(V.device).orthogonalize(V, method, steps, dtype, eps=eps, coefficients=coefficients,
                                                       reuse_result=reuse_result)

    def __repr__(self) -> str:
        return f"AutoBackend({self.by_device!r})"


def backend_for(backend: Backend, device: torch.device) -> Backend:
    """The backend that runs ``device``'s buckets: ``backend.for_device(device)`` for a backend that
    chooses per device (`AutoBackend`), else ``backend`` itself. A step resolves it once, when it
    builds its buckets (`muonclip.optim.buckets.make_buckets`)."""
    choose = getattr(backend, "for_device", None)
    return backend if choose is None else choose(device)


def make_backend(backend: str | Backend) -> Backend:
    """The backend ``Muon(backend=...)`` names: ``"auto"``, a registered name, or an object with
    `Backend`'s methods (used as it is). Raises ValueError otherwise."""
    if isinstance(backend, str):
        if backend == "auto":
            return AutoBackend()
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose 'auto' or one of {sorted(BACKENDS)}")
        return BACKENDS[backend]()
    if not isinstance(backend, Backend):
        raise ValueError(f"backend must be a name or an object with empty() and orthogonalize(), got {backend!r}")
    return backend


__all__ = ["BACKENDS", "AutoBackend", "Backend", "CoreBackend", "backend_for", "make_backend", "register_backend"]
