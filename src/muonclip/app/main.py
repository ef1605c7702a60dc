"""The ``muonclip`` command: ``compare``, ``train``, ``plan``, ``torchtitan-assets`` (also ``python -m muonclip.app``).

Exit codes: 0 done; 2 bad input (data, config, output folder, checkpoint; also: the app's
dependencies are not installed, `muonclip.app.dependencies`; a checkpoint could not be written, e.g. a
full disk) — nothing written, or the last checkpoint kept; 3 non-finite loss — training
stopped, last good checkpoint kept; 4 under torchrun, another rank stopped answering for
``--timeout`` seconds or died — the last checkpoint kept; 130 Ctrl-C — checkpoint of the last
finished step written (a second Ctrl-C, at any moment: at once, the last checkpoint whole; `main`).

``train --resume`` on an absent or empty ``--out`` starts a new run and says so (a job script may
always pass it); anything else there must be a run to continue (`muonclip.app.runfolder`).

``muonclip train`` also runs under ``torchrun --nproc_per_node=N`` (DDP; ``--fsdp`` for FSDP2;
see `muonclip.app.launch`): rank 0 prints, every rank returns the same exit code (torchrun's own
exit code is 1 whenever a worker's is not 0: torchrun reports a failed worker, whatever its
code).

This module imports none of the app's own dependencies, so that without them the command can
still say what to install.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..distributed.checkpoint import CheckpointError
from .checkpoints import read_checkpoint, read_run_config
from .config import OPTIMIZERS, PRESETS, RunConfig, apply_overrides, make_config
from .data import DataError
from .dependencies import APP_DEPENDENCIES, ASSET_DEPENDENCIES, ASSET_HINT, EXTRA_HINT, missing_dependencies
from .launch import (
    DEFAULT_TIMEOUT,
    LAUNCH_HINT,
    device,
    is_active,
    is_collective_failure,
    launched_by_torchrun,
    mode,
    session,
)
from .model import orthogonalisation
from .resume import check_restart
from .runfolder import check_run_folder, inspect_folder
from .safe_files import OutputError
from .train import ABORTED, CtrlC, Interrupted, NonFiniteLossError

EXIT_INPUT, EXIT_NONFINITE, EXIT_PEER, EXIT_INTERRUPTED = 2, 3, 4, 130


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default=None,
                   help="starting configuration (default: default); see muonclip.app.config")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config field, e.g. --set n_layer=2 --set lr_muon=0.02 (repeatable)")
    p.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--data", help="a text file or a folder of .txt/.md files (default: built-in Shakespeare plays)")
    p.add_argument("--seed", type=int, help="model init and batch order seed")
    p.add_argument("--tau", type=float, help="QK-Clip threshold on the max logit")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: all cores)")
    p.add_argument("--out", help="output folder of the run")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="muonclip",
        description="Train a small GPT on real text with AdamW, Muon or MuonClip (Muon + QK-Clip).",
        epilog="Exit codes: 0 done, 2 bad input, 3 non-finite loss, 4 another rank stopped answering (torchrun), "
               "130 interrupted (checkpoint saved).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="AdamW vs Muon vs MuonClip on the same model and data; writes a report",
                       description="Train the same GPT with the same data order and seed with each optimizer "
                                   "and write plots and summary.md to --out (default out/compare-<preset>-<time>).")
    _common(c)
    c.add_argument("--optimizers", default="adamw,muon",
                   help="comma-separated optimizers of the token-efficiency runs, each at its own rate (default: "
                        "adamw,muon; also muonclip, normuon, muon_cautious, muon_8bit; AdamW is the reference of the "
                        "ratios; the stability segment always runs muon and muonclip)")
    c.add_argument("--jobs", type=int, default=None,
                   help="runs at a time, in worker processes (default: one per core)")
    c.add_argument("--sweep", action="store_true",
                   help="first tune every optimizer's learning rate on a log grid (5 points, sqrt 2 apart, extended "
                        "while the best is at an edge), then compare with the tuned values; see muonclip.app.sweep")
    c.add_argument("--sweep-warmups", default=None, metavar="STEPS",
                   help="with --sweep: comma-separated warm-up lengths to tune too (default: the config's)")
    c.add_argument("--sweep-seeds", type=int, default=2, metavar="N", help="with --sweep: seeds per point (default 2)")
    t = sub.add_parser("train", help="train with one optimizer, with checkpoints and --resume",
                       description="Train the GPT with one optimizer. Writes config.json, metrics.jsonl/.csv and "
                                   "checkpoints (checkpoint.json names the current one) to --out (default "
                                   "out/train-<optimizer>-<time>).")
    _common(t)
    t.add_argument("--optimizer", choices=OPTIMIZERS, default=None, help="default: muonclip (on resume: the run's)")
    t.add_argument("--lr", type=float, help="peak learning rate of the chosen optimizer")
    t.add_argument("--tensorboard", metavar="DIR", default=None,
                   help="also write the metrics as TensorBoard scalars to DIR (pip install 'muonclip[tensorboard]'); "
                        "not inside another run's folder")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its checkpoint (its config, with any overrides given); "
                        "a new or empty --out starts a new run, and says so")
    t.add_argument("--fsdp", action="store_true",
                   help="under torchrun: shard the model with FSDP2 (fully_shard) instead of DDP; "
                        "e.g. torchrun --nproc_per_node=2 -m muonclip.app train --fsdp")
    t.add_argument("--tp", type=int, default=1, metavar="N",
                   help="under torchrun with --fsdp: tensor parallel over groups of N ranks (heads split), FSDP2 "
                        "over the rest (a 2-D mesh); e.g. torchrun --nproc_per_node=4 $(which muonclip) train "
                        "--fsdp --tp 2")
    t.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"under torchrun: how long a rank waits for the others in a collective (and at the start) "
                        f"before the run stops with exit code 4 (default {DEFAULT_TIMEOUT:g})")
    pl = sub.add_parser("plan", help="what one optimizer step costs per rank on a model and a mesh, before any run",
                        description="Plan one optimizer step of a model (built on the meta device, no weights) on a "
                                    "mesh, with the distributed step's own planner: per rank (min / median / max), "
                                    "Newton-Schulz flops, bytes gathered and scattered, the clip's reduction, "
                                    "optimizer state (exact), working set and time (modelled: a roofline), for "
                                    "Muon, MuonClip and AdamW side by side. See docs/compare.md, muonclip plan.")
    from .plan import add_arguments

    add_arguments(pl)
    a = sub.add_parser("torchtitan-assets", help="a tokenizer and a dataset for torchtitan, from the built-in plays",
                       description="Write a byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json) and the "
                                   "plays as JSON lines (train/plays.jsonl, val/plays.jsonl) to DIR, the assets of "
                                   "the torchtitan quick start (docs/integrations.md); prints its commands.")
    a.add_argument("dir", nargs="?", default="torchtitan_assets",
                   help="folder to create (default: torchtitan_assets, where --config llama3_quickstart reads)")
    a.add_argument("--vocab-size", type=int, default=2048,
                   help="tokens of the tokenizer (default 2048: llama3's debug model's vocabulary)")
    a.add_argument("--plays", type=int, default=None, metavar="N",
                   help="the first N plays only, for a quicker build (default: all 38)")
    a.add_argument("--nproc", type=int, default=2, help="processes of the printed torchrun commands (default 2)")
    return parser


def _run_torchtitan_assets(args: argparse.Namespace) -> int:
    from .torchtitan_assets import commands, make_assets

    start = time.perf_counter()
    made = make_assets(args.dir, vocab_size=args.vocab_size, plays=args.plays)
    took = time.perf_counter() - start
    print(f"{made.path}: tokenizer of {made.vocab_size} tokens; {made.train_documents} training passages "
          f"({made.train_tokens:,} tokens), {made.val_documents} validation passages ({took:.0f}s)")
    default = args.dir == "torchtitan_assets"
    for name, cmd in commands(made.path, args.nproc, paths=not default).items():
        print(f"\n{name}:\n  {cmd}")
    return 0


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {"steps": args.steps, "data": args.data, "seed": args.seed, "tau": args.tau, "threads": args.threads}


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _run_train(args: argparse.Namespace) -> int:
    from .train import train_run

    if args.fsdp and not launched_by_torchrun():
        raise ValueError(f"--fsdp shards the model over several processes; {LAUNCH_HINT}")
    if launched_by_torchrun() and args.out is None:
        raise OutputError("under torchrun, give --out: every rank must write to the same run folder")
    resume = args.resume
    if resume:
        if args.out is None:
            raise OutputError("--resume needs --out, the folder of the run to continue")
        if args.preset is not None:
            raise ValueError("--preset cannot be used with --resume: the run's config comes from its checkpoint")
        if inspect_folder(Path(args.out)).kind in ("absent", "empty"):  # a job script that always resumes
            resume = False
            if not _quiet_rank():
                print(f"muonclip: nothing to resume in {args.out}, starting a new run", file=sys.stderr)
    if resume:
        state = check_run_folder(Path(args.out))
        record = read_run_config(Path(args.out))  # every file checked before anything is read for training
        if state.has_checkpoint:
            found = read_checkpoint(Path(args.out))
            optimizer = args.optimizer or found.optimizer
            try:
                base = RunConfig.from_dict(found.config)
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"{found.path} holds an unreadable config ({e})") from None
        else:  # a run that stopped before its first checkpoint restarts with its own config
            check_restart(Path(args.out), record.config)
            optimizer, base = args.optimizer or record.optimizer, record.config
        over = _overrides(args)
        if args.lr is not None:
            over[f"lr_{optimizer}"] = args.lr
        cfg = apply_overrides(base, over, args.sets)
        out = Path(args.out)
    else:
        optimizer = args.optimizer or "muonclip"
        over = _overrides(args)
        if args.lr is not None:
            over[f"lr_{optimizer}"] = args.lr
        cfg = make_config(args.preset or "default", over, args.sets)
        out = Path(args.out) if args.out else Path("out") / f"train-{optimizer}-{_stamp()}"
    with session(args.fsdp, args.tp, args.timeout) as ctx:
        result = train_run(cfg, optimizer, out, resume=resume, progress=not args.quiet,
                           tensorboard=args.tensorboard, fsdp=args.fsdp, tp=args.tp)
        if ctx.rank == 0:
            ranks = f" on {ctx.world_size} processes ({mode(ctx, args.fsdp, args.tp)})" if is_active(ctx, args.fsdp) \
                else ""
            orth = "" if optimizer == "adamw" else f"; orthogonalisation in {orthogonalisation(cfg, device(ctx))}"
            print(f"{optimizer}: {result.steps} steps{ranks}, final validation loss {result.final_val_loss:.4f}, "
                  f"{result.wall_time:.0f}s{orth}; run folder {out}")
    return 0


def _own_protocol(cfg: RunConfig, out: Path, *, jobs: int | None, progress: bool) -> tuple[dict[str, Any], str]:
    """Run the protocol of a preset that has its own (`muonclip.app.compare_runs.OWN_PROTOCOL`)."""
    if cfg.preset == "finetune":
        from .finetune import compare_finetune

        return compare_finetune(cfg, out, progress=progress)
    if cfg.preset == "ladder":
        from .ladder import compare_ladder

        return compare_ladder(cfg, out, jobs=jobs, progress=progress)
    from .guards import compare_guards

    return compare_guards(cfg, out, jobs=jobs, progress=progress)


def _run_compare(args: argparse.Namespace) -> int:
    from .compare import compare
    from .compare_runs import EFFICIENCY, OWN_PROTOCOL

    if launched_by_torchrun() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("muonclip compare runs in one process; under torchrun use `muonclip train` "
                         "(one optimizer per launch, --optimizer adamw|muon|muonclip)")

    cfg = make_config(args.preset or "default", _overrides(args), args.sets)
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    sweep = None
    if args.sweep:
        try:
            warmups = None if args.sweep_warmups is None else [int(w) for w in args.sweep_warmups.split(",")]
        except ValueError:
            raise ValueError(f"--sweep-warmups expects comma-separated steps like 20,50,100, got "
                             f"{args.sweep_warmups!r}") from None
        if (warmups is not None and any(w < 0 for w in warmups)) or args.sweep_seeds < 1:
            raise ValueError("--sweep-warmups must be >= 0 and --sweep-seeds >= 1")
        sweep = {"warmups": warmups, "seeds": args.sweep_seeds,
                 "optimizers": [o for o in OPTIMIZERS if o != "muonclip" and (o in optimizers or o == "muon")]}
    elif args.sweep_warmups is not None:
        raise ValueError("--sweep-warmups needs --sweep")
    out = Path(args.out) if args.out else Path("out") / f"compare-{cfg.preset}-{_stamp()}"
    if cfg.preset in OWN_PROTOCOL:
        if sweep is not None or optimizers != list(EFFICIENCY):
            raise ValueError(f"--preset {cfg.preset} runs its own protocol ({OWN_PROTOCOL[cfg.preset]}): "
                             "--optimizers and --sweep do not apply to it")
        _, printed = _own_protocol(cfg, out, jobs=args.jobs, progress=not args.quiet)
    else:
        _, printed = compare(cfg, out, optimizers=optimizers, jobs=args.jobs, sweep=sweep, progress=not args.quiet)
    print(printed)
    print(f"\nreport: {out}/summary.md" + ("" if cfg.preset == "finetune" else f" and the plots in {out}"))
    return 0


def _quiet_rank() -> bool:
    """True on ranks other than 0 of a torchrun launch (they keep input-error messages to themselves)."""
    return launched_by_torchrun() and os.environ.get("RANK", "0") != "0"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``muonclip`` console script; returns the exit code.

    Called without ``argv`` (the console script, ``python -m muonclip.app``: the command is the
    process), Ctrl-C is the command's (`muonclip.app.train.CtrlC`): the first one stops it with
    130 (a run saves a checkpoint of its last step first), any later one ends the process at once
    with 130 (`muonclip.app.train.abort`), never with a traceback; once the command has its exit
    code, Ctrl-C is ignored while the process exits (Python itself would die of a SIGINT in its
    last moments, with -2). Called with ``argv`` (from Python), the caller's handler stays: a
    Ctrl-C stops the command with 130 all the same, a second one raises KeyboardInterrupt.
    """
    if argv is not None or threading.current_thread() is not threading.main_thread():
        return _main(argv)
    signal.signal(signal.SIGINT, CtrlC())
    try:
        return _main(argv)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    assets = args.command == "torchtitan-assets"
    # plan needs none of the app's extras (matplotlib only for --plot, checked there)
    missing = [] if args.command == "plan" else missing_dependencies(ASSET_DEPENDENCIES if assets else APP_DEPENDENCIES)
    if missing:
        if not _quiet_rank():
            what, hint = (("the corpus and torchtitan's tokenizer library", ASSET_HINT) if assets else
                          ("the app's dependencies", EXTRA_HINT))
            print(f"muonclip: error: `muonclip {args.command}` needs {what}, which are not installed here "
                  f"({', '.join(missing)}); install them with: {hint}", file=sys.stderr)
        return EXIT_INPUT
    try:
        if assets:
            return _run_torchtitan_assets(args)
        if args.command == "plan":
            from .plan import run_plan

            return run_plan(args)
        return _run_train(args) if args.command == "train" else _run_compare(args)
    except (DataError, OutputError, CheckpointError, ValueError) as e:
        if not _quiet_rank():
            print(f"muonclip: error: {e}", file=sys.stderr)
        return EXIT_INPUT
    except RuntimeError as e:  # under torchrun: a collective timed out (--timeout) or a peer died
        if not is_collective_failure(e):
            raise
        print(f"\nmuonclip: error: rank {os.environ.get('RANK', '0')}: another rank stopped answering or died "
              f"(a collective operation failed: {str(e).splitlines()[0][:300]}); the run stopped, its last checkpoint "
              "is intact. Continue with --resume once every rank can run", file=sys.stderr)
        return EXIT_PEER
    except OSError as e:  # a write the run could not do (its folder, a full disk)
        if not _quiet_rank():
            where = f"{e.filename}: " if e.filename else ""
            print(f"muonclip: error: {where}{e.strerror or e}; the last checkpoint (if any) is intact", file=sys.stderr)
        return EXIT_INPUT
    except NonFiniteLossError as e:
        if not _quiet_rank():
            print(f"\nmuonclip: error: {e}", file=sys.stderr)
        return EXIT_NONFINITE
    except Interrupted as e:
        if not _quiet_rank():
            print(f"\nmuonclip: {e}; continue with: muonclip train --out {e.checkpoint.parent} --resume",
                  file=sys.stderr)
        return EXIT_INTERRUPTED
    except KeyboardInterrupt:
        print(f"\n{ABORTED}", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
