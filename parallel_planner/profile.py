"""What the planner needs from a ``ModelSpec``: per block structure, GEMM shapes, saved activations.

Everything here is read off the spec's attention/MLP/parameter fields (no model names).  Blocks with
the same signature share one ``BlockProfile``; ``ModelProfile.layer_types`` maps each layer to it, so
a stage's cost is a count of each block type plus the embedding and head it may own.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from adapt.core.errors import BadInput
from adapt.core.spec import BlockSpec, ModelSpec


@dataclass(frozen=True)
class GemmShape:
    """One forward GEMM per token: ``in_features -> out_features``."""

    in_features: int
    out_features: int
    tp_sharded: bool = True  # column- or row-parallel; False for small replicated projections (MLA down, router)
    routed: bool = False  # routed-expert GEMM: its M dimension is the tokens each expert receives
    row_parallel: bool = False  # back to the residual width: TP splits the inner dimension, not the output
    recomputed: bool = False  # selective recompute runs it again in backward (MLA's up-projections)
    # The separate matmuls this shape stands for, by output width, in the order the block runs them (k then v; gate
    # then up); empty: one.  Op-level recompute policies count matmuls, not fused shapes (timing.alternate_matmuls).
    parts: tuple[int, ...] = ()

    def per_rank(self, tp):
        """(inner, output) widths one TP rank computes: column-parallel GEMMs split their output over TP,
        row-parallel ones their inner dimension, replicated ones neither."""
        shard = tp if self.tp_sharded else 1
        if self.row_parallel:
            return self.in_features / shard, self.out_features
        return self.in_features, self.out_features / shard


@dataclass(frozen=True)
class BlockProfile:
    count: int
    hidden: int
    gemms: tuple[GemmShape, ...]
    flops_scale: float  # spec linear FLOPs / FLOPs of ``gemms``: the spec is authoritative for the total
    attention_flops_per_ctx: int  # forward, per token per attended token (all heads)
    window: int | None
    causal: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key width per head: the attention kernel's rate depends on it (kernel_rates)
    kv_cache_width: int  # elements cached per token (K and V, or MLA's latent + rope key)
    cp_exchange_width: int  # K and V elements per token that context parallelism passes around the ring
    saved_width: int  # activation elements per token kept for backward (TP/SP sharded), no recompute
    recomputable_width: int  # of which norm outputs and activation-function outputs (selective recompute drops)
    routed_width: int  # elements per routed token saved inside the experts (times top_k)
    unfused_width: int  # more elements per token saved when norms and GLUs run as eager modules (see below)
    unfused_routed_width: int  # ... per routed token inside the experts
    elementwise_width: int  # bytes-moving elementwise work per token (norms, residuals, activations), elements
    eager_elementwise_width: int  # more such work when norms, GLU and rotary run as eager modules (see below)
    host_ops: int  # aten operators one block issues in forward + backward as eager modules
    host_ops_fused: int  # ... with fused norm, GLU and rotary kernels
    num_experts: int
    top_k: int
    dense_params: int  # everything but routed experts (sharded by TP)
    expert_params: int  # all routed experts (sharded by EP x TP)
    has_attention: bool
    has_mlp: bool
    score_bias: bool = False  # an additive bias on the attention scores (ALiBi)
    # Of ``recomputable_width``, the elements saved only as inputs of the block's quantisable GEMMs (norm outputs
    # feeding projections, activation outputs feeding down-projections): an fp8 recipe may cache them in fp8.
    cacheable_width: int = 0
    routed_cacheable_width: int = 0  # per routed token: the dispatched input, the SwiGLU input and output
    routed_recomputable_width: int = 0  # per routed token: the activation output selective recompute drops
    routed_output_width: int = 0  # per routed token: the expert's output, kept for the routing weight's gradient
    expert_layout: str = ""  # MLPSpec.expert_layout: adapt's expert parallelism shards a "bank" only
    expert_groups: int = 1  # group-limited routing: experts fall into this many contiguous groups ...
    groups_per_token: int = 1  # ... of which a token's experts come from at most this many

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def residual_branches(self) -> int:
        """Branches that add into the residual stream (attention, MLP): each a bias-dropout-add in Megatron."""
        return int(self.has_attention) + int(self.has_mlp)


@dataclass
class _Parts:
    """What the attention or the MLP of a block contributes: GEMMs and saved widths (elements per token)."""

    gemms: list[GemmShape] = field(default_factory=list)
    saved: int = 0  # kept for backward without recompute
    recomputable: int = 0  # of which selective recompute drops
    cacheable: int = 0  # of which only quantisable GEMMs read (fp8-cacheable)
    cache: int = 0  # KV-cache width
    ring: int = 0  # K/V width context parallelism exchanges
    routed: int = 0  # per routed token
    routed_cacheable: int = 0
    routed_recomputable: int = 0
    routed_output: int = 0
    expert_params: int = 0


def _attention_parts(block: BlockSpec, h: int) -> _Parts:
    """GEMMs and saved widths of the attention; the norm output that feeds the projections is recomputable and
    read only by them."""
    attn = block.attention
    if attn is None or attn.kind == "none":
        return _Parts()
    a, g, dq, dv = attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.v_head_dim
    out = GemmShape(a * dv, h, row_parallel=True)
    if attn.kind != "mla" and attn.kv_shared:  # K/V read from another layer: no K/V GEMM, nothing cached or kept
        saved = 2 * h + a * dq + a * dv + 2 * a
        return _Parts([GemmShape(h, a * dq), out], saved, h, h, cache=0, ring=g * (dq + dv))
    if attn.kind != "mla":
        saved = 2 * h + a * dq + g * (dq + dv) + a * dv + 2 * a  # norm in, qkv in, q/k/v, output, fp32 lse
        gemms = [GemmShape(h, a * dq), GemmShape(h, g * (dq + dv), parts=(g * dq, g * dv)), out]
        return _Parts(gemms, saved, h, h, cache=g * (dq + dv), ring=g * (dq + dv))
    rope, nope = attn.qk_rope_head_dim, attn.qk_nope_head_dim or dq - attn.qk_rope_head_dim
    gemms = [
        GemmShape(h, attn.kv_lora_rank + rope, tp_sharded=False),
        GemmShape(attn.kv_lora_rank, a * (nope + dv), recomputed=True),
    ]
    if attn.q_lora_rank:
        gemms += [
            GemmShape(h, attn.q_lora_rank, tp_sharded=False),
            GemmShape(attn.q_lora_rank, a * dq, recomputed=True),
        ]
    else:
        gemms.append(GemmShape(h, a * dq))
    latent = attn.q_lora_rank + attn.kv_lora_rank + rope
    saved = 2 * h + latent + a * (2 * dq + dv) + a * dv + 2 * a
    # Selective recompute reruns the up-projections from the saved latents: their outputs (k and v, and q when
    # it has a latent) are not kept (DeepSeek-V3 sec. 3.2.3; Megatron-Core's ``mla_up_proj`` recompute module).
    up_projected = a * (dq + dv) + (a * dq if attn.q_lora_rank else 0)
    return _Parts(gemms + [out], saved, h + up_projected, h, cache=attn.kv_lora_rank + rope, ring=a * (dq + dv))


def _mlp_parts(block: BlockSpec, h: int) -> _Parts:
    """GEMMs and saved widths of the MLP, per token and per routed token, and the routed experts' parameters.

    Recomputable: the norm output and the activation output; fp8-cacheable: what only GEMMs read (the dense
    norm output and activation output, the shared experts' activation output; the MoE norm output also feeds
    the router, which stays 16-bit) and, per routed token, the dispatched input, the gate/up output the
    activation reads and the activation output (DeepSeek-V3 sec. 3.3.3 caches the experts' SwiGLU inputs in fp8).
    """
    mlp = block.mlp
    if mlp.kind == "none":
        return _Parts()
    if mlp.kind in ("dense_gated", "dense_plain"):
        gated = mlp.kind == "dense_gated"
        f = mlp.intermediate_size
        gemms = [
            GemmShape(h, (2 if gated else 1) * f, parts=(f, f) if gated else ()),
            GemmShape(f, h, row_parallel=True),
        ]
        return _Parts(gemms, 2 * h + (3 if gated else 2) * f, h + f, h + f)
    e, k, f = mlp.num_experts, mlp.top_k, mlp.intermediate_size
    if e <= k:
        raise BadInput(f"block {block.index}: MoE with {e} experts and top-{k} routing is not a sparse MoE")
    per_expert = _routed_expert_params(block)
    gated = per_expert >= 3 * h * f
    gemms = [GemmShape(h, e, tp_sharded=False)]
    gemms += [GemmShape(h, (2 if gated else 1) * f, routed=True), GemmShape(f, h, routed=True, row_parallel=True)]
    parts = _Parts(gemms, 2 * h + 2 * e, h, 0)  # norm in, router input, fp32 router logits
    if mlp.shared_intermediate_size:
        fs = mlp.shared_intermediate_size
        parts.gemms += [GemmShape(h, 2 * fs, parts=(fs, fs)), GemmShape(fs, h, row_parallel=True)]
        parts.saved, parts.recomputable, parts.cacheable = parts.saved + 3 * fs, parts.recomputable + fs, fs
    # Per routed token: the dispatched input, the expert's up (and gate) output and down input, and its
    # output once more, which the gradient of the routing weight needs.
    parts.routed = 2 * h + (3 if gated else 2) * f
    parts.routed_cacheable = h + (3 if gated else 1) * f  # a plain expert's up output feeds the activation only
    parts.routed_recomputable, parts.routed_output = f, h
    parts.expert_params = per_expert * e
    return parts


def _routed_expert_params(block: BlockSpec) -> int:
    """Parameters of one routed expert: the block's idle parameters are all routed experts."""
    return (block.params - block.params_active) // (block.mlp.num_experts - block.mlp.top_k)


def _norm_inventory(block: BlockSpec, h: int) -> tuple[int, int]:
    """(norm kernels, elements they normalise per token): the block's own, MLA latents, per-head QK norms."""
    attn = block.attention
    count = 4 if block.norm.placement == "sandwich" else 2
    elements = count * h
    if attn is not None and attn.kind == "mla":
        count, elements = count + 1 + bool(attn.q_lora_rank), elements + attn.q_lora_rank + attn.kv_lora_rank
    if attn is not None and attn.qk_norm:
        count, elements = count + 2, elements + (attn.num_heads + attn.num_kv_heads) * attn.head_dim
    return count, elements


def _unfused_widths(block: BlockSpec, h: int) -> tuple[int, int]:
    """What eager modules save beyond fused kernels, per token and per routed token.

    Fused kernels (adapt's operators, Transformer Engine, Liger) save a norm's bf16 input and its
    per-row statistics, and a GLU's gate and up (the activation is recomputed in backward).  The
    eager modules transformers ships upcast RMSNorm to fp32 (an fp32 copy of the input, 2 bf16
    widths, plus the normalised bf16 tensor before the weight: 2h more per norm), keep the
    activation's output (f more per GLU), and eager experts keep the weighted output they add back
    (h more per routed token).  LayerNorm's native kernel is already fused.
    """
    if block.norm.kind != "rmsnorm":
        norm_widths = 0
    else:  # the block's own norms, MLA's latent norms, per-head QK norms
        attn = block.attention
        norm_widths = (4 if block.norm.placement == "sandwich" else 2) * h
        if attn is not None and attn.kind == "mla":
            norm_widths += attn.q_lora_rank + attn.kv_lora_rank
        if attn is not None and attn.qk_norm:
            norm_widths += (attn.num_heads + attn.num_kv_heads) * attn.head_dim
    mlp = block.mlp
    per_token = 2 * norm_widths
    if mlp.kind == "dense_gated":
        return per_token + mlp.intermediate_size, 0
    if mlp.kind == "moe":  # eager experts also keep the weighted output they add back
        gated = _routed_expert_params(block) >= 3 * h * mlp.intermediate_size
        return per_token + mlp.shared_intermediate_size, h + gated * mlp.intermediate_size
    return per_token, 0


# Aten operators per block, forward + backward, counted with a dispatch mode on transformers' Llama layer
# (219 eager; ``tests/planner/test_fidelity.py`` recounts it and checks another architecture).
OPS_PER_GEMM = 8  # forward view/transpose/mm, backward two mm and their transposes
OPS_PER_NORM = (22, 3)  # (eager, fused): fp32 upcast, pow, mean, rsqrt, muls and casts, and their backward
OPS_ROTARY = (34, 4)  # slices, negation, cat, muls and adds for q and k, and their backward
OPS_GLU = (7, 2)
OPS_ATTENTION = 14  # reshapes, transposes, SDPA forward and backward
OPS_BLOCK_FIXED = 64  # residual adds, views, autograd's gradient accumulation and hidden-state reshapes
# Of a Llama layer's 219 ops, 21 are GEMMs and 105 views (no kernel): 93 launch a non-GEMM kernel.
KERNEL_SHARE = 93 / 219


def _host_ops(block: BlockSpec, norms: int, gemms: int) -> tuple[int, int]:
    attn, mlp = block.attention, block.mlp
    rotary = attn is not None and attn.kind != "none" and block.positional == "rope"
    glu = mlp.kind == "dense_gated" or mlp.kind == "moe"
    attention = attn is not None and attn.kind != "none"
    common = OPS_PER_GEMM * gemms + OPS_ATTENTION * attention + OPS_BLOCK_FIXED
    eager = common + OPS_PER_NORM[0] * norms + OPS_ROTARY[0] * rotary + OPS_GLU[0] * glu
    fused = common + OPS_PER_NORM[1] * norms + OPS_ROTARY[1] * rotary + OPS_GLU[1] * glu
    return eager, fused


def _profile_block(block: BlockSpec, h: int, count: int) -> BlockProfile:
    attn_parts, mlp_parts = _attention_parts(block, h), _mlp_parts(block, h)
    unfused_width, unfused_routed_width = _unfused_widths(block, h)
    gemms = attn_parts.gemms + mlp_parts.gemms
    k = block.mlp.top_k if block.mlp.kind == "moe" else 1
    own_flops = sum(2 * gm.in_features * gm.out_features * (k if gm.routed else 1) for gm in gemms)
    if not gemms and block.linear_flops_per_token:  # unknown mixer: one square-ish GEMM carrying the spec's FLOPs
        gemms = [GemmShape(h, max(1, block.linear_flops_per_token // (2 * h)))]
        own_flops = 2 * h * gemms[0].out_features
    attn = block.attention
    intermediate = (
        block.mlp.top_k * block.mlp.intermediate_size + block.mlp.shared_intermediate_size
        if block.mlp.kind == "moe"
        else block.mlp.intermediate_size
    )
    norms, norm_elements = _norm_inventory(block, h)
    # transformers runs K and V, and gate and up, as separate linears where the profile joins them
    linears = len(gemms) + bool(attn is not None and attn.kind in ("mha", "gqa")) + (block.mlp.kind == "dense_gated")
    eager_ops, fused_ops = _host_ops(block, norms, linears)
    # Eager RMSNorm upcasts to fp32 and makes ~6 passes over it (anchors: 7-8 % of copy bandwidth counting its
    # one read and write, ~12x a fused kernel's traffic); eager SiLU*up writes and rereads the activation;
    # eager rotary builds rotate_half with a cat and four elementwise ops over q and k.
    rotary_width = (
        (attn.num_heads + attn.num_kv_heads) * attn.head_dim
        if attn is not None and attn.kind != "none" and block.positional == "rope"
        else 0
    )
    glu_width = 2 * intermediate if block.mlp.kind in ("dense_gated", "moe") else 0
    eager_width = (11 * 2 * norm_elements if block.norm.kind == "rmsnorm" else 0) + glu_width + 6 * rotary_width
    return BlockProfile(
        count=count,
        hidden=h,
        gemms=tuple(gemms),
        flops_scale=block.linear_flops_per_token / own_flops if own_flops else 1.0,
        attention_flops_per_ctx=block.attention_flops_per_token_per_ctx,
        window=attn.window if attn else None,
        causal=attn.causal if attn else True,
        num_heads=attn.num_heads if attn else 0,
        num_kv_heads=attn.num_kv_heads if attn else 0,
        head_dim=attn.head_dim if attn else 0,
        kv_cache_width=attn_parts.cache,
        cp_exchange_width=attn_parts.ring,
        saved_width=attn_parts.saved + mlp_parts.saved,
        recomputable_width=attn_parts.recomputable + mlp_parts.recomputable,
        routed_width=mlp_parts.routed,
        unfused_width=unfused_width,
        unfused_routed_width=unfused_routed_width,
        elementwise_width=12 * h + 4 * intermediate,
        eager_elementwise_width=eager_width,
        host_ops=eager_ops,
        host_ops_fused=fused_ops,
        num_experts=block.mlp.num_experts if block.mlp.kind == "moe" else 0,
        top_k=block.mlp.top_k if block.mlp.kind == "moe" else 0,
        dense_params=block.params - mlp_parts.expert_params,
        expert_params=mlp_parts.expert_params,
        has_attention=bool(attn_parts.gemms),
        has_mlp=bool(mlp_parts.gemms),
        score_bias=bool(attn_parts.gemms) and block.positional == "alibi",
        cacheable_width=attn_parts.cacheable + mlp_parts.cacheable,
        routed_cacheable_width=mlp_parts.routed_cacheable,
        routed_recomputable_width=mlp_parts.routed_recomputable,
        routed_output_width=mlp_parts.routed_output,
        expert_groups=block.mlp.n_group if block.mlp.kind == "moe" else 1,
        expert_layout=block.mlp.expert_layout if block.mlp.kind == "moe" else "",
        groups_per_token=block.mlp.topk_group if block.mlp.kind == "moe" else 1,
    )


@dataclass(frozen=True)
class ModelProfile:
    blocks: tuple[BlockProfile, ...]
    layer_types: np.ndarray  # block-type index of each layer, in order
    hidden: int
    vocab: int
    embed_params: int
    head_params: int  # lm head (a copy of the embedding when tied and the ends sit on different stages), final norm
    head_flops_per_token: int
    tied: bool
    signatures: tuple[str, ...]  # BlockSpec.signature() of each block type, for calibration look-ups
    prediction_modules: int = 0  # multi-token-prediction modules after the last layer (``with_prediction_modules``)

    @property
    def head_passes(self) -> int:
        """Passes through the output head and its loss per micro-batch: the model's, then one per MTP module."""
        return 1 + self.prediction_modules

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def max_experts(self) -> int:
        return max((b.num_experts for b in self.blocks), default=0)

    def attention_context(self, block: BlockProfile, seq_len: int) -> float:
        """Average attended tokens per query: causal halves the square, a window caps it."""
        span = min(seq_len, block.window) if block.window else seq_len
        if not block.causal:
            return float(span)
        if block.window and block.window < seq_len:
            return span * (1 - span / (2 * seq_len)) + 0.5
        return (seq_len + 1) / 2

    def model_flops_per_token(self, seq_len: int, training: bool = True) -> float:
        """Model FLOPs per token (no recompute): the numerator of MFU."""
        forward = self.head_flops_per_token + sum(
            b.count * (b.flops_scale * _gemm_flops(b) + b.attention_flops_per_ctx * self.attention_context(b, seq_len))
            for b in self.blocks
        )
        return 3 * forward if training else forward


def with_prediction_modules(profile: ModelProfile, depth: int) -> ModelProfile:
    """``profile`` trained with ``depth`` multi-token-prediction modules (DeepSeek-V3 sec. 2.2).

    Each module normalises the last hidden state and the next token's embedding, projects their concatenation
    (2h -> h), runs one block of its own and passes through the shared output head and loss again.  Modelled as one
    more layer of the last layer's kind after the last (so on the head's stage), the projection's parameters and
    FLOPs with the head, and one more head pass (``head_passes``); the embedding and head weights are shared.
    """
    if depth <= 0:
        return profile
    last = int(profile.layer_types[-1])
    blocks = tuple(replace(b, count=b.count + depth) if i == last else b for i, b in enumerate(profile.blocks))
    projection = 2 * profile.hidden * profile.hidden
    return replace(
        profile,
        blocks=blocks,
        layer_types=np.concatenate([profile.layer_types, np.full(depth, last, dtype=np.int64)]),
        head_params=profile.head_params + depth * projection,
        head_flops_per_token=profile.head_flops_per_token * (1 + depth) + depth * 2 * projection,
        prediction_modules=depth,
    )


def _gemm_flops(block: BlockProfile) -> float:
    return sum(2 * g.in_features * g.out_features * (block.top_k if g.routed else 1) for g in block.gemms)


def profile_model(spec: ModelSpec) -> ModelProfile:
    if not spec.blocks:
        raise BadInput("the model spec has no repeated blocks to lay out")
    h = spec.hidden_size
    signatures: dict[str, int] = {}
    counts: dict[str, int] = {}
    first: dict[str, BlockSpec] = {}
    layer_types = []
    for block in spec.blocks:
        sig = block.signature()
        if sig not in signatures:
            signatures[sig] = len(signatures)
            first[sig] = block
        counts[sig] = counts.get(sig, 0) + 1
        layer_types.append(signatures[sig])
    blocks = tuple(_profile_block(first[sig], h, counts[sig]) for sig in signatures)
    embed = spec.params.embeddings or spec.vocab_size * h
    head = spec.params.lm_head or (spec.vocab_size * h if spec.is_causal else 0)
    outside_blocks = spec.params.total - sum(b.params for b in spec.blocks) - embed - spec.params.lm_head
    head += max(0, outside_blocks)  # final norm and anything else outside the blocks rides with the head
    return ModelProfile(
        blocks=blocks,
        layer_types=np.asarray(layer_types, dtype=np.int64),
        hidden=h,
        vocab=spec.vocab_size,
        embed_params=embed,
        head_params=head,
        head_flops_per_token=spec.cost.lm_head_flops_per_token or 2 * h * spec.vocab_size,
        tied=spec.tie_word_embeddings,
        signatures=tuple(signatures),
    )
