"""The rate a GEMM keeps while an NCCL collective runs beside it, and the collective's beside the GEMM.

    PYTHONPATH=$PWD python benchmarks/gemm_beside_nccl.py --out benchmarks/results     # 2 GPUs of one host

The planner's ``Efficiency.overlap`` (0.8) says what share of its rate a GEMM keeps while a collective runs on the
SMs NCCL takes (issue 15: the published rows' one-signed optimism; docs/planner-model.md, "TP overlap").  It was
read off NCCL's SM count, not measured.  This measures it the way the runs overlap: one process per GPU (two GPUs,
NCCL over NVLink), bf16 GEMMs at Megatron-Core's layer shapes on the compute stream, and an all-gather (bf16) or
reduce-scatter (fp32, as gradients are reduced) issued asynchronously on NCCL's own stream at the same moment,
sized to outlast the GEMMs.  Each GEMM burst is timed with CUDA events alone and beside the collective; each
collective alone and beside a GEMM burst long enough to cover it.  ``kept`` is the GEMM's rate beside the
collective over its rate alone: the figure to compare with ``Efficiency.overlap``.  Results:
``gemm-beside-nccl-<gpu>.{json,md}`` (``--render OUT.json`` redraws the table without a GPU).
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repository root
from benchmarks.results_files import rerender_if_asked, write_results  # noqa: E402

# (tokens, in, out): Megatron-Core GPT layer GEMMs at seq 4096, micro-batch 4 (the 7.1B's MLP up-projection at TP 2,
# the 16B's attention projection at TP 4) and the 8192^3 reference the catalogue's ceiling comes from.
GEMMS = ((16384, 4096, 8192), (16384, 6144, 4608), (8192, 8192, 8192))
COLLECTIVES = (("all_gather", torch.bfloat16), ("reduce_scatter", torch.float32))
MIB = 256  # bytes each rank receives per collective call, in MiB: many milliseconds on NVLink
REPS = 3


def _burst_seconds(fn, count: int) -> float:
    """Seconds of ``count`` back-to-back calls of ``fn`` on the current stream, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(count):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _collective(kind: str, dtype: torch.dtype, world: int):
    """A call of the collective (async, on NCCL's stream) and its whole buffer's bytes (gathered output or
    reduce-scatter input), nccl-tests' size convention."""
    import torch.distributed as dist

    elements = MIB * 2**20 // torch.tensor([], dtype=dtype).element_size()
    shard = torch.ones(elements, device="cuda", dtype=dtype)
    whole = torch.ones(elements * world, device="cuda", dtype=dtype)
    nbytes = whole.numel() * whole.element_size()
    if kind == "all_gather":
        return (lambda: dist.all_gather_into_tensor(whole, shard, async_op=True)), nbytes
    return (lambda: dist.reduce_scatter_tensor(shard, whole, async_op=True)), nbytes


def _pair(gemm, gemm_count: int, comm, comm_count: int) -> tuple[float, float]:
    """(GEMM burst seconds, collectives' seconds) with both issued at once: the collectives first, on NCCL's stream,
    then the GEMMs on the compute stream.  The collectives' end is marked on a side stream that waits on them, so
    each side is timed on its own."""
    import torch.distributed as dist

    dist.barrier()
    torch.cuda.synchronize()
    start, comm_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    works = [comm() for _ in range(comm_count)]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for work in works:
            work.wait()  # NCCL: the current (side) stream waits for the collective, the host does not
        comm_end.record()
    seconds = _burst_seconds(gemm, gemm_count)
    torch.cuda.synchronize()
    return seconds, start.elapsed_time(comm_end) / 1e3


def measure(world: int) -> list[dict[str, Any]]:
    """Every GEMM shape against every collective, on this rank."""
    rows = []
    for tokens, k, n in GEMMS:
        a = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        flops = 2.0 * tokens * k * n

        def gemm(a=a, b=b):
            return a @ b

        for kind, dtype in COLLECTIVES:
            comm, nbytes = _collective(kind, dtype, world)
            bus = (world - 1) / world
            _burst_seconds(gemm, 3)
            comm_alone = min(_pair(lambda: None, 0, comm, 2)[1] / 2 for _ in range(REPS))
            gemm_alone = min(_burst_seconds(gemm, 10) / 10 for _ in range(REPS))
            comm_count = 4
            gemm_count = max(4, int(comm_count * comm_alone / gemm_alone * 0.8))  # the GEMMs end before the comm
            beside = [_pair(gemm, gemm_count, comm, comm_count) for _ in range(REPS)]
            gemm_beside = min(s for s, _ in beside) / gemm_count
            cover = max(16, int(comm_count * comm_alone / gemm_alone * 1.5))  # GEMMs outlast the collectives
            comm_beside = min(_pair(gemm, cover, comm, comm_count)[1] for _ in range(REPS))
            rows.append(
                {
                    "gemm": [tokens, k, n],
                    "collective": kind,
                    "dtype": str(dtype).removeprefix("torch."),
                    "mib_per_call": nbytes / 2**20,  # the whole buffer: gathered output, reduce-scatter input
                    "gemm_tflops_alone": flops / gemm_alone / 1e12,
                    "gemm_tflops_beside": flops / gemm_beside / 1e12,
                    "kept": gemm_alone / gemm_beside,
                    # bus bandwidth, nccl-tests' convention for both collectives: bytes x (n-1)/n per second
                    "comm_busbw_alone": bus * nbytes / comm_alone / 1e9,
                    "comm_busbw_beside": bus * nbytes * comm_count / comm_beside / 1e9,
                }
            )
            print(rows[-1], flush=True)
    return rows


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    rows = measure(world)
    if rank == 0:
        data = {
            "device": torch.cuda.get_device_name(),
            "gpus": world,
            "torch": torch.__version__,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "nccl_env": {k: v for k, v in os.environ.items() if k.startswith("NCCL_")},
            "rows": rows,
        }
        gpu = data["device"].split()[-1].lower()
        print(write_results(Path(out) / f"gemm-beside-nccl-{gpu}.json", data, render), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def render(data: dict[str, Any]) -> str:
    lines = [
        f"# A GEMM beside an NCCL collective ({data['gpus']} x {data['device']}, torch {data['torch']}, "
        f"NCCL {data['nccl']})",
        "",
        "bf16 GEMM on the compute stream, the collective issued at the same moment on NCCL's stream (best of "
        f"{REPS}). kept: the GEMM's rate beside the collective over its rate alone (the planner's "
        "`Efficiency.overlap` is 0.8). Collective: bus bandwidth (nccl-tests' convention), alone and beside the GEMMs.",
        "",
        "| GEMM tokens x in x out | collective | MiB/call | GEMM TFLOP/s alone | beside | kept | bus GB/s alone "
        "| beside |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {' x '.join(map(str, r['gemm']))} | {r['collective']} ({r['dtype']}) | {r['mib_per_call']:.0f} "
            f"| {r['gemm_tflops_alone']:.0f} | {r['gemm_tflops_beside']:.0f} | {r['kept']:.2f} "
            f"| {r['comm_busbw_alone']:.0f} | {r['comm_busbw_beside']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if rerender_if_asked(argv, render):
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    world = torch.cuda.device_count()
    if world < 2:
        sys.exit("needs 2 GPUs of one host: NCCL runs one rank per GPU")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torch.multiprocessing.spawn(_rank, args=(2, port, args.out), nprocs=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
