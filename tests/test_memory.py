"""The peak-memory estimate of a training step (`muonclip.app.memory`) and the refusal of runs
that cannot fit: against measured peaks, against torch's own choice of attention kernel, and
through the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from muonclip.app import memory, shapes
from muonclip.app.config import make_config, model_config
from muonclip.app.main import main
from muonclip.app.model import build_model


def peak_tensor_bytes(work):
    """The peak of the bytes of live tensors that torch allocates while ``work()`` runs, from the
    profiler's allocation and free events summed in time order (tensors allocated before are not
    counted, nor what they free)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        work()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = top = 0
    for _, nbytes in events:
        live += nbytes
        top = max(top, live)
    return top


def test_peak_tensor_bytes_follows_allocations_and_frees():
    """The measure itself: two 1 MiB tensors alive together, then a third while one of them is
    freed, and a tensor made before the measure and freed inside it, which does not count."""
    old = torch.empty(2**18)

    def work():
        nonlocal old
        a, b = torch.empty(2**18), torch.empty(2**18)
        del a
        c = torch.empty(2**18)
        old = None
        del b, c

    assert peak_tensor_bytes(work) == 2 * 2**20


@pytest.fixture(scope="module")
def corpus():
    from muonclip.app.data import load_corpus

    return load_corpus(None)


@pytest.mark.parametrize(("optimizer", "sets"), [
    ("muonclip", "block_size=512,batch_size=16,n_layer=2"),  # fused attention: activations dominate
    ("adamw", "block_size=512,batch_size=8,n_layer=2,attention=mla"),  # MLA: T x T scores too
    ("muonclip", "block_size=1024,batch_size=4,n_layer=2,n_embd=128"),  # long sequences
    ("muon", "block_size=256,batch_size=16,attention=mla,n_head=4,n_expert=8,expert_hidden=64"),  # experts
    ("muon", "block_size=512,batch_size=8,n_layer=2,attn_softcap=30"),  # soft-capping: eager T x T scores
    ("muon", "block_size=256,batch_size=8,attention=mla,qk_norm=true,attn_softcap=30"),  # MLA's q^C/k^C norms too
])
def test_estimate_counts_the_tensors_a_step_allocates(optimizer, sets, corpus):
    """The tensors the estimate counts (parameters, gradients, optimizer state, activations,
    attention scores, the validation set) cover the peak of the tensors torch allocates for building
    the model, the optimizer and the validation set, two real steps and a validation pass (one
    thread), and are at most twice it
    (1.06-1.42 times it over the six configs of `benchmarks/bench_memory.py`). What the process
    holds beyond its tensors (the kernels' code and workspaces, the heap's slack) depends on the
    machine; that script measures it, for the estimate's fixed part and margin (docs/benchmarks.md)."""
    from muonclip.app.data import train_batch, val_batches
    from muonclip.app.model import build_optimizer
    from muonclip.app.train import evaluate, forward_loss

    cfg = make_config("default", sets=sets.split(","))

    def work():
        model = build_model(cfg)
        opt = build_optimizer(optimizer, model, cfg)
        val = val_batches(corpus, n_batches=cfg.eval_batches, batch_size=cfg.batch_size, block_size=cfg.block_size)
        for step in range(2):
            x, y = train_batch(corpus, step, batch_size=cfg.batch_size, block_size=cfg.block_size, seed=0)
            opt.zero_grad(set_to_none=True)
            forward_loss(model, x, y).backward()
            opt.step()
        evaluate(model, val)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the attention kernels keep a buffer per thread
    try:
        peak = peak_tensor_bytes(work)
    finally:
        torch.set_num_threads(threads)
    est = memory.step_memory(cfg, optimizer)
    counted = est.parameters + est.activations + est.attention_scores + est.validation
    assert peak <= counted <= 2 * peak, (counted / 2**20, peak / 2**20)


LOAD = """
import json, sys
import torch
from muonclip.app.data import load_corpus

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))


def rss():  # the resident set now, with the high-water mark reset to it (so only what follows counts)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")

torch.zeros(2, 2) @ torch.zeros(2, 2)
before = rss()
corpus = load_corpus(sys.argv[1])
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the RSS from Linux's /proc")
def test_corpus_estimate_covers_reading_one_large_file_of_wide_characters(tmp_path):
    """The worst case for reading: one 12 MB file whose one 4-byte character makes Python hold the
    whole text at 4 bytes a character (peak measured 8.0x the file; corpus_memory counts 11x)."""
    from muonclip.app.data import corpus_size

    path = tmp_path / "wide.txt"
    path.write_text("the quick brown fox jumps over the lazy dog\n" * 270_000 + "\U0001F600\n", encoding="utf-8")
    run = subprocess.run([sys.executable, "-c", LOAD, str(path)], capture_output=True, text=True, timeout=300,
                         check=True)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    measured = got["peak"] - got["before"]
    assert measured <= memory.corpus_memory(*corpus_size(path)) <= 3 * measured


@pytest.mark.parametrize("sets", [[], ["n_kv_head=2"], ["qk_norm=true"], ["attention=mla"]])
def test_attention_kernel_is_the_one_torch_picks(sets):
    """The estimate counts no T x T scores where torch's CPU attention is fused (MHA, GQA,
    QK-norm) and counts them for MLA, whose query/key and value head widths differ: torch's
    own kernel choice for the model's shapes (training, causal, no dropout) says the same."""
    cfg = make_config("tiny", sets=sets)
    model = build_model(cfg)
    seen = []

    def spy(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *, recorder=None,
            training=True):
        seen.append(torch._fused_sdp_choice(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                            enable_gqa=enable_gqa))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                                                 enable_gqa=enable_gqa)

    import muonclip.models._gpt as gpt_module

    real, gpt_module.scaled_dot_product_attention = gpt_module.scaled_dot_product_attention, spy
    try:
        x = torch.randint(0, 256, (2, cfg.block_size))
        model(x, x)[1].backward()
    finally:
        gpt_module.scaled_dot_product_attention = real
    math_path = int(torch.nn.attention.SDPBackend.MATH.value)
    assert seen and all((choice == math_path) == (cfg.attention == "mla") for choice in seen)
    assert (shapes.activation_widths(model_config(cfg))[1] > 0) == (cfg.attention == "mla")


def test_estimate_grows_as_the_step_does():
    """Activations linear in batch_size x block_size; MLA's scores (n_layer + 2) x batch x heads
    x T^2 floats; parameters counted on the meta model equal the real model's; FSDP2 divides
    them over the ranks, DDP adds a gradient copy; each rank holds its share of the batch."""
    cfg = make_config("tiny")
    base = memory.step_memory(cfg, "muon")
    assert memory.step_memory(replace(cfg, batch_size=16), "muon").activations == 2 * base.activations
    assert memory.step_memory(replace(cfg, block_size=64), "muon").activations == 2 * base.activations
    assert base.attention_scores == 0
    mla = replace(cfg, attention="mla")
    scores = memory.step_memory(mla, "muon").attention_scores
    assert scores == 4 * (cfg.n_layer + 2) * cfg.batch_size * cfg.n_head * cfg.block_size**2
    assert memory.step_memory(replace(mla, block_size=64), "muon").attention_scores == 4 * scores
    total, hidden, largest = shapes.parameter_counts(model_config(cfg))
    real = build_model(cfg)
    assert total == sum(p.numel() for p in real.parameters()) and 0 < largest <= hidden < total
    adamw = memory.step_memory(cfg, "adamw").parameters
    assert adamw == 4 * (4 * total + hidden)  # weights, grads, two moments, the RMS meter's copy
    fsdp = memory.step_memory(cfg, "adamw", world_size=2, fsdp=True)
    ddp = memory.step_memory(cfg, "adamw", world_size=2)
    assert fsdp.parameters == adamw // 2 and ddp.parameters == adamw + 4 * total
    assert fsdp.activations == ddp.activations < memory.step_memory(cfg, "adamw").activations


@pytest.mark.parametrize(("sets", "first", "second"), [
    (["block_size=8192", "attention=mla"], "block_size", "batch_size"),  # T^2 scores dominate
    (["block_size=100000"], "batch_size", "block_size"),  # activations dominate
    (["n_embd=16384", "n_head=64", "batch_size=1", "block_size=8"], "n_embd", "n_layer"),  # parameters
])
def test_check_memory_names_the_setting_to_lower(monkeypatch, sets, first, second):
    """Too little memory: a ValueError naming the dominant setting first, with the largest
    value that fits (it fits; one more unit does not); enough memory: the estimate back."""
    cfg = make_config("default", sets=sets)
    available = 8 * 2**30
    monkeypatch.setattr(memory, "available_memory", lambda device, ranks_here=1: available)
    with pytest.raises(ValueError, match=rf"8.0 GiB available\. Lower {first} \(now") as e:
        memory.check_memory(cfg, "muonclip", torch.device("cpu"))
    message = str(e.value)
    assert message.index(first) < message.index(f"or {second}")
    fits = int(message.split(f"{first} (now {getattr(cfg, first)}; ")[1].split(" ")[0])
    unit = 2 * cfg.n_head if first == "n_embd" else 1
    assert memory.step_memory(replace(cfg, **{first: fits}), "muonclip").total <= available
    assert memory.step_memory(replace(cfg, **{first: fits + unit}), "muonclip").total > available
    monkeypatch.setattr(memory, "available_memory", lambda device, ranks_here=1: 2**50)
    assert memory.check_memory(cfg, "muonclip", torch.device("cpu")).total < 2**50


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="Linux's /proc/meminfo")
def test_available_memory_is_read_from_the_system(tmp_path):
    meminfo = Path("/proc/meminfo").read_text()
    total = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemTotal:"))
    available = next(int(line.split()[1]) * 1024 for line in meminfo.splitlines()
                     if line.startswith("MemAvailable:"))
    found = memory.available_memory(torch.device("cpu"))
    assert 0 < found <= total
    # the division among ranks, on a copy of the file (the live value moves between two reads)
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text(meminfo)
    assert memory.available_memory(torch.device("cpu"), root=tmp_path) == available
    assert memory.available_memory(torch.device("cpu"), ranks_here=4, root=tmp_path) == available // 4


@pytest.mark.parametrize("command", ["train", "compare"])
def test_impossible_block_size_exits_2_at_once(tmp_path, capsys, monkeypatch, command):
    """``muonclip train --set block_size=100000 --steps 2`` (23 GiB of activations): exit 2 before
    any work (the corpus is not read), naming batch_size and block_size, nothing written (the
    machine's memory is fixed at 16 GiB here, so the outcome does not depend on the machine the
    test runs on)."""
    import muonclip.app.compare_runs
    import muonclip.app.train_setup

    monkeypatch.setattr(memory, "available_memory", lambda device, ranks_here=1: 16 * 2**30)
    for module in (muonclip.app.train_setup, muonclip.app.compare_runs):
        monkeypatch.setattr(module, "load_corpus", lambda *a, **k: pytest.fail("the corpus was read"))
    out = tmp_path / "out"
    rc = main([command, "--set", "block_size=100000", "--steps", "2", "--quiet", "--out", str(out)])
    assert rc == 2
    err = capsys.readouterr().err
    assert "muonclip: error: one training step needs about 30.8 GiB (activations of 16 x 100000 tokens 22.9 GiB" in err
    assert "validation set of 16 batches 391 MiB" in err
    assert "16.0 GiB available. Lower batch_size (now 16; " in err and "or block_size (now 100000; " in err
    assert not out.exists()


def _fake_system(root, cgroup, mountinfo, files, meminfo_kib=64 * 2**20):
    """A copy of the files available_memory reads, under ``root``: /proc/self/cgroup, /proc/self/mountinfo,
    /proc/meminfo (64 GiB available) and cgroup files (path relative to root -> content)."""
    (root / "proc/self").mkdir(parents=True)
    (root / "proc/self/cgroup").write_text(cgroup)
    (root / "proc/self/mountinfo").write_text(mountinfo)
    (root / "proc/meminfo").write_text(f"MemTotal: {2 * meminfo_kib} kB\nMemAvailable: {meminfo_kib} kB\n")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


GIB = 2**30


def test_cgroup_v2_limits_of_this_process_nested(tmp_path):
    """cgroup v2, the process in /jobs/a/run: the tightest level wins (the parent's 3 GiB with 2 GiB
    used leaves 1 GiB, below the process's own 2.2 GiB limit); the root's file is not what counts (on
    the old code only /sys/fs/cgroup/memory.max was read: 64 GiB here)."""
    _fake_system(tmp_path, "0::/jobs/a/run\n", "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n", {
        "sys/fs/cgroup/memory.max": "max\n", "sys/fs/cgroup/memory.current": str(5 * GIB),
        "sys/fs/cgroup/jobs/memory.max": "max\n", "sys/fs/cgroup/jobs/memory.current": str(2 * GIB),
        "sys/fs/cgroup/jobs/a/memory.max": str(3 * GIB), "sys/fs/cgroup/jobs/a/memory.current": str(2 * GIB),
        "sys/fs/cgroup/jobs/a/run/memory.max": str(int(2.2 * GIB)),
        "sys/fs/cgroup/jobs/a/run/memory.current": str(GIB // 2),
    })
    limits = memory.cgroup_limits(tmp_path)
    assert [(p.name, lim) for p, lim, _ in limits] == [("run", int(2.2 * GIB)), ("a", 3 * GIB)]
    assert memory.available_memory(torch.device("cpu"), root=tmp_path) == GIB
    assert memory.available_memory(torch.device("cpu"), ranks_here=2, root=tmp_path) == GIB // 2


def test_cgroup_v1_limits_with_a_hybrid_mount_table(tmp_path):
    """cgroup v1 (the memory controller mounted alone, with a cgroup2 mount beside it, as on this
    project's test machine): the process's own 2.2 GiB limit counts."""
    mountinfo = ("31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n"
                 "32 31 0:29 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n"
                 "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
                 "41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n")
    _fake_system(tmp_path, "4:memory:/batch/job7\n1:cpu:/\n0::/\n", mountinfo, {
        "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712",
        "sys/fs/cgroup/memory/memory.usage_in_bytes": str(7 * GIB),
        "sys/fs/cgroup/memory/batch/job7/memory.limit_in_bytes": str(int(2.2 * GIB)),
        "sys/fs/cgroup/memory/batch/job7/memory.usage_in_bytes": str(GIB // 5),
    })
    assert memory.available_memory(torch.device("cpu"), root=tmp_path) == int(2.2 * GIB) - GIB // 5


def test_cgroup_of_a_container_without_its_own_namespace(tmp_path):
    """A container whose cgroup is mounted as the root of the mount (mountinfo's root field is the
    cgroup's path): the mount point itself is the process's cgroup."""
    _fake_system(tmp_path, "0::/docker/abc\n", "30 23 0:26 /docker/abc /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n", {
        "sys/fs/cgroup/memory.max": str(GIB), "sys/fs/cgroup/memory.current": str(GIB // 4)})
    assert memory.available_memory(torch.device("cpu"), root=tmp_path) == GIB - GIB // 4
    _fake_system(tmp_path / "none", "0::/\n", "", {})
    assert memory.available_memory(torch.device("cpu"), root=tmp_path / "none") == 64 * GIB  # MemAvailable


def test_a_step_that_fits_only_without_the_cgroup_is_refused(tmp_path, monkeypatch, capsys):
    """The issue's case, through the CLI: a run whose estimate exceeds its cgroup's 2.2 GiB (while the
    machine has 64 GiB) exits 2 before any work, saying so."""
    _fake_system(tmp_path / "sys", "0::/job\n", "30 23 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n", {
        "sys/fs/cgroup/job/memory.max": str(int(2.2 * GIB)), "sys/fs/cgroup/job/memory.current": "0"})
    real = memory.available_memory
    monkeypatch.setattr(memory, "available_memory", lambda device, ranks_here=1: real(device, ranks_here,
                                                                                       root=tmp_path / "sys"))
    out = tmp_path / "out"
    rc = main(["train", "--set", "block_size=8192", "--set", "batch_size=16", "--steps", "2", "--quiet",
               "--out", str(out)])
    assert rc == 2 and "but this machine has 2.2 GiB available" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize(("preset", "sets"), [
    ("tiny", []), ("default", []), ("k2-mini", []), ("tiny", ["n_kv_head=1"]), ("tiny", ["qk_norm=true"]),
    ("k2-mini", ["n_shared_expert=0"]), ("k2-mini", ["expert_hidden=0", "n_expert_active=3"]),
    ("tiny", ["attention=mla", "n_head=4"]), ("tiny", ["n_layer=3", "n_embd=48", "n_head=3"]),
])
def test_parameters_are_counted_from_the_config_exactly(preset, sets):
    """The estimate's parameter shapes, counted by arithmetic, are the model's own: every name and
    shape of its named_parameters (on the meta device), and which of them muonclip.param_groups
    gives to Muon; the largest dimension of those is what the learning-rate check scales by."""
    from muonclip.optim import param_groups

    cfg = make_config(preset, sets=sets)
    with torch.device("meta"):
        model = build_model(cfg)
    ours = {f"blocks.{i}.{n}": (s, h) for i in range(cfg.n_layer) for n, s, h in shapes.block_parameters(model_config(cfg))}
    ours.update({n: (s, h) for n, s, h in shapes.outer_parameters(model_config(cfg))})
    assert {n: s for n, (s, _) in ours.items()} == {n: tuple(p.shape) for n, p in model.named_parameters()}
    hidden = {n for g in param_groups(model) if g["algorithm"] == "muon" for n in g["param_names"]}
    assert {n for n, (_, h) in ours.items() if h} == hidden
    assert shapes.hidden_extent(model_config(cfg)) == max(max(p.shape[-2:]) for n, p in model.named_parameters() if n in hidden)


@pytest.mark.parametrize("readable", [True, False])
@pytest.mark.parametrize(("sets", "lower"), [
    (["n_layer=1000000000000"], "Lower n_layer (now 1000000000000; "),  # old code: the model was built, without end
    (["n_embd=4000000000", "n_head=2"], "Lower n_embd (now 4000000000; "),
    (["block_size=1000000000000000"], "Lower batch_size (now 16) or block_size (now 1000000000000000; "),
    (["n_expert=1000000000000", "n_expert_active=1"], "n_expert (now 1000000000000; "),
    (["eval_batches=99999999999"], "Lower eval_batches (now 99999999999; "),  # old code: exit 1, 3.2 TB allocated
])
def test_absurd_sizes_exit_2_at_once_without_building_a_model(tmp_path, capsys, monkeypatch, sets, lower, readable):
    """Sizes no machine runs: exit 2 from the arithmetic estimate before any model is built and before
    anything is written, with or without a readable memory limit (where none can be read, the bound is
    1 PiB)."""
    from muonclip.models import _gpt as gpt

    monkeypatch.setattr(gpt.GPT, "__init__", lambda *a, **k: pytest.fail("a model was built"))
    monkeypatch.setattr(memory, "available_memory",
                        (lambda device, ranks_here=1: 16 * 2**30) if readable else (lambda device, ranks_here=1: None))
    out = tmp_path / "out"
    sets = [x for s in sets for x in ("--set", s)]
    assert main(["train", *sets, "--steps", "2", "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "muonclip: error: one training step needs about" in err and lower in err, err
    if not readable:
        assert "no machine (the memory available here cannot be read, and no machine has 1 PiB)" in err, err
    assert not out.exists()


def test_validation_set_estimate_covers_the_tensors_it_allocates():
    """The validation set (`val_batches`) is held for the whole run: the estimate covers the peak of
    the tensors torch allocates to build it (its windows' inputs and targets, the start offsets and
    each batch's gathered windows) and is at most twice it; it grows with eval_batches,
    batch_size x block_size."""
    from muonclip.app.data import load_corpus, val_batches

    corpus = load_corpus(None)
    cfg = make_config("default", sets=["eval_batches=64"])
    kept = []
    peak = peak_tensor_bytes(lambda: kept.append(val_batches(corpus, n_batches=cfg.eval_batches,
                                                             batch_size=cfg.batch_size, block_size=cfg.block_size)))
    assert peak <= memory.validation_memory(cfg) <= 2 * peak
    assert memory.step_memory(cfg, "muon").validation == memory.validation_memory(cfg)
    assert memory.validation_memory(replace(cfg, eval_batches=128)) == 2 * memory.validation_memory(cfg)
    assert memory.validation_memory(cfg, sets=2) == 2 * memory.validation_memory(cfg)


VAL_RSS = """
import json, sys
import torch
from muonclip.app.data import load_corpus, val_batches

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key + ":"))

corpus = load_corpus(None)
torch.zeros(2, 2) @ torch.zeros(2, 2)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
before = status("VmRSS")
kept = val_batches(corpus, n_batches=int(sys.argv[1]), batch_size=1, block_size=1)
print(json.dumps({"before": before, "peak": status("VmHWM")}))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the RSS from Linux's /proc")
def test_validation_estimate_covers_many_small_batches(tmp_path):
    """Where the batches are tiny (one window of one token), a batch's Python objects and heap blocks are
    most of its memory: 200,000 of them, measured in a fresh process (1.4-1.8 KiB a batch here), are
    covered by VAL_BATCH_BYTES (2 KiB), and at most twice."""
    n = 200_000
    run = subprocess.run([sys.executable, "-c", VAL_RSS, str(n)], capture_output=True, text=True, timeout=300,
                         check=True)
    got = json.loads(run.stdout.strip().splitlines()[-1])
    measured = got["peak"] - got["before"]
    counted = memory.validation_memory(make_config("default", sets=[f"eval_batches={n}", "batch_size=1",
                                                                    "block_size=1"]))
    assert measured <= counted <= 2 * measured, (measured / n, counted / n)


@pytest.mark.parametrize(("argv", "lower"), [
    (["train", "--set", "eval_batches=99999999999"], "Lower eval_batches (now 99999999999; "),
    (["compare", "--set", "seeds=99999999999"], "Lower seeds (now 99999999999; "),  # old code: 9e11 runs planned
    (["compare", "--preset", "guards", "--set", "seeds=99999999999"], "Lower seeds (now 99999999999; "),
    (["compare", "--preset", "ladder", "--set", "seeds=99999999999"], "Lower seeds (now 99999999999; "),
    (["compare", "--preset", "finetune", "--set", "eval_batches=99999999999"], "Lower eval_batches (now 99999999999; "),
    (["compare", "--preset", "finetune", "--set", "seeds=99999999999"], "Lower seeds (now 99999999999; "),
])
def test_sizes_set_by_a_user_number_are_refused_before_they_are_allocated(tmp_path, capsys, monkeypatch, argv,
                                                                           lower):
    """Every whole-number setting that sizes an allocation is in the estimate: the validation set
    (eval_batches: on the old code a traceback, exit 1, after trying to allocate 3.2 TB) and a
    comparison's plan (seeds: on the old code 9e11 runs planned, until memory ran out). Exit 2 before the
    corpus is read, naming the setting and a value that fits; nothing written."""
    import muonclip.app.compare_runs
    import muonclip.app.finetune
    import muonclip.app.train_setup

    monkeypatch.setattr(memory, "available_memory", lambda device, ranks_here=1: 16 * 2**30)
    for module in (muonclip.app.train_setup, muonclip.app.compare_runs):
        monkeypatch.setattr(module, "load_corpus", lambda *a, **k: pytest.fail("the corpus was read"))
    monkeypatch.setattr(muonclip.app.finetune, "genre_corpora", lambda *a, **k: pytest.fail("the corpus was read"))
    out = tmp_path / "out"
    assert main([*argv, "--quiet", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "muonclip: error: one training step needs about" in err and lower in err, err
    fits = int(err.split(lower)[1].split(" ")[0])
    name = lower.split()[1]
    assert 1 <= fits < 99999999999 and f"{name} (now" in err
    assert not out.exists()
