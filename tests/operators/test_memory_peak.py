"""The peak-memory attribution of ``benchmarks/memory_peak.py``: replaying the allocator's events to the peak and
naming who allocated each block (no GPU: the events are written here as the allocator writes them)."""

from __future__ import annotations

from benchmarks.memory_peak import memory_lines, origin, replay_peak

MODEL = {"filename": "/site/transformers/models/llama/modeling_llama.py", "line": 9, "name": "forward"}
TORCH = {"filename": "/site/torch/nn/functional.py", "line": 3, "name": "linear"}
GRAPH = {"filename": "/tmp/torchinductor_root/ab/cabcdef.py", "line": 1, "name": "call"}


def test_the_peak_is_the_highest_total_and_holds_the_blocks_live_then():
    events = [
        {"action": "alloc", "addr": 1, "size": 10, "frames": [TORCH, MODEL]},
        {"action": "free_completed", "addr": 99, "size": 5},  # allocated before the trace began
        {"action": "alloc", "addr": 2, "size": 20, "frames": [GRAPH]},
        {"action": "free_completed", "addr": 1, "size": 10},
        {"action": "alloc", "addr": 3, "size": 3, "frames": []},
    ]
    peak, live, freed_before = replay_peak(events)
    assert peak == 25 and sorted(live) == [1, 2] and freed_before == 5  # 10 + 20 - 5, before addr 1 was freed


def test_a_block_is_named_by_the_innermost_frame_outside_torchs_plumbing():
    assert origin([TORCH, MODEL]) == "llama/modeling_llama.py:9 forward"
    assert origin([GRAPH, MODEL]).startswith("inductor graph cabcdef.py")
    assert origin([TORCH]).startswith("no Python frame")


def test_the_report_lists_each_variants_peak_and_largest_origins():
    mem = {
        "peak_gib": 3.0,
        "allocated_before_and_live_at_peak_gib": 1.0,
        "by_origin_gib": [["a.py:1 f", 1.5], ["b.py:2 g", 0.5]],
        "other_origins_gib": 0.0,
    }
    report = {"models": {"m": {"variants": {"adapt": {"memory_at_peak": mem}, "eager": {}}}}}
    lines = memory_lines(report)
    assert len([ln for ln in lines if ln.startswith("- ")]) == 1 and "a.py:1 f 1.50" in lines[-1]
    assert memory_lines({"models": {"m": {"variants": {"eager": {}}}}}) == []
