"""The AdamW branch of `muonclip.Muon`: decoupled weight decay, bias-corrected moments.

Matches ``torch.optim.AdamW`` (Loshchilov & Hutter, arXiv 1711.05101):

    m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
    W = W (1 - lr wd)
    W = W - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

Moments are kept in float32 whatever the parameter dtype. `adamw_step` is what
`muonclip.Muon.step` runs for an ``algorithm="adamw"`` group: the state, then `adamw_update`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any

import torch
from torch import Tensor


def adamw_update(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],  # float32, like params
    exp_avg_sqs: list[Tensor],  # float32, like params
    step: int,  # the step number after this update (1 on the first update)
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """Apply one AdamW update in place to ``params`` and the moment buffers (one ``_foreach``
    kernel per operation for the whole list)."""
    if not params:
        return
    beta1, beta2 = betas
    bc1 = 1.0 - beta1**step
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    grads32 = [g if g.dtype == torch.float32 else g.float() for g in grads]
    torch._foreach_lerp_(exp_avgs, grads32, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads32, grads32, value=1.0 - beta2)
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    updates = torch._foreach_div(exp_avgs, denom)
    if all(p.dtype == torch.float32 for p in params):
        torch._foreach_add_(params, updates, alpha=-lr / bc1)
    else:  # a float32 update into a bf16 weight, rounded once
        for p, u in zip(params, updates):
            p.add_(u, alpha=-lr / bc1)


def adamw_step(params: Iterable[Tensor], state: MutableMapping[Tensor, dict[str, Any]], *, lr: float,
               betas: tuple[float, float], eps: float, weight_decay: float,
               new_buffer: Callable[[Tensor], Tensor]) -> None:
    """One AdamW step of every parameter of ``params`` with a gradient: its ``state`` entry
    (``step``, ``exp_avg`` and ``exp_avg_sq`` made by ``new_buffer``) advanced, then `adamw_update`.

    Parameters of one group can have different step counts (one without a gradient at some
    step), so each step count is updated as its own batch.
    """
    by_step: dict[int, list[Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        st = state[p]
        if "step" not in st:
            st["step"] = 0
            st["exp_avg"] = new_buffer(p)
            st["exp_avg_sq"] = new_buffer(p)
        st["step"] += 1
        by_step[st["step"]].append(p)
    for step, ps in by_step.items():
        adamw_update(ps, [p.grad for p in ps], [state[p]["exp_avg"] for p in ps], [state[p]["exp_avg_sq"] for p in ps],
                     step, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
