"""Loss and parameter parity of every realised layout against a single-process run (gloo, CPU).

Each layout trains five steps from the same checkpoint on the same global batches; per-step loss,
gradient norm and the final (gathered) weights must match the one-process run at float32
tolerance.  Worker groups run once per module: a 1-rank group for the references, then one
2-rank and one 4-rank group for the layouts.
"""

from __future__ import annotations

import pytest
import torch
from dist_workers import CASES, STEPS

pytestmark = pytest.mark.distributed

TWO_RANK = [
    "zero3", "zero2", "zero1", "zero0_replicate",
    "tp_sp_gqa", "tp_sp_mha", "tp_gqa_no_sp", "tp_sp_vocab_qknorm_tied", "tp_sp_remote_code", "tp_random_init_synced",
    "pp_1f1b", "pp_gpipe", "pp_interleaved", "pp_zero_bubble", "pp_tied", "pp_end_chunks",
    "ep_qwen3_moe", "ep_mixtral",
]  # fmt: skip
FOUR_RANK = ["fsdp_tp", "pp_fsdp", "pp_tp", "ep_fsdp", "hsdp", "pp_fsdp_tied"]
ADAPTED = ["adapted_tp_sp", "adapted_fsdp", "adapted_pp"]  # kernel plan + compiled blocks
REFERENCES = sorted({f"ref_{CASES[c][0]}" for c in TWO_RANK + FOUR_RANK + ADAPTED})

LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
PARAM_TOL = {
    "rtol": 1e-4,
    "atol": 2e-5,
}  # measured worst case 1e-5 (remote-code TP); 2x grad error gives 1.7e-4
# adapt's kernels round differently from PyTorch's ops: an element whose gradient is near zero can
# take an Adam step of another size.  A tenth of one step (lr 2e-3); measured worst case 1.6e-4.
ADAPTED_PARAM_TOL = {"rtol": 1e-4, "atol": 2e-4}


@pytest.fixture(scope="module")
def results(dist_models, run_group, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("parity")
    found = run_group(1, REFERENCES, dist_models, out)
    found.update(run_group(2, TWO_RANK, dist_models, out))
    found.update(run_group(4, FOUR_RANK, dist_models, out))
    return found


@pytest.fixture(scope="module")
def adapted_results(results, run_group, dist_models, tmp_path_factory) -> dict[str, dict]:
    return run_group(2, ADAPTED, dist_models, tmp_path_factory.mktemp("adapted"), timeout=600)


@pytest.mark.parametrize("case", TWO_RANK + FOUR_RANK)
def test_layout_matches_single_process(case, results):
    _assert_parity(case, results[case], results, PARAM_TOL)


@pytest.mark.slow
@pytest.mark.parametrize("case", ADAPTED)
def test_adapted_compiled_layout_matches_plain_single_process(case, adapted_results, results):
    """The kernel plan and per-block compilation under each layout train like the plain model on one process."""
    got = adapted_results[case]
    _assert_parity(case, got, results, ADAPTED_PARAM_TOL)
    for rank_report in got["adapted"]:
        assert rank_report["patched"] > 0 and rank_report["compiled_blocks"] > 0, rank_report
        assert rank_report["fallback_calls"] == 0, rank_report["fallback_reasons"]
    if CASES[case][1].get("tp", 1) > 1:  # the norms ran adapt's kernel on each rank's sequence shard
        assert all(r["local_shard_calls"] > 0 for r in got["adapted"])


def _assert_parity(case: str, got: dict, results: dict, param_tol: dict) -> None:
    model = CASES[case][0]
    ref = results[f"ref_{model}"]
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL)
    torch.testing.assert_close(torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), **LOSS_TOL)
    assert got["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(
            got["params"][name],
            value,
            **param_tol,
            msg=lambda m, n=name: f"{case} {n}: {m}",
        )
    # Same starting point (ranks synchronised to rank 0), and the comparison means something only if
    # training moved the weights.
    for name, value in ref["initial"].items():
        torch.testing.assert_close(got["initial"][name], value, rtol=0, atol=0)
    moved = max((ref["params"][k] - v).abs().max().item() for k, v in ref["initial"].items())
    assert moved > 1e-3, f"reference weights barely moved ({moved:.2e}): the run did not train"
