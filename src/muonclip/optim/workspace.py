"""Workspaces: where a Muon step's buckets live and how they are orthogonalised.

`muonclip.Muon` writes the V of same-shape matrices into one bucket (``workspace.empty``) and
orthogonalises it with one call (``workspace.orthogonalize``). A workspace changes where those
tensors live and how a batch is cut, never what is computed: the built-in ones run the core's
one iteration of each method (`muonclip.ortho`), given their storage, and each is tested
against the core's result.

* ``"core"`` (`CoreWorkspace`): a new tensor for every bucket and the pure `muonclip.orthogonalize`.
* ``"buffered"`` (`muonclip.fast.BufferedWorkspace`, registered by `muonclip.fast`): on CPU,
  buffers reused by every bucket and chunk of a step, released when the step ends.
* ``"auto"`` (`AutoWorkspace`, Muon's default): per device type, the workspace registered for it
  with ``auto_for`` (``"buffered"`` for CPU), else ``"core"``.

A workspace is any object with the two methods of `Workspace`, and optionally ``release()``:
`muonclip.Muon` calls it when a step is over (also one that raised), so that what the workspace
kept for the step's buckets does not sit under the next forward and backward passes.
`register_workspace` gives one a name.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from ..common import defaults as D
from ..ortho import run_method


@runtime_checkable
class Workspace(Protocol):
    """What `muonclip.Muon` asks of a workspace."""

    def empty(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """An uninitialised tensor for ``role`` (``"input"``: a bucket's V, handed to
        `orthogonalize` and not read again)."""
        ...

    def orthogonalize(self, V: Tensor, method: str, steps: int | None = D.NS_STEPS,
                      dtype: torch.dtype | str | None = D.ORTH_DTYPE, *, eps: float = D.EPS,
                      coefficients: Sequence[float] | None = D.NS_COEFFICIENTS,
                      reuse_result: bool = False) -> Tensor:
        """`muonclip.orthogonalize` of the batch ``V`` (which it may overwrite), in ``V``'s dtype.
        ``reuse_result``: the result may be overwritten by the next call (the caller has used
        it by then)."""
        ...


class CoreWorkspace:
    """The core: a new tensor for every bucket, the pure `muonclip.orthogonalize`."""

    name = "core"

    def empty(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """A new uninitialised tensor (``role`` is ignored)."""
        return torch.empty(tuple(shape), dtype=dtype, device=device)

    def orthogonalize(self, V: Tensor, method: str, steps: int | None = D.NS_STEPS,
                      dtype: torch.dtype | str | None = D.ORTH_DTYPE, *, eps: float = D.EPS,
                      coefficients: Sequence[float] | None = D.NS_COEFFICIENTS,
                      reuse_result: bool = False) -> Tensor:
        """`muonclip.orthogonalize` (``V`` is not written; ``reuse_result`` is ignored), as
        `muonclip.ortho.run_method`: the step has checked its gradients, no pass over V for it."""
        return run_method(V, method, steps, dtype, eps=eps, coefficients=coefficients)

    def __repr__(self) -> str:
        return "CoreWorkspace()"


WORKSPACES: dict[str, Callable[[], Any]] = {"core": CoreWorkspace}
"""Workspace name -> factory (a class, or any callable returning a workspace)."""

_AUTO: dict[str, str] = {}  # device type -> the name "auto" picks there


def register_workspace(name: str, factory: Callable[[], Any], auto_for: Collection[str] = ()) -> None:
    """Name a workspace (``Muon(workspace=name)``); with ``auto_for``, the device types for which
    ``workspace="auto"`` picks it."""
    WORKSPACES[name] = factory
    for device_type in auto_for:
        _AUTO[device_type] = name


class AutoWorkspace:
    """Per device type, the workspace registered for it (``auto_for``), else the core; one
    instance of each, made on first use."""

    name = "auto"

    def __init__(self) -> None:
        self.by_device: dict[str, Any] = {}

    def for_device(self, device: torch.device) -> Any:
        """The workspace used for tensors on ``device``."""
        workspace = self.by_device.get(device.type)
        if workspace is None:
            workspace = self.by_device[device.type] = WORKSPACES[_AUTO.get(device.type, "core")]()
        return workspace

    def empty(self, role: str, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> Tensor:
        """``empty`` of ``device``'s workspace."""
        return self.for_device(device).empty(role, shape, dtype, device)

    def orthogonalize(self, V: Tensor, method: str, steps: int | None = D.NS_STEPS,
                      dtype: torch.dtype | str | None = D.ORTH_DTYPE, *, eps: float = D.EPS,
                      coefficients: Sequence[float] | None = D.NS_COEFFICIENTS,
                      reuse_result: bool = False) -> Tensor:
        """``orthogonalize`` of ``V.device``'s workspace."""
        return self.for_device(V.device).orthogonalize(V, method, steps, dtype, eps=eps, coefficients=coefficients,
                                                       reuse_result=reuse_result)

    def __repr__(self) -> str:
        return f"AutoWorkspace({self.by_device!r})"


def workspace_for(workspace: Workspace, device: torch.device) -> Workspace:
    """The workspace that runs ``device``'s buckets: ``workspace.for_device(device)`` for a workspace that
    chooses per device (`AutoWorkspace`), else ``workspace`` itself. A step resolves it once, when it
    builds its buckets (`muonclip.optim._buckets.make_buckets`)."""
    choose = getattr(workspace, "for_device", None)
    return workspace if choose is None else choose(device)


def make_workspace(workspace: str | Workspace) -> Workspace:
    """The workspace ``Muon(workspace=...)`` names: ``"auto"``, a registered name, or an object with
    `Workspace`'s methods (used as it is). Raises ValueError otherwise."""
    if isinstance(workspace, str):
        if workspace == "auto":
            return AutoWorkspace()
        if workspace not in WORKSPACES:
            raise ValueError(f"unknown workspace {workspace!r}; choose 'auto' or one of {sorted(WORKSPACES)}")
        return WORKSPACES[workspace]()
    if not isinstance(workspace, Workspace):
        raise ValueError(f"workspace must be a name or an object with empty() and orthogonalize(), got {workspace!r}")
    return workspace


__all__ = ["WORKSPACES", "AutoWorkspace", "CoreWorkspace", "Workspace", "make_workspace", "register_workspace",
           "workspace_for"]
