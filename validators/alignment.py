"""The alignment result and what the full and the streamed comparison share: options, the report, the reference
dtype, the device check, and the final verdict (``finish_report``)."""

from __future__ import annotations

import contextlib
import dataclasses
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from adapt.core.errors import BadInput
from adapt.core.jsonio import to_jsonable
from adapt.core.stage_verdicts import Check, StageSummary, SummaryContext, alignment_checks, fmt, num
from validators.compare import LayerResult, parse_dtype

# Widths from which a float64 CPU reference costs more than it tells: use float32 there.
FP32_REFERENCE_FROM_WIDTH = 4096
PARITY_TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 3e-2}
SUMMARY_TENSOR_FIELDS = ("name", "block", "component", "cosine", "rel_err", "max_abs", "err_ratio",
                         "baseline_rel_err", "negligible", "passed")  # fmt: skip  # what the gate re-judges


@dataclass
class AlignOptions:
    batch: int = 2
    seq_len: int = 32
    seed: int | None = None  # None: fresh random inputs each run (the seed used is reported)
    backward: bool = True
    parity_steps: int = 4
    lr: float = 1e-3
    reference_dtype: str | None = None  # "fp64" or "fp32"; None: fp64, or fp32 from FP32_REFERENCE_FROM_WIDTH
    # How the candidate is compiled: "blocks", "whole" or "none"; None: as its kernel plan says (``adapt_model``)
    compile_mode: str | None = None
    compile_backend: str = "inductor"  # torch.compile backend of a compiled candidate ("aot_eager" where no compiler)


@dataclass
class ParityResult:
    steps: int
    baseline_losses: list[float]
    candidate_losses: list[float]
    max_rel_diff: float
    tolerance: float
    passed: bool
    training_randomness_off: bool = False  # the model's training forward is random: both ran with it off
    # gradient norms before clipping, at the same weights as the losses; max_rel_diff covers them too
    baseline_grad_norms: list[float] = field(default_factory=list)
    candidate_grad_norms: list[float] = field(default_factory=list)


@dataclass
class AlignmentReport:
    source: str
    dtype: str
    device: str
    reference_dtype: str
    streamed: bool
    seed: int
    thresholds: dict[str, float]
    # The verdict starts as "not passed, nothing compared" and is filled in as tensors are judged.
    passed: bool = False
    first_divergent: str | None = None
    first_divergent_block: int | None = None
    first_divergent_component: str | None = None
    nonfinite_module: str | None = None
    corrupt_tensor: str | None = None  # on-disk key of a checkpoint tensor holding NaN/Inf: the one to fetch again
    layers: list[LayerResult] = field(default_factory=list)
    gradients: list[LayerResult] = field(default_factory=list)
    parity: ParityResult | None = None
    inconclusive: str | None = None  # why nothing diverged and still no pass can be given
    patched_modules: list[str] = field(default_factory=list)  # "module: provider/kernel", as the plan installed
    candidate_compile: str = "none"  # what the candidate ran under: "blocks (inductor)", "whole (aot_eager)", "none"
    routing_undecidable: dict[int, int] = field(default_factory=dict)  # block -> tokens left out (near-tied router)
    routing_clear_flips: dict[int, int] = field(default_factory=dict)  # block -> tokens routed differently, judged
    input_redraws: int = 0  # fresh inputs drawn again because too many expert choices were undecidable
    loss_terms_left_out: int = 0  # of the gradients' loss: terms that see a token whose expert choice is undecidable
    peak_rss_bytes: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["layers"] = [r.to_dict() for r in self.layers]
        data["gradients"] = [r.to_dict() for r in self.gradients]
        data["parity"] = dataclasses.asdict(self.parity) if self.parity else None
        return data

    def summary(self, context: SummaryContext | None = None) -> StageSummary:
        """What the report shows of the alignment stage, judged by ``alignment_checks`` on the recorded limits."""
        context = context or SummaryContext()
        report = to_jsonable(self.to_dict())
        layers = [{k: t.get(k) for k in SUMMARY_TENSOR_FIELDS} for t in report["layers"]]
        gradients = [{k: g.get(k) for k in SUMMARY_TENSOR_FIELDS} for g in report["gradients"]]
        keys = ("dtype", "device", "reference_dtype", "seed", "first_divergent", "first_divergent_block",
                "first_divergent_component", "nonfinite_module", "inconclusive", "thresholds")  # fmt: skip
        data = {k: report.get(k) for k in keys}
        parity = report.get("parity")
        data |= {"layers": layers, "gradients": gradients, "parity": parity}
        data["shapes"] = {"seq_len": context.seq_len, "batch_size": context.batch_size}
        checks = alignment_checks(data, context.section("alignment"))
        failed = sum(not t["passed"] for t in layers)
        worst = max(layers, key=lambda t: num(t["rel_err"]) or 0.0, default=None)
        line = f"{len(layers) - failed}/{len(layers)} tensors within {self.dtype} limits"
        if gradients:
            line += f", {sum(bool(g['passed']) for g in gradients)}/{len(gradients)} gradients"
        if parity:
            line += f", loss parity {'ok' if parity.get('passed') else 'FAILED'} over {parity.get('steps')} steps"
        if self.nonfinite_module:
            line += f"; NaN/Inf first produced by {self.nonfinite_module}"
        elif self.first_divergent:
            line += f"; first divergent: {self.first_divergent}"
        elif worst is not None:
            line += f"; worst rel err {fmt(worst['rel_err'], '.2e')} ({worst['name']})"
        summary = StageSummary(line, data, checks)
        parity_failed = bool(parity) and not parity.get("passed")
        if not summary.passed and not (self.nonfinite_module or self.first_divergent or parity_failed):
            # every count above can read as a pass: say first why it is not one
            summary.verdict = f"not passed ({self.inconclusive or 'no tensor was judged'}); " + line
        return summary

    def verdict(self, thresholds: dict[str, Any] | None = None) -> list[Check]:
        return alignment_checks(self.summary().data, thresholds)


def reference_dtype(
    hidden_size: int, requested: str | None = None, candidate: torch.dtype = torch.bfloat16
) -> torch.dtype:
    """float64 unless asked otherwise; float32 for wide 16-bit candidates (half the memory, still 2^16 finer)."""
    if requested is not None:
        if requested not in ("fp64", "fp32"):
            raise BadInput(f"reference dtype must be fp64 or fp32, not {requested!r}")
        return torch.float64 if requested == "fp64" else torch.float32
    wide_enough = candidate.itemsize < 4 and hidden_size >= FP32_REFERENCE_FROM_WIDTH
    return torch.float32 if wide_enough else torch.float64


@contextlib.contextmanager
def float64_forward(model: torch.nn.Module) -> Iterator[None]:
    """A float64 model (the reference) runs with float64 as torch's default dtype, so that a tensor it builds from a
    Python scalar without a dtype (``torch.full((), torch.finfo(x.dtype).min)``, a mask floor) is float64 like the
    rest, not a float32 that overflows; every float32 it asks for is float64 (``Float64Reference``)."""
    param = next(model.parameters(), None)
    if param is None or param.dtype != torch.float64:
        yield
        return
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with Float64Reference():
            yield
    finally:
        torch.set_default_dtype(previous)


class Float64Reference(TorchFunctionMode):
    """What the float64 reference runs differently from the model's code, to stay float64 throughout.

    Models upcast to float32 for stability where the rest runs in 16 bits: an RMSNorm's ``x.to(torch.float32)``, a
    softmax's ``dtype=torch.float32``, rotary's ``.float()``.  In a float64 model each would round to float32 and
    leave the reference no more precise than a float32 candidate (or, as XLNet's float32 positions beside float64
    weights, fail outright): here float32 means float64.  And torch's CPU convolution has no fast float64 kernel: a
    depthwise ``conv1d`` runs group by group, about a second per call at the 8192 channels of a gated-delta-net
    layer; the same sums, one multiply-add per kernel tap, are exact to float64 rounding and take milliseconds."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("dtype") is torch.float32:
            kwargs = {**kwargs, "dtype": torch.float64}
        if func is torch.Tensor.float:
            return args[0].to(torch.float64)
        if func is torch.Tensor.to:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        if func is torch.conv1d:
            out = depthwise_conv1d_by_taps(*args, **kwargs)
            if out is not None:
                return out
        return func(*args, **kwargs)


def depthwise_conv1d_by_taps(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    stride: Any = 1,
    padding: Any = 0,
    dilation: Any = 1,
    groups: int = 1,
) -> torch.Tensor | None:
    """``conv1d`` of a batched float64 depthwise convolution with stride 1 as a sum over its taps; None for any
    other convolution (the caller runs torch's own)."""
    single = [v[0] if isinstance(v, (tuple, list)) and len(v) == 1 else v for v in (stride, padding, dilation)]
    stride, padding, dilation = single
    if padding == "valid":
        padding = 0
    depthwise = input.dim() == 3 and groups == input.shape[1] == weight.shape[0] and weight.shape[1] == 1
    plain = stride == 1 and isinstance(padding, int) and isinstance(dilation, int)
    if input.dtype != torch.float64 or not depthwise or not plain:
        return None
    padded = torch.nn.functional.pad(input, (padding, padding))
    length = padded.shape[-1] - dilation * (weight.shape[-1] - 1)
    taps = [padded[..., j * dilation : j * dilation + length] * weight[:, 0, j, None] for j in range(weight.shape[-1])]
    out = torch.stack(taps).sum(0)
    return out if bias is None else out + bias[:, None]


def peak_rss_bytes() -> int:
    """This process's peak resident set.  Linux: ``VmHWM`` of the current address space, because
    ``ru_maxrss`` also carries the parent's peak across fork+exec; elsewhere ``ru_maxrss``."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def check_device(device: str) -> None:
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise BadInput(f"unknown device {device!r}: use cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise BadInput("--device cuda requested but no CUDA device is available")


def _reference_more_precise(report: AlignmentReport) -> bool:
    reference = getattr(torch, report.reference_dtype, None)
    if not isinstance(reference, torch.dtype):
        return False
    return torch.finfo(reference).eps < torch.finfo(parse_dtype(report.dtype)).eps


# An unadapted model in a lower dtype drifts from its float64 reference by rounding: a few 1e-2 in bf16 over a deep
# stack, single MoE tensors past 0.1 on routing flips.  An error as large as the signal itself is no rounding.
UNREPRODUCED_REL_ERR = 1.0


def finish_report(report: AlignmentReport, started: float) -> None:
    """Verdict: every tensor, every gradient and the parity run must pass; name the first divergence."""
    first = next((r for r in report.layers if not r.passed), None)
    if first is None:
        first = next((r for r in report.gradients if not r.passed), None)
    if first is not None:
        report.first_divergent = first.name
        report.first_divergent_block = first.block
        report.first_divergent_component = first.component
    unreproduced = next((r for r in report.layers if not r.baseline_rel_err <= UNREPRODUCED_REL_ERR), None)
    dtype_limited = [r.name for r in report.layers if r.baseline_rel_err > report.thresholds["max_rel_err"]]
    if dtype_limited and unreproduced is None:
        report.notes.append(
            f"{len(dtype_limited)} tensors exceed the {report.dtype} rel_err limit in the unadapted model too "
            f"(a cost of the dtype, judged by err_ratio only), first: {dtype_limited[0]}"
        )
    parity_ok = report.parity is None or report.parity.passed
    report.passed = first is None and parity_ok and report.nonfinite_module is None and bool(report.layers)
    if unreproduced is not None:
        mark_inconclusive(
            report,
            f"the unadapted model does not reproduce its own reference at {unreproduced.name} (rel err "
            f"{unreproduced.baseline_rel_err:.3g}, beyond any rounding): the two runs did not compute the same "
            "function (a weight the checkpoint lacks, initialised at random on each load?), so agreement proves nothing",
        )
    if not _reference_more_precise(report):
        mark_inconclusive(
            report,
            f"the reference ran in {report.reference_dtype}, no more precise than the {report.dtype} candidate; "
            "its agreement proves nothing",
        )
    report.seconds = time.perf_counter() - started
    report.peak_rss_bytes = peak_rss_bytes()


def mark_inconclusive(report: AlignmentReport, why: str) -> None:
    """No pass can be given though nothing diverged: say why, as a field and as a note."""
    report.passed = False
    report.inconclusive = report.inconclusive or why
    report.notes.append(f"inconclusive, so not passed: {why}")
