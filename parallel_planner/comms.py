"""α–β cost of NCCL-style collectives on the link a process group actually crosses.

Ranks are laid out as ``ParallelPlan.mesh_shape`` says: pp outermost, then dp, cp, tp innermost, so a
group of ``size`` ranks spaced ``stride`` apart fits in one node when ``size * stride <= gpus_per_node``.
Groups that span nodes are bounded by each GPU's NIC (rail-optimised fabrics run one ring per rail);
all-to-all keeps the share of its traffic that stays inside a node on the scale-up link.
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

    def all_gather(self, nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
        """Ring all-gather or reduce-scatter: ``nbytes`` is the full (gathered) buffer."""
        bw, alpha, _ = self._placement(size, stride)
        steps = size - 1
        return np.where(size > 1, steps * alpha + nbytes * steps / np.maximum(size, 1) / bw, 0.0)

    reduce_scatter = all_gather

    def all_reduce(self, nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
        return 2.0 * self.all_gather(nbytes, size, stride)

    def all_to_all(self, nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
        """Each rank sends ``nbytes`` spread evenly over the group; off-node shares go through the NIC."""
        bw, alpha, local = self._placement(size, stride)
        size_f = np.maximum(size, 1).astype(np.float64)
        off_node = nbytes * (size_f - local) / size_f / self.inter
        on_node = nbytes * (local - 1) / size_f / self.intra
        return np.where(size > 1, (size - 1) * alpha + np.maximum(off_node, on_node), 0.0)

    def send_recv(self, nbytes: np.ndarray, size: np.ndarray, stride: np.ndarray) -> np.ndarray:
        """Point-to-point between neighbours of a group (pipeline stages)."""
        bw, alpha, _ = self._placement(size, stride)
        return np.where(size > 1, alpha + nbytes / bw, 0.0)
