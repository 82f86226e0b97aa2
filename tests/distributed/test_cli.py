"""``adapt train`` and ``adapt launch`` end to end, and their bad-input paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _adapt(*args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("RANK", None)
    return subprocess.run(
        [sys.executable, "-m", "adapt", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _plan(tmp_path: Path, **fields) -> str:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({"precision": "fp32", "seq_len": 16, "global_batch": 4, **fields}))
    return str(path)


@pytest.mark.distributed
def test_train_resumes_from_its_checkpoint_and_exports(zoo, tmp_path):
    plan, ckpt, export = _plan(tmp_path), tmp_path / "ckpt", tmp_path / "hf"
    first = _adapt(
        "train",
        str(zoo("llama")),
        "--plan",
        plan,
        "--steps",
        "2",
        "--ckpt",
        str(ckpt),
        "--metrics",
        str(tmp_path / "a.jsonl"),
    )
    assert first.returncode == 0, first.stderr[-3000:]
    assert (ckpt / ".metadata").is_file()
    second = _adapt(
        "train", str(zoo("llama")), "--plan", plan, "--steps", "4", "--ckpt", str(ckpt),
        "--metrics", str(tmp_path / "b.jsonl"), "--export-hf", str(export),
    )  # fmt: skip
    assert second.returncode == 0, second.stderr[-3000:]
    steps = [json.loads(line) for line in (tmp_path / "b.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [2, 3]  # resumed, not restarted
    for s in steps:
        assert s["loss"] > 0 and s["grad_norm"] > 0 and s["tokens_per_s"] > 0 and s["peak_memory_gib"] > 0
    assert "loss" in second.stdout and (export / "model.safetensors").is_file()


@pytest.mark.distributed
def test_launch_executes_a_two_process_plan(zoo, tmp_path):
    plan = _plan(tmp_path, dp_shard=2)
    printed = _adapt("launch", str(zoo("llama")), "--plan", plan, "--steps", "2")
    assert (
        printed.returncode == 0 and "torch.distributed.run" in printed.stdout and "--nproc-per-node=2" in printed.stdout
    )
    ran = _adapt("launch", str(zoo("llama")), "--plan", plan, "--steps", "2", "--execute")
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.count("loss") == 2  # rank 0 reports each step once


def test_bad_inputs_exit_2_with_one_line(zoo, tmp_path):
    missing = _adapt("train", str(zoo("llama")), "--plan", str(tmp_path / "nope.json"))
    assert missing.returncode == 2 and "plan file not found" in missing.stderr and "Traceback" not in missing.stderr
    needs_torchrun = _adapt("train", str(zoo("llama")), "--plan", _plan(tmp_path, tp=2))
    assert needs_torchrun.returncode == 2 and "adapt launch" in needs_torchrun.stderr
    nodes = _adapt("launch", str(zoo("llama")), "--plan", _plan(tmp_path, tp=2), "--nnodes", "2")
    assert nodes.returncode == 2 and "rdzv-endpoint" in nodes.stderr


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("[1]", "a plan is a JSON object, not a list"),
        ('{"plans": []}', "'plans' holds no ranked plan"),
        ('{"plans": [{"layout": {"tp": 2}}]}', "no plan field among layout"),
        ('{"tp": 0}', "the plan is inconsistent: tp must be >= 1"),
        ('{"tp": true}', "tp is True; allowed: an integer"),
        ('{"recompute": "partial"}', "recompute is 'partial'; allowed: none, selective, full"),
        ("{not json", "not a plan JSON"),
    ],
)
def test_a_plan_file_that_is_not_a_usable_plan_is_refused(content, fragment, tmp_path):
    """A plan file is the user's input: nothing in it may fall back to defaults or reach a traceback."""
    from adapt.core.errors import BadInput
    from parallel_planner.plan import ParallelPlan

    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(BadInput) as refused:
        ParallelPlan.load(str(path))
    assert str(refused.value).startswith(f"{path}: {fragment}")
