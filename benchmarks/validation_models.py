"""What ``benchmarks/validation.py`` builds and runs: each model's config and stage sizes, and the run's constants.

Shared by the run and by its report (``benchmarks/validation_report.py``), which both need the alignment's
batch and the MoE kernel's name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from benchmarks.shapes import SHAPES

# The kernel that only adapt's routed-MoE path calls, once per MoE block forward.
MOE_ROUTE_KERNEL = "moe_route"
MOE_PROVIDER = "adapt-triton"


@dataclass(frozen=True)
class StageSizes:
    """Batch x sequence of the bench and the soak, and the soak's length."""

    bench_batch: int
    bench_seq: int
    soak_batch: int
    soak_seq: int
    soak_steps: int


@dataclass(frozen=True)
class ValidationModel:
    """One model the run can build: its transformers config at full size and at rehearsal width."""

    model_type: str
    title: str  # the shape, as the Markdown title names it; formatted with the config fields
    file_stem: str  # output files: <file_stem>.json / .md
    full: dict[str, Any]
    tiny: dict[str, Any]
    sizes: StageSizes
    tiny_sizes: StageSizes
    ops_limit_s: int  # default time limit of the operators stage on the device
    check_patch: bool  # operators stage: float32 logits and gradients of the patched vs the unpatched model

    def config_fields(self, tiny: bool) -> dict[str, Any]:
        return self.tiny if tiny else self.full

    def moe_blocks(self, tiny: bool) -> int:
        """Routed blocks the built model holds: this benchmark makes every layer routed or none."""
        fields = self.config_fields(tiny)
        return fields["num_hidden_layers"] if fields.get("num_experts") or fields.get("num_local_experts") else 0


# The CPU rehearsal checks that every stage runs (the Triton interpreter is slow), not soak statistics.
_TINY_SIZES = StageSizes(bench_batch=2, bench_seq=64, soak_batch=2, soak_seq=32, soak_steps=20)


def _h200_sizes(soak_steps: int) -> StageSizes:
    """The bench at the e2e batch (4 x 2048) and a short-sequence soak of ``soak_steps``, on the H200."""
    return StageSizes(bench_batch=4, bench_seq=2048, soak_batch=4, soak_seq=256, soak_steps=soak_steps)


def _dense(shape: str, title: str, file_stem: str, soak_steps: int) -> ValidationModel:
    """A dense reference shape (``benchmarks/shapes.py``: model_type, full and tiny): bf16 alignment judges every
    token, so no float32 patch check is needed beside it."""
    return ValidationModel(
        **SHAPES[shape],
        title=title,
        file_stem=file_stem,
        sizes=_h200_sizes(soak_steps),
        tiny_sizes=_TINY_SIZES,
        ops_limit_s=240,
        check_patch=False,
    )


MODELS = {
    "llama-1b": _dense("llama-1b", "the Llama-3.2-1B shape", "validation-h200", soak_steps=500),
    "gemma2-2b": _dense("gemma2-2b", "the Gemma-2-2B shape", "validation-gemma2-h200", soak_steps=200),
    "qwen3-moe": ValidationModel(
        **SHAPES["qwen3-moe"],  # model_type, full and tiny: the reference shape (benchmarks/shapes.py)
        title="a reduced Qwen3-30B-A3B shape ({num_hidden_layers} routed layers, {num_experts} experts top-{num_experts_per_tok})",
        file_stem="validation-moe-h200",
        sizes=_h200_sizes(soak_steps=100),
        tiny_sizes=_TINY_SIZES,
        ops_limit_s=300,  # a float64 probe of a 604 M-parameter expert bank on the CPU, once per structure
        # bf16 alignment judges few tokens past a 128-expert router (ALIGN_SEED_NOTE, validation.py); the float32 check
        # of the patched model against the unpatched one compares every token on identical routing
        check_patch=True,
    ),
    "gpt-oss": ValidationModel(
        **SHAPES["gpt-oss"],
        title="gpt-oss-20b's width at {num_hidden_layers} layers (attention sinks, {num_local_experts} experts "
        "top-{num_experts_per_tok})",
        file_stem="validation-gpt-oss-h200",
        sizes=_h200_sizes(soak_steps=100),
        tiny_sizes=_TINY_SIZES,
        ops_limit_s=300,
        check_patch=True,  # routed: as for qwen3-moe, the float32 patch check compares every token on identical routing
    ),
}
STAGES = ("env", "ops", "align", "bench", "soak")
ALIGN_BATCH, ALIGN_SEQ = 2, 64  # the float32 reference runs on the CPU
