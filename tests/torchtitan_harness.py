"""Tiny torchtitan models trained with MuonClipOptimizers, as torchtitan's trainer builds them
(for tests/test_torchtitan.py; needs the torchtitan extra)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

VOCAB = 64
SEQ = 16


def tiny_llama(n_heads=4, n_kv_heads=2, dim=32, n_layers=2):
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        Llama3Model,
        _build_llama3_layers,
        _output_linear_init,
    )

    return Llama3Model.Config(
        dim=dim, vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_output_linear_init(dim)),
        layers=_build_llama3_layers(
            fuse_qkv=True, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, hidden_dim=48,
            rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=64, theta=500000, scaling="llama"),
            attn_backend="flex"),
    )


def trainer_config(model_config, *, dp=1, tp=1, name="MuonClip", tau=1.0, **opt):
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    from muonclip.integrations.torchtitan import with_muonclip

    base = llama3_debugmodel()
    base.model_spec.model = model_config
    cfg = with_muonclip(base, device_type="cpu")
    cfg.parallelism.data_parallel_shard_degree = dp
    cfg.parallelism.tensor_parallel_degree = tp
    cfg.training.seq_len = SEQ
    o = cfg.optimizer
    o.name, o.tau, o.lr, o.orth_dtype = name, tau, 0.02, "float32"
    for k, v in opt.items():
        setattr(o, k, v)
    return cfg


def build(cfg, world, folder, parallel=True):
    """The model as torchtitan's Trainer builds it (meta init, parallelize, init weights), and the optimizer."""
    from torchtitan.distributed import ParallelDims

    model_config = cfg.model_spec.model
    model_config.update_from_config(config=cfg)
    with torch.device("meta"):
        model = model_config.build()
    if parallel:
        dims = ParallelDims.from_config(cfg.parallelism, world)
        model = cfg.model_spec.parallelize_fn(model, parallel_dims=dims, training=cfg.training,
                                              parallelism=cfg.parallelism, compile_config=cfg.compile,
                                              ac_config=cfg.activation_checkpoint, dump_folder=folder)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


def canonical_params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    from muonclip.integrations.torchtitan_layouts import canonical_name

    return {canonical_name(n): (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for n, p in model.named_parameters()}


def load_params(model, full: dict[str, torch.Tensor]) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    from muonclip.integrations.torchtitan_layouts import canonical_name

    with torch.no_grad():
        for n, p in model.named_parameters():
            t = full[canonical_name(n)]
            if isinstance(p, DTensor):
                t = distribute_tensor(t, p.device_mesh, p.placements)
            p.copy_(t)


def batch(step, B=4):
    g = torch.Generator().manual_seed(500 + step)
    x = torch.randint(0, VOCAB, (B, SEQ + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def train(model, opt, steps, *, part=0, parts=1, start=0, log=None, micro=1):
    """``steps`` steps on the global batches ``start..``; this data-parallel part (of ``parts``) takes
    its rows, in ``micro`` micro-batches (one process: ``micro=parts`` runs each rank's rows as its
    own micro-batch, so every token meets the same kernels as on the ranks). The loss is
    torchtitan's: summed cross-entropy over the global token count."""
    from torch.distributed.tensor import DTensor

    for s in range(start, start + steps):
        x, y = batch(s)
        n = x.shape[0] // parts
        x, y_part = x[part * n:(part + 1) * n], y[part * n:(part + 1) * n]
        for xm, ym in zip(x.chunk(micro), y_part.chunk(micro)):
            out = model(xm)
            if isinstance(out, DTensor):
                out = out.full_tensor()
            loss = F.cross_entropy(out.flatten(0, 1).float(), ym.flatten(), reduction="sum")
            (loss / y.numel()).backward()
        opt.step()
        opt.zero_grad()
        if log is not None:
            inner = opt.optimizers[0]
            log.append({k: (v.clone(), inner.last_clipped[k].clone()) for k, v in getattr(inner, "last_max_logits", {}).items()})


def tiny_deepseek(dim=32, n_heads=4):
    """DeepSeek-V3 shrunk: MLA (no query LoRA), one dense layer then one MoE layer (4 experts, top 2)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _output_linear_init,
    )

    layers = _build_dsv3_layers(
        n_layers=2, n_dense_layers=1, dim=dim, n_heads=n_heads, q_lora_rank=0, kv_lora_rank=16, qk_nope_head_dim=8,
        qk_rope_head_dim=4, v_head_dim=8, mscale=0.70, dense_hidden_dim=48, moe_hidden_dim=16, num_experts=4,
        num_shared_experts=1, router_top_k=2, router_score_func="softmax", attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=4, max_seq_len=64, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=64))
    return DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=dim,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=_output_linear_init(dim)),
        layers=layers, mtp_layers=[])


def deepseek_config(model_config, *, dp=1, tau=1.0):
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    from muonclip.integrations.torchtitan import with_muonclip

    base = deepseek_v3_debugmodel()
    base.model_spec.model = model_config
    cfg = with_muonclip(base, device_type="cpu")
    cfg.parallelism.data_parallel_shard_degree = dp
    cfg.training.seq_len = SEQ
    o = cfg.optimizer
    o.tau, o.lr, o.orth_dtype = tau, 0.02, "float32"
    return cfg


def reference_start(cfg, seed=0):
    """The full weights every run starts from: torchtitan's init (seeded), q and k scaled so that
    some heads' logits exceed tau = 1 and others stay below."""
    torch.manual_seed(seed)
    model = build(cfg, 1, "", parallel=False)
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "qkv_linear"):  # fused wqkv: per kv group [q heads | k | v]
                w = m.qkv_linear.wqkv.weight
                hd, hq, hkv = m.head_dim, m.n_heads, m.n_kv_heads
                hpk = hq // hkv
                view = w.view(hkv, hpk + 2, hd, -1)
                view[:, :hpk] *= torch.linspace(4.0, 40.0, hq).view(hkv, hpk, 1, 1)
                view[:, hpk] *= 6.0
            elif hasattr(m, "wkv_b"):  # MLA
                m.wq.weight.view(m.n_heads, -1, m.wq.weight.shape[1]).mul_(torch.linspace(0.5, 40.0, m.n_heads)[:, None, None])
                m.wkv_b.weight.mul_(6.0)
    return canonical_params(model)


# ------------------------------------------------------------------------------------------
# pipeline parallelism: the stages as torchtitan's trainer builds them, trained as it trains them
# ------------------------------------------------------------------------------------------


def pipeline_config(cfg, *, pp=2, schedule="1F1B", rows=4, microbatch=1, ac=True):
    """``cfg`` pipelined: ``pp`` ranks, torchtitan's ``schedule``, ``rows`` rows per data-parallel rank in
    micro-batches of ``microbatch`` rows; torchtitan's plain cross-entropy (summed, over the global token count);
    ``ac=False``: no activation checkpointing."""
    from torchtitan.components.loss import CrossEntropyLoss

    cfg.parallelism.pipeline_parallel_degree = pp
    cfg.parallelism.pipeline_parallel_schedule = schedule
    cfg.parallelism.pipeline_parallel_microbatch_size = microbatch
    cfg.training.local_batch_size = rows
    cfg.loss = CrossEntropyLoss.Config()
    if not ac:
        cfg.activation_checkpoint = None
    return cfg


class Pipeline:
    """What torchtitan's ``pipelining_fn`` returns on this rank (schedule, model parts, first/last stage)."""

    def __init__(self, schedule, parts, first, last):
        self.schedule, self.parts, self.first, self.last = schedule, parts, first, last


def build_pipeline(cfg, world, folder=""):
    """The model as torchtitan's Trainer builds it under pipeline parallelism (meta init, ``pipelining_fn``:
    split, parallelise each part, the schedule; then each part's weights initialised)."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    model_config = cfg.model_spec.model
    model_config.update_from_config(config=cfg)
    with torch.device("meta"):
        model = model_config.build()
    dims = ParallelDims.from_config(cfg.parallelism, world)
    dist_utils.set_spmd_backend(cfg.parallelism.spmd_backend)  # as the trainer does (its loss reads it)
    schedule, parts, first, last = cfg.model_spec.pipelining_fn(
        model, parallel_dims=dims, training=cfg.training, parallelism=cfg.parallelism, compile_config=cfg.compile,
        ac_config=cfg.activation_checkpoint, dump_folder=folder, device=torch.device("cpu"), model_config=model_config,
        parallelize_fn=cfg.model_spec.parallelize_fn, loss_fn=cfg.loss.build(compile_config=cfg.compile))
    for m in parts:
        m.to_empty(device="cpu")
        with torch.no_grad():
            m.init_weights(buffer_device=None)
        m.train()
    return Pipeline(schedule, parts, first, last)


def train_pipeline(pipe, opt, steps, *, part=0, parts=1, start=0, log=None, microbatch=1):
    """`train` through the pipeline, as torchtitan's trainer steps it: this data-parallel part's rows in
    micro-batches of ``microbatch`` rows, ``schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=..., losses=...,
    loss_kwargs={"global_valid_tokens": ...})``, then the optimizer. ``log`` gets, per step, this rank's layers'
    max logits and clipped heads."""
    for s in range(start, start + steps):
        x, y = batch(s)
        tokens = torch.tensor(y.numel())
        n = x.shape[0] // parts
        xs, ys = x[part * n:(part + 1) * n].split(microbatch), y[part * n:(part + 1) * n].split(microbatch)
        losses = [] if pipe.last else None
        pipe.schedule.step(arg_mbs=[(xm,) for xm in xs] if pipe.first else None, kwarg_mbs=[{} for _ in xs],
                           target_mbs=list(ys) if pipe.last else None, losses=losses,
                           loss_kwargs={"global_valid_tokens": tokens}, return_outputs=False)
        opt.step()
        opt.zero_grad()
        if log is not None:
            log.append({k: (v.clone(), o.last_clipped[k].clone()) for o in opt.clipping()
                        for k, v in o.last_max_logits.items()})


def save_start(cfg, params: dict[str, torch.Tensor], path) -> None:
    """``params`` (canonical names) as a DCP checkpoint of the model, in torchtitan's checkpoint keys
    (``ModelWrapper``: the fused wqkv saved as wq, wk, wv), written by one process."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    model = build(cfg, 1, "", parallel=False)
    load_params(model, params)
    dcp.save({"model": ModelWrapper(model).state_dict()}, checkpoint_id=str(path), no_dist=True)


def load_model(parts, path) -> None:
    """The model weights of a DCP checkpoint into ``parts`` (torchtitan's ``ModelWrapper``: any split, any mesh)."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    wrapper = ModelWrapper(parts)
    state = {"model": wrapper.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    wrapper.load_state_dict(state["model"])


def save(path, parts, opt) -> None:
    """Model and optimizer (torchtitan's flat state dict) to DCP, as its checkpointer writes them."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    dcp.save({"model": ModelWrapper(parts).state_dict(), "optimizer": opt.state_dict()}, checkpoint_id=str(path))


def load(path, parts, opt) -> None:
    """Model and optimizer from DCP into ``parts`` and ``opt`` (any split, any mesh)."""
    import torch.distributed.checkpoint as dcp
    from torchtitan.components.checkpointer.base import ModelWrapper

    wrapper = ModelWrapper(parts)
    state = {"model": wrapper.state_dict(), "optimizer": opt.state_dict()}
    dcp.load(state, checkpoint_id=str(path))
    wrapper.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def merged(results: list[dict]) -> dict:
    """One run's figures over the ranks of a pipeline: every stage's parameters, and per step every stage's
    layers' (max logits, clipped heads)."""
    params: dict = {}
    for r in results:
        params.update(r["params"])
    log = [{} for _ in results[0]["log"]]
    for r in results:
        for step, got in zip(log, r["log"]):
            step.update(got)
    return {"params": params, "log": log}
