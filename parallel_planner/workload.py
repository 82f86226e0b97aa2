"""What the cluster will run: sequence length, global batch, training or inference, precision, optimizer."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from adapt.core.errors import BadInput

# Bytes of fp32 optimizer state per parameter (Adam: two moments; SGD/Lion: one; Adafactor: factored, ~0).
OPTIMIZER_STATE_BYTES: dict[str, int] = {"adamw": 8, "adam": 8, "sgd": 4, "lion": 4, "adafactor": 0}


@dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int  # sequences per optimizer step (inference: sequences per forward batch)
    mode: Literal["train", "inference"] = "train"
    precision: Literal["bf16", "fp8"] = "bf16"
    optimizer: str = "adamw"
    # Tokens the busiest expert-parallel rank receives over the mean.  Load-balanced routers (auxiliary
    # loss or DeepSeek-V3's bias balancing) keep a rank's share of a large batch within 1.0-1.2; the
    # slowest rank sets the pace of expert compute and all-to-all, and its activations the memory.
    moe_imbalance: float = 1.1
    # Bits of each optimizer moment: 16 keeps Adam's moments in bf16 (DeepSeek-V3 sec. 3.3.3; Megatron-Core 0.13's
    # precision-aware optimizer), master weights and gradients staying fp32.
    moment_bits: int = 32
    # Bits of the activations the fp8 GEMMs' backward reads: 8 caches their fp8 copies (DeepSeek-V3 sec. 3.3.3).
    act_cache_bits: int = 16
    # Multi-token-prediction modules trained after the last layer (DeepSeek-V3 sec. 2.2: depth 1).  Configs declare
    # them (``num_nextn_predict_layers``) but transformers builds none, so a run of adapt's own trains none.
    mtp_depth: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.global_batch < 1:
            raise BadInput(f"--seq and --global-batch must be positive (got {self.seq_len}, {self.global_batch})")
        if self.mode not in ("train", "inference"):
            raise BadInput(f"mode must be train or inference, got {self.mode!r}")
        if self.precision not in ("bf16", "fp8"):
            raise BadInput(f"--precision must be bf16 or fp8, got {self.precision!r}")
        if not 1.0 <= self.moe_imbalance <= 4.0:
            raise BadInput(f"--moe-imbalance must be between 1 and 4, got {self.moe_imbalance}")
        if self.moment_bits not in (16, 32):
            raise BadInput(f"optimizer moments must be 16 or 32 bits, got {self.moment_bits}")
        if self.act_cache_bits not in (8, 16) or (self.act_cache_bits == 8 and self.precision != "fp8"):
            raise BadInput(f"activations cached in {self.act_cache_bits} bits: 16, or 8 with --precision fp8")
        if not 0 <= self.mtp_depth <= 8 or (self.mtp_depth and not self.training):
            raise BadInput(f"multi-token-prediction depth {self.mtp_depth}: 0 to 8, and only when training")
        if self.optimizer not in OPTIMIZER_STATE_BYTES:
            raise BadInput(f"optimizer {self.optimizer!r} unknown (known: {', '.join(OPTIMIZER_STATE_BYTES)})")

    @classmethod
    def from_tokens(cls, seq_len: int, global_batch_tokens: int, **kwargs: Any) -> Workload:
        """A global batch given in tokens must be a whole number of sequences."""
        if global_batch_tokens % seq_len:
            raise BadInput(f"global batch of {global_batch_tokens} tokens is not a multiple of seq {seq_len}")
        return cls(seq_len, global_batch_tokens // seq_len, **kwargs)

    @property
    def training(self) -> bool:
        return self.mode == "train"

    @property
    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch

    @property
    def optimizer_state_bytes(self) -> int:
        return OPTIMIZER_STATE_BYTES[self.optimizer] * self.moment_bits // 32

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
