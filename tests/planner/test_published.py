"""The time model against published runs (Megatron-LM 2021 Table 1, Megatron-Core r0.8 on H100, Llama 3 405B, BLOOM-176B)."""

from __future__ import annotations

import pytest

from parallel_planner.published import load_published_runs
from parallel_planner.published_eval import error_summary, evaluate
from parallel_planner.runtimes import RUNTIMES


@pytest.fixture(scope="module")
def rows():
    return evaluate(load_published_runs(), search=True)


def test_predicted_throughput_tracks_published_runs(rows):
    summary = error_summary(rows)
    assert summary["rows"] == len(load_published_runs())
    # Nothing is fitted to these rows, so this is out-of-sample error (target: mean 6 %, worst 12 %; not met).
    assert summary["mean_abs_error"] < 0.09, summary
    configured = {run.name for run in load_published_runs() if run.hf_config}
    dense = error_summary([r for r in rows if r["run"] not in configured])
    assert dense["max_abs_error"] < 0.18, dense
    # DeepSeek-V3 (MoE, MLA, fp8): optimistic by ~19 %; its own profile trace shows where (docs/planner-model.md).
    assert all(abs(r["error"]) < 0.25 for r in rows if r["run"] in configured)


def test_every_row_states_its_knobs_and_source():
    for run in load_published_runs():
        assert run.citation and run.framework in RUNTIMES
        assert run.attention in ("unfused", "flash2", "flash3")
        assert {"sp", "tp_overlap", "grad_overlap", "ep_overlap"} <= set(run.layout)


def test_search_fits_and_is_at_least_as_fast_as_the_published_layout(rows):
    for row in rows:
        assert row["searched"]["fits"], row["run"]
        if row["chosen"]["pp_schedule"] != "dualpipe":  # a schedule only a pinned layout is evaluated with
            assert row["searched_speedup"] >= 1 - 1e-9, row["run"]
