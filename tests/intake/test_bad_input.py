"""Every kind of bad input gets exit code 2 and one readable line, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from adapt.app.cli import main
from adapt.core.errors import BadInput
from adapt.model.intake import load_model, resolve_source


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_bad(capsys, argv, *fragments):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (code, out, err)
    lines = [line for line in err.strip().splitlines() if line]
    assert len(lines) == 1 and lines[0].startswith("adapt: error:"), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def clone(zoo, name, tmp_path):
    dst = tmp_path / name
    shutil.copytree(zoo(name), dst)
    return dst


def test_missing_path(capsys, tmp_path):
    assert_bad(capsys, ["inspect", str(tmp_path / "nope")], "no such file or directory")


def test_directory_without_config(capsys, tmp_path):
    assert_bad(capsys, ["inspect", str(tmp_path)], "no config.json")


def test_config_that_does_not_parse(capsys, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", ')
    assert_bad(capsys, ["inspect", str(tmp_path / "config.json")], "not valid JSON", "line 1")


def test_unknown_architecture(capsys, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "hyperwobble", "hidden_size": 8}))
    assert_bad(capsys, ["inspect", str(tmp_path)], "unknown architecture", "hyperwobble")


def test_remote_code_needs_the_flag(capsys, zoo):
    line = assert_bad(capsys, ["inspect", str(zoo("custom"))], "--trust-remote-code")
    assert "ZephyrineForCausalLM" in line and "modeling_zephyrine.py" in line
    code, out, _ = run_cli(capsys, "inspect", str(zoo("custom")), "--trust-remote-code", "--json")
    assert code == 0 and json.loads(out)["model_type"] == "zephyrine"


def test_truncated_safetensors_names_the_file(capsys, zoo, tmp_path):
    ckpt = clone(zoo, "llama", tmp_path)
    shard = ckpt / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert_bad(capsys, ["inspect", str(ckpt)], "model.safetensors", "truncated")


def test_corrupt_safetensors_header(capsys, zoo, tmp_path):
    ckpt = clone(zoo, "llama", tmp_path)
    shard = ckpt / "model.safetensors"
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\x00garbage"
    shard.write_bytes(bytes(data))
    assert_bad(capsys, ["inspect", str(ckpt)], "model.safetensors", "corrupt")


def test_shape_mismatch_names_first_mismatches(capsys, zoo, tmp_path):
    ckpt = clone(zoo, "llama", tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(cfg))
    assert_bad(capsys, ["inspect", str(ckpt)], "do not match the config", "mlp.", "[128, 64]", "[96, 64]")


def test_pickle_only_weights_refused_without_flag(capsys, zoo, tmp_path):
    ckpt = clone(zoo, "llama", tmp_path)
    from safetensors.torch import load_file

    state = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    assert_bad(capsys, ["inspect", str(ckpt)], "pytorch_model.bin", "--allow-pickle")
    # With the flag the weights load (through transformers, weights_only) and match the original.
    model = load_model(resolve_source(str(ckpt), allow_pickle=True))
    assert torch.equal(model.model.embed_tokens.weight, state["model.embed_tokens.weight"])


def test_non_finite_weights_are_refused(zoo, tmp_path):
    ckpt = clone(zoo, "llama", tmp_path)
    from safetensors.torch import load_file, save_file

    state = load_file(ckpt / "model.safetensors")
    state["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan")
    save_file(state, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(BadInput, match="model.layers.1.mlp.up_proj.weight"):
        load_model(resolve_source(str(ckpt)))


def test_uncached_hub_id_while_offline(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    assert_bad(
        capsys,
        ["inspect", "acme/never-seen-7b"],
        "acme/never-seen-7b",
        "not in the Hugging Face cache",
        "HF_HUB_OFFLINE",
    )


def test_cli_subprocess_prints_no_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "adapt", "inspect", str(tmp_path / "missing"), "--json"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("change", "fragments"),
    [
        ({"hidden_size": -1}, ["hidden_size", "-1", "integer >= 1"]),
        ({"num_hidden_layers": 0}, ["num_hidden_layers", "0", "integer >= 1"]),
        (
            {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
            ["hidden_size 64", "num_attention_heads 3", "head_dim"],
        ),
        ({"intermediate_size": -8}, ["intermediate_size", "-8"]),
        ({"num_key_value_heads": 3}, ["num_key_value_heads", "3", "divisor"]),
        ({"vocab_size": "lots"}, ["vocab_size", "'lots'"]),
        ({"hidden_act": 5}, ["transformers rejects", "hidden_act"]),
        ({"rms_norm_eps": "tiny"}, ["transformers rejects", "rms_norm_eps"]),
        ({"rms_norm_eps": float("nan")}, ["rms_norm_eps is NaN"]),
        ({"rope_theta": 0}, ["rope_theta is 0", "finite number > 0"]),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": float("inf")}}, ["rope_theta is inf"]),
        ({"rope_parameters": {"rope_type": "default", "factor": float("nan")}}, ["rope_parameters.factor is NaN"]),
        ({"num_hidden_layers": 1_000_000}, ["num_hidden_layers is 1000000", "up to 10,000"]),
    ],
)
def test_bad_config_values_are_bad_input(capsys, zoo, tmp_path, change, fragments):
    _check_bad_config(capsys, zoo, tmp_path, change, fragments, "inspect")


@pytest.mark.parametrize("command", ["ops", "run", "align", "plan"])
def test_every_command_checks_the_config(capsys, zoo, tmp_path, command):
    _check_bad_config(capsys, zoo, tmp_path, {"rms_norm_eps": "tiny"}, ["transformers rejects"], command)
    _check_bad_config(capsys, zoo, tmp_path / "b", {"num_hidden_layers": 0}, ["num_hidden_layers"], command)


def _check_bad_config(capsys, zoo, tmp_path, change, fragments, command):
    """adapt's own size checks and transformers' own config validation both answer as bad input."""
    ckpt = clone(zoo, "llama", tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **change}))
    extra = ["--out", str(tmp_path / "out")] if command == "run" else []
    assert_bad(capsys, [command, str(ckpt), *extra], "config.json", *fragments)
    assert not (tmp_path / "out" / "stages").exists()  # rejected before any stage


def test_nested_text_config_is_checked(tmp_path):
    from adapt.core.inputs import check_config_values

    with pytest.raises(BadInput, match="text_config: num_hidden_layers is 0"):
        check_config_values({"model_type": "x", "text_config": {"num_hidden_layers": 0}}, "config.json")
    check_config_values({"num_experts": 0, "n_shared_experts": 0, "sliding_window": None}, "config.json")  # 0 = none


def test_input_errors_answer_without_importing_torch(tmp_path):
    """Bad ids, options and configs are rejected before torch (seconds of start-up) is imported."""
    bad_config = tmp_path / "config.json"
    bad_config.write_text(json.dumps({"model_type": "llama", "hidden_size": -1}))
    probe = (
        "import sys\nfrom adapt.app.cli import main\n"
        "codes = [main(a) for a in ({cases})]\n"
        "print(codes, 'torch' in sys.modules, 'transformers' in sys.modules)"
    )
    cases = [
        ["run", "acme//bad"],
        ["inspect", "acme//bad"],
        ["ops", "acme//bad"],
        ["plan", "acme//bad"],
        ["align", "acme//bad"],
        ["soak", "acme//bad", "--steps", "2"],
        ["env", "--plan", str(tmp_path / "none.json")],
        ["train", "acme//bad", "--plan", str(tmp_path / "none.json")],
        ["launch", "acme//bad", "--plan", str(tmp_path / "none.json")],
        ["gate", str(tmp_path / "none.json")],
        ["run", str(bad_config)],
        ["run", str(bad_config.parent), "--stages", "soak"],
        ["run", str(bad_config.parent), "--cluster", "0xH100"],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", probe.format(cases=repr(cases)[1:-1] + ",")], capture_output=True, text=True, check=False
    )
    assert proc.stdout.strip() == f"{[2] * len(cases)} False False", proc.stdout + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


def test_a_size_given_per_layer_is_checked_per_layer(rng):
    """Gemma 3n ships ``intermediate_size`` as one size per layer: accepted while every entry is a positive integer."""
    import random

    from adapt.core.errors import BadInput
    from adapt.core.inputs import check_config_values

    sizes = [rng.randint(1, 4096) for _ in range(rng.randint(2, 40))]
    check_config_values({"model_type": "x", "intermediate_size": sizes}, "config.json")
    bad = sizes.copy()
    bad[random.randrange(len(bad))] = rng.choice([0, -3, 2.5])
    with pytest.raises(BadInput, match="intermediate_size"):
        check_config_values({"model_type": "x", "intermediate_size": bad}, "config.json")
    with pytest.raises(BadInput, match="intermediate_size"):
        check_config_values({"model_type": "x", "intermediate_size": []}, "config.json")


def test_integer_codes_for_floating_weights_are_bad_input(zoo, tmp_path):
    """A quantised file without its quantization_config would load its codes cast to floats, silently."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from adapt.model.intake import inspect

    shutil.copytree(zoo("llama"), tmp_path / "codes")
    weights = load_file(tmp_path / "codes" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = (weights[name] * 127).to(torch.int8)
    save_file(weights, tmp_path / "codes" / "model.safetensors")
    with pytest.raises(BadInput, match=f"1 tensor.*first: {name}, I8 on disk, float32 in the model"):
        inspect(str(tmp_path / "codes"))


def test_a_key_written_twice_in_the_config_is_bad_input(zoo, tmp_path):
    """Which of two values wins is the reader's choice (Python's takes the last): the file is ambiguous."""
    import shutil

    from adapt.model.intake import inspect

    shutil.copytree(zoo("llama"), tmp_path / "twice")
    config = (tmp_path / "twice" / "config.json").read_text()
    (tmp_path / "twice" / "config.json").write_text(config.replace("{", '{"model_type": "gpt2",', 1))
    with pytest.raises(BadInput, match="key 'model_type' appears twice"):
        inspect(str(tmp_path / "twice"))


NOT_UTF8 = b"\xff\xfe\x00 not text"


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{dir}/config.json"],
        ["inspect", "{dir}"],
        ["plan", "{llama}", "--cluster", "{dir}/cluster.yaml"],
        ["plan", "{llama}", "--calibration", "{dir}/calibration.json"],
        ["ops", "{llama}", "--profile", "{dir}/profile.yaml"],
        ["gate", "{dir}/report.json"],
        ["report", "render", "{dir}/report.json"],
        ["train", "{llama}", "--plan", "{dir}/plan.json"],
    ],
    ids=["config", "config-in-dir", "cluster", "calibration", "profile", "report", "render", "plan"],
)
def test_a_file_that_is_not_text_is_bad_input(capsys, zoo, tmp_path, argv):
    """Whatever file a user names, bytes that are not UTF-8 answer as one line naming it, exit 2."""
    for name in ("config.json", "cluster.yaml", "calibration.json", "profile.yaml", "report.json", "plan.json"):
        (tmp_path / name).write_bytes(NOT_UTF8)
    filled = [a.format(dir=tmp_path, llama=zoo("llama")) for a in argv]
    assert_bad(capsys, filled, "not UTF-8 text", "byte 0xff at offset 0")


def test_the_thresholds_file_must_be_text(capsys, zoo, tmp_path):
    (tmp_path / "t.yaml").write_bytes(NOT_UTF8)
    from reports.judge import load_thresholds

    with pytest.raises(BadInput, match=r"thresholds .*t\.yaml: not UTF-8 text"):
        load_thresholds(tmp_path / "t.yaml")


@pytest.mark.parametrize("command", ["inspect", "align"])
def test_a_weight_of_the_wrong_shape_is_named_with_both_shapes(capsys, zoo, tmp_path, command):
    """transformers' own refusal points at a load report its silenced log held: adapt names the tensor instead."""
    from safetensors.torch import load_file, save_file

    ckpt = clone(zoo, "llama", tmp_path)
    weights = load_file(ckpt / "model.safetensors")
    name = next(k for k in weights if k.endswith("q_proj.weight"))
    weights[name] = torch.zeros(3, 3)
    save_file(weights, ckpt / "model.safetensors")
    assert_bad(capsys, [command, str(ckpt)], "weights do not match the config", name, "[3, 3]")
