"""Context parallelism on CPU: what can run without CUDA (the guard, the sequence sharding)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def result(misc_two_rank) -> dict:
    return misc_two_rank["cp_plumbing"]


def test_context_parallel_is_refused_off_cuda(result):
    assert "context parallelism needs CUDA" in result["refused"]


def test_sequence_shards_are_load_balanced_and_aligned(result):
    tokens = result["tokens"]
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    chunks = inputs.shape[1] // 4  # 2*cp chunks: rank r holds chunks r and 3-r
    order = {0: [0, 3], 1: [1, 2]}
    for rank, shard in enumerate(result["shards"]):
        cols = torch.cat([torch.arange(c * chunks, (c + 1) * chunks) for c in order[rank]])
        assert torch.equal(shard["inputs"], inputs[:, cols])
        assert torch.equal(shard["labels"], labels[:, cols])  # each token keeps its own target
        assert torch.equal(shard["positions"], cols.expand_as(shard["positions"]))  # and its true position
