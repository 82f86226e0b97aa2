"""Operator inventory, structural recognition, kernel mapping and patching (the operators stage).

Public API:

- ``build_inventory(model_or_spec, ...) -> OpInventory``: every ATen op (overload, count, owning
  module, shapes, dtypes, core-ATen membership), forward and backward; meta tracing for giants.
- ``recognise(model, inventory) -> Recognition``: components by traced structure, confirmed by
  float64 numeric probes; look-alikes are rejected.
- ``plan_kernels(inventory, components, profile, target) -> KernelPlan``: fused / native /
  decomposed / generated / unsupported for every component and op under a backend profile.
- ``apply_kernel_plan(model, plan) -> PatchHandle``: in-place, reversible (``handle.revert()``),
  ``state_dict`` untouched.  The validation stage calls it on a freshly loaded model.
- ``run_ops(src, profile=None, out_dir=None) -> OpsReport``: the whole stage (``adapt ops``/``adapt run``).
- ``adapt_model(model, plan) -> PatchHandle``: the adapted configuration (kernels patched in, then
  compiled as ``plan.compile`` says); what trainer, bench, benchmarks and alignment run.
"""

from operators.api import OpsReport, PatchCheck, adapt_model, build_inventory, check_kernel_plan, run_ops
from operators.inventory import OpInventory
from operators.mapping import KernelPlan, plan_kernels
from operators.patch import PatchHandle, apply_kernel_plan
from operators.profiles import BackendProfile, load_profile
from operators.recognition import Component, Recognition, recognise
from operators.registry import Target

__all__ = [
    "BackendProfile", "Component", "KernelPlan", "OpInventory", "OpsReport", "PatchCheck", "PatchHandle", "Recognition",
    "Target", "adapt_model", "apply_kernel_plan", "build_inventory", "check_kernel_plan", "load_profile", "plan_kernels", "recognise",
    "run_ops",
]  # fmt: skip
