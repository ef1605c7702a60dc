"""What a run's checkpoint carries besides its tensors: the run's identity (`RunIdentity`, with the
digest of its corpus, `corpus_digest`), kept in ``config.json`` and in every checkpoint pointer,
and torch's RNG states (`rng_state`, `set_rng_state`), with their JSON form for a sharded
checkpoint (`rng_to_json`, `rng_from_json`) and their check before a resume (`check_rng`)."""

from __future__ import annotations

import base64
import hashlib
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from ..distributed.checkpoint import CheckpointError
from .config import INT_LIMIT


@dataclass
class RunIdentity:
    """Who a run is, kept in ``config.json`` and in every checkpoint pointer.

    Attributes:
        id: a random id given when the run starts (a checkpoint copied in from another run
            carries another one).
        data_sha256: SHA-256 of the run's training and validation bytes (`corpus_digest`).
        history: the changes made on resume, in order: ``{"step": s, "changed": {field: [old, new]}}``.
        tensorboard: the entries of the run folder its TensorBoard logging wrote (a folder's
            name, or ``"."`` for event files in the run folder itself), which a resume keeps
            as the run's own (`muonclip.app.runfolder.inspect_folder`).
    """

    id: str
    data_sha256: str
    history: list[dict[str, Any]] = field(default_factory=list)
    tensorboard: list[str] = field(default_factory=list)

    @classmethod
    def new(cls, data_sha256: str) -> RunIdentity:
        return cls(uuid.uuid4().hex, data_sha256)

    def to_dict(self) -> dict[str, Any]:
        out = {"id": self.id, "data_sha256": self.data_sha256, "history": list(self.history)}
        return {**out, "tensorboard": list(self.tensorboard)} if self.tensorboard else out

    @classmethod
    def from_dict(cls, d: Any) -> RunIdentity:
        """The identity of ``d`` (`to_dict`'s form).

        Raises:
            ValueError: a field is missing or malformed, naming it (``run.<field>``).
        """
        if not isinstance(d, dict):
            raise ValueError(f"run must be a JSON object (the run's identity), got {d!r:.100}")
        for key in ("id", "data_sha256"):
            if not isinstance(d.get(key), str) or not d[key]:
                raise ValueError(f"run.{key} must be a non-empty string, got {d.get(key)!r:.100}")
        history = d.get("history", [])
        if not isinstance(history, list):
            raise ValueError(f"run.history must be a list of the resumes' changes, got {history!r:.100}")
        for i, h in enumerate(history):
            step = h.get("step") if isinstance(h, dict) else None
            changed = h.get("changed") if isinstance(h, dict) else None
            if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= INT_LIMIT \
                    or not isinstance(changed, dict) \
                    or not all(isinstance(v, list) and len(v) == 2 for v in changed.values()):
                raise ValueError(f"run.history[{i}] must be {{\"step\": a whole number >= 0, \"changed\": "
                                 f"{{field: [old, new]}}}}, got {h!r:.100}")
        tensorboard = d.get("tensorboard", [])
        if not isinstance(tensorboard, list) or not all(
                isinstance(e, str) and (e == "." or (e and e != ".." and "/" not in e)) for e in tensorboard):
            raise ValueError(f"run.tensorboard must be a list of entries of the run folder, got {tensorboard!r:.100}")
        return cls(d["id"], d["data_sha256"], list(history), list(tensorboard))


def corpus_digest(train: torch.Tensor, val: torch.Tensor) -> str:
    """SHA-256 of a corpus's training then validation bytes (uint8 tensors)."""
    h = hashlib.sha256()
    for t in (train, val):
        h.update(t.contiguous().numpy().tobytes())
        h.update(b"\x00")
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    """The torch RNG states to restore on resume (CPU, and every CUDA device if present)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    return {"torch": torch.get_rng_state(), "cuda": cuda}


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the states returned by `rng_state` (CUDA states only where CUDA is present)."""
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def rng_to_json(state: dict[str, Any]) -> dict[str, Any]:
    """`rng_state` as JSON: each byte tensor as base64 text."""
    def enc(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode("ascii")

    cuda = state.get("cuda")
    return {"torch": enc(state["torch"]), "cuda": None if cuda is None else [enc(t) for t in cuda]}


def rng_from_json(data: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `rng_to_json`, checked (`check_rng`).

    Raises:
        CheckpointError: not such a dict.
    """
    def dec(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)

    try:
        cuda = data.get("cuda")
        state = {"torch": dec(data["torch"]), "cuda": None if cuda is None else [dec(s) for s in cuda]}
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"the checkpoint's RNG states are unreadable ({type(e).__name__}: {e})") from None
    check_rng(state, "the checkpoint's RNG states")
    return state


def check_rng(state: Any, where: str) -> None:
    """Raise `CheckpointError` unless ``state`` is what `rng_state` returns and torch accepts it:
    ``{"torch": the CPU generator's uint8 state, "cuda": None or a list of uint8 states}`` (the
    CPU state is tried on the generator, which is then put back as it was)."""
    if not isinstance(state, dict) or not isinstance(state.get("torch"), torch.Tensor):
        raise CheckpointError(f"{where}: rng must be {{'torch': a uint8 tensor, 'cuda': ...}}, got {state!r:.100}")
    cuda = state.get("cuda")
    if cuda is not None and not isinstance(cuda, (list, tuple)):
        raise CheckpointError(f"{where}: rng.cuda must be None or a list of CUDA generator states, got {cuda!r:.100}")
    for name, t in [("rng.torch", state["torch"]), *((f"rng.cuda[{i}]", t) for i, t in enumerate(cuda or []))]:
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.ndim != 1:
            raise CheckpointError(f"{where}: {name} must be a 1-D uint8 tensor (a generator's state), got {t!r:.100}")
    own = torch.get_rng_state()
    try:
        torch.set_rng_state(state["torch"])
    except (RuntimeError, ValueError, TypeError) as e:
        raise CheckpointError(f"{where}: rng.torch is not a state of torch's CPU generator ({e})") from None
    finally:
        torch.set_rng_state(own)
