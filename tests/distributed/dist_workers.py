"""Distributed test worker, run under torchrun by the tests: trains each named case and saves what it saw.

Usage: ``torchrun --nproc-per-node N dist_workers.py OUT_DIR MODELS_JSON CASE [CASE ...]``.  Rank 0 writes
``OUT_DIR/<case>.pt`` with per-step losses and gradient norms and the gathered final weights.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from adapt.runtime import checkpoint
from adapt.runtime.runner import prepare
from adapt.runtime.trainer import TrainConfig
from parallel_planner.plan import ParallelPlan

STEPS = 5
BASE = {"precision": "fp32", "seq_len": 16, "global_batch": 4}
TRAIN = TrainConfig(steps=STEPS, lr=2e-3, warmup_steps=2, max_grad_norm=1.0, seed=0)

# case -> (model, plan overrides)
CASES: dict[str, tuple[str, dict]] = {
    "ref_llama": ("llama", {}),
    "ref_llama4": ("llama4", {}),
    "ref_llama_mha": ("llama_mha", {}),
    "ref_qwen3": ("qwen3", {}),
    "ref_qwen3_moe": ("qwen3_moe", {}),
    "ref_mixtral": ("mixtral", {}),
    "ref_custom": ("custom", {}),
    "ref_llama_random": ("llama_random", {}),
    "zero3": ("llama", {"dp_shard": 2, "zero": 3}),
    "zero2": ("llama", {"dp_shard": 2, "zero": 2, "recompute": "selective"}),
    "zero1": (
        "llama",
        {"dp_shard": 2, "zero": 1, "grad_accum": 2, "recompute": "full"},
    ),
    "tp_sp_gqa": ("llama", {"tp": 2, "sequence_parallel": True}),
    "tp_sp_mha": ("llama_mha", {"tp": 2, "sequence_parallel": True}),
    "tp_gqa_no_sp": ("llama", {"tp": 2, "sequence_parallel": False}),
    "tp_sp_vocab_qknorm_tied": (
        "qwen3",
        {"tp": 2, "sequence_parallel": True, "vocab_parallel": True},
    ),
    "tp_sp_remote_code": ("custom", {"tp": 2, "sequence_parallel": True}),
    "tp_random_init_synced": ("llama_random", {"tp": 2, "dp_shard": 1}),
    "pp_1f1b": ("llama", {"pp": 2, "grad_accum": 2, "pp_schedule": "1f1b"}),
    "pp_gpipe": ("llama", {"pp": 2, "grad_accum": 2, "pp_schedule": "gpipe"}),
    "pp_zero_bubble": (
        "llama4",
        {"pp": 2, "vpp": 2, "grad_accum": 2, "pp_schedule": "zero_bubble"},
    ),
    "zero0_replicate": ("llama", {"dp_replicate": 2, "dp_shard": 1, "zero": 0}),
    "hsdp": ("llama", {"dp_replicate": 2, "dp_shard": 2}),
    "pp_interleaved": (
        "llama4",
        {"pp": 2, "vpp": 2, "grad_accum": 2, "pp_schedule": "interleaved_1f1b"},
    ),
    "ep_qwen3_moe": ("qwen3_moe", {"dp_shard": 2, "ep": 2}),
    "ep_mixtral": ("mixtral", {"dp_shard": 2, "ep": 2}),
    "fsdp_tp": ("llama", {"dp_shard": 2, "tp": 2}),
    "pp_fsdp": ("llama", {"pp": 2, "dp_shard": 2, "grad_accum": 2}),
    "pp_end_chunks": (
        "llama4",
        {"pp": 2, "vpp": 2, "grad_accum": 2, "pp_schedule": "interleaved_1f1b", "stage_layers": [0, 2, 2, 0]},
    ),
    "pp_tied": ("qwen3", {"pp": 2, "grad_accum": 2, "pp_schedule": "1f1b"}),
    "pp_fsdp_tied": ("qwen3", {"pp": 2, "dp_shard": 2, "grad_accum": 2}),
    "pp_tp": ("llama", {"pp": 2, "tp": 2, "grad_accum": 2}),
    "ep_fsdp": ("qwen3_moe", {"dp_shard": 4, "ep": 2}),
    # The adapted model: adapt's kernel plan, blocks compiled (aot_eager on CPU), under each layout.
    "adapted_tp_sp": ("llama", {"tp": 2, "sequence_parallel": True}),
    "adapted_fsdp": ("llama", {"dp_shard": 2, "recompute": "selective"}),
    "adapted_pp": ("llama4", {"pp": 2, "vpp": 2, "grad_accum": 2, "pp_schedule": "interleaved_1f1b"}),
}
ADAPTED_BACKEND = "aot_eager"


def load(models: dict[str, str], name: str) -> torch.nn.Module:
    """The zoo checkpoint through HF's loader (or a config-only random init for ``llama_random``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name == "llama_random":  # config-only, seeded by rank: ranks start from different weights
        torch.manual_seed(dist.get_rank() if dist.get_world_size() > 1 else 0)
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(models["llama"]), dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32, trust_remote_code=True)


def spec_of(models: dict[str, str], name: str, model: torch.nn.Module):
    """The intake's ModelSpec: head geometry for models whose config uses its own field names."""
    from adapt.model.intake import build_spec, resolve_source

    return build_spec(resolve_source(models[name], trust_remote_code=True), model=model)


def train_case(models: dict[str, str], case: str) -> dict:
    model_name, overrides = CASES[case]
    model = load(models, model_name)
    spec = spec_of(models, model_name, model) if overrides.get("tp", 1) > 1 and model_name in models else None
    adapt = adapt_options(model) if case.startswith("adapted_") else None
    run = prepare(model, ParallelPlan(**BASE, **overrides), TRAIN, spec=spec, adapt=adapt)
    initial = checkpoint.gather_full_state_dict(run.pmodel)
    steps = [run.trainer.train_step() for _ in range(STEPS)]
    params = checkpoint.gather_full_state_dict(run.pmodel)
    losses, norms = [s.loss for s in steps], [s.grad_norm for s in steps]
    adapted = run.pmodel.adapted.to_dict()
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, adapted)
    return {"losses": losses, "grad_norms": norms, "initial": initial, "params": params, "adapted": reports}


def adapt_options(model: torch.nn.Module):
    """The operators stage's kernel plan for ``model`` (float32 training on this machine), compiled blocks."""
    from adapt.runtime.adapted import AdaptOptions
    from operators import load_profile, plan_kernels, recognise
    from operators.inventory import trace_model
    from operators.registry import Target

    inventory = trace_model(model)
    plan = plan_kernels(inventory, recognise(model, inventory), load_profile("cuda-hopper"), Target.here())
    return AdaptOptions(kernel_plan=plan, compile=ADAPTED_BACKEND)


def probe_logits(run, vocab: int) -> torch.Tensor | None:
    """Logits of a fixed batch (non-pipelined layouts), as seen by rank 0."""
    probe = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        return run.pmodel.chunks[0](input_ids=probe, use_cache=False).logits.detach().clone()


def checkpoint_case(
    models: dict[str, str],
    out: Path,
    model_name: str,
    save_plan: dict,
    load_plan: dict,
    tag: str,
) -> dict:
    """Train 2 steps under ``save_plan`` and save; load into ``load_plan`` (poisoned first); both continue 2 steps."""
    ckpt = out / f"dcp_{tag}"
    first = prepare(load(models, model_name), ParallelPlan(**BASE, **save_plan), TRAIN)
    for _ in range(2):
        first.trainer.train_step()
    checkpoint.save(ckpt, first.pmodel, first.trainer.optimizers, first.trainer.step)
    vocab = first.model_config.vocab_size
    saved_logits = probe_logits(first, vocab)
    first_losses = [first.trainer.train_step().loss for _ in range(2)]
    first_params = checkpoint.gather_full_state_dict(first.pmodel)

    fresh = load(models, model_name)
    with torch.no_grad():
        for param in fresh.parameters():
            param.fill_(float("nan"))  # everything must come from the checkpoint
    second = prepare(fresh, ParallelPlan(**BASE, **load_plan), TRAIN)
    second.trainer.restore(checkpoint.load(ckpt, second.pmodel, second.trainer.optimizers))
    loaded_step = second.trainer.step
    loaded_logits = probe_logits(second, vocab)
    second_losses = [second.trainer.train_step().loss for _ in range(2)]
    second_params = checkpoint.gather_full_state_dict(second.pmodel)
    export = checkpoint.export_hf(out / f"hf_{tag}", second.pmodel, second.model_config)
    return {
        "loaded_step": loaded_step,
        "saved_logits": saved_logits,
        "loaded_logits": loaded_logits,
        "first_losses": first_losses,
        "second_losses": second_losses,
        "first_params": first_params,
        "second_params": second_params,
        "export_dir": str(export) if export else None,
    }


def cp_plumbing_case(models: dict[str, str]) -> dict:
    """Context parallelism on CPU: the guard refuses; the sequence sharding the trainer uses is checked."""
    from torch.distributed.device_mesh import init_device_mesh

    from adapt.core.errors import BadInput
    from adapt.runtime.context_parallel import (
        context_parallel_batch,
        position_ids_for,
    )

    try:
        prepare(load(models, "llama"), ParallelPlan(**BASE, cp=2), TRAIN)
        refused = ""
    except BadInput as err:
        refused = str(err)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(3))
    inputs, labels = tokens[:, :-1].clone(), tokens[:, 1:].clone()
    positions = position_ids_for(inputs)
    with context_parallel_batch(
        init_device_mesh("cpu", (2,), mesh_dim_names=("cp",)),
        [inputs, labels, positions],
    ):
        shards = {
            "inputs": inputs.clone(),
            "labels": labels.clone(),
            "positions": positions.clone(),
        }
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, shards)
    return {"refused": refused, "tokens": tokens, "shards": gathered}


CHECKPOINT_CASES = {
    "dcp_fsdp_to_tp": ("llama", {"dp_shard": 2}, {"tp": 2}),
    "dcp_ep_to_fsdp": ("qwen3_moe", {"dp_shard": 2, "ep": 2}, {"dp_shard": 2}),
}


def main() -> None:
    out, models = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case in sys.argv[3:]:
        if case == "cp_plumbing":
            result = cp_plumbing_case(models)
        elif case in CHECKPOINT_CASES:
            model_name, save_plan, load_plan = CHECKPOINT_CASES[case]
            result = checkpoint_case(models, out, model_name, save_plan, load_plan, case)
        else:
            result = train_case(models, case)
        if dist.get_rank() == 0:
            torch.save(result, out / f"{case}.pt")
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    main()
