"""The time model's physical constants and the software a run uses (``Efficiency``): what every other planner module
reads, so it sits below them all."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from parallel_planner.comms import LinkModel
from parallel_planner.dispatch import DispatchCosts
from parallel_planner.runtimes import check_runtime

# fp8 recipes by scale granularity: one scale per tensor (Transformer Engine's delayed scaling), per row, or per block
# (1x128 activation tiles and 128x128 weight blocks, DeepSeek-V3); each one's measured GEMM rate is in kernel_rates.
FP8_SCALINGS = ("tensorwise", "rowwise", "blockwise")


@dataclass(frozen=True)
class Efficiency:
    """Physical constants of the time model and the software the run uses; nothing here is fitted.

    Every constant's source is in ``docs/planner-model.md``.  The software fields say how the run
    executes: ``runtime`` "torch" (DTensor tensor parallelism, ``torch.distributed.pipelining``, as adapt
    and torchtitan run), "megatron" (hand-written TP collectives, asynchronous pipeline P2P) or
    "deepspeed-pipe" (DeepSpeed's pipeline engine and bf16 optimizer, ``runtimes.py``);
    ``attention`` the attention kernel; ``fused_kernels`` whether norms, GLUs and rotary run fused
    (adapt's operators, Transformer Engine, Megatron's fused kernels) or as transformers' eager modules;
    ``compiled`` whether a compiled graph issues the kernels.
    """

    network: float = 0.8  # NCCL bus bandwidth / datasheet link bandwidth (nccl-tests on DGX A100/H100)
    memory_bw: float = 0.8  # achieved HBM fraction of elementwise kernels (anchors: fused RMSNorm 63-91 % of copy)
    kernel_overhead_s: float = 4e-6  # launch gap and tail per kernel on the GPU
    alpha_intra_s: float = 5e-6  # NCCL latency per algorithm step on NVLink
    alpha_inter_s: float = 15e-6  # ... across the network
    overlap: float = 0.8  # compute rate kept while a collective runs beside it (NCCL's SMs taken from the GEMMs)
    cpu_adam_params_per_s: float = 5e8  # offloaded optimizer: host Adam throughput per GPU (DeepSpeed CPU-Adam)
    zero_bubble_fraction: float = 1 / 3  # ZB-H1 bubble relative to 1F1B's (Qi et al. 2024)
    runtime: str = "torch"
    attention: str = "flash2"
    fused_kernels: bool = True
    compiled: bool = False
    host: DispatchCosts = field(default_factory=DispatchCosts)
    cp_allgather: bool = False  # CP gathers K/V before attention (Llama 3) instead of passing them round a ring
    attention_dropout: bool = False  # the run drops attention probabilities (Megatron-LM's default 0.1)
    hidden_dropout: bool = False  # the run drops each residual branch's output (Megatron-LM's default 0.1)
    fp8_scaling: str = "tensorwise"  # fp8 recipe's scale granularity (FP8_SCALINGS; DeepSeek-V3: blockwise)
    grad_accum_fused: bool = False  # weight-gradient GEMMs accumulate into the fp32 buffer (Megatron 2022+)
    grads16: bool = False  # gradients stay 16-bit: autograd accumulates them, DP reduces 16 bits (Megatron-LM 2021)
    launch_blocking: bool = False  # CUDA_LAUNCH_BLOCKING=1: the host waits for every kernel (BLOOM's launch script)
    ep_forwarded: bool = False  # MoE all-to-all crosses the network once per target node, then NVLink (DeepEP)
    ep_fp8_dispatch: bool = False  # tokens quantised to fp8 before the dispatch (and gradients before its mirror)
    moe_weighted_activation: bool = False  # routing weight applied to the experts' activation (memory.MemoryModel)
    # selective recompute also reruns every second matmul of a block (torchtitan's "selective op" policy)
    selective_alternate_matmuls: bool = False
    gemm_scale: float = 1.0  # a calibration's measured / modelled GEMM rate on the target machine (1: none)
    gpu_spread: float = 0.08  # speed range over a cluster's GPUs of one SKU, outliers left out (Sinha et al., SC22)

    def __post_init__(self) -> None:
        check_runtime(self.runtime)
        if self.fp8_scaling not in FP8_SCALINGS:
            raise ValueError(f"unknown fp8 scaling {self.fp8_scaling!r}: one of {', '.join(FP8_SCALINGS)}")

    def link_model(self) -> LinkModel:
        return LinkModel(self.alpha_intra_s, self.alpha_inter_s, self.network)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
