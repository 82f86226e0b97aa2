"""How the kernels are registered (``ADAPT_KERNEL_OPS``): the choice of mode, and, in a process of its own with
``inductor`` mode and no interpreter, that the converted operators are ``triton_op`` and trace into Triton kernel
nodes for Inductor (``inductor_ops_trace``; no GPU is needed to trace)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._library.triton import get_triton_kernels_for_op

from operators.kernels import _registration, ops  # noqa: F401  (ops registers torch.ops.adapt)

CONVERTED = {
    f"adapt::{name}"
    for name in (
        "rms_norm",
        "add_rms_norm",
        "rms_norm_backward",
        "layer_norm",
        "layer_norm_backward",
        "glu",
        "glu_backward",
        "glu_linear",
        "glu_linear_backward",
        "apply_rotary",
        "apply_rotary_backward",
        "fused_linear_cross_entropy",
        "fused_linear_cross_entropy_backward",
    )
}
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "value, interpret, mode",
    [
        (None, "0", "opaque"),
        ("", "0", "opaque"),
        ("inductor", "0", "inductor"),
        (" Inductor ", "0", "inductor"),
        ("opaque", "0", "opaque"),
        ("inductor", "1", "opaque"),  # the interpreter's kernels cannot be wrapped
    ],
)
def test_mode_from_environment(monkeypatch, value, interpret, mode):
    if value is None:
        monkeypatch.delenv(_registration.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(_registration.ENV_VAR, value)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    assert _registration.effective_mode() == mode


@pytest.mark.parametrize("interpret", ["0", "1"])
def test_bad_mode_names_the_allowed_values(monkeypatch, interpret):
    monkeypatch.setenv(_registration.ENV_VAR, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    with pytest.raises(ValueError, match="ADAPT_KERNEL_OPS='triton': expected one of opaque, inductor"):
        _registration.effective_mode()


def test_this_session_registers_in_its_mode():
    """Under the interpreter (CPU sessions) the operators are ``custom_op``, with no kernels declared."""
    expected = _registration.effective_mode()
    assert _registration.MODE == expected
    assert all(bool(get_triton_kernels_for_op(name)) == (expected == "inductor") for name in CONVERTED)


@pytest.fixture(scope="module")
def inductor_trace() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(
        ADAPT_KERNEL_OPS="inductor", PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    )
    script = Path(__file__).with_name("inductor_ops_trace.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_inductor_mode_registers_triton_ops(inductor_trace):
    assert inductor_trace["mode"] == "inductor" and inductor_trace["interpret"] is None
    assert set(inductor_trace["triton_ops"]) == CONVERTED


def test_schemas_match_the_opaque_registration(inductor_trace):
    for name, schema in inductor_trace["schemas"].items():
        assert schema == str(getattr(torch.ops.adapt, name.split("::")[1]).default._schema)


def test_each_operator_traces_into_kernel_launches(inductor_trace):
    """AOTAutograd decomposes each operator into its launch code: at least one Triton kernel node per operator,
    one per chunk for the cross-entropy (two chunks of 8 tokens here)."""
    nodes = inductor_trace["kernel_nodes"]
    assert {f"adapt::{name}" for name in nodes} == CONVERTED
    assert all(count >= 1 for count in nodes.values()), nodes
    assert nodes["fused_linear_cross_entropy"] == nodes["fused_linear_cross_entropy_backward"] == 2


def test_compiled_block_launches_kernels_at_a_dynamic_length(inductor_trace):
    """A block's kernels, forward and backward, compiled with the sequence length dynamic: three kernel nodes each
    way (norm, rotary, gated unit), and the launch code leaves the length symbolic (no recompile per length)."""
    assert inductor_trace["compiled"] == {
        "forward": {"kernels": 3, "symbolic": True},
        "backward": {"kernels": 3, "symbolic": True},
    }


def test_traces_do_not_count_as_calls(inductor_trace):
    assert inductor_trace["calls_advanced"] == {}
