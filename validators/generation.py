"""Generation alignment: does the adapted model generate what the original generates, token for token?

Alignment compares one forward pass; generation adds what only decoding exercises: the KV cache
(sliding windows, MLA latents, sinks, recurrent state, whatever the model keeps), left padding and
the accumulation of error over many steps.  Three instances run on the same fresh random prompts:

  reference  the unadapted model in float64 on the CPU (float32 on an accelerator), no cache;
  baseline   the unadapted model in the target dtype on the target device;
  candidate  the adapted model (kernel plan applied) in the target dtype on the target device.

The reference greedily generates ``new_tokens`` per prompt, recomputing the whole prefix each step.
Baseline and candidate are then teacher-forced along the reference's tokens, once with their cache
and once without, so every step is compared even after an undecidable tie.  While no step
mismatches, teacher forcing yields exactly the free-running greedy continuation.

Checks per step: the candidate's greedy token equals the reference's, unless the reference's top
two are closer than the dtype can resolve (an *undecidable* tie, reported, not failed); its
log-probabilities are within ``max_err_ratio`` of the baseline's error (plus the dtype's floor);
cached decode matches the uncached forward of the same model; a left-padded batch of prompts of
different lengths matches each prompt alone.  The first failing step names its position and, from
per-layer hidden states at that step, the layer responsible (``validators.generation_diagnose``).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adapt.core.errors import BadInput
from adapt.core.jsonio import to_jsonable
from adapt.core.stage_verdicts import Check, StageSummary, SummaryContext, generation_checks
from adapt.model.calls import without_cache
from validators.align import CandidateTransform, kernel_plan_transform
from validators.alignment import check_device
from validators.compare import Thresholds, parse_dtype, thresholds_for
from validators.generation_steps import (
    CacheRefused,
    Divergence,
    cached_steps,
    greedy_reference,
    logits_of,
    uncached_steps,
)
from validators.training import vocab_size

CHECKS = ("tokens", "logprobs", "cache", "batch")
# At one step, a cache that disagrees with the uncached forward explains wrong tokens and log-probs there.
ROOT_CAUSE_ORDER = ("cache", "tokens", "logprobs", "batch")
# Above this share of undecidable steps, a pass would say little: the result is inconclusive.
MAX_UNDECIDABLE_SHARE = 0.5


@dataclass
class GenerationOptions:
    prompts: int = 3
    prompt_len: int = 12  # the longest prompt; the others are shorter by 3 tokens each (batch check)
    new_tokens: int = 64
    seed: int | None = None  # None: fresh random prompts each run (the seed used is reported)
    reference_dtype: str | None = None  # "fp64" or "fp32"; None: fp64 on the CPU, fp32 on an accelerator
    batch_check: bool = True

    def __post_init__(self) -> None:
        if self.prompts < 1 or self.new_tokens < 1:
            raise BadInput("generation check needs at least 1 prompt and 1 new token")
        if self.prompt_len < 2:
            raise BadInput("--prompt-len must be at least 2")


@dataclass
class Tie:
    prompt: int
    step: int
    reference_token: int
    candidate_token: int
    gap: float  # reference log-prob of its top token minus the candidate's token's
    margin: float  # what the dtype can move two log-probs by at this step


@dataclass
class CheckResult:
    name: str
    checked: bool
    passed: bool
    steps: int = 0  # steps compared (over all prompts)
    worst_err: float = 0.0  # relative error of the centred log-probs at the worst step
    worst_allowed: float = 0.0  # the limit at that step
    note: str = ""


@dataclass
class GenerationReport:
    source: str
    dtype: str
    device: str
    reference_dtype: str
    seed: int
    prompt_lengths: list[int]
    new_tokens: int
    thresholds: dict[str, float]
    applicable: bool = True
    checks: list[CheckResult] = field(default_factory=list)
    ties: list[Tie] = field(default_factory=list)
    first_divergence: Divergence | None = None
    cache_kinds: list[str] = field(default_factory=list)
    patched_modules: list[str] = field(default_factory=list)  # "module: provider/kernel", as the plan installed
    random_weights: bool = False  # a config-only source: one random draw shared by every instance
    inconclusive: bool = False
    passed: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def outcome(self) -> str:
        if not self.applicable:
            return "not applicable"
        if self.inconclusive:
            return "inconclusive"
        return "passed" if self.passed else "failed"

    def describe(self) -> str:
        if not self.applicable:
            return "not a causal language model: nothing to generate"
        n, steps = len(self.prompt_lengths), self.new_tokens
        head = f"{n} prompts x {steps} tokens ({self.dtype} vs {self.reference_dtype})"
        if self.first_divergence is not None:
            return f"{head}: first divergence: {self.first_divergence.describe()}"
        parts = [f"{c.name} ok" if c.checked else f"{c.name} not checked" for c in self.checks]
        ties = f"; {len(self.ties)} undecidable tie(s)" if self.ties else ""
        kinds = f"; cache: {', '.join(self.cache_kinds)}" if self.cache_kinds else ""
        tail = "; inconclusive: too many undecidable steps" if self.inconclusive else ""
        return f"{head}: {', '.join(parts)}{ties}{kinds}{tail}"

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["verdict"] = self.outcome
        data["summary"] = self.describe()
        return data

    def summary(self, context: SummaryContext | None = None) -> StageSummary:
        """The generation check's own outcome and line, with the fields a report table needs."""
        result = to_jsonable(self.to_dict())
        keys = ("verdict", "dtype", "device", "reference_dtype", "seed", "prompt_lengths", "new_tokens", "checks",
                "ties", "first_divergence", "cache_kinds", "applicable")  # fmt: skip
        data = {k: result.get(k) for k in keys}
        return StageSummary(
            self.describe(), data, generation_checks(data, (context or SummaryContext()).section("generation"))
        )

    def verdict(self, thresholds: dict[str, Any] | None = None) -> list[Check]:
        return generation_checks(self.summary().data, thresholds)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenerationReport:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["checks"] = [CheckResult(**c) for c in data.get("checks", [])]
        values["ties"] = [Tie(**t) for t in data.get("ties", [])]
        if data.get("first_divergence"):
            values["first_divergence"] = Divergence(**data["first_divergence"])
        return cls(**values)


def centred_logprob_error(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per-row relative L2 error of log-probabilities with their mean removed (the constant carries nothing)."""
    ref = torch.log_softmax(reference.double(), -1)
    oth = torch.log_softmax(other.double(), -1)
    ref, oth = ref - ref.mean(-1, keepdim=True), oth - oth.mean(-1, keepdim=True)
    err = (oth - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-300)
    return torch.where(torch.isfinite(oth).all(-1), err, torch.full_like(err, float("inf")))


def max_logprob_shift(reference: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """Per-row largest change of any log-probability (nats): how far the dtype can move one token."""
    diff = (torch.log_softmax(other.double(), -1) - torch.log_softmax(reference.double(), -1)).abs()
    return diff.nan_to_num(float("inf")).amax(-1)


class StepJudge:
    """Judges one prompt's steps: tokens with tie detection, and error-ratio checks against the baseline."""

    def __init__(self, limits: Thresholds, reference: torch.Tensor, baseline: torch.Tensor, tokens: torch.Tensor):
        self.limits = limits
        self.reference = reference
        self.tokens = tokens  # the reference's greedy tokens, one per step
        self.base_err = centred_logprob_error(reference, baseline)
        self.shift = max_logprob_shift(reference, baseline)
        self.base_tokens = baseline.argmax(-1)

    def allowed(self, yardstick: torch.Tensor | None = None) -> torch.Tensor:
        base = self.base_err if yardstick is None else torch.maximum(self.base_err, yardstick)
        return self.limits.max_err_ratio * base + self.limits.rel_err_floor

    def token_mismatch(self, candidate: torch.Tensor, prompt: int, ties: list[Tie]) -> tuple[int, str] | None:
        """The first step whose greedy token is wrong and decidable; undecidable ones go to ``ties``."""
        picked = candidate.argmax(-1)
        logp = torch.log_softmax(self.reference, -1)
        for step in torch.nonzero(picked != self.tokens).flatten().tolist():
            ref_tok, cand_tok = int(self.tokens[step]), int(picked[step])
            gap = float(logp[step, ref_tok] - logp[step, cand_tok])
            margin = 2 * self.limits.max_err_ratio * float(self.shift[step])
            if gap <= margin or int(self.base_tokens[step]) != ref_tok:
                if not any(t.prompt == prompt and t.step == step for t in ties):
                    ties.append(Tie(prompt, step, ref_tok, cand_tok, gap, margin))
                continue
            return (
                step,
                f"token {cand_tok} instead of {ref_tok} (reference gap {gap:.3g} nats, dtype margin {margin:.3g})",
            )
        return None


@dataclass
class _Worst:
    """The step with the largest error-to-limit ratio seen so far in one check."""

    err: float = 0.0
    allowed: float = 0.0
    ratio: float = -1.0
    steps: int = 0

    def add(self, errors: torch.Tensor, allowed: torch.Tensor) -> int | None:
        """Record these steps' errors against their limits; return the first failing step."""
        self.steps += len(errors)
        ratios = (errors / allowed).nan_to_num(float("inf"))
        worst = int(torch.argmax(ratios))
        if float(ratios[worst]) > self.ratio:
            self.err, self.allowed, self.ratio = float(errors[worst]), float(allowed[worst]), float(ratios[worst])
        failing = torch.nonzero(~(errors <= allowed)).flatten()
        return int(failing[0]) if len(failing) else None


# ---- the check ---------------------------------------------------------------------------------


def cache_kinds(model: nn.Module) -> list[str]:
    """What the model's cache holds beyond plain full attention, read off its config and parameters."""
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if config is not None and hasattr(config, "get_text_config") else config
    kinds = set()
    for kind in getattr(text, "layer_types", None) or []:
        kinds.add(str(kind))
    if getattr(text, "sliding_window", None) and not kinds:
        kinds.add("sliding_attention")
    if getattr(text, "kv_lora_rank", None):
        kinds.add("mla latent")
    if any(name.endswith("sinks") for name, _ in model.named_parameters()):
        kinds.add("attention sinks")
    return sorted(kinds)


def _is_causal(model: nn.Module, vocab: int, device: str) -> bool:
    """The output is over the vocabulary, and changing the last token leaves earlier outputs alone."""
    ids = torch.randint(0, vocab, (1, 6), generator=torch.Generator().manual_seed(7)).to(device)
    changed = ids.clone()
    changed[0, -1] = (changed[0, -1] + 1) % vocab
    with torch.no_grad():
        first, _ = logits_of(model, input_ids=ids, **without_cache(model))  # (no cache: a probe, not a decode)
        second, _ = logits_of(model, input_ids=changed, **without_cache(model))
    if first.shape[-1] != vocab:
        return False
    # Rounding may differ (MoE groups tokens per expert), a bidirectional model's outputs move for real.
    earlier, moved = first[:, :-1].double(), second[:, :-1].double()
    return bool(((moved - earlier).abs().max() <= 1e-2 * earlier.abs().max()).item())


def _load(src, dtype: torch.dtype, device: str, notes: list[str], seed: int) -> nn.Module:
    """The model through adapt's loader; a config-only source gets the same random weights in every instance."""
    from adapt.model.skeleton import load_model

    if src.has_weights:
        return load_model(src, dtype, device, notes).eval()
    note = f"config-only source: random weights drawn once in float32 (seed {seed}) and cast for each instance"
    if note not in notes:
        notes.append(note)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = load_model(src, torch.float32, "cpu", notes)
    return model.to(device=device, dtype=dtype).eval()


def _reference_dtype(device: str, requested: str | None) -> torch.dtype:
    if requested is not None:
        if requested not in ("fp64", "fp32"):
            raise BadInput(f"reference dtype must be fp64 or fp32, not {requested!r}")
        return torch.float64 if requested == "fp64" else torch.float32
    return torch.float64 if device == "cpu" else torch.float32


@torch.no_grad()
def generation_check(
    src,
    kernel_plan: Any = None,
    dtype: str = "fp32",
    device: str = "cpu",
    thresholds: Thresholds | dict[str, float] | None = None,
    transform: CandidateTransform | None = None,
    options: GenerationOptions | None = None,
) -> GenerationReport:
    """Generate with the adapted model and the original; ``transform`` overrides ``kernel_plan`` (tests use it)."""
    started = time.perf_counter()
    parse_dtype(dtype)
    check_device(device)
    options = options or GenerationOptions()
    limits = thresholds_for(dtype, thresholds)
    notes: list[str] = []
    patched: list[str] = []
    transform = transform or kernel_plan_transform(kernel_plan, notes, patched)
    seed = options.seed if options.seed is not None else int.from_bytes(os.urandom(4), "little")
    ref_dtype = _reference_dtype(device, options.reference_dtype)
    ref_device = "cpu" if ref_dtype == torch.float64 else device
    lengths = [max(2, options.prompt_len - 3 * i) for i in range(options.prompts)]
    report = GenerationReport(
        source=src.text, dtype=dtype, device=device, reference_dtype=str(ref_dtype).removeprefix("torch."), seed=seed,
        prompt_lengths=lengths, new_tokens=options.new_tokens, thresholds=limits.to_dict(), notes=notes,
        patched_modules=patched, random_weights=not src.has_weights,
    )  # fmt: skip
    baseline = _load(src, parse_dtype(dtype), device, notes, seed)
    vocab = vocab_size(baseline)
    if not _is_causal(baseline, vocab, device):
        report.applicable, report.passed = False, True
        report.seconds = time.perf_counter() - started
        return report
    candidate = copy.deepcopy(baseline)
    if transform is not None:
        candidate = transform(candidate) or candidate
    candidate.eval()
    reference = _load(src, ref_dtype, ref_device, notes, seed)
    report.cache_kinds = cache_kinds(baseline)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    try:
        traced = [greedy_reference(reference, p.to(ref_device), options.new_tokens) for p in prompts]
    except RuntimeError as err:
        if ref_dtype != torch.float64:
            raise
        # Some operators (grouped GEMM for MoE experts) have no float64 kernel: fall back to float32.
        notes.append(f"float64 reference failed ({str(err).splitlines()[0]}); reference runs in float32")
        reference = _load(src, torch.float32, ref_device, notes, seed)
        report.reference_dtype = "float32"
        traced = [greedy_reference(reference, p.to(ref_device), options.new_tokens) for p in prompts]
    models = {"reference": reference, "baseline": baseline, "candidate": candidate}
    try:
        _run_checks(report, models, prompts, traced, limits, options, device)
    except CacheRefused as refused:  # the model cannot decode with its own cache: that is the finding
        report.passed = False
        report.first_divergence = Divergence(
            "cache", 0, 0, lengths[0], f"the model's own cached decoding raised {refused}"
        )
    report.seconds = time.perf_counter() - started
    return report


def _run_checks(report, models, prompts, traced, limits, options, device) -> None:
    n_steps, lengths = options.new_tokens, report.prompt_lengths
    baseline, candidate = models["baseline"], models["candidate"]
    worst = {name: _Worst() for name in CHECKS}
    failures: list[Divergence] = []
    judges, cand_cached = [], []
    cache_note = None
    for i, (full_ids, ref_logits) in enumerate(traced):
        full_ids = full_ids.cpu()
        n = lengths[i]
        tokens = full_ids[n : n + n_steps]
        base_cached, note = cached_steps(baseline, [full_ids], [n], n_steps, device)
        cand_cached_i, _ = cached_steps(candidate, [full_ids], [n], n_steps, device)
        cand_full = uncached_steps(candidate, full_ids, n, n_steps, device)
        base_full = uncached_steps(baseline, full_ids, n, n_steps, device)
        judge = StepJudge(limits, ref_logits, base_full if base_cached is None else base_cached[0], tokens)
        judges.append(judge)
        cand_decoded = cand_full if cand_cached_i is None else cand_cached_i[0]
        cand_cached.append(cand_decoded)
        mismatch = judge.token_mismatch(cand_decoded, i, report.ties)
        worst["tokens"].steps += n_steps
        if mismatch is not None:
            failures.append(_divergence("tokens", i, mismatch[0], n, mismatch[1]))
        for label, cand_steps in (("decoded", cand_decoded), ("uncached", cand_full)):
            errors = centred_logprob_error(ref_logits, cand_steps)
            full_judge = StepJudge(limits, ref_logits, base_full, tokens) if label == "uncached" else judge
            step = worst["logprobs"].add(errors, full_judge.allowed())
            if step is not None:
                detail = f"{label} log-prob error {float(errors[step]):.3g} > allowed {float(full_judge.allowed()[step]):.3g}"
                failures.append(_divergence("logprobs", i, step, n, detail))
        if cand_cached_i is None:
            cache_note = note
            continue
        base_gap = centred_logprob_error(base_full, base_cached[0])
        errors = centred_logprob_error(cand_full, cand_cached_i[0])
        step = worst["cache"].add(errors, judge.allowed(base_gap))
        if step is not None:
            detail = f"cached decode differs from the uncached forward: error {float(errors[step]):.3g}"
            failures.append(_divergence("cache", i, step, n, detail))
    batch_note = None
    if options.batch_check and len(prompts) > 1 and cache_note is None:
        batch, batch_note = cached_steps(candidate, [t[0].cpu() for t in traced], lengths, n_steps, device)
        for i, judge in enumerate(judges):
            errors = centred_logprob_error(cand_cached[i], batch[i])
            step = worst["batch"].add(errors, judge.allowed())
            mismatch = judge.token_mismatch(batch[i], i, report.ties)
            if step is not None:
                failures.append(
                    _divergence(
                        "batch",
                        i,
                        step,
                        lengths[i],
                        f"left-padded row differs from the prompt alone: error {float(errors[step]):.3g}",
                    )
                )
            if mismatch is not None:
                failures.append(_divergence("batch", i, mismatch[0], lengths[i], f"left-padded row: {mismatch[1]}"))
    checked = {"tokens": True, "logprobs": True, "cache": cache_note is None,
               "batch": options.batch_check and len(prompts) > 1 and cache_note is None}  # fmt: skip
    failed = {d.check for d in failures}
    notes = {
        "cache": cache_note or "",
        "batch": batch_note or ("needs 2+ prompts and a cache" if not checked["batch"] else ""),
    }
    for name in CHECKS:
        w = worst[name]
        report.checks.append(
            CheckResult(
                name,
                checked[name],
                checked[name] and name not in failed,
                w.steps,
                w.err,
                w.allowed,
                notes.get(name, ""),
            )
        )
    if failures:
        first = min(failures, key=lambda d: (d.step, ROOT_CAUSE_ORDER.index(d.check), d.prompt))
        from validators.generation_diagnose import name_layer

        name_layer(first, models, traced, lengths, limits, device)
        report.first_divergence = first
    total = len(prompts) * n_steps
    report.inconclusive = (
        not failures and len({(t.prompt, t.step) for t in report.ties}) > MAX_UNDECIDABLE_SHARE * total
    )
    report.passed = not failures and not report.inconclusive and all(c.passed for c in report.checks if c.checked)


def _divergence(check: str, prompt: int, step: int, prompt_len: int, detail: str) -> Divergence:
    return Divergence(check=check, prompt=prompt, step=step, position=prompt_len + step, detail=detail)
