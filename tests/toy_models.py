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
