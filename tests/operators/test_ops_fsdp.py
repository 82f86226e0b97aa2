"""A patched model keeps working when FSDP2 (``fully_shard``) wraps it afterwards (gloo, one rank)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import sys, torch, torch.distributed as dist
    sys.path.insert(0, {here!r})
    from torch.distributed.fsdp import fully_shard
    from operators import Target, apply_kernel_plan, load_profile, plan_kernels, recognise
    from operators.inventory import trace_model
    from adapt.model.blocks import find_blocks
    from ops_testlib import load

    dist.init_process_group("gloo", store=dist.FileStore({store!r}, 1), rank=0, world_size=1)
    reference, model = load({path!r}), load({path!r})
    inv = trace_model(model)
    plan = plan_kernels(inv, recognise(model, inv), load_profile("cuda-hopper"), Target.here())
    handle = apply_kernel_plan(model, plan)
    for block in find_blocks(model):
        fully_shard(block)
    fully_shard(model)
    ids = torch.randint(0, 256, (2, 12))
    out = model(input_ids=ids).logits
    out.pow(2).mean().backward()
    ref = reference(input_ids=ids).logits
    ref.pow(2).mean().backward()
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6), (out - ref).abs().max()
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        grad = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        assert torch.allclose(grad, q.grad, rtol=1e-4, atol=1e-6), name
    assert len(handle.patched) == sum(c.patch for c in plan.components) >= 5
    dist.destroy_process_group()
    print("ok")
    """
)


def test_patched_model_under_fully_shard(zoo, tmp_path):
    script = SCRIPT.format(here=str(Path(__file__).parent), path=str(zoo("llama")), store=str(tmp_path / "store"))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
