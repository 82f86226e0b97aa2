"""Validation against published training runs (``data/published_runs.csv``).

We write each row's ModelSpec from its dimensions (``published.run_spec``), plan that layout
with ``--fixed`` semantics under the row's software (framework, attention kernel), and compare per-GPU
token throughput with the source's figure, turned into tokens/s with the source's own FLOP count.

Nothing in the time model is fitted to these rows (``efficiency.Efficiency`` states every constant's
source), so every error here is out of sample; leave-one-source-out equals in-sample by construction.
Knobs a source leaves unstated (micro-batch, virtual stages) are the planner's choice; ``knob_range``
shows how far they move the prediction.  ``benchmarks/planner_report.py`` writes the tables.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from adapt.core.errors import BadInput
from adapt.core.spec import ModelSpec
from parallel_planner.cluster import make_cluster
from parallel_planner.efficiency import Efficiency
from parallel_planner.published import PublishedRun, load_published_runs, run_spec
from parallel_planner.search import plan_parallel

# What a report shows of a planned layout: its parallel degrees and knobs, and its memory per GPU.
LAYOUT_KEYS = (
    "tp",
    "pp",
    "dp",
    "cp",
    "ep",
    "zero",
    "recompute",
    "micro_batch",
    "vpp",
    "pp_schedule",
    "memory_gib_per_gpu",
)


def layout_fields(plan: Any, *figures: str) -> dict[str, Any]:
    """``plan.to_dict()`` cut to ``LAYOUT_KEYS`` and the named ``figures``."""
    wanted = (*LAYOUT_KEYS, *figures)
    return {k: v for k, v in plan.to_dict().items() if k in wanted}


def evaluate(runs: list[PublishedRun], eff: Efficiency | None = None, search: bool = True) -> list[dict[str, Any]]:
    """Predicted vs published per-GPU throughput for each row (and the searched plan when ``search``)."""
    eff = eff or Efficiency()
    out = []
    for run in runs:
        spec = run_spec(run)
        cluster = make_cluster(run.gpu, run.gpus)
        run_eff = run.efficiency(eff)
        fixed = _fastest(run, spec, cluster, run_eff, run.layouts())
        published = run.published_tokens_per_s_per_gpu(spec)
        row = {
            "source": run.source,
            "run": run.name,
            "layout": run.layout,
            "published_tflops_per_gpu": run.reported_tflops_per_gpu,
            "published_tokens_per_s_per_gpu": published,
            "predicted_tokens_per_s_per_gpu": fixed.tokens_per_s_per_gpu,
            "error": fixed.tokens_per_s_per_gpu / published - 1,
            "fits": fixed.fits,
            "memory_gib_per_gpu": fixed.memory_gib_per_gpu,
            "chosen": {k: getattr(fixed.plan, k) for k in ("micro_batch", "vpp", "pp_schedule", "recompute")},
            "predicted_mfu": fixed.mfu,
            "published_pct_peak": run.reported_pct_peak,
        }
        if search:
            started = time.perf_counter()
            best = plan_parallel(spec, cluster, run.workload(), top_k=1, efficiency=run_eff).best
            row["search_s"] = time.perf_counter() - started
            row["searched"] = layout_fields(best, "fits", "tokens_per_s_per_gpu")
            row["searched_speedup"] = best.tokens_per_s_per_gpu / fixed.tokens_per_s_per_gpu
        out.append(row)
    return out


def planned(run: PublishedRun, eff: Efficiency | None = None) -> Any:
    """The row as the planner predicts it: its stated layout and software, the unstated knobs its best choice."""
    spec = run_spec(run)
    return _fastest(run, spec, make_cluster(run.gpu, run.gpus), run.efficiency(eff), run.layouts())


def _fastest(run: PublishedRun, spec: ModelSpec, cluster: Any, eff: Efficiency, layouts: list[dict[str, Any]]) -> Any:
    """The planner's best plan over ``layouts`` (each pinned in turn): fitting plans first, then the fastest."""
    plans = []
    for layout in layouts:
        try:
            plans.append(plan_parallel(spec, cluster, run.workload(), fixed=layout, top_k=1, efficiency=eff).best)
        except BadInput:
            if len(layouts) == 1:
                raise
    if not plans:
        raise BadInput(f"{run.name}: none of its framework's layouts is valid")
    return max(plans, key=lambda p: (p.fits, p.tokens_per_s_per_gpu))


def error_summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    errors = [abs(r["error"]) for r in rows]
    return {"mean_abs_error": sum(errors) / len(errors), "max_abs_error": max(errors), "rows": len(errors)}


def knob_range(run: PublishedRun, eff: Efficiency | None = None) -> tuple[float, float] | None:
    """(lowest, highest) predicted tokens/s/GPU over the knobs the source leaves unstated (micro-batch and
    virtual stages), or None when it states them all: how much of an error the unstated knobs can explain."""
    if run.mbs and (run.vpp or run.pp == 1):
        return None
    spec, cluster = run_spec(run), make_cluster(run.gpu, run.gpus)
    predictions = []
    stated_vpp = (run.vpp or 1,) if run.vpp or run.pp == 1 else None
    for mbs in (run.mbs,) if run.mbs else (1, 2, 4, 8):
        for vpp in stated_vpp or run.vpp_choices or (1, 2, 4, 8):
            layout = dict(run.layout, mbs=mbs, vpp=vpp)
            if run.pp > 1 and vpp == 1 and not run.schedule:
                layout["schedule"] = "1f1b"
            try:
                best = plan_parallel(
                    spec, cluster, run.workload(), fixed=layout, top_k=1, efficiency=run.efficiency(eff)
                ).best
            except BadInput:
                continue  # the batch does not split into these micro-batches, or the layers into these chunks
            predictions.append(best.tokens_per_s_per_gpu)
    return (min(predictions), max(predictions)) if predictions else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    rows = evaluate(load_published_runs(), search=False)
    print(
        json.dumps(
            {
                "all": error_summary(rows),
                "rows": [
                    {
                        k: r[k]
                        for k in ("run", "error", "predicted_tokens_per_s_per_gpu", "published_tokens_per_s_per_gpu")
                    }
                    for r in rows
                ],
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
