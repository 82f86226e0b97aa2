"""adapt's training step (the trainer that bench, soak and ``adapt train`` run) reads nothing back from the device
before its optimizer is queued: a read (``.item()``, ``float(tensor)``) makes the host wait for the device, which
then idles while the host issues what follows.  That covers the trainer's own clipping and the forward's causal
mask, where transformers checks the positions for packed sequences (``operators.positions``)."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adapt.model.intake import load_model, resolve_source


class HostReads(TorchDispatchMode):
    """Records, in order, each read of a device value into Python (``aten._local_scalar_dense``)."""

    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.events.append("read")
        return func(*args, **(kwargs or {}))


def test_nothing_is_read_back_before_the_optimizer_is_queued(zoo):
    from validators.session import prepare_run

    model = load_model(resolve_source(str(zoo("llama"))), dtype=torch.float32)
    run = prepare_run(model, seq_len=12, batch=2, precision="fp32", steps=2, seed=0, deterministic=False)
    events: list[str] = []
    for optimizer in run.trainer.optimizers:
        step = optimizer.step
        optimizer.step = lambda *a, step=step, **k: (events.append("optimizer"), step(*a, **k))[1]
    forward_backward = run.trainer._forward_backward
    run.trainer._forward_backward = lambda *a, **k: (forward_backward(*a, **k), events.append("backward"))[0]
    run.trainer.pmodel.train()
    with HostReads(events):
        metrics = run.trainer.train_step()
    backward, optimizer = events.index("backward"), events.index("optimizer")
    assert backward < optimizer and "read" not in events[:optimizer], events  # forward and backward included
    assert "read" in events[optimizer:], events  # the loss and the norm are read once the step is queued
    assert isinstance(metrics.grad_norm, float) and metrics.grad_norm > 0
