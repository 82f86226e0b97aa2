"""How long planning takes for the largest models, from a config-only checkpoint to the ranked answer, cold and
cached (``benchmarks/planner_report.py`` reports it)."""

from __future__ import annotations

import time
from typing import Any

from parallel_planner.cluster import make_cluster
from parallel_planner.published_eval import layout_fields
from parallel_planner.search import plan_parallel
from parallel_planner.workload import Workload

# A fresh interpreter importing what describing the config needs before intake reads a module: torch, and
# transformers' modelling code for the config (resolving the model class imports it); without cyclic
# collections, as in the spec worker.
_IMPORT_FLOOR = """import gc, sys, time
started = time.perf_counter()
gc.disable()
from adapt.core.source import resolve_source
from adapt.model.skeleton import load_config, model_class
src = resolve_source(sys.argv[1], config_only=True)
model_class(src, load_config(src))
print(time.perf_counter() - started)
"""


def planning_speed(cold_runs: int = 5, cases: int = 2) -> list[dict[str, Any]]:
    """Seconds to plan the two giants of the issue, from a config-only checkpoint to the ranked answer.

    ``intake_s`` builds the ModelSpec from a meta skeleton (torch/transformers start-up included when cold);
    ``cli_cold_s`` is ``adapt plan --no-cache`` end to end in a fresh process (the median and the least of
    ``cold_runs``) and ``cli_cold_cpu_s`` its CPU seconds, planner and spec worker together (the median: wall
    time on a shared machine follows its load, CPU time much less); ``cli_cached_s`` the same once the spec is
    cached; ``imports_s`` (median of ``cold_runs``) is what a fresh interpreter takes to import torch and
    transformers' modelling code for the config, the floor under a cold spec that intake's own work comes on
    top of.
    """
    import os
    import resource
    import statistics
    import subprocess
    import sys
    import tempfile

    from transformers import DeepseekV3Config

    from adapt.model.intake import inspect

    giants = [
        ("DeepSeek-V3 (671B MoE, MLA), 2048 x H800", DeepseekV3Config(), "h800", 2048, 4096, 15360),
        (
            "3T MoE (DeepSeek-V3 shape, 1024 experts, 70 layers), 16384 x H100",
            DeepseekV3Config(n_routed_experts=1024, num_hidden_layers=70),
            "h100",
            16384,
            4096,
            16384,
        ),
    ]
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, ADAPT_CACHE_DIR=os.path.join(tmp, "cache"))
        for i, (name, config, gpu, gpus, seq, batch) in enumerate(giants[:cases]):
            path = os.path.join(tmp, f"model{i}")
            config.save_pretrained(path)
            started = time.perf_counter()
            spec = inspect(path, config_only=True, seq_len=seq)
            intake_s = time.perf_counter() - started
            started = time.perf_counter()
            result = plan_parallel(spec, make_cluster(gpu, gpus), Workload(seq, batch))
            plan_s = time.perf_counter() - started
            command = [
                sys.executable,
                "-m",
                "adapt.app.cli",
                "plan",
                path,
                "--config-only",
                "--gpu",
                gpu,
                "--gpus",
                str(gpus),
                "--seq",
                str(seq),
                "--global-batch",
                str(batch),
                "--json",
            ]
            cold, cpu, imports = [], [], []
            for _ in range(cold_runs):  # each cold run beside an import floor, under the same load
                used = resource.getrusage(resource.RUSAGE_CHILDREN)
                started = time.perf_counter()
                subprocess.run(command + ["--no-cache"], env=env, check=True, capture_output=True)
                cold.append(time.perf_counter() - started)
                now = resource.getrusage(resource.RUSAGE_CHILDREN)  # the CLI and the spec worker it waited for
                cpu.append(now.ru_utime + now.ru_stime - used.ru_utime - used.ru_stime)
                floor = subprocess.run([sys.executable, "-c", _IMPORT_FLOOR, path], check=True, capture_output=True)
                imports.append(float(floor.stdout))
            started = time.perf_counter()
            subprocess.run(command, env=env, check=True, capture_output=True)
            cli_s = time.perf_counter() - started
            best = result.best
            out.append(
                {
                    "load_average": round(os.getloadavg()[0], 1),
                    "case": name,
                    "params_total": spec.params_total,
                    "layouts_scored": result.searched,
                    "intake_s": intake_s,
                    "plan_s": plan_s,
                    "cli_cached_s": cli_s,
                    "cli_cold_s": statistics.median(cold),
                    "cli_cold_min_s": min(cold),
                    "cold_runs": cold_runs,
                    "cli_cold_cpu_s": statistics.median(cpu),
                    "imports_s": statistics.median(imports),
                    "best": layout_fields(best, "tokens_per_s", "mfu"),
                }
            )
    return out
