"""``benchmarks/e2e.py --tiny``: the one-call benchmark runs end to end on the CPU, in its own processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_tiny_run_trains_each_variant_on_the_same_weights_and_data(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO)}
    cmd = [
        sys.executable,
        str(REPO / "benchmarks" / "e2e.py"),
        "--out",
        str(tmp_path),
        "--tiny",
        "--models",
        "llama-1b",
        "--variants",
        "eager,adapt,adapt-selective-loss1g",
        "--ops-light",
        "--steps",
        "1",
        "--budget-s",
        "850",
        "--variant-timeout-s",
        "400",
    ]
    done = subprocess.run(cmd, check=False, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    report = json.loads((tmp_path / "e2e-cpu-tiny.json").read_text())
    entry = report["models"]["llama-1b"]
    assert entry["ops-cold"]["ok"] and entry["ops-cold"]["compile"]["mode"] == "none"  # CPU: the plan runs eager
    eager, adapt = entry["variants"]["eager"], entry["variants"]["adapt"]
    assert eager["ok"] and adapt["ok"], (eager, adapt)
    assert adapt["patched"] > 0 and adapt["compile_mode"] == "none"
    assert adapt["kernel_ops"] == "opaque"  # the interpreter's kernels are always custom_op
    for variant in (eager, adapt):
        assert variant["tokens_per_s"] > 0 and variant["steps_timed"] == 1 and len(variant["losses"]) == 2
    # same checkpoint, same batches: the first loss agrees within bf16 rounding
    assert abs(eager["losses"][0] - adapt["losses"][0]) < 0.05 * abs(eager["losses"][0])
    assert "| llama-1b | adapt |" in (tmp_path / "e2e-cpu-tiny.md").read_text()
    lean = entry["variants"]["adapt-selective-loss1g"]
    assert lean["ok"] and lean["recompute"] == "selective" and lean["loss_chunk_budget_bytes"] == 2**30, lean
    # recomputation reruns the same arithmetic: the losses are the adapted model's own
    assert lean["losses"] == pytest.approx(adapt["losses"], rel=1e-3)


def test_inductor_ops_variant_is_adapt_adamw_with_triton_ops_in_its_process():
    from benchmarks.e2e import VARIANTS
    from benchmarks.e2e_worker import ADAPT_OPTIMIZER_VARIANTS, ADAPT_VARIANTS, VARIANT_ENV

    assert VARIANT_ENV == {"adapt-inductor-ops": {"ADAPT_KERNEL_OPS": "inductor"}}
    assert "adapt-inductor-ops" in set(VARIANTS) & set(ADAPT_OPTIMIZER_VARIANTS)
    assert ADAPT_VARIANTS["adapt-inductor-ops"] == ADAPT_VARIANTS["adapt-adamw"]


def test_unknown_variant_is_refused_with_one_line(tmp_path):
    cmd = [sys.executable, str(REPO / "benchmarks" / "e2e.py"), "--out", str(tmp_path), "--tiny", "--variants", "nope"]
    done = subprocess.run(
        cmd, check=False, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "unknown model or variant 'nope'" in done.stderr and "Traceback" not in done.stderr


def _verdicts(report: dict) -> dict[str, str]:
    from benchmarks.e2e import loss_tracking_lines

    lines = [line.strip() for line in loss_tracking_lines(report) if line.startswith("  - ")]
    return {line[2:].split(":")[0]: line.rsplit(": ", 1)[1] for line in lines}


def test_loss_tracking_flags_a_variant_that_drifts_beyond_one_bf16_step():
    import random

    from benchmarks.e2e import BF16_EPS

    eager = [random.uniform(9.0, 12.0) for _ in range(20)]
    close = [x + random.uniform(-1, 1) * BF16_EPS * 8.0 for x in eager]  # inside one bf16 step of a loss >= 9
    drifted = list(eager)
    drifted[random.randrange(20)] += 13.0 * BF16_EPS * 2  # beyond it at any loss here
    report = {
        "models": {"m": {"variants": {"eager": {"losses": eager}, "a": {"losses": close}, "b": {"losses": drifted}}}}
    }
    assert _verdicts(report) == {"a": "tracks eager", "b": "BEYOND the noise"}


def test_loss_tracking_takes_a_trusted_baselines_drift_as_the_noise():
    import random

    from benchmarks.e2e import BF16_EPS

    eager = [random.uniform(9.0, 12.0) for _ in range(50)]
    wide = 12.0 * BF16_EPS * 4  # four bf16 steps at the largest loss
    compiled = [x + wide for x in eager]  # torch.compile drifted this far: that is the noise of these steps
    inside = [x - 0.9 * wide for x in eager]
    outside = [x + 1.2 * wide for x in eager]
    variants = {"eager": {"losses": eager}, "compile": {"losses": compiled}, "a": {"losses": inside}}
    variants["b"] = {"losses": outside}
    assert _verdicts({"models": {"m": {"variants": variants}}}) == {
        "compile": "BEYOND the noise",  # judged by the others: alone, it has only the rounding step
        "a": "tracks eager",
        "b": "BEYOND the noise",
    }
    variants["compile"] = {"losses": compiled[:10]}  # compile ran 10 steps: it says nothing of the 50
    assert _verdicts({"models": {"m": {"variants": variants}}})["a"] == "BEYOND the noise"
    del variants["compile"]  # without it only one bf16 step is allowed
    assert _verdicts({"models": {"m": {"variants": variants}}}) == {"a": "BEYOND the noise", "b": "BEYOND the noise"}
    variants["a"] = {"losses": inside[:8]}  # judged over the steps it ran
    variants["compile"] = {"losses": compiled[:8]}
    assert _verdicts({"models": {"m": {"variants": variants}}})["a"] == "tracks eager"


def test_a_second_eager_run_sets_the_noise_of_a_run_to_run_nondeterministic_model():
    """Two eager processes of a model with atomics (MoE routing) drift apart: that drift is the noise a variant is
    judged against, where it is wider than a reordering baseline's."""
    import random

    from benchmarks.e2e import BF16_EPS

    eager = [random.uniform(5.0, 8.0) for _ in range(50)]
    wide = 8.0 * BF16_EPS * 20
    again = [x + wide for x in eager]
    compiled = [x - 0.3 * wide for x in eager]
    adapted = [x + 0.8 * wide for x in eager]
    variants = {"eager": {"losses": eager}, "eager-again": {"losses": again}, "compile": {"losses": compiled}}
    variants["adapt"] = {"losses": adapted}
    assert _verdicts({"models": {"m": {"variants": variants}}})["adapt"] == "tracks eager"
    del variants["eager-again"]
    assert _verdicts({"models": {"m": {"variants": variants}}})["adapt"] == "BEYOND the noise"
