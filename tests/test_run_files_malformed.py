"""Every malformed file of a run folder is bad input: ``muonclip train --resume`` on a folder whose
``checkpoint.json``, ``config.json`` or checkpoint file has any field replaced by a value of another
type, out of range, or removed exits with 2, a message naming the file and the field, no traceback,
and the folder exactly as it was (muonclip.app.checkpoints: read_checkpoint, read_run_config,
check_contents; the optimizer's own load_state_dict). A table over every field of each file (the
model's shapes: the first tensor's), a few odd values each, chosen by the field's kind."""

from __future__ import annotations

import copy
import hashlib
import json
import math
import shutil

import pytest
import torch

from muonclip.app.main import main

TINY = ["--preset", "tiny", "--quiet", "--threads", "1"]
ODD = {  # by the kind of the original value: values of other kinds, or out of every range of that kind
    str: [5, None, ["x"], {"a": 1}, True],
    int: ["abc", 1.5, None, [1], {"a": 1}, True, -1, 2**70],
    float: ["abc", None, [1], {"a": 1}, True, math.nan],
    bool: [0, "yes", None, [1]],
    type(None): ["abc", 1.5, [1], True, -1],
    list: [5, "abc", {"a": 1}],
    dict: [5, "abc", [1], None],
}
VALID = {("extra", "last_val_loss"): [None], ("extra",): [None]}  # kinds that field may take (null: none yet)
OPTIONAL = {("world_size",), ("mode",), ("run", "history")}  # fields a file may lack


@pytest.fixture(scope="module")
def run4(tmp_path_factory, text):
    run = tmp_path_factory.mktemp("runs") / "run4"
    assert main(["train", *TINY, "--data", text, "--steps", "4", "--out", str(run)]) == 0
    return run


def snapshot(folder):
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def leaves(obj, path=()):
    """Every (path, value) of a JSON tree, containers included; of ``shapes``, only the first tensor's."""
    yield path, obj
    if isinstance(obj, dict):
        items = list(obj.items())
        if path == ("shapes",):
            items = items[:1]
        for k, v in items:
            yield from leaves(v, (*path, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj[:1]):
            yield from leaves(v, (*path, i))


def mutated(tree, path, value):
    out = copy.deepcopy(tree)
    node = out
    for k in path[:-1]:
        node = node[k]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


DELETE = object()


def cases(tree, skip=(), required=None):
    """(path, odd value or DELETE) of every field but those under ``skip``; DELETE for the fields a file
    must hold (``required(path)``; default: every top-level one, and those of run and files)."""
    required = required or (lambda path: len(path) == 1 or path[0] in ("run", "files"))
    for path, value in leaves(tree):
        if not path or path[0] in skip:
            continue
        for odd in ODD[type(value)]:
            if odd not in VALID.get(tuple(p for p in path if isinstance(p, str)), []):
                yield path, odd
        if required(path) and path not in OPTIONAL:
            yield path, DELETE


def named(path):
    """What the message must name: the field (a top-level key, the config field, run.<key>; the manifest
    and the shapes by their own names)."""
    if path[0] in ("files", "shapes"):
        return path[0]
    keys = [str(p) for p in path if isinstance(p, str)]
    return keys[-1] if keys else str(path[0])


def assert_refused(capsys, run, file, field, before):
    rc = main(["train", "--quiet", "--out", str(run), "--resume"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "muonclip: error:" in err and "Traceback" not in err, err
    assert file in err and field in err, (file, field, err)
    assert snapshot(run) == before, err


def rehash(run):
    ptr = json.loads((run / "checkpoint.json").read_text())
    for rel in ptr["files"]:
        b = (run / rel).read_bytes()
        ptr["files"][rel] = {"bytes": len(b), "sha256": hashlib.sha256(b).hexdigest()}
    (run / "checkpoint.json").write_text(json.dumps(ptr))


def test_every_field_of_checkpoint_json(tmp_path, capsys, run4):
    """On the old code: "config": 5, [1, 2]; "shapes": 5; "extra": [1]; a files entry "abc";
    run.history "abc"; config.tau "big"; config.data 5 ... were tracebacks (exit 1)."""
    run = tmp_path / "run"
    shutil.copytree(run4, run)
    original = (run / "checkpoint.json").read_text()
    pointer = json.loads(original)
    n = 0
    for path, odd in cases(pointer):
        (run / "checkpoint.json").write_text(json.dumps(mutated(pointer, path, odd)))
        before = snapshot(run)
        # a changed fixed field of the config that is still valid is refused as another run's checkpoint,
        # naming that field too
        assert_refused(capsys, run, "checkpoint.json", named(path), before)
        n += 1
    (run / "checkpoint.json").write_text(original)
    assert n > 350
    assert main(["train", "--quiet", "--out", str(run), "--resume", "--steps", "5"]) == 0  # the original resumes


def test_every_field_of_config_json(tmp_path, capsys, run4):
    run = tmp_path / "run"
    shutil.copytree(run4, run)
    original = (run / "config.json").read_text()
    config = json.loads(original)
    n = 0
    for path, odd in cases(config, skip=("optimizer",), required=lambda path: path[0] == "run"):  # fields: defaults
        (run / "config.json").write_text(json.dumps(mutated(config, path, odd)))
        before = snapshot(run)
        assert_refused(capsys, run, "config.json", named(path), before)
        n += 1
    for odd in [5, None, "sgd", [1]]:  # without a valid optimizer it is not a run's config: the folder is foreign
        (run / "config.json").write_text(json.dumps(mutated(config, ("optimizer",), odd)))
        assert_refused(capsys, run, "config.json", "optimizer" if isinstance(odd, str) else "config.json",
                       snapshot(run))
        n += 1
    assert n > 250


def _pt_cases(data):
    groups = data["optim"]["param_groups"]  # the counters: in a group, or (earlier) the first parameter's state
    home = ("optim", "param_groups", 0) if "steps_taken" in groups[0] else ("optim", "state", groups[0]["params"][0])
    adamw_state = next(pid for g in data["optim"]["param_groups"] if g["algorithm"] == "adamw"
                       for pid in g["params"] if pid in data["optim"]["state"])
    muon_state = next(pid for g in data["optim"]["param_groups"] if g["algorithm"] == "muon"
                      for pid in g["params"] if pid in data["optim"]["state"])
    momentum = data["optim"]["state"][muon_state]["momentum_buffer"]
    name = next(iter(data["model"]))
    t = data["model"][name]

    def put(*path):
        def apply(d, value):
            node = d
            for k in path[:-1]:
                node = node[k]
            node[path[-1]] = value
        return apply

    def drop(*path):
        def apply(d, _):
            node = d
            for k in path[:-1]:
                node = node[k]
            del node[path[-1]]
        return apply

    out = []
    for key in ("format", "version", "step", "model", "optim", "rng"):
        out += [(put(key), v, key) for v in (None, 5, "abc", [1])] + [(drop(key), None, key)]
    out += [
        (put("model", name), t[:1].clone(), name), (put("model", name), t.long(), name),
        (put("model", name), torch.full_like(t, math.nan), name), (put("model", name), "abc", name),
        (put("model", "extra.weight"), t.clone(), "model"), (drop("model", name), None, "model"),
        (put("optim", "state"), 5, "optim"), (put("optim", "param_groups"), 5, "optim"),
        (put("optim", "param_groups", 0, "params"), 5, "optim"),
        (put("optim", "param_groups", 0, "lr"), "abc", "lr"), (put("optim", "param_groups", 0, "lr"), 1e39, "lr"),
        (put("optim", "param_groups", 0, "betas"), 0.9, "betas"),
        (put(*home, "steps_taken"), "abc", "steps_taken"),
        (put(*home, "steps_taken"), -1, "steps_taken"),
        (put(*home, "tau"), "big", "tau"),
        (put("optim", "state", adamw_state, "exp_avg_sq"), -torch.ones(3), "exp_avg_sq"),
        (put("optim", "state", adamw_state, "step"), -1, "step"),
        (put("optim", "state", adamw_state), "abc", "optim"),
        # on the old code: a momentum removed resumed with exit 0 (restarted from zero, silently); one on the
        # meta device was a traceback
        (drop("optim", "state", muon_state, "momentum_buffer"), None, "momentum_buffer"),
        (put("optim", "state", muon_state, "momentum_buffer"), momentum.to("meta"), "momentum_buffer"),
        (put("rng", "torch"), torch.zeros(3), "rng.torch"),
        (put("rng", "torch"), torch.zeros(3, dtype=torch.uint8), "rng.torch"),
        (put("rng", "torch"), torch.zeros(5056, dtype=torch.uint8), "rng.torch"),  # not an mt19937 state
        (put("rng", "cuda"), 5, "rng.cuda"), (put("rng", "cuda"), [5], "rng.cuda"),
        (drop("rng", "torch"), None, "rng"),
    ]
    return out


def test_every_field_of_the_checkpoint_file(tmp_path, capsys, run4):
    """The checkpoint file itself (its manifest rehashed, as a writer of the folder could): on the old
    code an rng state of zeros(3) or 5, or a model tensor of the wrong shape, were tracebacks."""
    run = tmp_path / "run"
    shutil.copytree(run4, run)
    pt = run / "checkpoint-step4.pt"
    data = torch.load(pt, weights_only=True)
    for apply, value, field in _pt_cases(data):
        d = copy.deepcopy(data)
        apply(d, value)
        torch.save(d, pt)
        rehash(run)
        assert_refused(capsys, run, "checkpoint-step4.pt", field, snapshot(run))
