"""Every kernel compiles for Hopper (sm_90) through Triton's real compiler, down to a cubin.

The CPU interpreter accepts code that the GPU compiler rejects (non-constexpr globals, unsupported
control flow), so CI also compiles each kernel for an H100/H200 target; no GPU is needed for that.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
P16, P32, PI64, I32, F32 = "*bf16", "*fp32", "*i64", "i32", "fp32"


def _sig(names: str, types: list[str], constexprs: dict) -> dict:
    params = names.split()
    sig = dict(zip(params, types, strict=True))
    sig.update({k: "constexpr" for k in constexprs})
    return sig


CASES = {
    "norms._rms_norm_fwd": (
        "X R S Y W RSTD M N stride_x stride_r eps offset",
        [P16, P16, P16, P16, P16, P32, I32, I32, I32, I32, F32, F32],
        dict(HAS_RESIDUAL=True, STORE_RSTD=True, CAST=0, BLOCK_M=2, BLOCK_N=4096),
    ),
    "norms._rms_norm_bwd": (
        "DY X W RSTD DS DX DW_PARTIAL M N stride_dy stride_ds offset",
        [P16, P16, P16, P32, P16, P16, P32, I32, I32, I32, I32, F32],
        dict(HAS_DS=True, COMPUTE_DW=True, CAST=2, PREFETCH=True, BLOCK_M=1, BLOCK_N=8192),
    ),
    "norms._layer_norm_fwd": (
        "X Y W B MEAN RSTD M N stride_x eps",
        [P16, P16, P16, P16, P32, P32, I32, I32, I32, F32],
        dict(HAS_BIAS=True, STORE_STATS=True, BLOCK_M=4, BLOCK_N=2048),
    ),
    "norms._layer_norm_bwd": (
        "DY X W MEAN RSTD DX DW_PARTIAL DB_PARTIAL M N stride_dy",
        [P16, P16, P16, P32, P32, P16, P32, P32, I32, I32, I32],
        dict(COMPUTE_DW=True, COMPUTE_DB=True, PREFETCH=True, BLOCK_M=2, BLOCK_N=4096),
    ),
    "glu._glu_fwd": ("G U Y N stride_g stride_u", [P16, P16, P16, I32, I32, I32], dict(ACT=2, BLOCK=2048)),
    "glu._glu_bwd": (
        "DY G U DG DU Y N stride_dy stride_g stride_u",
        [P16] * 6 + [I32] * 4,
        dict(ACT=1, STORE_Y=True, BLOCK=2048),
    ),
    "rope._rope_kernel": (
        "Q K COS SIN QO KO S N HQ HK D half q_sb q_sh q_ss q_sd k_sb k_sh k_ss k_sd c_sb c_ss c_sd "
        "qo_sb qo_sh qo_ss qo_sd ko_sb ko_sh ko_ss ko_sd",
        [P16] * 6 + [I32] * 25,
        dict(INTERLEAVED=True, INVERSE=True, BLOCK_T=1, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_R=32, BLOCK_P=64),
    ),
    "cross_entropy._ce_chunk_kernel": (
        "LOGITS stride_l LABELS LOSS SCALE V ignore_index label_smoothing z_loss softcap",
        [P16, I32, PI64, P32, P32, I32, I32, F32, F32, F32],
        dict(HAS_SOFTCAP=True, PER_ROW_SCALE=True, COMPUTE_GRAD=True, BLOCK_V=8192),
    ),
    "moe._route_fwd": (
        "LOGITS BIAS WEIGHTS IDS E stride_l scale",
        [P16, P32, P32, PI64, I32, I32, F32],
        dict(
            TOP_K=8,
            SCORING=1,
            N_GROUP=8,
            TOPK_GROUP=4,
            HAS_BIAS=True,
            NORMALIZE=True,
            BLOCK_E=256,
            BLOCK_K=8,
            BLOCK_G=8,
        ),
    ),
    "moe._route_bwd": (
        "LOGITS IDS DWEIGHTS DLOGITS E stride_l scale",
        [P16, PI64, P32, P16, I32, I32, F32],
        dict(TOP_K=2, SCORING=0, NORMALIZE=True, BLOCK_E=8, BLOCK_K=2),
    ),
    "moe._gather_rows": ("X SOURCE OUT H stride_x", [P16, PI64, P16, I32, I32], dict(BLOCK_H=1024)),
    "moe._combine_rows": (
        "Y POSITION WEIGHTS OUT H stride_y",
        [P16, PI64, P32, P16, I32, I32],
        dict(TOP_K=6, HAS_WEIGHTS=True, BLOCK_K=8, BLOCK_H=1024),
    ),
    "moe._unpermute_bwd": (
        "DY Y POSITION WEIGHTS DYS DW H stride_y",
        [P16, P16, PI64, P32, P16, P32, I32, I32],
        dict(TOP_K=2, BLOCK_K=2, BLOCK_H=1024),
    ),
    "gemm._grouped_mm_kernel": (
        "A B C OFFSETS TILE_EXPERT TILE_FIRST N K stride_am stride_ak stride_be stride_bk stride_bn stride_cm",
        [P16, P16, P16, PI64, "*i32", "*i32"] + [I32] * 8,
        dict(FP32_IEEE=False, UPCAST=False, BLOCK_M=128, BLOCK_N=128, BLOCK_K=64),
    ),
    "gemm._grouped_weight_grad_kernel": (
        "X DY DW OFFSETS K N stride_xm stride_dym stride_we stride_wk stride_wn",
        [P16, P16, P16, PI64] + [I32] * 7,
        dict(FP32_IEEE=False, UPCAST=False, BLOCK_M=64, BLOCK_N=128, BLOCK_K=64),
    ),
}


def compile_all(names: list[str]) -> dict[str, str]:
    """Compile the named kernels for sm_90; returns {kernel: error} for those that fail."""
    import importlib

    failures = {}
    for kernel in names:
        module_name, fn_name = kernel.split(".")
        fn = getattr(importlib.import_module(f"operators.kernels.{module_name}"), fn_name)
        names_, types, constexprs = CASES[kernel]
        try:
            assert isinstance(fn, triton.runtime.jit.JITFunction), f"{kernel} was built for the interpreter"
            compiled = triton.compile(ASTSource(fn, _sig(names_, types, constexprs), constexprs), target=HOPPER)
            assert len(compiled.asm["cubin"]) > 0
        except Exception as exc:  # collected, so one run reports every kernel
            failures[kernel] = f"{type(exc).__name__}: {exc}"[-2000:]
    return failures


def test_every_kernel_compiles_for_sm90():
    # Triton decides interpreter vs compiler when triton.language is imported, so compile in a fresh process.
    env = dict(
        os.environ, TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION=os.environ.get("TRITON_DEFAULT_FP_FUSION", "1")
    )
    proc = subprocess.run(
        [sys.executable, __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert f"compiled {len(CASES)} kernels" in proc.stdout


if __name__ == "__main__":
    failed = compile_all(sorted(CASES))
    for name, error in failed.items():
        print(f"FAILED {name}: {error}")
    print(f"compiled {len(CASES) - len(failed)} kernels")
    sys.exit(1 if failed else 0)
