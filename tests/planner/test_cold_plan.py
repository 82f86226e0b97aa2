"""A cold ``adapt plan`` leaves torch to its spec worker, and the worker imports nothing it does not need.

Most of a cold plan is start-up: importing torch and transformers' modelling code in the worker while the
planning process, which never imports torch, sets up the planner.  These tests fail when an import puts
torch into the planning process or a heavy package (ONNX, plotting, data frames, adapt's upper layers)
into describing a model.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

# Nothing describing a model needs; each costs start-up in every cold plan.
WORKER_NEVER_IMPORTS = (
    "onnx",
    "onnxscript",
    "matplotlib",
    "pandas",
    "scipy",
    "operators",
    "validators",
    "reports",
    "adapt.runtime",
    "adapt.app",
)

PLANNER_PROBE = """import json, sys
from adapt.app.cli import main
code = main(sys.argv[2:])
print(json.dumps({"code": code, "heavy": sorted(m for m in ("torch", "transformers") if m in sys.modules)}),
      file=open(sys.argv[1], "w"))
"""

WORKER_PROBE = """import json, sys
from adapt.core.source import resolve_source
from parallel_planner.spec_worker import describe
spec = describe(resolve_source(sys.argv[2], config_only=True), 128)
never = json.loads(sys.argv[3])
heavy = sorted({m for m in sys.modules for n in never if m == n or m.startswith(n + ".")})
print(json.dumps({"layers": spec.num_layers, "heavy": heavy}), file=open(sys.argv[1], "w"))
"""


def _tiny_deepseek_v3(path: Path, rng: random.Random) -> int:
    """A config-only MoE + MLA checkpoint of random depth, the shape of the giant the planner is timed on."""
    layers = rng.randint(2, 5)
    config = {
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": layers,
        "first_k_dense_replace": rng.randint(0, 1),
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_routed_experts": rng.choice([4, 8]),
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "n_group": 2,
        "topk_group": 1,
        "q_lora_rank": 32,
        "kv_lora_rank": 16,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8,
        "v_head_dim": 8,
        "max_position_embeddings": 256,
    }
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return layers


def test_cold_plan_keeps_torch_in_the_worker_and_the_worker_lean(tmp_path, rng):
    layers = _tiny_deepseek_v3(tmp_path / "model", rng)
    model = str(tmp_path / "model")
    argv = ["plan", model, "--config-only", "--gpu", "h100", "--gpus", "8", "--seq", "128", "--global-batch", "16",
            "--json", "--no-cache"]  # fmt: skip
    env = dict(os.environ, ADAPT_CACHE_DIR=str(tmp_path / "cache"))
    planner, worker = tmp_path / "planner.json", tmp_path / "worker.json"
    runs = [  # two interpreters at once: each pays torch's start-up
        subprocess.Popen([sys.executable, "-c", PLANNER_PROBE, str(planner), *argv], env=env, stdout=subprocess.PIPE),
        subprocess.Popen(
            [sys.executable, "-c", WORKER_PROBE, str(worker), model, json.dumps(WORKER_NEVER_IMPORTS)],
            env=env,
            stdout=subprocess.PIPE,
        ),
    ]
    outputs = [run.communicate()[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0]
    planned = json.loads(planner.read_text())
    assert planned == {"code": 0, "heavy": []}  # the spec came from the worker; torch never loaded here
    assert json.loads(outputs[0])["plans"]  # and it was planned
    assert json.loads(worker.read_text()) == {"layers": layers, "heavy": []}
