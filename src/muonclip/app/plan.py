"""``muonclip plan``: what one optimizer step costs on a model and a mesh, per rank, before any run.

The model is built on the meta device (`muonclip.app.plan_model`), laid out on the mesh
(`muonclip.app.plan_layout`) and planned by the distributed step's own planner
(`muonclip.distributed._plan.plan_step`, through `muonclip.app.plan_cost`): per rank, the
Newton–Schulz flops the owner plan gives it, the bytes gathered and scattered, the agreement and
clip all-reduces, the optimizer state (all exact: equal to what a real step counts), the peak
working set and the step's time (modelled: `muonclip.app.plan_time`), for Muon, MuonClip and
AdamW side by side, and the same flops and bytes when every rank orthogonalises everything it
holds a piece of, and the flops when owners are dealt round robin. `make_plan` returns it all as a
JSON-ready dict; `muonclip.app.report.plan_report` prints the table and draws the plot.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .plan_cost import compute_dtype, plan_costs
from .plan_layout import Mesh, MeshError, stage_of_layers
from .plan_model import BUILTINS, PlanModel, load_model
from .plan_time import DEVICES, Device, calibrate, model_times, override, training_step

DEFAULT_TOKENS = 4 * 2**20
DEFAULT_SEQ_LEN = 4096
DEFAULT_MFU = 0.4


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``muonclip plan``."""
    p.add_argument("model", help=f"a built-in ({', '.join(BUILTINS)}), preset:NAME (the app's GPT presets), "
                                 "torchtitan:NAME (a torchtitan config function, e.g. torchtitan:llama3_8b), or the "
                                 "path of a Hugging Face config.json (or its folder)")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="with preset:NAME: override a field of the preset's model (repeatable)")
    mesh = p.add_argument_group("mesh (every degree defaults to 1)")
    for name, what in (("dp-shard", "FSDP2 sharding (fully_shard)"),
                       ("dp-replicate", "data-parallel replicas (DDP; HSDP's replicas; ZeRO-1 with --zero1)"),
                       ("tp", "tensor parallel"), ("cp", "context parallel (sharded with --dp-shard, as torchtitan)"),
                       ("ep", "expert parallel, carved from the data-parallel ranks"),
                       ("pp", "pipeline stages (torchtitan's default layer split; each stage plans alone)")):
        mesh.add_argument(f"--{name}", type=int, default=1, metavar="N", help=what)
    mesh.add_argument("--zero1", action="store_true",
                      help="--dp-replicate ranks partition the optimizer state (ZeRO-1: DeepSpeed's flat ranges)")
    dev = p.add_argument_group("device (the time model; flops, bytes and memory do not depend on it)")
    dev.add_argument("--device", choices=[*DEVICES, "cpu"], default="h100",
                     help="a published peak of the device table, or cpu: measure this machine (default h100)")
    dev.add_argument("--peak-flops", type=float, metavar="FLOP/S", help="matmul rate instead of the device's")
    dev.add_argument("--mem-bw", type=float, metavar="B/S", help="memory bandwidth instead of the device's")
    dev.add_argument("--link-bw", type=float, metavar="B/S", help="bandwidth between ranks (NVLink and network)")
    run = p.add_argument_group("the training step around it")
    run.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, metavar="N",
                     help=f"tokens per optimizer step, all ranks (default {DEFAULT_TOKENS:,})")
    run.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, metavar="N",
                     help=f"sequence length, for attention's flops (default {DEFAULT_SEQ_LEN})")
    run.add_argument("--mfu", type=float, default=DEFAULT_MFU,
                     help=f"model flops utilisation of the forward and backward (default {DEFAULT_MFU})")
    run.add_argument("--comm-dtype", choices=("float32", "bfloat16"), default="float32",
                     help="Muon's wire dtype (comm_dtype; default float32, the momentum's)")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    out.add_argument("--plot", metavar="FILE", help="also draw the work per rank to FILE (PNG; matplotlib)")


def mesh_of(args: argparse.Namespace) -> Mesh:
    """The `Mesh` of the options."""
    return Mesh(dp_replicate=args.dp_replicate, dp_shard=args.dp_shard, cp=args.cp, tp=args.tp, ep=args.ep,
                pp=args.pp, zero1=args.zero1)


def device_of(args: argparse.Namespace, model: PlanModel) -> Device:
    """The device of the options: the table's, or this CPU measured in the step's compute dtype."""
    if args.device == "cpu":
        group = next((w.group for w in model.weights if w.muon), None)
        dtype = compute_dtype(group, "cpu") if group is not None else torch.float32
        device = calibrate(dtype)
    else:
        device = DEVICES[args.device]
    for name in ("peak_flops", "mem_bw", "link_bw"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {value}")
    return override(device, args.peak_flops, args.mem_bw, args.link_bw)


def _stats(values: Sequence[float]) -> dict[str, float]:
    mean = statistics.fmean(values)
    return {"min": min(values), "median": statistics.median(values), "max": max(values), "mean": mean,
            "imbalance": max(values) / mean if mean else 1.0}


def make_plan(model: PlanModel, mesh: Mesh, device: Device, *, tokens: int = DEFAULT_TOKENS,
              seq_len: int = DEFAULT_SEQ_LEN, mfu: float = DEFAULT_MFU,
              comm_dtype: torch.dtype | None = None, device_kind: str = "cuda") -> dict[str, Any]:
    """The whole plan as a JSON-ready dict: the inputs, per-rank lists (``ranks``), their
    min / median / max / mean / imbalance (``summary``), modelled times and the training step's
    share (module docstring). ``device_kind``: ``"cpu"`` when the step runs on this CPU.

    The alternative without owners is timed as its flops at the owner plan's mean seconds per
    flop, its element-wise work, and the bytes it receives at the network rate."""
    if tokens < 1 or seq_len < 1 or not 0 < mfu <= 1:
        raise ValueError(f"--tokens and --seq-len must be >= 1 and 0 < --mfu <= 1, got {tokens}, {seq_len}, {mfu}")
    r = plan_costs(model, mesh, comm_dtype, device_kind)
    t = model_times(r, device)
    per_token, train = training_step(model.active_params, model.attention, tokens, seq_len, mesh.world, mfu, device)
    muon_t, clip_t, adamw_t = max(t.muon()), max(t.muonclip()), max(t.adamw)
    per_flop = [a / f for a, f in zip(t.ns, r.ns_flops) if f]
    flop_seconds = statistics.fmean(per_flop) if per_flop else 1 / device.flops
    rep_t = [f * flop_seconds + e + (max(s, v) / (device.net_bw or 1) if t.comm_known else 0.0)
             for f, e, s, v in zip(r.rep_flops, t.elementwise, r.rep_sent, r.rep_recv)]
    ranks = {name: getattr(r, name) for name in (
        "ns_flops", "gather_sent", "gather_recv", "scatter_sent", "scatter_recv", "checks", "first_checks",
        "first_copies", "clip", "muon_state", "adamw_state", "muon_work", "adamw_work", "rep_flops", "rep_sent",
        "rep_recv", "rr_flops")}
    ranks.update(muon_seconds=t.muon(), muonclip_seconds=t.muonclip(), adamw_seconds=t.adamw, ns_seconds=t.ns,
                 comm_seconds=t.comm, elementwise_seconds=t.elementwise, rep_seconds=rep_t)
    stages = stage_of_layers(model.n_layers, mesh.pp)
    return {
        "model": {"name": model.name, "source": model.source, "parameters": model.total_params,
                  "active_parameters": model.active_params, "layers": model.n_layers,
                  "muon_matrices": sum(w.muon for w in model.weights),
                  "attention_layers": len(model.heads) if model.heads is not None else 0,
                  "clip_note": model.clip_note},
        "mesh": {"degrees": {k: getattr(mesh, k) for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")},
                 "zero1": mesh.zero1, "world": mesh.world, "stage_size": mesh.stage_size,
                 "description": mesh.describe(),
                 "stage_layers": [stages.count(s) for s in range(mesh.pp)]},
        "device": {"name": device.name, "peak_flops": device.flops, "mem_bw": device.mem_bw,
                   "link_bw": device.link_bw, "net_bw": device.net_bw, "domain": device.domain,
                   "measured": [list(m) for m in device.measured], "source": device.source},
        "wire": str(comm_dtype or torch.float32).removeprefix("torch."),
        "ranks": ranks,
        "summary": {k: _stats(v) for k, v in ranks.items()},
        "step": {"muon_seconds": muon_t, "muonclip_seconds": clip_t, "adamw_seconds": adamw_t,
                 "replicated_seconds": max(rep_t), "comm_modelled": t.comm_known,
                 "train_seconds": train, "flops_per_token": per_token, "tokens": tokens, "seq_len": seq_len,
                 "mfu": mfu,
                 "share": {k: v / (train + v) for k, v in (("muon", muon_t), ("muonclip", clip_t),
                                                            ("adamw", adamw_t))},
                 "muon_vs_adamw": (muon_t - adamw_t) / (train + adamw_t),
                 "ns_flops_vs_model": statistics.fmean(r.ns_flops) / (per_token * tokens / mesh.world)},
        "exact": ["ns_flops", "gather_sent", "gather_recv", "scatter_sent", "scatter_recv", "checks",
                  "first_checks", "first_copies", "clip", "muon_state", "adamw_state", "rep_flops", "rep_sent",
                  "rep_recv", "rr_flops"],
        "modelled": ["muon_work", "adamw_work", "*_seconds", "step"],
        "notes": r.notes,
    }


def run_plan(args: argparse.Namespace) -> int:
    """``muonclip plan``: print the plan (table or JSON), draw it with ``--plot``; 0 when done.

    Raises:
        ValueError: a model, mesh or option that cannot be planned (exit 2, `muonclip.app.main`).
    """
    from .report.plan_report import plot_plan, render_plan

    mesh = mesh_of(args)
    mesh.check()
    if args.plot is not None:
        from .dependencies import missing_dependencies

        if missing_dependencies(("matplotlib",)):
            raise ValueError('--plot needs matplotlib, which is not installed: pip install "muonclip[cli]"')
    model = load_model(args.model, args.sets)
    if mesh.pp > 1:
        stage_of_layers(model.n_layers, mesh.pp)
    if mesh.ep > 1 and not any(w.expert for w in model.weights):
        raise MeshError(f"--ep {mesh.ep}: {args.model} has no stacked routed experts to split")
    device = device_of(args, model)
    wire = torch.bfloat16 if args.comm_dtype == "bfloat16" else None
    plan = make_plan(model, mesh, device, tokens=args.tokens, seq_len=args.seq_len, mfu=args.mfu, comm_dtype=wire,
                     device_kind="cpu" if args.device == "cpu" else "cuda")
    print(json.dumps(plan, indent=1) if args.json else render_plan(plan))
    if args.plot is not None:
        path = plot_plan(plan, Path(args.plot))
        if not args.json:
            print(f"\nplot: {path}")
    return 0
