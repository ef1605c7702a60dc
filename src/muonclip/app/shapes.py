"""The shapes of the run's GPT, counted from its config by arithmetic, never by building it: its
parameters (`block_parameters`, `outer_parameters`, `parameter_counts`), the largest dimension of a
matrix Muon updates (`hidden_extent`: `muonclip.app.config.RunConfig.check_rates` bounds the rates
by it) and the widths of the tensors a layer keeps for the backward pass (`activation_widths`:
`muonclip.app.memory` estimates a step from them). Every function takes the model's
`muonclip.models.GPTConfig` (`muonclip.app.config.model_config` of a run's config);
``tests/test_memory.py`` checks the counts against the model's own parameters."""

from __future__ import annotations

import math

from ..models import GPTConfig

Shapes = list[tuple[str, tuple[int, ...], bool]]
"""``(name, shape, hidden)`` of parameters: ``hidden`` when `muonclip.param_groups` gives it to Muon."""


def block_parameters(g: GPTConfig) -> Shapes:
    """The parameters of one transformer block of the GPT of ``g`` (names relative to
    ``blocks.<i>.``), counted from the config (no bias and a full-rank MLA query, as the run's GPT
    has: `muonclip.app.config.model_config`): the two norms, the attention (MHA/GQA with its
    optional q/k norms, or MLA with its latent's norm) and the dense MLP or the mixture of experts
    (router, the experts' 3-D stacks, the shared expert)."""
    C, H = g.n_embd, g.n_head
    out: Shapes = [("ln_1.weight", (C,), False), ("ln_2.weight", (C,), False)]
    if g.attention == "mha":
        hd = C // H
        out += [("attn.q_proj.weight", (H * hd, C), True), ("attn.k_proj.weight", (g.n_kv_head * hd, C), True),
                ("attn.v_proj.weight", (g.n_kv_head * hd, C), True), ("attn.o_proj.weight", (C, H * hd), True)]
        if g.qk_norm:
            out += [("attn.q_norm.weight", (hd,), False), ("attn.k_norm.weight", (hd,), False)]
    else:
        nope, rope, v, rank = g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim, g.kv_lora_rank
        out += [("attn.q_proj.weight", (H * (nope + rope), C), True),  # a run's MLA has no query LoRA
                ("attn.kv_a_proj_with_mqa.weight", (rank + rope, C), True), ("attn.kv_a_norm.weight", (rank,), False),
                ("attn.kv_b_proj.weight", (H * (nope + v), rank), True), ("attn.o_proj.weight", (C, H * v), True)]
    if g.n_expert:
        E, eh = g.n_expert, g.expert_hidden
        out += [("mlp.router.weight", (E, C), True), ("mlp.experts.w_fc", (E, eh, C), True),
                ("mlp.experts.w_proj", (E, C, eh), True)]
        if g.n_shared_expert:
            sh = eh * g.n_shared_expert
            out += [("mlp.shared_expert.c_fc.weight", (sh, C), True),
                    ("mlp.shared_expert.c_proj.weight", (C, sh), True)]
    else:
        out += [("mlp.c_fc.weight", (4 * C, C), True), ("mlp.c_proj.weight", (C, 4 * C), True)]
    return out


def outer_parameters(g: GPTConfig) -> Shapes:
    """The GPT's parameters outside its blocks: the token embedding (its LM head is the same
    tensor: the run's GPT ties them) and the final norm."""
    return [("wte.weight", (g.vocab_size, g.n_embd), False), ("ln_f.weight", (g.n_embd,), False)]


def hidden_extent(g: GPTConfig) -> int:
    """The largest dimension of a matrix Muon updates in the GPT of ``g`` (a 3-D stack is a batch
    of its last two dimensions): what its largest update scale, ``0.2 sqrt(max(A, B))``, depends on."""
    return max((max(shape[-2:]) for _, shape, hidden in block_parameters(g) if hidden), default=1)


def parameter_counts(g: GPTConfig) -> tuple[int, int, int]:
    """(all parameters, those of Muon's hidden matrices, the largest hidden matrix), counted from
    the config (`block_parameters` times ``n_layer``, plus `outer_parameters`)."""
    block = [(math.prod(shape), hidden) for _, shape, hidden in block_parameters(g)]
    outer = sum(math.prod(shape) for _, shape, _ in outer_parameters(g))
    hidden = [n for n, h in block if h]
    total = g.n_layer * sum(n for n, _ in block) + outer
    return total, g.n_layer * sum(hidden), max(hidden, default=0)


def activation_widths(g: GPTConfig) -> tuple[list[int], int]:
    """(the widths, in floats per token, of the tensors one layer keeps for the backward pass;
    the floats of one layer's ``heads x T x T`` scores per sequence (T = ``block_size``), 0 for
    fused attention, two such tensors with soft-capping) of the GPT of ``g``."""
    C, H = g.n_embd, g.n_head
    widths = [C] * 4  # ln_1 in/out, ln_2 in/out
    if g.n_expert:  # router scores and probabilities; per routed slot the gathered input, c_fc out, gelu
        k, eh = g.n_expert_active, g.expert_hidden  # out, weighted output; the shared expert's c_fc out and gelu
        widths += [g.n_expert] * 2 + [k * (2 * C + 2 * eh)] + [g.n_shared_expert * eh] * 2
    else:
        widths += [4 * C] * 2  # c_fc out, gelu out
    capped = 2 * H * g.block_size**2 if g.attn_softcap else 0  # softcap_attention keeps tanh's and softmax's
    if g.attention == "mha":
        kv = g.n_kv_head * (C // H)
        widths += [C, kv, kv, C, C, H]  # q, k (after RoPE), v, output, its contiguous copy, logsumexp
        if g.qk_norm:
            widths += [C, kv] * 2  # the norms' inputs and outputs
        return widths, capped
    qk, v = H * (g.qk_nope_head_dim + g.qk_rope_head_dim), H * g.v_head_dim
    widths += [qk] * 4 + [H * (g.qk_nope_head_dim + g.v_head_dim), v, v]  # q, k (and scaled), kv_b out, output, copy
    widths += [g.kv_lora_rank + g.qk_rope_head_dim, g.kv_lora_rank]  # the latent's norm: input, output
    if g.qk_norm:
        widths += [H * g.qk_nope_head_dim] * 4  # q^C and k^C norms' inputs and outputs
    return widths, capped or H * g.block_size**2  # unfused: query/key and value widths differ
