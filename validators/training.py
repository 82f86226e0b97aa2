"""The pieces of a training step that alignment parity, bench and soak share.

The batch for step ``s`` is a pure function of ``(seed, s)``, so a run resumed from a checkpoint
sees exactly the data the uninterrupted run saw, without saving any RNG state for the data.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from adapt.model.calls import token_vocab, without_cache
from validators.modules import first_tensor


def vocab_size(model: nn.Module) -> int:
    return token_vocab(model)


def batch_for_step(
    seed: int, step: int, batch: int, seq_len: int, vocab: int, device: str | torch.device
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab, (batch, seq_len), generator=gen).to(device)


def model_output(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits for a causal LM, last hidden states for an encoder; caches off so outputs are plain tensors."""
    out = first_tensor(model(input_ids=input_ids, **without_cache(model)))
    if out is None:
        raise RuntimeError("the model returned no tensor")
    return out


def loss_from_output(
    output: torch.Tensor, input_ids: torch.Tensor, vocab: int, skip_tokens: set[int] = frozenset()
) -> torch.Tensor:
    """Next-token cross-entropy when the output is over the vocabulary, else a fixed quadratic objective.

    The quadratic target is drawn from a generator seeded by the shape, so reference, baseline and
    candidate minimise the same function.  ``skip_tokens`` (flat batch*seq positions) contribute no term.
    """
    compute = torch.float64 if output.dtype == torch.float64 else torch.float32
    batch, seq = output.shape[:2]
    keep = torch.ones(batch, seq, dtype=torch.bool)
    keep.view(-1)[sorted(skip_tokens)] = False
    keep = keep.to(output.device)
    if output.shape[-1] == vocab and seq > 1:
        logits = output[:, :-1].to(compute)[keep[:, :-1]]
        return F.cross_entropy(logits, input_ids[:, 1:][keep[:, :-1]])
    gen = torch.Generator().manual_seed(output.shape[-1])
    target = torch.randn(tuple(output.shape), generator=gen, dtype=torch.float64).to(output.device, compute)
    return ((output.to(compute) - target) ** 2)[keep].mean()


def make_optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW as a user would run it: the fused kernel on CUDA, the multi-tensor (foreach) one elsewhere."""
    params = [p for p in model.parameters() if p.requires_grad]
    on_cuda = bool(params) and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0, fused=on_cuda or None, foreach=None if on_cuda else True
    )


def train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, input_ids: torch.Tensor, vocab: int, max_grad_norm: float = 1.0
) -> tuple[float, float]:
    """Forward, backward, clip, AdamW step.  Returns (loss, grad norm before clipping)."""
    optimizer.zero_grad(set_to_none=True)
    loss, grad_norm = loss_and_gradients(model, input_ids, vocab, max_grad_norm)
    optimizer.step()
    return loss, grad_norm


def loss_and_gradients(
    model: nn.Module, input_ids: torch.Tensor, vocab: int, max_grad_norm: float = 1.0
) -> tuple[float, float]:
    """A training step without the optimizer: forward, backward into cleared ``.grad``, clip.  Returns (loss,
    grad norm before clipping)."""
    model.zero_grad(set_to_none=True)
    loss = loss_from_output(model_output(model, input_ids), input_ids, vocab)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    return float(loss.detach()), float(grad_norm)
