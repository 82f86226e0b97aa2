"""The environment stage judges this machine, and the plan only when the plan targets this machine."""

from __future__ import annotations

from parallel_planner.plan import ParallelPlan
from validators.environment import DeviceInfo, PlanTarget, check_environment, judge_plan

ONE_H200 = [DeviceInfo(0, "NVIDIA H200", "9.0", 141 * 2**30, 132)]  # a described GPU: runs on the CPU
EIGHT_GPU_PLAN = ParallelPlan(dp_shard=8, gpus_per_node=8, global_batch=64)
ONE_GPU_PLAN = ParallelPlan(gpus_per_node=1, global_batch=64)


def test_a_plan_for_another_cluster_is_a_note_not_a_problem():
    target = PlanTarget("8xH100", "h100", 8, 8)
    problems, notes, judged = judge_plan(EIGHT_GPU_PLAN, "bf16", ONE_H200, target)
    assert problems == [] and not judged
    assert len(notes) == 1 and "8xH100" in notes[0]


def test_a_local_plan_is_judged_against_this_machine():
    local = PlanTarget("local", "h200", 1, 1, local=True)
    assert judge_plan(ONE_GPU_PLAN, "bf16", ONE_H200, local) == ([], [], True)
    problems, notes, judged = judge_plan(EIGHT_GPU_PLAN, "bf16", ONE_H200, local)
    assert judged and notes == [] and len(problems) == 1 and "8 GPUs per node" in problems[0]


def test_a_named_cluster_that_is_exactly_this_machine_is_judged():
    assert PlanTarget("1xH200", "h200", 1, 1).is_this_machine(ONE_H200)
    assert not PlanTarget("2xH200", "h200", 2, 2).is_this_machine(ONE_H200)
    assert not PlanTarget("1xH100", "h100", 1, 1).is_this_machine(ONE_H200)
    assert not PlanTarget("1xH200", "h200", 1, 1).is_this_machine([])  # a CPU machine


def test_fp8_is_checked_only_where_the_plan_runs():
    ampere = [DeviceInfo(0, "NVIDIA A100-SXM4-80GB", "8.0", 80 * 2**30, 108)]
    problems, notes, _ = judge_plan(ONE_GPU_PLAN, "fp8", ampere, PlanTarget("8xH100", "h100", 8, 8))
    assert problems == [] and "fp8" in notes[0]
    problems, _, _ = judge_plan(ONE_GPU_PLAN, "fp8", ampere, PlanTarget("local", "a100", 1, 1, local=True))
    assert len(problems) == 1 and "fp8" in problems[0]


def test_without_a_target_the_plan_is_meant_for_this_machine():
    problems, notes, judged = judge_plan(EIGHT_GPU_PLAN, "bf16", ONE_H200, None)
    assert judged and notes == [] and len(problems) == 1


def test_check_environment_on_this_cpu_keeps_a_remote_plan_as_a_note():
    target = PlanTarget("8xH100", "h100", 8, 8)
    report = check_environment(EIGHT_GPU_PLAN, precision="bf16", device="cpu", measure=False, target=target)
    assert not report.judged_against_plan and report.plan_target == "8xH100"
    assert not any("GPU" in problem for problem in report.problems)
    assert len(report.notes) == 1
    assert report.passed == (not report.problems)
    judged = check_environment(EIGHT_GPU_PLAN, precision="bf16", device="cpu", measure=False)
    assert judged.judged_against_plan and not judged.passed
