"""Apply a KernelPlan to an instantiated model in place, reversibly.

Each patched module gets an instance-level ``forward`` that calls the chosen kernel with the
module's *own* parameters, looked up by name on every call.  Parameters, buffers and module
structure are untouched, so ``state_dict`` keys and tensors stay identical, and wrappers that work
through hooks and parameter swaps (FSDP2 ``fully_shard``, DTensor TP) keep working on top.
Attention is switched through transformers' attention-function hook: the attention module gets a
private config copy selecting the ``adapt`` function, which runs SDPA/FlexAttention with the
recognised parameters.  A replacement forward may carry ``release``, undoing process-wide state it
set up: rotary embedding swaps a function in the modelling module's globals (``operators.global_swap``,
reference-counted across modules and models).  The fused loss is installed on the module that owns
the vocabulary projection (``get_output_embeddings()``), not on the projection itself.  A fused
residual-add + norm hooks the children of the block whose own code runs the add
(``triton_residual``) and wraps the norm's forward last, over whatever the other choices gave it.
An attention whose SDPA backend was measured (``KernelChoice.backend``) runs under ``sdpa_kernel`` with that
backend alone, whether or not anything else in it is patched.
``PatchHandle.revert()`` restores every forward, config and global it changed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from operators.generated import GeneratedKernel, compile_module
from operators.mapping import KernelChoice, KernelPlan
from operators.providers import providers, torch_native
from operators.providers.triton_head import head_owner
from operators.providers.triton_residual import FusionTarget
from operators.recognition.component import Component
from operators.registry import Target

_MISSING = object()


@dataclass
class PatchHandle:
    model: nn.Module
    forwards: list[tuple[nn.Module, Any]] = field(
        default_factory=list
    )  # (module, previous instance forward or _MISSING)
    configs: list[tuple[nn.Module, Any]] = field(default_factory=list)  # (attention module, its shared config)
    attention_modules: list[nn.Module] = field(default_factory=list)
    patched: list[str] = field(default_factory=list)  # "module: provider/kernel"
    generated: list[GeneratedKernel] = field(default_factory=list)
    releases: list[Callable[[], None]] = field(default_factory=list)  # undo state beyond forwards (globals, hooks)
    fusion_targets: list[FusionTarget] = field(default_factory=list)  # fused residual-add + norm pairs
    fallbacks: list[str] = field(default_factory=list)  # generated kernels that gave way to their module's forward
    active: bool = True

    def revert(self) -> None:
        """Undo every change, newest first; idempotent."""
        if not self.active:
            return
        for module, previous in reversed(self.forwards):
            if previous is _MISSING:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        for module, shared in reversed(self.configs):
            module.config = shared
        for module in self.attention_modules:
            torch_native.forget_attention(module)
        for release in reversed(self.releases):
            release()
        self.active = False

    def attention_calls(self) -> int:
        """How many times the adapt attention kernel ran since patching (proves it is on the path)."""
        return sum(torch_native.attention_calls(m) for m in self.attention_modules)

    def residual_fusion(self) -> dict[str, int]:
        """Fused residual-add + norm pairs; norm calls they served; times they ran unfused; pairs never used."""
        targets = self.fusion_targets
        return {
            "pairs": len(targets),
            "fused": sum(t.fused for t in targets),
            "missed": sum(t.missed for t in targets),
            "idle": sum(t.fused == 0 for t in targets),
        }

    def __enter__(self) -> PatchHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.revert()


def apply_kernel_plan(model: nn.Module, plan: KernelPlan) -> PatchHandle:
    """Install every ``patch=True`` decision of ``plan`` on ``model``; returns the handle to revert.

    Usable on any freshly loaded instance of the same architecture (module paths must exist).
    """
    handle = PatchHandle(model)
    options = {p.name: p for p in providers()}
    target = Target(**plan.target)
    try:  # residual-add + norm last: it wraps the norm's forward as the other choices left it
        for choice in sorted(plan.components, key=lambda c: c.kind == "residual_add_norm"):
            if not choice.patch:
                continue
            module = model.get_submodule(choice.module)
            if choice.status == "generated":
                _install(handle, module, compile_module(module, choice.module, handle.fallbacks.append))
            elif choice.kind == "attention":
                _install_attention(handle, module, choice)
            elif choice.kind == "residual_add_norm":
                pair = _factory(options, choice, target)(model.get_submodule(choice.variant.add_in), _component(choice))
                _install(handle, pair.norm, pair.forward)
                handle.releases.append(pair.release)
                handle.fusion_targets.append(pair.target)
            else:
                factory = _factory(options, choice, target)
                if choice.kind == "lm_head_cross_entropy":
                    module = head_owner(model, module)
                _install(handle, module, factory(module, _component(choice)))
            handle.patched.append(f"{choice.module}: {choice.provider}/{choice.kernel}")
        for choice in plan.components:  # patched or already in the graph, attention runs the backend measured fastest
            if choice.kind == "attention" and choice.backend:
                module = model.get_submodule(choice.module)
                _install(handle, module, _pinned_sdpa(module.forward, choice.backend))
    except Exception:
        handle.revert()
        raise
    return handle


def _component(choice: KernelChoice) -> Component:
    return Component(choice.module, choice.kind, choice.variant, choice.confirmed)


def _factory(provs: dict[str, Any], choice: KernelChoice, target: Target):
    for opt in provs[choice.provider].options(_component(choice), target):
        if opt.kernel == choice.kernel and opt.make_forward is not None:
            failure = opt.check_failure()
            if failure:
                raise RuntimeError(f"{choice.provider}:{choice.kernel} failed its check on {target.device}: {failure}")
            return opt.make_forward
    raise RuntimeError(f"{choice.provider} does not offer {choice.kernel} for {choice.module} on {target.device}")


def _install(handle: PatchHandle, module: nn.Module, forward) -> None:
    if getattr(forward, "release", None) is not None:
        handle.releases.append(forward.release)
    handle.forwards.append((module, module.__dict__.get("forward", _MISSING)))
    module.forward = forward


def _pinned_sdpa(forward: Callable[..., Any], backend: str) -> Callable[..., Any]:
    """``forward`` with SDPA restricted to ``backend`` (a key of ``operators.benchmark.SDPA_BACKENDS``)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from operators.benchmark import SDPA_BACKENDS

    chosen = [getattr(SDPBackend, SDPA_BACKENDS[backend])]

    def pinned(*args: Any, **kwargs: Any) -> Any:
        with sdpa_kernel(chosen):
            return forward(*args, **kwargs)

    return pinned


def _install_attention(handle: PatchHandle, module: nn.Module, choice: KernelChoice) -> None:
    """Give the module a private shallow copy of its config that selects the ``adapt`` attention function.

    Model-level code (mask construction) and every unpatched module keep the shared config, so only
    this module's attention core changes.
    """
    _register_hook()
    torch_native.attention_forward(module, _component(choice))
    handle.attention_modules.append(module)
    private = copy.copy(module.config)
    private._attn_implementation = torch_native.ATTENTION_HOOK_NAME
    handle.configs.append((module, module.config))
    module.config = private


def _register_hook() -> None:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(torch_native.ATTENTION_HOOK_NAME, torch_native.adapt_attention)
    AttentionMaskInterface.register(torch_native.ATTENTION_HOOK_NAME, sdpa_mask)
