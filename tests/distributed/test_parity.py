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
REFERENCES = sorted({f"ref_{CASES[c][0]}" for c in TWO_RANK + FOUR_RANK})

LOSS_TOL = {"rtol": 1e-5, "atol": 1e-5}
PARAM_TOL = {
    "rtol": 1e-4,
    "atol": 2e-5,
}  # measured worst case 1e-5 (remote-code TP); 2x grad error gives 1.7e-4


@pytest.fixture(scope="module")
def results(dist_models, run_group, tmp_path_factory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("parity")
    found = run_group(1, REFERENCES, dist_models, out)
    found.update(run_group(2, TWO_RANK, dist_models, out))
    found.update(run_group(4, FOUR_RANK, dist_models, out))
    return found


@pytest.mark.parametrize("case", TWO_RANK + FOUR_RANK)
def test_layout_matches_single_process(case, results):
    model = CASES[case][0]
    got, ref = results[case], results[f"ref_{model}"]
    assert len(got["losses"]) == len(ref["losses"]) == STEPS
    torch.testing.assert_close(
        torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL
    )
    torch.testing.assert_close(
        torch.tensor(got["grad_norms"]), torch.tensor(ref["grad_norms"]), **LOSS_TOL
    )
    assert got["params"].keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(
            got["params"][name],
            value,
            **PARAM_TOL,
            msg=lambda m, n=name: f"{case} {n}: {m}",
        )
    # Same starting point (ranks synchronised to rank 0), and the comparison means something only if
    # training moved the weights.
    for name, value in ref["initial"].items():
        torch.testing.assert_close(got["initial"][name], value, rtol=0, atol=0)
    moved = max(
        (ref["params"][k] - v).abs().max().item() for k, v in ref["initial"].items()
    )
    assert moved > 1e-3, (
        f"reference weights barely moved ({moved:.2e}): the run did not train"
    )
