"""Intake: ModelSource -> (meta skeleton, checkpoint headers) -> ModelSpec.

Public entry points used by every later stage:
``resolve_source``, ``load_config``, ``build_meta_model``, ``load_model``, ``build_spec``, ``inspect``.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch import nn

from adapt.core.errors import BadInput
from adapt.core.source import ModelSource, resolve_source
from adapt.core.spec import (
    SCHEMA_VERSION,
    AttentionSpec,
    BlockSpec,
    CheckpointReport,
    CostSpec,
    HeadSpec,
    MLPSpec,
    ModelSpec,
    NormSpec,
    ParamCounts,
)
from adapt.model.activations import canonical_activation
from adapt.model.blocks import NoBlockList, find_blocks, residual_width
from adapt.model.measure import ChildFacts, block_signatures, measure_blocks
from adapt.model.roles import child_roles, settle_banks, split_nested_blocks
from adapt.model.skeleton import (
    build_meta_model,
    check_checkpoint,
    declared_attention_softcap,
    load_config,
    load_model,
    quiet_transformers,
)
from adapt.model.structure import (
    attention_causal,
    attention_window,
    interpret_attention,
    interpret_expert_attention,
    interpret_mlp,
    probe_activation,
    probe_norm,
    same_tensor,
    split_block,
)
from adapt.model.traits import features, novelties, stacks_left_out

__all__ = [
    "ModelSource",
    "build_meta_model",
    "build_spec",
    "check_checkpoint",
    "inspect",
    "load_config",
    "load_model",
    "resolve_source",
]  # fmt: skip

DEFAULT_SEQ_LEN = 4096
_HARMLESS_PARAM_FREE = (nn.Dropout, nn.Identity)


def inspect(
    text: str,
    *,
    config_only: bool = False,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    seq_len: int | None = None,
) -> ModelSpec:
    """Resolve, read and describe a checkpoint without loading its tensors."""
    src = resolve_source(text, config_only=config_only, trust_remote_code=trust_remote_code, allow_pickle=allow_pickle)
    return build_spec(src, seq_len=seq_len)


def build_spec(src: ModelSource, seq_len: int | None = None, model: nn.Module | None = None) -> ModelSpec:
    """Describe the model from its meta skeleton (and cross-check the checkpoint when there is one)."""
    config = load_config(src)
    if model is None:
        model = build_meta_model(src, config)
    checkpoint = check_checkpoint(src, model)
    with quiet_transformers():
        return describe_model(model, config, src, seq_len=seq_len, checkpoint=checkpoint)


def describe_model(
    model: nn.Module, config, src: ModelSource | None = None, seq_len: int | None = None,
    checkpoint: CheckpointReport | None = None,
) -> ModelSpec:  # fmt: skip
    embed = model.get_input_embeddings()
    weight = getattr(embed, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise BadInput(
            f"cannot describe this model: its input embedding is a {type(embed).__name__}, not one table of token "
            "vectors (several token streams at once, as an audio codec's codebooks); adapt reads models whose "
            "input is one stream of token ids"
        )
    vocab, hidden = int(weight.shape[0]), residual_width(model)
    try:
        found = find_blocks(model)
    except NoBlockList as err:
        raise BadInput(f"cannot describe this model: {err}") from None
    blocks_path, block_list = found.path, found.blocks
    block_ids = {id(p) for block in block_list for p in block.parameters()}
    max_pos = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    seq = seq_len or min(DEFAULT_SEQ_LEN, max_pos or DEFAULT_SEQ_LEN)
    generates = bool(getattr(model, "can_generate", lambda: False)())

    rope = _rope_info(model, config)
    head_dim_hint = rope["rotary_dim"] if rope and rope.get("partial", 1.0) == 1.0 else None
    has_final_norm = _has_final_norm(model, block_ids, hidden)
    # Before the forward: a model may reconfigure its blocks while running (BigBird falls back from block-sparse
    # to full attention on a short input), and the measured facts are filed under the signatures they had.
    signatures = block_signatures(found)
    try:
        measured = measure_blocks(model, found, signatures)
    except Exception:  # noqa: BLE001 - measurement is a refinement; shapes and config still describe the model
        measured = {}
    norm_cache: dict[tuple[type, int], NormSpec | None] = {}
    unrecognized: list[str] = []
    counts = ParamCounts()
    blocks = []
    # Where the measurement sees q/k rotated in some block, a measured attention without it has no rotary there.
    rotation_seen = any(f.rotation for facts in measured.values() for f in facts.values())
    for index, block in enumerate(block_list):
        spec_block, block_counts = _describe_block(
            block, index, f"{blocks_path}.{index}", config, hidden, head_dim_hint, has_final_norm, norm_cache,
            unrecognized, rope is not None, measured.get(signatures[index], {}), generates, rotation_seen,
        )  # fmt: skip
        blocks.append(spec_block)
        for key, value in block_counts.items():
            setattr(counts, key, getattr(counts, key) + value)
    if all(b.mixer == "none" for b in blocks):  # tokens mix somewhere: these blocks are not the whole layer (XLM's
        for b in blocks:  # attentions sit in a list beside its feed-forward list)
            b.mixer = "unknown"
    # What the attention masks do decides, not which head the class carries: a generating class whose every
    # attention sees later tokens (a BERT LM head built without is_decoder) computes an encoder, and a class that
    # cannot generate (a sequence classifier over a decoder) is causal when its attention masks the future.
    attentions = [b.attention for b in blocks if b.attention]
    is_causal = any(a.causal for a in attentions) if attentions else generates

    _count_outside_blocks(model, block_ids, counts, hidden)
    counts.total = sum(p.numel() for p in model.parameters())
    counts.active_per_token = counts.total - sum(
        round(c) for c in (_inactive_expert_params(b, block_list[b.index]) for b in blocks)
    )
    cost = _cost(model, blocks, counts, seq, hidden, vocab, is_causal, config)
    dtype = str(getattr(config, "dtype", None) or "float32").replace("torch.", "")
    final_cap = getattr(config, "final_logit_softcapping", None)
    head = HeadSpec(tied=_tied(model), softcap=float(final_cap) if final_cap else None)
    return ModelSpec(
        schema_version=SCHEMA_VERSION,
        model_type=str(getattr(config, "model_type", "") or ""),
        architectures=list(getattr(config, "architectures", None) or []),
        source=src.text if src else "",
        revision=src.revision if src else None,
        dtype=dtype,
        model_class=type(model).__name__,
        is_causal=is_causal,
        hidden_size=hidden,
        vocab_size=vocab,
        num_layers=len(blocks),
        max_position_embeddings=max_pos,
        tie_word_embeddings=head.tied,
        rope=rope,
        blocks=blocks,
        params=counts,
        cost=cost,
        unrecognized=sorted(set(unrecognized)),
        novelties=novelties(blocks, sorted(set(unrecognized))) + stacks_left_out(model, found, counts.total),
        checkpoint=checkpoint,
        features=features(blocks, is_causal, head),
        head=head,
    )


def _describe_block(
    block, index, path, config, hidden, head_dim_hint, has_final_norm, norm_cache, unrecognized, has_rope,
    facts: dict[str, ChildFacts], generates: bool, rotation_seen: bool,
) -> tuple[BlockSpec, dict[str, int]]:  # fmt: skip
    parts = split_block(block)
    facts = split_nested_blocks(parts, facts, hidden)
    settle_banks(parts, facts, hidden)
    roles = child_roles(parts, facts, hidden)
    attn_owners, mlp_owners, moe_owners = roles.attention, roles.mlp, roles.moe
    mixer_owners, side_owners, expert_attention = roles.mixer, roles.side, roles.expert_attention
    module_of = dict(block.named_modules())

    # Norms: probe each distinct (class, size) once. Narrow norms inside the attention owner are
    # per-head QK norms or MLA's latent norms; they are classified once the head size is known.
    block_norms: list[NormSpec] = []
    attn_norm_sizes: list[int] = []
    norm_params = attn_norm_params = 0
    for npath, module, size in parts.norm_like:
        key = (type(module), size)
        if key not in norm_cache:
            norm_cache[key] = probe_norm(module, size)
        found = norm_cache[key]
        n_params = sum(p.numel() for p in module.parameters())
        if found is None:
            unrecognized.append(f"{type(module).__name__} ({path}.{npath})")
            continue
        if npath.split(".", 1)[0] in attn_owners and size != hidden:
            attn_norm_params += n_params
            attn_norm_sizes.append(size)
        else:
            norm_params += n_params
            if size == hidden:
                block_norms.append(found)

    activation = "unknown"
    # an MoE's own activation sits beside its expert banks; another in the MLP (Zaya's router MLP) is not the experts'
    bank_holders = {path.rpartition(".")[0] for owner in moe_owners for path, _ in parts.banks.get(owner, [])}
    beside_banks = False
    for fpath, module in parts.param_free:
        if isinstance(module, _HARMLESS_PARAM_FREE) or list(module.buffers()):
            continue
        found_act = probe_activation(module)
        if found_act and fpath.split(".", 1)[0] in (mlp_owners + moe_owners):
            here = fpath.rpartition(".")[0] in bank_holders
            if activation == "unknown" or (here and not beside_banks):
                activation, beside_banks = found_act, here
        elif not found_act:
            unrecognized.append(f"{type(module).__name__} ({path}.{fpath})")
    if activation == "unknown":  # measured: the activation ops the MLP children ran
        seen = Counter(a for o in mlp_owners + moe_owners if o in facts for a in facts[o].activations)
        activation = seen.most_common(1)[0][0] if seen else activation
    if activation == "unknown":
        act = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None)
        activation = canonical_activation(act) if act else "unknown"

    attn_modules = [module_of[o] for o in attn_owners]
    attention: AttentionSpec | None = None
    attn_params = sum(p.params for o in attn_owners for p in parts.projections[o]) + attn_norm_params
    attn_bank, active_attn_bank = 0, 0.0
    if attn_owners:
        group = [p for o in attn_owners for p in parts.projections[o]]
        core = next((facts[o] for o in attn_owners if o in facts and facts[o].head_dim), None)
        measured_dim = core.head_dim if core else None
        if expert_attention:
            owner = expert_attention[0]
            attention, attn_bank, active_attn_bank = interpret_expert_attention(
                group, parts.banks[owner], attn_modules + list(module_of[owner].modules()), config, hidden,
                facts[owner].top_k if owner in facts else None, measured_dim, head_dim_hint,
            )  # fmt: skip
            attn_params += attn_bank
        else:
            attention = interpret_attention(
                group, attn_norm_sizes, attn_modules, config, hidden, index, head_dim_hint, measured_dim,
                core.query_heads if core else None,
            )  # fmt: skip
        attention.window = attention_window(attn_modules, config, index)
        measured_causal = next(
            (facts[o].causal for o in attn_owners if o in facts and facts[o].causal is not None), None
        )
        attention.causal = measured_causal if measured_causal is not None else attention_causal(attn_modules, generates)
        attention.softcap = declared_attention_softcap(config)
        attention.qk_norm = attention.kind != "mla" and attention.head_dim in attn_norm_sizes
        measured_sinks = next((facts[o].sinks for o in attn_owners if o in facts and facts[o].sinks is not None), None)
        if measured_sinks is not None:
            attention.sinks = measured_sinks
        else:  # the core was not seen: a per-head vector in the attention is the best evidence there is
            sinks = [
                s for (m, _, s) in parts.other_1d if m.split(".", 1)[0] in attn_owners and s == attention.num_heads
            ]
            attention.sinks = bool(sinks)
        attn_params += sum(s for (m, _, s) in parts.other_1d if m.split(".", 1)[0] in attn_owners)

    mlp_projs = [p for o in mlp_owners + moe_owners for p in parts.projections.get(o, [])]
    banks = [b for o in moe_owners for b in parts.banks[o]]
    if mlp_projs or banks:
        mlp, bank_params, router_params = interpret_mlp(
            mlp_projs, banks, [module_of[o] for o in moe_owners] + [m for o in moe_owners for m in module_of[o].modules()],
            config, hidden, activation,
        )  # fmt: skip
        routed = next((facts[o] for o in moe_owners if o in facts and facts[o].top_k), None)
        if mlp.kind == "moe" and routed is not None:  # what the router ran outranks config names
            mlp.top_k, mlp.router_scoring = int(routed.top_k), routed.scoring or mlp.router_scoring
        if mlp.kind == "moe":
            mlp.expert_layout = "+".join(sorted({parts.bank_layout.get(o, "bank") for o in moe_owners}))
    else:
        mlp, bank_params, router_params = MLPSpec(kind="none", intermediate_size=0), 0, 0
    mlp_params = sum(p.params for p in mlp_projs)

    if len(block_norms) >= 4:
        placement = "sandwich"
    else:
        placement = "pre" if has_final_norm else "post"
    norm = block_norms[0] if block_norms else NormSpec(kind="none", placement="unknown")
    norm = NormSpec(kind=norm.kind, placement=placement if block_norms else "unknown", eps=norm.eps, offset=norm.offset)

    total = sum(p.numel() for p in block.parameters())
    counted = attn_params + mlp_params + bank_params + norm_params
    shared = mlp_params - router_params if mlp.kind == "moe" else 0
    block_counts = {
        "attention": attn_params,
        "dense_mlp": mlp_params if mlp.kind != "moe" else 0,
        "experts": bank_params,
        "shared_experts": shared,
        "router": router_params,
        "norms": norm_params,
        "other": total - counted,
    }
    active_bank = bank_params * mlp.top_k / mlp.num_experts if mlp.kind == "moe" and mlp.num_experts else 0
    # a mixer's bare matrices (Mamba's A_log) scale its state elementwise; its linear maps are per-token GEMMs
    mixer_maps = [p for o in mixer_owners for p in parts.projections.get(o, []) if p.out_features is not None]
    linear_flops = (
        2
        * (  # every per-token projection: attention's, a state-space or linear-attention mixer's, the MLP's
            sum(p.shape[0] * p.shape[1] for o in attn_owners for p in parts.projections[o])
            + sum(p.shape[0] * p.shape[1] for p in mixer_maps)
            + sum(p.shape[0] * p.shape[1] for o in side_owners for p in parts.projections[o])
            + sum(p.shape[0] * p.shape[1] for p in mlp_projs)
            + int(active_bank)
            + int(active_attn_bank)
        )
    )
    attn_coeff = 0
    if attention is not None:
        attn_coeff = 2 * attention.num_heads * (attention.head_dim + attention.v_head_dim)
    # a rotation measured in the attention names rotary embedding where no inv_freq buffer does
    measured_cores = [facts[o] for o in attn_owners if o in facts and facts[o].head_dim]
    rotated = any(f.rotation for f in measured_cores)
    unrotated_here = rotation_seen and bool(measured_cores) and not rotated  # e.g. layers configured without rope
    mixer, second_mixer = "unknown", None
    state_mixer = "recurrent" if any(facts[o].recurrence for o in mixer_owners if o in facts) else "convolution"
    if attention is not None:
        mixer = "sliding_attention" if attention.window else "full_attention"
        second_mixer = state_mixer if mixer_owners else None
    elif mixer_owners:
        mixer = state_mixer
    elif roles.feed_forward_only:
        mixer = "none"  # a feed-forward-only layer of a hybrid stack (Nemotron-H's "-" and "E" layers) mixes no tokens
    return (
        BlockSpec(
            index=index,
            module=path,
            class_name=type(block).__name__,
            mixer=mixer,
            attention=attention,
            mlp=mlp,
            norm=norm,
            positional="rope" if rotated or (has_rope and not unrotated_here) else "none",
            params=total,
            params_active=total - (bank_params - int(active_bank)) - (attn_bank - int(active_attn_bank)),
            linear_flops_per_token=linear_flops,
            attention_flops_per_token_per_ctx=attn_coeff,
            second_mixer=second_mixer,
        ),  # fmt: skip
        block_counts,
    )


def _inactive_expert_params(block_spec: BlockSpec, block: nn.Module) -> float:
    return block_spec.params - block_spec.params_active


def _has_final_norm(model: nn.Module, block_ids: set[int], hidden: int) -> bool:
    """Pre-norm models normalise after the last block; post-norm ones (BERT) do not."""
    modules = dict(model.named_modules())
    embedding_parents = {name.rsplit(".", 1)[0] if "." in name else "" for name, m in modules.items()
                         if isinstance(m, nn.Embedding)}  # fmt: skip
    # An embedding-side norm (BERT's embeddings.LayerNorm) is not a final norm, unless its parent is the
    # trunk that also holds the blocks (GPT-2's ln_f next to wte and h).
    embedding_parents = {p for p in embedding_parents
                         if not any(id(q) in block_ids for q in modules[p].parameters())}  # fmt: skip
    for name, module in model.named_modules():
        own = list(module.parameters(recurse=False))
        if not own or any(id(p) in block_ids for p in own) or any(p.dim() != 1 for p in own):
            continue
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if parent in embedding_parents:
            continue
        if all(p.numel() == hidden for p in own):
            return True
    return False


def _count_outside_blocks(model: nn.Module, block_ids: set[int], counts: ParamCounts, hidden: int) -> None:
    seen: set[int] = set(block_ids)
    out_emb = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            for p in module.parameters(recurse=False):
                if id(p) not in seen:
                    seen.add(id(p))
                    counts.embeddings += p.numel()
    if out_emb is not None:
        for p in out_emb.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                counts.lm_head += p.numel()
    for module in model.modules():
        own = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        if not own:
            continue
        for p in own:
            seen.add(id(p))
        if all(p.dim() == 1 for p in own) and all(p.numel() == hidden for p in own):
            counts.norms += sum(p.numel() for p in own)
        else:
            counts.other += sum(p.numel() for p in own)


def _tied(model: nn.Module) -> bool:
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return out is not None and same_tensor(out.weight, model.get_input_embeddings().weight)


def _rope_info(model: nn.Module, config) -> dict | None:
    """Rotary embedding facts: inv_freq buffers give the rotary dim; theta/scaling come from the config."""
    dims = [int(b.shape[0]) * 2 for name, b in model.named_buffers() if name.endswith("inv_freq") and b.dim() == 1]
    if not dims:
        return None
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        # one set per layer kind (full and sliding attention): the full layers' reach the longest context
        params = dict(params.get("full_attention") or next(iter(params.values())))
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    partial = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) or 1.0
    return {
        "rotary_dim": Counter(dims).most_common(1)[0][0],
        "theta": theta,
        "rope_type": params.get("rope_type", "default"),
        "scaling": {k: v for k, v in params.items() if k not in ("rope_theta", "rope_type")} or None,
        "partial": float(partial),
    }


def _avg_context(seq: int, window: int | None, causal: bool) -> float:
    if not causal:
        return float(seq)
    if window and window < seq:
        return (window * (window + 1) / 2 + (seq - window) * window) / seq
    return seq / 2


def _cost(model, blocks: list[BlockSpec], counts: ParamCounts, seq, hidden, vocab, is_causal, config) -> CostSpec:
    linear = sum(b.linear_flops_per_token for b in blocks)
    attention = sum(
        int(
            b.attention_flops_per_token_per_ctx
            * _avg_context(seq, b.attention.window if b.attention else None, is_causal)
        )
        for b in blocks
    )
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = 2 * math.prod(out.weight.shape) if out is not None else 0
    forward = linear + attention + head
    dtype = getattr(config, "dtype", None)
    nbytes = dtype.itemsize if isinstance(dtype, torch.dtype) else 2  # checkpoint dtype; bf16 when unstated
    kv = 0
    if is_causal:
        for b in blocks:
            a = b.attention
            if a is None or a.kv_shared:  # a layer reading another's K/V caches nothing of its own
                continue
            per_layer = (
                a.kv_lora_rank + a.qk_rope_head_dim if a.kind == "mla" else a.num_kv_heads * (a.head_dim + a.v_head_dim)
            )
            kv += per_layer * nbytes
    return CostSpec(
        seq_len=seq, forward_flops_per_token=forward, train_flops_per_token=3 * forward, linear_flops_per_token=linear,
        attention_flops_per_token=attention, lm_head_flops_per_token=head, kv_cache_bytes_per_token=kv,
        kv_cache_dtype_bytes=nbytes,
    )  # fmt: skip
