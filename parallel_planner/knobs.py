"""``--fixed`` knobs: the spellings real runs use (Megatron's names included), parsed into the candidate columns'
indices; shared by the search and the calibration of measured runs."""

from __future__ import annotations

from adapt.core.errors import BadInput
from parallel_planner.layout import FIELDS, RECOMPUTE, SCHEDULES, SPLITS

ALIASES = {
    "micro_batch": "mbs",
    "pp_schedule": "schedule",
    "offload_optimizer": "offload",
    "dp_replicate": "replicate",
    "sequence_parallel": "sp",
    "tp_comm_overlap": "tp_overlap",
    "overlap_grad_reduce": "grad_overlap",
    "virtual_stages": "vpp",
    "overlap_moe_expert_parallel_comm": "ep_overlap",
}
SWITCHES = ("offload", "sp", "tp_overlap", "grad_overlap", "ep_overlap", "distributed_optimizer")
# The network is the cluster's, but a run pins it like a knob: NVLink-domain size and GB/s per GPU per level.
NETWORK_KEYS = {"nvlink_domain": "gpus_per_node", "nvlink_gbps": "intra_node_gbps", "inter_gbps": "inter_node_gbps"}


def parse_fixed(text: str | dict | None) -> dict[str, int]:
    """``"tp=8,pp=16,recompute=none"`` (or a dict) -> knob indices as the candidate columns hold them."""
    if not text:
        return {}
    items = text.items() if isinstance(text, dict) else (_pair(p) for p in str(text).split(",") if p.strip())
    fixed: dict[str, int] = {}
    for key, value in items:
        key = ALIASES.get(key.strip(), key.strip())
        value = str(value).strip().lower()
        if key in NETWORK_KEYS:
            try:
                fixed[key] = float(value) if key != "nvlink_domain" else int(value)
            except ValueError:
                raise BadInput(f"--fixed: {key} must be a number, got {value!r}") from None
            if fixed[key] <= 0:
                raise BadInput(f"--fixed: {key}={value} is out of range")
            continue
        if key == "distributed_optimizer":  # Megatron's name for sharding optimizer states over data parallel
            if value in ("true", "yes", "1"):
                fixed.setdefault("zero", 1)
            continue
        if key not in FIELDS:
            known = ", ".join((*FIELDS, "distributed_optimizer", *NETWORK_KEYS))
            raise BadInput(f"--fixed: unknown key {key!r} (known: {known})")
        choices = {"recompute": RECOMPUTE, "schedule": SCHEDULES, "split": SPLITS}.get(key)
        if choices:
            value = {"interleaved": "interleaved_1f1b", "zb": "zero_bubble"}.get(value, value)
            if value not in choices:
                raise BadInput(f"--fixed: {key} must be one of {', '.join(choices)}, got {value!r}")
            fixed[key] = choices.index(value)
            continue
        if key in SWITCHES and value in ("true", "false", "yes", "no", "on", "off"):
            value = "1" if value in ("true", "yes", "on") else "0"
        try:
            fixed[key] = int(value)
        except ValueError:
            raise BadInput(f"--fixed: {key} must be an integer, got {value!r}") from None
        if fixed[key] < (0 if key in ("zero", *SWITCHES) else 1) or (key in SWITCHES and fixed[key] > 1):
            raise BadInput(f"--fixed: {key}={value} is out of range")
    if fixed.get("zero", 0) > 3:
        raise BadInput("--fixed: zero must be 0, 1, 2 or 3")
    return fixed


def _pair(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise BadInput(f"--fixed: expected key=value, got {text.strip()!r}")
    key, value = text.split("=", 1)
    return key, value
