"""Kernel providers and the conditions under which each of their kernels may be chosen.

A provider declares, per component kind, which kernels it implements and the conditions they
need (device, dtype, training, shape limits, compute capability, interpreter).  ``options`` only
returns kernels whose conditions hold for the target, and the plan runs an option's ``verify`` before it uses
it, so a chosen kernel is a kernel that runs: nothing falls back silently.  A kernel option carries ``make_forward``, the replacement forward the
patcher installs; ``None`` means the model already runs this kernel and nothing needs patching.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from operators.recognition.component import Component


@dataclass
class Target:
    """Where the adapted model will run."""

    device: str = "cuda"  # "cuda", "cpu", or a profile's device name
    dtype: str = "bfloat16"
    training: bool = True
    compute_capability: tuple[int, int] | None = (9, 0)
    prefer: list[str] = field(default_factory=list)  # provider names to rank first (tests, user choice)

    @classmethod
    def here(cls, dtype: str = "float32", training: bool = True) -> Target:
        """The machine this process runs on."""
        if torch.cuda.is_available():
            return cls("cuda", dtype, training, torch.cuda.get_device_capability())
        return cls("cpu", dtype, training, None)

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "dtype": self.dtype,
            "training": self.training,
            "compute_capability": self.compute_capability,
            "prefer": self.prefer,
        }


ForwardFactory = Callable[[nn.Module, Component], Callable[..., Any]]


@dataclass
class KernelOption:
    provider: str
    kernel: str
    status: str  # "fused" or "native"
    make_forward: ForwardFactory | None  # None: already in the model's graph, nothing to patch
    requires_ops: list[str] = field(default_factory=list)  # ATen overloads the kernel dispatches (checked vs profile)
    needs_codegen: str | None = None  # e.g. "triton": only where the profile can run Triton
    note: str = ""
    keeps_less: str = ""  # what it spares the backward's saved activations: preferred at equal speed (benchmark)
    # The provider's check of the kernels behind this option (a self-test against float64), run before the option
    # is used: None when it passed, else why not.  Run on the winner only, so a cold plan does not compile and check
    # kernels that lose the timing.
    verify: Callable[[], str | None] | None = field(default=None, compare=False)

    def check_failure(self) -> str | None:
        """Why ``verify`` refused this option; None when it passed or there is nothing to check."""
        return self.verify() if self.verify else None

    @property
    def inductor_rewrites(self) -> bool:
        """Whether compiling this option changes the kernels it runs.  A hand kernel (one that ships its own Triton
        code: our ``torch.library`` operators, Liger's autograd functions) stays an opaque call under Inductor, and
        the GEMMs beside it stay library calls; ATen's paths (fused norms, decompositions, the module's own forward)
        are what Inductor rewrites into its own kernels."""
        return self.needs_codegen != "triton"

    @property
    def lowered_like_own_forward(self) -> bool:
        """A replacement forward of plain ATen ops: under compile Inductor lowers it into its own kernels for the
        arithmetic the module's own forward does, so inside a compiled block it is that forward by another route
        (on the H200, ``F.rms_norm`` compiled and the norms' own forwards compiled timed within 2% of each other on
        Llama, Gemma-2 and Qwen3, the own forward ahead on Qwen3's per-head norms: ops-cold-h200.md)."""
        return self.make_forward is not None and self.inductor_rewrites


class Provider(Protocol):
    name: str

    def available(self, target: Target) -> tuple[bool, str]: ...

    def options(self, component: Component, target: Target) -> list[KernelOption]: ...
