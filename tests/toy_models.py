"""Small models for optimizer and routing tests (built in code, nothing downloaded)."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d, bias=False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d, bias=bias)
        self.k = nn.Linear(d, d, bias=bias)
        self.v = nn.Linear(d, d, bias=bias)
        self.o = nn.Linear(d, d, bias=bias)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d, bias=bias)
        self.proj = nn.Linear(4 * d, d, bias=bias)

    def forward(self, x):
        h = self.ln_1(x)
        a = torch.softmax(self.q(h) @ self.k(h).mT / h.shape[-1] ** 0.5, -1) @ self.v(h)
        x = x + self.o(a)
        return x + self.proj(torch.relu(self.fc(self.ln_2(x))))


class TinyLM(nn.Module):
    """Embedding, two blocks, final norm and an LM head (tied to the embedding or not)."""

    def __init__(self, vocab=32, d=16, tie=True, bias=False):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, bias) for _ in range(2)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx)
        for b in self.blocks:
            x = b(x)
        return self.lm_head(self.ln_f(x))


class Mixed(nn.Module):
    """Every parameter kind: matrix, conv, stacked experts, embedding, norm, bias, scalar, head."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.conv = nn.Conv2d(2, 4, 3)
        self.lin = nn.Linear(8, 12)
        self.experts = nn.Parameter(torch.randn(3, 6, 8) * 0.3)
        self.norm = nn.LayerNorm(12)
        self.gate = nn.Parameter(torch.tensor(0.5))
        self.head = nn.Linear(12, 10)

    def forward(self, idx, img):
        x = self.emb(idx)  # (B, 8)
        e = torch.einsum("bi,eoi->beo", x, self.experts).sum(1)  # (B, 6)
        c = self.conv(img).mean((1, 2, 3))  # (B,)
        h = self.norm(self.lin(x)) * self.gate + c[:, None] + e.sum(-1, keepdim=True)
        return self.head(h)


def mixed_loss(model: Mixed, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 10, (4,), generator=g)
    img = torch.randn(4, 2, 5, 5, generator=g)
    return model(idx, img).pow(2).mean()


class Conv1D(nn.Module):
    """transformers' ``Conv1D`` (GPT-2) re-made here: a linear layer whose weight is stored ``(in, out)``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


class Conv1DBlock(nn.Module):
    """A GPT-2-style MLP block: fused (3d x d) projection split in three, then back to d."""

    def __init__(self, d):
        super().__init__()
        self.c_attn = Conv1D(3 * d, d)
        self.c_proj = Conv1D(d, 3 * d)

    def forward(self, x):
        return x + self.c_proj(torch.tanh(self.c_attn(x)))


class Conv1DNet(nn.Module):
    """Two `Conv1DBlock`s between an input and an output projection (plain Linear layers)."""

    def __init__(self, d=8, n_in=6):
        super().__init__()
        self.inp = nn.Linear(n_in, d)
        self.blocks = nn.ModuleList([Conv1DBlock(d) for _ in range(2)])
        self.out = nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.out(h)


# ------------------------------------------------------------------------------------------------
# unfused twins: the same maps stored as separate nn.Linear layers / separate expert stacks
# ------------------------------------------------------------------------------------------------


class ConcatLinear(nn.Module):
    """Separate ``nn.Linear`` maps standing in for one fused projection: their outputs are
    concatenated the way the fused weight stores them (``groups > 1``: interleaved per group,
    like GPT-NeoX's per-head ``[q k v]``), so the model computes the same function."""

    def __init__(self, parts, groups=1):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.groups = groups

    @classmethod
    def split(cls, fused, sizes, groups=1):
        """The twin of ``fused`` (an ``nn.Linear``, or transformers' ``Conv1D`` stored ``(in, out)``)."""
        conv1d = type(fused).__name__ == "Conv1D"
        w = fused.weight.detach()
        w = (w.T if conv1d else w).unflatten(0, (groups, -1))  # (G, S, in)
        b = None if fused.bias is None else fused.bias.detach().unflatten(0, (groups, -1))
        parts, a = [], 0
        for s in sizes:
            lin = nn.Linear(w.shape[-1], groups * s, bias=b is not None)
            with torch.no_grad():
                lin.weight.copy_(w[:, a:a + s].flatten(0, 1))
                if b is not None:
                    lin.bias.copy_(b[:, a:a + s].flatten())
            parts.append(lin)
            a += s
        return cls(parts, groups)

    def forward(self, x):
        outs = [p(x) for p in self.parts]
        if self.groups == 1:
            return torch.cat(outs, -1)
        return torch.cat([o.unflatten(-1, (self.groups, -1)) for o in outs], -1).flatten(-2)

    def fused(self, name, conv1d=False):
        """``{name.weight: ..., name.bias: ...}`` as the fused layer stores them."""
        def join(ts):
            return torch.cat([t.unflatten(0, (self.groups, -1)) for t in ts], 1).flatten(0, 1)

        w = join([p.weight.detach() for p in self.parts])
        out = {f"{name}.weight": w.T if conv1d else w}
        if self.parts[0].bias is not None:
            out[f"{name}.bias"] = join([p.bias.detach() for p in self.parts])
        return out


class SplitExperts(nn.Module):
    """transformers' stacked experts (Mixtral style, ``gate_up_proj (E, 2I, H)`` = ``[gate | up]``)
    with gate and up as separate ``(E, I, H)`` parameters; the eager forward of ``MixtralExperts``."""

    def __init__(self, fused):
        super().__init__()
        inter = fused.intermediate_dim
        self.num_experts = fused.num_experts
        gate_up = fused.gate_up_proj.detach()
        self.gate_proj = nn.Parameter(gate_up[:, :inter].clone())
        self.up_proj = nn.Parameter(gate_up[:, inter:].clone())
        self.down_proj = nn.Parameter(fused.down_proj.detach().clone())
        self.act_fn = fused.act_fn

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            x = hidden_states[tok]
            h = self.act_fn(nn.functional.linear(x, self.gate_proj[e])) * nn.functional.linear(x, self.up_proj[e])
            h = nn.functional.linear(h, self.down_proj[e]) * top_k_weights[tok, pos, None]
            out.index_add_(0, tok, h.to(out.dtype))
        return out

    def fused(self, name):
        return {f"{name}.gate_up_proj": torch.cat([self.gate_proj.detach(), self.up_proj.detach()], 1),
                f"{name}.down_proj": self.down_proj.detach()}


def unfuse(model):
    """Replace every fused projection of a tiny transformers model (Phi-3 ``qkv_proj`` and
    ``gate_up_proj``, GPT-2 ``c_attn``, GPT-NeoX ``query_key_value``, Mixtral-style experts) by
    its twin with separate maps, in place. Returns ``fused_params()``: the twin's parameters as
    the fused model names and stores them, for comparisons."""
    twins = []  # (module path, twin, conv1d)
    for name, module in list(model.named_modules()):
        cls = type(module).__name__
        if cls == "Phi3Attention":
            nh, nkv, d = module.config.num_attention_heads, module.num_key_value_heads, module.head_dim
            twins.append((f"{name}.qkv_proj", ConcatLinear.split(module.qkv_proj, [nh * d, nkv * d, nkv * d]), False))
        elif cls == "Phi3MLP":
            inter = module.config.intermediate_size
            twins.append((f"{name}.gate_up_proj", ConcatLinear.split(module.gate_up_proj, [inter, inter]), False))
        elif cls == "GPT2Attention":
            twins.append((f"{name}.c_attn", ConcatLinear.split(module.c_attn, [module.embed_dim] * 3), True))
        elif cls == "GPTNeoXAttention":
            d = module.head_size
            twins.append((f"{name}.query_key_value",
                          ConcatLinear.split(module.query_key_value, [d] * 3, groups=module.config.num_attention_heads),
                          False))
        elif cls == "MixtralExperts":
            twins.append((name, SplitExperts(module), None))
    for path, twin, _ in twins:
        parent, _, attr = path.rpartition(".")
        setattr(model.get_submodule(parent), attr, twin)

    def fused_params():
        out = {n: p.detach() for n, p in model.named_parameters()}
        for path, twin, conv1d in twins:
            for n in [n for n in out if n.startswith(path + ".")]:
                del out[n]
            out.update(twin.fused(path) if conv1d is None else twin.fused(path, conv1d))
        return out

    return fused_params
