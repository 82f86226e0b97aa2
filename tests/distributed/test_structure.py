"""Structure discovery, stage splitting, launch commands, data and schedule: no process group needed."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from adapt.core.errors import BadInput
from adapt.runtime.data import SyntheticTokens, TokenFile
from adapt.runtime.model_parts import find_parts
from adapt.runtime.pipeline import build_schedule, stage_block_counts
from adapt.runtime.tensor_parallel import check_tensor_parallel
from adapt.runtime.trainer import TrainConfig, lr_lambda
from parallel_planner.launch import LaunchConfig, torchrun_command
from parallel_planner.plan import ParallelPlan


def _model(zoo, name):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(zoo(name), trust_remote_code=True)


def test_roles_found_in_renamed_remote_code_model(zoo):
    parts = find_parts(_model(zoo, "custom"))
    assert (parts.embedding, parts.final_norm, parts.head, parts.blocks_path) == (
        "trunk.lexicon", "trunk.level_out", "readout", "trunk.strata"
    )  # fmt: skip
    gaze, forge = parts.blocks[0].branches
    assert gaze.attention and gaze.colwise == ["gaze.ask", "gaze.match", "gaze.carry"] and gaze.rowwise == ["gaze.emit"]
    assert not forge.attention and forge.colwise == ["forge.valve", "forge.feed"] and forge.rowwise == ["forge.drain"]
    assert set(parts.blocks[0].norms) == {
        "level_a",
        "quench",
        "level_b",
    }  # per-token modules, SP-safe


def test_qk_norm_tied_head_and_experts(zoo):
    qwen3 = find_parts(_model(zoo, "qwen3"))
    assert qwen3.tied and qwen3.blocks[0].branches[0].head_norms == [
        "self_attn.q_norm",
        "self_attn.k_norm",
    ]
    moe = find_parts(_model(zoo, "qwen3_moe"))
    assert moe.blocks[0].branches[1].experts == "mlp.experts"


def test_tensor_parallel_refuses_what_it_cannot_split(zoo):
    mla = find_parts(_model(zoo, "deepseek_v3"))
    with pytest.raises(BadInput, match="cannot place"):
        check_tensor_parallel(mla, 2, vocab_parallel=False)
    llama = find_parts(_model(zoo, "llama"))  # 4 query heads, 2 kv heads
    check_tensor_parallel(llama, 2, vocab_parallel=True)
    with pytest.raises(BadInput, match="kv heads"):
        check_tensor_parallel(llama, 4, vocab_parallel=False)


def test_stage_split_follows_plan():
    assert stage_block_counts(ParallelPlan(pp=2, vpp=2, global_batch=8), 6) == [
        2,
        2,
        1,
        1,
    ]
    assert stage_block_counts(ParallelPlan(pp=2, stage_layers=[3, 1], global_batch=8), 4) == [3, 1]
    with pytest.raises(BadInput, match="sums to"):
        stage_block_counts(ParallelPlan(pp=2, stage_layers=[3, 3], global_batch=8), 4)
    with pytest.raises(BadInput, match="cannot fill"):
        stage_block_counts(ParallelPlan(pp=4, global_batch=8), 2)


def test_a_dualpipe_plan_is_refused_with_its_reason_before_any_stage_is_built():
    plan = ParallelPlan(pp=2, dp_shard=1, pp_schedule="dualpipe", grad_accum=4)
    with pytest.raises(BadInput, match="dualpipe is planned but not run") as refusal:
        build_schedule([], plan, pp_mesh=None, device=torch.device("cpu"), loss_fn=None)
    assert "vpp > 1" not in str(refusal.value).split(";")[0]


def test_torchrun_commands():
    plan = ParallelPlan(tp=2, dp_shard=4, pp=2, global_batch=8)
    single = torchrun_command(plan, LaunchConfig(), ["m", "--plan", "p.json"])
    assert single[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--standalone" in single and "--nproc-per-node=16" in single
    assert single[-6:] == ["-m", "adapt", "train", "m", "--plan", "p.json"]
    multi = torchrun_command(plan, LaunchConfig(nnodes=2, rdzv_endpoint="node0:29500"), ["m"])
    assert "--nproc-per-node=8" in multi and "--rdzv-endpoint=node0:29500" in multi and "--standalone" not in multi
    with pytest.raises(BadInput, match="rdzv-endpoint"):
        torchrun_command(plan, LaunchConfig(nnodes=2), ["m"])
    with pytest.raises(BadInput, match="needs 16 processes"):
        torchrun_command(plan, LaunchConfig(nnodes=3), ["m"])


def test_token_file_windows_and_checks(tmp_path):
    tokens = np.arange(100, dtype=np.int32) % 50
    np.save(tmp_path / "t.npy", tokens)
    data = TokenFile(str(tmp_path / "t.npy"), vocab_size=50, seq_len=8)
    batch = data.global_batch(step=1, batch=2)
    assert batch.shape == (2, 9)
    assert torch.equal(batch[0], torch.arange(16, 25) % 50)  # step 1 starts at window 2
    with pytest.raises(BadInput, match="outside the model's vocabulary"):
        TokenFile(str(tmp_path / "t.npy"), vocab_size=10, seq_len=8)
    with pytest.raises(BadInput, match="not found"):
        TokenFile(str(tmp_path / "missing.npy"), vocab_size=50, seq_len=8)


def test_token_files_that_cannot_be_tokens_are_refused(tmp_path):
    """Negative ids, pickles, a torn .bin and an empty file are the user's input: BadInput, never a crash."""
    np.save(tmp_path / "negative.npy", np.full(100, -1, dtype=np.int64))
    np.save(tmp_path / "objects.npy", np.array([1, "a"] * 50, dtype=object), allow_pickle=True)
    (tmp_path / "torn.bin").write_bytes(b"\x01" * 101)
    (tmp_path / "empty.bin").write_bytes(b"")
    cases = {
        "negative.npy": "token id -1 is outside the model's vocabulary",
        "objects.npy": "pickled Python objects, which are never loaded",
        "torn.bin": "101 bytes is not a whole number of uint16",
        "empty.bin": "not a readable token array",
    }
    for name, message in cases.items():
        with pytest.raises(BadInput, match=message):
            TokenFile(str(tmp_path / name), vocab_size=50, seq_len=8)


def test_synthetic_stream_is_reproducible_and_learnable():
    data = SyntheticTokens(vocab_size=97, seq_len=12, seed=5)
    a, b = data.global_batch(3, 4), data.global_batch(3, 4)
    assert torch.equal(a, b) and not torch.equal(a, data.global_batch(4, 4))
    stride = (a[:, 1:] - a[:, :-1]) % 97
    assert (stride == stride[:, :1]).all()  # each sequence is an arithmetic progression


def test_learning_rate_warms_up_then_decays_to_floor():
    factor = lr_lambda(TrainConfig(steps=10, warmup_steps=2, min_lr_ratio=0.1))
    assert [factor(0), factor(1)] == [0.5, 1.0]
    assert factor(2) == pytest.approx(1.0) and factor(10) == pytest.approx(0.1)
    assert all(factor(s) >= factor(s + 1) for s in range(2, 10))


def test_pipeline_split_refuses_a_forward_with_extra_work(zoo):
    """Gemma-2 soft-caps its logits after the head: splitting would silently drop that."""
    from adapt.runtime.pipeline import (
        capture_block_context,
        check_decomposition,
    )

    for name, splittable in (("llama", True), ("gemma2", False)):
        model = _model(zoo, name).eval()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        parts = find_parts(model)
        ids = torch.randint(0, parts.vocab_size, (2, 16))
        if splittable:
            check_decomposition(model, parts, ids, capture_block_context(model, parts, ids))
        else:
            with pytest.raises(BadInput, match="pipeline split refused"):
                check_decomposition(model, parts, ids, capture_block_context(model, parts, ids))
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # the probe restores weights
