"""The float64 reference's forward: torch's default dtype follows it, and depthwise convs run tap by tap."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from validators.alignment import depthwise_conv1d_by_taps, float64_forward


def _shapes(rng: random.Random) -> tuple[int, int, int, int, int, int]:
    """A depthwise conv whose dilated kernel fits the padded input, as torch requires."""
    batch, channels = rng.randint(1, 3), rng.randint(2, 48)
    kernel, padding, dilation = rng.randint(1, 5), rng.randint(0, 3), rng.randint(1, 2)
    span = dilation * (kernel - 1) + 1
    length = rng.randint(max(1, span - 2 * padding), 40)
    return batch, channels, length, kernel, padding, dilation


@pytest.mark.parametrize("with_bias", [True, False])
def test_tap_sum_matches_torch_conv1d_forward_and_backward(with_bias, rng):
    batch, channels, length, kernel, padding, dilation = _shapes(rng)
    x = torch.randn(batch, channels, length, dtype=torch.float64, requires_grad=True)
    w = torch.randn(channels, 1, kernel, dtype=torch.float64, requires_grad=True)
    b = torch.randn(channels, dtype=torch.float64, requires_grad=True) if with_bias else None
    expected = torch.conv1d(x, w, b, 1, padding, dilation, channels)
    got = depthwise_conv1d_by_taps(x, w, b, (1,), (padding,), (dilation,), channels)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    upstream = torch.randn_like(expected)
    grads = torch.autograd.grad(expected, [x, w], upstream)
    torch.testing.assert_close(torch.autograd.grad(got, [x, w], upstream), grads, rtol=1e-12, atol=1e-12)


def test_other_convolutions_are_left_to_torch():
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    assert depthwise_conv1d_by_taps(x.float(), torch.randn(8, 1, 3), groups=8) is None  # float32
    assert depthwise_conv1d_by_taps(x, torch.randn(8, 4, 3, dtype=torch.float64), groups=2) is None  # grouped
    assert depthwise_conv1d_by_taps(x, torch.randn(8, 1, 3, dtype=torch.float64), stride=2, groups=8) is None


def test_a_float64_module_runs_its_conv_by_taps_and_its_scalars_in_float64(rng):
    batch, channels, length, kernel, padding, dilation = _shapes(rng)
    conv = nn.Conv1d(channels, channels, kernel, padding=padding, dilation=dilation, groups=channels).double()
    x = torch.randn(batch, channels, length, dtype=torch.float64)
    with float64_forward(conv):
        assert torch.get_default_dtype() == torch.float64
        assert torch.full((), torch.finfo(torch.float64).min).dtype == torch.float64
        out = conv(x)
    assert torch.get_default_dtype() == torch.float32
    by_taps = depthwise_conv1d_by_taps(x, conv.weight, conv.bias, 1, padding, dilation, channels)
    assert torch.equal(out, by_taps)
    with float64_forward(conv.float()):
        assert torch.get_default_dtype() == torch.float32


def test_the_reference_keeps_float64_where_a_model_upcasts_to_float32():
    """Models upcast to float32 for stability (an RMSNorm's ``.to(torch.float32)``, a softmax's ``dtype=``, rotary's
    ``.float()``): in the reference each would round to float32, no more precise than a float32 candidate."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = LlamaRMSNorm(64).double()
    x = torch.randn(3, 64, dtype=torch.float64) * 1e3 + 1.0
    exact = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    rounded = norm(x)  # as written: the variance and the scaling in float32
    assert (rounded - exact).abs().max() / exact.abs().max() > 1e-9
    with float64_forward(norm):
        kept = norm(x)
        probs = torch.softmax(x, dim=-1, dtype=torch.float32)
        positions = torch.arange(5).float()
        moved = x.to("cpu", torch.float32)
    torch.testing.assert_close(kept, exact, rtol=1e-14, atol=0)
    assert probs.dtype == positions.dtype == moved.dtype == torch.float64
    assert torch.arange(5).float().dtype == torch.float32  # outside the reference, float32 is float32 again
