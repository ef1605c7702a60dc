"""The library's own Python at Kimi K2's count of matrices, on one core.

Kimi K2 (`muonclip.app.plan_model.BUILTINS`' ``kimi-k2``): 61 layers, the first dense and 60 of
384 routed experts plus one shared expert, MLA attention with 64 heads. This builds that COUNT of
matrices at a small width (hidden 32, expert width 8, MLA ranks 16/16, head dims 4+4/4, vocabulary
256: about 19M parameters), with transformers' ``DeepseekV3ForCausalLM`` from a config, in two forms:

* ``3d``: the experts as transformers 5 stores them, two 3-D tensors per layer (``gate_up_proj``
  ``(384, 16, 32)``, ``down_proj`` ``(384, 32, 8)``): 61 x ~10 weights, 60 x 2 x 384 matrices;
* ``linear``: every expert a module of three ``nn.Linear`` (``gate_proj``, ``up_proj``,
  ``down_proj``), as older transformers and many custom models hold them: 60 x 384 x 3 = 69,120
  matrices, each its own parameter.

Timed, in one process, ``torch.set_num_threads(1)``, by the process's CPU time
(``time.process_time``: with one thread, the wall time on a quiet machine, and barely changed by
other processes on a loaded one), each once, in seconds:

* ``param_groups``: ``muonclip.param_groups(model)``;
* ``Muon()``: ``muonclip.Muon(param_groups(model))`` (param_groups included);
* ``MuonClip()``: ``muonclip.MuonClip(model)`` (finding and attaching the 61 attention layers too);
* ``plan 1 rank`` / ``plan 256``: what ``muonclip plan`` runs once the model is built (the routing
  `muonclip.app.plan_model.route`, which builds ``MuonClip(model)``, and
  `muonclip.app.plan.make_plan`), for one rank and for NVIDIA's K2 layout PP4 x DP64 (ZeRO-1) x EP64;
* a step, first and steady (the second and third, the faster taken), of Muon and of MuonClip after
  a forward and backward of 2 x 16 tokens (MuonClip records the max logits of every head in it);
  every parameter without a gradient (experts no token reached) is given a random one, so every
  matrix is stepped, as in a large batch.

**Overhead beyond the arithmetic** (``overhead``): the step's wall time less (a) the time spent in
the workspace's ``orthogonalize`` calls during that very step (the Newton–Schulz arithmetic,
wrapped and timed: the calls are the same, so is their work) and (b) the element-wise arithmetic
of the same step done alone, by torch's ``_foreach`` kernels over the same tensors (Muon:
momentum ``M = mu M + G``, ``V = G + mu M``, the decay, the update: four passes over every Muon
weight and two more per AdamW weight; done on copies, so nothing is changed). What is left is
the library's Python and torch's per-call dispatch: the bookkeeping, and the copies the step
makes (V stacked into buckets; small weights' gradients, momenta and weights stacked and copied
back): an upper bound on the bookkeeping.

**The lean step** (``lean``, and ``steady - lean``): the same step written per weight with no
bookkeeping (`lean_step`: the gradient check, then per weight one torch call per pass, into
buckets orthogonalised by the same workspace, on copies): torch.optim.Muon's form, written as
lean as it goes. ``steady - lean`` is what the library adds to it, or, negative, what its
stacked passes over small weights save.

``--profile FORM:WHAT`` (e.g. ``linear:muonclip-step``) prints cProfile's top functions of one
measurement instead.

Usage: ``python benchmarks/bench_bookkeeping.py [--forms 3d,linear] [--profile FORM:WHAT] [--top 25]``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

LAYERS, EXPERTS, HEADS = 61, 384, 64
FIELDS = dict(vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=8, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=HEADS, n_routed_experts=EXPERTS, n_shared_experts=1,
              num_experts_per_tok=8, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=16,
              kv_lora_rank=16, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, max_position_embeddings=64,
              tie_word_embeddings=False)


class LinearExperts(nn.Module):
    """The routed experts as separate modules, each ``gate_proj``/``up_proj``/``down_proj`` ``nn.Linear``
    (older transformers' ``DeepseekV3MoE.experts``), with transformers 5's experts' call."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP

        self.experts = nn.ModuleList(DeepseekV3MLP(config, config.moe_intermediate_size)
                                     for _ in range(config.n_routed_experts))

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            out.index_add_(0, token, self.experts[e](hidden[token]) * top_k_weights[token, slot, None])
        return out


def build(form: str) -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**FIELDS))
    if form == "linear":
        for layer in model.model.layers:
            if hasattr(layer.mlp, "experts"):
                layer.mlp.experts = LinearExperts(model.config)
    return model


def forward_backward(model: nn.Module) -> None:
    ids = torch.randint(0, FIELDS["vocab_size"], (2, 16), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    g = torch.Generator().manual_seed(2)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.randn(p.shape, generator=g) * 1e-3


class TimedWorkspace:
    """A workspace that times its inner one's ``orthogonalize`` (the Newton–Schulz arithmetic)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.seconds = inner, 0.0

    def for_device(self, device: torch.device) -> TimedWorkspace:
        self.inner = self.inner.for_device(device) if hasattr(self.inner, "for_device") else self.inner
        return self

    def empty(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.empty(*args, **kwargs)

    def orthogonalize(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.process_time()
        out = self.inner.orthogonalize(*args, **kwargs)
        self.seconds += time.process_time() - start
        return out

    def release(self) -> None:
        release = getattr(self.inner, "release", None)
        if release is not None:
            release()


def adamw_copies(opt: torch.optim.Optimizer) -> tuple[list[torch.Tensor], ...]:
    """Copies of the AdamW branch's weights and gradients, and two moments (the weights' values)."""
    adamw = [p for g in opt.param_groups if g["algorithm"] == "adamw" for p in g["params"]]
    return ([p.detach().clone() for p in adamw], [p.grad.clone() for p in adamw],
            [p.detach().clone() for p in adamw], [p.detach().clone() for p in adamw])


def adamw_passes(w: list[torch.Tensor], g: list[torch.Tensor], m1: list[torch.Tensor],
                 m2: list[torch.Tensor]) -> None:
    """The AdamW branch's element-wise passes by ``_foreach`` kernels (first and second moments,
    the update), in place on the lists given (copies)."""
    torch._foreach_lerp_(m1, g, 0.1)
    torch._foreach_mul_(m2, 0.95)
    torch._foreach_addcmul_(m2, g, g, value=0.05)
    denom = torch._foreach_sqrt(m2)
    torch._foreach_add_(denom, 1e-8)
    torch._foreach_addcdiv_(w, m1, denom, value=-1e-3)


def elementwise_alone(opt: torch.optim.Optimizer) -> float:
    """Seconds of the step's element-wise passes done by torch's ``_foreach`` kernels on copies."""
    muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    w, g, m = ([p.detach().clone() for p in muon], [p.grad.clone() for p in muon],
               [p.detach().clone() for p in muon])
    wa, ga, m1, m2 = adamw_copies(opt)
    start = time.process_time()
    torch._foreach_mul_(m, 0.95)
    torch._foreach_add_(m, g)  # M = mu M + G
    v = torch._foreach_add(g, m, alpha=0.95)  # V = G + mu M
    torch._foreach_mul_(w, 0.999)  # decay
    torch._foreach_add_(w, v, alpha=-1e-3)  # the update (the result of orth in its place)
    adamw_passes(wa, ga, m1, m2)
    return time.process_time() - start


@torch.no_grad()
def lean_step(opt: torch.optim.Optimizer) -> float:
    """Seconds of the leanest per-weight form of the same one-process Muon step, on copies: one
    torch call per weight per pass and no bookkeeping (torch.optim.Muon's form).

    The gradients checked (`muonclip.optim._validation.finite_per_tensor`, as the step does);
    then per Muon weight, with no bookkeeping, the calls the step cannot do without: ``M = G + mu
    M`` and ``V = G + mu M`` into its slot of a bucket of its shape (at most `chunk_limit`
    matrices, the step's), the bucket orthogonalised by the same kind of workspace, the decay and
    the update; the AdamW weights by ``_foreach`` kernels (as `elementwise_alone`).
    """
    from muonclip.optim._buckets import chunk_limit
    from muonclip.optim._validation import finite_per_tensor
    from muonclip.optim.workspace import make_workspace
    from muonclip.ortho import resolve_orth_dtype

    muon = [p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]]
    copies = [(p.detach().clone(), p.grad.clone(), torch.zeros_like(p)) for p in muon]
    wa, ga, m1, m2 = adamw_copies(opt)
    by_shape: dict[tuple[int, ...], list[tuple[torch.Tensor, ...]]] = {}
    for w, g, m in copies:
        by_shape.setdefault(tuple(w.shape), []).append((w, g, m))
    device = torch.device("cpu")
    dtype = resolve_orth_dtype("auto", "ns5", device)
    ws = make_workspace("auto").for_device(device)
    start = time.process_time()
    finite_per_tensor([g for _, g, _ in copies] + ga)
    for shape, items in by_shape.items():
        A, B = shape[-2:]
        E = shape[0] if len(shape) == 3 else 1
        run = max(1, chunk_limit(A, B, dtype, device) // E)
        scale = 0.2 * max(A, B) ** 0.5
        for lo in range(0, len(items), run):
            part = items[lo : lo + run]
            V = ws.empty("input", (len(part) * E, A, B), dtype, device)
            slots = V.unbind(0) if E == 1 else V.split(E)
            for (_, g, m), slot in zip(part, slots):
                torch.add(g, m, alpha=0.95, out=m)
                torch.add(g, m, alpha=0.95, out=slot)
            O = ws.orthogonalize(V, "ns5", None, dtype, eps=1e-7, coefficients=None, reuse_result=True)
            for (w, _, _), o in zip(part, O.unbind(0) if E == 1 else O.split(E)):
                w.mul_(0.999)
                w.add_(o, alpha=-1e-3 * scale)
    ws.release()
    adamw_passes(wa, ga, m1, m2)
    return time.process_time() - start


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out


def measure(form: str, profile: str | None, top: int) -> dict[str, float]:
    import muonclip
    from muonclip.app.plan import make_plan
    from muonclip.app.plan_layout import Mesh
    from muonclip.app.plan_model import route
    from muonclip.app.plan_time import DEVICES

    seconds, model = timed(lambda: build(form))
    n_params = sum(1 for _ in model.parameters())
    print(f"[{form}] model built in {seconds:.1f} s: {n_params} parameters, "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M elements", flush=True)
    row: dict[str, float] = {}

    def run(what: str, fn: Callable[[], Any]) -> Any:
        if profile == f"{form}:{what}":
            prof = cProfile.Profile()
            prof.enable()
            t, out = timed(fn)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(top)
        else:
            t, out = timed(fn)
        row[what] = t
        print(f"[{form}] {what}: {t:.3f} s", flush=True)
        return out

    run("param_groups", lambda: muonclip.param_groups(model))
    run("Muon()", lambda: muonclip.Muon(muonclip.param_groups(model), lr=1e-3))
    run("MuonClip()", lambda: muonclip.MuonClip(model, lr=1e-3))
    muonclip.integrations.hf.detach(model)
    pm = run("plan route", lambda: route(model, "k2-count"))
    muonclip.integrations.hf.detach(model)
    run("plan 1 rank", lambda: make_plan(pm, Mesh(), DEVICES["gb300"]))
    run("plan 256", lambda: make_plan(pm, Mesh(pp=4, dp_replicate=64, ep=64, zero1=True), DEVICES["gb300"]))
    pm = None  # the steps are timed with the model alone alive: Python's collector, which a step's new objects
    gc.collect()  # set off, walks every live object, so a larger heap (the plan's) costs each step more

    for name in ("muon", "muonclip"):
        ws = TimedWorkspace(muonclip.optim.workspace.make_workspace("auto"))
        opt = (muonclip.Muon(muonclip.param_groups(model), lr=1e-3, workspace=ws) if name == "muon"
               else muonclip.MuonClip(model, lr=1e-3, workspace=ws))
        steps = []
        for s in range(3):
            model.zero_grad(set_to_none=True)
            forward_backward(model)
            ws.seconds = 0.0
            run(f"{name} step {s + 1}", opt.step)
            steps.append((row[f"{name} step {s + 1}"], ws.seconds))
        elementwise = min(elementwise_alone(opt) for _ in range(2))
        lean = min(lean_step(opt) for _ in range(2))
        first, steady = steps[0], min(steps[1:])
        for label, (t, ns) in (("first", first), ("steady", steady)):
            row[f"{name} {label}"] = t
            row[f"{name} {label} ns"] = ns
            row[f"{name} {label} overhead"] = t - ns - elementwise
        row[f"{name} elementwise"] = elementwise
        row[f"{name} lean"] = lean
        row[f"{name} steady - lean"] = steady[0] - lean
        if name == "muonclip":
            muonclip.integrations.hf.detach(model)
        del opt
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--forms", default="3d,linear")
    ap.add_argument("--profile", default=None, help="FORM:WHAT, e.g. linear:muonclip step 2")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import muonclip.integrations.hf  # noqa: F401  (transformers' import is not what is measured)

    rows = {form: measure(form, args.profile, args.top) for form in args.forms.split(",")}
    print(f"\ntorch {torch.__version__}, 1 thread; CPU seconds (K2's count: {LAYERS} layers, {EXPERTS} experts)")
    keys = ["param_groups", "Muon()", "MuonClip()", "plan route", "plan 1 rank", "plan 256"]
    for name in ("muon", "muonclip"):
        keys += [f"{name} {k}" for k in ("first", "first ns", "first overhead", "steady", "steady ns",
                                          "steady overhead", "elementwise", "lean", "steady - lean")]
    print("| measured | " + " | ".join(rows) + " |")
    print("|---|" + "---:|" * len(rows))
    for k in keys:
        print(f"| {k} | " + " | ".join(f"{rows[f][k]:.3f}" for f in rows) + " |")


if __name__ == "__main__":
    main()
