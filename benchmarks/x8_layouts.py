"""The cases of ``benchmarks/x8.py``: model shapes, layouts, run modes, and the planner's plan and prediction for each.

Every layout is the plan the planner itself emits for that pinned layout (``plan_parallel(fixed=...)``), so the
prediction and the measurement describe the same thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoConfig

from adapt.model.intake import inspect
from parallel_planner.cluster import make_cluster
from parallel_planner.search import plan_parallel
from parallel_planner.workload import Workload

# Model shapes.  Tiny CPU widths keep 8 gloo processes on 2 cores inside minutes; 8 heads / 4 kv heads
# so that tp=2 (and tp=4) divide them, 4 layers so that pp=2 stages hold two each, 8 experts for EP8.
CPU_MODELS = {
    "llama": {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "tie_word_embeddings": True, "max_position_embeddings": 256},
    "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                  "moe_intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 8,
                  "num_key_value_heads": 4, "head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "max_position_embeddings": 256},
}  # fmt: skip
# Llama-3.2-1B as in shared/anchors.md; Qwen3-30B-A3B widths with the depth cut to fit one GPU's reference run.
CUDA_MODELS = {
    "llama": {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
              "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
              "tie_word_embeddings": True, "max_position_embeddings": 8192},
    "qwen3_moe": {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
                  "moe_intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 32,
                  "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                  "norm_topk_prob": True, "max_position_embeddings": 8192},
}  # fmt: skip

# Tied embeddings (as Llama-3.2-1B has) cannot be split over pipeline stages by the realisation, so the
# pipelined layout trains the same shape untied, against its own one-process reference.
CPU_MODELS["llama_untied"] = {**CPU_MODELS["llama"], "tie_word_embeddings": False}
CUDA_MODELS["llama_untied"] = {**CUDA_MODELS["llama"], "tie_word_embeddings": False}

# case -> (model, knobs pinned in the planner; None = the planner's own first choice)
LAYOUTS: dict[str, tuple[str, dict | None]] = {
    "fsdp8_zero3": ("llama", {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "ep": 1, "zero": 3}),
    "tp2_fsdp4": ("llama", {"tp": 2, "pp": 1, "dp": 4, "cp": 1, "ep": 1, "zero": 3}),
    "pp2_tp2_fsdp2": ("llama_untied", {"tp": 2, "pp": 2, "dp": 2, "cp": 1, "ep": 1, "zero": 3, "vpp": 1, "schedule": "1f1b"}),
    "planner_top": ("llama", None),
    "ep8": ("qwen3_moe", {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "ep": 8, "zero": 3}),
    "ep4_fsdp2": ("qwen3_moe", {"tp": 1, "pp": 1, "dp": 8, "cp": 1, "ep": 4, "zero": 3}),
}  # fmt: skip


@dataclass(frozen=True)
class ModeConfig:
    device: str
    seq_len: int
    global_batch: int
    micro_batch: int  # pinned in the planner, so every layout's micro-batches have one shape
    warmup_steps: int  # untimed steps (their losses still count for parity)
    timed_steps: int
    parity_steps: int
    loss_rtol: float
    param_tol: dict = field(default_factory=dict)  # empty: weights are not compared
    precision: str = "fp32"


CPU = ModeConfig("cpu", seq_len=32, global_batch=8, micro_batch=1, warmup_steps=0, timed_steps=5, parity_steps=5,
                 loss_rtol=1e-5, param_tol={"rtol": 1e-4, "atol": 2e-5})  # fmt: skip
CUDA = ModeConfig("cuda", seq_len=2048, global_batch=32, micro_batch=4, warmup_steps=5, timed_steps=30,
                  parity_steps=5, loss_rtol=2e-2, precision="bf16")  # fmt: skip


def write_config(name: str, fields: dict, root: Path) -> Path:
    """A config-only model directory: every run initialises it randomly from the same seed (then rank 0's
    weights are broadcast), on CPU exactly as on the GPUs."""
    fields = dict(fields)
    AutoConfig.for_model(fields.pop("model_type"), **fields).save_pretrained(root / name)
    return root / name


def realisable_here(plan, device: str) -> str:
    """Why the realisation cannot run ``plan`` on ``device`` ('' when it can)."""
    if device == "cpu" and plan.cp > 1:
        return "context parallelism needs CUDA"
    if device == "cpu" and plan.offload_optimizer:
        return "optimizer offload needs CUDA"
    if plan.ep > 1 and plan.tp > 1:
        return "ep with tp is not realised"
    return ""


def plan_layouts(sources: dict[str, Path], mode: ModeConfig, gpu: str = "h200") -> dict[str, dict]:
    """Each case's plan and the planner's prediction for it (8 GPUs of ``gpu``)."""
    cluster, workload = make_cluster(gpu, 8), Workload(mode.seq_len, mode.global_batch)
    specs = {name: inspect(str(path)) for name, path in sources.items()}
    cases = {}
    for case, (model, pinned) in LAYOUTS.items():
        fixed = None if pinned is None else {"recompute": "none", "mbs": mode.micro_batch, "offload": 0, **pinned}
        ranked = plan_parallel(specs[model], cluster, workload, fixed=fixed, top_k=20).plans
        # Unpinned: the first-ranked layout this device can realise; say what was passed over.
        why = [realisable_here(c.plan, mode.device) if pinned is None else "" for c in ranked]
        first = next((i for i, reason in enumerate(why) if not reason), 0)
        chosen, skipped = ranked[first], [{"rank": c.rank, "why": r} for c, r in zip(ranked[:first], why)]
        plan = chosen.plan
        plan.precision = mode.precision
        cases[case] = {
            "model": model, "source": str(sources[model]), "plan": plan.to_dict(), "planner_rank": chosen.rank,
            "skipped_ranks": skipped, "predicted": _prediction(chosen), "fixed": fixed,
        }  # fmt: skip
    return cases


def _prediction(ranked) -> dict:
    return {"tokens_per_s": ranked.tokens_per_s, "mfu": ranked.mfu, "memory_gib_per_gpu": ranked.memory_gib_per_gpu,
            "step_time_s": ranked.step_time_s, "fits": ranked.fits}  # fmt: skip


def predict_fixed(case: dict, spec, mode: ModeConfig, calibration, gpu: str = "h200") -> dict:
    """Re-predict one case's layout (with a calibration this time)."""
    p = case["plan"]
    fixed = {"tp": p["tp"], "pp": p["pp"], "dp": p["dp"], "cp": p["cp"], "ep": p["ep"], "zero": p["zero"],
             "recompute": p["recompute"], "mbs": p["micro_batch"], "vpp": p["vpp"], "schedule": p["pp_schedule"],
             "offload": int(p["offload_optimizer"])}  # fmt: skip
    result = plan_parallel(spec, make_cluster(gpu, 8), Workload(mode.seq_len, mode.global_batch), fixed=fixed,
                           top_k=1, calibration=calibration)  # fmt: skip
    return _prediction(result.plans[0])


def layout_name(plan: dict) -> str:
    parts = [f"{k.upper()}{plan[k]}" for k in ("pp", "tp", "cp") if plan[k] > 1]
    if plan["ep"] > 1:  # experts borrow the data-parallel ranks: ep-way sharded, dp/ep-way replicated
        parts.append(
            f"EP{plan['ep']}" + (f" (expert-DP {plan['dp'] // plan['ep']})" if plan["dp"] > plan["ep"] else "")
        )
    parts.append(f"FSDP{plan['dp']} ZeRO-{plan['zero']}" if plan["dp"] > 1 else "")
    extra = [f"mbs{plan['micro_batch']}", f"ga{plan['grad_accum']}"]
    if plan["pp"] > 1:
        extra.append(plan["pp_schedule"] + (f" v{plan['vpp']}" if plan["vpp"] > 1 else ""))
    if plan["recompute"] != "none":
        extra.append(f"recompute={plan['recompute']}")
    return " x ".join(p for p in parts if p) + f" ({', '.join(extra)})"
