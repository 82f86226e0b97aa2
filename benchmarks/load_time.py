"""Where the operators stage's "load" phase goes: the checkpoint's read, transformers' loader, the dtype and device.

    python benchmarks/load_time.py OUT.json [--model llama-1b]    # on a GPU; builds the checkpoint under /tmp
    python benchmarks/load_time.py --render OUT.json              # the table again (no GPU)

Each way of loading runs in its own fresh process (imports included, as a user's run pays them), after one
raw read has put the file in the page cache:

* ``raw read``: the safetensors file read into memory (the disk or page cache's rate);
* ``adapt load_model``: the operators stage's own call (fp32 onto the device), with a cProfile summary;
* ``hf bf16 device_map``: transformers' ``from_pretrained`` in the stored dtype straight onto the device;
* ``safetensors to device``: ``safetensors.torch.load_file(device=...)`` alone (no model);
* ``import transformers + config``: the imports and config parsing every load pays first.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.results_files import rerender_if_asked, write_results

CASES = {
    "raw read": "data = open(path + '/model.safetensors', 'rb').read()",
    "import transformers + config": (
        "from transformers import AutoConfig, AutoModelForCausalLM\nAutoConfig.from_pretrained(path)"
    ),
    "safetensors to device": (
        "import torch\ntorch.empty(1, device='cuda')\nfrom safetensors.torch import load_file\n"
        "t0 = time.perf_counter()\nsd = load_file(path + '/model.safetensors', device='cuda')\n"
        "torch.cuda.synchronize()\nparts['transfer'] = time.perf_counter() - t0"
    ),
    "hf bf16 device_map": (
        "import torch\ntorch.empty(1, device='cuda')\nfrom transformers import AutoModelForCausalLM\n"
        "t0 = time.perf_counter()\nm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map='cuda')\n"
        "torch.cuda.synchronize()\nparts['from_pretrained'] = time.perf_counter() - t0\n"
        "t0 = time.perf_counter()\nm.float()\ntorch.cuda.synchronize()\nparts['widen'] = time.perf_counter() - t0"
    ),
    "adapt load_model": (
        "import torch, cProfile, pstats, io\ntorch.empty(1, device='cuda')\n"
        "from adapt.model.intake import resolve_source, load_model\n"
        "t0 = time.perf_counter()\nsrc = resolve_source(path)\nparts['resolve'] = time.perf_counter() - t0\n"
        "prof = cProfile.Profile()\nt0 = time.perf_counter()\nprof.enable()\n"
        "m = load_model(src, dtype=torch.float32, device='cuda')\ntorch.cuda.synchronize()\nprof.disable()\n"
        "parts['load_model'] = time.perf_counter() - t0\nbuf = io.StringIO()\n"
        "pstats.Stats(prof, stream=buf).sort_stats('cumulative').print_stats(30)\n"
        "parts['profile'] = buf.getvalue()[-6000:]"
    ),
}


def run_case(code: str, path: str) -> dict:
    script = (
        "import json, sys, time\nstart = time.perf_counter()\nparts = {}\n"
        f"path = {path!r}\n{code}\nparts['total'] = time.perf_counter() - start\nprint('RESULT' + json.dumps(parts))"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[len("RESULT") :])
    return {"error": proc.stderr[-2000:]}


def render(results: dict) -> str:
    """A short table: each case's process time and the parts it timed itself (seconds)."""
    lines = [
        f"# Loading the {results['model']} checkpoint ({results['bytes'] / 2**30:.2f} GiB), one process per way",
        "",
        "| way | process s | timed parts (s) |",
        "| --- | --- | --- |",
    ]
    for name, case in results["cases"].items():
        parts = ", ".join(f"{k} {v:.2f}" for k, v in case.items() if isinstance(v, float) and k != "process_s")
        lines.append(f"| {name} | {case.get('process_s', 0):.2f} | {parts or case.get('error', '')[:200]} |")
    if results.get("note"):
        lines += ["", results["note"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if rerender_if_asked(argv, render):
        return 0
    model = argv[argv.index("--model") + 1] if "--model" in argv else "llama-1b"
    ckpt = Path("/tmp/load-time") / model
    if not (ckpt / "model.safetensors").is_file():
        from benchmarks.shapes import build_checkpoint

        build_checkpoint(model, ckpt, device="cuda")
    results = {"model": model, "bytes": (ckpt / "model.safetensors").stat().st_size, "cases": {}}
    for name, code in CASES.items():
        started = time.perf_counter()
        results["cases"][name] = {**run_case(code, str(ckpt)), "process_s": time.perf_counter() - started}
        print(name, {k: v for k, v in results["cases"][name].items() if k != "profile"}, flush=True)
    print(results["cases"]["adapt load_model"].get("profile", ""))
    write_results(argv[0], results, render)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
