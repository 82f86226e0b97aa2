"""adapt's AdamW update against float64 arithmetic, and ``TritonAdamW`` against ``torch.optim.AdamW``."""

from __future__ import annotations

import copy

import pytest
import torch

from operators.kernels import adamw
from operators.optim import TritonAdamW

HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def adamw_float64(p, g, m, v, step, lr, beta1, beta2, eps, weight_decay):
    """One decoupled-decay AdamW step in float64 from the same (rounded) inputs."""
    p, g, m, v = (t.double() for t in (p, g, m, v))
    p = p * (1 - lr * weight_decay)
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = v.sqrt() / (1 - beta2**step) ** 0.5 + eps
    return p - lr / (1 - beta1**step) * m / denom, m, v


def one_ulp(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at each reference value: a correctly rounded fp32 computation lands within it."""
    mantissa_bits = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    exponent = torch.floor(torch.log2(reference.abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(exponent - mantissa_bits) + 1e-12


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.bfloat16,), (torch.float16, torch.bfloat16)])
def test_one_call_updates_every_tensor_as_float64_would_within_one_rounding(dtypes):
    """Several tensors per call (sizes across block boundaries, one empty), mixed dtypes, each at its own step."""
    sizes = [1, 4095, 4096 * 2 + 3, 0, int(torch.randint(1, 5000, ()).item())]
    dtype_of = [dtypes[i % len(dtypes)] for i in range(len(sizes))]
    p = [torch.randn(n).to(dt) for n, dt in zip(sizes, dtype_of)]
    g = [torch.randn(n).to(dt) for n, dt in zip(sizes, dtype_of)]
    m = [torch.randn(n).to(dt) for n, dt in zip(sizes, dtype_of)]
    v = [(torch.rand(n) * 0.1).to(dt) for n, dt in zip(sizes, dtype_of)]
    steps = [int(s) for s in torch.randint(1, 50, (len(sizes),))]
    expected = [adamw_float64(*t, s, 3e-3, 0.9, 0.95, 1e-8, 0.1) for *t, s in zip(p, g, m, v, steps)]
    m_scales = [0.9 * a.double().abs() + 0.1 * b.double().abs() for a, b in zip(m, g)]  # the moment's sum may cancel
    originals, grads_before = [t.clone() for t in p], [t.clone() for t in g]
    adamw.adamw_update(p, g, m, v, steps, 3e-3, 0.9, 0.95, 1e-8, 0.1)
    moved_beyond_rounding = 0
    for i, dtype in enumerate(dtype_of):
        assert torch.equal(g[i], grads_before[i]), "the gradient is read only"
        scales = (torch.maximum(expected[i][0].abs(), originals[i].double().abs()), m_scales[i], expected[i][2])
        for got, ref, scale, name in zip((p[i], m[i], v[i]), expected[i], scales, ("param", "exp_avg", "exp_avg_sq")):
            err = (got.double() - ref).abs()
            bound = one_ulp(scale, dtype) * (2 if dtype != torch.float32 else 8)
            assert bool((err <= bound).all()), f"tensor {i} {name}: worst {err.max().item():.3g} beyond one rounding"
            if name == "param":
                # where float64 moves a parameter by more than the rounding allowed, the kernel must have written it;
                # a step within one rounding may land on either neighbour, the original among them
                moved = (ref - originals[i].double()).abs() > bound
                assert bool((p[i][moved] != originals[i][moved]).all()), f"tensor {i}: parameters left unwritten"
                moved_beyond_rounding += int(moved.sum())
    assert moved_beyond_rounding > 0  # the draw exercised updates that a kernel writing nothing would fail


def test_triton_adamw_tracks_torch_adamw_in_float32_over_steps():
    params = [torch.nn.Parameter(torch.randn(shape)) for shape in ((300, 17), (5,), (4096,))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    ours, theirs = TritonAdamW(params, **HYPER), torch.optim.AdamW(twins, foreach=False, **HYPER)
    schedules = [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in (ours, theirs)]
    for _ in range(5):
        for p, q in zip(params, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        params[1].grad = twins[1].grad = None  # a parameter without a gradient this step is left alone
        ours.step(), theirs.step()
        for s in schedules:
            s.step()
    for p, q in zip(params, twins):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert ours.state_dict()["state"].keys() == theirs.state_dict()["state"].keys()


def test_state_moves_between_torch_adamw_and_triton_adamw():
    params = [torch.nn.Parameter(torch.randn(64, 8))]
    theirs = torch.optim.AdamW(params, foreach=False, **HYPER)
    params[0].grad = torch.randn(64, 8)
    theirs.step()
    ours = TritonAdamW(params, **HYPER)
    ours.load_state_dict(copy.deepcopy(theirs.state_dict()))  # torch shares a CPU step tensor between loads
    twin = [torch.nn.Parameter(params[0].detach().clone())]
    again = torch.optim.AdamW(twin, foreach=False, **HYPER)
    again.load_state_dict(copy.deepcopy(theirs.state_dict()))
    params[0].grad = torch.randn(64, 8)
    twin[0].grad = params[0].grad.clone()
    ours.step(), again.step()
    assert ours.state[params[0]]["step"].item() == 2
    torch.testing.assert_close(params[0], twin[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "options, words",
    [
        ({"amsgrad": True}, "amsgrad"),
        ({"maximize": True}, "maximize"),
        ({"lr": torch.tensor(1e-3)}, "tensor learning rate"),
    ],
)
def test_options_the_kernel_lacks_are_refused_when_built(options, words):
    with pytest.raises(ValueError, match=words):
        TritonAdamW([torch.nn.Parameter(torch.randn(4))], **options)


def test_non_contiguous_parameters_are_refused():
    weight = torch.nn.Parameter(torch.randn(4, 6).t())
    with pytest.raises(ValueError, match="non-contiguous"):
        TritonAdamW([weight])


def test_build_adamw_takes_the_kernel_only_where_asked_or_measured_faster():
    from operators.optim import build_adamw

    params = [torch.nn.Parameter(torch.randn(8))]
    auto, why = build_adamw(params, "auto", lr=1e-3)
    assert type(auto) is torch.optim.AdamW and why == "torch AdamW", "auto on a CPU is torch's AdamW"
    insisted, why = build_adamw(params, "adapt", lr=1e-3)
    assert isinstance(insisted, TritonAdamW) and why.startswith("adapt AdamW")
    with pytest.raises(ValueError, match="amsgrad"):
        build_adamw(params, "adapt", lr=1e-3, amsgrad=True)
    with pytest.raises(ValueError, match="one of auto, adapt, torch"):
        build_adamw(params, "fast")
