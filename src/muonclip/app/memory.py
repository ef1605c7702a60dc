"""Will one training step of a run fit in memory? An estimate of its peak, checked before any work.

`step_memory` estimates the peak memory of one ``muonclip train`` step of the reference GPT
from the config alone, by arithmetic: the parameters' shapes are counted from the config
(`muonclip.app.shapes`; ``tests/test_memory.py`` checks them against the model's own), never by
building a model, so that any size, however absurd (``n_layer`` =
1e23), is estimated at once and refused:

* parameters (float32) and their gradients; the optimizer state (AdamW's two moments; Muon's
  momentum on the hidden matrices, AdamW's moments on the rest, and four Newton–Schulz
  buffers of the largest matrix); the update RMS meter's copy of the hidden matrices;
* activations kept for the backward pass, per token and layer, counted tensor by tensor
  (`muonclip.app.shapes.activation_widths`): for MHA/GQA with PyTorch's fused attention, 15 ``n_embd`` + 2
  key/value widths + one float per head (RMSNorm inputs and outputs, q and k after RoPE, v,
  the attention output and its contiguous copy, the MLP's two ``4 n_embd`` tensors); MLA's
  own widths; a mixture of experts instead of the MLP: the router's scores and probabilities,
  per routed slot the gathered input, the expert's two hidden tensors and its weighted output,
  and the shared expert's two hidden tensors (counted, not measured against a real peak); plus
  the final norm, the logits, their log-softmax and both gradients, and one layer's gradients
  in flight during the backward pass;
* attention scores: MLA's query/key and value head widths differ, so PyTorch's CPU attention
  takes its unfused path, which materialises ``batch x heads x T x T`` float32 scores: the
  saved softmax of every layer and two gradients in flight; soft-capped attention
  (``attn_softcap``, computed eagerly) keeps two such tensors a layer, tanh's and the softmax's.
  The fused kernels (MHA/GQA) and the chunked max-logit recording keep them in blocks of a few MiB;
* allocator slack: activation tensors smaller than `MMAP_BYTES` count `ALLOCATOR_FACTOR`
  times (2: glibc keeps freed blocks in its heap; the peak RSS of a step measured 2.0–2.2
  times the live tensors with 4k–8k tokens when no block is returned to the system), larger
  ones once (glibc maps them and returns them when freed); plus `LIBRARY_BYTES` for what the
  process holds beyond its tensors and their heap: the code and workspaces of the kernels a
  first step touches, which depend on the machine's BLAS and attention kernels;
* the corpus (`corpus_memory`, from its files' sizes: `muonclip.app.data.corpus_size`): its
  tokens and the heap its reading leaves behind, and the largest document while it is decoded;
* the validation set, held for the whole run (`validation_memory`: ``eval_batches`` batches of
  ``batch_size x block_size`` inputs and targets, int64, and each batch's Python objects);
* for a comparison, its plan (`plan_memory`: ``seeds`` times the runs of one seed, each a config
  and its bookkeeping);
* a safety margin: `SAFETY_MARGIN` of everything counted above but the fixed overhead.

How the parts are checked. The tensors counted (parameters, gradients, optimizer state,
activations, scores) do not depend on the machine: ``tests/test_memory.py`` requires them to
cover the peak of the tensors torch allocates for two real steps, and at most twice it. The
peak RSS does depend on the machine (its BLAS and kernels, the heap): `benchmarks/bench_memory.py`
measures it for reading the corpus, two steps and a validation pass, and docs/benchmarks.md
records its figures per machine. The fixed part is sized to cover the largest RSS beyond the
rest of the estimate recorded there (a machine whose libraries hold a few hundred MiB more
than another's, whatever the config).
The margin covers what grows with the step: the peak RSS varies by 10–15% from run to run, and
the largest step's tensors come within 6% of their count.

Under torchrun each rank holds its share of the batch (and of the parameters and state with
FSDP2; DDP adds a gradient bucket copy). On CUDA the same count is made for the device (the
corpus stays on the host): the caching allocator's slack is smaller, and CUDA's
memory-efficient attention does not materialise MLA's scores, so there it is an over-estimate.

`check_memory` compares the estimate with the memory available (`available_memory`; CPU: the
smallest of ``MemAvailable`` and what every level of this process's own memory cgroups still
allows, v1 or v2, nested (`cgroup_limits`), shared by the ranks of the machine; CUDA: the
device's free memory; where none can be read, `MEMORY_CEILING`, more than any machine has) and
raises a ValueError (the CLI exits with 2, before anything is written) naming the setting to
lower and the largest value of it that fits.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import RunConfig, model_config
from .shapes import activation_widths, parameter_counts

ALLOCATOR_FACTOR = 2.0  # peak RSS over the live bytes of heap-allocated activations (measured 2.0-2.2)
MMAP_BYTES = 32 * 2**20  # glibc's largest mmap threshold: larger blocks go back to the system when freed
LIBRARY_BYTES = 384 * 2**20  # beyond the tensors: the kernels' code and workspaces (see the module docstring)
FLOAT = 4  # bytes of a float32
CORPUS_FACTOR = 3  # peak and kept RSS of the corpus per byte of its files (2.4-2.5 measured, many documents)
DOCUMENT_FACTOR = 8  # per byte of the largest file (4.9 measured for ASCII text, 8.0 with 4-byte characters)
SAFETY_MARGIN = 0.3  # added share of the counted tensors (all but the fixed overhead): see the module docstring
VAL_BATCH_BYTES = 2048  # a validation batch's tuple, tensor objects and heap blocks (1.2-1.8 KiB measured)
VAL_INDEX_BYTES = 16  # per validation window while the set is built: its start (float32, rounded, then int64)
RUN_PLAN_BYTES = 8192  # a planned run of a comparison: its spec and config (2.3 KiB measured), future and outcome
MEMORY_CEILING = 2**50
"""Bytes no single process has (1 PiB): the bound of a step's estimate where the memory available
cannot be read."""


@dataclass(frozen=True)
class StepMemory:
    """Bytes one training step is estimated to need at its peak, by part (see the module docstring)."""

    parameters: int  # weights, gradients, optimizer state and its buffers
    activations: int  # kept for the backward pass, plus the head's and one layer's gradients in flight
    attention_scores: int  # materialised T x T scores (MLA's unfused path, soft-capping); 0 for fused attention
    overhead: int  # allocator slack and the libraries' workspaces
    corpus: int = 0  # the corpus while it is read, and once in memory (`corpus_memory`)
    validation: int = 0  # the validation set, kept for the run (`validation_memory`)
    plan: int = 0  # a comparison's planned runs (`plan_memory`); 0 for one run
    margin: int = 0  # SAFETY_MARGIN of the counted parts (all but the fixed overhead)

    @property
    def total(self) -> int:
        return (self.parameters + self.activations + self.attention_scores + self.overhead + self.corpus
                + self.validation + self.plan + self.margin)


def corpus_memory(total_bytes: int, largest_bytes: int) -> int:
    """Bytes that reading a corpus takes at its peak and keeps (`muonclip.app.data.load_corpus`),
    from its files' sizes (`muonclip.app.data.corpus_size`): `CORPUS_FACTOR` per byte of all files
    (the tokens, kept, plus the heap the encoded documents leave behind) and `DOCUMENT_FACTOR` per
    byte of the largest file (read as bytes, decoded to a str of up to 4 bytes a character, cut in
    two, encoded back)."""
    return CORPUS_FACTOR * total_bytes + DOCUMENT_FACTOR * largest_bytes


def validation_memory(cfg: RunConfig, sets: int = 1) -> int:
    """Bytes of ``sets`` fixed validation sets of ``cfg`` (`muonclip.app.data.val_batches`), held
    for the whole run: per batch its inputs and targets (``batch_size x block_size`` int64 each) and
    `VAL_BATCH_BYTES`, plus `VAL_INDEX_BYTES` per window while the set is built. Every rank builds
    the whole set (on the CPU it keeps it: its share is a view)."""
    windows = cfg.eval_batches * cfg.batch_size
    return sets * (2 * 8 * windows * cfg.block_size + VAL_BATCH_BYTES * cfg.eval_batches + VAL_INDEX_BYTES * windows)


def plan_memory(cfg: RunConfig, runs_per_seed: int) -> int:
    """Bytes of a comparison's plan: ``seeds`` times ``runs_per_seed`` runs, `RUN_PLAN_BYTES` each."""
    return RUN_PLAN_BYTES * cfg.seeds * runs_per_seed


def step_memory(cfg: RunConfig, optimizer: str, *, world_size: int = 1, fsdp: bool = False,
                corpus: tuple[int, int] = (0, 0), val_sets: int = 1, runs_per_seed: int = 0) -> StepMemory:
    """Estimated peak bytes of one training step of ``cfg`` with ``optimizer`` on one rank.

    Args:
        cfg: the run's config.
        optimizer: "adamw", "muon" or "muonclip".
        world_size: ranks of a torchrun launch (default 1): each holds ``batch_size /
            world_size`` sequences.
        fsdp: parameters, gradients and state sharded over the ranks (default False: DDP,
            which keeps a whole copy on every rank plus its gradient buckets).
        corpus: the bytes of the corpus's files and of its largest file (default (0, 0): a corpus
            already in memory, or none), counted by `corpus_memory`.
        val_sets: validation sets held (default 1; `validation_memory`).
        runs_per_seed: the runs of one seed of a comparison, whose plan is counted (default 0: one
            run; `plan_memory`).
    """
    g = model_config(cfg)
    total, hidden, largest = parameter_counts(g)
    if optimizer == "adamw":
        state = 2 * total  # exp_avg, exp_avg_sq
    else:  # AdamW's moments off the hidden matrices, Muon's momentum and Newton-Schulz buffers on them
        state = 2 * (total - hidden) + hidden + 4 * largest
    copies = total + total + state + hidden  # weights, gradients, state, the update RMS meter's copy
    if world_size > 1:
        copies = copies / world_size if fsdp else copies + total  # FSDP2 shards; DDP's gradient buckets
    per_layer, scores_per_sequence = activation_widths(g)
    sequences = max(1, cfg.batch_size // world_size)
    tokens = sequences * cfg.block_size
    C, V = cfg.n_embd, 256
    # every layer's, the final norm's, the logits' (with log-softmax and both gradients), one
    # layer's gradients in flight during the backward pass, the int64 inputs and targets
    widths = [(w, cfg.n_layer) for w in per_layer] + [(C, 2), (V, 4), (4 * C, 2), (4, 1)]  # (floats, how many)
    activations = sum(FLOAT * tokens * w * n for w, n in widths)
    slack = sum((ALLOCATOR_FACTOR - 1) * FLOAT * tokens * w * n for w, n in widths if FLOAT * tokens * w < MMAP_BYTES)
    scores = FLOAT * (cfg.n_layer + 2) * sequences * scores_per_sequence  # a softmax a layer, two gradients
    parts = StepMemory(parameters=int(FLOAT * copies), activations=activations, attention_scores=scores,
                       overhead=int(slack) + LIBRARY_BYTES, corpus=corpus_memory(*corpus),
                       validation=validation_memory(cfg, val_sets), plan=plan_memory(cfg, runs_per_seed))
    return replace(parts, margin=int(SAFETY_MARGIN * (parts.total - parts.overhead)))


def _mounts(mountinfo: str) -> list[tuple[str, str, str, str]]:
    """``(fstype, mount root, mount point, super options)`` of every line of ``/proc/self/mountinfo``."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if sep and len(fields) >= 5 and len(tail) >= 3:
            out.append((tail[0], fields[3], fields[4], tail[2]))
    return out


def cgroup_limits(root: str | Path = "/") -> list[tuple[Path, int, int]]:
    """``(folder, limit, usage)`` of every memory cgroup level that limits this process, from its
    own cgroup up to the top of the mounted hierarchy: cgroup v2 (``memory.max``,
    ``memory.current``) and v1 (``memory.limit_in_bytes``, ``memory.usage_in_bytes``), found from
    ``/proc/self/cgroup`` and the mount table (``/proc/self/mountinfo``), so a process in a nested
    cgroup (a container, a systemd slice, a job scheduler's cgroup) sees its own limits, not the
    root's. Levels without a limit (``max``, or v1's huge default) are left out; empty where
    nothing can be read. ``root``: where ``/proc`` and ``/sys`` are (default ``/``; tests use a
    copy of the files)."""
    root = Path(root)
    try:
        cgroups = (root / "proc/self/cgroup").read_text()
        mounts = _mounts((root / "proc/self/mountinfo").read_text())
    except OSError:
        return []
    found = []
    for line in cgroups.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":  # v2
            files = ("memory.max", "memory.current")
            mine = [m for m in mounts if m[0] == "cgroup2"]
        elif "memory" in controllers.split(","):  # v1
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            mine = [m for m in mounts if m[0] == "cgroup" and "memory" in m[3].split(",")]
        else:
            continue
        for _, mount_root, point, _ in mine:
            rel = os.path.relpath(path, mount_root)
            if rel == ".." or rel.startswith("../"):  # this mount does not show the process's cgroup
                continue
            top = Path(os.path.normpath(root / point.lstrip("/")))
            found += _levels(Path(os.path.normpath(top / rel)), top, files)
            break
    return found


def _levels(folder: Path, top: Path, files: tuple[str, str]) -> list[tuple[Path, int, int]]:
    """The limited levels from ``folder`` up to ``top`` (included)."""
    out = []
    while True:
        try:
            cap = (folder / files[0]).read_text().strip()
            if cap != "max" and int(cap) < 2**60:
                out.append((folder, int(cap), int((folder / files[1]).read_text().strip())))
        except (OSError, ValueError):
            pass
        if folder == top or top not in folder.parents:
            return out
        folder = folder.parent


def available_memory(device: torch.device, ranks_here: int = 1, root: str | Path = "/") -> int | None:
    """Bytes a run may use on ``device``: for CUDA the device's free memory; for the CPU the
    smallest of Linux's ``MemAvailable`` and, at every level of this process's memory cgroups
    (`cgroup_limits`), the limit minus the usage, divided among the ``ranks_here`` processes of
    the machine. None where none can be read. ``root``: as in `cgroup_limits`."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    found = []
    try:
        for line in (Path(root) / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    found += [max(0, limit - usage) for _, limit, usage in cgroup_limits(root)]
    return min(found) // max(1, ranks_here) if found else None


def _gib(n: float) -> str:
    if n >= 2**50:
        return f"{n / 2**50:.3g} PiB"
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _largest_fitting(cfg: RunConfig, optimizer: str, name: str, available: int, world_size: int,
                     fsdp: bool, corpus: tuple[int, int], val_sets: int = 1, runs_per_seed: int = 0) -> int | None:
    """The largest value below the current one of setting ``name`` whose step fits, or None
    (``n_embd`` in multiples of ``2 n_head``: whole heads of even width, as RoPE needs; ``n_expert``
    at least ``n_expert_active``). A binary search of the arithmetic estimate: about 62 steps at most."""
    unit = 2 * cfg.n_head if name == "n_embd" else 1
    floor = cfg.n_expert_active if name == "n_expert" else 1
    lo, hi = floor - 1, getattr(cfg, name) // unit  # in units: lo fits (floor - 1: nothing yet), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            need = step_memory(replace(cfg, **{name: mid * unit}), optimizer, world_size=world_size, fsdp=fsdp,
                               corpus=corpus, val_sets=val_sets, runs_per_seed=runs_per_seed).total
        except ValueError:  # not a model (e.g. n_embd no longer a multiple of the heads)
            need = available + 1
        lo, hi = (mid, hi) if need <= available else (lo, mid)
    return lo * unit if lo >= floor else None


def check_memory(cfg: RunConfig, optimizer: str, device: torch.device, *, world_size: int = 1,
                 fsdp: bool = False, ranks_here: int = 1, sharing: str = "ranks",
                 corpus: tuple[int, int] = (0, 0), val_sets: int = 1, runs_per_seed: int = 0) -> StepMemory:
    """Raise a ValueError naming the setting to lower when one step of the run cannot fit in
    `available_memory` (nothing is checked where that cannot be read); return the estimate.

    The setting named is the one that dominates the estimate: ``block_size`` when the attention
    scores do (they grow with its square), ``batch_size`` when the activations do, ``n_embd``
    when the parameters and optimizer state do, ``eval_batches`` when the validation set does,
    ``seeds`` when a comparison's plan does, each with the largest value that would fit; where
    lowering neither of those would make it fit, the sizes that would (``n_layer``, ``n_embd``,
    ``batch_size``, ``block_size``, ``n_expert``, ``eval_batches``).
    ``ranks_here`` processes share the machine's memory; ``sharing`` names them in the message
    (default "ranks"; `muonclip compare` runs several runs at a time). ``corpus``: the sizes of
    the corpus's files and of the largest one, read into this process's memory (`step_memory`;
    not counted on a GPU). ``val_sets``, ``runs_per_seed``: as in `step_memory`.
    """
    if device.type == "cuda":
        corpus = (0, 0)
    sizes = dict(world_size=world_size, fsdp=fsdp, corpus=corpus, val_sets=val_sets, runs_per_seed=runs_per_seed)
    need = step_memory(cfg, optimizer, **sizes)
    available = available_memory(device, ranks_here)
    unknown = available is None
    if unknown:
        available = MEMORY_CEILING
    if need.total <= available:
        return need

    def fitting(name: str) -> int | None:
        return _largest_fitting(cfg, optimizer, name, available, **sizes)

    parts = {"attention_scores": need.attention_scores, "activations": need.activations,
             "parameters": need.parameters, "validation": need.validation, "plan": need.plan}
    order = {"attention_scores": ("block_size", "batch_size"), "activations": ("batch_size", "block_size"),
             "parameters": ("n_embd", "n_layer"), "validation": ("eval_batches", "batch_size"),
             "plan": ("seeds",)}[max(parts, key=parts.__getitem__)]
    fits = {name: fitting(name) for name in order}
    if not any(fits.values()):  # lowering neither helps: the setting out of all proportion is another
        others = [n for n in ("n_layer", "n_embd", "batch_size", "block_size", *(("n_expert",) if cfg.n_expert else ()),
                              "eval_batches") if n not in order]
        found = {n: fitting(n) for n in others}
        if any(found.values()):
            fits = {n: v for n, v in found.items() if v}
    hints = [f"{name} (now {getattr(cfg, name)}" + (f"; {v} would fit)" if v else ")") for name, v in fits.items()]
    where = "the GPU" if device.type == "cuda" else "this machine" + (f"'s share for each of {ranks_here} {sharing}"
                                                                     if ranks_here > 1 else "")
    if unknown:
        where = "no machine (the memory available here cannot be read, and no machine"
    named = {f"activations of {cfg.batch_size // max(1, world_size)} x {cfg.block_size} tokens": need.activations,
             "attention scores": need.attention_scores, "parameters and optimizer state": need.parameters,
             "allocator and libraries": need.overhead, "the corpus": need.corpus,
             f"validation set of {cfg.eval_batches} batches": need.validation,
             f"plan of {cfg.seeds * runs_per_seed} runs": need.plan, "safety margin": need.margin}
    detail = ", ".join(f"{label} {_gib(n)}" for label, n in named.items() if n)
    has = f"has {_gib(available)})" if unknown else f"has {_gib(available)} available"
    raise ValueError(f"one training step needs about {_gib(need.total)} ({detail}), but {where} {has}. "
                     f"Lower {' or '.join(hints)}")
