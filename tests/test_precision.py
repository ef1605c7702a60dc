"""orth_dtype="auto": bfloat16 where the device multiplies it natively, float32 elsewhere.

Every machine kind is emulated by mocking what the hardware declares (`muonclip.common._hardware`:
the CPU's flags, a CUDA device's capability), so each decision is tested on any machine.
"""

from __future__ import annotations

import pytest
import torch
from probes import latest_structure

import muonclip
from muonclip.app.config import make_config
from muonclip.app.model import muon_orth_dtype, orthogonalisation
from muonclip.app.report.markdown import protocol_markdown
from muonclip.common import _hardware as hardware
from muonclip.common._hardware import native_bf16
from muonclip.models import GPT, GPTConfig
from muonclip.optim._buckets import make_buckets
from muonclip.optim._matrices import matrix_spec
from muonclip.optim._precision import explain_orth_dtype
from muonclip.optim.workspace import CoreWorkspace
from muonclip.ortho import resolve_orth_dtype

AMX = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"})  # Sapphire Rapids
AVX512_BF16 = frozenset({"avx2", "avx512f", "avx512_bf16"})  # AMD Zen 4, Intel Cooper Lake
AVX512 = frozenset({"avx2", "avx512f"})  # Skylake-SP ... Ice Lake
AVX2 = frozenset({"avx2", "fma"})  # AMD Zen 3 and earlier, Intel client cores
ARM_BF16 = frozenset({"fp", "asimd", "sve", "bf16", "i8mm"})  # Arm Neoverse V1 (Graviton 3)


def cpu(monkeypatch, flags: frozenset[str]) -> None:
    monkeypatch.setattr(hardware, "cpu_flags", lambda: flags)
    monkeypatch.delenv(hardware.CPU_BF16_ENV, raising=False)  # the flags decide, whatever the suite was run with


def gpu(monkeypatch, capability: tuple[int, int], name: str) -> None:
    monkeypatch.setattr(hardware, "_cuda_capability", lambda index: (capability, name))


@pytest.mark.parametrize("flags, expected, named", [
    (AMX, torch.bfloat16, "AMX-BF16 and AVX512-BF16"),
    (AVX512_BF16, torch.bfloat16, "AVX512-BF16"),
    (AVX512, torch.float32, "no bfloat16 matrix instructions"),
    (AVX2, torch.float32, "no bfloat16 matrix instructions"),
    (ARM_BF16, torch.float32, "no bfloat16 matrix instructions"),
], ids=["amx", "avx512-bf16", "avx512", "avx2", "arm-bf16"])
def test_auto_on_each_cpu_kind(monkeypatch, flags, expected, named):
    cpu(monkeypatch, flags)
    assert resolve_orth_dtype("auto", "ns5", "cpu") is expected
    assert named in native_bf16("cpu")[1]
    assert explain_orth_dtype("auto", "ns5", "cpu").startswith(f"{str(expected)[6:]} on cpu (auto: ")


@pytest.mark.parametrize("capability, name, expected", [
    ((9, 0), "NVIDIA H100 80GB HBM3", torch.bfloat16),
    ((8, 0), "NVIDIA A100-SXM4-40GB", torch.bfloat16),
    ((8, 6), "NVIDIA GeForce RTX 3090", torch.bfloat16),
    ((7, 5), "Tesla T4", torch.float32),
    ((7, 0), "Tesla V100-SXM2-16GB", torch.float32),
], ids=["sm90", "sm80", "sm86", "sm75", "sm70"])
def test_auto_on_each_cuda_capability(monkeypatch, capability, name, expected):
    gpu(monkeypatch, capability, name)
    cpu(monkeypatch, AVX2)  # the host CPU does not decide for the GPU
    assert resolve_orth_dtype("auto", "ns5", "cuda:0") is expected
    why = native_bf16(torch.device("cuda", 0))[1]
    assert name in why and f"{capability[0]}.{capability[1]}" in why
    assert ("has bfloat16 tensor cores" in why) == (expected is torch.bfloat16)


def test_other_devices_and_methods(monkeypatch):
    cpu(monkeypatch, AMX)
    assert resolve_orth_dtype("auto", "ns5", "mps") is torch.float32
    assert resolve_orth_dtype("auto", "ns5", "meta") is torch.float32
    for method in ("polar_express", "gram", "ns5_sym", "ns5_compiled"):
        assert resolve_orth_dtype("auto", method, "cpu") is torch.bfloat16
    # svd cannot compute in bfloat16: its own default, on every kind
    assert resolve_orth_dtype("auto", "svd", "cpu") is torch.float64
    assert "method 'svd' computes in float32/float64" in explain_orth_dtype("auto", "svd", "cpu")


@pytest.mark.parametrize("flags", [AMX, AVX2], ids=["amx", "avx2"])
def test_explicit_orth_dtype_overrides_on_every_kind(monkeypatch, flags):
    cpu(monkeypatch, flags)
    gpu(monkeypatch, (7, 0), "Tesla V100-SXM2-16GB")
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        assert resolve_orth_dtype(dtype, "ns5", "cpu") is dtype
        assert resolve_orth_dtype(dtype, "ns5", "cuda:0") is dtype
        assert explain_orth_dtype(dtype, "ns5", "cpu") == f"{str(dtype)[6:]} on cpu (set by orth_dtype)"
    assert resolve_orth_dtype(None, "ns5", "cpu") is torch.bfloat16  # the method's own default, on every kind


def test_detection_runs_once_and_never_times(monkeypatch):
    """The CPU's flags are read once per process (cached), from /proc/cpuinfo where it exists."""
    hardware.cpu_flags.cache_clear()
    reads = []
    real = hardware._read_cpuinfo
    monkeypatch.setattr(hardware, "_read_cpuinfo", lambda: reads.append(1) or real())
    try:
        for _ in range(3):
            hardware.cpu_matrix_instructions()
            resolve_orth_dtype("auto", "ns5", "cpu")
    finally:
        hardware.cpu_flags.cache_clear()
    assert reads == [1]


def test_cpuinfo_is_parsed_for_x86_and_arm(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_bf16\n"
                   "processor\t: 1\nflags\t\t: fpu\n")
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve bf16\nCPU implementer\t: 0x41\n")
    assert hardware._read_cpuinfo(str(x86)) == {"fpu", "avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert hardware._read_cpuinfo(str(arm)) == {"fp", "asimd", "sve", "bf16"}
    assert hardware._read_cpuinfo(str(tmp_path / "missing")) is None
    # where the file cannot be read, torch's cpuid probes answer (each probe that this torch has)
    probes = hardware._torch_probes([("avx2", "_is_avx2_supported"), ("x", "_no_such_probe")])
    assert probes <= {"avx2"} and probes == ({"avx2"} if torch.cpu._is_avx2_supported() else set())


def test_instructions_are_named(monkeypatch):
    cpu(monkeypatch, AMX)
    assert hardware.cpu_matrix_instructions() == ("AMX-BF16", "AVX512-BF16", "AVX512F", "AVX2")
    assert hardware.cpu_bf16_instructions() == ("AMX-BF16", "AVX512-BF16")
    cpu(monkeypatch, AVX2)
    assert hardware.cpu_matrix_instructions() == ("AVX2",) and hardware.cpu_bf16_instructions() == ()


def _steps(orth_dtype, shapes=((24, 40), (40, 24), (3, 16, 16))):
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    opt = muonclip.Muon(ps, lr=0.02, orth_dtype=orth_dtype)
    for k in range(3):
        g = torch.Generator().manual_seed(100 + k)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return opt, ps


@pytest.mark.parametrize("flags, same_as", [(AMX, torch.bfloat16), (AVX512_BF16, torch.bfloat16),
                                            (AVX512, torch.float32), (AVX2, torch.float32)],
                         ids=["amx", "avx512-bf16", "avx512", "avx2"])
def test_muon_default_is_auto_and_steps_as_the_dtype_it_resolves_to(monkeypatch, flags, same_as):
    """Muon's default orth_dtype is "auto"; its steps are those of the dtype it resolves to, bit
    for bit (the same code on the same machine), and its buckets are in that dtype."""
    cpu(monkeypatch, flags)
    opt, ps = _steps("auto")
    assert muonclip.Muon(ps).defaults["orth_dtype"] == "auto"
    assert {b.compute_dtype for b in latest_structure(opt).buckets} == {same_as}
    _, explicit = _steps(same_as)
    assert all(torch.equal(p, q) for p, q in zip(ps, explicit))


def test_muonclip_default_is_auto(monkeypatch):
    cpu(monkeypatch, AVX2)
    opt = muonclip.MuonClip(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)), lr=0.02)
    assert opt.defaults["orth_dtype"] == "auto"
    assert "orth_dtype: auto -> float32 on cpu (the CPU has no bfloat16 matrix instructions" in repr(opt)


def test_resolution_is_per_device_of_the_parameters(monkeypatch):
    """One optimizer, parameters on two devices: each bucket gets its device's dtype (the CPU with
    AMX: bfloat16; a device where bfloat16 is not known to be native: float32)."""
    cpu(monkeypatch, AMX)
    group = {"method": "ns5", "ns_steps": None, "orth_dtype": "auto", "eps": 1e-7, "ns_coefficients": None,
             "split_sizes": None, "split_groups": 1, "flatten": False, "transposed": False,
             "adjust_lr_fn": "match_rms_adamw"}
    spec = matrix_spec((8, 8), group)
    buckets = make_buckets([spec, spec], [group, group], [torch.device("cpu"), torch.device("meta")], range(2),
                           CoreWorkspace())
    assert [(b.device.type, b.compute_dtype) for b in buckets] == [("cpu", torch.bfloat16), ("meta", torch.float32)]


def test_repr_and_report_name_the_dtype_and_why(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 10))
    cpu(monkeypatch, AMX)
    groups = muonclip.param_groups(model)
    assert groups.report().splitlines()[-1] == (
        "Orthogonalisation (Muon's default orth_dtype='auto'; orth_dtype=torch.float32 or torch.bfloat16 sets it): "
        "bfloat16 on cpu (auto: the CPU has AMX-BF16 and AVX512-BF16)")
    cpu(monkeypatch, AVX2)
    assert "float32 on cpu (auto: the CPU has no bfloat16 matrix instructions" in groups.report()
    assert "orth_dtype: torch.bfloat16\n" in repr(muonclip.Muon(muonclip.param_groups(model),
                                                                 orth_dtype=torch.bfloat16))
    opt = muonclip.Muon(groups)
    assert "orth_dtype: auto -> float32 on cpu (the CPU has no bfloat16 matrix instructions" in repr(opt)
    cpu(monkeypatch, AMX)
    assert "orth_dtype: auto -> bfloat16 on cpu (the CPU has AMX-BF16 and AVX512-BF16)" in repr(opt)
    # the groups the optimizer took now hold its orth_dtype: the report names it as theirs
    assert groups.report().splitlines()[-1] == "Orthogonalisation: bfloat16 on cpu (auto: the CPU has AMX-BF16 and " \
                                               "AVX512-BF16)"


def test_auto_is_saved_as_auto_and_resolved_again_where_loaded(monkeypatch):
    """A state saved on a machine with AMX holds "auto" (a string any checkpointer stores); loaded
    on a CPU without bfloat16 instructions, the next step orthogonalises in float32 there. An
    explicit dtype is saved and loaded as that dtype."""
    cpu(monkeypatch, AMX)
    opt, ps = _steps("auto")
    sd = opt.state_dict()
    assert {g["orth_dtype"] for g in sd["param_groups"]} == {"auto"}
    cpu(monkeypatch, AVX2)
    other = muonclip.Muon(ps, lr=0.02, orth_dtype=torch.bfloat16)
    other.load_state_dict(sd)
    assert other.param_groups[0]["orth_dtype"] == "auto"
    for p in ps:
        p.grad = torch.ones_like(p)
    other.step()
    assert {b.compute_dtype for b in latest_structure(other).buckets} == {torch.float32}
    fixed, _ = _steps(torch.bfloat16)
    sd = fixed.state_dict()
    assert sd["param_groups"][0]["orth_dtype"] == "torch.bfloat16"
    again = muonclip.Muon(ps, lr=0.02)
    again.load_state_dict(sd)
    assert again.param_groups[0]["orth_dtype"] is torch.bfloat16


def test_auto_converts_to_torch_optim_muon():
    """torch.optim.Muon orthogonalises in bfloat16: "auto" is the same update up to rounding."""
    opt, _ = _steps("auto", shapes=[(24, 40)])
    assert opt.torch_state_dict()["param_groups"][0]["ns_steps"] == 5
    opt2, _ = _steps(torch.float32, shapes=[(24, 40)])
    with pytest.raises(ValueError, match=r"orth_dtype=torch.float32 \(torch.optim.Muon orthogonalises in bfloat16\)"):
        opt2.torch_state_dict()


def test_bad_orth_dtype_is_refused_with_what_to_pass():
    p = torch.nn.Parameter(torch.randn(4, 4))
    with pytest.raises(ValueError, match=r"orth_dtype must be 'auto', None .* or a torch dtype such as "
                                         r"torch.bfloat16 or torch.float32, got 'bfloat16'"):
        muonclip.Muon([p], orth_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"method 'svd' computes in one of"):
        muonclip.Muon([p], method="svd", orth_dtype=torch.bfloat16)
    assert muonclip.Muon([p], method="svd").param_groups[0]["orth_dtype"] == "auto"


def test_app_default_is_auto_and_its_report_says_why(monkeypatch):
    cpu(monkeypatch, AVX2)
    cfg = make_config("tiny")
    assert cfg.orth_dtype == "auto" and muon_orth_dtype(cfg) == "auto"
    assert orthogonalisation(cfg) == ("float32 on cpu (auto: the CPU has no bfloat16 matrix instructions "
                                      "(AMX-BF16, AVX512-BF16): bfloat16 is emulated)")
    assert "orthogonalisation ns5 in float32 on cpu (auto: the CPU has no bfloat16" in protocol_markdown(
        cfg, ["adamw", "muon"], False)
    cpu(monkeypatch, AMX)
    assert "ns5 in bfloat16 on cpu (auto: the CPU has AMX-BF16 and AVX512-BF16)" in protocol_markdown(
        cfg, ["adamw", "muon"], False)
    pinned = make_config("tiny", sets=["orth_dtype=float32"])
    assert muon_orth_dtype(pinned) is torch.float32
    assert orthogonalisation(pinned) == "float32 on cpu (set by orth_dtype)"
    with pytest.raises(ValueError, match=r"orth_dtype must be one of \('auto', 'bfloat16', 'float32'\)"):
        make_config("tiny", sets=["orth_dtype=half"])

