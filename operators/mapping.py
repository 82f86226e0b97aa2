"""KernelPlan: a decision for every recognised component and every traced ATen op under a profile.

Component decisions come from the providers (``fused``/``native``) or, for modules that compute
something no kind covers, from Inductor (``generated``).  Op decisions: an op inside a fused or
generated component takes that status; any other op is ``native`` when the profile supports it,
``decomposed`` when ``torch._decomp`` rewrites it into supported ops, ``generated`` when its
owning module can be compiled for the device, else ``unsupported``.  On CUDA, when several
kernels qualify, a cached micro-benchmark on the device picks one.

Compilation is part of the plan (``KernelPlan.compile``).  On CUDA the adapted model is compiled
block by block, so each candidate is timed inside ``torch.compile``: a hand kernel stays only where
it beats what Inductor generates from the module's own forward, and each choice records what it
beat and by how much.  Elsewhere the plan runs eager and says why.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from operators.decompose import decompose
from operators.inventory import OpInventory, json_ready
from operators.profiles import BackendProfile
from operators.providers import provider_status, providers
from operators.recognition import Recognition
from operators.recognition.component import Component
from operators.recognition.variants import Variant, check_variant, variant_from_dict
from operators.registry import KernelOption, Target

STATUSES = ("fused", "native", "decomposed", "generated", "unsupported")
# Kinds recognised on the path of another component (the add before a norm, the rope inside an attention).
_SHARED_PATH_KINDS = ("residual_add_norm", "rotary_application")
# Kinds whose module maps hidden states to hidden states: kernels are timed against the module's own forward.
_TIMED_KINDS = ("rms_norm", "layer_norm", "gated_mlp", "mlp", "moe", "routed_experts")


@dataclass
class KernelChoice:
    module: str
    kind: str
    variant: Variant  # the kind's class in operators.recognition.variants.VARIANTS
    provider: str | None
    kernel: str | None
    status: str
    confirmed: bool
    patch: bool = False  # True when apply_kernel_plan installs something for this component
    note: str = ""
    timings: dict[str, float] = field(default_factory=dict)  # ms per measured candidate ("provider:kernel")
    margin: float | None = None  # best other time / chosen time (>1: won by; <1: chosen at equal speed for memory)
    backend: str | None = None  # attention: the SDPA backend pinned by measurement (None: PyTorch's dispatch)

    def __post_init__(self) -> None:
        check_variant(self.kind, self.variant, self.module)

    def to_dict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return json_ready({**fields, "variant": self.variant.to_dict()})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelChoice:
        """The choice back from ``to_dict()``; its variant as ``variant_from_dict`` builds it."""
        variant = variant_from_dict(data["kind"], data.get("variant"), data["module"])
        return cls(**{**data, "variant": variant})


@dataclass
class OpDecision:
    overload: str
    count: int
    status: str
    core: bool
    modules: list[str]
    replacement: str | None = None  # decomposition result or generating module
    flops: int = 0
    recognised_flops: int = 0  # of ``flops``, those inside a component a probe confirmed as a kind adapt knows


@dataclass
class KernelPlan:
    profile: dict[str, Any]
    target: dict[str, Any]
    components: list[KernelChoice]
    ops: list[OpDecision]
    providers: dict[str, str] = field(default_factory=dict)
    compile: dict[str, Any] = field(default_factory=lambda: {"mode": "none", "reason": "not decided"})
    # seconds spent deciding each component kind (self-tests, timings, compiles of candidates): where a cold plan goes
    seconds_by_kind: dict[str, float] = field(default_factory=dict)

    def component(self, module: str, kind: str | None = None) -> KernelChoice | None:
        return next((c for c in self.components if c.module == module and (kind is None or c.kind == kind)), None)

    def coverage(self) -> dict[str, Any]:
        total = sum(o.count for o in self.ops)
        by_status = Counter()
        flops = Counter()
        for o in self.ops:
            by_status[o.status] += o.count
            flops[o.status] += o.flops
        unmapped = sum(o.count for o in self.ops if o.status not in STATUSES)
        all_flops = sum(flops.values())
        fast = flops["fused"] + flops["native"]
        recognised = sum(o.recognised_flops for o in self.ops)
        return {
            "ops_total": total,
            "unmapped": unmapped,
            "share_by_status": {s: round(by_status[s] / total, 4) if total else 0.0 for s in STATUSES},
            "flops_total": all_flops,
            "flops_share_fused_or_native": round(fast / all_flops, 4) if all_flops else None,
            # Running natively is not being understood: FLOPs of ops inside a component a probe confirmed, apart.
            "flops_share_recognised": round(recognised / all_flops, 4) if all_flops else None,
        }

    def to_dict(self) -> dict[str, Any]:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        components = [c.to_dict() for c in self.components]
        return json_ready({**fields, "components": components, "coverage": self.coverage()})

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelPlan:
        """The plan back from ``to_dict()`` (a plan saved by one process, applied in another)."""
        return cls(
            profile=data["profile"],
            target=data["target"],
            components=[KernelChoice.from_dict(c) for c in data["components"]],
            ops=[OpDecision(**o) for o in data["ops"]],
            providers=data.get("providers", {}),
            compile=data.get("compile", {"mode": "none", "reason": "not recorded"}),
            seconds_by_kind=data.get("seconds_by_kind", {}),
        )


def plan_kernels(
    inventory: OpInventory,
    components: Recognition | list[Component],
    profile: BackendProfile,
    target: Target,
    model: nn.Module | None = None,
    compile_mode: str | None = None,
    as_traced: dict[str, str] | None = None,
    earlier: KernelPlan | None = None,
) -> KernelPlan:
    """Decide a kernel for every component and a status for every traced op.

    ``model`` (optional) lets the CUDA micro-benchmark time candidates on copies of the real modules.
    ``compile_mode`` ("blocks", "whole" or "none") overrides the device's default (``compile_plan``).
    ``as_traced``: new components Inductor could not compile as one graph (module -> why), which run as traced;
    with the ``earlier`` plan that found them, every other component keeps the choice made there.
    """
    comps = components.components if isinstance(components, Recognition) else components
    provs = providers()
    compile_choice = compile_plan(target, profile, compile_mode)
    compiled = compile_choice["mode"] != "none"
    kept = {(c.module, c.kind): c for c in earlier.components} if earlier is not None else {}
    choices, seconds = [], Counter(earlier.seconds_by_kind if earlier is not None else {})
    for comp in comps:
        start = time.perf_counter()
        if comp.module in (as_traced or {}) and comp.kind == "new":
            choices.append(_uncompilable(comp, as_traced[comp.module]))
        elif (comp.module, comp.kind) in kept:
            choices.append(kept[(comp.module, comp.kind)])
            continue
        else:
            choices.append(_choose(comp, provs, profile, target, model, compiled))
        seconds[comp.kind] += time.perf_counter() - start
    ops, to_generate = _op_decisions(inventory, choices, profile)
    if to_generate:  # whole components become generated kernels: their ops follow them
        _escalate_to_generated(to_generate, choices)
        ops, _ = _op_decisions(inventory, choices, profile)
    by_kind = {kind: round(t, 3) for kind, t in seconds.most_common()}
    plan = KernelPlan(
        profile.to_dict(), target.to_dict(), choices, ops, provider_status(target), compile_choice, by_kind
    )
    return for_compile_mode(plan, compile_choice["mode"])


def for_compile_mode(plan: KernelPlan, mode: str) -> KernelPlan:
    """``plan`` as it can run under compile ``mode``.

    Compiled block by block, a residual-add fusion is left to Inductor: the fusion hangs on hooks of each
    block's children, and Dynamo guards a compiled block on its hooks' ids, so every block would compile its
    own graph and those past Dynamo's recompile limit would run eagerly (measured on the H200: 8 of 16
    Llama blocks eager).  Inductor runs the add inside the block's graph instead.
    """
    if mode != "blocks":
        return plan
    components = [
        dataclasses.replace(
            c,
            provider="inductor",
            kernel="own add, compiled with its block",
            status="native",
            patch=False,
            note="blocks compile one by one: the fusion's per-block hooks would give each block its own graph",
            timings={},
            margin=None,
        )
        if c.kind == "residual_add_norm" and c.patch
        else c
        for c in plan.components
    ]
    return dataclasses.replace(plan, components=components)


COMPILE_MODES = ("blocks", "whole", "none")
# Under compile, the module's own forward is a candidate for every timed kind: Inductor's code for it.
INDUCTOR_OWN_FORWARD = KernelOption(
    "inductor", "own forward, compiled", "native", None, note="the module's own forward, compiled with its block"
)


def compile_plan(target: Target, profile: BackendProfile, mode: str | None = None) -> dict[str, Any]:
    """How the adapted model is compiled.  CUDA with Triton code generation: each repeated block on its own
    (``module.compile()``), which compiles once for all identical blocks and keeps compile time in seconds.
    Whole-model compilation is not timed per model (it costs a full compile, tens of seconds); the end-to-end
    benchmark (``benchmarks/e2e.py``, variant ``adapt-whole``) measures it, and on the H200 it was slower on a
    dense and an MoE shape (cuDNN attention's backward ran slower inside the whole-model graph)."""
    if mode is not None:
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile mode must be one of {', '.join(COMPILE_MODES)}, not {mode!r}")
        return {"mode": mode, "reason": "chosen by the caller"}
    if target.device != "cuda":
        return {
            "mode": "none",
            "reason": f"{target.device}: the plan runs eager (Inductor's C++ path is not timed here)",
        }
    if profile.codegen != "triton":
        return {"mode": "none", "reason": f"the profile's code generator is {profile.codegen!r}, not Triton"}
    return {
        "mode": "blocks",
        "reason": (
            "CUDA: every repeated block compiled on its own (one compilation serves all identical blocks; "
            "measured faster than whole-model compilation in benchmarks/e2e.py)"
        ),
    }


def _uncompilable(comp: Component, why: str) -> KernelChoice:
    """A new component whose forward Dynamo cannot capture whole (data-dependent loops, host syncs): its own
    code runs, and the report says why no generated kernel stands in for it."""
    note = f"Inductor cannot compile it as one graph ({why}); it runs as traced"
    return KernelChoice(comp.module, comp.kind, comp.variant, None, "as traced", "native", False, note=note)


def _choose(
    comp: Component, provs, profile: BackendProfile, target: Target, model: nn.Module | None, compiled: bool = False
) -> KernelChoice:
    if comp.kind == "new" and not comp.variant.container:  # a container's own code runs as traced
        if comp.variant.python_sizes:
            return KernelChoice(
                comp.module,
                comp.kind,
                comp.variant,
                None,
                "as traced",
                "native",
                False,
                note="its forward takes Python integers; a compiled graph would be rebuilt whenever they change",
            )
        if profile.codegen == "none":
            return KernelChoice(
                comp.module,
                comp.kind,
                comp.variant,
                None,
                None,
                "unsupported",
                False,
                note="profile has no code generator",
            )
        return KernelChoice(
            comp.module,
            comp.kind,
            comp.variant,
            "inductor",
            f"inductor ({_codegen_language(target)})",
            "generated",
            False,
            patch=True,
        )
    options: list[KernelOption] = []
    for prov in provs:
        for opt in prov.options(comp, target):
            if all(profile.supports_aten(op) for op in opt.requires_ops) and (
                opt.needs_codegen is None or opt.needs_codegen == profile.codegen
            ):
                options.append(opt)
    module = model.get_submodule(comp.module) if model is not None else None
    best, timings, rejected = _verified_rank(options, comp, target, module, compiled)
    if best is None:
        return KernelChoice(
            comp.module,
            comp.kind,
            comp.variant,
            None,
            None,
            "native",
            comp.confirmed,
            note="; ".join(["no provider kernel; runs as traced", *rejected]),
        )
    context = "inside torch.compile" if compiled else "eager"
    timed = f"timed here ({context}): " + ", ".join(f"{k} {v:.3f} ms" for k, v in timings.items()) if timings else ""
    chosen = f"{best.provider}:{best.kernel}"
    margin = _margin(timings, chosen)
    won = ""
    if margin and margin >= 1:
        won = f"{chosen} won by x{margin:.2f}"
    elif margin:
        won = f"{chosen} chosen at x{1 / margin:.3f} of the fastest's time: the same speed, {best.keeps_less}"
    backend = None
    if comp.kind == "attention" and best.kernel and "SDPA" in best.kernel:
        from operators.benchmark import attention_backend

        backend, timings, why = attention_backend(comp.variant, target)
        margin = _margin(timings)
        timed = (
            "SDPA backends: "
            + (", ".join(f"{k} {v:.3f} ms" for k, v in timings.items()) + "; " if timings else "")
            + why
        )
    note = "; ".join(filter(None, [best.note, timed, won, *rejected]))
    return KernelChoice(
        comp.module,
        comp.kind,
        comp.variant,
        best.provider,
        best.kernel,
        best.status,
        comp.confirmed,
        patch=best.make_forward is not None,
        note=note,
        timings=timings,
        margin=margin,
        backend=backend,
    )


def _margin(timings: dict[str, float], chosen: str | None = None) -> float | None:
    """The best other time over ``chosen``'s (default: the fastest): above 1, how much faster the chosen path
    measured; below 1, how much slower a path chosen at equal speed for memory was.  None: fewer than two timed."""
    if len(timings) < 2:
        return None
    chosen = chosen if chosen in timings else min(timings, key=timings.get)
    others = min(v for k, v in timings.items() if k != chosen)
    return round(others / timings[chosen], 4) if timings[chosen] > 0 else None


def _codegen_language(target: Target) -> str:
    return "Triton" if target.device == "cuda" else "C++/OpenMP"


def _verified_rank(
    options: list[KernelOption], comp: Component, target: Target, module: nn.Module | None, compiled: bool
) -> tuple[KernelOption | None, dict[str, float], list[str]]:
    """``_rank``'s pick once it passed its provider's check (``KernelOption.verify``), the timings, and each
    pick that failed the check (dropped, the rest ranked again: their timings come from the cache).  None when
    no option is left."""
    rejected: list[str] = []
    while options:
        best, timings = _rank(options, comp, target, module, compiled)
        failure = best.check_failure()
        if failure is None:
            return best, timings, rejected
        rejected.append(f"{best.provider}:{best.kernel} not used: its check failed ({failure})")
        options = [o for o in options if o is not best]
    return None, {}, rejected


def _rank(
    options: list[KernelOption], comp: Component, target: Target, module: nn.Module | None, compiled: bool = False
) -> tuple[KernelOption, dict[str, float]]:
    """The preferred provider's kernel; else, on CUDA, the fastest measured - the module's own traced
    path competing where it maps hidden states to hidden states (under compile: what Inductor makes of
    it, which an ATen replacement forward adds nothing to); else the first candidate."""
    fused = [o for o in options if o.status == "fused"] or options
    preferred = [o for o in fused if o.provider in target.prefer]
    if preferred:
        return preferred[0], {}
    traced = (
        [o for o in options if o.status == "native" and o.make_forward is None] if comp.kind in _TIMED_KINDS else []
    )
    if compiled and comp.kind in _TIMED_KINDS:
        # Inside a compiled block an ATen replacement is the own forward by another route: one candidate, one
        # compile to time it, and no patch.
        traced = traced or [INDUCTOR_OWN_FORWARD]
        fused = [o for o in fused if not o.lowered_like_own_forward]
    candidates = fused + [o for o in traced if o not in fused]
    if len(candidates) > 1 and target.device == "cuda":
        from operators.benchmark import fastest

        return fastest(candidates, comp, target, module, compiled=compiled)
    return candidates[0], {}


def _escalate_to_generated(need: set[str], choices: list[KernelChoice]) -> None:
    """Components holding an op that only a generated kernel can run are compiled as a whole."""
    for c in choices:
        if c.kernel == "as traced" and c.kind == "new":
            continue  # Inductor already failed on it: its ops the profile lacks stay unsupported
        if c.module in need and c.kind == "rotary_application" and c.patch:
            c.provider, c.kernel, c.status, c.patch = (
                "inductor",
                "inductor (with its attention module)",
                "generated",
                False,
            )
            c.note = "inside a module compiled whole by Inductor"
        elif c.module in need and c.status != "generated" and c.kind not in _SHARED_PATH_KINDS:
            c.provider, c.kernel, c.status, c.patch = "inductor", "inductor (subgraph)", "generated", True
            c.note = "holds ops the profile lacks and torch._decomp cannot rewrite"


def _owner(module: str, by_module: dict[str, KernelChoice]) -> KernelChoice | None:
    """The innermost planned component enclosing ``module``."""
    path = module
    while True:
        if path in by_module:
            return by_module[path]
        if not path:
            return None
        path = path.rsplit(".", 1)[0] if "." in path else ""


def _op_decisions(
    inv: OpInventory, choices: list[KernelChoice], profile: BackendProfile
) -> tuple[list[OpDecision], set[str]]:
    by_module = {}
    for c in choices:  # these share a path with the component they sit in, whose decision owns the ops
        if c.kind not in _SHARED_PATH_KINDS:
            by_module[c.module] = c
    confirmed = {m: c for m, c in by_module.items() if c.confirmed}  # proven by a probe: what "recognised" counts
    grouped: dict[str, dict[str, Any]] = defaultdict(
        lambda: {
            "count": 0, "status": Counter(), "modules": set(), "flops": Counter(), "recognised": Counter(),
            "core": False, "repl": set(),
        }
    )  # fmt: skip
    decomp_cache: dict[str, Any] = {}
    to_generate: set[str] = set()
    for rec in inv.ops:
        owner = _owner(rec.module, by_module) if not rec.module.startswith("<") else None
        if owner is not None and owner.status in ("fused", "generated"):
            status, repl = owner.status, (owner.module if owner.status == "generated" else None)
        elif profile.supports_aten(rec.overload, rec.dtypes):
            status, repl = "native", None
        else:
            if rec.overload not in decomp_cache:
                decomp_cache[rec.overload] = decompose(rec.overload, profile, rec.dtypes)
            d = decomp_cache[rec.overload]
            if d.ok:
                status, repl = "decomposed", " + ".join(d.into)
            elif profile.codegen != "none" and owner is not None:
                status, repl = "generated", owner.module
                to_generate.add(owner.module)
            else:
                status, repl = "unsupported", d.reason
        g = grouped[rec.overload]
        g["count"] += rec.count
        g["status"][status] += rec.count
        g["modules"].add(rec.module)
        g["flops"][status] += rec.flops
        if owner is not None and _owner(rec.module, confirmed) is not None:
            g["recognised"][status] += rec.flops
        g["core"] = rec.core
        if repl:
            g["repl"].add(repl)
    out = []
    for overload, g in sorted(grouped.items()):
        for status, count in g["status"].items():
            out.append(
                OpDecision(
                    overload,
                    count,
                    status,
                    g["core"],
                    sorted(g["modules"])[:8],
                    "; ".join(sorted(g["repl"]))[:300] or None,
                    g["flops"][status],
                    g["recognised"][status],
                )
            )
    return out, to_generate
