"""The cases timed by ``benchmarks/kernel_speed.py``: shapes, inputs, variants and float64 references.

Shapes follow ``/work/shared/anchors.md``. Variants are adapt's kernel, the Hugging Face eager code
path (the modules and functions transformers itself runs), ``torch.compile`` of that path, and
Liger-Kernel 0.8.5 where it has the same operation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import operators.kernels as K
from operators.kernels import norms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16 = torch.bfloat16
MEMORY_BOUND = ("rms_norm", "add_rms_norm", "layer_norm", "swiglu", "geglu", "rope")


@dataclass
class Case:
    kernel: str
    shape: str
    dtype: torch.dtype
    make: Callable[[], dict]
    variants: dict[str, Callable]
    reference: Callable
    fwd_bytes: int = 0
    fwdbwd_bytes: int = 0
    fwd_flops: int = 0
    fwdbwd_flops: int = 0
    make_check: Callable[[], dict] | None = None
    tolerance_scale: float = 1.0
    backward: bool = True

    def __post_init__(self):
        self.make_check = self.make_check or self.make


def triton_version() -> str:
    import triton

    return triton.__version__


def hf_version() -> str:
    import transformers

    return transformers.__version__


def liger_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("liger-kernel")
    except Exception:
        return None


def _liger():
    """Liger's ops, or None when the wheel is not installed (the variant is then left out)."""
    if DEVICE != "cuda":
        return None
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm
        from liger_kernel.transformers.layer_norm import LigerLayerNorm
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
    except Exception as exc:
        print(f"Liger-Kernel unavailable: {exc}")
        return None
    return dict(
        rms=LigerRMSNorm,
        add_rms=LigerFusedAddRMSNorm,
        ln=LigerLayerNorm,
        silu_mul=LigerSiLUMulFunction,
        gelu_mul=LigerGELUMulFunction,
        rope=liger_rotary_pos_emb,
        flce=liger_fused_linear_cross_entropy,
    )


def _compiled(fn):
    if DEVICE != "cuda":
        return None
    return torch.compile(fn, dynamic=False)


def _with_variants(eager, adapt, liger=None, compile_eager=True):
    variants = {"adapt": adapt, "hf_eager": eager}
    compiled = _compiled(eager) if compile_eager else None
    if compiled is not None:
        variants["torch.compile"] = compiled
    if liger is not None:
        variants["liger"] = liger
    return variants


def _rand(*shape, dtype=BF16, scale=1.0, grad=True):
    return (torch.randn(*shape, device=DEVICE, dtype=torch.float32) * scale).to(dtype).requires_grad_(grad)


def rms_cases(shapes, lg):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for m, n in shapes:
        hf = LlamaRMSNorm(n, eps=1e-6).to(DEVICE, BF16)
        liger = lg["rms"](n, eps=1e-6).to(DEVICE, BF16) if lg else None
        weight = hf.weight

        def ref(x, w):
            xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            return w * (xf + (xf.to(BF16).double() - xf).detach())

        with torch.no_grad():
            weight.copy_(torch.randn(n, device=DEVICE) * 0.1 + 1)
            if liger is not None:
                liger.weight.copy_(weight)
        yield Case(
            "rms_norm",
            f"{m}x{n}",
            BF16,
            lambda m=m, n=n, w=weight: {"x": _rand(m, n), "w": w},
            _with_variants(
                lambda x, w, hf=hf: hf(x),
                lambda x, w: K.rms_norm(x, w, 1e-6),
                (lambda x, w, lig=liger: lig(x)) if liger is not None else None,
            ),
            ref,
            fwd_bytes=2 * m * n * 2,
            fwdbwd_bytes=5 * m * n * 2,
            make_check=lambda m=m, n=n, w=weight: {"x": _rand(min(m, 4096), n), "w": w},
        )


def add_rms_cases(shapes, lg):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    for m, n in shapes:
        hf = LlamaRMSNorm(n, eps=1e-6).to(DEVICE, BF16)
        liger = lg["add_rms"](n, eps=1e-6).to(DEVICE, BF16) if lg else None
        weight = hf.weight

        def eager(x, r, w, hf=hf):
            s = x + r
            return s, hf(s)

        def ref(x, r, w):
            s = x + r
            s = s + (s.to(BF16).double() - s).detach()
            xf = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6)
            return s, w * (xf + (xf.to(BF16).double() - xf).detach())

        with torch.no_grad():
            weight.copy_(torch.randn(n, device=DEVICE) * 0.1 + 1)
            if liger is not None:
                liger.weight.copy_(weight)
        liger_fn = (lambda x, r, w, lig=liger: lig(x, r)) if liger is not None else None
        yield Case(
            "add_rms_norm",
            f"{m}x{n}",
            BF16,
            lambda m=m, n=n, w=weight: {"x": _rand(m, n), "r": _rand(m, n), "w": w},
            _with_variants(eager, lambda x, r, w: K.add_rms_norm(x, r, w, 1e-6), liger_fn),
            ref,
            fwd_bytes=4 * m * n * 2,
            fwdbwd_bytes=9 * m * n * 2,
            make_check=lambda m=m, n=n, w=weight: {"x": _rand(min(m, 4096), n), "r": _rand(min(m, 4096), n), "w": w},
        )


def layer_norm_cases(shapes, lg):
    for m, n in shapes:
        hf = torch.nn.LayerNorm(n, eps=1e-5).to(DEVICE, BF16)
        liger = lg["ln"](n, eps=1e-5).to(DEVICE, BF16) if lg else None
        with torch.no_grad():
            hf.weight.copy_(torch.randn(n, device=DEVICE) * 0.1 + 1)
            hf.bias.copy_(torch.randn(n, device=DEVICE) * 0.1)
            if liger is not None:
                liger.weight.copy_(hf.weight)
                liger.bias.copy_(hf.bias)
        w, b = hf.weight, hf.bias
        yield Case(
            "layer_norm",
            f"{m}x{n}",
            BF16,
            lambda m=m, n=n: {"x": _rand(m, n)},
            _with_variants(
                lambda x, hf=hf: hf(x),
                lambda x, w=w, b=b: K.layer_norm(x, w, b, 1e-5),
                (lambda x, lig=liger: lig(x)) if liger is not None else None,
            ),
            lambda x, w=w, b=b: F.layer_norm(x, (x.shape[-1],), w.double(), b.double(), 1e-5),
            fwd_bytes=2 * m * n * 2,
            fwdbwd_bytes=5 * m * n * 2,
            make_check=lambda m=m, n=n: {"x": _rand(min(m, 4096), n)},
        )


def glu_cases(kind, shapes, lg):
    from transformers.activations import ACT2FN

    act = ACT2FN["silu"] if kind == "swiglu" else ACT2FN["gelu_pytorch_tanh"]
    ours = (lambda g, u: K.swiglu(g, u)) if kind == "swiglu" else (lambda g, u: K.geglu(g, u, "tanh"))
    ref_act = F.silu if kind == "swiglu" else (lambda g: F.gelu(g, approximate="tanh"))
    liger = None
    if lg:
        liger = (
            (lambda g, u: lg["silu_mul"].apply(g, u)) if kind == "swiglu" else (lambda g, u: lg["gelu_mul"].apply(g, u))
        )
    for m, n in shapes:
        yield Case(
            kind,
            f"{m}x{n}",
            BF16,
            lambda m=m, n=n: {"g": _rand(m, n), "u": _rand(m, n)},
            _with_variants(lambda g, u: act(g) * u, ours, liger),
            lambda g, u: ref_act(g) * u,
            fwd_bytes=3 * m * n * 2,
            fwdbwd_bytes=8 * m * n * 2,
            make_check=lambda m=m, n=n: {"g": _rand(min(m, 2048), n), "u": _rand(min(m, 2048), n)},
        )


def rope_cases(shapes, lg):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    for b, hq, hk, s, d in shapes:
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=DEVICE, dtype=torch.float32) / d))
        freqs = torch.arange(s, device=DEVICE, dtype=torch.float32)[:, None] * inv
        emb = torch.cat([freqs, freqs], -1)[None].expand(b, s, d)
        cos, sin = emb.cos().to(BF16).contiguous(), emb.sin().to(BF16).contiguous()

        def make(b=b, hq=hq, hk=hk, s=s, d=d, rows=None):
            s_used = rows or s
            q = _rand(b, s_used, hq, d, grad=False).transpose(1, 2).requires_grad_(True)  # HF's [b, s, h, d] view
            k = _rand(b, s_used, hk, d, grad=False).transpose(1, 2).requires_grad_(True)
            return {"q": q, "k": k}

        def ref(q, k, cos=cos, sin=sin):
            c, sn = cos[:, : q.shape[2]].double().unsqueeze(1), sin[:, : q.shape[2]].double().unsqueeze(1)

            def rot(x):
                half = x.shape[-1] // 2
                return x * c + torch.cat([-x[..., half:], x[..., :half]], -1) * sn

            return rot(q), rot(k)

        def adapt(q, k, cos=cos, sin=sin):
            return K.apply_rotary(q, k, cos[:, : q.shape[2]], sin[:, : q.shape[2]])

        liger = (lambda q, k, cos=cos, sin=sin: lg["rope"](q, k, cos, sin)) if lg else None
        tensor_bytes = 2 * b * (hq + hk) * s * d * 2 + 2 * cos.numel() * 2
        yield Case(
            "rope",
            f"b{b} hq{hq} hk{hk} s{s} d{d}",
            BF16,
            make,
            _with_variants(lambda q, k, cos=cos, sin=sin: apply_rotary_pos_emb(q, k, cos, sin), adapt, liger),
            ref,
            fwd_bytes=tensor_bytes,
            fwdbwd_bytes=2 * tensor_bytes,
            make_check=lambda make=make, s=s: make(rows=min(256, s)),
        )


def flce_cases(shapes, lg):
    for tokens, hidden, vocab in shapes:
        weight = _rand(vocab, hidden, scale=hidden**-0.5)

        def make(tokens=tokens, hidden=hidden, vocab=vocab, weight=weight):
            return {"h": _rand(tokens, hidden), "w": weight, "y": torch.randint(0, vocab, (tokens,), device=DEVICE)}

        def eager(h, w, y):
            return F.cross_entropy((h @ w.t()).float(), y)

        liger = (lambda h, w, y: lg["flce"](h, w, y)) if lg else None
        flops = 2 * tokens * hidden * vocab
        yield Case(
            "fused_linear_ce",
            f"T{tokens} H{hidden} V{vocab}",
            BF16,
            make,
            _with_variants(
                eager, lambda h, w, y: K.fused_linear_cross_entropy(h, w, y), liger, compile_eager=tokens <= 8192
            ),  # compile time: one token count only
            lambda h, w, y: F.cross_entropy(h @ w.t(), y),
            fwd_flops=flops,
            fwdbwd_flops=3 * flops,
            make_check=lambda make=make: {k: (v[:1024] if k != "w" else v) for k, v in make().items()},
        )


def grouped_gemm_cases(shapes):
    for tokens, top_k, experts, k, n in shapes:

        def make(tokens=tokens, top_k=top_k, experts=experts, k=k, n=n, scale=1):
            t = max(tokens // scale, 1)
            ids = torch.rand(t, experts, device=DEVICE).argsort(-1)[:, :top_k]
            counts = torch.bincount(ids.flatten(), minlength=experts)
            offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
            return {"x": _rand(t * top_k, k), "w": _rand(experts, k, n, scale=k**-0.5), "offsets": offsets}

        def loop(x, w, offsets):
            bounds = offsets.tolist()
            return torch.cat([x[bounds[e] : bounds[e + 1]] @ w[e] for e in range(w.shape[0])])

        flops = 2 * tokens * top_k * k * n
        yield Case(
            "grouped_gemm",
            f"T{tokens} k{top_k} E{experts} {k}x{n}",
            BF16,
            make,
            {"adapt": lambda x, w, offsets: K.grouped_gemm(x, w, offsets), "torch.mm loop": loop},
            loop,
            fwd_flops=flops,
            fwdbwd_flops=3 * flops,
            make_check=lambda make=make: make(scale=8),
        )


def all_cases(smoke: bool, only: list[str] | None):
    lg = _liger()
    if smoke:
        norm_shapes, glu_shapes = [(64, 96)], [(32, 200)]
        rope_shapes, ce_shapes, gg_shapes = [(1, 4, 2, 16, 32)], [(40, 32, 300)], [(32, 2, 4, 32, 48)]
    else:
        norm_shapes = [(16384, 4096), (32768, 8192), (65536, 2048)]
        glu_shapes = [(16384, 14336), (8192, 28672)]
        rope_shapes = [(4, 32, 8, 4096, 128)]
        ce_shapes = [(8192, 4096, 128256), (8192, 4096, 151936), (32768, 4096, 128256), (32768, 4096, 151936)]
        gg_shapes = [(8192, 2, 8, 4096, 14336), (8192, 8, 128, 2048, 1536)]
    groups = {
        "rms_norm": lambda: rms_cases(norm_shapes, lg),
        "swiglu": lambda: glu_cases("swiglu", glu_shapes, lg),
        "add_rms_norm": lambda: add_rms_cases(norm_shapes, lg),
        "layer_norm": lambda: layer_norm_cases(norm_shapes[:2], lg),
        "geglu": lambda: glu_cases("geglu", glu_shapes[:1], lg),
        "rope": lambda: rope_cases(rope_shapes, lg),
        "fused_linear_ce": lambda: flce_cases(ce_shapes, lg),
        "grouped_gemm": lambda: grouped_gemm_cases(gg_shapes),
    }
    for name, make_group in groups.items():
        if only is None or name in only:
            yield from make_group()


def sweep_configs(bench: Callable, smoke: bool) -> list[dict]:
    """Kernel-only timings over launch configs: RMSNorm / add+RMSNorm / LayerNorm forward (rows per
    program x warps, one program per tile) and RMSNorm backward with dW (plus persistence and prefetch),
    next to a plain copy of the same byte count (the best any streaming kernel of that size can do)."""
    out = []
    norm_shapes = [(64, 96)] if smoke else [(16384, 4096), (32768, 8192), (65536, 2048)]
    for m, n in norm_shapes:
        w = _rand(n, grad=False)
        x = _rand(m, n, grad=False)
        r = _rand(m, n, grad=False)
        b = _rand(n, grad=False)
        src = torch.empty(m * n, device=DEVICE, dtype=BF16)
        dst = torch.empty_like(src)
        out.append(
            {
                "kernel": "copy (same bytes as the norm forward)",
                "shape": f"{m}x{n}",
                "config": "torch copy_",
                "ms": bench(lambda: dst.copy_(src)),
            }
        )
        forward = {
            "rms_norm fwd": lambda cfg: norms.rms_forward(x, None, w, 1e-6, 0.0, "llama", cfg, need_rstd=False),
            "add_rms_norm fwd": lambda cfg: norms.rms_forward(x, r, w, 1e-6, 0.0, "llama", cfg, need_rstd=False),
            "layer_norm fwd": lambda cfg: norms.layer_norm_forward(x, w, b, 1e-5, cfg, need_stats=False),
        }
        for name, run in forward.items():
            for block_m in (1, 2, 4, 8):
                for warps in (4, 8, 16):
                    if block_m * n > 32768 or block_m * n < 32 * warps:
                        continue
                    cfg = norms.RowConfig(block_m=block_m, num_warps=warps, programs_per_sm=0)
                    out.append({"kernel": name, "shape": f"{m}x{n}", "config": str(cfg), "ms": bench(lambda: run(cfg))})
            out.append({"kernel": name, "shape": f"{m}x{n}", "config": "default", "ms": bench(lambda: run(None))})
            print(f"swept {name} {m}x{n}", flush=True)
        dy = torch.randn_like(x)
        _, _, rstd = norms.rms_forward(x, None, w, 1e-6, 0.0, "llama", None, need_rstd=True)
        for block_m in (1, 2, 4):
            for warps in (8, 16):
                if block_m * n > 16384 or block_m * n < 32 * warps:
                    continue
                for per_sm in (1, 2, 4):
                    cfg = norms.RowConfig(block_m=block_m, num_warps=warps, programs_per_sm=per_sm, prefetch=True)
                    bwd = bench(lambda: norms.rms_backward(dy, None, x, w, rstd, 0.0, "llama", True, cfg))
                    out.append({"kernel": "rms_norm bwd+dW", "shape": f"{m}x{n}", "config": str(cfg), "ms": bwd})
        default = bench(lambda: norms.rms_backward(dy, None, x, w, rstd, 0.0, "llama", True, None))
        out.append({"kernel": "rms_norm bwd+dW", "shape": f"{m}x{n}", "config": "default", "ms": default})
        print(f"swept rms_norm backward {m}x{n}: default {default:.4f} ms", flush=True)
    return out
