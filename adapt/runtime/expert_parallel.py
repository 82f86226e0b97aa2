"""Expert parallelism: experts sharded over the ``ep`` mesh, tokens dispatched and combined by all-to-all.

The experts container (a module whose own weights are ``[num_experts, ...]``, called as
``experts(tokens[T, H], top_k_index[T, k], top_k_weights[T, k])``) keeps its class and its
forward; each rank keeps only its contiguous range of experts.  A pre-hook sends every
(token, choice) pair to the rank that owns the chosen expert with ``all_to_all_single``, the
unchanged forward runs the local experts with weight 1, and a post-hook returns the results
(autograd flows back through the differentiable all-to-all) and applies the router weights.

Gradients: an owner's expert gradient sums the contributions of every rank in its ``ep`` group.
Dense parameters get FSDP's mean over the data-parallel ranks; ``reduce_expert_gradients`` takes
the same mean for experts (sum over expert-data-parallel replicas, divide by the dp degree).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from adapt.core.errors import BadInput
from adapt.runtime.model_parts import ModelParts


@dataclass
class ExpertShard:
    """One experts container after sharding: which global experts this rank owns."""

    path: str
    num_experts: int
    first: int
    count: int
    param_names: list[str]


@dataclass
class ExpertParallelState:
    ep_mesh: DeviceMesh
    expert_dp_mesh: DeviceMesh | None
    dp_degree: int
    shards: list[ExpertShard] = field(default_factory=list)
    params: list[nn.Parameter] = field(default_factory=list)  # this rank's expert weights

    def reduce_expert_gradients(self) -> None:
        """Mean expert gradients over data parallelism, matching FSDP's reduction of dense ones."""
        for param in self.params:
            if param.grad is None:  # no token reached these experts this step
                param.grad = torch.zeros_like(param)
            if self.expert_dp_mesh is not None:
                dist.all_reduce(param.grad, group=self.expert_dp_mesh.get_group())
            param.grad.div_(self.dp_degree)


class _Dispatch:
    """Routing bookkeeping kept between the pre-hook and the post-hook of one call."""

    def __init__(
        self,
        order: torch.Tensor,
        send_counts: list[int],
        recv_counts: list[int],
        weights: torch.Tensor,
    ):
        self.order, self.send_counts, self.recv_counts, self.weights = (
            order,
            send_counts,
            recv_counts,
            weights,
        )


def _make_hooks(shard: ExpertShard, group: dist.ProcessGroup):
    pending: list[_Dispatch] = []

    def dispatch(module, args, kwargs):
        tokens, top_k_index, top_k_weights = (list(args) + list(kwargs.values()))[:3]
        top_k = top_k_index.shape[1]
        flat_expert = top_k_index.reshape(-1)
        order = torch.argsort(flat_expert, stable=True)
        owner = flat_expert[order] // shard.count
        send = torch.bincount(owner, minlength=group.size())
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=group)
        send_counts, recv_counts = send.tolist(), recv.tolist()
        token_of_pair = order // top_k
        local_expert = (flat_expert[order] % shard.count).to(top_k_index.dtype)
        recv_expert = local_expert.new_empty(sum(recv_counts))
        dist.all_to_all_single(recv_expert, local_expert, recv_counts, send_counts, group=group)
        recv_tokens = funcol.all_to_all_single_autograd(tokens[token_of_pair], recv_counts, send_counts, group)
        recv_tokens = funcol.wait_tensor(recv_tokens)
        pending.append(_Dispatch(order, send_counts, recv_counts, top_k_weights))
        ones = torch.ones(recv_expert.shape[0], 1, dtype=top_k_weights.dtype, device=tokens.device)
        return (recv_tokens, recv_expert[:, None], ones), {}

    def combine(module, args, output):
        state = pending.pop()
        back = funcol.all_to_all_single_autograd(output, state.send_counts, state.recv_counts, group)
        back = funcol.wait_tensor(back)
        pairs = torch.empty_like(back)
        pairs = pairs.index_copy(0, state.order, back)
        num_tokens, top_k = state.weights.shape
        weighted = pairs.view(num_tokens, top_k, -1) * state.weights[..., None].to(pairs.dtype)
        return weighted.sum(dim=1)

    return dispatch, combine


def apply_expert_parallel(model: nn.Module, parts: ModelParts, state: ExpertParallelState) -> list[nn.Parameter]:
    """Keep this rank's experts in every experts container and route tokens over ``state.ep_mesh``."""
    ep_mesh = state.ep_mesh
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    added: list[nn.Parameter] = []
    for block in parts.blocks:
        for branch in block.branches:
            if branch.experts is None:
                continue
            path = f"{block.path}.{branch.experts}"
            experts = model.get_submodule(path)
            names = [n for n, _ in experts.named_parameters(recurse=False)]
            total = getattr(experts, names[0]).shape[0]
            if total % ep:
                raise BadInput(f"ep={ep} must divide the number of experts ({total}) in {path}")
            count = total // ep
            for name in names:
                full = getattr(experts, name)
                local = full.detach()[rank * count : (rank + 1) * count].clone()
                setattr(experts, name, nn.Parameter(local, requires_grad=full.requires_grad))
                added.append(getattr(experts, name))
            # Expert kernels size their bookkeeping (bins, one-hot widths) from the container's own
            # integer attributes that state the expert count: they now describe the local experts.
            for attr, value in list(vars(experts).items()):
                if type(value) is int and value == total:
                    setattr(experts, attr, count)
            shard = ExpertShard(
                path=path,
                num_experts=total,
                first=rank * count,
                count=count,
                param_names=names,
            )
            dispatch, combine = _make_hooks(shard, ep_mesh.get_group())
            experts.register_forward_pre_hook(dispatch, with_kwargs=True)
            experts.register_forward_hook(combine)
            state.shards.append(shard)
    if not added and parts.blocks:
        raise BadInput("ep > 1 but no experts container (module with [num_experts, ...] weights) was found")
    state.params.extend(added)
    return added
