"""Soak: a SIGKILLed run resumes from its last checkpoint and reproduces the loss trajectory exactly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import torch

from adapt.model.intake import resolve_source
from validators.modules import find_blocks
from validators.soak import soak

STEPS, EVERY = 40, 8


def _cmd(src, ckpt, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "adapt.app.cli",
        "soak",
        str(src),
        "--steps",
        str(STEPS),
        "--ckpt-every",
        str(EVERY),
        "--ckpt-dir",
        str(ckpt),
        "--dtype",
        "fp32",
        "--seq",
        "64",
        "--batch",
        "4",
        "--no-kernels",
        "--json",
        *extra,
    ]


def _run(cmd) -> dict:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def test_sigkill_mid_soak_resumes_and_reproduces_the_trajectory(zoo, tmp_path):
    src = zoo("llama")
    uninterrupted = _run(_cmd(src, tmp_path / "full"))
    assert uninterrupted["passed"] and uninterrupted["steps_done"] == STEPS
    assert uninterrupted["checkpoints"] == list(range(EVERY, STEPS + 1, EVERY))

    killed_dir = tmp_path / "killed"
    history = killed_dir / "history.jsonl"
    seed = str(uninterrupted["seed"])  # the killed run trains the same data; its resume finds the seed stored
    proc = subprocess.Popen(_cmd(src, killed_dir, "--seed", seed), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if history.is_file() and len(history.read_text().splitlines()) >= 2 * EVERY + EVERY // 2:
            break
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL, "the soak finished before it could be killed"
    done_before_kill = len(history.read_text().splitlines())
    assert done_before_kill < STEPS

    other = str(uninterrupted["seed"] ^ 1)
    refused = subprocess.run(_cmd(src, killed_dir, "--seed", other), capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and f"seed {seed}" in refused.stderr  # another seed would train other data
    resumed = _run(_cmd(src, killed_dir))
    assert resumed["resumed_from"] is not None and 0 < resumed["resumed_from"] <= done_before_kill
    assert resumed["resumed_from"] % EVERY == 0
    assert len(resumed["steps"]) == STEPS - resumed["resumed_from"]
    assert resumed["seed"] == uninterrupted["seed"]
    assert resumed["losses"] == uninterrupted["losses"]  # bit-for-bit, deterministic mode
    assert resumed["passed"]


def _leaky(per_step_bytes: int):
    """A transform whose first block keeps a reference to fresh memory on every forward (a real leak)."""
    kept: list[torch.Tensor] = []

    def transform(model):
        block = find_blocks(model).blocks[0]
        block.register_forward_hook(lambda *_: kept.append(torch.ones(per_step_bytes // 4)) and None)
        return model

    return transform


def test_leak_verdict_separates_a_leaking_run_from_a_healthy_one(zoo):
    src = resolve_source(str(zoo("llama")))
    healthy = soak(src, steps=30, dtype="fp32", seq_len=32, deterministic=False)
    assert healthy.passed and not healthy.leak
    assert healthy.step_time_cv is not None and healthy.memory_slope_bytes_per_step is not None
    leaking = soak(src, steps=30, dtype="fp32", seq_len=32, deterministic=False, transform=_leaky(8 << 20))
    assert leaking.leak and not leaking.passed
    assert leaking.memory_slope_bytes_per_step > 4 << 20


def test_soak_rejects_bad_arguments(zoo, tmp_path):
    from adapt.app.cli import main

    assert main(["soak", str(zoo("llama")), "--steps", "0"]) == 2
    assert main(["soak", str(zoo("llama")), "--steps", "3", "--ckpt-every", "2"]) == 2  # no --ckpt-dir
    assert main(["soak", str(tmp_path / "missing"), "--steps", "3"]) == 2
    assert os.environ.get("ADAPT_DEBUG") is None


def test_a_history_torn_by_a_kill_mid_append_reads_back_to_the_resume_step(tmp_path):
    """A kill while appending leaves half a line: resuming must drop it with the steps past the checkpoint."""
    from validators.soak import CheckpointStore

    store = CheckpointStore(str(tmp_path))
    lines = [json.dumps({"step": s, "loss": 5.0 - s / 10}) for s in range(1, 6)]
    store.history.write_text("\n".join(lines) + '\n{"step": 6, "lo')
    kept = store.read_history(before=4)
    assert [r["step"] for r in kept] == [1, 2, 3]
    assert store.history.read_text().splitlines() == lines[:3]
