"""Training forwards that pass only token ids skip transformers' packed-sequence check and its host read; every
other call (a caller's positions, a mask, evaluation) runs the check as transformers does.  The check runs only
without a KV cache, as the adapted model trains (``api.uncached_in_training``): the calls here pass
``use_cache=False``."""

from __future__ import annotations

import pytest
import torch
from ops_testlib import load
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import masking_utils

from operators.positions import _DERIVED, derived_positions_in_training


class HostReads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


def reads(fn) -> int:
    mode = HostReads()
    with mode:
        fn()
    return mode.count


@pytest.fixture
def llama(zoo):
    model = load(zoo("llama")).train()
    undo = derived_positions_in_training(model)
    yield model
    undo()


def test_a_training_forward_on_token_ids_reads_nothing_back(zoo, llama):
    ids = torch.randint(0, llama.config.vocab_size, (2, 9))
    plain = load(zoo("llama")).train()
    assert reads(lambda: plain(input_ids=ids, use_cache=False)) >= 1  # transformers' own check reads the device
    assert reads(lambda: llama(input_ids=ids, use_cache=False)) == 0
    torch.testing.assert_close(
        llama(input_ids=ids, use_cache=False).logits, plain(input_ids=ids, use_cache=False).logits, rtol=0, atol=0
    )


def test_a_callers_packed_positions_are_still_found(zoo, llama):
    """Two sequences packed in each row: their attention stays apart, exactly as in the unpatched model."""
    ids = torch.randint(0, llama.config.vocab_size, (2, 10))
    packed = torch.cat([torch.arange(4), torch.arange(6)]).expand(2, -1)
    plain = load(zoo("llama")).train()
    ours = llama(input_ids=ids, position_ids=packed, use_cache=False).logits
    torch.testing.assert_close(ours, plain(input_ids=ids, position_ids=packed, use_cache=False).logits, rtol=0, atol=0)
    separate = plain(
        input_ids=ids[:, 4:], position_ids=packed[:, 4:], use_cache=False
    ).logits  # the second sequence alone
    torch.testing.assert_close(ours[:, 4:], separate, rtol=1e-5, atol=1e-5)
    assert reads(lambda: llama(input_ids=ids, position_ids=packed, use_cache=False)) >= 1
    assert reads(lambda: llama.eval()(input_ids=ids, use_cache=False)) >= 1  # evaluation runs the check too


def test_a_failed_forward_leaves_nothing_behind_and_undo_restores_transformers(zoo):
    model = load(zoo("llama")).train()
    before = masking_utils.find_packed_sequence_indices  # (already swapped while another model holds the swap)
    undo = derived_positions_in_training(model)
    assert "_skipping_when_derived" in masking_utils.find_packed_sequence_indices.__qualname__
    with pytest.raises(IndexError):
        model(input_ids=torch.full((1, 3), 10**9), use_cache=False)  # an out-of-range token id fails inside the forward
    assert _DERIVED == []
    undo()
    assert masking_utils.find_packed_sequence_indices is before
