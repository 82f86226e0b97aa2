"""Choosing among kernels by measurement on CUDA: the module's own traced path competes for hidden->hidden kinds.

There is no GPU here, so the timing itself (``operators.benchmark.measure``) is replaced by given figures; what
is checked is which candidates are timed, that the fastest wins even when it is the model's own path, that
the choice says why, and that the cache answers the second time.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from operators import benchmark
from operators.mapping import _choose
from operators.recognition import Component
from operators.recognition.variants import AttentionVariant, GatedMLPVariant, MoEVariant, RMSNormVariant
from operators.registry import KernelOption, Target

CUDA = Target("cuda", "bfloat16", True, (9, 0))


class Provider:
    def __init__(self, name: str, options: list[KernelOption]):
        self.name, self._options = name, options

    def options(self, component, target):
        return self._options


def provider_options():
    kernel = KernelOption("kernels", "grouped", "fused", lambda module, component: module.forward)
    traced = KernelOption("native", "as traced", "native", None)
    return [Provider("kernels", [kernel]), Provider("native", [traced])]


class Profile:
    codegen = "triton"

    def supports_aten(self, *args) -> bool:
        return True


def test_the_models_own_path_wins_when_it_is_faster(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "test device")
    timed: list[list[str]] = []

    def measure(options, comp, target, module, compiled=False):
        timed.append([f"{o.provider}:{o.kernel}" for o in options])
        return {"kernels:grouped": 2.5, "native:as traced": 1.5}

    monkeypatch.setattr(benchmark, "measure", measure)
    model = nn.Sequential(nn.Linear(8, 8))
    moe = Component("0", "moe", MoEVariant(width=8, top_k=2), True)
    choice = _choose(moe, provider_options(), Profile(), CUDA, model)
    assert timed == [["kernels:grouped", "native:as traced"]]
    assert (choice.provider, choice.status, choice.patch) == ("native", "native", False)
    assert choice.timings == {"kernels:grouped": 2.5, "native:as traced": 1.5} and choice.margin == pytest.approx(
        2.5 / 1.5, abs=1e-4
    )
    again = _choose(moe, provider_options(), Profile(), CUDA, model)  # from the cache: not timed again
    assert len(timed) == 1 and again.provider == "native"

    # attention has no hidden->hidden forward to time: its one fused kernel is taken without timing
    attention = Component("0", "attention", AttentionVariant(), True)
    assert _choose(attention, provider_options(), Profile(), CUDA, model).provider == "kernels" and len(timed) == 1


def _fake_cuda(monkeypatch, tmp_path, figures: dict[str, float]) -> list[tuple[list[str], bool]]:
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "test device")
    timed: list[tuple[list[str], bool]] = []

    def measure(options, comp, target, module, compiled=False):
        names = [f"{o.provider}:{o.kernel}" for o in options]
        timed.append((names, compiled))
        return {name: figures[name] for name in names}

    monkeypatch.setattr(benchmark, "measure", measure)
    return timed


def norm_providers():
    kernel = KernelOption(
        "adapt", "rms_norm", "fused", lambda module, component: module.forward, needs_codegen="triton"
    )
    return [Provider("adapt", [kernel])]


def test_under_compile_a_hand_kernel_must_beat_inductor_on_its_own_forward(monkeypatch, tmp_path):
    timed = _fake_cuda(monkeypatch, tmp_path, {"adapt:rms_norm": 0.30, "inductor:own forward, compiled": 0.20})
    model = nn.Sequential(nn.LayerNorm(8))
    norm = Component("0", "rms_norm", RMSNormVariant(width=8, eps=1e-6), True)
    choice = _choose(norm, norm_providers(), Profile(), CUDA, model, compiled=True)
    assert timed == [(["adapt:rms_norm", "inductor:own forward, compiled"], True)]
    assert (choice.provider, choice.status, choice.patch) == ("inductor", "native", False)
    assert choice.timings == {"adapt:rms_norm": 0.30, "inductor:own forward, compiled": 0.20}
    assert choice.margin == 1.5


def test_under_compile_an_aten_replacement_is_not_timed_beside_the_own_forward(monkeypatch, tmp_path):
    """Inductor lowers an ATen replacement (``F.rms_norm``) and the module's own forward alike: only the own forward
    and the hand kernels are compiled and timed, and a replacement alone leaves the own forward, untimed."""
    figures = {"adapt:rms_norm": 0.30, "inductor:own forward, compiled": 0.20, "torch:F.rms_norm": 0.10}
    timed = _fake_cuda(monkeypatch, tmp_path, figures)
    aten = Provider("torch", [KernelOption("torch", "F.rms_norm", "fused", lambda module, component: module.forward)])
    model = nn.Sequential(nn.LayerNorm(8))
    norm = Component("0", "rms_norm", RMSNormVariant(width=8, eps=1e-6), True)
    choice = _choose(norm, [aten, *norm_providers()], Profile(), CUDA, model, compiled=True)
    assert timed == [(["adapt:rms_norm", "inductor:own forward, compiled"], True)]
    assert (choice.provider, choice.patch) == ("inductor", False)
    alone = _choose(norm, [aten], Profile(), CUDA, model, compiled=True)
    assert (alone.provider, alone.patch, alone.timings) == ("inductor", False, {}) and len(timed) == 1
    # eager, the replacement is what it is: it competes with the hand kernel
    eager = _choose(norm, [aten, *norm_providers()], Profile(), CUDA, model, compiled=False)
    assert timed[-1] == (["torch:F.rms_norm", "adapt:rms_norm"], False) and eager.provider == "torch"


def test_a_hand_kernel_that_beats_inductor_stays_and_eager_timings_are_kept_apart(monkeypatch, tmp_path):
    timed = _fake_cuda(monkeypatch, tmp_path, {"adapt:rms_norm": 0.10, "inductor:own forward, compiled": 0.25})
    model = nn.Sequential(nn.LayerNorm(8), nn.LayerNorm(8))
    norm = Component("0", "rms_norm", RMSNormVariant(width=8, eps=1e-6), True)
    choice = _choose(norm, norm_providers(), Profile(), CUDA, model, compiled=True)
    assert (choice.provider, choice.patch, choice.margin) == ("adapt", True, 2.5)
    # eager: the module's own forward only competes when a provider offers it; one kernel is taken untimed
    eager = _choose(norm, norm_providers(), Profile(), CUDA, model, compiled=False)
    assert eager.provider == "adapt" and eager.timings == {} and len(timed) == 1
    # the compiled timings came from the cache: the same shape is never timed twice
    _choose(
        Component("1", "rms_norm", RMSNormVariant(width=8, eps=1e-6), True),
        norm_providers(),
        Profile(),
        CUDA,
        model,
        compiled=True,
    )
    assert len(timed) == 1


def _checked_providers(checks: list[str], verdicts: dict[str, str | None]) -> list[Provider]:
    """Two kernels whose checks record that they ran and answer from ``verdicts``, beside the traced path."""

    def option(name: str) -> KernelOption:
        def verify() -> str | None:
            checks.append(name)
            return verdicts[name]

        return KernelOption(name, "moe", "fused", lambda module, component: module.forward, verify=verify)

    return [Provider("fast", [option("fast")]), Provider("slow", [option("slow")]), provider_options()[1]]


def test_only_the_winner_is_checked_and_one_that_fails_gives_way_to_the_next(monkeypatch, tmp_path):
    figures = {"fast:moe": 1.0, "slow:moe": 2.0, "native:as traced": 3.0}
    timed = _fake_cuda(monkeypatch, tmp_path, figures)
    model = nn.Sequential(nn.Linear(8, 8))
    moe = Component("0", "moe", MoEVariant(width=8, top_k=2), True)
    checks: list[str] = []
    choice = _choose(moe, _checked_providers(checks, {"fast": None, "slow": "wrong"}), Profile(), CUDA, model)
    assert choice.provider == "fast" and checks == ["fast"]  # the losers' kernels are never checked

    checks.clear()
    choice = _choose(moe, _checked_providers(checks, {"fast": "wrong", "slow": None}), Profile(), CUDA, model)
    assert choice.provider == "slow" and checks == ["fast", "slow"]
    assert "fast:moe not used: its check failed (wrong)" in choice.note
    assert len(timed) == 1  # the second ranking read the cache

    checks.clear()
    choice = _choose(moe, _checked_providers(checks, {"fast": "wrong", "slow": "wrong"}), Profile(), CUDA, model)
    assert (choice.provider, choice.patch) == ("native", False) and checks == ["fast", "slow"]


def test_a_candidate_that_cannot_run_is_left_out_and_the_rest_still_compete(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "test device")

    def broken(module, component):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(benchmark, "time_ms", lambda fn, timer: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: self)
    monkeypatch.setattr(torch, "randn", lambda *shape, **kwargs: torch.ones(*shape, requires_grad=True))
    options = [KernelOption("kernels", "broken", "fused", broken), KernelOption("native", "as traced", "native", None)]
    norm = Component("0", "rms_norm", RMSNormVariant(width=8, eps=1e-6), True)
    best, timings = benchmark.fastest(options, norm, CUDA, nn.Sequential(nn.LayerNorm(8)))
    assert (best.provider, list(timings)) == ("native", ["native:as traced"])


def test_a_per_head_norm_is_timed_on_as_many_rows_per_token_as_the_model_gives_it(monkeypatch, tmp_path):
    monkeypatch.setenv("ADAPT_CACHE", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "test device")
    monkeypatch.setattr(benchmark, "time_ms", lambda fn, timer: (fn(), 1.0)[1])
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *args, **kwargs: self)
    shapes = []

    def randn(*shape, **kwargs):
        shapes.append(tuple(shape[0]) if len(shape) == 1 else shape)
        return torch.ones(*shapes[-1], requires_grad=True)

    monkeypatch.setattr(torch, "randn", randn)
    heads = 1 + torch.randint(1, 16, ()).item()
    options = [KernelOption("native", "as traced", "native", None)]
    norm = Component("0", "rms_norm", RMSNormVariant(width=8, eps=1e-6, rows_per_token=heads), True)
    benchmark.fastest(options, norm, CUDA, nn.Sequential(nn.LayerNorm(8)))
    assert shapes == [(1, benchmark.TOKENS, heads, 8)]


def test_a_new_candidate_is_timed_alone_beside_cached_ones(monkeypatch, tmp_path):
    figures = {"kernels:grouped": 2.0, "native:as traced": 3.0, "extra:fast": 1.0}
    timed = _fake_cuda(monkeypatch, tmp_path, figures)
    model = nn.Sequential(nn.Linear(8, 8))
    moe = Component("0", "moe", MoEVariant(width=8, top_k=2), True)
    _choose(moe, provider_options(), Profile(), CUDA, model)
    extra = Provider("extra", [KernelOption("extra", "fast", "fused", lambda module, component: module.forward)])
    choice = _choose(moe, [*provider_options(), extra], Profile(), CUDA, model)
    assert [names for names, _ in timed] == [["kernels:grouped", "native:as traced"], ["extra:fast"]]
    assert choice.provider == "extra" and choice.margin == 2.0


def test_the_same_block_at_another_depth_shares_one_timing(monkeypatch, tmp_path):
    """An MoE variant names its router and expert banks by path: keyed from the component, every depth is one shape."""
    timed = _fake_cuda(monkeypatch, tmp_path, {"kernels:grouped": 2.0, "native:as traced": 3.0})
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8))

    def moe(depth: int, experts: int = 4) -> Component:
        paths = {"router": f"{depth}.gate", "gate_up_bank": f"{depth}.experts.gate_up", "shared_experts": None}
        return Component(str(depth), "moe", MoEVariant(width=8, top_k=2, num_experts=experts, **paths), True)

    first, second = (_choose(moe(d), provider_options(), Profile(), CUDA, model) for d in (0, 1))
    assert len(timed) == 1 and first.timings == second.timings and second.provider == "kernels"
    _choose(moe(2, experts=8), provider_options(), Profile(), CUDA, model)  # another shape is timed on its own
    assert len(timed) == 2


def test_compile_is_planned_on_cuda_and_said_to_be_off_elsewhere():
    from operators.mapping import compile_plan

    assert compile_plan(CUDA, Profile())["mode"] == "blocks"
    cpu = compile_plan(Target("cpu", "float32", True, None), Profile())
    assert cpu["mode"] == "none" and "cpu" in cpu["reason"]
    assert compile_plan(Target("cpu", "float32", True, None), Profile(), "whole")["mode"] == "whole"


def test_repetitions_stop_once_the_spread_is_known():
    steady, noisy = iter([1.0] * 100), iter([1.0, 2.0, 0.5, 3.0] * 25)
    calls = {"steady": 0, "noisy": 0}

    def timer(name, source):
        def run(fn):
            calls[name] += 1
            return next(source)

        return run

    assert benchmark.time_ms(lambda: None, timer("steady", steady), warmup=1) == 1.0
    benchmark.time_ms(lambda: None, timer("noisy", noisy), warmup=1)
    assert calls["steady"] == 1 + benchmark.MIN_REPS
    assert calls["noisy"] > calls["steady"]


def test_a_saved_plan_reads_back_equal(zoo):
    import json

    from operators import run_ops
    from operators.mapping import KernelPlan

    plan = run_ops(str(zoo("llama")), config_only=True).plan
    again = KernelPlan.from_dict(json.loads(json.dumps(plan.to_dict())))
    assert again.to_dict() == plan.to_dict() and again.compile == plan.compile
    # where the plan's seconds went, per component kind, travels with it
    assert set(plan.seconds_by_kind) == {c.kind for c in plan.components}
    assert again.seconds_by_kind == plan.seconds_by_kind and all(t >= 0 for t in plan.seconds_by_kind.values())


def test_the_sdpa_backend_is_pinned_only_when_it_beats_the_default(monkeypatch, tmp_path):
    from operators.mapping import KernelChoice, KernelPlan

    _fake_cuda(monkeypatch, tmp_path, {})
    figures = {"default": 1.0, "flash": 0.8, "cudnn": -1.0, "efficient": 1.4}
    monkeypatch.setattr(benchmark, "_time_sdpa", lambda backend, *args: figures[backend])
    variant = AttentionVariant(num_heads=4, head_dim=16, causal=True, window=None, softcap=None)
    backend, timings, why = benchmark.attention_backend(variant, CUDA)
    assert backend == "flash" and "cudnn" not in timings and "x1.25" in why
    figures["flash"] = 0.99  # within the noise: PyTorch's dispatch stays
    assert benchmark.attention_backend(dataclasses.replace(variant, head_dim=32), CUDA)[0] is None
    assert benchmark.attention_backend(dataclasses.replace(variant, softcap=50.0), CUDA)[0] is None
    off = benchmark.attention_backend(variant, Target("cpu", "float32", True, None))
    assert off[0] is None and off[1] == {} and "CUDA only" in off[2]

    # every path that applies the plan runs attention on the pinned backend, patched or not; revert undoes it
    from operators import apply_kernel_plan

    class Core(nn.Module):
        def forward(self, q):
            return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)

    model = nn.Sequential(Core())
    q = torch.randn(1, 2, 8, 16)
    choice = KernelChoice("0", "attention", variant, "torch-native", "SDPA", "native", True, backend="efficient")
    plan = KernelPlan({}, CUDA.to_dict(), [choice], [], compile={"mode": "none", "reason": "test"})
    handle = apply_kernel_plan(model, plan)
    with pytest.raises(RuntimeError):  # the CPU has no memory-efficient kernel: the pin is what SDPA sees
        model(q)
    handle.revert()
    assert "forward" not in model[0].__dict__
    torch.testing.assert_close(model(q), torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))


class _FakeDevice:
    """A CUDA stand-in whose events read a virtual GPU clock: kernels run when the host enqueues them, unless
    a sleep still holds the GPU, in which case they run back to back after it."""

    def __init__(self, kernel_ms: float, host_ms: float, cycles_per_ms: float = 1000.0) -> None:
        self.kernel_ms, self.host_ms, self.cycles_per_ms = kernel_ms, host_ms, cycles_per_ms
        self.host_clock = self.gpu_free_at = 0.0
        self.sleeps: list[float] = []

    def synchronize(self) -> None:
        self.host_clock = max(self.host_clock, self.gpu_free_at)

    def _sleep(self, cycles: int) -> None:
        self.sleeps.append(cycles / self.cycles_per_ms)
        self.gpu_free_at = max(self.gpu_free_at, self.host_clock) + cycles / self.cycles_per_ms

    def Event(self, enable_timing: bool = True):  # noqa: N802 - torch.cuda's spelling
        device = self

        class _Event:
            def record(self) -> None:
                self.at = max(device.gpu_free_at, device.host_clock)
                device.gpu_free_at = self.at

            def elapsed_time(self, other) -> float:
                return other.at - self.at

            def query(self) -> bool:
                return self.at <= device.host_clock

        return _Event()

    def launch(self) -> None:
        """One host call: ``host_ms`` of host time enqueuing ``kernel_ms`` of GPU work."""
        self.host_clock += self.host_ms
        self.gpu_free_at = max(self.gpu_free_at, self.host_clock) + self.kernel_ms


@pytest.mark.parametrize("kernel_ms,host_ms", [(0.1, 1.0), (2.0, 0.3)])
def test_device_timer_times_the_kernels_not_the_host_that_launches_them(monkeypatch, kernel_ms, host_ms):
    import time as time_module

    device = _FakeDevice(kernel_ms, host_ms)
    monkeypatch.setattr(time_module, "perf_counter", lambda: device.host_clock / 1e3)
    timer = benchmark.DeviceTimer(device)
    timer._cycles_per_ms = 1000.0
    plain = benchmark.time_ms(device.launch, lambda fn: timer._events(fn)[0], warmup=1)
    assert plain == pytest.approx(host_ms + kernel_ms)  # without the sleep the host's enqueue time is timed too
    assert benchmark.time_ms(device.launch, timer, warmup=1) == pytest.approx(kernel_ms)
    assert all(ms <= benchmark.MAX_SLEEP_MS for ms in device.sleeps)


def test_device_timer_lengthens_a_sleep_that_ran_short_of_the_host(monkeypatch):
    """The GPU's clock runs three times the rate the sleep was calibrated at (a cold GPU boosting): each
    planned sleep lasts a third of its plan and ends before the host has enqueued the call.  The timer sees
    the start event already passed, sleeps longer, and still times the kernels alone."""
    import time as time_module

    device = _FakeDevice(kernel_ms=0.05, host_ms=0.8, cycles_per_ms=3000.0)
    monkeypatch.setattr(time_module, "perf_counter", lambda: device.host_clock / 1e3)
    timer = benchmark.DeviceTimer(device)
    timer._cycles_per_ms = 1000.0  # as read at the lower clock
    assert benchmark.time_ms(device.launch, timer, warmup=1) == pytest.approx(0.05)
    assert timer.sleep_scale > 1.0


def test_device_timer_reads_its_sleep_rate_from_the_gpu(monkeypatch):
    import time as time_module

    device = _FakeDevice(kernel_ms=0.05, host_ms=0.8, cycles_per_ms=1700.0)
    monkeypatch.setattr(time_module, "perf_counter", lambda: device.host_clock / 1e3)
    assert benchmark.DeviceTimer(device).cycles_per_ms() == pytest.approx(1700.0)


def test_under_compile_only_the_paths_inductor_rewrites_are_compiled_to_be_timed(monkeypatch):
    """Hand kernels (their own Triton code) are timed as they run inside a compiled block, as themselves;
    ATen's paths, which Inductor turns into its own kernels, are compiled first."""
    from operators.mapping import INDUCTOR_OWN_FORWARD
    from operators.providers import providers

    for provider in providers():  # as on a CUDA machine where every provider loads
        monkeypatch.setattr(type(provider), "available", lambda self, target: (True, ""))
    norm = Component("0", "rms_norm", RMSNormVariant(width=64, eps=1e-6, weight=True, cast="round_then_scale"), True)
    options = {f"{o.provider}:{o.kernel}": o for p in providers() for o in p.options(norm, CUDA)}
    options["inductor"] = INDUCTOR_OWN_FORWARD
    assert {name: o.inductor_rewrites for name, o in options.items()} == {
        "adapt-triton:rms_norm": False,
        "liger:LigerRMSNormFunction": False,
        "torch-native:F.rms_norm": True,
        "inductor": True,
    }


@pytest.mark.parametrize(
    "frugal_ms, chosen",
    [(1.01, "adapt:swiglu_linear"), (1.10, "liger:silu_mul")],
    ids=["within-the-same-speed-keeps-less", "slower-loses"],
)
def test_at_the_same_speed_the_kernel_that_keeps_fewer_activations_is_chosen(monkeypatch, tmp_path, frugal_ms, chosen):
    timed = _fake_cuda(monkeypatch, tmp_path, {"adapt:swiglu_linear": frugal_ms, "liger:silu_mul": 1.00})
    frugal = KernelOption("adapt", "swiglu_linear", "fused", lambda m, c: m.forward, keeps_less="its output")
    plain = KernelOption("liger", "silu_mul", "fused", lambda m, c: m.forward)
    providers = [Provider("liger", [plain]), Provider("adapt", [frugal])]
    mlp = Component("0", "gated_mlp", GatedMLPVariant(width=8, activation="silu"), True)
    choice = _choose(mlp, providers, Profile(), CUDA, nn.Sequential(nn.Linear(8, 8)))
    assert len(timed) == 1 and f"{choice.provider}:{choice.kernel}" == chosen
    if chosen.startswith("adapt"):  # the note says it was not the fastest, by how much, and what it spares
        assert choice.margin == pytest.approx(1.00 / frugal_ms, abs=1e-4) and "its output" in choice.note
    else:
        assert choice.margin == pytest.approx(frugal_ms, abs=1e-4)
