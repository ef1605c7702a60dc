"""Workspaces (where Muon's buckets live) against the core, and the CPU chunking rule.

`BufferedWorkspace` without chunking makes exactly the core's products on the same values and
only writes them into kept storage, so its results are compared bit for bit (the same kernels
on the same inputs, on any machine); chunked runs batch the products differently and are
compared at round-off tolerance.
"""

import copy

import pytest
import torch
from probes import buffer_pointers, latest_structure
from test_ortho_fast import conditioned

import muonclip
from muonclip import orthogonalize
from muonclip.fast import BufferedWorkspace
from muonclip.fast import _buffered as buffered
from muonclip.fast._buffered import CPU_CHUNK_BYTES, Buffers, chunk_size, working_set
from muonclip.optim.workspace import AutoWorkspace, CoreWorkspace, make_workspace
from muonclip.ortho._newton_schulz import normalized, polar_express_coefficients, quintic

METHODS = ["ns5", "gram", "polar_express"]
SHAPES = [(7, 24, 72), (7, 72, 24), (7, 24, 24)]


@pytest.fixture
def keep_small(monkeypatch):
    """Keep even the small temporaries of these test shapes."""
    monkeypatch.setattr(buffered, "KEEP_BYTES", 0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES)
def test_buffered_equals_the_core_and_reuses_its_buffers(keep_small, method, shape):
    """The same result bit for bit as the pure core, wide, tall and square; the temporaries live
    in the workspace's buffers, and a second call of the same shape (or a smaller one) reuses them
    without allocating; the result is a view of the kept "result" buffer.

    Bit for bit on any machine: the same bmm/baddbmm calls on the same operands in the same
    layouts; only the storage they write differs."""
    V, bf16 = conditioned(shape).to(torch.bfloat16), torch.bfloat16  # a bucket in its compute dtype
    want = orthogonalize(V, method, dtype=bf16)
    workspace = BufferedWorkspace()
    got = workspace.orthogonalize(V.clone(), method, dtype=bf16, reuse_result=True)
    assert torch.equal(got, want)
    roles = workspace.buffers.roles()
    assert {"result", "ns.S" if method != "gram" or shape[-1] == shape[-2] else "ns.R"} <= roles
    ptrs = buffer_pointers(workspace.buffers)
    result_ptr = got.data_ptr()
    again = workspace.orthogonalize(V.clone(), method, dtype=bf16, reuse_result=True)
    assert torch.equal(again, want) and again.data_ptr() == result_ptr
    assert torch.equal(workspace.orthogonalize(V[:2].clone(), method, dtype=bf16),
                       orthogonalize(V[:2], method, dtype=bf16))
    assert buffer_pointers(workspace.buffers) == ptrs


@pytest.mark.parametrize("method", METHODS)
def test_buffered_may_overwrite_only_its_input(method):
    """A bucket in the compute dtype is normalised in place (it is the step's, not read again);
    a float32 input is cast to a copy and left as it was; a result not asked to be reused is a
    new tensor each call."""
    V32 = conditioned((7, 24, 72)).float()
    V = V32.to(torch.bfloat16)
    keep, keep32 = V.clone(), V32.clone()
    workspace, bf16 = BufferedWorkspace(), torch.bfloat16
    want = orthogonalize(V, method, dtype=bf16)
    assert torch.equal(workspace.orthogonalize(V32, method, dtype=bf16).bfloat16(),
                       orthogonalize(V32, method, dtype=bf16).bfloat16())
    assert torch.equal(V32, keep32)
    a = workspace.orthogonalize(V, method, dtype=bf16)
    assert torch.equal(a, want) and not torch.equal(V, keep)
    b = workspace.orthogonalize(keep.clone(), method, dtype=bf16)
    assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


@pytest.mark.parametrize("steps", [1, 2, 5, 6])
@pytest.mark.parametrize("shape", [(3, 16, 40), (3, 40, 16), (3, 16, 16)])
def test_quintic_ping_pong_equals_the_plain_loop(keep_small, steps, shape):
    """The one quintic iteration given storage: its steps alternate between the input and the
    result (odd and even step counts, wide, tall and square), bit for bit the same iteration
    with fresh ``baddbmm`` results, the result in ``out``; a third X-sized buffer only for step
    0 of an even step count.

    Bit for bit on any machine: the same bmm/baddbmm calls on the same operands in the same
    layouts, into other storage."""
    torch.manual_seed(steps)
    X0 = normalized(torch.randn(shape), torch.bfloat16, 1e-7)
    coeffs = polar_express_coefficients(steps)
    want = quintic(X0, coeffs)
    out = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    kept = Buffers()
    got = quintic(X0.clone(), coeffs, out=out, scratch=kept.get)
    assert torch.isfinite(want).all() and torch.equal(got, want) and got.data_ptr() == out.data_ptr()
    assert ("ns.X" in kept.roles()) == (steps % 2 == 0)


@pytest.mark.parametrize("method", ["ns5", "gram", "polar_express", "ns5_sym", "svd"])
def test_backends_stay_differentiable_and_fall_back_to_the_core(method):
    """An input that requires grad (outside no_grad), a method the buffered workspace has no form
    for, or a device it does not keep buffers on: the core's pure function runs, so backward
    works, and the result equals the no-grad one bit for bit (the same products)."""
    dtype = torch.float64 if method == "svd" else None
    V = conditioned((2, 16, 40)).float().requires_grad_()
    O = BufferedWorkspace().orthogonalize(V, method, dtype=dtype)
    O.square().sum().backward()
    assert V.grad is not None and torch.isfinite(V.grad).all() and V.grad.abs().sum() > 0
    with torch.no_grad():
        assert torch.equal(O.detach(), orthogonalize(V, method, dtype=dtype))
    workspace = BufferedWorkspace()
    workspace.orthogonalize(V.detach().clone(), method, dtype=dtype)
    assert len(workspace.buffers) == 0 or method in ("ns5", "gram", "polar_express")


def test_kept_buffers(monkeypatch):
    monkeypatch.setattr(buffered, "KEEP_BYTES", 0)
    kept = Buffers()
    cpu = torch.device("cpu")
    a = kept.get("x", (2, 3), torch.float32, cpu)
    assert a.shape == (2, 3) and len(kept) == 1
    b = kept.get("x", (2, 3), torch.float32, cpu, avoid=a)  # the role's second buffer
    assert b.data_ptr() != a.data_ptr() and "x'" in kept.roles()
    assert kept.get("x", (2, 3), torch.float32, cpu, avoid=b).data_ptr() == a.data_ptr()
    assert kept.get("x", (4, 3), torch.float32, cpu).numel() == 12  # grown
    assert kept.get("x", (2,), torch.bfloat16, cpu).dtype == torch.bfloat16  # per dtype
    assert kept.get("y", (2,), torch.float32, torch.device("meta")) is None  # off the CPU: allocate as usual
    assert kept.empty("y", (2,), torch.float32, torch.device("meta")).device.type == "meta"
    monkeypatch.setattr(buffered, "KEEP_BYTES", 1024)
    assert kept.get("z", (255,), torch.float32, cpu) is None  # small: allocate as usual
    assert kept.get("z", (256,), torch.float32, cpu).numel() == 256
    assert len(copy.deepcopy(kept)) == 0  # scratch, not state


def _twins(shapes, groups=None, **kw):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]

    def grouped(ps):
        return [{"params": ps[a:b], **extra} for (a, b), extra in groups] if groups else ps

    return params, twin, grouped


def _step_both(params, twin, opt, ref):
    for p, q in zip(params, twin):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    opt.step()
    ref.step()


def test_muon_default_backend_equals_the_core_and_frees_its_buffers_when_a_step_ends(keep_small, monkeypatch):
    """One process on CPU, ``workspace="auto"``: the buffered workspace; every bucket's input and
    result come from the same two buffers and Newton–Schulz's temporaries from buffers of their
    own during a step, all freed when the step ends (nothing kept under the next forward); a
    deepcopy starts without them; every step equals, bit for bit, a ``workspace="core"``
    optimizer's (fresh tensors everywhere).

    Bit for bit on any machine: both form the same batches and make the same products on the
    same values; only the storage differs."""
    held = []
    release = BufferedWorkspace.release
    monkeypatch.setattr(BufferedWorkspace, "release", lambda self: (held.append(self.buffers.roles()), release(self)))
    shapes = [(32, 32)] * 3 + [(64, 32), (32, 64), (48, 32)]
    params, twin, grouped = _twins(shapes, [((0, 5), {}), ((5, 6), {"split_sizes": [16, 8, 24]})])
    opt = muonclip.Muon(grouped(params), lr=0.02, weight_decay=0.1)
    ref = muonclip.Muon(grouped(twin), lr=0.02, weight_decay=0.1, workspace="core")
    assert isinstance(opt.workspace, AutoWorkspace) and isinstance(ref.workspace, CoreWorkspace)
    for step in range(3):
        _step_both(params, twin, opt, ref)
        # ns5's 5 steps ping-pong between the normalised input and the result: no third X
        assert held[step] == {"input", "result", "ns.S", "ns.P"}
        assert len(opt.workspace.for_device(torch.device("cpu")).buffers) == 0
    assert len(held) == 3
    for p, q in zip(params, twin):
        assert torch.equal(p, q)
    assert len(copy.deepcopy(opt).workspace.for_device(torch.device("cpu")).buffers) == 0


def test_a_step_that_fails_still_frees_the_buffers(keep_small):
    """A bucket's orthogonalisation that raises still ends the step: the buffers it filled are freed."""

    class Failing(BufferedWorkspace):
        def orthogonalize(self, V, *args, **kw):
            super().orthogonalize(V, *args, **kw)
            raise RuntimeError("boom")

    workspace = Failing()
    p = torch.nn.Parameter(torch.randn(32, 32))
    p.grad = torch.randn(32, 32)
    opt = muonclip.Muon([p], lr=0.02, workspace=workspace)
    with pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert len(workspace.buffers) == 0


@pytest.mark.parametrize("workspace", ["core", "buffered"])
@pytest.mark.parametrize("shape, matrix", [((24, 40), (24, 40)), ((3, 24, 40), (24, 40)), ((8, 3, 3, 5), (8, 45))],
                         ids=["matrix", "experts", "conv"])
@pytest.mark.parametrize("options", [{}, {"normuon": True, "cautious_weight_decay": True}], ids=["plain", "variants"])
def test_muon_step_is_muon_update_on_one_weight(workspace, shape, matrix, options, bf16_answer):
    """`Muon.step` on one weight is `muonclip.muon_update` bit for bit: the same step body
    (`muon_step`) on the same values, a matrix, a stack of experts and a convolution (the
    matrix ``(out, in kh kw)``, as `Muon` sees it), with NorMuon and cautious weight decay too,
    under each of ``orth_dtype="auto"``'s answers (both sides read the one default)."""
    torch.manual_seed(0)
    W = torch.nn.Parameter(torch.randn(shape))
    W2, M = W.detach().clone(), torch.zeros(shape)
    V2 = torch.zeros(shape[0] if len(shape) == 3 else 1, matrix[0]) if options else None
    opt = muonclip.Muon([W], lr=0.02, weight_decay=0.1, momentum=0.9, workspace=workspace, **options)
    for _ in range(3):
        G = torch.randn(shape)
        W.grad = G.clone()
        opt.step()
        muonclip.muon_update(W2, G, M, lr=0.02, weight_decay=0.1, momentum=0.9, scale=0.2 * max(matrix) ** 0.5,
                             second_moment=V2, cautious=bool(options))
        assert torch.equal(W.detach(), W2) and torch.equal(opt.state[W]["momentum_buffer"], M)
        if options:
            assert torch.equal(opt.state[W]["neuron_second_moment"], V2)


def test_step_structure_is_cached_and_rebuilt_when_an_option_changes():
    """The buckets and update scales are built once and reused while shapes and options stay;
    lr, weight decay and momentum are read every step; changing a structural option (method,
    adjust_lr_fn, split_sizes) rebuilds them. Every step equals, bit for bit, an optimizer that
    rebuilds everything each step.

    Bit for bit on any machine: a cached structure describes the same batches and scales, so the
    same ops run on the same values."""
    params, twin, grouped = _twins([(32, 32), (32, 32), (64, 32), (48, 32)], [((0, 3), {}), ((3, 4), {})])
    opt = muonclip.Muon(grouped(params), lr=0.02, weight_decay=0.1)
    ref = muonclip.Muon(grouped(twin), lr=0.02, weight_decay=0.1)
    changes = [
        None, None,
        lambda o: o.param_groups[0].update(lr=0.05, weight_decay=0.3, momentum=0.8),
        lambda o: o.param_groups[0].update(method="gram"),
        lambda o: o.param_groups[1].update(adjust_lr_fn="original"),
        lambda o: o.param_groups[1].update(split_sizes=[16, 32]),
    ]
    seen = []
    for change in changes:
        if change is not None:
            change(opt)
            change(ref)
        ref._structures.clear()  # nothing cached
        _step_both(params, twin, opt, ref)
        seen.append(latest_structure(opt))
        for p, q in zip(params, twin):
            assert torch.equal(p, q)
    assert seen[1] is seen[0] and seen[2] is seen[0]  # same structure; lr/wd/momentum still applied
    assert len({id(s) for s in seen[2:]}) == 4  # each structural change rebuilt it
    assert [len(b.entries) for b in seen[-1].buckets] == [2, 1, 1, 1]  # 32x32 x2, 64x32, 16x32, 32x32 block
    assert (seen[-1].specs[2].axis, seen[-1].specs[2].ranges) == (0, ((0, 64, pytest.approx(0.2 * 64**0.5)),))
    # "original": sqrt(max(1, A / B)) per block, 1 for both, so their row ranges merge into one add
    assert (seen[-1].specs[3].axis, seen[-1].specs[3].ranges) == (0, ((0, 48, 1.0),))


def test_backend_choice():
    assert isinstance(make_workspace("core"), CoreWorkspace)
    assert isinstance(make_workspace("buffered"), BufferedWorkspace)
    auto = make_workspace("auto")
    assert isinstance(auto.for_device(torch.device("cpu")), BufferedWorkspace)
    assert isinstance(auto.for_device(torch.device("meta")), CoreWorkspace)  # no buffers off the CPU
    mine = BufferedWorkspace(chunk=4)
    assert make_workspace(mine) is mine
    with pytest.raises(ValueError, match="unknown workspace"):
        make_workspace("fastest")
    with pytest.raises(ValueError, match="empty"):
        make_workspace(object())
    with pytest.raises(ValueError, match="chunk must be"):
        BufferedWorkspace(chunk=0)


# ------------------------------------------------------------------------------------------
# CPU chunking: a rule, never a timing trial
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_chunks_equal_one_call(method, shape):
    """Chunks of 1 and of 3 (3, 3, 1) written into one result: the whole batch's values to
    float32 round-off (a batched product over 1 or 3 matrices need not round as one over 7)."""
    V = conditioned(shape).float()
    whole = orthogonalize(V, method, dtype=torch.float32)
    for k in (1, 3):
        got = BufferedWorkspace(chunk=k).orthogonalize(V.clone(), method, dtype=torch.float32)
        assert got.shape == V.shape
        torch.testing.assert_close(got, whole, atol=1e-6, rtol=0)


def test_chunk_rule():
    """Whole batches unless asked; the "cache" rule takes the most matrices that fit in
    CPU_CHUNK_BYTES, a multiple of the thread count; never on a GPU, for one matrix, or for a
    batch that fits anyway."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert chunk_size(None, 24, 384, 384, bf16, cpu) == 24
    assert chunk_size(5, 24, 8, 8, bf16, cpu) == 5 and chunk_size(50, 24, 8, 8, bf16, cpu) == 24
    per = working_set(384, 384, bf16)  # 1.2 MB: 3 fit in 4 MiB
    assert CPU_CHUNK_BYTES // per == 3
    assert chunk_size("cache", 24, 384, 384, bf16, cpu, threads=2) == 2
    assert chunk_size("cache", 24, 384, 384, bf16, cpu, threads=1) == 3
    assert chunk_size("cache", 24, 384, 384, bf16, cpu, threads=4) == 4  # never below the thread count
    assert chunk_size("cache", 3, 384, 384, bf16, cpu, threads=2) == 3  # fits: the whole batch
    assert chunk_size("cache", 6, 1536, 384, bf16, cpu, threads=2) == 2  # tall: m = 384, n = 1536
    assert chunk_size("cache", 24, 384, 384, bf16, torch.device("meta"), threads=2) == 24
    assert chunk_size("cache", 1, 384, 384, bf16, cpu, threads=2) == 1
