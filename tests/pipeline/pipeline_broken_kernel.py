"""The broken-kernel fixture: the kernel plan is applied for real, then block 1's post-attention norm
is made 1% off, as a subtly wrong fused RMSNorm kernel would be.  Used in-process (monkeypatch)
and, through ``CONFTEST``, inside a pytest subprocess."""

from __future__ import annotations

BROKEN_MODULE = "model.layers.1.post_attention_layernorm"


def broken_apply_kernel_plan(real_apply):
    def apply(model, plan):
        handle = real_apply(model, plan)
        model.get_submodule(BROKEN_MODULE).register_forward_hook(lambda module, args, out: out * 1.01)
        return handle

    return apply


CONFTEST = f'''
import operators

_real = operators.apply_kernel_plan


def _broken(model, plan):
    handle = _real(model, plan)
    model.get_submodule("{BROKEN_MODULE}").register_forward_hook(lambda module, args, out: out * 1.01)
    return handle


operators.apply_kernel_plan = _broken
'''
