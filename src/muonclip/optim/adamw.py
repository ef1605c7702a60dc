"""The AdamW branch of `muonclip.Muon`: decoupled weight decay, bias-corrected moments.

Matches ``torch.optim.AdamW`` (Loshchilov & Hutter, arXiv 1711.05101):

    m = beta1 m + (1 - beta1) g          v = beta2 v + (1 - beta2) g^2
    W = W (1 - lr wd)
    W = W - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)

Moments are kept in float32 whatever the parameter dtype.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .nonfinite import StepGate


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
    gate: StepGate | None = None,
) -> None:
    """Apply one AdamW update in place to ``params`` and the moment buffers.

    ``gate`` (`muonclip.optim.nonfinite.StepGate`, default None): for ``on_nonfinite="mask"``,
    with the gradients already zeroed where its flag is set. The coefficients ``1 - beta1``,
    ``beta2``, ``1 - lr wd`` and ``-lr / bc1`` then become 0-D device tensors (0, 1, 1 and 0
    where the flag is set), so a masked step leaves parameters and moments bit-identical and an
    unmasked one rounds exactly as with the Python scalars (tests/test_ortho_fast.py).
    """
    if not params:
        return
    beta1, beta2 = betas
    bc1 = 1.0 - beta1**step
    bc2_sqrt = math.sqrt(1.0 - beta2**step)
    grads32 = [g if g.dtype == torch.float32 else g.float() for g in grads]
    moment = exp_avgs[0]  # float32 (float64 for float64 params): the dtype gate coefficients take
    if gate is None:
        torch._foreach_lerp_(exp_avgs, grads32, 1.0 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
    else:  # per tensor: lerp_ with a 0-D weight exists in every supported torch (the foreach one is newer)
        w1 = gate.where(1.0 - beta1, 0.0, moment)
        for m, g in zip(exp_avgs, grads32):
            m.lerp_(g, w1)
        torch._foreach_mul_(exp_avg_sqs, gate.where(beta2, 1.0, moment))
    torch._foreach_addcmul_(exp_avg_sqs, grads32, grads32, value=1.0 - beta2)  # adds 0 on a masked step
    fp32 = all(p.dtype == torch.float32 for p in params)
    if weight_decay != 0.0:
        decay = 1.0 - lr * weight_decay
        if gate is None:
            torch._foreach_mul_(params, decay)
        elif fp32:
            torch._foreach_mul_(params, gate.where(decay, 1.0, moment))
        else:  # _foreach_mul_ would round a 0-D coefficient to a bf16 parameter's dtype; mul_ does not
            for p in params:
                p.mul_(gate.where(decay, 1.0, p))
    denom = torch._foreach_sqrt(exp_avg_sqs)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    updates = torch._foreach_div(exp_avgs, denom)
    if gate is not None:  # addcmul with a 0-D coefficient rounds like add with alpha (any param dtype)
        torch._foreach_addcmul_(params, updates, [gate.where(-lr / bc1, 0.0, moment)] * len(params))
    elif fp32:
        torch._foreach_add_(params, updates, alpha=-lr / bc1)
    else:
        for p, u in zip(params, updates):
            p.add_(u, alpha=-lr / bc1)
