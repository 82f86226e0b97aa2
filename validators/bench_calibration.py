"""The throughput stage's measurements in the planner's calibration format: per-block forward and backward
times on captured real block inputs, the adapted model's training step, and the GEMM rate achieved here.

``adapt run`` writes the result as ``artifacts/throughput/calibration.json``; ``adapt plan --calibration``
and the run's re-plan read it (``parallel_planner.calibration`` documents the format).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from torch import nn

from adapt.model.captured import fresh_input
from parallel_planner.calibration import calibration_from_measurements
from validators.compare import parse_dtype
from validators.environment import measure_matmul_flops
from validators.modules import find_blocks, first_tensor
from validators.session import synchronize
from validators.training import batch_for_step, vocab_size


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def timed(fn, device: str, reps: int) -> float:
    """Median wall time of ``fn`` over ``reps`` runs after one warm-up, synchronising the device."""
    fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def time_block(block: nn.Module, args: tuple, kwargs: dict, device: str) -> tuple[float, float]:
    """Median forward and backward seconds of one block on its captured inputs."""
    hidden = (args[0] if args else kwargs["hidden_states"]).detach().requires_grad_(True)

    def forward():
        rest = fresh_input(kwargs)
        if args:
            return first_tensor(block(hidden, *fresh_input(args[1:]), **rest))
        return first_tensor(block(**{**rest, "hidden_states": hidden}))

    forward_s = timed(forward, device, 5)
    grad = torch.randn_like(forward())
    backward_s = timed(lambda: torch.autograd.backward(forward(), grad), device, 5) - forward_s
    return forward_s, max(backward_s, 1e-9)


def planner_calibration(
    blocks: dict[str, Any], adapted: dict[str, Any], options: Any, device: str, datasheet: float | None
) -> dict[str, Any]:
    """The calibration file (``parallel_planner.calibration``): the adapted model's training step as a one-GPU
    run, the GEMM rate achieved here against the datasheet peak, and the per-block timings.

    ``adapted`` is the adapted variant's ``VariantResult`` as a dict; ``options`` the bench's ``BenchOptions``.
    A depth-truncated model's step is not the model's, so it is left out of ``runs``; without a datasheet peak
    (a CPU's peak is its own measured rate) there is no ``gemm_efficiency``."""
    shape = {k: blocks[k] for k in ("seq_len", "micro_batch", "hidden_size", "tokens")}
    runs = []
    if not options.max_layers:
        runs.append(
            {
                "gpus": 1,
                # the trainer's one-rank plan (validators.session.one_rank_plan)
                "layout": {"tp": 1, "pp": 1, "cp": 1, "zero": 0, "recompute": "none", "mbs": options.batch},
                "seq_len": options.seq_len,
                "global_batch": options.batch,
                "tokens_per_s": adapted["train_tokens_per_s"],
                "step_time_s": adapted["train_step_s"],
                "peak_memory_gib": adapted["peak_memory_bytes"] / 2**30,
                "mfu": adapted["mfu"],
            }
        )
    achieved = None
    if datasheet and options.dtype in ("bf16", "fp16"):
        achieved = measure_matmul_flops(torch.device(device), parse_dtype(options.dtype)) / 1e12
    return calibration_from_measurements(
        blocks["device"],
        achieved,
        datasheet / 1e12 if datasheet else None,
        None,
        runs,
        dtype=options.dtype,
        shape=shape,
        blocks=blocks["blocks"],
    )


def block_calibration(model: nn.Module, options: Any, device: str, spec) -> dict[str, Any]:
    """Forward and backward time of every block on its real inputs, in ``parallel_planner.calibration`` format."""
    model = model.to(device).train()
    blocks = find_blocks(model)
    inputs: dict[int, tuple] = {}

    def capture(i: int, args: tuple, kwargs: dict) -> None:  # returns None: the block runs on its own inputs
        inputs.setdefault(i, fresh_input((args, kwargs)))

    handles = [
        block.register_forward_pre_hook(lambda _m, args, kwargs, i=i: capture(i, args, kwargs), with_kwargs=True)
        for i, block in enumerate(blocks.blocks)
    ]
    ids = batch_for_step(options.seed, 20_000, options.batch, options.seq_len, vocab_size(model), device)
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    entries = []
    for i, block in enumerate(blocks.blocks):
        forward_s, backward_s = time_block(block, *inputs[i], device)
        entries.append({"index": i, "forward_s": forward_s, "backward_s": backward_s})
    model.zero_grad(set_to_none=True)
    return {
        "device": device_name(device),
        "dtype": options.dtype,
        "seq_len": options.seq_len,
        "micro_batch": options.batch,
        "hidden_size": spec.hidden_size,
        "tokens": options.batch * options.seq_len,
        "blocks": entries,
    }
