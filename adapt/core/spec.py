"""Architecture-neutral description of a model: the contract every later stage reads.

A ``ModelSpec`` is derived from the instantiated module tree and the real tensor shapes (see
``adapt.model.structure``), never from a ``model_type`` table.  Operators, planner, validators and
reports all consume this one object, so every field here is plain data and JSON-serialisable.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from adapt.core.stage_verdicts import Check, StageSummary, SummaryContext, human, intake_checks, plural

SCHEMA_VERSION = 1

MixerKind = Literal[
    "full_attention", "sliding_attention", "linear_attention", "ssm", "convolution", "recurrent", "none", "unknown"
]
AttentionKind = Literal["mha", "gqa", "mqa", "mla", "none"]
MLPKind = Literal["dense_gated", "dense_plain", "moe", "none"]
NormKind = Literal["rmsnorm", "layernorm", "unknown", "none"]
NormPlacement = Literal["pre", "post", "sandwich", "unknown"]
PositionalKind = Literal["rope", "absolute", "alibi", "none"]


@dataclass
class AttentionSpec:
    kind: AttentionKind
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key head dim (for MLA: nope + rope part)
    v_head_dim: int
    causal: bool = True
    window: int | None = None  # sliding-window size in tokens, None for full attention
    softcap: float | None = None  # attention logit soft-capping (tanh), e.g. Gemma-2
    sinks: bool = False  # learned attention sinks
    qkv_bias: bool = False
    qk_norm: bool = False
    # Cross-layer KV sharing: the layer attends to K/V another layer computed, so it holds no K/V projections and
    # caches nothing of its own (Gemma 3n/4, Kolibri).
    kv_shared: bool = False
    # Multi-head latent attention (DeepSeek-V2/V3); zero when not MLA.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0


@dataclass
class MLPSpec:
    kind: MLPKind
    intermediate_size: int  # dense: ffn width; MoE: per-expert width
    activation: str = "unknown"  # silu, gelu, gelu_tanh, relu, ...
    num_experts: int = 0
    top_k: int = 0
    num_shared_experts: int = 0
    shared_intermediate_size: int = 0  # total width of the shared-expert path
    router_scoring: str = ""  # "softmax" or "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    bias: bool = False
    # how the routed experts' weights are kept: "bank" (one module's [experts, ...] tensors), "list" (a module per
    # expert) or "rows" (experts stacked in the rows of 2-D matrices, DBRX's); "" where there are none
    expert_layout: str = ""


@dataclass
class NormSpec:
    kind: NormKind
    placement: NormPlacement
    eps: float = 1e-6
    offset: float = 0.0  # 1.0 for Gemma-style (1 + w) scaling


@dataclass
class BlockSpec:
    """One repeated block (decoder layer / encoder layer)."""

    index: int
    module: str  # module path inside the model, e.g. "model.layers.3"
    class_name: str
    mixer: MixerKind
    attention: AttentionSpec | None
    mlp: MLPSpec
    norm: NormSpec
    positional: PositionalKind
    params: int  # parameters owned by this block
    params_active: int  # parameters touched per token (MoE: top-k + shared experts)
    linear_flops_per_token: int  # forward FLOPs of all active linears, 2*in*out each
    attention_flops_per_token_per_ctx: int  # forward FLOPs per token per attended token (QK^T + AV)
    # A token mixer the block runs besides its attention: Falcon-H1's Mamba-2 heads beside it, Zamba's Mamba layer
    # after its shared attention.  None when attention is the block's only mixer (or the block has none).
    second_mixer: MixerKind | None = None

    def signature(self) -> str:
        """Blocks with the same signature share one structure (used to trace one of each)."""
        payload = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("index", "module")}
        return json.dumps(payload, sort_keys=True)


@dataclass
class HeadSpec:
    """What the output head does besides its projection: the treatment a replacing loss kernel must keep."""

    tied: bool  # the projection's weight is the token embedding's
    softcap: float | None = None  # c of c * tanh(logits / c) on the output logits; None: none


@dataclass
class ParamCounts:
    embeddings: int = 0
    attention: int = 0
    dense_mlp: int = 0
    experts: int = 0  # routed experts (all of them)
    shared_experts: int = 0
    router: int = 0
    norms: int = 0
    lm_head: int = 0  # zero when tied to the embeddings
    other: int = 0
    total: int = 0
    active_per_token: int = 0


@dataclass
class CostSpec:
    """FLOPs and KV-cache accounting at a stated sequence length."""

    seq_len: int
    forward_flops_per_token: int  # linears + attention at seq_len (causal: average context seq_len/2)
    train_flops_per_token: int  # 3x forward (forward + backward), no recompute
    linear_flops_per_token: int
    attention_flops_per_token: int
    lm_head_flops_per_token: int
    kv_cache_bytes_per_token: int  # at the checkpoint dtype, summed over layers
    kv_cache_dtype_bytes: int


@dataclass
class TensorInfo:
    name: str
    shape: list[int]
    dtype: str
    nbytes: int
    file: str


@dataclass
class CheckpointReport:
    """What the safetensors headers say, cross-checked against the meta skeleton."""

    format: Literal["safetensors", "pytorch_bin", "none"]
    files: list[str] = field(default_factory=list)
    num_tensors: int = 0
    num_elements: int = 0
    total_bytes: int = 0
    dtypes: dict[str, int] = field(default_factory=dict)  # dtype -> tensor count
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    shape_mismatches: list[dict[str, Any]] = field(default_factory=list)
    tied: list[list[str]] = field(default_factory=list)  # groups of names sharing storage
    # integers on disk where the model holds floating point (a quantised file read without its quantisation)
    integer_for_float: list[dict[str, Any]] = field(default_factory=list)
    # the checkpoint's quantization_config (weights stored quantised: fp8 blocks, packed integers), and the tensors it
    # stores in its own form beside or instead of the model's (scales, zero points, packed weights)
    quantization: dict[str, Any] = field(default_factory=dict)
    quantization_tensors: list[str] = field(default_factory=list)

    def quantization_line(self) -> str:
        """How the weights are stored, when quantised: method and format as the config states them."""
        q = self.quantization
        if not q:
            return ""
        details = [str(q[key]) for key in ("fmt", "bits", "weight_dtype") if q.get(key) is not None]
        if q.get("weight_block_size"):
            details.append("x".join(str(n) for n in q["weight_block_size"]) + " blocks")
        method = str(q.get("quant_method", "unknown method"))
        return f"weights stored quantised ({method}{': ' + ', '.join(details) if details else ''})"


@dataclass
class ModelSpec:
    schema_version: int
    model_type: str
    architectures: list[str]
    source: str
    revision: str | None
    dtype: str
    model_class: str
    is_causal: bool  # decoder (causal LM) or bidirectional encoder
    hidden_size: int
    vocab_size: int
    num_layers: int
    max_position_embeddings: int | None
    tie_word_embeddings: bool
    rope: dict[str, Any] | None  # theta, scaling, partial/rotary dim, interleaved
    blocks: list[BlockSpec]
    params: ParamCounts
    cost: CostSpec
    unrecognized: list[str]  # module classes whose role could not be identified
    novelties: list[str]  # what adapt knows no kind for: unrecognised components, unknown token mixers
    checkpoint: CheckpointReport | None = None
    features: list[str] = field(default_factory=list)  # every known trait, stated (GQA, windows, soft-caps, routing)
    head: HeadSpec | None = None  # None: a spec written before intake described the head

    # ---- convenience views used by the planner and validators -------------------------
    @property
    def params_total(self) -> int:
        return self.params.total

    @property
    def params_active(self) -> int:
        return self.params.active_per_token

    @property
    def is_moe(self) -> bool:
        return any(b.mlp.kind == "moe" for b in self.blocks)

    def distinct_blocks(self) -> list[BlockSpec]:
        """The first block of each distinct structure, in order."""
        seen: dict[str, BlockSpec] = {}
        for block in self.blocks:
            seen.setdefault(block.signature(), block)
        return list(seen.values())

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["params_total"] = self.params.total
        data["params_active"] = self.params.active_per_token
        data["flops_per_token"] = {
            "seq_len": self.cost.seq_len,
            "forward": self.cost.forward_flops_per_token,
            "train": self.cost.train_flops_per_token,
        }
        data["kv_cache_bytes_per_token"] = self.cost.kv_cache_bytes_per_token
        return data

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        return from_dict(cls, data)

    def summary(self, context: SummaryContext | None = None) -> StageSummary:
        """What the report shows of the intake stage.  Only tensors the model needs that the checkpoint lacks fail it:
        unexpected tensors (a saved ``position_ids`` buffer) are reported, and transformers' loader ignores them too;
        shape mismatches never get here, intake rejects them as bad input."""
        data = _intake_data(self.to_dict())
        checks = intake_checks(data, (context or SummaryContext()).section("intake"))
        kinds = sorted({f"{b['attention']}/{b['mlp']}" for b in data["blocks"]})
        line = (
            f"{self.model_class}: {self.num_layers} blocks ({', '.join(kinds)}), {human(data['params_total'])} params, "
            f"{plural(len(self.novelties), 'novelty', 'novelties')}"
        )
        problems, unexpected = data["checkpoint_problems"], data["checkpoint_unexpected"]
        if problems:
            line += f"; checkpoint: {problems[0]}" + (f" (+{len(problems) - 1})" if len(problems) > 1 else "")
        if unexpected:
            line += f"; {plural(len(unexpected), 'unused checkpoint tensor', 'unused checkpoint tensors')}"
        if self.checkpoint is not None and self.checkpoint.quantization:
            line += f"; {self.checkpoint.quantization_line()}"
        return StageSummary(line, data, checks)

    def verdict(self, thresholds: dict[str, Any] | None = None) -> list[Check]:
        return intake_checks(self.summary().data, thresholds)


def _intake_data(spec: dict[str, Any]) -> dict[str, Any]:
    ckpt = spec.get("checkpoint") or {}
    problems = [f"missing tensor {n}" for n in ckpt.get("missing", [])]
    problems += [f"shape mismatch {m.get('name', m)}" for m in ckpt.get("shape_mismatches", [])]
    blocks = [
        {
            "index": b["index"],
            "module": b["module"],
            "mixer": b["mixer"] + (f" + {b['second_mixer']}" if b.get("second_mixer") else ""),
            "attention": (b.get("attention") or {}).get("kind", "none"),
            "mlp": b["mlp"]["kind"],
            "norm": f"{b['norm']['kind']} ({b['norm']['placement']})",
            "params": b["params"],
        }
        for b in spec.get("blocks", [])
    ]
    params = spec.get("params", {})
    return {
        "model_type": spec.get("model_type"),
        "architectures": spec.get("architectures", []),
        "model_class": spec.get("model_class"),
        "dtype": spec.get("dtype"),
        "is_causal": spec.get("is_causal"),
        "hidden_size": spec.get("hidden_size"),
        "num_layers": spec.get("num_layers"),
        "vocab_size": spec.get("vocab_size"),
        "params_total": params.get("total"),
        "params_active": params.get("active_per_token"),
        "blocks": blocks,
        "novelties": spec.get("novelties", []),
        "features": spec.get("features", []),
        "unrecognized": spec.get("unrecognized", []),
        "checkpoint_problems": problems,
        "checkpoint_unexpected": list(ckpt.get("unexpected", [])),
    }


T = TypeVar("T")


def from_dict(cls: type[T], data: Any) -> T:
    """Rebuild a (nested) dataclass from ``dataclasses.asdict`` output, ignoring extra keys."""
    import typing

    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in data:
            continue
        kwargs[f.name] = _coerce(hints[f.name], data[f.name])
    return cls(**kwargs)


def _coerce(tp: Any, value: Any) -> Any:
    import types
    import typing

    if value is None:
        return None
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is type(None):
                continue
            return _coerce(arg, value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value)
    if origin is list and args:
        return [_coerce(args[0], v) for v in value]
    return value
