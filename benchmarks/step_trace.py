"""What one `muonclip.Muon.step` (and one `muonclip.MuonClip.step`) runs: the files and functions
it enters, and the walk of a weight's lr.

Three measures, each printed as a table and, with ``--json``, as one JSON object:

* **Files and functions per step** (one process, CPU, ``Muon``'s defaults, or ``--workspace``):
  a small GPT-like set of weights (per layer q, k, v, o ``d x d``, the MLP's ``4d x d`` and
  ``d x 4d``, plus a stacked-expert weight and an AdamW group) takes a first step (the state
  and the step's structure are made then), and the second step is traced with
  ``sys.setprofile``: every Python function entered (a ``call`` event) whose file is under
  ``src/muonclip`` counts, once per (file, function). The count is deterministic: it depends
  on the code, not on timing.

* **Files and functions per MuonClip step** (``--clip``; one process, CPU, ``MuonClip``'s
  defaults, ``--workspace``): the reference GPT (`muonclip.models.GPT`, 2 layers of MHA, 4
  heads) takes a forward and backward that record its max logits, a first step, another
  forward and backward, and the second step is traced the same way. Its ``tau`` is set below
  the recorded maxima of some heads, so the clip scales rows.

* **The lr walk** (``--walk``, two processes over gloo): one Muon step over two ranks
  (replicated plain parameters, as DDP gives them, ``process_group`` the default group), the
  lr of every group a value found nowhere else (``LR``). On rank 0, from the step's entry to
  its end, ``sys.settrace`` follows every Python frame of ``src/muonclip``:

  - a **stay** is a frame (one call of a function) in which the lr is held as a value: an
    argument or local variable that equals ``LR``, or holds it up to two levels down (tuple,
    list, dict value, dataclass field: e.g. a list of per-weight records, a dict of per-group
    ``(lr, weight_decay)``); the param group itself (the dict the user's lr sits in) does not
    count: the walk starts where the lr is read out of it;
  - a **room** is a distinct function among the stays;
  - a **return** is a ``return`` event whose value is, or holds (as above), ``LR``.

  The weights: 3 layers of the GPT set above, 18 matrices in one group. The figures count
  frames, not time, and are the same on every run.

Usage: ``python benchmarks/step_trace.py [--workspace auto|core] [--clip] [--walk] [--json]`` (on a tree
from before the workspace had its name, ``--workspace`` is passed as ``backend=``).
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import muonclip

SRC = str(Path(muonclip.__file__).resolve().parent)
LR = 0.00123456789  # a value nothing else in a step holds
D, LAYERS = 32, 3


def shapes(layers: int = LAYERS, d: int = D) -> list[tuple[int, ...]]:
    """The hidden matrices of a GPT block stack (q, k, v, o, c_fc, c_proj per layer)."""
    return [s for _ in range(layers) for s in [(d, d)] * 4 + [(4 * d, d), (d, 4 * d)]]


def optimizer(workspace: str = "auto", experts: bool = True) -> muonclip.Muon:
    """A Muon over the GPT set (plus a stacked-expert weight and an AdamW group), with gradients."""
    gen = torch.Generator().manual_seed(0)
    muon = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes()]
    if experts:
        muon.append(torch.nn.Parameter(torch.randn(4, D, 2 * D, generator=gen)))
    adamw = [torch.nn.Parameter(torch.randn(D, generator=gen))]
    for p in muon + adamw:
        p.grad = torch.randn(p.shape, generator=gen)
    key = "workspace" if "workspace" in inspect.signature(muonclip.Muon).parameters else "backend"  # its older name
    return muonclip.Muon([{"params": muon}, {"params": adamw, "algorithm": "adamw"}], lr=LR, **{key: workspace})


def _short(filename: str) -> str:
    return os.path.relpath(filename, SRC)


def clip_optimizer(workspace: str = "auto") -> tuple[muonclip.MuonClip, object]:
    """A MuonClip over the reference GPT, and ``backward()``: one forward and backward that
    records the max logits (the same batch each time)."""
    from muonclip.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, n_embd=32)).train()
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    opt = muonclip.MuonClip(model, lr=LR, tau=0.05, workspace=workspace, orth_dtype=torch.float32)

    def backward() -> None:
        opt.zero_grad()
        model(idx, idx)[1].backward()

    return opt, backward


def files_and_functions(workspace: str = "auto", clip: bool = False) -> dict[str, list[str]]:
    """``file (relative to src/muonclip) -> sorted functions`` entered by the second step (of
    `MuonClip` on the reference GPT with ``clip``, else of `Muon` on the GPT set)."""
    if clip:
        opt, backward = clip_optimizer(workspace)
        backward()
        opt.step()
        backward()
    else:
        opt = optimizer(workspace)
        opt.step()
    entered: set[tuple[str, str]] = set()

    def profile(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(SRC):
                entered.add((_short(f), frame.f_code.co_qualname))

    sys.setprofile(profile)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    out: dict[str, list[str]] = {}
    for f, fn in sorted(entered):
        out.setdefault(f, []).append(fn)
    return out


def holds_lr(v: object, depth: int = 2) -> bool:
    """Whether ``v`` is ``LR`` or holds it up to two levels down (tuple, list, dict value,
    dataclass field, NamedTuple field); a param group (a dict with ``"params"``) does not count."""
    if isinstance(v, float) and not isinstance(v, bool):
        return v == LR
    if depth == 0:
        return False
    if isinstance(v, dict):
        return "params" not in v and any(holds_lr(x, depth - 1) for x in v.values())
    if isinstance(v, (tuple, list)):
        return any(holds_lr(x, depth - 1) for x in v)
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return any(holds_lr(getattr(v, f.name, None), depth - 1) for f in dataclasses.fields(v))
    return False


def trace_walk(opt: muonclip.Muon) -> dict[str, list[str]]:
    """The lr walk of one ``opt.step()`` on this process (module docstring): the functions of its
    stays and of its returns, in order."""
    stays: list[str] = []
    returns: list[str] = []

    def trace(frame, event, arg):
        if event != "call" or not frame.f_code.co_filename.startswith(SRC):
            return None
        seen = False

        def lines(frame, event, arg):  # this frame's events: a stay once it holds the lr
            nonlocal seen
            if not seen and any(holds_lr(v) for v in frame.f_locals.values()):
                seen = True
                stays.append(frame.f_code.co_qualname)
            if event == "return" and holds_lr(arg):
                returns.append(frame.f_code.co_qualname)
            return lines

        return lines(frame, event, arg)

    sys.settrace(trace)
    try:
        opt.step()
    finally:
        sys.settrace(None)
    return {"stays": stays, "returns": returns}


def _walk_worker(rank: int, world: int, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        opt = optimizer("core", experts=False)
        opt.step()  # the first step builds the state and the plan; the second is walked
        got = trace_walk(opt)
        if rank == 0:
            Path(out).write_text(json.dumps(got))
    finally:
        dist.destroy_process_group()


def lr_walk() -> dict[str, object]:
    """The lr walk of one two-rank step (module docstring): stays, rooms, returns."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "walk.json")
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        mp.start_processes(_walk_worker, args=(2, init, out), nprocs=2, start_method="spawn")
        got = json.loads(Path(out).read_text())
    return {"stays": len(got["stays"]), "rooms": len(set(got["stays"])), "returns": len(got["returns"]),
            "rooms_list": sorted(set(got["stays"])), "returns_by_function": _counts(got["returns"])}


def _counts(names: list[str]) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in names:
        out[n] = out.get(n, 0) + 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workspace", default="auto")
    parser.add_argument("--clip", action="store_true", help="a MuonClip step on the reference GPT")
    parser.add_argument("--walk", action="store_true", help="also the two-rank lr walk")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    entered = files_and_functions(args.workspace, args.clip)
    result: dict[str, object] = {"files": len(entered), "functions": sum(map(len, entered.values())),
                                 "entered": entered}
    if args.walk:
        result["walk"] = lr_walk()
    if args.json:
        print(json.dumps(result, indent=1))
        return
    what = "MuonClip" if args.clip else "Muon"
    print(f"# one {what}.step (workspace={args.workspace!r}, CPU): {result['files']} files, "
          f"{result['functions']} functions of src/muonclip\n")
    for f, fns in entered.items():
        print(f"{f:40s} {len(fns):3d}  {', '.join(fns)}")
    if args.walk:
        w = result["walk"]
        print(f"\n# lr walk of one two-rank step: {w['stays']} stays, {w['rooms']} rooms, {w['returns']} returns")
        print("rooms:", ", ".join(w["rooms_list"]))
        print("returns:", ", ".join(f"{k} x{v}" for k, v in w["returns_by_function"].items()))


if __name__ == "__main__":
    main()
