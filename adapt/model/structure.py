"""Derive the per-block structure of a model from its module tree and tensor shapes.

No ``model_type`` or class-name tables: a block is one element of the model's repeated
``ModuleList``; inside it, parametric leaves are grouped by the block child that owns them and
classified by shape (2-D weights are projections, 3-D weights are expert banks, 1-D-only modules
are norm candidates; ``roles.settle_banks`` corrects the banks from what the block was seen to compute).
Norms and activations are confirmed by running a CPU copy of that one small module against reference formulas.  Head counts come from the attention module's own attributes or
the config's standard names, cross-checked against projection shapes.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from adapt.core.spec import AttentionSpec, MLPSpec, NormSpec
from adapt.model.activations import ACTIVATIONS
from adapt.model.blocks import is_expert_list

# ---------------------------------------------------------------- leaf classification


@dataclass
class Projection:
    path: str  # relative to the block
    shape: tuple[int, int]  # weight shape as stored
    bias: bool
    params: int
    out_features: int | None = None  # where the module names it (nn.Linear); GPT-2's Conv1D stores (in, out)

    def other_dim(self, hidden: int) -> int | None:
        """The dimension that is not the model width (None when both are the width)."""
        a, b = self.shape
        if a == hidden and b == hidden:
            return None
        return b if a == hidden else a


@dataclass
class BlockLeaves:
    """One block's leaves sorted by what their parameters look like (the intake's raw material)."""

    projections: dict[str, list[Projection]] = field(default_factory=dict)  # by owning child
    banks: dict[str, list[tuple[str, tuple[int, ...]]]] = field(default_factory=dict)  # 3-D expert weights
    bank_layout: dict[str, str] = field(default_factory=dict)  # by owner: "bank", "list" or "rows" (MLPSpec's)
    norm_like: list[tuple[str, nn.Module, int]] = field(default_factory=list)  # (path, module, size)
    param_free: list[tuple[str, nn.Module]] = field(default_factory=list)
    other_1d: list[tuple[str, str, int]] = field(default_factory=list)  # (module path, param name, size)
    # several same-shaped matrices on one module (DBRX keeps its experts as (experts x inner, width) matrices): by
    # owning child, (path, shape); also counted in ``other_1d`` until a router says they are expert banks
    stacked: dict[str, list[tuple[str, tuple[int, int]]]] = field(default_factory=dict)
    convolutions: dict[str, list[str]] = field(default_factory=dict)  # by owning child: conv module paths
    buffers: dict[str, tuple[int, ...]] = field(default_factory=dict)


def _owner(path: str) -> str:
    return path.split(".", 1)[0] if "." in path else ""


def split_block(block: nn.Module) -> BlockLeaves:
    parts = BlockLeaves()
    skip: tuple[str, ...] = ()
    for path, module in block.named_modules():
        if skip and path.startswith(skip):
            continue
        if is_expert_list(module):
            # Experts kept as a list of identical MLPs: record them as 3-D banks, like fused experts.
            for pname, p in module[0].named_parameters():
                if p.dim() == 2:
                    parts.banks.setdefault(_owner(path), []).append((f"{path}.{pname}", (len(module), *p.shape)))
                    parts.bank_layout[_owner(path)] = "list"
            skip = tuple(f"{path}.{i}." for i in range(len(module))) + tuple(f"{path}.{i}" for i in range(len(module)))
            continue
        own = list(module.named_parameters(recurse=False))
        if isinstance(module, nn.modules.conv._ConvNd):  # a token mixer's filter, not an expert bank
            parts.convolutions.setdefault(_owner(path), []).append(path)
            continue
        if not own:
            if path and not list(module.children()):
                parts.param_free.append((path, module))
            continue
        # a 3-D parameter is a bank of matrices when both trailing sizes are; one shaped (1, 1, h) is a vector kept
        # ready to broadcast over (batch, positions): RWKV's token-shift mixing weights
        vectors = [(n, p) for n, p in own if p.dim() == 3 and min(p.shape[1:]) == 1]
        if vectors:
            parts.other_1d += [(path, n, p.numel()) for n, p in vectors]
            broadcast = {n for n, _ in vectors}
            own = [(n, p) for n, p in own if n not in broadcast]
            if not own:
                continue
        dims = {p.dim() for _, p in own}
        if 3 in dims:
            for pname, p in own:
                if p.dim() == 3:
                    parts.banks.setdefault(_owner(path), []).append((f"{path}.{pname}", tuple(p.shape)))
                    parts.bank_layout.setdefault(_owner(path), "bank")
            continue
        weight2d = [(n, p) for n, p in own if p.dim() == 2]
        if len(weight2d) == 1 and all(p.dim() <= 2 for _, p in own):
            name, w = weight2d[0]
            proj = Projection(
                path=path,
                shape=(int(w.shape[0]), int(w.shape[1])),
                bias=any(p.dim() == 1 for _, p in own),
                params=sum(p.numel() for _, p in own),
                out_features=getattr(module, "out_features", None) if isinstance(module, nn.Linear) else None,
            )
            parts.projections.setdefault(_owner(path), []).append(proj)
        elif dims == {1}:
            sizes = {p.numel() for _, p in own}
            # a norm holds no weighted children: a 1-D parameter beside them is a bias of the module's own output
            parent = any(True for child in module.children() for _ in child.parameters())
            if len(own) <= 2 and len(sizes) == 1 and not parent:
                parts.norm_like.append((path, module, sizes.pop()))
            else:
                parts.other_1d += [(path, n, p.numel()) for n, p in own]
        else:
            parts.other_1d += [(path, n, p.numel()) for n, p in own]
            if len(weight2d) > 1 and len({tuple(p.shape) for _, p in weight2d}) == 1:
                parts.stacked.setdefault(_owner(path), []).extend(
                    (f"{path}.{n}", (int(p.shape[0]), int(p.shape[1]))) for n, p in weight2d
                )
    for name, buf in block.named_buffers():
        parts.buffers[name] = tuple(buf.shape)
    return parts


# ---------------------------------------------------------------- numeric probes


def _materialise(module: nn.Module) -> nn.Module | None:
    """A CPU float64 copy of one small module with fresh random parameters, or None if impossible."""
    if sum(p.numel() for p in module.parameters()) > 50_000_000:
        return None
    try:
        clone = copy.deepcopy(module).to_empty(device="cpu").to(torch.float64)
    except Exception:
        return None
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in clone.parameters():
            p.copy_(torch.rand(p.shape, generator=gen, dtype=torch.float64) * 0.5 + 0.25)
    return clone


def probe_norm(module: nn.Module, size: int) -> NormSpec | None:
    """Which normalisation ``module`` computes (RMS or Layer, with (1+w) offset), by running it.

    None when it matches neither, or cannot be run on one tensor alone (a gated norm that needs its gate)."""
    try:
        return _probe_norm(module, size)
    except Exception:  # noqa: BLE001 - a module that is not a plain norm may fail anywhere in the probe
        return None


def _probe_norm(module: nn.Module, size: int) -> NormSpec | None:
    clone = _materialise(module)
    if clone is None:
        return None
    gen = torch.Generator().manual_seed(99)
    params = list(clone.parameters())
    w, b = params[0], (params[1] if len(params) > 1 else None)
    # Two input scales: at small magnitude the eps term matters, so eps placement is tested too.
    # Modules that compute internally in float32 agree with the float64 formulas to ~1e-6 relative.
    matches: set[tuple[str, float, float]] | None = None
    for scale in (2.0, 0.02):
        x = (torch.randn(3, 5, size, generator=gen, dtype=torch.float64) + 0.35) * scale
        try:
            with torch.no_grad():
                y = clone(x)
        except Exception:
            return None
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            return None
        y = y.to(torch.float64)
        found = set()
        for eps in _eps_candidates(module):
            rms = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            centred = x - x.mean(-1, keepdim=True)
            ln = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps)
            for kind, base in (("rmsnorm", rms), ("layernorm", ln)):
                for offset in (0.0, 1.0):
                    ref = base * (w + offset) + (b if b is not None else 0)
                    if torch.allclose(y, ref, rtol=2e-5, atol=1e-6):
                        found.add((kind, eps, offset))
        matches = found if matches is None else matches & found
    if not matches:
        return None
    kind, eps, offset = sorted(matches)[0]
    return NormSpec(kind=kind, placement="unknown", eps=eps, offset=offset)  # type: ignore[arg-type]


def _eps_candidates(module: nn.Module) -> list[float]:
    found = [float(v) for k, v in vars(module).items() if "eps" in k.lower() and isinstance(v, (int, float))]
    return found or [1e-5, 1e-6, 1e-12, 1e-8]


def probe_activation(module: nn.Module) -> str | None:
    x = torch.linspace(-6, 6, 97, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = copy.deepcopy(module).to_empty(device="cpu")(x)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    for name, fn in ACTIVATIONS.items():
        if torch.allclose(y.to(torch.float64), fn(x), rtol=1e-6, atol=1e-6):
            return name
    return None


# ---------------------------------------------------------------- block interpretation


def _int_attr(modules: list[nn.Module], names: tuple[str, ...]) -> int | None:
    for module in modules:
        for name in names:
            value = getattr(module, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _cfg(config, *names, default=None):
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def is_mlp_group(projs: list[Projection], hidden: int) -> bool:
    """Projections that go width -> I (once, twice, or fused 2I) -> width, with one inner size I; beside them a
    square gate on the width (RWKV's receptance) when an up- and a down-projection are both there."""
    if not projs or any(hidden not in p.shape for p in projs):
        return False  # a matrix off the width (Mamba's A_log beside its mixer) is no MLP
    sized = [p for p in projs if p.other_dim(hidden) is not None]
    if len(sized) < len(projs) and not (_reads_width(sized, hidden) and _writes_width(sized, hidden)):
        return False  # squares beside narrow projections that only read the width: an attention's q and o
    others = [p.other_dim(hidden) for p in sized]
    if not others:
        return False
    inner = min(others)  # type: ignore[type-var]
    return all(o in (inner, 2 * inner) for o in others) and sum(o == inner for o in others) >= 1


def is_whole_feed_forward(projs: list[Projection], hidden: int) -> bool:
    """An MLP group holding both its way in from the width and its way back to it."""
    sized = [p for p in projs if p.other_dim(hidden) is not None]
    return _reads_width(sized, hidden) and _writes_width(sized, hidden)


def _reads_width(projs: list[Projection], hidden: int) -> bool:
    return any(p.out_features is not None and p.out_features != hidden for p in projs)


def _writes_width(projs: list[Projection], hidden: int) -> bool:
    return any(p.out_features == hidden for p in projs)


def interpret_attention(
    group: list[Projection],
    latent_norms: list[int],
    attn_modules: list[nn.Module],
    config,
    hidden: int,
    layer: int,
    head_dim_hint: int | None,
    measured_head_dim: int | None = None,
    measured_heads: int | None = None,
) -> AttentionSpec:
    """Attention kind and geometry from projection shapes; the head size and query heads measured on the attention
    core's operands, else from module attributes or the config, else the rotary size (heads: the output
    projection's width over the head size, which a low-rank output projection does not hold)."""
    width_in = [p for p in group if hidden in p.shape]
    # Output projection: the last one writing the width from another size (HF registers o_proj last, though a
    # projection reading the width, a sink's or a position bias's, may follow it), else the last touching it.
    # A square one (heads x head size equal to the width) writes the width too, when no other one does.
    writes = [p for p in width_in if p.out_features == hidden and p.other_dim(hidden) is not None] or [
        p for p in width_in if p.out_features == hidden
    ]
    out_proj = writes[-1] if writes else width_in[-1]
    inputs = [p for p in width_in if p is not out_proj]
    # MLA's up-projections are linear layers reading a latent the attention wrote from the width: a low-rank query
    # or a normed key-value latent.  A matrix off the width that reads anything else, or whose input side is not
    # known (a relative-position bias table, a convolution's static filter), is not one.  A latent is narrower than
    # the width: attention that reads a wider input (Zamba's width concatenated with the embeddings) is no MLA.
    latents = {d for d in {p.other_dim(hidden) for p in inputs} | set(latent_norms) if d is not None and d < hidden}
    low_rank = [p for p in group if hidden not in p.shape and p.out_features is not None and p.shape[1] in latents]
    head_dim = (
        measured_head_dim
        or _int_attr(attn_modules, ("head_dim", "head_size", "attention_head_size", "span"))
        or head_dim_hint
    )
    num_heads = _int_attr(attn_modules, ("num_heads", "num_attention_heads", "n_heads", "n_head"))
    num_heads = num_heads or _cfg(config, "num_attention_heads")
    if low_rank:  # multi-head latent attention: low-rank q and kv with their own norms
        q_lora = _cfg(config, "q_lora_rank", default=0) or 0
        kv_lora = _cfg(config, "kv_lora_rank", default=min(latent_norms) if latent_norms else 0)
        rope_dim = _cfg(config, "qk_rope_head_dim", default=0)
        nope_dim = _cfg(config, "qk_nope_head_dim", default=0)
        v_dim = _cfg(config, "v_head_dim", default=0)
        # heads unnamed: the output projection reads heads * v_dim
        heads = (
            int(num_heads) if num_heads else max(1, (out_proj.other_dim(hidden) or hidden) // max(int(v_dim or 1), 1))
        )
        return AttentionSpec(
            kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=measured_head_dim or rope_dim + nope_dim, v_head_dim=v_dim,
            q_lora_rank=q_lora, kv_lora_rank=kv_lora, qk_rope_head_dim=rope_dim, qk_nope_head_dim=nope_dim,
            qkv_bias=any(p.bias for p in inputs),
        )  # fmt: skip
    q_out_total = out_proj.other_dim(hidden) or hidden
    if head_dim is None and num_heads:
        head_dim = q_out_total // int(num_heads)
    outs = sorted((p.other_dim(hidden) or hidden) for p in inputs)
    if head_dim:  # a projection to a width that is not whole heads (a relative-position bias's) is no q, k or v
        outs = [o for o in outs if o % head_dim == 0] or outs
    head_dim = head_dim or 64
    if len(inputs) != 1 and outs and (q_out_total % head_dim or outs[0] % head_dim):
        # nothing names the head size and 64 does not divide the projections: the largest size that divides
        # both the query and the key widths (never zero heads, never a zero-byte KV cache)
        head_dim = math.gcd(q_out_total, outs[0])
    num_heads = measured_heads or max(1, q_out_total // head_dim)
    fused = (inputs[0].other_dim(hidden) or hidden) if len(inputs) == 1 else 0
    kv_shared = _reads_shared_kv(attn_modules) or (len(inputs) == 1 and fused // head_dim <= num_heads)
    if kv_shared:  # only a query projection: the K/V come from another layer, with that layer's head count
        kv_heads = _shared_kv_heads(attn_modules, config, num_heads)
    elif len(inputs) == 1:  # fused qkv: out = (h + 2*kv) * d
        kv_heads = max(1, (fused // head_dim - num_heads) // 2)
    else:
        # the narrowest input projection is the keys' (or the values'), unless the module names a KV head count that
        # another of its projections holds whole (``named_kv_heads``)
        named = named_kv_heads(attn_modules, num_heads, head_dim, outs)
        kv_heads = named or (max(1, outs[0] // head_dim) if outs else num_heads)
    kind = "mha" if kv_heads == num_heads else ("mqa" if kv_heads == 1 else "gqa")
    return AttentionSpec(
        kind=kind, num_heads=num_heads, num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim,
        qkv_bias=any(p.bias for p in inputs), kv_shared=kv_shared,
    )  # fmt: skip


def named_kv_heads(attn_modules: list[nn.Module], heads: int, head_dim: int, widths: list[int]) -> int | None:
    """The KV head count an attention module names, where one of its input projections (output ``widths``) holds
    that many heads whole: the narrowest projection is not always the keys' (Zaya splits its values into a current
    and a delayed half).  None where the module names none, or no projection bears it out."""
    named = _int_attr(attn_modules, ("num_key_value_heads", "num_kv_heads"))
    return named if named is not None and heads % named == 0 and named * head_dim in widths else None


def _reads_shared_kv(attn_modules: list[nn.Module]) -> bool:
    """transformers marks a layer that attends to another layer's K/V (``is_kv_shared_layer``); such a layer may
    still hold K/V projections it does not use, so the projections alone cannot say."""
    return any(getattr(m, "is_kv_shared_layer", False) is True for m in attn_modules)


def _shared_kv_heads(attn_modules: list[nn.Module], config, num_heads: int) -> int:
    """KV heads of the K/V a sharing layer reads: its query heads over the heads each KV head serves, else the
    module's or the config's KV head count."""
    groups = _int_attr(attn_modules, ("num_key_value_groups",))
    if groups and num_heads % groups == 0:
        return num_heads // groups
    heads = _int_attr(attn_modules, ("num_key_value_heads", "num_kv_heads")) or _cfg(config, "num_key_value_heads")
    return int(heads) if isinstance(heads, int) and 0 < heads <= num_heads else num_heads


def attention_window(attn_modules: list[nn.Module], config, layer: int) -> int | None:
    """The attention's sliding window in tokens, None for full attention: the module's own setting, else the config
    it was built from (a stack with a config of its own, BLT's local encoder, keeps its window there), else the
    model's."""
    if any(getattr(m, "is_sliding", None) is False for m in attn_modules):  # a window kept on a full layer
        return None
    for module in attn_modules:
        if hasattr(module, "sliding_window"):
            value = module.sliding_window
            return int(value) if value else None
    config = next((m.config for m in attn_modules if _is_config(getattr(m, "config", None))), config)
    layer_types = _cfg(config, "layer_types")
    window = _cfg(config, "sliding_window")
    if layer_types and window:
        return int(window) if "sliding" in str(layer_types[layer]) else None
    if window and _cfg(config, "use_sliding_window", default=True):
        return int(window)
    return None


def _is_config(value: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One tensor under two names: the same object, or the same elements of one storage (a Parameter re-wrapping
    another's data).  Equal values in two storages are two tensors: an update to one leaves the other."""
    if a is b:
        return True
    if a.is_meta or b.is_meta or a.device != b.device:  # meta tensors have no storage to compare
        return False
    return (a.untyped_storage().data_ptr(), a.storage_offset(), a.shape, a.stride()) == (
        b.untyped_storage().data_ptr(), b.storage_offset(), b.shape, b.stride())  # fmt: skip


def attention_causal(attn_modules: list[nn.Module], model_causal: bool) -> bool:
    """The ``is_causal`` flag of the attention or of a module inside it (an encoder's self-attention sits below a
    wrapper); else what the model is, a decoder or an encoder."""
    for module in attn_modules:
        for inner in module.modules():
            flag = getattr(inner, "is_causal", None)
            if isinstance(flag, bool):
                return flag
    return model_causal


def interpret_mlp(
    projs: list[Projection],
    banks: list[tuple[str, tuple[int, ...]]],
    block_modules: list[nn.Module],
    config,
    hidden: int,
    activation: str,
) -> tuple[MLPSpec, int, int]:
    """MLP kind and sizes; returns (spec, routed-expert params, router params)."""
    if banks:
        experts = banks[0][1][0]
        inner = min(d for _, shape in banks for d in shape[1:] if d != hidden) if any(
            d != hidden for _, s in banks for d in s[1:]) else hidden  # fmt: skip
        gated = any(2 * inner in shape[1:] for _, shape in banks) or len(banks) >= 3
        bank_params = sum(math.prod(shape) for _, shape in banks)
        router = [p for p in projs if experts in p.shape and hidden in p.shape]
        shared = [p for p in projs if p not in router and 1 not in p.shape]
        shared_inner = min((p.other_dim(hidden) or hidden for p in shared), default=0)
        top_k = _int_attr(block_modules, ("top_k", "num_experts_per_tok")) or _cfg(
            config, "num_experts_per_tok", default=1
        )
        has_bias_correction = False
        spec = MLPSpec(
            kind="moe", intermediate_size=inner, activation=activation, num_experts=experts, top_k=int(top_k),
            num_shared_experts=round(shared_inner / inner) if shared_inner and inner else 0,
            shared_intermediate_size=shared_inner,
            router_scoring=str(_cfg(config, "scoring_func", default="")) or "softmax",
            n_group=int(_cfg(config, "n_group", default=1) or 1), topk_group=int(_cfg(config, "topk_group", default=1) or 1),
        )  # fmt: skip
        del has_bias_correction
        return spec, bank_params, sum(p.params for p in router)
    # a square projection beside narrow ones is a gate on the width (RWKV's receptance), not the inner size
    others = [p.other_dim(hidden) for p in projs if p.other_dim(hidden) is not None] or [hidden] * len(projs)
    inner = min(others)
    ups = [o for o in others if o in (inner, 2 * inner)]
    gated = len(ups) >= 3 or any(o == 2 * inner for o in others) or len(others) < len(projs)
    spec = MLPSpec(
        kind="dense_gated" if gated else "dense_plain", intermediate_size=inner, activation=activation,
        bias=any(p.bias for p in projs),
    )  # fmt: skip
    return spec, 0, 0


def heads_kept_as_experts(projs: list[Projection], banks: list[tuple[str, tuple[int, ...]]], hidden: int) -> bool:
    """Does a child holding expert banks keep an attention's query heads as its experts (a mixture of attention
    heads, JetMoE's)?  Besides its router, an MoE's own projections are shared experts, an MLP that leaves the
    width and comes back to it; projections that only read the width are the keys and values the experts' queries
    attend to."""
    rest = _beside_router(projs, banks, hidden)
    if not rest or any(hidden not in p.shape for p in rest):
        return False
    sides = {p.shape.index(hidden) for p in rest}  # the weight's dimension that is the width: one way, or both
    return len(rest) == 1 or (len(sides) == 1 and all(p.shape[0] != p.shape[1] for p in rest))


def interpret_expert_attention(
    projs: list[Projection],
    banks: list[tuple[str, tuple[int, ...]]],
    attn_modules: list[nn.Module],
    config,
    hidden: int,
    measured_top_k: int | None,
    measured_head_dim: int | None,
    head_dim_hint: int | None,
) -> tuple[AttentionSpec, int, float]:
    """An attention whose experts compute the query heads and write the output (``heads_kept_as_experts``): each
    token's heads are its top-k experts' heads; the keys and values come from the projections beside the router.
    Returns (spec, the experts' parameters, those a token touches)."""
    head_dim = (
        measured_head_dim
        or _int_attr(attn_modules, ("head_dim", "head_size", "attention_head_size"))
        or head_dim_hint
        or 64
    )
    top_k = measured_top_k or _int_attr(attn_modules, ("top_k", "num_experts_per_tok"))
    top_k = int(top_k or _cfg(config, "num_experts_per_tok", default=1))
    experts = banks[0][1][0]
    per_expert = min((d for _, shape in banks for d in shape[1:] if d != hidden), default=hidden)
    num_heads = max(1, top_k * per_expert // head_dim)
    kv_width = sum(p.other_dim(hidden) or hidden for p in _beside_router(projs, banks, hidden))
    kv_heads = max(1, kv_width // (2 * head_dim))
    kind = "mha" if kv_heads == num_heads else ("mqa" if kv_heads == 1 else "gqa")
    bank_params = sum(math.prod(shape) for _, shape in banks)
    spec = AttentionSpec(kind=kind, num_heads=num_heads, num_kv_heads=kv_heads, head_dim=head_dim, v_head_dim=head_dim)
    return spec, bank_params, bank_params * min(top_k, experts) / experts


def _beside_router(projs: list[Projection], banks: list[tuple[str, tuple[int, ...]]], hidden: int) -> list[Projection]:
    """An expert-bank owner's projections other than its router (width x experts) and one-wide gates."""
    experts = banks[0][1][0]
    return [p for p in projs if not (experts in p.shape and hidden in p.shape) and 1 not in p.shape]
