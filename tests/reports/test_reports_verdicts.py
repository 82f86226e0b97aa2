"""One verdict for ``adapt run`` and ``adapt gate``: every stage's result type judges its own summary with the rule in
``adapt.core.stage_verdicts``, and the gate re-judges report.json's summaries with that same rule."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import pytest
import torch

from adapt.core.source import resolve_source
from adapt.core.spec import ModelSpec
from adapt.core.stage_verdicts import STAGE_CHECKS, SummaryContext, judged
from adapt.core.verdicts import STAGE_DECODE_MINIMA, decode_targets, gradient_thresholds
from operators.ops_report import OpsReport
from parallel_planner.replan import CalibratedPlan
from parallel_planner.result import PlannerResult
from reports.judge import load_thresholds, rejudge
from reports.schema import build_report, stage
from validators.alignment import AlignmentReport, ParityResult, finish_report, mark_inconclusive
from validators.compare import judge, thresholds_for
from validators.environment import EnvReport
from validators.generation import GenerationReport
from validators.soak import SoakOptions, SoakStep, _verdict
from validators.throughput import BenchOptions, ThroughputReport, VariantResult, measured_verdict

SECTIONED = ("alignment", "operators", "throughput", "soak")  # the stages a thresholds file can set limits for


def _tensors(rng: random.Random, n: int, clean: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A reference and two copies off it by fresh amounts (the candidate sometimes not finite); ``clean``: the
    candidate off by less than the unadapted copy, within every dtype's limits."""
    ref = torch.randn(n, dtype=torch.float64) * rng.choice([1e-6, 1.0, 30.0])
    errors = [1e-7] if clean else [0.0, 1e-7, 1e-4, 1e-3, 0.3]
    cand = ref + torch.randn(n, dtype=torch.float64) * ref.norm() / n**0.5 * rng.choice(errors)
    base = ref + torch.randn(n, dtype=torch.float64) * ref.norm() / n**0.5 * rng.choice(
        [1e-6] if clean else [0.0, 1e-7, 1e-4, 0.3]
    )
    if not clean and rng.random() < 0.05:
        cand[rng.randrange(n)] = float("inf")
    return ref, cand, base


def _alignment(rng: random.Random, clean: bool = False) -> AlignmentReport:
    """Judged as the validator judges: ``compare.judge`` per tensor, ``finish_report`` for the verdict."""
    dtype = rng.choice(["fp32", "bf16", "fp16"])
    limits = thresholds_for(dtype)
    report = AlignmentReport("x", dtype, "cpu", "float64", False, rng.randrange(2**31), limits.to_dict())
    for i in range(rng.choice([4, 6] if clean else [0, 1, 4, 6])):
        report.layers.append(judge(f"model.layers.{i}", i, None, *_tensors(rng, 64, clean), limits))
    for i in range(rng.randint(0, 5)):
        ref, cand, base = _tensors(rng, 32, clean)
        floor = rng.choice([0.0, 2 * float(ref.norm())])  # a vanishing gradient: cosine not judged
        report.gradients.append(judge(f"w{i}", i, None, ref, cand, base, gradient_thresholds(limits), floor))
    if rng.random() < 0.5:
        report.parity = ParityResult(4, [1.0] * 4, [1.0] * 4, 0.0, 1e-4, clean or rng.random() < 0.8)
    if not clean and rng.random() < 0.1:
        report.nonfinite_module = "model.layers.0.mlp"
    finish_report(report, time.perf_counter())
    if not clean and rng.random() < 0.15:
        mark_inconclusive(report, "routing undecidable")
    return report


def _throughput(rng: random.Random) -> ThroughputReport:
    """Rates around the best baseline's, on a CPU or a GPU, judged by the validator's ``measured_verdict``."""
    device = rng.choice(["cpu", "cuda"])
    best = rng.uniform(1e3, 1e5)
    names = ["eager", *(["compiled"] if rng.random() < 0.6 else []), "adapted"]
    variants = [
        VariantResult(name, 0.1, 0.0 if rng.random() < 0.05 else best * rng.uniform(0.9, 1.1), rng.uniform(0, 0.5),
                      best * rng.uniform(0.9, 1.1), best * rng.uniform(0.9, 1.1), True, rng.randrange(2**30),
                      [rng.uniform(1, 5), float("nan") if rng.random() < 0.05 else 2.0],
                      rng.choice([None, 0.01, 0.2]), idle, idle > 0.3)
        for name in names
        for idle in [rng.uniform(0, 0.5)]
    ]  # fmt: skip
    decode = []
    if device == "cuda" and rng.random() < 0.7:
        for batch in (1, 8):
            static = rng.uniform(100, 2000) * batch
            rates = {"hf-static-compile": static, "adapted": static * rng.uniform(0.9, 1.3)}
            rates["hf-eager"] = rates["adapted"] / rng.uniform(0.8, 3)
            decode += [{"variant": v, "batch": batch, "decode_tokens_per_s": r, "gpu_idle_share": 0.1}
                       for v, r in rates.items()]  # fmt: skip
    options = BenchOptions(dtype="bf16", seq_len=64, batch=2, steps=3)
    outcome, reasons = measured_verdict(variants, device, options, decode)
    return ThroughputReport(
        "x", device, device, "bf16", 64, 2, 2, 2, False, 1e6, None, "none", variants, {}, outcome != "failed",
        outcome=outcome, reasons=reasons, decode=decode,
        decode_targets=decode_targets(decode, device == "cuda", STAGE_DECODE_MINIMA),
    )  # fmt: skip


def _soak(rng: random.Random, clean: bool = False) -> object:
    growth = [0] if clean else [0, 2**19, 2**23]  # bytes a step
    steps = [
        SoakStep(s, rng.uniform(1, 5), 1.0, rng.uniform(0.09, 0.11), 2**20 + s * rng.choice(growth), None)
        for s in range(1, rng.randint(8, 16) if clean else rng.randint(3, 16))
    ]
    if not clean and rng.random() < 0.1:
        steps[-1].loss = float("nan")
    src = resolve_source("examples/tiny-llama")
    return _verdict(src, "cpu", SoakOptions(steps=len(steps), seed=1), None, [], steps, [], [], "cpu")


def _operators(rng: random.Random, fixture: dict, clean: bool = False) -> OpsReport:
    """A real run's operators result with fresh op statuses (some unsupported or unmapped unless ``clean``)."""
    ops = OpsReport.from_dict(stage(fixture, "operators")["result"])
    for op in ops.plan.ops:
        op.status = rng.choices(
            ["fused", "native", "unsupported", "unknown-status"], [10, 10, 0 if clean else 1, 0 if clean else 1]
        )[0]
    ops.patch_check.passed = clean or rng.random() < 0.8
    return ops


def fresh_results(rng: random.Random, fixture: dict) -> dict[str, object]:
    """Every stage's typed result from fresh random draws (intake, operators and plans from a real run's, altered)."""
    spec = ModelSpec.from_dict(stage(fixture, "intake")["result"])
    spec.checkpoint.missing = rng.sample(["lm_head.weight", "model.norm.weight"], rng.choice([0, 0, 1, 2]))
    ops = _operators(rng, fixture)
    plan = PlannerResult.from_dict(stage(fixture, "plan")["result"])
    plan.plans[0].fits = rng.random() < 0.8
    plan.plans = plan.plans if rng.random() < 0.9 else []
    problems = rng.sample(["no CUDA", "old driver"], rng.choice([0, 0, 1]))
    env = EnvReport({}, "cpu", [], None, rng.uniform(0.1, 1), "float32", None, problems)
    applicable, inconclusive = rng.random() < 0.8, rng.random() < 0.2
    passed = not applicable or (not inconclusive and rng.random() < 0.7)
    generation = GenerationReport("x", "fp32", "cpu", "float64", 1, [8], 4, {}, applicable, inconclusive=inconclusive,
                                  passed=passed)  # fmt: skip
    return {
        "intake": spec,
        "operators": ops,
        "plan": plan,
        "environment": env,
        "alignment": _alignment(rng),
        "generation": generation,
        "throughput": _throughput(rng),
        "replan": CalibratedPlan.from_dict(stage(fixture, "replan")["result"]),
        "soak": _soak(rng),
    }


def _gate(tmp_path, report: dict, thresholds: str) -> dict[str, bool]:
    """Each stage's pass flag as ``adapt gate`` judges ``report`` with this thresholds file."""
    (tmp_path / "t.yaml").write_text(thresholds)
    result = rejudge(json.loads(json.dumps(report)), load_thresholds(tmp_path / "t.yaml"))
    return {name: all(c.passed for c in result.checks if c.stage.split(".")[0] == name) for name in STAGE_CHECKS}


def test_the_run_and_the_gate_give_every_stage_the_same_verdict(tmp_path, rng, report):
    context = SummaryContext(cluster="8xH100", seq_len=64, batch_size=2)
    for _ in range(6):
        results = fresh_results(rng, report)
        summaries = {name: result.summary(context) for name, result in results.items()}
        for name in ("alignment", "environment", "soak", "generation"):  # the validator's own flag is the verdict's
            assert summaries[name].passed == results[name].passed, name
        assert summaries["throughput"].passed == (results["throughput"].outcome != "failed")
        for name, result in results.items():  # the same checks, whatever run facts the summary states
            assert [(c.name, c.passed) for c in result.verdict()] == [
                (c.name, c.passed) for c in summaries[name].checks
            ]
        records = [
            {"name": n, "status": "passed" if s.passed else "failed", "verdict": s.verdict, "summary": s.data}
            for n, s in summaries.items()
        ]
        built = build_report(records, {}, {"text": "x"})
        expected = {name: s.passed for name, s in summaries.items()}
        assert _gate(tmp_path, built, "") == expected  # recorded statuses
        assert _gate(tmp_path, built, "".join(f"{s}: {{}}\n" for s in SECTIONED)) == expected  # re-judged, defaults


def test_soak_and_environment_flags_come_from_their_rule_and_stay_in_report_json(rng):
    """The validators build the report; its ``passed`` (a field report.json's readers still find) is the rule's."""
    outcomes = set()
    for _ in range(12):
        soak = _soak(rng)
        env = EnvReport({}, "cpu", [], None, rng.uniform(0.1, 1), "float32", None, [])
        if rng.random() < 0.5:
            env.problems.append("old driver")  # a problem found after the report was built still counts
        for name, result in (("soak", soak), ("environment", env)):
            stored = result.to_dict()
            assert set(stored) == {f.name for f in dataclasses.fields(result)} | {"passed"}
            assert stored["passed"] == result.passed == judged(STAGE_CHECKS[name](result.summary().data, None))
            outcomes.add((name, result.passed))
    assert ("environment", False) in outcomes and ("environment", True) in outcomes


def _failed(rule, data: dict, section: dict) -> list[str]:
    return [c.name for c in rule(data, section) if not c.passed]


def test_one_limit_in_a_thresholds_section_flips_exactly_its_check(rng, report):
    result = _operators(rng, report, clean=True)
    strict = SummaryContext(thresholds={"operators": {"min_fast_flop_share": 1.01}})  # `adapt run --thresholds`
    assert result.summary().passed and not result.summary(strict).passed
    assert [c.name for c in result.summary(strict).checks if not c.passed] == ["fast_flop_share"]
    ops = result.summary().data
    rule = STAGE_CHECKS["operators"]
    assert _failed(rule, ops, {}) == []
    ops["fast_flop_share"] = share = rng.uniform(0.3, 0.95)
    assert _failed(rule, ops, {}) == []  # the run sets no minimum share
    assert _failed(rule, ops, {"min_fast_flop_share": share + 1e-3}) == ["fast_flop_share"]
    assert _failed(rule, ops, {"min_fast_flop_share": share}) == []
    unmapped = rng.randint(1, 5)
    ops["coverage"]["unmapped"] = unmapped
    assert _failed(rule, ops, {}) == ["unmapped"]  # the run's limit: none unmapped
    assert _failed(rule, ops, {"max_unmapped": unmapped}) == []

    soak = _soak(rng, clean=True).summary().data
    soak["step_time_cv"] = cv = rng.uniform(0.01, 0.5)
    assert _failed(STAGE_CHECKS["soak"], soak, {}) == []  # the run judges no step-time spread
    assert _failed(STAGE_CHECKS["soak"], soak, {"max_step_time_cv": cv * 0.99}) == ["step_time_cv"]
    soak["leak"] = True
    assert _failed(STAGE_CHECKS["soak"], soak, {}) == ["memory_leak"]
    assert _failed(STAGE_CHECKS["soak"], soak, {"allow_leak": True}) == []

    align = _alignment(rng, clean=True).summary().data
    assert _failed(STAGE_CHECKS["alignment"], align, {}) == []
    worst = max(align["layers"], key=lambda t: t["rel_err"])
    limit = worst["rel_err"] * rng.uniform(0.5, 0.99)
    failed = _failed(STAGE_CHECKS["alignment"], align, {"max_rel_err": limit, "allow_dtype_cost": False})
    assert worst["name"] in failed
    assert set(failed) <= {t["name"] for t in align["layers"] + align["gradients"]}  # tensors only


@pytest.mark.parametrize("key", ["eager", "static_compile"])
def test_a_decode_minimum_flips_only_its_own_targets(rng, key):
    decode = []
    for batch in (1, 8):
        rates = {"hf-static-compile": rng.uniform(100, 2000), "hf-eager": rng.uniform(100, 500)}
        rates["adapted"] = max(rates.values()) * rng.uniform(1.05, 1.5)
        decode += [{"variant": v, "batch": batch, "decode_tokens_per_s": r} for v, r in rates.items()]
    targets = decode_targets(decode, True, STAGE_DECODE_MINIMA)
    data = {"device": "cuda", "decode": decode, "decode_targets": targets, "vs_best_baseline": {}, "finite": True}
    rule = STAGE_CHECKS["throughput"]
    assert _failed(rule, data, {}) == []
    lowest = min(t[f"vs_{key}"] for t in targets)
    name = next(n for n in STAGE_DECODE_MINIMA if n.endswith(key.replace("_", "-")))
    failed = _failed(rule, data, {f"min_decode_vs_{key}": lowest * 1.01})
    assert failed and all(f.endswith(f"vs {name}") for f in failed)
