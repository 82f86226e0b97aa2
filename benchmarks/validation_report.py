"""The Markdown report of ``benchmarks/validation.py``, rendered from its results dict (the JSON it writes)."""

from __future__ import annotations

import json
from collections import Counter

from benchmarks.validation_models import ALIGN_BATCH, ALIGN_SEQ, MOE_PROVIDER, MOE_ROUTE_KERNEL


def summarise_notes(notes: list[str]) -> list[str]:
    """Notes as Markdown list items (the patch note already counts modules per kernel)."""
    return [f"- {note}" for note in notes]


def _moe_lines(r: dict) -> list[str]:
    """The MoE verdict: what the plan chose for the routed blocks and how often adapt's routing kernel ran."""
    if not r.get("moe_blocks"):
        return []
    moe = r.get("operators", {}).get("moe")
    if moe is None:
        return [
            (
                f"**MoE blocks: no kernel plan** (operators stage skipped or failed): "
                f"the {r['moe_blocks']} routed blocks ran HF's own code."
            ),
            "",
        ]
    kernels = ", ".join(f"{n}× {k}" for k, n in moe["patched_by_kernel"].items()) or "none"
    lines = [
        (
            f"MoE blocks: {moe['expected_blocks']} routed blocks in the model; {moe['recognised']} recognised as `moe` "
            f"({moe['confirmed']} confirmed); kernel plan patched {moe['patched']}: {kernels}."
        )
    ]
    if moe["all_on_adapt_kernel"]:
        lines.append(
            f"Every MoE block is planned on {MOE_PROVIDER}'s routed-MoE Triton path "
            "(route, permute, grouped GEMM, GLU, weighted unpermute)."
        )
    else:
        missing = moe["expected_blocks"] - moe["recognised"]
        lines.append(
            f"**The plan did NOT choose {MOE_PROVIDER} for every MoE block**"
            + (f": {missing} routed block(s) were not recognised as `moe`" if missing > 0 else "")
            + "."
        )
        lines.append(f"{MOE_PROVIDER} on this device: {moe['provider_status']}.")
        lines += [
            f"- {c['module']}: {c['provider']}/{c['kernel']} ({c['status']}{', unconfirmed' if not c['confirmed'] else ''})"
            + (f"; note: {c['note']}" if c["note"] else "")
            + (f"; adapt's MoE kernels refuse this variant: {c['variant_refused']}" if c["variant_refused"] else "")
            for c in moe["not_on_adapt_kernel"]
        ]
    calls = {
        name: r[name]["moe_kernel_calls"]
        for name in ("alignment", "alignment_fp32", "bench", "soak")
        if "moe_kernel_calls" in r.get(name, {})
    }
    if calls:
        lines.append(
            f"Calls of adapt's `{MOE_ROUTE_KERNEL}` kernel (once per MoE block forward): "
            + ", ".join(f"{name} {n:,}" for name, n in calls.items())
            + (
                ""
                if all(calls.values())
                else " — **zero in a stage that ran the adapted model: adapt's MoE kernel did not run there**"
            )
        )
    return lines + [""]


def _judged_tokens(excluded: int) -> list[str]:
    """How many tokens the per-tensor verdict rests on once undecidable routing is left out."""
    tokens = ALIGN_BATCH * ALIGN_SEQ
    if not excluded:
        return []
    line = f"tokens judged at the logits: {tokens - excluded} of {tokens} ({excluded} had an expert choice undecidable in bf16)"
    if 2 * excluded > tokens:
        line = (
            f"**{line}: the per-tensor verdict past the first routed block rests on few tokens; the loss parity "
            "(every token) and the float32 patch check (identical routing) are what test the MoE path**"
        )
    return [line]


def _millions(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.3g} M"


def _alignment_lines(al: dict, dtype: str) -> list[str]:
    if "layers" not in al:
        return []
    worst = max(al["layers"], key=lambda l: l["rel_err"] or 0)
    grads = al["gradients"]
    lines = [
        f"## Alignment ({dtype} candidate on the device vs CPU reference)",
        "",
        (
            f"reference {al['reference_dtype']}; passed **{al['passed']}**; first divergent: {al['first_divergent']}; "
            f"{sum(l['passed'] for l in al['layers'])}/{len(al['layers'])} tensors and "
            f"{sum(g['passed'] for g in grads)}/{len(grads)} gradients within limits; worst tensor {worst['name']} "
            f"rel_err {worst['rel_err']:.3g} (cosine {worst['cosine']:.6f}, err_ratio {worst['err_ratio']:.3g})"
        ),
        "",
    ]
    logits = next((l for l in al["layers"] if l["name"] == "logits"), None)
    if logits:
        lines.append(
            f"logits: cosine {logits['cosine']:.6f}, rel_err {logits['rel_err']:.3g}, err_ratio {logits['err_ratio']:.3g}"
        )
        lines += _judged_tokens(logits["excluded_tokens"])
    if al.get("parity"):
        p = al["parity"]
        lines.append(
            f"loss parity over {p['steps']} steps: max relative difference {p['max_rel_diff']:.3g} (tolerance {p['tolerance']})"
        )
    return [*lines, "", "notes:", *summarise_notes(al["notes"]), ""]


def render_markdown(r: dict) -> str:
    title = r.get("title", "the Llama-3.2-1B shape")
    facts = f" ({_millions(r['parameters'])} parameters)" if r.get("parameters") else ""
    lines = [f"# Validation at {title} on {r['device']}", "", f"Shape{facts}: `{json.dumps(r['shape'])}`", ""]
    if r.get("experts_implementation"):
        lines += [f"Unadapted model's experts: transformers `{r['experts_implementation']}`", ""]
    env = r.get("environment", {})
    if "versions" in env:
        lines += [
            f"Versions: `{json.dumps(env['versions'])}`",
            "",
            (
                f"Devices: {', '.join(d['name'] + ' sm_' + d['capability'] for d in env['devices']) or 'none'}; "
                f"copy {env['copy_gbps']:.0f} GB/s, {env['matmul_dtype']} matmul {env['matmul_tflops']:.1f} TFLOP/s; "
                + (
                    f"NCCL all-reduce {env['allreduce_gbps']:.0f} GB/s bus bandwidth; "
                    if env.get("allreduce_gbps")
                    else ""
                )
                + f"problems: {env['problems'] or 'none'}; not checked: {env['unchecked'] or 'nothing'}"
            ),
            "",
        ]
    ops = r.get("operators", {})
    if "components" in ops:
        patched = [c for c in ops["components"] if c["patch"]]
        by_kernel = Counter(f"{c['provider']}/{c['kernel']}" for c in patched if "provider" in c)
        lines += [
            f"Kernel plan: {len(patched)} of {len(ops['components'])} components patched"
            + (": " + ", ".join(f"{n}× {k}" for k, n in by_kernel.most_common()) if by_kernel else ""),
            "",
        ]
        check = ops.get("patch_check")
        if check:
            lines += [
                (
                    f"Patch check (float32, patched vs unpatched model, same weights and tokens): passed **{check['passed']}**; "
                    f"logits max abs diff {check['logits_max_abs_diff']:.3g}, gradient max rel diff {check['grad_max_rel_diff']:.3g}, "
                    f"{check['patched_modules']} modules patched, state dict unchanged {check['state_dict_unchanged']}, "
                    f"reverted exactly {check['reverted_exactly']}"
                ),
                "",
            ]
    lines += _moe_lines(r)
    for name, dtype in (("alignment", "bf16"), ("alignment_fp32", "fp32")):
        lines += _alignment_lines(r.get(name, {}), dtype)
    be = r.get("bench", {})
    if "variants" in be:
        lines += [
            "## Throughput",
            "",
            (
                f"{be['device_name']}, {be['dtype']}, batch {be['batch']} x {be['seq_len']} tokens, "
                f"peak {be['peak_flops'] / 1e12:.0f} TFLOP/s ({be['peak_flops_basis']}), train FLOPs/token {be['train_flops_per_token']:.4g}"
            ),
            "",
            "| variant | train tokens/s | MFU | prefill tokens/s | decode tokens/s | peak memory GiB |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for v in be["variants"]:
            lines.append(
                f"| {v['name']} | {v['train_tokens_per_s']:,.0f} | {v['mfu'] * 100:.1f}% | {v['prefill_tokens_per_s']:,.0f} | "
                f"{v['decode_tokens_per_s']:,.0f} | {v['peak_memory_bytes'] / 2**30:.1f} |"
            )
        lines += ["", "notes:", *summarise_notes(be["notes"]), ""]
    so = r.get("soak", {})
    if "losses" in so:
        losses = so["losses"]
        lines += [
            "## Soak",
            "",
            (
                f"{so['steps_done']}/{so['steps_planned']} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
                f"finite {so['loss_finite']}, step-time CV {so['step_time_cv']:.3f}, drift {so['step_time_drift']:.3f}, "
                f"memory slope {so['memory_slope_bytes_per_step']:.1f} B/step, leak {so['leak']}, checkpoints at {so['checkpoints']}; "
                f"passed **{so['passed']}**"
            ),
            "",
        ]
    stage_names = ("environment", "operators", "alignment", "alignment_fp32", "bench", "soak")
    stage_times = {name: r[name]["wall_s"] for name in stage_names if "wall_s" in r.get(name, {})}
    if stage_times:
        checkpoint = [f"checkpoint {r['checkpoint_s']:.0f}s"] if "checkpoint_s" in r else []
        lines += ["Wall time: " + ", ".join(checkpoint + [f"{name} {s:.0f}s" for name, s in stage_times.items()]), ""]
    for name in stage_names:
        if "error" in r.get(name, {}):
            lines += [f"**{name} failed**: {r[name]['error']}", ""]
    return "\n".join(lines) + "\n"
