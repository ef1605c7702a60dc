"""A small GPT to read in one sitting (nanoGPT style), with the attention variants QK-Clip acts on.

* ``attention="mha"``: multi-head attention with RoPE on q and k; ``n_kv_head < n_head`` makes it
  grouped-query attention (GQA), ``n_kv_head=1`` multi-query attention (MQA).
* ``attention="mla"``: DeepSeek-V3 / Kimi K2 multi-head latent attention with decoupled RoPE —
  per-head non-rotary q^C/k^C from low-rank projections, a per-head rotary query q^R and one
  rotary key k^R shared by all heads.

Every attention call goes through `muonclip.scaled_dot_product_attention` with the module's
`MaxLogitRecorder` (``attn.recorder``) and ``training=self.training``: only training forwards
(training mode, grad enabled) feed the clip, never evaluation or a forward under ``no_grad``
(`muonclip.attention.forward_rule`). Every attention module has ``qk_clip_layer(name)``
returning the `AttentionLayer` that `MuonClip` clips. No QK-norm by default; with
``qk_norm=True`` QK-Clip is refused (the norm undoes any scaling of W_q/W_k; docs/design.md,
"QK-Clip is never a silent no-op"). For MLA, ``qk_norm`` normalises the non-rotary parts q^C and
k^C of each head only (the rotary q^R and the shared k^R stay as they are).

``attn_softcap = c > 0``: Gemma 2's logit soft-capping, the softmax over ``c * tanh(s / c)`` of
every logit ``s = scale * q.k`` (`muonclip.models._softcap`, eager: the full score matrix); the recorder
still receives the raw logits' maxima. QK-Clip refuses such a layer (the two guards together are
not supported).

Pre-norm blocks (RMSNorm), GELU MLP, no biases unless ``bias=True``, tied embeddings unless
``tie_embeddings=False``. With ``n_expert > 0`` the MLP of every block is a mixture of experts
(`MoE`, DeepSeek-V3 / Kimi K2 style): a router picks the top ``n_expert_active`` of
``n_expert`` routed experts per token, whose weights are stored as one 3-D stack per projection
(`Experts`: ``(E, out, in)``, which `muonclip.Muon` orthogonalises as E separate matrices in one
batched call), plus ``n_shared_expert`` always-on shared experts; the training loss adds
``aux_loss_weight`` times the load-balancing loss (`MoE.aux_loss`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..attention import MaxLogitRecorder, scaled_dot_product_attention
from ..qkclip._layouts import AttentionLayer, GQALayout, MHALayout, MLALayout
from ._softcap import softcap_attention


@dataclass
class GPTConfig:
    """Model shape. MLA dimensions are used only with ``attention="mla"``.

    Args:
        vocab_size: tokens (default 256: bytes).
        block_size: longest sequence (default 128); sizes the RoPE tables.
        n_layer: transformer blocks (default 4).
        n_head: query heads (default 4).
        n_kv_head: key/value heads (default None = n_head: MHA; fewer: GQA; 1: MQA).
        n_embd: model width (default 128); head_dim = n_embd // n_head for ``"mha"``.
        attention: ``"mha"`` (MHA/GQA/MQA, default) or ``"mla"``.
        q_lora_rank: MLA query low rank (default 0: a full-rank ``q_proj``).
        kv_lora_rank: MLA key/value latent rank (default 32).
        qk_nope_head_dim: MLA non-rotary q/k dim per head (default 16).
        qk_rope_head_dim: MLA rotary q/k dim per head (default 8).
        v_head_dim: MLA value dim per head (default 16).
        rope_theta: RoPE base (default 10000.0).
        bias: biases in the linear layers (default False).
        qk_norm: RMSNorm on per-head q and k (default False; blocks QK-Clip). MHA: on the whole
            of q and k (before RoPE); MLA: on the non-rotary q^C and k^C of each head only
            (Qwen3 / OLMo 2 normalise whole heads; MLA's rotary k^R is one key shared by every
            head, left unnormalised here, as is q^R).
        attn_softcap: Gemma 2's attention logit soft-capping ``c`` (default 0.0: none): the
            softmax sees ``c * tanh(s / c)`` of every logit ``s`` (`muonclip.models._softcap`); must be
            >= 0; blocks QK-Clip.
        tie_embeddings: share the token embedding and the LM head (default True).
        dropout: dropout in attention and residuals (default 0.0).
        n_expert: routed experts per block (default 0: a dense MLP instead of `MoE`).
        n_expert_active: routed experts per token, top-k (default 2).
        n_shared_expert: shared experts every token goes through (default 1).
        expert_hidden: hidden width of each expert (default 0: ``4 * n_embd // (n_expert_active +
            n_shared_expert)``, the dense MLP's width split over the experts a token uses).
        aux_loss_weight: weight of the load-balancing loss added to the training loss
            (default 0.01; only with experts, only in training mode).
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None
    n_embd: int = 128
    attention: str = "mha"
    q_lora_rank: int = 0
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    bias: bool = False
    qk_norm: bool = False
    attn_softcap: float = 0.0
    tie_embeddings: bool = True
    dropout: float = 0.0
    n_expert: int = 0
    n_expert_active: int = 2
    n_shared_expert: int = 1
    expert_hidden: int = 0
    aux_loss_weight: float = 0.01

    def __post_init__(self) -> None:
        if self.n_expert:
            if not 1 <= self.n_expert_active <= self.n_expert:
                raise ValueError(
                    f"n_expert_active={self.n_expert_active} must be between 1 and n_expert={self.n_expert}")
            if not self.expert_hidden:
                self.expert_hidden = max(1, 4 * self.n_embd // (self.n_expert_active + self.n_shared_expert))
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention must be 'mha' or 'mla', got {self.attention!r}")
        if not (self.attn_softcap >= 0 and math.isfinite(self.attn_softcap)):
            raise ValueError(f"attn_softcap must be a finite number >= 0 (0: no soft-capping), got "
                             f"{self.attn_softcap!r}")
        if self.attention == "mha":
            if self.n_embd % self.n_head:
                raise ValueError(f"n_embd={self.n_embd} must be divisible by n_head={self.n_head}")
            if (self.n_embd // self.n_head) % 2:
                raise ValueError("head_dim = n_embd // n_head must be even for RoPE")
            if self.n_head % self.n_kv_head:
                raise ValueError(f"n_head={self.n_head} must be a multiple of n_kv_head={self.n_kv_head}")
        else:
            if self.qk_rope_head_dim % 2:
                raise ValueError("qk_rope_head_dim must be even")


# ----------------------------------------------------------------------------------------------
# RoPE
# ----------------------------------------------------------------------------------------------


def rope_tables(dim: int, length: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin tables ``(length, dim)`` for rotate-half RoPE (Llama convention)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))  # (dim/2,)
    freqs = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)  # (T, dim/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (T, dim)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x (B, H, T, d)`` by position; ``cos, sin (T, d)``."""
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


# ----------------------------------------------------------------------------------------------
# attention
# ----------------------------------------------------------------------------------------------


def _check_no_other_guard(name: str, qk_norm: bool, softcap: float) -> None:
    """Refuse QK-Clip on a layer that already guards its logits another way (ValueError naming it)."""
    if qk_norm:
        raise ValueError(
            f"attention layer '{name}' has QK-norm (q_norm/k_norm after the projections): scaling W_q/W_k "
            "cannot change its logits, so QK-Clip cannot act on it. Build the model with qk_norm=False, or use "
            "muonclip.Muon without the clip."
        )
    if softcap:
        raise ValueError(
            f"attention layer '{name}' soft-caps its logits (attn_softcap={softcap:g}): QK-Clip together with "
            "soft-capping is not supported (tau would bound the raw logits while the softmax sees capped ones). "
            "Build the model with attn_softcap=0 for MuonClip, or use muonclip.Muon with the soft cap."
        )


class CausalSelfAttention(nn.Module):
    """MHA / GQA / MQA with RoPE. Query head h uses key/value head ``h // (n_head // n_kv_head)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        hd, b = self.head_dim, config.bias
        self.q_proj = nn.Linear(config.n_embd, self.n_head * hd, bias=b)
        self.k_proj = nn.Linear(config.n_embd, self.n_kv_head * hd, bias=b)
        self.v_proj = nn.Linear(config.n_embd, self.n_kv_head * hd, bias=b)
        self.o_proj = nn.Linear(self.n_head * hd, config.n_embd, bias=b)
        self.q_norm = nn.RMSNorm(hd) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(hd) if config.qk_norm else None
        self.dropout = config.dropout
        self.softcap = config.attn_softcap
        cos, sin = rope_tables(hd, config.block_size, config.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.recorder = MaxLogitRecorder(self.n_head)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape  # x: (B, T, C)
        # -1 heads: under tensor parallelism (`muonclip.models.parallel`) this rank computes a slice of them
        q = self.q_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.k_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, self.cos[:T], self.sin[:T]), apply_rope(k, self.cos[:T], self.sin[:T])
        if self.softcap:
            y = softcap_attention(q, k, v, self.softcap, dropout_p=self.dropout if self.training else 0.0,
                                  recorder=self.recorder, training=self.training)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        y = scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            enable_gqa=self.n_kv_head != self.n_head, recorder=self.recorder, training=self.training,
        )  # (B, nh, T, hs)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def qk_clip_layer(self, name: str) -> AttentionLayer:
        """The `AttentionLayer` QK-Clip acts on (MHA layout, or GQA/MQA with the per-head policy)."""
        _check_no_other_guard(name, self.q_norm is not None, self.softcap)
        q, k = self.q_proj, self.k_proj
        if self.n_kv_head == self.n_head:
            layout = MHALayout(q.weight, k.weight, self.n_head, self.head_dim, q.bias, k.bias)
        else:
            layout = GQALayout(q.weight, k.weight, self.n_head, self.n_kv_head, self.head_dim, q.bias, k.bias)
        return AttentionLayer(name, layout, self.recorder)


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V3 MLA with decoupled RoPE (no KV cache: training only).

    ``q = q_proj(x)`` (or ``q_b_proj(norm(q_a_proj(x)))`` with a query LoRA), per head
    ``[q^C (nope) | q^R (rope)]``. ``kv_a_proj_with_mqa(x) = [c^KV (kv_lora_rank) | k^R (rope)]``;
    ``kv_b_proj(norm(c^KV))`` is, per head, ``[k^C (nope) | v]``. k^R is one rotary key shared by
    all heads. Softmax scale ``1/sqrt(nope + rope)``.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        c, b = config, config.bias
        self.n_head = c.n_head
        self.nope, self.rope = c.qk_nope_head_dim, c.qk_rope_head_dim
        self.v_dim, self.kv_rank = c.v_head_dim, c.kv_lora_rank
        q_out = c.n_head * (self.nope + self.rope)
        if c.q_lora_rank > 0:
            self.q_a_proj = nn.Linear(c.n_embd, c.q_lora_rank, bias=b)
            self.q_a_norm = nn.RMSNorm(c.q_lora_rank)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(c.n_embd, q_out, bias=b)
        self.kv_a_proj_with_mqa = nn.Linear(c.n_embd, self.kv_rank + self.rope, bias=b)
        self.kv_a_norm = nn.RMSNorm(self.kv_rank)
        self.kv_b_proj = nn.Linear(self.kv_rank, c.n_head * (self.nope + self.v_dim), bias=b)
        self.o_proj = nn.Linear(c.n_head * self.v_dim, c.n_embd, bias=b)
        self.q_norm = nn.RMSNorm(self.nope) if c.qk_norm else None  # the non-rotary parts q^C, k^C only
        self.k_norm = nn.RMSNorm(self.nope) if c.qk_norm else None
        self.dropout = c.dropout
        self.softcap = c.attn_softcap
        self.scale = 1.0 / math.sqrt(self.nope + self.rope)
        cos, sin = rope_tables(self.rope, c.block_size, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.recorder = MaxLogitRecorder(self.n_head)

    def _q_weight_bias(self) -> tuple[nn.Parameter, Tensor | None]:
        if hasattr(self, "q_b_proj"):
            return self.q_b_proj.weight, self.q_b_proj.bias
        return self.q_proj.weight, self.q_proj.bias

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape  # x: (B, T, C)
        cos, sin = self.cos[:T], self.sin[:T]
        q = self.q_b_proj(self.q_a_norm(self.q_a_proj(x))) if hasattr(self, "q_b_proj") else self.q_proj(x)
        q = q.view(B, T, -1, self.nope + self.rope).transpose(1, 2)  # (B, nh, T, nope+rope)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        c_kv, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_norm(c_kv)).view(B, T, -1, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # (B, nh, T, nope), (B, nh, T, v)
        if self.q_norm is not None:
            q_nope, k_nope = self.q_norm(q_nope), self.k_norm(k_nope)
        k_rope = apply_rope(k_rope.view(B, 1, T, self.rope), cos, sin)  # (B, 1, T, rope): shared by all heads
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], dim=-1)  # (B, nh, T, nope+rope)
        k = torch.cat([k_nope, k_rope.expand(B, q.shape[1], T, self.rope)], dim=-1)  # (B, nh, T, nope+rope)
        if self.softcap:
            y = softcap_attention(q, k, v, self.softcap, scale=self.scale,
                                  dropout_p=self.dropout if self.training else 0.0, recorder=self.recorder,
                                  training=self.training)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        y = scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0, scale=self.scale,
            recorder=self.recorder, training=self.training,
        )  # (B, nh, T, v)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def qk_clip_layer(self, name: str) -> AttentionLayer:
        """The `AttentionLayer` QK-Clip acts on (MLA layout; the shared k^R is never touched)."""
        _check_no_other_guard(name, self.q_norm is not None, self.softcap)
        qw, qb = self._q_weight_bias()
        layout = MLALayout(qw, self.n_head, self.nope, self.rope, self.kv_b_proj.weight, self.v_dim,
                           q_bias=qb, kv_b_bias=self.kv_b_proj.bias)
        return AttentionLayer(name, layout, self.recorder)


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------


class MLP(nn.Module):
    """``c_proj(gelu(c_fc(x)))`` with ``hidden`` units (default 4 * n_embd)."""

    def __init__(self, config: GPTConfig, hidden: int | None = None) -> None:
        super().__init__()
        hidden = hidden or 4 * config.n_embd
        self.c_fc = nn.Linear(config.n_embd, hidden, bias=config.bias)
        self.c_proj = nn.Linear(hidden, config.n_embd, bias=config.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Experts(nn.Module):
    """``num_experts`` GELU MLPs stored as one 3-D stack per projection: ``w_fc (E, H, C)`` and
    ``w_proj (E, C, H)``, each expert's matrix laid out as ``nn.Linear`` stores it, (out, in).

    ``forward(x (N, C), index (N, k), weight (N, k))``: token n's output is
    ``sum_j weight[n, j] * expert_{index[n, j]}(x[n])``; each expert runs once on the tokens routed to it.
    """

    def __init__(self, num_experts: int, n_embd: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.w_fc = nn.Parameter(torch.empty(num_experts, hidden, n_embd))
        self.w_proj = nn.Parameter(torch.empty(num_experts, n_embd, hidden))

    def forward(self, x: Tensor, index: Tensor, weight: Tensor) -> Tensor:
        out = torch.zeros_like(x)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(index.shape[1])  # (N k,)
        flat_index, flat_weight = index.reshape(-1), weight.reshape(-1)
        for e in range(self.num_experts):
            slots = (flat_index == e).nonzero().squeeze(1)
            if slots.numel():
                rows = token[slots]
                h = F.gelu(x[rows] @ self.w_fc[e].T) @ self.w_proj[e].T  # (n_e, C)
                out.index_add_(0, rows, h * flat_weight[slots, None])
        return out


class MoE(nn.Module):
    """Mixture-of-experts feed-forward: ``router`` (a linear map to E scores, softmax), the top
    ``n_expert_active`` routed experts per token weighted by their renormalised probabilities
    (`Experts`), plus a shared dense expert of ``n_shared_expert * expert_hidden`` hidden units.

    After a forward pass ``aux_loss`` holds the load-balancing loss of Switch Transformer /
    GShard, ``E * sum_e f_e * P_e`` (f_e: share of the token-slots routed to expert e; P_e: mean
    router probability of e), which is 1 when the load is uniform.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        C, H, E = config.n_embd, config.expert_hidden, config.n_expert
        self.top_k = config.n_expert_active
        self.router = nn.Linear(C, E, bias=False)
        self.experts = Experts(E, C, H)
        self.shared_expert = MLP(config, hidden=H * config.n_shared_expert) if config.n_shared_expert else None
        self.aux_loss: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        probs = F.softmax(self.router(flat).float(), dim=-1)  # (N, E)
        top, index = probs.topk(self.top_k, dim=-1)  # (N, k)
        weight = (top / top.sum(dim=-1, keepdim=True)).to(x.dtype)
        out = self.experts(flat, index, weight)
        E = probs.shape[1]
        share = torch.bincount(index.reshape(-1), minlength=E).to(probs.dtype) / index.numel()  # f_e (no gradient)
        self.aux_loss = E * (share * probs.mean(dim=0)).sum()
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        return out.reshape(B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.RMSNorm(config.n_embd)
        self.attn = CausalSelfAttention(config) if config.attention == "mha" else MultiHeadLatentAttention(config)
        self.ln_2 = nn.RMSNorm(config.n_embd)
        self.mlp = MoE(config) if config.n_expert else MLP(config)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln_1(x)))
        return x + self.drop(self.mlp(self.ln_2(x)))


class GPT(nn.Module):
    """Decoder-only transformer: ``forward(idx (B, T) long, targets=None) -> (logits (B, T, V), loss)``.

    ``loss`` is the mean cross-entropy against ``targets (B, T)`` (``-1`` = ignore), or None; with
    experts, in training mode, plus ``aux_loss_weight`` times the load-balancing loss (`aux_loss`).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.RMSNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scaled init of residual projections
            if name.endswith(("o_proj.weight", "c_proj.weight", "experts.w_proj")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))
            elif name.endswith("experts.w_fc"):
                nn.init.normal_(p, mean=0.0, std=0.02)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        B, T = idx.shape  # idx: (B, T) long
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        x = self.drop(self.wte(idx))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
            if self.training and self.config.n_expert and self.config.aux_loss_weight:
                loss = loss + self.config.aux_loss_weight * self.aux_loss()
        return logits, loss

    def aux_loss(self) -> Tensor:
        """Sum over the blocks of the load-balancing loss of the last forward pass (`MoE.aux_loss`;
        0 without experts)."""
        parts = [b.mlp.aux_loss for b in self.blocks if isinstance(b.mlp, MoE) and b.mlp.aux_loss is not None]
        return torch.stack(parts).sum() if parts else torch.zeros(())

    def attention_modules(self) -> list[nn.Module]:
        """The attention module of every block, in order."""
        return [block.attn for block in self.blocks]

    def pop_max_logits(self) -> dict[str, Tensor]:
        """Per layer ``(n_head,)`` max logits recorded since the last reset, then reset (for logging when
        no `MuonClip` consumes them, e.g. runs with AdamW or plain Muon). Layers with nothing
        recorded are left out."""
        out = {}
        for i, attn in enumerate(self.attention_modules()):
            if attn.recorder.value is not None:
                out[f"blocks.{i}.attn"] = attn.recorder.value
            attn.recorder.reset()
        return out
