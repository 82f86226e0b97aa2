"""GPU catalogue: the hardware figures the memory and time models need, one entry per GPU type.

Peaks are vendor datasheet figures for dense (non-sparse) tensor-core math.  Bandwidths are per GPU
and per direction: ``intra_node_gbps`` is the GPU's share of the scale-up fabric (NVLink/NVSwitch,
Infinity Fabric), ``inter_node_gbps`` is its NIC (rail-optimised clusters give each GPU one NIC).
``gemm_ceiling`` is the fraction of dense peak that a large, well-shaped bf16 GEMM sustains with the
vendor BLAS, so the time model never assumes a rate the silicon does not deliver.  H100, H800 and H200
share the GH100 die, clocks and 700 W envelope, so they share one figure: the repeated 8192^3 reading on
H200 (680-687 TFLOP/s, shared/anchors.md; a single higher reading of 788 was not repeated in that
session).  A calibration (``gemm_efficiency``) replaces it with the target machine's measurement.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from adapt.core.errors import BadInput

GIB = 1024**3


@dataclass(frozen=True)
class GpuType:
    name: str
    memory_gib: float
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense; 0 where the GPU has no fp8 tensor cores
    hbm_gbps: float  # GB/s
    intra_node_gbps: float  # GB/s per direction per GPU
    inter_node_gbps: float  # GB/s per direction per GPU
    gpus_per_node: int
    gemm_ceiling: float  # large-GEMM fraction of dense peak
    pcie_gbps: float = 25.0  # host link, used by optimizer offload

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    def peak_flops(self, precision: str) -> float:
        """Dense tensor-core FLOP/s for ``precision``; fp8 on a GPU without it is bad input."""
        if precision == "fp8":
            if not self.fp8_tflops:
                raise BadInput(f"GPU {self.name} has no fp8 tensor cores; use --precision bf16")
            return self.fp8_tflops * 1e12
        return self.bf16_tflops * 1e12

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


GPU_CATALOG: dict[str, GpuType] = {
    gpu.name: gpu
    for gpu in (
        # A100 SXM4 80 GB: NVLink3 600 GB/s bidirectional, 8x HDR 200 Gb/s per DGX node.
        GpuType("a100", 80, 312, 0, 2039, 300, 25, 8, 0.88, pcie_gbps=25),
        # H100 SXM5 80 GB: NVLink4 900 GB/s bidirectional, 8x NDR 400 Gb/s.
        GpuType("h100", 80, 989, 1979, 3350, 450, 50, 8, 0.69, pcie_gbps=50),
        # H800: H100 silicon with NVLink cut to 400 GB/s bidirectional; 8x 400 Gb/s IB (DeepSeek-V3 cluster).
        GpuType("h800", 80, 989, 1979, 3350, 200, 50, 8, 0.69, pcie_gbps=50),
        # H200 SXM 141 GB HBM3e.
        GpuType("h200", 141, 989, 1979, 4800, 450, 50, 8, 0.69, pcie_gbps=50),
        # B200 180 GB HBM3e: NVLink5 1.8 TB/s bidirectional, ConnectX-8 800 Gb/s.
        GpuType("b200", 180, 2250, 4500, 8000, 900, 100, 8, 0.72, pcie_gbps=50),
        # MI300X 192 GB: 7 Infinity Fabric links of 64 GB/s per direction, 400 Gb/s NIC.
        GpuType("mi300x", 192, 1307, 2615, 5300, 448, 50, 8, 0.55, pcie_gbps=50),
    )
}


def gpu_type(name: str) -> GpuType:
    key = name.strip().lower().replace("-", "").replace("_", "")
    for gpu in GPU_CATALOG.values():
        if gpu.name == key:
            return gpu
    raise BadInput(f"GPU type {name!r} is not in the catalogue (known: {', '.join(GPU_CATALOG)})")
