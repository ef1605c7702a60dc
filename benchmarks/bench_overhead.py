"""Fixed cost of one optimizer step: everything but Newton–Schulz, on tiny matrices.

The GPT set's 36 hidden matrices (6 layers: q, k, v, o at d x d, c_fc 4d x d, c_proj d x 4d)
at d = 4 by default, so the arithmetic is negligible and what is timed is Python, dispatch
and the small elementwise passes, i.e. what a GPU step spends launching kernels. The
orthogonaliser is replaced by the identity in both muonclip.Muon (a workspace whose
``orthogonalize`` returns its input) and torch.optim.Muon (so their Newton–Schulz is not timed
at all), then, timed round-robin in one run (timing.py):

* ``muonclip.Muon`` default (non-finite check with one host read), and ``on_nonfinite="mask"``
  (no host read);
* the same with the step structure rebuilt every step (no cache: what the buckets and update
  scales cost);
* ``torch.optim.Muon`` (same lr, weight decay; no non-finite check);
* ``torch.optim.AdamW(foreach=True)``.

Usage: ``python benchmarks/bench_overhead.py [--threads 1] [--rounds 200] [--clock process]
[--d 4] [--layers 6] [--device cpu|cuda]``.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch
from step_sets import LR, WD, gpt_shapes, make_params
from timing import machine, round_robin, setup_threads

import muonclip
from muonclip.optim.workspace import CoreWorkspace

try:
    import torch.optim._muon as torch_muon_module
except ImportError:  # pragma: no cover
    torch_muon_module = None


class IdentityWorkspace(CoreWorkspace):
    """muonclip.Muon's buckets, not orthogonalised."""

    def orthogonalize(self, V, *args, **kwargs):
        return V


def _torch_identity(grad, *args, **kwargs):
    return grad


@contextmanager
def no_newton_schulz():
    """torch.optim.Muon's orthogonaliser replaced by the identity while inside."""
    theirs = None
    if torch_muon_module is not None:
        theirs = torch_muon_module._zeropower_via_newtonschulz
        torch_muon_module._zeropower_via_newtonschulz = _torch_identity
    try:
        yield
    finally:
        if theirs is not None:
            torch_muon_module._zeropower_via_newtonschulz = theirs


def rebuilt_every_step(opt):
    """``opt.step`` with its cached step structure dropped first."""

    def step():
        opt._structures.clear()
        opt.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--clock", choices=["wall", "process"], default="process")
    parser.add_argument("--d", type=int, default=4)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    setup_threads(args.threads)
    if args.device.startswith("cuda"):
        args.clock = "wall"
    shapes = gpt_shapes(args.d, args.layers)
    grads = [torch.randn(s) for s in shapes]

    def muon(**kw):
        return muonclip.Muon(make_params(shapes, grads, args.device), lr=LR, weight_decay=WD,
                             workspace=IdentityWorkspace(), **kw)

    opts = {
        "muonclip.Muon (default: check + host read)": muon(),
        'muonclip.Muon on_nonfinite="mask" (no host read)': muon(on_nonfinite="mask"),
        "muonclip.Muon, structure rebuilt every step": muon(),
        'muonclip.Muon "mask", structure rebuilt every step': muon(on_nonfinite="mask"),
    }
    steps = {n: rebuilt_every_step(o) if "rebuilt" in n else o.step for n, o in opts.items()}
    if hasattr(torch.optim, "Muon"):
        opts["torch.optim.Muon"] = torch.optim.Muon(make_params(shapes, grads, args.device), lr=LR, weight_decay=WD)
    kw = {"fused": True} if args.device.startswith("cuda") else {"foreach": True}
    opts[f"torch.optim.AdamW({next(iter(kw))}=True)"] = torch.optim.AdamW(
        make_params(shapes, grads, args.device), lr=LR, weight_decay=WD, **kw
    )
    steps.update({n: o.step for n, o in opts.items() if n not in steps})
    with no_newton_schulz():
        times = round_robin(steps, rounds=args.rounds, warmup=5,
                            clock=args.clock, device=args.device)
    base = times.get("torch.optim.Muon")
    print(f"# Fixed cost per step, Newton–Schulz replaced by the identity ({machine()}, {args.clock} clock)\n")
    print(f"{len(shapes)} matrices: GPT set at d={args.d}, {args.layers} layers, on {args.device}\n")
    print("| optimizer | ms per step | / torch.optim.Muon |")
    print("|---|---|---|")
    for name, t in times.items():
        ratio = f"{t / base:.2f}" if base else "n/a"
        print(f"| {name} | {t * 1e3:.3f} | {ratio} |")


if __name__ == "__main__":
    main()
