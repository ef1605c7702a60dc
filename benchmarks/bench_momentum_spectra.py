"""Can Newton–Schulz take 4 steps instead of 5 on real momentum? Measured on a training run.

A tighter bound on sigma_max than ||X||_F is free in the first quintic step: S = X X^T and S S
are computed anyway, and ||S S||_F^(1/4) = (sum sigma_i^8)^(1/8) >= sigma_max. Normalising by it
instead of ||X||_F raises every singular value by r = ||X||_F / ||S S||_F^(1/4), which could buy
back one of ns5's five steps (each step multiplies a small singular value by at most a = 3.4445):

* ns5, 5 steps, ``X / ||X||_F``: reaches the band (sigma >= 0.68) from sigma / ||X||_F >= 0.00150;
* ns5, 4 steps, ``X / ||S S||_F^(1/4)``: from sigma / ||S S||_F^(1/4) >= 0.00517 (3.44x higher).

So the 4-step variant is no less accurate only where r >= 3.44; r <= ||X||_F / sigma_max =
sqrt(stable rank). The optimizer-step benchmark's synthetic matrices (singular values
log-spaced in [0.01, 1]) have r = 4.8. This script measures r and the stable rank of the
momentum V that Muon actually orthogonalises while training the `muonclip compare` default
GPT on the built-in corpus (AdamW for embeddings, head and gains, as in compare), and for both
variants (bf16) how many singular directions land in ns5's band, |sigma - 1| <= 0.32 (real
momenta have singular values near 0 that no 5-step quintic reaches, so max |sigma - 1| is ~1
for both and says nothing).

Usage: ``python benchmarks/bench_momentum_spectra.py [--steps 300] [--every 100]``.
"""

from __future__ import annotations

import argparse

import torch
from timing import setup_threads

import muonclip
from muonclip.app.config import RunConfig
from muonclip.app.data.batches import train_batch
from muonclip.app.data.corpus import load_corpus
from muonclip.models import GPT, GPTConfig
from muonclip.ortho import orthogonalize
from muonclip.ortho._newton_schulz import NS5_COEFFICIENTS


def ns5_four_steps_tight_norm(V: torch.Tensor) -> torch.Tensor:
    """4 ns5 steps in bf16 after normalising by ||S S||_F^(1/4) (S = X X^T): the variant under test."""
    X = V.to(torch.bfloat16)
    transposed = X.shape[-2] > X.shape[-1]
    if transposed:
        X = X.mT
    X = X / (torch.linalg.vector_norm(X, dim=(-2, -1), keepdim=True) + 1e-7)  # keep bf16 products in range
    a, b, c = NS5_COEFFICIENTS
    for i in range(4):
        S = X @ X.mT
        SS = S @ S
        if i == 0:  # rescale by the tighter bound, reusing S and S S
            s = torch.linalg.vector_norm(SS.float(), dim=(-2, -1), keepdim=True).pow(0.25) + 1e-7
            X, S, SS = X / s.to(X.dtype), S / (s * s).to(S.dtype), SS / s.pow(4).to(SS.dtype)
        X = a * X + (b * S + c * SS) @ X
    return X.mT if transposed else X


def in_band(O: torch.Tensor, band: float = 0.32) -> int:
    """Singular values of ``O`` (float64) within ``band`` of 1."""
    return int(((torch.linalg.svdvals(O.double()) - 1).abs() <= band).sum())


def spectra(V: torch.Tensor) -> tuple[float, float]:
    """(stable rank ||V||_F^2 / sigma_max^2, r = ||V||_F / ||S S||_F^(1/4))."""
    s = torch.linalg.svdvals(V.double())
    return float(s.square().sum() / s[0] ** 2), float(s.square().sum().sqrt() / s.pow(8).sum().pow(0.125))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    setup_threads(args.threads)
    cfg = RunConfig()
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head, n_embd=cfg.n_embd))
    groups = muonclip.param_groups(model, adamw_lr=cfg.lr_adamw)
    opt = muonclip.Muon(groups, lr=cfg.lr_muon, weight_decay=cfg.weight_decay)
    muon_params = {id(q) for g in opt.param_groups if g["algorithm"] == "muon" for q in g["params"]}
    hidden = [(n, p) for n, p in model.named_parameters() if id(p) in muon_params]
    momentum = {id(q): g["momentum"] for g in opt.param_groups for q in g["params"]}
    corpus = load_corpus()
    print(f"GPT {cfg.n_layer} layers x {cfg.n_embd} wide, batch {cfg.batch_size} x {cfg.block_size}, "
          f"Muon lr {cfg.lr_muon} (constant), {len(hidden)} hidden matrices\n")
    print("| step | matrices | stable rank (median, min) | r (median, min) | share r >= 3.44 "
          "| directions in band: ns5 5 steps | 4 steps, tight norm | matrices with fewer in band |")
    print("|---|---|---|---|---|---|---|---|")
    for step in range(1, args.steps + 1):
        x, y = train_batch(corpus, step, batch_size=cfg.batch_size, block_size=cfg.block_size, seed=0)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        if step % args.every == 0 or step == 1:
            rows = []
            for _, p in hidden:  # V = G + mu M: what this step orthogonalised (Nesterov, the default)
                V = p.grad + momentum[id(p)] * opt.state[p]["momentum_buffer"]
                sr, r = spectra(V)
                rows.append((sr, r, in_band(orthogonalize(V, "ns5")), in_band(ns5_four_steps_tight_norm(V))))
            srs, rs = sorted(x[0] for x in rows), sorted(x[1] for x in rows)
            n5, n4 = sum(x[2] for x in rows), sum(x[3] for x in rows)
            worse = sum(x[3] < x[2] for x in rows)
            total = sum(min(p.shape) for _, p in hidden)
            mid = len(rows) // 2
            print(f"| {step} | {len(rows)} | {srs[mid]:.1f}, {srs[0]:.1f} | {rs[mid]:.2f}, {rs[0]:.2f} "
                  f"| {sum(r >= 3.44 for r in rs) / len(rs):.2f} | {n5} of {total} | {n4} of {total} "
                  f"| {worse} of {len(rows)} |", flush=True)
        opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
