"""The plan JSON: what the planner emits and what the torch.distributed realisation consumes.

World size = pp * dp_replicate * dp_shard * cp * tp.  Expert parallelism borrows ranks from the
data-parallel x context-parallel dimensions (``ep`` must divide ``dp_replicate*dp_shard*cp``), as in
torchtitan: experts are sharded over ``ep`` ranks and replicated (expert data parallelism) over the rest.

ZeRO stages map onto FSDP2 like this:
  zero=0  plain replication (``dp_shard == 1``, DDP-style ``replicate``)
  zero=1  optimizer states sharded; realised with FSDP2 as ``reshard_after_forward=False`` over
          ``dp_shard`` with gradients reduce-scattered only on the last micro-batch
  zero=2  ``fully_shard(reshard_after_forward=False)``
  zero=3  ``fully_shard(reshard_after_forward=True)``
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any, Literal

from adapt.core.errors import BadInput
from adapt.core.inputs import read_input_text

Recompute = Literal["none", "selective", "full"]
PipelineSchedule = Literal["1f1b", "interleaved_1f1b", "gpipe", "zero_bubble", "dualpipe"]


@dataclass
class ParallelPlan:
    tp: int = 1
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    ep: int = 1
    zero: int = 3
    sequence_parallel: bool = True  # with tp > 1
    recompute: Recompute = "none"
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    grad_accum: int = 1  # micro-batches per step per data-parallel rank (pp: micro-batches in flight)
    pp_schedule: PipelineSchedule = "1f1b"
    vpp: int = 1  # virtual stages per pipeline rank (interleaved schedule)
    stage_layers: list[int] = field(default_factory=list)  # blocks per (virtual) stage, embed on first, head on last
    offload_optimizer: bool = False
    vocab_parallel: bool = False  # shard embedding and lm_head over tp
    seq_len: int = 2048
    global_batch: int = 8  # sequences per optimizer step
    precision: Literal["bf16", "fp8", "fp32"] = "bf16"
    gpus_per_node: int = 8

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def mesh_shape(self) -> dict[str, int]:
        """Named DeviceMesh dimensions in outer-to-inner order (tp innermost, within a node)."""
        return {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }

    def validate(self) -> list[str]:
        """Internal consistency problems (empty list when the plan is coherent)."""
        problems = []
        for name in ("tp", "pp", "dp_replicate", "dp_shard", "cp", "ep", "micro_batch", "grad_accum", "vpp"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.zero not in (0, 1, 2, 3):
            problems.append("zero must be 0, 1, 2 or 3")
        if self.ep > 1 and (self.dp * self.cp) % self.ep:
            problems.append(f"ep={self.ep} must divide dp*cp={self.dp * self.cp}")
        if self.vpp > 1 and self.pp == 1:
            problems.append("vpp > 1 needs pp > 1")
        if self.stage_layers and len(self.stage_layers) != self.pp * self.vpp:
            problems.append(f"stage_layers has {len(self.stage_layers)} entries, expected pp*vpp={self.pp * self.vpp}")
        if self.global_batch % (self.micro_batch * self.dp):
            problems.append(
                f"global_batch={self.global_batch} is not a multiple of micro_batch*dp={self.micro_batch * self.dp}"
            )
        return problems

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["dp"] = self.dp
        data["world_size"] = self.world_size
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ParallelPlan:
        """The plan from its JSON object (keys it does not hold, such as the derived ``dp``, are ignored).

        A field of the wrong type or outside its choices is refused, naming it, as is an object holding no plan
        field at all: a typo must not train under the defaults."""
        if not isinstance(data, dict):
            raise BadInput(f"a plan is a JSON object, not a {type(data).__name__}")
        hints = typing.get_type_hints(cls)
        known = {k: v for k, v in data.items() if k in hints}
        if not known:
            raise BadInput(f"no plan field among {', '.join(sorted(map(str, data))[:6]) or 'no keys'}")
        for key, value in known.items():
            _check_field(key, value, hints[key])
        return cls(**known)

    @classmethod
    def load(cls, path: str) -> ParallelPlan:
        """A plan file from the user: a bare plan, or a planner answer whose first ranked entry carries "plan".
        Unreadable JSON, a missing plan, a bad field or an inconsistent plan is ``BadInput``."""
        try:
            data = json.loads(read_input_text(path, "plan"))
        except json.JSONDecodeError as err:
            raise BadInput(f"{path}: not a plan JSON ({err})") from None
        if isinstance(data, dict) and "plans" in data:
            ranked = data["plans"]
            if not isinstance(ranked, list) or not ranked:
                raise BadInput(f"{path}: 'plans' holds no ranked plan")
            data = ranked[0]
        if isinstance(data, dict) and "plan" in data:
            data = data["plan"]
        try:
            plan = cls.from_dict(data)
        except BadInput as err:
            raise BadInput(f"{path}: {err}") from None
        problems = plan.validate()
        if problems:
            raise BadInput(f"{path}: the plan is inconsistent: {'; '.join(problems)}")
        return plan


def _check_field(key: str, value: Any, hint: Any) -> None:
    """``value`` fits the field's annotation: int (not bool), bool, a Literal's choices, or a list of ints."""
    choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else ()
    if choices:
        ok = value in choices
        allowed = ", ".join(map(str, choices))
    elif hint is bool:
        ok, allowed = isinstance(value, bool), "true or false"
    elif hint is int:
        ok, allowed = isinstance(value, int) and not isinstance(value, bool), "an integer"
    else:  # list[int]
        ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        allowed = "a list of integers"
    if not ok:
        raise BadInput(f"{key} is {value!r}; allowed: {allowed}")
