"""The e2e profile's grouping of device kernels by what they are, from their names alone."""

from __future__ import annotations

import pytest

from benchmarks.step_profile import OTHER, kernel_kind, summarise

TRITON = "triton (Inductor or hand-written)"


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("_rms_norm_fwd", TRITON),  # adapt's hand-written kernels are named by their function
        ("_glu_bwd", TRITON),
        ("_rope_kernel", TRITON),
        ("triton_red_fused__to_copy_add_embedding_mean_mul_pow_rsqrt_0", TRITON),
        ("_adamw_kernel", "optimizer"),
        ("_ce_chunk_kernel", "loss"),
        ("nvjet_sm90_tst_128x256_64x4_2x1_v_bz_coopA_NTN", "gemm"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", "attention"),
        ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<float>>(int, ...)", OTHER),
        ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<...>", "optimizer"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", OTHER),
        ("Memcpy DtoH (Device -> Pinned)", "copies and fills"),
    ],
)
def test_kernels_are_grouped_by_their_names(name, kind):
    assert kernel_kind(name) == kind


def test_the_summary_keeps_every_kernels_time_for_a_later_grouping():
    kernels = [(0.0, 10.0, "_glu_fwd"), (10.0, 30.0, "nvjet_x"), (40.0, 45.0, "_glu_fwd")]
    summary = summarise(kernels, wall_us=50.0, steps=1)
    assert summary["by_name_ms_per_step"] == {"nvjet_x": 0.02, "_glu_fwd": 0.015}
    assert summary["by_kind_ms_per_step"] == {"gemm": 0.02, TRITON: 0.015}
    assert summary["largest_gaps"] == [{"ms": 0.01, "after": "nvjet_x", "before": "_glu_fwd"}]
