"""adapt's optimizer update as a ``torch.library`` operator (see ``ops`` for the conventions).

The operator mutates its parameter and moment arguments in place and returns nothing, so a traced
optimizer step (``torch.compile`` of ``step``) keeps it as one node with its mutations declared.
"""

from __future__ import annotations

import torch
from torch.library import custom_op

from . import adamw
from ._op_utils import CALLS


@custom_op("adapt::adamw_update_", mutates_args=("params", "exp_avgs", "exp_avg_sqs"))
def adamw_update_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[int],
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One decoupled-decay AdamW step for every parameter tensor (``steps[i]``: its step number, from 1)."""
    CALLS["adamw_update_"] += 1
    adamw.adamw_update(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay)


@adamw_update_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay):
    return None
