"""DCP round trips across layouts, and the HF safetensors export.

A run trains two steps under one layout and saves; a fresh model, poisoned with NaN, loads the
checkpoint under another layout.  Both then train two more steps: outputs at load time, the
continued losses and the final weights must agree, which needs the model *and* the optimizer
state (AdamW moments, step counts, learning rate) to have round-tripped.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed

CASES = ["dcp_fsdp_to_tp", "dcp_ep_to_fsdp"]
TOL = {"rtol": 1e-4, "atol": 5e-5}


@pytest.fixture(scope="module")
def results(misc_two_rank) -> dict[str, dict]:
    return misc_two_rank


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_round_trip_across_layouts(case, results):
    got = results[case]
    assert got["loaded_step"] == 2
    assert torch.isfinite(got["loaded_logits"]).all()
    torch.testing.assert_close(got["loaded_logits"], got["saved_logits"], **TOL)
    torch.testing.assert_close(
        torch.tensor(got["second_losses"]),
        torch.tensor(got["first_losses"]),
        rtol=1e-5,
        atol=1e-5,
    )
    assert got["second_params"].keys() == got["first_params"].keys()
    for name, value in got["first_params"].items():
        torch.testing.assert_close(got["second_params"][name], value, **TOL, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("case", CASES)
def test_hf_export_reloads_with_transformers(case, results):
    from transformers import AutoModelForCausalLM

    got = results[case]
    model = AutoModelForCausalLM.from_pretrained(got["export_dir"], dtype=torch.float32)
    state = model.state_dict()
    for name, value in got["second_params"].items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
