"""Property: whatever a user feeds adapt, it answers with exit 0, 1 or 2 and never a traceback.

Hypothesis mutates a model's config.json, a cluster file and the command-line options.  For every
draw: the exit code is 0, 1 or 2; nothing on stderr is a traceback; exit 2 is exactly one line
``adapt: error: ...``; and no input file changed.  The CLI runs in this process (no start-up cost)
with few examples per property, so the whole module stays within about a minute.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adapt.app.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"
PROPERTY_SETTINGS = settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture], derandomize=False
)

ODD_VALUES = st.one_of(
    st.integers(-3, 300),
    st.sampled_from([0, 1, -1, 2**40]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-2, 4), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
_counter = itertools.count()


def _digest(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode() + file.read_bytes())
    return digest.hexdigest()


def _cli(capsys, argv: list[str]) -> tuple[int, str]:
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own rejections
        code = int(exit_.code or 0)
    return code, capsys.readouterr().err


def _assert_answered(code: int, err: str, argv: list[str]) -> None:
    assert code in (0, 1, 2), (code, argv, err[-2000:])
    assert "Traceback" not in err, (argv, err[-2000:])
    if code == 2:
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("adapt: error:"), (argv, err)


@pytest.fixture(scope="module")
def spec_json(tmp_path_factory) -> Path:
    """The example's ModelSpec as JSON, so planning needs no torch work per draw."""
    from adapt.model.intake import inspect

    path = tmp_path_factory.mktemp("spec") / "spec.json"
    path.write_text(inspect(str(EXAMPLE), config_only=True).to_json())
    return path


@PROPERTY_SETTINGS
@given(
    key=st.sampled_from(
        [
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "intermediate_size",
            "vocab_size",
            "max_position_embeddings",
            "head_dim",
            "rms_norm_eps",
            "hidden_act",
            "tie_word_embeddings",
            "model_type",
            "architectures",
        ]
    ),
    value=ODD_VALUES,
    delete=st.booleans(),
)
def test_mutated_config(capsys, tmp_path, key, value, delete):
    work = tmp_path / f"cfg{next(_counter)}"
    work.mkdir()
    config = json.loads((EXAMPLE / "config.json").read_text())
    if delete:
        config.pop(key, None)
    else:
        config[key] = value
    path = work / "config.json"
    path.write_text(json.dumps(config))
    before = _digest(work)
    argv = ["inspect", str(path), "--json"]
    code, err = _cli(capsys, argv)
    _assert_answered(code, err, argv)
    assert _digest(work) == before


GPU_FIELDS = ["memory_gib", "bf16_tflops", "fp8_tflops", "hbm_gbps", "intra_node_gbps", "inter_node_gbps",
              "gpus_per_node", "gemm_ceiling", "pcie_gbps"]  # fmt: skip


@PROPERTY_SETTINGS
@given(
    where=st.sampled_from(["gpus", "gpus_per_node", "gpu", "overrides", "gpu_mapping", "extra"]),
    field=st.sampled_from(GPU_FIELDS),
    value=ODD_VALUES,
    suffix=st.sampled_from([".yaml", ".toml"]),
)
def test_mutated_cluster_file(capsys, tmp_path, spec_json, where, field, value, suffix):
    data: dict = {"gpu": "h100", "gpus": 16, "gpus_per_node": 8}
    if where == "gpu_mapping":
        data["gpu"] = {"name": "x1", "memory_gib": 96, "bf16_tflops": 500, "fp8_tflops": 0, "hbm_gbps": 3000,
                       "intra_node_gbps": 300, "inter_node_gbps": 50, "gpus_per_node": 8, "gemm_ceiling": 0.7,
                       field: value}  # fmt: skip
    elif where == "overrides":
        data["overrides"] = {field: value}
    elif where == "extra":
        data[str(value)[:8] or "x"] = 1
    else:
        data[where] = value
    path = tmp_path / f"cluster{next(_counter)}{suffix}"
    if suffix == ".toml":
        lines = [f"{k} = {json.dumps(v)}" for k, v in data.items() if not isinstance(v, dict) and v is not None]
        for k, v in data.items():
            if isinstance(v, dict):
                lines.append(f"[{k}]")
                lines += [f"{kk} = {json.dumps(vv)}" for kk, vv in v.items() if vv is not None]
        path.write_text("\n".join(lines) + "\n")
    else:
        path.write_text(yaml.safe_dump(data))
    before, spec_before = _digest(path), _digest(spec_json)
    argv = ["plan", str(spec_json), "--cluster", str(path), "--global-batch", "16", "--plan-seq-len", "256", "--json"]
    code, err = _cli(capsys, argv)
    _assert_answered(code, err, argv)
    assert _digest(path) == before and _digest(spec_json) == spec_before


@pytest.fixture(scope="module")
def example_copy(tmp_path_factory) -> Path:
    return Path(shutil.copytree(EXAMPLE, tmp_path_factory.mktemp("src") / "tiny-llama"))


INT_FLAGS = ["--seq-len", "--batch-size", "--bench-steps", "--soak-steps", "--ckpt-every", "--plan-seq-len",
             "--global-batch"]  # fmt: skip


@PROPERTY_SETTINGS
@given(
    stages=st.lists(st.sampled_from(["intake", "plan", "soak", "alignment", "report", "typo", ""]), max_size=3),
    skip=st.lists(st.sampled_from(["intake", "plan", "operators", "nonsense"]), max_size=2),
    cluster=st.one_of(
        st.sampled_from(["8xH100", "0xH100", "8xFOO", "-1xa100", "3xh200", "banana", "", "x", "local"]),
        st.builds(lambda n, g: f"{n}x{g}", st.integers(-2, 9), st.sampled_from(["h100", "a100", "tpu"])),
    ),
    ints=st.dictionaries(st.sampled_from(INT_FLAGS), st.integers(-3, 9) | st.text(max_size=3), max_size=3),
    dtype=st.sampled_from([None, "fp32", "bf16", "fp64", ""]),
    device=st.sampled_from([None, "cpu", "gpu", "cuda:x"]),
)
def test_mutated_run_options(capsys, tmp_path, example_copy, stages, skip, cluster, ints, dtype, device):
    # Only stages that finish in seconds can be selected validly; everything else must be refused up front.
    argv = ["run", str(example_copy), "--out", str(tmp_path / f"run{next(_counter)}"), "--quiet", "--cluster", cluster]
    argv += ["--stages", ",".join(stages) or "intake"]
    if skip:
        argv += ["--skip", ",".join(skip)]
    for flag, value in ints.items():
        argv += [flag, str(value)]
    if dtype is not None:
        argv += ["--dtype", dtype]
    if device is not None:
        argv += ["--device", device]
    before = _digest(example_copy)
    code, err = _cli(capsys, argv)
    _assert_answered(code, err, argv)
    assert _digest(example_copy) == before
