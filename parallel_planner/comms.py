"""α–β cost of NCCL-style collectives on the link a process group actually crosses.

Ranks are laid out as ``ParallelPlan.mesh_shape`` says: pp outermost, then dp, cp, tp innermost, so a
group of ``size`` ranks spaced ``stride`` apart fits in one node when ``size * stride <= gpus_per_node``.
A ring that spans nodes leaves each node through the NICs of the group's members there (NCCL runs one
channel per NIC, rail-optimised fabrics give each GPU its own): one member per node is bounded by its
NIC, eight by the node's eight.  All-to-all keeps the share of its traffic that stays inside a node on
the scale-up link; point-to-point between pipeline stages goes through each rank's own NIC.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from parallel_planner.cluster import Cluster


@dataclass(frozen=True)
class LinkModel:
    """Latency per algorithm step and achieved fraction of the datasheet bandwidth."""

    alpha_intra_s: float
    alpha_inter_s: float
    bandwidth_efficiency: float


class Collectives:
    """Times (seconds) of one collective for every candidate at once; sizes are bytes per rank."""

    def __init__(self, cluster: Cluster, link: LinkModel):
        self.per_node = cluster.gpus_per_node
        self.intra = cluster.gpu.intra_node_gbps * 1e9 * link.bandwidth_efficiency
        self.inter = cluster.gpu.inter_node_gbps * 1e9 * link.bandwidth_efficiency
        self.link = link

    def _placement(self, size: np.ndarray, stride: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(bandwidth, latency, members per node) of each group."""
        inside = size * stride <= self.per_node
        members_per_node = np.clip(self.per_node // np.maximum(stride, 1), 1, None)
        members_per_node = np.minimum(members_per_node, size)
        bandwidth = np.where(inside, self.intra, self.inter)
        alpha = np.where(inside, self.link.alpha_intra_s, self.link.alpha_inter_s)
        return bandwidth, alpha, members_per_node

    def affine(self, kind: str, size: np.ndarray, stride: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(latency s, s per byte) of one ``kind`` collective over each group: it takes ``a + b * nbytes``.

        Ring all-gather / reduce-scatter (``nbytes`` the gathered buffer), all-reduce (twice that),
        all-to-all (each rank sends ``nbytes`` spread evenly over the group; off-node shares go through
        the NIC), send_recv (point-to-point between neighbouring pipeline stages).
        """
        bw, alpha, local = self._placement(size, stride)
        size_f = np.maximum(size, 1).astype(np.float64)
        steps = size_f - 1
        if kind in ("all_gather", "reduce_scatter", "all_reduce"):
            # A ring that crosses nodes leaves each node once per channel; NCCL spreads its channels over
            # the NICs of the group's members there, so a node sends through ``local`` NICs (at most the
            # node's NVLink share per GPU, which every channel also crosses).
            bw = np.where(bw < self.intra, np.minimum(self.intra, local * bw), bw)
            scale = 2.0 if kind == "all_reduce" else 1.0
            a, b = scale * steps * alpha, scale * steps / size_f / bw
        elif kind == "all_to_all":
            a, b = steps * alpha, np.maximum((size_f - local) / self.inter, (local - 1) / self.intra) / size_f
        elif kind == "send_recv":
            a, b = alpha, 1.0 / bw
        else:
            raise ValueError(f"unknown collective {kind!r}")
        single = size <= 1
        return np.where(single, 0.0, a), np.where(single, 0.0, b)

    def time(self, kind: str, nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
        a, b = self.affine(kind, size, stride)
        return a + b * nbytes

    def all_gather(self, nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
        return self.time("all_gather", nbytes, size, stride)

    def all_to_all(self, nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
        return self.time("all_to_all", nbytes, size, stride)

    def send_recv(self, nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
        return self.time("send_recv", nbytes, size, stride)

    def forwarded_all_to_all(
        self, nbytes: np.ndarray, copies: int, nodes_reached: np.ndarray, size: np.ndarray, stride: np.ndarray
    ) -> np.ndarray:
        """An MoE dispatch (or combine) that crosses the network once per target node and forwards inside it.

        Each rank sends ``nbytes`` per copy, ``copies`` copies (one per routed expert).  DeepEP's normal kernels
        (DeepSeek-V3 sec. 3.2.2) send a token over the NIC once to the same-index GPU of each node holding any of
        its experts, ``nodes_reached`` of the group's nodes, of which ``(N-1)/N`` are remote; NVLink then carries
        every copy whose expert is on another GPU of that node.  The two legs are pipelined, so the slower sets
        the time; one network and one NVLink latency.  A group inside one node is the plain all-to-all.
        """
        bw, alpha, local = self._placement(size, stride)
        size_f = np.maximum(size, 1).astype(np.float64)
        nodes = size_f / local
        remote = np.minimum(nodes_reached, nodes) * (nodes - 1) / nodes
        seconds = np.maximum(remote / self.inter, copies * (local - 1) / local / self.intra) * nbytes
        spans = bw < self.intra
        flat = self.all_to_all(copies * nbytes, size, stride)
        forwarded = self.link.alpha_inter_s + self.link.alpha_intra_s + seconds
        return np.where(spans & (size > 1), forwarded, flat)
