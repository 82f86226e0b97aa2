"""The time model against published runs (Megatron-LM 2021 Table 1, Llama 3 405B)."""

from __future__ import annotations

from pathlib import Path

import pytest

from parallel_planner.published import error_summary, evaluate, load_published_runs

SHARED_CSV = Path(__file__).resolve().parents[3] / "shared" / "planner" / "published_runs.csv"


@pytest.fixture(scope="module")
def rows():
    return evaluate(load_published_runs(), search=True)


def test_bundled_csv_is_the_shared_one():
    if not SHARED_CSV.exists():
        pytest.skip("no ../shared checkout next to the repository")
    from importlib import resources

    bundled = resources.files("parallel_planner.data").joinpath("published_runs.csv").read_text()
    assert bundled == SHARED_CSV.read_text()


def test_predicted_throughput_tracks_published_runs(rows):
    summary = error_summary(rows)
    assert summary["rows"] == 13
    assert summary["mean_abs_error"] < 0.10, summary
    assert summary["max_abs_error"] < 0.20, summary


def test_search_fits_and_is_at_least_as_fast_as_the_published_layout(rows):
    for row in rows:
        assert row["searched"]["fits"], row["run"]
        assert row["searched_speedup"] >= 1 - 1e-9, row["run"]
