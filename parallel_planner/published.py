"""Published training runs (``data/published_runs.csv``): each row as the source ran it, and its ModelSpec.

Each row names a model by its dimensions, a cluster, the layout the authors ran and the knobs and
software they state (CSV header).  ``run_spec`` writes the row's ModelSpec from those dimensions, or,
for a model the dense columns cannot describe (MoE, MLA), reads a transformers configuration through
adapt's intake (``hf_config``); ``published_eval`` plans it and compares with the source's figure.

One FLOP convention: adapt's model FLOPs (3x the forward, causal attention averaging ``(s+1)/2``
context, no recompute).  A source's TFLOP/s is turned into tokens/s with the source's own count and
compared as tokens/s, which at a fixed model is MFU under adapt's convention.  Megatron-LM 2021 and
BLOOM count ``96 B s l h^2 (1 + s/6h + V/16lh)`` per step: the full (non-causal) attention square and
the recomputed forward, so their "% of peak" is hardware FLOPs, not MFU; the conversion undoes both.
Llama 3 reports MFU under a model-FLOPs count, read as adapt's.  DeepSeek-V3 states its cost in GPU-hours per
trillion tokens, which is tokens/s per GPU with no FLOP count at all.
"""

from __future__ import annotations

import csv
import dataclasses
import functools
import io
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from adapt.core.errors import BadInput
from adapt.core.inputs import read_input_text
from adapt.core.spec import (
    SCHEMA_VERSION,
    AttentionSpec,
    BlockSpec,
    CostSpec,
    MLPSpec,
    ModelSpec,
    NormSpec,
    ParamCounts,
)
from parallel_planner.efficiency import FP8_SCALINGS, Efficiency
from parallel_planner.profile import profile_model
from parallel_planner.workload import Workload

# What each source trained, as its paper describes it (the CSV gives the dimensions).
SOURCE_ARCHITECTURE = {
    "megatron2021": dict(mlp="dense_plain", activation="gelu", norm="layernorm", positional="absolute", tied=True),
    "llama3": dict(mlp="dense_gated", activation="silu", norm="rmsnorm", positional="rope", tied=False),
    "bloom": dict(mlp="dense_plain", activation="gelu", norm="layernorm", positional="alibi", tied=True),
    # Megatron-Core r0.8.0's GPT defaults (ffn 4h, GeLU, LayerNorm, learned absolute positions); the table's
    # parameter counts (1.7B at h=2048, l=24, V=131072) hold only with untied embedding and output weights.
    "mcore2024": dict(mlp="dense_plain", activation="gelu", norm="layernorm", positional="absolute", tied=False),
    # torchtitan's Llama 2 and Llama 3 (torchtitan/models/llama: SwiGLU, RMSNorm, rotary, untied output)
    "torchtitan2024": dict(mlp="dense_gated", activation="silu", norm="rmsnorm", positional="rope", tied=False),
}


# blank: the framework's own selective recompute; alternate_mm: it also reruns every second matmul of a block
RECOMPUTE_POLICIES = ("", "alternate_mm")


@dataclass(frozen=True)
class PublishedRun:
    source: str
    model: str
    params_b: float
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    gpu: str
    gpus: int
    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    zero: int
    global_batch_seqs: int
    recompute: str  # blank in the CSV: unstated, the planner's choice
    reported_tflops_per_gpu: float = 0.0
    reported_pct_peak: float = 0.0
    reported_gpu_hours_per_trillion_tokens: float = 0.0  # a source that states its cost instead of its FLOP rate
    reported_tokens_per_s_per_gpu: float = 0.0  # a source that states its token rate per GPU (torchtitan's WPS)
    kernels: str = "fused"  # "eager": norms, GLUs and rotary as eager PyTorch ops (no torch.compile, no fused kernels)
    recompute_policy: str = (
        ""  # "alternate_mm": selective recompute reruns every second matmul too (torchtitan's op SAC)
    )
    framework: str = "megatron"
    attention: str = "flash2"
    cp_comm: str = "ring"  # "allgather": K/V gathered before attention, exposed (Llama 3, arXiv 2407.21783 sec. 3.3.2)
    dropout: int = 0  # attention and hidden dropout (Megatron-LM's 0.1 each, which BLOOM inherited; Llama 3: none)
    grad_bits: int = 32  # 16: gradients accumulated and reduced in 16 bits (Megatron-LM 2021); 32: fp32 main grads
    grad_accum_fused: int = 0  # 1: weight-gradient GEMMs accumulate into the fp32 main grads (Megatron-Core default)
    launch_blocking: int = 0  # 1: CUDA_LAUNCH_BLOCKING=1 in the run's environment (BLOOM's launch script)
    flop_convention: str = "adapt"  # "megatron_recompute": 96Bslh^2(1+s/6h+V/16lh) per step; "adapt": 3x causal fwd;
    # "megatron_mfu": Megatron-Core's num_floating_point_operations (3x forward, full attention square, no recompute)
    sp: int = 0
    tp_overlap: int = 0
    grad_overlap: int = 1
    mbs: int = 0  # 0: the planner chooses
    vpp: int = 0
    split: str = ""
    nvlink_domain: int = 0  # 0: the GPU type's node
    inter_gbps: float = 0.0  # 0: the GPU type's NIC per GPU
    hf_config: str = ""  # the model is this transformers model type's default configuration (MoE, MLA)
    precision: str = "bf16"
    schedule: str = ""  # blank: 1F1B, interleaved with virtual stages
    ep_overlap: int = 0  # EP all-to-all beside another micro-batch's compute (DualPipe, combined 1F1B)
    ep_comm: str = "flat"  # "forwarded": once per target node over the network, then NVLink (DeepEP)
    ep_dispatch_bits: int = 16  # 8: tokens quantised to fp8 before the dispatch
    fp8_scaling: str = "tensorwise"  # with precision fp8: one scale per tensor, per row, or per block (DeepSeek-V3)
    moe_weighted_act: int = 0  # 1: the routing weight scales the experts' activation (no expert output kept)
    moment_bits: int = 32  # 16: Adam's moments in bf16
    act_cache_bits: int = 16  # 8: the fp8 GEMMs' inputs cached in fp8
    mtp_depth: int = 0  # multi-token-prediction modules trained after the last layer (DeepSeek-V3: 1)
    citation: str = ""

    def __post_init__(self) -> None:
        if self.recompute_policy not in RECOMPUTE_POLICIES:
            raise BadInput(
                f"{self.model}: recompute_policy must be blank or one of {', '.join(RECOMPUTE_POLICIES[1:])}, "
                f"not {self.recompute_policy!r}"
            )
        if self.fp8_scaling not in FP8_SCALINGS:
            raise BadInput(f"{self.model}: fp8_scaling must be blank or one of {', '.join(FP8_SCALINGS)}")

    @property
    def name(self) -> str:
        return f"{self.model}@{self.gpus}x{self.gpu}" + (f",s={self.seq}" if self.source == "llama3" else "")

    @property
    def layout(self) -> dict[str, Any]:
        """The published layout and knobs: 1F1B when pipelining, interleaved unless the source states one virtual
        stage (Megatron-LM without virtual stages, DeepSpeed's TrainSchedule)."""
        layout = dict(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            cp=self.cp,
            ep=self.ep,
            zero=self.zero,
            replicate=1,
            sp=self.sp if self.tp > 1 else 0,
            tp_overlap=self.tp_overlap if self.tp > 1 else 0,
            grad_overlap=self.grad_overlap,
            ep_overlap=self.ep_overlap if self.ep > 1 else 0,
        )
        if self.recompute:
            layout["recompute"] = self.recompute
        if self.pp > 1:  # a published vpp of 1 is plain 1F1B (DeepSpeed's pipeline engine)
            layout["schedule"] = self.schedule or ("1f1b" if self.vpp == 1 else "interleaved_1f1b")
        for key in ("mbs", "vpp", "split"):
            if getattr(self, key):
                layout[key] = getattr(self, key)
        if self.nvlink_domain:
            layout["nvlink_domain"] = self.nvlink_domain
        if self.inter_gbps:
            layout["inter_gbps"] = self.inter_gbps
        return layout

    @property
    def vpp_choices(self) -> tuple[int, ...]:
        """Virtual stages to choose among when the source leaves them unstated and its framework builds only even
        chunks: Megatron asserts that the layers per stage divide into whole chunks (``arguments.py``, 2021 and
        Megatron-Core r0.8), so every divisor of ``layers / pp`` (1: plain 1F1B).  Empty when stated, unpipelined,
        or the framework splits freely: the layout is planned as given."""
        if self.vpp or self.pp == 1 or self.framework != "megatron" or self.split not in ("", "balanced"):
            return ()
        per_stage = self.layers // self.pp
        return tuple(v for v in range(1, per_stage + 1) if per_stage % v == 0)

    def layouts(self) -> list[dict[str, Any]]:
        """The published layout, once per virtual-stage count its framework could have run (``vpp_choices``)."""
        return [
            dict(self.layout, vpp=v, schedule="1f1b" if v == 1 else "interleaved_1f1b") for v in self.vpp_choices
        ] or [self.layout]

    def efficiency(self, base: Efficiency | None = None) -> Efficiency:
        """The time model with this run's software: its framework, attention kernel, fused kernels."""
        return dataclasses.replace(
            base or Efficiency(),
            runtime=self.framework,
            attention=self.attention,
            fused_kernels=self.kernels != "eager",
            attention_dropout=bool(self.dropout),
            hidden_dropout=bool(self.dropout),
            cp_allgather=self.cp_comm == "allgather",
            grads16=self.grad_bits == 16,
            grad_accum_fused=bool(self.grad_accum_fused),
            launch_blocking=bool(self.launch_blocking),
            ep_forwarded=self.ep_comm == "forwarded",
            ep_fp8_dispatch=self.ep_dispatch_bits == 8,
            fp8_scaling=self.fp8_scaling,
            moe_weighted_activation=bool(self.moe_weighted_act),
            selective_alternate_matmuls=self.recompute_policy == "alternate_mm",
        )

    def workload(self) -> Workload:
        return Workload(
            self.seq,
            self.global_batch_seqs,
            precision=self.precision,
            moment_bits=self.moment_bits,
            act_cache_bits=self.act_cache_bits,
            mtp_depth=self.mtp_depth,
        )

    def published_tokens_per_s_per_gpu(self, spec: ModelSpec) -> float:
        """The paper's per-GPU FLOP rate turned into tokens/s with the paper's FLOP count, or its stated cost in
        GPU-hours per trillion tokens as tokens/s per GPU, or its stated tokens/s per GPU as they are."""
        if self.reported_tokens_per_s_per_gpu:
            return self.reported_tokens_per_s_per_gpu
        if self.reported_gpu_hours_per_trillion_tokens:
            return 1e12 / (self.reported_gpu_hours_per_trillion_tokens * 3600)
        l, h, s, v = self.layers, self.hidden, self.seq, self.vocab
        if self.flop_convention == "megatron_recompute":
            flops_per_token = 96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
        elif self.flop_convention == "megatron_mfu":
            # megatron/training/training.py::num_floating_point_operations (Megatron-Core r0.8.0), per token
            gated = 1.5 if SOURCE_ARCHITECTURE[self.source]["mlp"] == "dense_gated" else 1.0
            query = h // self.heads * self.heads / h
            attention = (1 + self.kv_heads / self.heads + s / h) * query
            flops_per_token = 12 * l * h * h * (attention + self.ffn / h * gated + v / (2 * l * h))
        else:
            flops_per_token = profile_model(spec).model_flops_per_token(self.seq)
        return self.reported_tflops_per_gpu * 1e12 / flops_per_token


def load_published_runs(path: str | Path | None = None) -> list[PublishedRun]:
    text = (
        read_input_text(path, "published runs")
        if path
        else resources.files("parallel_planner.data").joinpath("published_runs.csv").read_text()
    )
    rows = csv.DictReader(io.StringIO("\n".join(l for l in text.splitlines() if not l.startswith("#"))))
    runs = []
    for row in rows:
        kwargs = {}
        for f in dataclasses.fields(PublishedRun):
            value = row.get(f.name)
            if value in (None, "") and f.name != "recompute":
                continue  # an optional column left blank keeps its default (a blank recompute: unstated)
            kwargs[f.name] = (value or "") if f.type == "str" else (float if f.type == "float" else int)(value)
        runs.append(PublishedRun(**kwargs))
    return runs


def run_spec(run: PublishedRun) -> ModelSpec:
    """The ModelSpec of a row's decoder, written from its published dimensions (or read from its configuration)."""
    if run.hf_config:
        return _config_spec(run.hf_config, run.seq, (run.layers, run.hidden, run.vocab))
    arch = SOURCE_ARCHITECTURE[run.source]
    h, f, a, g, v, s = run.hidden, run.ffn, run.heads, run.kv_heads, run.vocab, run.seq
    d = h // a
    gated = arch["mlp"] == "dense_gated"
    bias = not gated  # GPT linears carry biases, Llama's do not
    attn_params = h * a * d + 2 * h * g * d + a * d * h + (a * d + 2 * g * d + h) * bias
    mlp_params = (3 if gated else 2) * h * f + (f + h) * bias
    norm_params = 2 * h * (2 if arch["norm"] == "layernorm" else 1)
    block_params = attn_params + mlp_params + norm_params
    linear = 2 * (attn_params - (a * d + 2 * g * d + h) * bias) + 2 * (3 if gated else 2) * h * f
    blocks = [
        BlockSpec(
            index=i,
            module=f"layers.{i}",
            class_name="DecoderLayer",
            mixer="full_attention",
            attention=AttentionSpec(
                kind="mha" if g == a else "gqa", num_heads=a, num_kv_heads=g, head_dim=d, v_head_dim=d, qkv_bias=bias
            ),
            mlp=MLPSpec(kind=arch["mlp"], intermediate_size=f, activation=arch["activation"], bias=bias),
            norm=NormSpec(kind=arch["norm"], placement="pre"),
            positional=arch["positional"],
            params=block_params,
            params_active=block_params,
            linear_flops_per_token=linear,
            attention_flops_per_token_per_ctx=2 * a * d + 2 * a * d,
        )
        for i in range(run.layers)
    ]
    embeddings = v * h + (s * h if arch["positional"] == "absolute" else 0)
    lm_head = 0 if arch["tied"] else v * h
    total = embeddings + lm_head + run.layers * block_params + norm_params // 2
    ctx = (s + 1) / 2
    forward = run.layers * (linear + 4 * a * d * ctx) + 2 * h * v
    cost = CostSpec(
        seq_len=s,
        forward_flops_per_token=int(forward),
        train_flops_per_token=int(3 * forward),
        linear_flops_per_token=run.layers * linear,
        attention_flops_per_token=int(run.layers * 4 * a * d * ctx),
        lm_head_flops_per_token=2 * h * v,
        kv_cache_bytes_per_token=run.layers * 2 * g * d * 2,
        kv_cache_dtype_bytes=2,
    )
    return ModelSpec(
        schema_version=SCHEMA_VERSION,
        model_type=run.source,
        architectures=[],
        source=f"published:{run.model}",
        revision=None,
        dtype="bfloat16",
        model_class="",
        is_causal=True,
        hidden_size=h,
        vocab_size=v,
        num_layers=run.layers,
        max_position_embeddings=s,
        tie_word_embeddings=arch["tied"],
        rope=None,
        blocks=blocks,
        params=ParamCounts(embeddings=embeddings, lm_head=lm_head, total=total, active_per_token=total),
        cost=cost,
        unrecognized=[],
        novelties=[],
    )


@functools.cache
def _config_spec(model_type: str, seq: int, dims: tuple[int, int, int]) -> ModelSpec:
    """The ModelSpec of a transformers model type's default configuration, read by adapt's intake like any
    config-only checkpoint (MoE and MLA need more than the CSV's dense columns); the row's layers, hidden size
    and vocabulary must agree with it."""
    import tempfile

    from transformers import AutoConfig

    from adapt.model.intake import inspect

    with tempfile.TemporaryDirectory() as tmp:
        AutoConfig.for_model(model_type).save_pretrained(tmp)
        spec = inspect(tmp, config_only=True, seq_len=seq)
    if (spec.num_layers, spec.hidden_size, spec.vocab_size) != dims:
        raise BadInput(f"{model_type}'s default configuration is not the row's model: layers, hidden, vocab {dims}")
    return spec
