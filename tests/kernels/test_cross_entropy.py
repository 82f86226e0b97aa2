"""Fused linear + cross-entropy against a float64 reference built on ``F.cross_entropy``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_close, leaf, ref_leaf

from operators.kernels import fused_linear_cross_entropy


def reference_loss(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, reduction):
    logits = hidden @ weight.t()
    if bias is not None:
        logits = logits + bias
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    flat, flat_labels = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    per_token = F.cross_entropy(
        flat, flat_labels, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none"
    )
    valid = flat_labels != ignore_index
    per_token = per_token + z_loss * torch.logsumexp(flat, -1).pow(2) * valid
    if reduction == "none":
        return per_token.view(labels.shape)
    total = per_token.sum()
    return total / valid.sum().clamp_min(1) if reduction == "mean" else total


def _check(
    dtype,
    tokens_shape,
    hidden_size,
    vocab,
    *,
    bias=False,
    ignore_index=-100,
    label_smoothing=0.0,
    z_loss=0.0,
    softcap=None,
    reduction="mean",
    chunk_size=None,
    upstream=1.0,
    scale=1.0,
):
    h_in = torch.randn(*tokens_shape, hidden_size, device=DEVICE, dtype=dtype)
    w_in = (torch.randn(vocab, hidden_size, device=DEVICE) / hidden_size**0.5 * 4).to(dtype)
    b_in = torch.randn(vocab, device=DEVICE, dtype=dtype) if bias else None
    labels = torch.randint(0, vocab, tokens_shape, device=DEVICE)
    labels[torch.rand(tokens_shape, device=DEVICE) < 0.25] = ignore_index
    h, w = leaf(h_in), leaf(w_in)
    b = leaf(b_in) if bias else None
    h64, w64 = ref_leaf(h_in), ref_leaf(w_in)
    b64 = ref_leaf(b_in) if bias else None
    opts = dict(
        ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, reduction=reduction
    )
    loss = fused_linear_cross_entropy(h, w, labels, b, chunk_size=chunk_size, **opts)
    ref = reference_loss(h64, w64, labels, b64, **opts)
    assert_close(loss, ref, dtype, scale=scale, what="loss")
    grad_out = torch.randn_like(loss) if reduction == "none" else torch.tensor(upstream, device=DEVICE)
    loss.backward(grad_out)
    ref.backward(grad_out.double())
    assert_close(h.grad, h64.grad, dtype, scale=2 * scale, what="dhidden")
    assert_close(w.grad, w64.grad, dtype, scale=2 * scale, what="dweight")
    if bias:
        assert_close(b.grad, b64.grad, dtype, scale=2 * scale, what="dbias")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_flce_reductions_multi_chunk(dtype, reduction):
    # 3x5 tokens in chunks of 4 rows, vocab 1000 (not a power of two) -> several vocab blocks per row
    _check(dtype, (3, 5), 48, 1000, reduction=reduction, chunk_size=4, upstream=0.37, scale=1.5)


@pytest.mark.parametrize(
    "options",
    [
        dict(label_smoothing=0.1),
        dict(z_loss=1e-3),
        dict(softcap=5.0),
        dict(bias=True, ignore_index=7),
        dict(label_smoothing=0.2, z_loss=1e-2, softcap=3.0, bias=True),
    ],
)
def test_flce_options(options):
    _check(torch.float32, (2, 6), 40, 777, chunk_size=5, **options)


def test_flce_fp16_default_chunking():
    _check(torch.float16, (11,), 64, 300, scale=2)


def test_flce_real_vocab_few_tokens():
    _check(torch.bfloat16, (3,), 32, 128256, chunk_size=2, scale=1.5)


def test_flce_all_ignored_is_zero_with_zero_grads():
    h = torch.randn(4, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(50, 16, device=DEVICE, requires_grad=True)
    loss = fused_linear_cross_entropy(h, w, torch.full((4,), -100, device=DEVICE))
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0


def test_flce_rejects_bad_arguments():
    h, w = torch.randn(4, 16, device=DEVICE), torch.randn(50, 16, device=DEVICE)
    with pytest.raises(ValueError):
        fused_linear_cross_entropy(h, w, torch.zeros(5, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError):
        fused_linear_cross_entropy(h, w, torch.zeros(4, dtype=torch.long, device=DEVICE), reduction="max")


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_flce_without_grad_is_loss_only(reduction):
    h = torch.randn(2, 7, 24, device=DEVICE)
    w = torch.randn(333, 24, device=DEVICE) / 5
    labels = torch.randint(0, 333, (2, 7), device=DEVICE)
    labels[0, 0] = -100
    with torch.no_grad():
        loss = fused_linear_cross_entropy(
            h, w, labels, label_smoothing=0.05, z_loss=1e-3, softcap=4.0, reduction=reduction, chunk_size=3
        )
    ref = reference_loss(h.double(), w.double(), labels, None, -100, 0.05, 1e-3, 4.0, reduction)
    assert loss.grad_fn is None
    assert_close(loss, ref, torch.float32)


@pytest.mark.parametrize("tokens,hidden,vocab", [(8192, 2048, 128256), (8192, 2304, 256000), (65536, 8192, 32000)])
def test_default_chunk_keeps_gemms_in_whole_tiles_and_the_weight_gradient_rereads_few(tokens, hidden, vocab):
    """Each chunk re-reads the whole weight gradient: chunks hold at least the byte budget or as many logits as
    d weight has entries (or all tokens)."""
    from operators.kernels.cross_entropy import CHUNK_BUDGET_BYTES, CHUNK_ROW_MULTIPLE, default_chunk_size

    rows = default_chunk_size(tokens, hidden, vocab)
    budget = max(CHUNK_BUDGET_BYTES, tokens * hidden * 2, hidden * vocab * 2)
    assert rows % CHUNK_ROW_MULTIPLE == 0
    assert rows * vocab * 2 <= budget  # never more logits than the budget
    assert rows == tokens or (rows + CHUNK_ROW_MULTIPLE) * vocab * 2 > budget  # and no fewer than fit in it
    assert rows == tokens or rows >= hidden - CHUNK_ROW_MULTIPLE  # d weight is re-read once per its size at most
    assert default_chunk_size(7, hidden, vocab) == 7  # fewer tokens than a chunk: one chunk


def test_flce_backward_allocates_nothing_of_the_weight_gradients_size():
    """The forward already holds d weight: its backward scales it in place (no copy, no zeros for the gradient
    outputs), so the step's peak holds one d weight, not three.  (Values: ``test_flce_reductions_multi_chunk``.)"""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NewTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = torch.utils._pytree.tree_leaves((args, kwargs))
            existing = {t.untyped_storage().data_ptr() for t in inputs if isinstance(t, torch.Tensor)}
            for t in torch.utils._pytree.tree_leaves(out):  # in place, out= and views: storage that exists
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in existing:
                    self.shapes.append(tuple(t.shape))
            return out

    h = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(40, 16, device=DEVICE, requires_grad=True)
    loss = fused_linear_cross_entropy(h, w, torch.randint(0, 40, (6,), device=DEVICE), chunk_size=4)
    mode = NewTensors()
    with mode:
        (loss * 0.5).backward()
    assert mode.shapes and (40, 16) not in mode.shapes and (6, 16) not in mode.shapes, mode.shapes


def test_flce_second_backward_through_the_same_graph_is_refused_not_scaled_twice():
    h = torch.randn(6, 16, device=DEVICE, requires_grad=True)
    w = torch.randn(40, 16, device=DEVICE, requires_grad=True)
    loss = fused_linear_cross_entropy(h, w, torch.randint(0, 40, (6,), device=DEVICE)) * 3.0
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace"):
        loss.backward()
