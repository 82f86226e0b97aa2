"""Fixtures that build the test models and run worker groups under torchrun (gloo, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

WORKERS = Path(__file__).with_name("dist_workers.py")
REPO = Path(__file__).resolve().parents[2]

# Variants beyond the zoo: a 4-block llama for interleaved pipelines, an MHA llama for dense TP.
VARIANTS = {
    "llama4": ("llama", {"num_hidden_layers": 4}),
    "llama_mha": ("llama", {"num_key_value_heads": 4}),
}


def _build_variant(base: str, overrides: dict, out: Path) -> Path:
    from transformers import AutoModelForCausalLM

    from adapt.model.zoo import make_config

    config = make_config(base)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(1)
    AutoModelForCausalLM.from_config(config).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def dist_models(zoo, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("dist_models")
    models = {name: str(zoo(name)) for name in ("llama", "qwen3", "qwen3_moe", "mixtral", "custom")}
    for name, (base, overrides) in VARIANTS.items():
        models[name] = str(_build_variant(base, overrides, root / name))
    path = root / "models.json"
    path.write_text(json.dumps(models))
    return path


def run_workers(nproc: int, cases: list[str], models: Path, out: Path, timeout: int = 300) -> dict[str, dict]:
    """Run ``cases`` in one torchrun group of ``nproc`` gloo processes; return each case's result."""
    out.mkdir(parents=True, exist_ok=True)
    for case in cases:  # poison: a stale result must never be read as this run's
        (out / f"{case}.pt").unlink(missing_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "TRANSFORMERS_VERBOSITY": "error",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(WORKERS),
    ]
    proc = subprocess.run(
        [*cmd, str(out), str(models), *cases],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode:
        raise AssertionError(f"worker group failed (rc={proc.returncode}):\n{proc.stderr[-6000:]}")
    return {case: torch.load(out / f"{case}.pt", weights_only=False) for case in cases}


@pytest.fixture(scope="session")
def run_group():
    return run_workers


MISC_TWO_RANK = ["dcp_fsdp_to_tp", "dcp_ep_to_fsdp", "cp_plumbing"]


@pytest.fixture(scope="session")
def misc_two_rank(dist_models, tmp_path_factory) -> dict[str, dict]:
    """Checkpoint round trips and context-parallel plumbing share one 2-rank group."""
    return run_workers(2, MISC_TWO_RANK, dist_models, tmp_path_factory.mktemp("misc"))
