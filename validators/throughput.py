"""Throughput: training step, prefill and decode rates, MFU and peak memory, eager against adapted.

Each variant (HF eager, adapted, adapted under ``torch.compile``) is trained for a few steps by
the distributed trainer under a one-rank plan; tokens/s come from the trainer's own step
timings after warm-up.  MFU divides achieved training FLOP/s (from ``ModelSpec``'s per-token
FLOPs at the measured sequence length) by the device peak.  Per-block forward and backward
times are measured on captured real block inputs and emitted in the planner's calibration format.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import statistics
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adapt.errors import BadInput
from adapt.skeleton import quiet_transformers
from validators.align import check_device, kernel_plan_transform
from validators.compare import parse_dtype
from validators.modules import find_blocks, first_tensor
from validators.session import prepare_run, synchronize
from validators.training import batch_for_step, vocab_size

# Dense 16-bit tensor-core peaks from the vendors' datasheets, for MFU on known parts.
DATASHEET_PEAK_16BIT = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}


@dataclass
class BenchOptions:
    dtype: str = "bf16"
    seq_len: int = 256
    batch: int = 2
    steps: int = 6  # timed training steps per variant, after ``warmup``
    warmup: int = 2
    decode_tokens: int = 16
    compile: bool = False
    max_layers: int | None = None  # measure a depth-truncated model at real width
    peak_flops: float | None = None
    seed: int = 0
    # Decode against HF eager and HF static+compile at these batches (None: 1 and 8 on CUDA, none on a CPU).
    decode_batches: tuple[int, ...] | None = None


@dataclass
class VariantResult:
    name: str
    train_step_s: float
    train_tokens_per_s: float
    mfu: float | None
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_kv_cache: bool
    peak_memory_bytes: int
    losses: list[float]


@dataclass
class ThroughputReport:
    source: str
    device: str
    device_name: str
    dtype: str
    seq_len: int
    batch: int
    layers_measured: int
    layers_total: int
    truncated: bool
    train_flops_per_token: float
    peak_flops: float | None
    peak_flops_basis: str
    variants: list[VariantResult]
    calibration: dict[str, Any]
    passed: bool
    notes: list[str] = field(default_factory=list)
    decode: list[dict[str, Any]] = field(default_factory=list)  # validators.decode.DecodeTiming rows

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["speedup_train"] = self.speedup("train_tokens_per_s")
        return data

    def speedup(self, metric: str) -> float | None:
        by_name = {v.name: getattr(v, metric) for v in self.variants}
        if "eager" in by_name and "adapted" in by_name and by_name["eager"]:
            return by_name["adapted"] / by_name["eager"]
        return None


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"CPU {platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"


def peak_flops_for(device: str, dtype: str, override: float | None) -> tuple[float | None, str]:
    if override:
        return override, "given"
    if device.startswith("cuda") and dtype in ("bf16", "fp16"):
        name = torch.cuda.get_device_name(torch.device(device))
        for part, peak in DATASHEET_PEAK_16BIT.items():
            if part in name:
                return peak, f"{part} datasheet dense 16-bit"
    from validators.environment import measure_matmul_flops

    return measure_matmul_flops(torch.device(device), parse_dtype(dtype)), "measured matmul rate on this device"


def train_flops_per_token(spec, layers: int, seq_len: int) -> float:
    """Forward+backward FLOPs per token (3x forward) at ``seq_len`` over the first ``layers`` blocks."""
    blocks = spec.blocks[:layers]
    linear = sum(b.linear_flops_per_token for b in blocks) + spec.cost.lm_head_flops_per_token
    context = seq_len / 2 if spec.is_causal else seq_len
    attention = sum(b.attention_flops_per_token_per_ctx for b in blocks) * context
    return 3.0 * (linear + attention)


def load_for_bench(src, dtype: torch.dtype, device: str, max_layers: int | None, notes: list[str]) -> nn.Module:
    """The model, or its first ``max_layers`` blocks at real width loaded straight from the shards."""
    from adapt.skeleton import build_skeleton, load_model

    if max_layers is None:
        return load_model(src, dtype, device, notes)
    from validators.streamed import Materialiser, ShardReader

    model = build_skeleton(src)
    blocks = find_blocks(model)
    if not 0 < max_layers <= len(blocks.blocks):
        raise BadInput(f"--max-layers must be between 1 and {len(blocks.blocks)}")
    parent_path, _, attr = blocks.path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, attr, nn.ModuleList(blocks.blocks[:max_layers]))
    if not src.has_weights:
        model = model.to_empty(device=device).to(dtype)
        model.init_weights()
        return model
    Materialiser(model, ShardReader(src, model), dtype, device).load("")
    for param in model.parameters():
        param.requires_grad_(True)
    return model


def bench(src, kernel_plan: Any = None, device: str = "cpu", options: BenchOptions | None = None, transform=None) -> ThroughputReport:
    from adapt.intake import build_spec

    options = options or BenchOptions()
    check_device(device)
    dtype = parse_dtype(options.dtype)
    notes: list[str] = []
    transform = transform or kernel_plan_transform(kernel_plan, notes)
    spec = build_spec(src, seq_len=options.seq_len)
    layers = options.max_layers or spec.num_layers
    if options.max_layers:
        notes.append(f"depth-truncated: first {layers} of {spec.num_layers} blocks at full width; rates are for that depth")
    peak, basis = peak_flops_for(device, options.dtype, options.peak_flops)
    flops = train_flops_per_token(spec, layers, options.seq_len)
    variants_wanted = ["eager", "adapted"] + (["adapted+compile"] if options.compile else [])
    if transform is None:
        notes.append("no kernel plan given: 'adapted' is the unmodified model")
    results, calibration = [], {}
    for name in variants_wanted:
        model = load_for_bench(src, dtype, device, options.max_layers, notes)
        if name != "eager" and transform is not None:
            model = transform(model) or model
        if name == "adapted":
            calibration = block_calibration(model, options, device, spec)
        if name.endswith("+compile"):
            model.compile()
        results.append(_measure(name, model, options, device, flops, peak))
        del model
    passed = all(r.train_tokens_per_s > 0 and all(map(_finite, r.losses)) for r in results)
    decode_batches = options.decode_batches if options.decode_batches is not None else ((1, 8) if device.startswith("cuda") else ())
    decode = []
    if decode_batches:
        from validators.decode import decode_comparison

        decode = [t.to_dict() for t in decode_comparison(src, transform, device, dtype, decode_batches, options.seq_len)]
    return ThroughputReport(
        source=src.text,
        device=device,
        device_name=device_name(device),
        dtype=options.dtype,
        seq_len=options.seq_len,
        batch=options.batch,
        layers_measured=layers,
        layers_total=spec.num_layers,
        truncated=bool(options.max_layers),
        train_flops_per_token=flops,
        peak_flops=peak,
        peak_flops_basis=basis,
        variants=results,
        calibration=calibration,
        passed=passed,
        notes=notes,
        decode=decode,
    )


def _finite(x: float) -> bool:
    return math.isfinite(x)


def _reset_peak(device: str) -> None:
    gc.collect()  # the previous variant's model and optimizer must not count towards this one's peak
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    from validators.align import peak_rss_bytes

    return peak_rss_bytes()


def _measure(name: str, model: nn.Module, options: BenchOptions, device: str, flops: float, peak: float | None) -> VariantResult:
    _reset_peak(device)
    run = prepare_run(model, options.seq_len, options.batch, options.dtype, options.warmup + options.steps, options.seed, False)
    steps = run.trainer.fit(options.warmup + options.steps).steps
    timed = steps[options.warmup :]
    step_s = statistics.median(s.step_time_s for s in timed)
    tokens_per_s = options.batch * options.seq_len / step_s
    peak_mem = _peak_bytes(device)
    model = run.pmodel.chunks[0]
    model.eval()
    with quiet_transformers():  # transformers >= 5.2x logs a rename notice for past_key_values
        prefill, decode, cached = _inference_rates(model, options, device)
    return VariantResult(
        name=name,
        train_step_s=step_s,
        train_tokens_per_s=tokens_per_s,
        mfu=tokens_per_s * flops / peak if peak else None,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        decode_kv_cache=cached,
        peak_memory_bytes=peak_mem,
        losses=[s.loss for s in steps],
    )


def _timed(fn, device: str, reps: int) -> float:
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


@torch.no_grad()
def _inference_rates(model: nn.Module, options: BenchOptions, device: str) -> tuple[float, float, bool]:
    vocab = vocab_size(model)
    ids = batch_for_step(options.seed, 10_000, options.batch, options.seq_len, vocab, device)
    prefill_s = _timed(lambda: model(input_ids=ids, use_cache=False), device, 3)
    out = model(input_ids=ids, use_cache=True)
    cached = getattr(out, "past_key_values", None) is not None
    next_tok = first_tensor(out)[:, -1:].argmax(-1)

    def decode():  # transformers >= 5.17 accepts past_key_values (newer ones warn and prefer cache=)
        past, tok, seq = (copy.deepcopy(out.past_key_values) if cached else None), next_tok, ids
        for _ in range(options.decode_tokens):
            if cached:
                step = model(input_ids=tok, past_key_values=past, use_cache=True)
                past = step.past_key_values
            else:  # no KV cache in this model: each token recomputes the whole prefix
                seq = torch.cat([seq, tok], dim=1)
                step = model(input_ids=seq)
            tok = first_tensor(step)[:, -1:].argmax(-1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        decode_s = _timed(decode, device, 2)
    return options.batch * options.seq_len / prefill_s, options.batch * options.decode_tokens / decode_s, cached


def _time_block(block: nn.Module, args: tuple, kwargs: dict, device: str) -> tuple[float, float]:
    """Median forward and backward seconds of one block on its captured inputs."""
    hidden = (args[0] if args else kwargs["hidden_states"]).detach().requires_grad_(True)
    call_args = (hidden, *args[1:]) if args else ()
    call_kwargs = kwargs if args else {**kwargs, "hidden_states": hidden}

    def forward():
        return first_tensor(block(*call_args, **call_kwargs))

    forward_s = _timed(forward, device, 5)
    grad = torch.randn_like(forward())
    backward_s = _timed(lambda: torch.autograd.backward(forward(), grad), device, 5) - forward_s
    return forward_s, max(backward_s, 1e-9)


def block_calibration(model: nn.Module, options: BenchOptions, device: str, spec) -> dict[str, Any]:
    """Forward and backward time of every block on its real inputs, in ``parallel_planner.calibration`` format."""
    model = model.to(device).train()
    blocks = find_blocks(model)
    inputs: dict[int, tuple] = {}
    handles = [
        block.register_forward_pre_hook(lambda _m, args, kwargs, i=i: inputs.setdefault(i, (args, kwargs)), with_kwargs=True)
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
        forward_s, backward_s = _time_block(block, *inputs[i], device)
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
