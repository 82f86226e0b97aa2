"""Throughput: training step, prefill and decode rates, MFU and peak memory, adapted against what a user would pick.

Each variant is trained for a few steps by the distributed trainer under a one-rank plan (AdamW fused
on CUDA); tokens/s come from the trainer's own step timings after warm-up.  The baselines are HF eager
and, on CUDA, ``torch.compile`` of the unpatched model; the adapted model is the kernel plan with its
compilation (``operators.adapt_model``).  The adapted model is judged against the best baseline per
part (train, prefill, decode): slower than it by more than ``adapt.core.stage_verdicts.SLOWER_TOLERANCE`` fails the stage and
says where.  On CUDA decode is judged on the serving paths instead (``validators.decode``, prompt 512,
256 new tokens, batch 1 and 8): the adapted static-cache decoder against HF ``generate`` with the dynamic
cache (eager) and with the static cache compiled, against ``adapt.core.verdicts.STAGE_DECODE_MINIMA`` (no slower than either).  On CUDA the shapes are realistic unless given (``cuda_shapes``); on a CPU the verdict is
"inconclusive" (a toy shape times the host, not kernels), and on CUDA a figure whose training step
leaves the GPU idle more than ``HOST_BOUND_IDLE`` of the time is marked host-bound.  MFU divides
achieved training FLOP/s (``ModelSpec``'s per-token FLOPs at the measured sequence length) by the
device peak.  The measurements are emitted in the planner's calibration format (``planner_calibration``):
the adapted model's training step as a one-GPU run, the achieved GEMM rate against the datasheet peak, and
per-block forward and backward times measured on captured real block inputs.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
import statistics
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adapt.core.errors import BadInput
from adapt.core.jsonio import to_jsonable
from adapt.core.stage_verdicts import Check, StageSummary, SummaryContext, slower_than_best, throughput_checks
from adapt.core.verdicts import STAGE_DECODE_MINIMA, decode_targets
from adapt.model.calls import library_failure
from adapt.model.skeleton import quiet_transformers
from validators.align import kernel_plan_transform
from validators.alignment import check_device
from validators.bench_calibration import block_calibration, device_name, planner_calibration, timed
from validators.compare import parse_dtype
from validators.modules import find_blocks, first_tensor
from validators.session import prepare_run
from validators.throughput_summary import throughput_summary
from validators.training import batch_for_step, vocab_size

# Dense 16-bit tensor-core peaks from the vendors' datasheets, for MFU on known parts.
DATASHEET_PEAK_16BIT = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12}
HOST_BOUND_IDLE = 0.3  # GPU idle share of a training step above which the figure is the host's, not the kernels'
CUDA_SEQ_CAP = 2048
MEMORY_FRACTION = 0.6  # of the free device memory the training step is sized to use
SPREAD_TARGET = 0.05  # step-time coefficient of variation a conclusive figure needs
CPU_SEQ, CPU_BATCH, CPU_STEPS, CUDA_STEPS = 256, 2, 6, 20
BASELINES = ("eager", "compiled")
DECODE_PROMPT, DECODE_NEW_TOKENS = 512, 256


@dataclass
class BenchOptions:
    """None: chosen by the device (realistic shapes on CUDA, see ``cuda_shapes``; small ones on a CPU)."""

    dtype: str = "bf16"
    seq_len: int | None = None
    batch: int | None = None
    steps: int | None = None  # timed training steps per variant, after ``warmup``
    warmup: int = 2
    decode_tokens: int = 16
    compile: bool | None = None  # the torch.compile baseline; None: on CUDA only (Inductor's CPU build is slow)
    max_layers: int | None = None  # measure a depth-truncated model at real width
    peak_flops: float | None = None
    seed: int = 0
    memory_fraction: float = MEMORY_FRACTION
    # Decode against HF eager and HF static+compile at these batches (None: 1 and 8 on CUDA, none on a CPU).
    decode_batches: tuple[int, ...] | None = None
    decode_prompt: int = DECODE_PROMPT  # shortened where the model's positions cannot hold prompt + new tokens
    decode_new_tokens: int = DECODE_NEW_TOKENS


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
    step_time_cv: float | None = None
    gpu_idle_share: float | None = None  # from the profiler over one forward+backward (CUDA only)
    host_bound: bool = False
    optimizer: str = ""  # which AdamW stepped it (operators.optim.build_adamw)


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
    # the measured verdict, "verdict" in to_dict(): "passed", "failed" (adapted slower than the best baseline) or
    # "inconclusive"; ``verdict()`` is the stage's checks
    outcome: str = "passed"
    reasons: list[str] = field(default_factory=list)  # why the verdict, part by part
    shapes_basis: str = ""
    decode: list[dict[str, Any]] = field(default_factory=list)  # validators.decode.DecodeTiming rows
    decode_targets: list[dict[str, Any]] = field(default_factory=list)  # adapt.core.verdicts.decode_targets rows

    def to_dict(self) -> dict[str, Any]:
        data = {("verdict" if k == "outcome" else k): v for k, v in dataclasses.asdict(self).items()}
        data["speedup_train"] = self.speedup("train_tokens_per_s")
        data["speedup_vs_best_baseline"] = {
            part: ratio for part, (_, ratio) in best_baseline_ratios(self.variants).items()
        }
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ThroughputReport:
        """A stored report (``to_dict``) as the pipeline hands it to a later stage."""
        names = {f.name for f in dataclasses.fields(cls)} - {"variants"}
        variant_names = {f.name for f in dataclasses.fields(VariantResult)}
        variants = [VariantResult(**{k: v for k, v in d.items() if k in variant_names}) for d in data["variants"]]
        data = {("outcome" if k == "verdict" else k): v for k, v in data.items()}
        return cls(variants=variants, **{k: v for k, v in data.items() if k in names})

    def summary(self, context: SummaryContext | None = None) -> StageSummary:
        """What the report shows of the throughput stage, judged by ``throughput_checks``."""
        return throughput_summary(
            to_jsonable(self.to_dict()), variants_finite(self.variants), context or SummaryContext()
        )

    def verdict(self, thresholds: dict[str, Any] | None = None) -> list[Check]:
        return throughput_checks(self.summary().data, thresholds)

    def speedup(self, metric: str) -> float | None:
        by_name = {v.name: getattr(v, metric) for v in self.variants}
        if "eager" in by_name and "adapted" in by_name and by_name["eager"]:
            return by_name["adapted"] / by_name["eager"]
        return None


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
    from adapt.model.skeleton import build_skeleton, load_model

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


def bench(
    src, kernel_plan: Any = None, device: str = "cpu", options: BenchOptions | None = None, transform=None
) -> ThroughputReport:
    from adapt.model.intake import build_spec

    options = dataclasses.replace(options or BenchOptions())
    check_device(device)
    dtype = parse_dtype(options.dtype)
    notes: list[str] = []
    on_cuda = device.startswith("cuda")
    patch = transform or kernel_plan_transform(kernel_plan, notes)
    compile_mode = (getattr(kernel_plan, "compile", None) or {}).get("mode", "none") if on_cuda else "none"
    spec = build_spec(src, seq_len=options.seq_len)  # what the shapes are chosen from does not depend on seq
    layers = options.max_layers or spec.num_layers
    basis = _choose_shapes(options, spec, dtype, device, on_cuda)
    if options.max_layers:
        notes.append(
            f"depth-truncated: first {layers} of {spec.num_layers} blocks at full width; rates are for that depth"
        )
    peak, peak_basis = peak_flops_for(device, options.dtype, options.peak_flops)
    flops = train_flops_per_token(spec, layers, options.seq_len)
    with_compiled = on_cuda if options.compile is None else options.compile
    variants_wanted = ["eager", *(["compiled"] if with_compiled else []), "adapted"]
    if not with_compiled:
        notes.append("no torch.compile baseline on this device (pass --compile to add it): eager is the only baseline")
    if patch is None:
        notes.append("no kernel plan given: 'adapted' is the unmodified model")
    if compile_mode != "none":
        notes.append(f"adapted = kernel plan + torch.compile ({compile_mode}), as the plan says")
    results, blocks = [], {}
    for name in variants_wanted:
        model = load_for_bench(src, dtype, device, options.max_layers, notes)
        if name == "adapted":
            if patch is not None:
                model = patch(model) or model
            blocks = block_calibration(model, options, device, spec)
            if compile_mode != "none":
                from operators.api import compile_as_planned

                compile_as_planned(model, compile_mode)
        elif name == "compiled":
            model.compile()
        results.append(_measure(name, model, options, device, flops, peak))
        del model
    decode_batches = options.decode_batches if options.decode_batches is not None else ((1, 8) if on_cuda else ())
    decode = []
    if decode_batches:
        from validators.decode import decode_comparison

        prompt, new_tokens = decode_shape(options, spec.max_position_embeddings, notes)
        timings = decode_comparison(src, patch, device, dtype, decode_batches, prompt, new_tokens)
        decode = [{k: v for k, v in t.to_dict().items() if k != "tokens"} for t in timings]  # rates, not token lists
    datasheet = peak if peak_basis == "given" or "datasheet" in peak_basis else None  # not a rate measured here
    calibration = planner_calibration(blocks, dataclasses.asdict(results[-1]), options, device, datasheet)
    verdict, reasons = measured_verdict(results, device, options, decode)
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
        peak_flops_basis=peak_basis,
        variants=results,
        calibration=calibration,
        passed=verdict != "failed",
        notes=notes,
        outcome=verdict,
        reasons=reasons,
        shapes_basis=basis,
        decode=decode,
        decode_targets=decode_targets(decode, on_cuda, STAGE_DECODE_MINIMA),
    )


def decode_shape(options: BenchOptions, max_positions: int | None, notes: list[str]) -> tuple[int, int]:
    """(prompt, new tokens) of the decode comparison: the options' own, the prompt shortened to fit the positions."""
    prompt, new_tokens = options.decode_prompt, options.decode_new_tokens
    if max_positions and prompt + new_tokens > max_positions:
        prompt = max(1, max_positions - new_tokens)
        notes.append(f"decode prompt shortened to {prompt} tokens: the model holds {max_positions} positions")
    return prompt, new_tokens


def _choose_shapes(options: BenchOptions, spec, dtype: torch.dtype, device: str, on_cuda: bool) -> str:
    """Fill the options left None; returns how the shapes were chosen (for the report)."""
    given = [n for n in ("seq_len", "batch", "steps") if getattr(options, n) is not None]
    suffix = f"; given: {', '.join(given)}" if given else ""
    if not on_cuda:
        options.seq_len = options.seq_len or min(CPU_SEQ, spec.max_position_embeddings or CPU_SEQ)
        options.batch = options.batch or CPU_BATCH
        options.steps = options.steps or CPU_STEPS
        return "CPU defaults" + suffix
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    seq, batch, why = cuda_shapes(spec, free, dtype.itemsize, options.memory_fraction)
    options.seq_len = options.seq_len or seq
    options.batch = options.batch or batch
    options.steps = options.steps or CUDA_STEPS
    return why + suffix


def cuda_shapes(spec, free_bytes: int, elem_bytes: int, fraction: float) -> tuple[int, int, str]:
    """(seq, batch, how): seq = min(max positions, 2048); batch = as many sequences as fit the training step
    in ``fraction`` of the free memory, after weights, gradients and AdamW state (12 bytes/parameter in 16 bit,
    fp32 moments), with activations estimated at 34 x hidden bytes per token per block (16 bit, no recompute,
    fused attention) and the logits at 3 fp32 copies of the vocabulary per token."""
    max_positions = spec.max_position_embeddings
    seq = min(max_positions or CUDA_SEQ_CAP, CUDA_SEQ_CAP)
    params = spec.params_total
    static = params * (2 * elem_bytes + 8)
    per_token = spec.num_layers * 34 * spec.hidden_size * elem_bytes / 2 + 3 * 4 * spec.vocab_size
    budget = fraction * free_bytes - static
    batch = max(1, min(64, int(budget // (per_token * seq)))) if budget > 0 else 1
    how = (
        f"seq min(max positions {max_positions}, {CUDA_SEQ_CAP}) = {seq}; batch {batch}: the training step sized to "
        f"{fraction:.0%} of {free_bytes / 2**30:.0f} GiB free"
    )
    return seq, batch, how


def best_baseline_ratios(variants: list[VariantResult]) -> dict[str, tuple[str, float]]:
    """Per part, (best baseline's name, adapted / best baseline) where both were measured."""
    by_name = {v.name: v for v in variants}
    adapted = by_name.get("adapted")
    out = {}
    for part, metric in (
        ("train", "train_tokens_per_s"),
        ("prefill", "prefill_tokens_per_s"),
        ("decode", "decode_tokens_per_s"),
    ):
        base = [(getattr(by_name[b], metric), b) for b in BASELINES if b in by_name and getattr(by_name[b], metric) > 0]
        if adapted is None or not base:
            continue
        rate, name = max(base)
        out[part] = (name, getattr(adapted, metric) / rate)
    return out


def judge(
    variants: list[VariantResult], device: str, options: BenchOptions, decode: list[dict[str, Any]] | None = None
) -> tuple[str, list[str]]:
    """Passed, failed or inconclusive, with the reasons: a part slower than the best baseline fails.  A host-bound
    baseline is said, but only the adapted model's own host-bound or noisy timing makes the verdict inconclusive.
    Decode rows of the serving comparison replace the training loop's decode, judged against the decode targets."""
    on_cuda = device.startswith("cuda")
    reasons, doubts = [], []
    ratios = best_baseline_ratios(variants)
    targets = decode_targets(decode or [], on_cuda, STAGE_DECODE_MINIMA)
    if targets:
        ratios.pop("decode", None)
    slower = [f"{part} x{ratio:.2f} of {name}" for part, (name, ratio) in ratios.items() if slower_than_best(ratio)]
    slower += [t["reason"] for t in targets if t["verdict"] == "failed"]
    doubts += [t["reason"] for t in targets if t["verdict"] == "inconclusive" and on_cuda]
    for v in variants:
        if v.host_bound:
            line = f"{v.name} is host-bound: the GPU sat idle {v.gpu_idle_share:.0%} of its training step"
            (doubts if v.name == "adapted" else reasons).append(line)
        if v.step_time_cv is not None and v.step_time_cv > SPREAD_TARGET:
            doubts.append(f"{v.name}'s step time varies by {v.step_time_cv:.1%} (more than {SPREAD_TARGET:.0%})")
    if not on_cuda:
        return "inconclusive", [
            f"on a CPU at batch {options.batch} x {options.seq_len} the rates time the host, not the kernels",
            *([f"slower than the best baseline: {', '.join(slower)}"] if slower else []),
            *doubts,
            *reasons,
        ]
    if slower:
        return "failed", [f"adapted misses: {', '.join(slower)}", *doubts, *reasons]
    if doubts:
        return "inconclusive", [*doubts, *reasons]
    compared = ", ".join(f"{p} x{r:.2f} of {n}" for p, (n, r) in ratios.items())
    return "passed", [f"adapted vs best baseline: {compared}", *(t["reason"] for t in targets), *reasons]


def measured_verdict(
    variants: list[VariantResult], device: str, options: BenchOptions, decode: list[dict[str, Any]]
) -> tuple[str, list[str]]:
    """``judge``, failed outright where a variant measured no rate or a non-finite loss."""
    verdict, reasons = judge(variants, device, options, decode)
    if not variants_finite(variants):
        return "failed", ["a variant produced no rate or a non-finite loss", *reasons]
    return verdict, reasons


def variants_finite(variants: list[VariantResult]) -> bool:
    """Every variant measured a training rate and only finite losses: otherwise the stage fails, whatever the rates."""
    return all(v.train_tokens_per_s > 0 and all(math.isfinite(x) for x in v.losses) for v in variants)


def _reset_peak(device: str) -> None:
    gc.collect()  # the previous variant's model and optimizer must not count towards this one's peak
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    from validators.alignment import peak_rss_bytes

    return peak_rss_bytes()


def _measure(
    name: str, model: nn.Module, options: BenchOptions, device: str, flops: float, peak: float | None
) -> VariantResult:
    _reset_peak(device)
    optimizer = "auto" if name == "adapted" else "torch"  # a baseline's user steps with torch's AdamW
    run = prepare_run(
        model,
        options.seq_len,
        options.batch,
        options.dtype,
        options.warmup + options.steps,
        options.seed,
        False,
        optimizer=optimizer,
    )
    steps = run.trainer.fit(options.warmup + options.steps).steps
    timed = steps[options.warmup :]
    step_s = statistics.median(s.step_time_s for s in timed)
    times = [s.step_time_s for s in timed]
    cv = statistics.pstdev(times) / statistics.fmean(times) if len(times) > 1 else None
    tokens_per_s = options.batch * options.seq_len / step_s
    peak_mem = _peak_bytes(device)
    model = run.pmodel.chunks[0]
    idle = training_idle_share(model, options, device) if device.startswith("cuda") else None
    model.eval()
    with quiet_transformers():  # transformers >= 5.2x logs a rename notice for past_key_values
        prefill, decode, cached = _inference_rates(model, options, device)
    return VariantResult(
        name=name,
        optimizer=run.trainer.optimizer_kind,
        train_step_s=step_s,
        train_tokens_per_s=tokens_per_s,
        mfu=tokens_per_s * flops / peak if peak else None,
        prefill_tokens_per_s=prefill,
        decode_tokens_per_s=decode,
        decode_kv_cache=cached,
        peak_memory_bytes=peak_mem,
        losses=[s.loss for s in steps],
        step_time_cv=cv,
        gpu_idle_share=idle,
        host_bound=idle is not None and idle > HOST_BOUND_IDLE,
    )


def training_idle_share(model: nn.Module, options: BenchOptions, device: str) -> float | None:
    """Share of the wall time of one forward+backward with no kernel running on the GPU (torch profiler)."""
    from validators.decode import gpu_idle_share
    from validators.training import loss_from_output, model_output

    vocab = vocab_size(model)
    ids = batch_for_step(options.seed, 30_000, options.batch, options.seq_len, vocab, device)
    idle = gpu_idle_share(
        lambda: loss_from_output(model_output(model, ids), ids, vocab).backward(), torch.device(device)
    )
    model.zero_grad(set_to_none=True)
    return idle


@torch.no_grad()
def _inference_rates(model: nn.Module, options: BenchOptions, device: str) -> tuple[float, float, bool]:
    vocab = vocab_size(model)
    ids = batch_for_step(options.seed, 10_000, options.batch, options.seq_len, vocab, device)
    prefill_s = timed(lambda: model(input_ids=ids, use_cache=False), device, 3)
    try:
        out = model(input_ids=ids, use_cache=True)
    except Exception as err:  # a cache the model's own code cannot build (the generation stage names why)
        if library_failure(model, err) is None:
            raise
        out = model(input_ids=ids, use_cache=False)
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
                step = model(input_ids=seq, use_cache=False)
            tok = first_tensor(step)[:, -1:].argmax(-1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        decode_s = timed(decode, device, 2)
    return options.batch * options.seq_len / prefill_s, options.batch * options.decode_tokens / decode_s, cached
